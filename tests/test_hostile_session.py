"""Careless callers of a Session, and targets whose logits stop being finite (issue 20, items 9 and 2).

Sampled sessions resumed burst by burst must give exactly the tokens, and the counts, of one
`generate` call with the same seed. Burst sizes are checked, never wrapped. Threads may share a
session. A row whose target logits are not finite stops, is flagged in the stats, and `generate`
raises naming the row and the position, in plain and speculative decoding alike.
"""
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax
from dflash_jax import sampling as smp
from dflash_jax.config import DrafterConfig, RopeConfig
from dflash_jax.decoding import plain as plain_mod
from dflash_jax.decoding.common import check_capacity, pack_prompts, stop_array
from dflash_jax.io.checkpoints import make_drafter
from dflash_jax.targets.dense import DenseTarget
from conftest import drafter_param_shapes, inject_reference, random_params, tiny_drafter

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [1, 2, 3], list(range(12, 30))]
MAX_NEW = 20
COUNTS = ("generated", "rounds", "committed", "drafted", "accepted", "accept_hist", "slot_accepted", "per_row")


@pytest.fixture(scope="module")
def drafter(target):
    return tiny_drafter(target, 4)  # 3 drafts a round: bursts of 3 and 7 end inside rounds


def by_bursts(session, sizes):
    """Every row's tokens, gathered burst by burst with sizes cycling through `sizes`."""
    got = [[] for _ in range(len(session.position))]
    i = 0
    while not session.finished:
        burst = session.burst(sizes[i % len(sizes)])
        assert all(len(t) <= sizes[i % len(sizes)] for t in burst.tokens), "a burst returns at most n tokens a row"
        for row, new in zip(got, burst.tokens):
            row.extend(new)
        i += 1
    return got


# --- item 9: sampled sessions resumed burst by burst ---------------------------------------------


@pytest.mark.parametrize("temperature, proposal", [(0.0, "argmax"), (0.7, "sample"), (1.0, "sample"),
                                                   (1.0, "argmax")])
def test_bursts_give_the_tokens_and_counts_of_one_generate_call(target, drafter, temperature, proposal):
    """Ragged batch of 3; sizes 1, 3 and 7 against a 4-row block, and a mixed sequence of sizes.
    Drawn proposals ("sample") from the tiny random pair accept often, so bursts end inside rounds."""
    sampling = dflash_jax.Sampling(temperature=temperature, seed=11, proposal=proposal)
    whole = dflash_jax.generate(target, drafter, PROMPTS, max_new_tokens=MAX_NEW, sampling=sampling)
    if temperature > 0 and proposal == "sample":
        assert max(whole.stats.accept_hist[1:]) > 0, "rounds must accept drafts, or no burst ends inside a round"
    for sizes in ([1], [3], [7], [2, 5, 1, 3]):
        session = dflash_jax.Session(target, drafter, PROMPTS, max_new_tokens=MAX_NEW, sampling=sampling)
        got = by_bursts(session, sizes)
        assert got == whole.tokens, f"T={temperature} {proposal}, bursts {sizes}: tokens differ from one call"
        stats = session.stats
        assert [getattr(stats, k) for k in COUNTS] == [getattr(whole.stats, k) for k in COUNTS], \
            f"bursts {sizes}: a burst boundary must not change the rounds run"


def test_burst_counts_add_up_to_the_run(target, drafter):
    sampling = dflash_jax.Sampling(temperature=1.0, seed=4, proposal="sample")
    whole = dflash_jax.generate(target, drafter, PROMPTS, max_new_tokens=MAX_NEW, sampling=sampling).stats
    session = dflash_jax.Session(target, drafter, PROMPTS, max_new_tokens=MAX_NEW, sampling=sampling)
    bursts = []
    while not session.finished:
        bursts.append(session.burst(3))
    assert sum(b.rounds for b in bursts) == whole.rounds
    assert sum(b.drafted for b in bursts) == whole.drafted
    assert sum(b.accepted for b in bursts) == whole.accepted
    assert [b.start for b in bursts[:2]] == [[0, 0, 0], [3, 3, 3]], "start says where a burst's tokens go"


