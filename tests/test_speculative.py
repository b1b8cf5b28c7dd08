"""Greedy speculative decoding is lossless: token-identical to plain greedy decoding.

Random drafters accept almost nothing, so the loop is also driven with injected proposals
(the plain greedy continuation with a wrong token at a chosen slot), which reach every
acceptance length 0..nd.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax
from dflash_jax.decoding import speculative as spec
from conftest import assert_long_prompts_decode_as_the_uncached_forward, inject_reference, tiny_drafter

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [1, 2, 3], list(range(12, 40))]
MAX_NEW = 24


@pytest.fixture(scope="module")
def plain(target):
    return dflash_jax.generate(target, None, PROMPTS, max_new_tokens=MAX_NEW).tokens


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_greedy_speculative_equals_plain_for_block_sizes(target, plain, block_size):
    drafter = tiny_drafter(target, block_size)
    out = dflash_jax.generate(target, drafter, PROMPTS, max_new_tokens=MAX_NEW)
    assert out.tokens == plain, f"block size {block_size}: speculative output differs from plain greedy"
    st, nd = out.stats, block_size - 1
    # every token but a row's first (chosen at prefill) is committed by a round; a round commits its m accepted
    # drafts and the target's token, except a row's last round, cut at max_new_tokens
    assert st.per_row["committed"] == [MAX_NEW - 1] * len(PROMPTS), st.per_row
    assert st.acceptance_length == pytest.approx(len(PROMPTS) * (MAX_NEW - 1) / st.rounds, rel=1e-12)
    assert st.drafted == nd * st.rounds and sum(st.accept_hist) == st.rounds, st
    assert st.accepted == sum(m * n for m, n in enumerate(st.accept_hist)), st
    for rounds, accepted, committed in zip(*(st.per_row[k] for k in ("rounds", "accepted", "committed"))):
        assert 0 <= accepted + rounds - committed <= nd, f"only a row's last round may be cut: {st.per_row}"


def test_batch_of_one_equals_plain(target, plain):
    out = dflash_jax.generate(target, tiny_drafter(target, 4), PROMPTS[2:], max_new_tokens=MAX_NEW)
    assert out.tokens == plain[2:]


@functools.partial(jax.jit, static_argnums=0)
def _draft_logits(loop, target, drafter, state):
    return loop.propose(target, drafter, state).logits


def _drafts_with_shifted_context(target, drafter, *below):
    """The drafter's logits for the first block after PROMPTS, once per `below`: with layer 0's context K/V at
    positions < below[b] shifted by 5 (row b)."""
    session = dflash_jax.Session(target, drafter, PROMPTS, max_new_tokens=MAX_NEW)
    ds, out = session.state.drafter_state, []
    for rows in below:
        hit = jnp.arange(ds.capacity)[None, :, None, None] < jnp.asarray(rows)[:, None, None, None]
        shifted = ds.replace(k=(jnp.where(hit, ds.k[0] + 5, ds.k[0]), *ds.k[1:]),
                             v=(jnp.where(hit, ds.v[0] + 5, ds.v[0]), *ds.v[1:]))
        out.append(np.asarray(_draft_logits(session.loop, target, drafter, session.state.replace(
            drafter_state=shifted))))
    return out


@pytest.mark.parametrize("causal", [True, False], ids=["sliding_causal", "sliding_symmetric"])
def test_sliding_window_drafter_with_context_longer_than_window(target, plain, causal):
    """Window 4 < prompt lengths up to 28: the window is applied, not refused. Applied means: context the window
    hides (positions <= seq_len - 4, before every block row's window) does not move the drafts at all, and the same
    weights without the window do see it."""
    drafter = tiny_drafter(target, 8, windows=(4, None), causal=(causal, False))
    nd = drafter.config.n_drafts
    out = dflash_jax.generate(target, drafter, PROMPTS, max_new_tokens=MAX_NEW)
    assert out.tokens == plain
    injected = dflash_jax.Session(target, drafter, PROMPTS, max_new_tokens=MAX_NEW,
                                  inject=inject_reference(plain, MAX_NEW, nd, [1] * (nd + 1))).run()
    assert injected.tokens == plain

    lengths = np.array([len(p) for p in PROMPTS])
    hidden = np.maximum(lengths - 4 + 1, 0)  # rows 0 and 2 have hidden context; row 1 (3 tokens) has none
    clean, shift_hidden, shift_all = _drafts_with_shifted_context(target, drafter, 0 * lengths, hidden, lengths)
    np.testing.assert_array_equal(shift_hidden, clean, err_msg="context outside the window changed the drafts")
    assert all(np.abs(shift_all[i] - clean[i]).max() > 1e-3 for i in range(len(PROMPTS))), "the shift is too small"
    full = tiny_drafter(target, 8, windows=(None, None), causal=(causal, False))
    clean, shift_hidden = _drafts_with_shifted_context(target, full, 0 * lengths, hidden)
    moved = np.abs(shift_hidden - clean).max(axis=(1, 2))
    assert (moved > 1e-3).tolist() == (hidden > 0).tolist(), f"without the window the same shift moves rows {moved}"


def test_injected_proposals_reach_every_acceptance_length_and_stay_exact(target, plain):
    drafter = tiny_drafter(target, 8)
    nd = drafter.config.n_drafts
    out = dflash_jax.Session(target, drafter, PROMPTS * 4, max_new_tokens=MAX_NEW,
                             inject=inject_reference(plain * 4, MAX_NEW, nd, [1] * (nd + 1))).run()
    assert out.tokens == plain * 4, "output must not depend on what was proposed"
    hist = out.stats.accept_hist
    assert all(h > 0 for h in hist), f"every acceptance length 0..{nd} must occur; histogram {hist}"


@pytest.mark.parametrize("wrong_slot, tau", [(0, 1.0), (3, 4.0), (None, 8.0)])
def test_acceptance_length_follows_the_first_wrong_slot(target, plain, wrong_slot, tau):
    drafter = tiny_drafter(target, 8)
    nd = drafter.config.n_drafts
    probs = np.zeros(nd + 1)
    probs[nd if wrong_slot is None else wrong_slot] = 1
    out = dflash_jax.Session(target, drafter, PROMPTS, max_new_tokens=MAX_NEW,
                             inject=inject_reference(plain, MAX_NEW, nd, probs)).run()
    assert out.tokens == plain
    hist = np.asarray(out.stats.accept_hist)
    accepted = nd if wrong_slot is None else wrong_slot
    # every round accepts `accepted` drafts except a last one cut short by max_new_tokens
    assert hist[accepted] >= out.stats.rounds - len(PROMPTS), f"histogram {hist.tolist()}"
    assert out.stats.acceptance_length == pytest.approx(tau, rel=0.25)


def test_stop_token_inside_an_accepted_span(target, plain):
    drafter = tiny_drafter(target, 8)
    nd = drafter.config.n_drafts
    stop = plain[0][5]  # the 6th token: mid-block when every draft is accepted
    expected = [row[: row.index(stop) + 1] if stop in row else row for row in plain]
    out = dflash_jax.Session(target, drafter, PROMPTS, max_new_tokens=MAX_NEW, stop_tokens=[stop],
                             inject=inject_reference(plain, MAX_NEW, nd, [0] * nd + [1])).run()
    assert out.tokens == expected


def test_max_new_tokens_ending_mid_block(target, plain):
    drafter = tiny_drafter(target, 8)
    nd = drafter.config.n_drafts
    out = dflash_jax.Session(target, drafter, PROMPTS, max_new_tokens=11,
                             inject=inject_reference(plain, MAX_NEW, nd, [0] * nd + [1])).run()
    assert out.tokens == [row[:11] for row in plain]


def test_session_bursts_equal_one_generate_call(target, plain):
    drafter = tiny_drafter(target, 4)
    nd = drafter.config.n_drafts
    inject = inject_reference(plain, MAX_NEW, nd, [1] * (nd + 1))
    whole = dflash_jax.Session(target, drafter, PROMPTS, max_new_tokens=MAX_NEW, inject=inject).run()
    session = dflash_jax.Session(target, drafter, PROMPTS, max_new_tokens=MAX_NEW, inject=inject)
    got = [[] for _ in PROMPTS]
    sizes = []
    while not session.finished:
        burst = session.burst(5)
        sizes.append(max(len(t) for t in burst.tokens))
        for row, new in zip(got, burst.tokens):
            row.extend(new)
    assert got == whole.tokens == plain
    assert max(sizes) <= 5, f"a burst must not return more than n tokens per row; sizes {sizes}"
    np.testing.assert_array_equal(session.position, [len(p) + MAX_NEW - 1 for p in PROMPTS])


def test_session_refuses_prompt_beyond_capacity(target):
    with pytest.raises(ValueError, match=r"capacity 32 is too small.*needs 4[0-9]"):
        dflash_jax.Session(target, tiny_drafter(target, 4), [list(range(1, 30))], max_new_tokens=8, capacity=32)


def test_drafter_that_does_not_fit_the_target_is_refused(target):
    drafter = tiny_drafter(target, 4, tap_ids=(0, 7))
    with pytest.raises(ValueError, match=r"target_layer_ids \[0, 7\] name layers \[7\]"):
        dflash_jax.generate(target, drafter, PROMPTS, max_new_tokens=4)


def test_propose_returns_the_drafters_block(target):
    drafter = tiny_drafter(target, 8)
    p = dflash_jax.propose(target, drafter, PROMPTS)
    nd, v = drafter.config.n_drafts, target.config.vocab_size
    assert p.tokens.shape == (3, nd) and p.logits.shape == (3, nd, v) and p.logits.dtype == np.float32
    np.testing.assert_array_equal(p.tokens, p.logits.argmax(-1))


def test_injected_proposals_still_pay_for_the_drafter(target, plain):
    """Benchmarks inject proposals to control acceptance; the drafter must still run (not be
    removed as dead code), or the measured rounds would be too cheap."""
    drafter = tiny_drafter(target, 4)
    nd = drafter.config.n_drafts

    def dots(inject):
        s = dflash_jax.Session(target, drafter, PROMPTS, max_new_tokens=MAX_NEW, inject=inject)
        return spec.run.lower(s.loop, target, drafter, s.state, s.stop_tokens).compile().as_text().count(" dot(")

    assert dots(inject_reference(plain, MAX_NEW, nd, [1] * (nd + 1))) >= dots(None) > 0


@pytest.mark.parametrize("injected, sampling", [
    (False, dflash_jax.Sampling()), (True, dflash_jax.Sampling()),
    (False, dflash_jax.Sampling(temperature=0.8, top_k=8, top_p=0.9, min_p=0.05, proposal="sample")),
])
def test_the_round_loop_has_no_nested_loop(target, plain, injected, sampling):
    """On a GPU every while loop iteration waits for its predicate on the host; a loop nested in
    the round (random.choice's searchsorted was one) costs a host sync per inner iteration.
    Lowered for CUDA (no GPU needed): on the CPU, threefry itself lowers to loops."""
    drafter = tiny_drafter(target, 4)
    nd = drafter.config.n_drafts
    inject = inject_reference(plain, MAX_NEW, nd, [1] * (nd + 1)) if injected else None
    s = dflash_jax.Session(target, drafter, PROMPTS, max_new_tokens=MAX_NEW, inject=inject, sampling=sampling)
    traced = spec.run.trace(s.loop, target, drafter, s.state, s.stop_tokens)
    hlo = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert hlo.count("stablehlo.while") == 1, "the speculative loop must be the only loop"


def test_verify_cap_bounds_acceptance_but_not_the_output(target, plain):
    drafter = tiny_drafter(target, 8)
    nd = drafter.config.n_drafts
    out = dflash_jax.Session(target, drafter, PROMPTS, max_new_tokens=MAX_NEW, verify_t=3,
                             inject=inject_reference(plain, MAX_NEW, nd, [0] * nd + [1])).run()
    assert out.tokens == plain
    hist = out.stats.accept_hist
    assert sum(hist[3:]) == 0 and hist[2] > 0, f"vt=3 examines at most 2 drafts; histogram {hist}"
    widths = []
    extend = type(target).extend

    def recording_extend(self, state, block, *args, **kwargs):
        widths.append(block.shape[1])
        return extend(self, state, block, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(target), "extend", recording_extend)
        session = dflash_jax.Session(target, drafter, PROMPTS, max_new_tokens=MAX_NEW, verify_t=3)
        widths.clear()  # the prefill's chunks
        spec.run.trace(session.loop, target, drafter, session.state, session.stop_tokens)
    assert widths == [3], f"a cap of 3 verifies a block of 3 rows, not {nd + 1}; the loop traced widths {widths}"
    with pytest.raises(ValueError, match=r"verify cap must be an integer in 2\.\.8"):
        dflash_jax.Session(target, drafter, PROMPTS, max_new_tokens=MAX_NEW, verify_t=9)
    with pytest.raises(ValueError, match=r"verify_t .* plain decoding \(drafter=None\) has none"):
        dflash_jax.generate(target, None, PROMPTS, max_new_tokens=MAX_NEW, verify_t=3)


def test_chunked_prefill_of_long_ragged_prompts_matches_the_uncached_forward(target):
    """Prompts longer than one prefill chunk (512) go in several chunks; rows of very different
    lengths share them. Greedy tokens must equal the argmax of the full uncached forward."""
    assert_long_prompts_decode_as_the_uncached_forward(target, tiny_drafter(target, 4))


def test_stop_token_chosen_at_prefill_ends_the_row_at_once(target, plain):
    stop = plain[0][0]
    out = dflash_jax.generate(target, tiny_drafter(target, 4), PROMPTS, max_new_tokens=MAX_NEW, stop_tokens=[stop])
    expected = [row[: row.index(stop) + 1] if stop in row else row for row in plain]
    assert out.tokens == expected and out.tokens[0] == [stop]


def test_plain_greedy_with_penalties_matches_a_reference_loop(target):
    """Penalties count the prompt and every generated token (Hugging Face semantics)."""
    prompt = [5, 6, 7, 5, 6]
    s = dflash_jax.Sampling(repetition_penalty=1.8, frequency_penalty=0.3, presence_penalty=0.2)
    got = dflash_jax.generate(target, None, [prompt], max_new_tokens=8, sampling=s).tokens[0]
    seq = prompt + got
    logits = np.asarray(target.full_logits([seq]), np.float64)[0]  # teacher-forced: one forward for every step
    for k in range(8):
        z = logits[len(prompt) - 1 + k].copy()
        counts = np.bincount(seq[:len(prompt) + k], minlength=z.size)
        seen = counts > 0
        z[seen] = np.where(z[seen] > 0, z[seen] / 1.8, z[seen] * 1.8)
        z -= 0.3 * counts + 0.2 * seen
        assert got[k] == int(z.argmax()), f"token {k}: {got[k]} != the penalised argmax {int(z.argmax())}"
    assert got != dflash_jax.generate(target, None, [prompt], max_new_tokens=8).tokens[0], "penalties must matter"
    with pytest.raises(ValueError, match="speculative decoding does not support penalties"):
        dflash_jax.generate(target, tiny_drafter(target, 4), [prompt], max_new_tokens=8, sampling=s)


def test_mixed_proposal_kinds_in_one_batch_are_refused(target):
    rows = [dflash_jax.Sampling(temperature=1.0), dflash_jax.Sampling(temperature=1.0, proposal="sample")]
    with pytest.raises(ValueError, match=r"proposal must be the same for every row.*\['argmax', 'sample'\]"):
        dflash_jax.Session(target, tiny_drafter(target, 4), PROMPTS[:2], max_new_tokens=4, sampling=rows)


def test_float32_models_ask_for_full_float32_products_and_bf16_ones_keep_the_default(target):
    """A GPU rounds float32 products through TF32 unless asked for HIGHEST, and a 16-row verify then rounds a
    near-tie apart from a one-row step (on the H200 the demo pair's HumanEval outputs differed from plain)."""
    drafter = tiny_drafter(target, 4)
    for dtype, exact in ((jnp.float32, True), (jnp.bfloat16, False)):
        t, d = (m.replace(params=jax.tree.map(lambda x: x.astype(dtype), m.params)) for m in (target, drafter))
        programs = [jax.jit(lambda tok: t.forward(tok, d.tap_ids)).lower(jnp.zeros((1, 6), jnp.int32)).as_text(),
                    jax.jit(d.train_hidden).lower(jnp.zeros((1, 6, 2 * 32), dtype), jnp.zeros((1, 1, 4, 32), dtype),
                                                  jnp.ones((1, 1), jnp.int32)).as_text()]
        for hlo in programs:
            products = hlo.count("dot_general")
            assert products > 0
            assert hlo.count("HIGHEST") == (2 * products if exact else 0), f"{dtype.__name__}: every product's precision"