def tiny_dspark_budget(target):
    """A DSpark drafter whose batch verify budget couples the rows: a row's verify width depends on
    which other rows run the round."""
    tc = target.config
    cfg = DrafterConfig(family="dspark", hidden_size=tc.hidden_size, intermediate_size=2 * tc.hidden_size,
                        num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6,
                        rope=RopeConfig(1e4), block_size=5, mask_token_id=tc.vocab_size - 1, target_layer_ids=(0, 2),
                        layer_window=(None,), causal=(False,), harvest="dspark", vocab_size=tc.vocab_size,
                        markov_rank=8, confidence_in_dim=tc.hidden_size + 8, verify_policy="confidence-slot",
                        verify_tau=0.3, markov=True, verify_budget=5)
    return make_drafter(cfg, random_params(drafter_param_shapes(cfg), 1, scale=0.4))


def test_bursts_keep_a_batch_coupled_verify_budget_exact(target):
    """Rows pausing at a burst's end would change the other rows' share of the budget."""
    drafter = tiny_dspark_budget(target)
    sampling = dflash_jax.Sampling(temperature=1.0, seed=5, proposal="sample")
    whole = dflash_jax.generate(target, drafter, PROMPTS, max_new_tokens=MAX_NEW, sampling=sampling)
    for sizes in ([1], [3], [4, 2]):
        session = dflash_jax.Session(target, drafter, PROMPTS, max_new_tokens=MAX_NEW, sampling=sampling)
        assert by_bursts(session, sizes) == whole.tokens, f"bursts {sizes}"
        assert [getattr(session.stats, k) for k in COUNTS] == [getattr(whole.stats, k) for k in COUNTS]


def test_bursts_with_a_stop_token_match_one_call(target, drafter):
    sampling = dflash_jax.Sampling(temperature=0.7, seed=2, proposal="sample")
    free = dflash_jax.generate(target, drafter, PROMPTS, max_new_tokens=MAX_NEW, sampling=sampling).tokens
    stop = free[0][6]
    whole = dflash_jax.generate(target, drafter, PROMPTS, max_new_tokens=MAX_NEW, sampling=sampling,
                                stop_tokens=[stop]).tokens
    assert len(whole[0]) <= 7, "the stop token must end row 0"
    for n in (1, 3, 7):
        session = dflash_jax.Session(target, drafter, PROMPTS, max_new_tokens=MAX_NEW, sampling=sampling,
                                     stop_tokens=[stop])
        assert by_bursts(session, [n]) == whole, f"bursts of {n}"


# --- item 9: burst sizes and threads ------------------------------------------------------------


@pytest.mark.parametrize("bad", [True, np.bool_(True), 0, -3, 2.0, "4", None, np.float32(3)])
def test_burst_refuses_sizes_that_are_not_positive_integers(target, drafter, bad):
    session = dflash_jax.Session(target, drafter, PROMPTS, max_new_tokens=MAX_NEW)
    with pytest.raises(ValueError, match=r"burst size must be a positive integer; got"):
        session.burst(bad)


@pytest.mark.parametrize("size", [2**31, 2**32 + 5, np.int64(2**40), MAX_NEW + 1])
def test_burst_past_the_remaining_tokens_is_clamped_not_wrapped(target, drafter, size):
    whole = dflash_jax.generate(target, drafter, PROMPTS, max_new_tokens=MAX_NEW).tokens
    session = dflash_jax.Session(target, drafter, PROMPTS, max_new_tokens=MAX_NEW)
    assert session.burst(3).tokens == [row[:3] for row in whole]
    assert session.burst(size).tokens == [row[3:] for row in whole], "a size past the end runs to the end"
    assert session.finished
    assert session.burst(size).tokens == [[], [], []], "a finished session has nothing left to give"


@pytest.mark.parametrize("threads", [2, 4])
def test_threads_bursting_one_session_get_one_calls_tokens_between_them(target, drafter, threads):
    sampling = dflash_jax.Sampling(temperature=1.0, seed=9, proposal="sample")
    whole = dflash_jax.generate(target, drafter, PROMPTS, max_new_tokens=MAX_NEW, sampling=sampling).tokens
    session = dflash_jax.Session(target, drafter, PROMPTS, max_new_tokens=MAX_NEW, sampling=sampling)
    bursts, errors = [], []

    def work(n):
        try:
            while not session.finished:
                bursts.append(session.burst(n))
        except Exception as e:  # any failure in a thread fails the test
            errors.append(e)

    pool = [threading.Thread(target=work, args=(1 + i % 3,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert not errors, f"bursting from {threads} threads raised {errors!r}"
    got = [[None] * len(row) for row in whole]
    for b in bursts:
        for row, start, new in zip(got, b.start, b.tokens):
            assert all(x is None for x in row[start: start + len(new)]), "no token is handed out twice"
            row[start: start + len(new)] = new
    assert got == whole, "the threads' bursts must tile one generate call's tokens"


# --- item 2, run time: target logits that are not finite ----------------------------------------

POISON_AT = 25
FAR = 10**6  # a NanAfter that never poisons: the clean reference, from the same compiled program
LONG = list(range(1, 21))  # 20 tokens: position 25 gives the logits of its generated token 6
SHORT = [7, 8, 9]  # never reaches position 25 within 12 new tokens and a verify block
NAN_TOKEN = 6
NAN_MESSAGE = r"not finite.*: row 1 at generated token 6 \(logits at sequence position 25\)\. The checkpoint"


class NanAfter(DenseTarget):
    """The tiny target with hidden states NaN from sequence position `poison_at` on (as an overflow
    late in a long context would make them), finite before."""

    poison_at: jax.Array

    def extend(self, state, tokens, start, tap_ids=(), impl="xla", valid=None):
        h, taps, state, pending = super().extend(state, tokens, start, tap_ids, impl, valid)
        pos = start[:, None] + jnp.arange(tokens.shape[1])[None, :]
        return jnp.where((pos >= self.poison_at)[..., None], jnp.nan, h), taps, state, pending


def nan_after(target, at):
    return NanAfter(config=target.config, params=target.params, poison_at=jnp.int32(at))


def plain_state(target, prompts, max_new, sampling):
    """Plain decoding's final carry (the loop under `generate`, which raises)."""
    c = target.config
    p = pack_prompts(prompts, c.vocab_size)
    cap = check_capacity(p, max_new, c.max_position_embeddings, 1, None)
    loop = plain_mod.PlainLoop(max_new, p.chunk, sampling.greedy, False)
    stops = stop_array((), c.vocab_size)
    s = plain_mod.start(loop, target, jnp.asarray(p.tokens), jnp.asarray(p.lengths), target.init_state(p.batch, cap),
                        smp.row_params(sampling, p.batch), stops)
    return jax.device_get(plain_mod.run(loop, target, s, stops))


def test_plain_row_with_nan_logits_stops_flagged_and_generate_names_it(target):
    """Sampled (greedy rows are checked by the NaN embedding test below); batch 2, row 1 goes bad."""
    sampling = dflash_jax.Sampling(temperature=0.7, seed=3)
    clean = dflash_jax.generate(nan_after(target, FAR), None, [SHORT, LONG], max_new_tokens=12,
                                sampling=sampling).tokens
    s = plain_state(nan_after(target, POISON_AT), [SHORT, LONG], 12, sampling)
    assert s.nonfinite.tolist() == [-1, NAN_TOKEN] and s.done.all()
    assert s.out[0, : s.n_out[0]].tolist() == clean[0], "the healthy row runs on untouched"
    assert s.out[1, : s.n_out[1]].tolist() == clean[1][:NAN_TOKEN], "the bad row keeps the tokens before"
    with pytest.raises(FloatingPointError, match=NAN_MESSAGE):
        dflash_jax.generate(nan_after(target, POISON_AT), None, [SHORT, LONG], max_new_tokens=12, sampling=sampling)


def test_speculative_row_with_nan_logits_stops_flagged_and_bursts_name_it(target, drafter):
    """Sampled, drawn proposals: rounds accept drafts, so the bad block row can fall inside a round."""
    sampling = dflash_jax.Sampling(temperature=0.7, seed=3, proposal="sample")
    clean = dflash_jax.generate(nan_after(target, FAR), drafter, [SHORT, LONG], max_new_tokens=12,
                                sampling=sampling).tokens
    bad = nan_after(target, POISON_AT)
    session = dflash_jax.Session(bad, drafter, [SHORT, LONG], max_new_tokens=12, sampling=sampling)
    with pytest.raises(FloatingPointError, match=NAN_MESSAGE):
        session.run()
    assert session.stats.per_row["nonfinite_at"] == [None, NAN_TOKEN]
    out, n_out = jax.device_get((session.state.out, session.state.n_out))
    assert out[0, : n_out[0]].tolist() == clean[0], "the healthy row runs on untouched"
    assert out[1, : n_out[1]].tolist() == clean[1][:NAN_TOKEN], "the bad row keeps the tokens before"
    with pytest.raises(FloatingPointError, match=NAN_MESSAGE):
        session.burst(1)

    session = dflash_jax.Session(bad, drafter, [SHORT, LONG], max_new_tokens=12, sampling=sampling)
    got = session.burst(2).tokens
    assert got == [clean[0][:2], clean[1][:2]]
    with pytest.raises(FloatingPointError, match=NAN_MESSAGE):
        while not session.finished:
            for row, new in zip(got, session.burst(2).tokens):
                row.extend(new)
    assert got[1] == clean[1][:len(got[1])] and len(got[1]) <= NAN_TOKEN, "no burst returns the bad token"
    with pytest.raises(FloatingPointError, match=NAN_MESSAGE):
        dflash_jax.generate(bad, drafter, [SHORT, LONG], max_new_tokens=12, sampling=sampling)


EMBED_PROMPTS = PROMPTS[:2]


def poisoned(target, name, value):
    return target.replace(params={**target.params, name: value})


def exact_inject(clean, nd):
    """Drafts copied from the clean greedy continuation, never wrong."""
    return inject_reference(clean, 24, nd, [0] * nd + [1])


def test_nan_embedding_row_reached_only_by_one_rows_output(target, drafter):
    """A NaN in the embedding of a token that only row 1 generates: both loops name row 1 alone."""
    clean = dflash_jax.generate(target, None, EMBED_PROMPTS, max_new_tokens=24).tokens
    token = next(t for t in clean[1][4:] if t not in clean[0] + EMBED_PROMPTS[0] + EMBED_PROMPTS[1] and t != 0)
    at = clean[1].index(token) + 1  # the first logits computed after the token is fed
    bad = poisoned(target, "embed", target.params["embed"].at[token].set(jnp.nan))
    with pytest.raises(FloatingPointError, match=rf"not finite \(NaN or Inf\): row 1 at generated token {at} "):
        dflash_jax.generate(bad, None, EMBED_PROMPTS, max_new_tokens=24)
    session = dflash_jax.Session(bad, drafter, EMBED_PROMPTS, max_new_tokens=24,
                                 inject=exact_inject(clean, drafter.n_drafts))
    with pytest.raises(FloatingPointError, match=r"not finite \(NaN or Inf\): row 1 at generated token \d+ ") as e:
        session.run()
    assert "row 0" not in str(e.value)
    flagged = session.stats.per_row["nonfinite_at"]
    # a verify block holding the token is NaN from its first row: attention multiplies the masked
    # (zero-weight) NaN values of later block rows too, so the flag may fall before `at`
    assert flagged[0] is None and 0 < flagged[1] <= at


@pytest.mark.parametrize("use_drafter", [False, True], ids=["plain", "speculative"])
def test_nan_weights_everywhere_are_caught_at_the_prefill(target, drafter, use_drafter):
    """Today every row emits token 0 (the demo's stop token) and an empty completion looks fine."""
    bad = poisoned(target, "final_norm", jnp.full_like(target.params["final_norm"], jnp.nan))
    match = r"row 0 at generated token 0 \(logits at sequence position 6\); row 1 at generated token 0 \(logits at " \
            r"sequence position 2\)"
    with pytest.raises(FloatingPointError, match=match):
        if use_drafter:
            clean = dflash_jax.generate(target, None, EMBED_PROMPTS, max_new_tokens=24).tokens
            dflash_jax.Session(bad, drafter, EMBED_PROMPTS, max_new_tokens=24, inject=exact_inject(clean, 3))
        else:
            dflash_jax.generate(bad, None, EMBED_PROMPTS, max_new_tokens=24)


def test_the_packed_report_a_burst_fetches_holds_the_state_it_read(target, drafter):
    """A burst reads the output and counters from one packed array (`speculative.report`, one transfer): unpacked,
    it equals the state's own fields, and the session's view of them."""
    from dflash_jax.decoding import speculative as spec

    session = dflash_jax.Session(target, drafter, PROMPTS, max_new_tokens=MAX_NEW)
    session.burst(5)
    s = jax.device_get(session.state)
    out, n_out, done, nonfinite, stats = spec.read_report(np.asarray(spec.report(session.state)), s.out.shape[1])
    np.testing.assert_array_equal(out, s.out)
    assert n_out.tolist() == s.n_out.tolist() and done.tolist() == s.done.tolist()
    assert done.dtype == bool and nonfinite.tolist() == s.nonfinite.tolist()
    for name in ("rounds", "drafted", "accepted", "committed", "accept_hist"):
        np.testing.assert_array_equal(getattr(stats, name), getattr(s.stats, name), err_msg=name)
    assert stats.rounds.max() > 0 and n_out.min() >= 5
    np.testing.assert_array_equal(session._out, s.out)
