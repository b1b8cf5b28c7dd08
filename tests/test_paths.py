"""Paths no other test takes end to end: `impl="pallas"` through `generate` and `Session` (the kernel in Pallas
interpret mode on the CPU), and one speculative batch that mixes greedy and sampled rows with ragged prompts,
stop tokens and a verify cap.

What is exact, and asserted:
- a greedy row equals plain greedy decoding, beside sampled rows and under a verify cap;
- stop tokens only end a row: each row is the same run without stop tokens cut after its first stop token
  (every row draws from its own random stream, so a sampled row too);
- the pallas kernel computes the attention the XLA path computes, so a pallas run gives the tokens of the XLA
  run with the same seeds (to float32 rounding, far from any sampling decision here);
- with verify_t=3 every round examines exactly 2 of the 3 drafts;
- a sampled row's tokens lie in the target's filtered support given their context (teacher-forced uncached
  forward, numpy filters);
- a one-row product XLA:GPU would strength-reduce is lowered for CUDA as a two-row GEMM (exported for CUDA from
  the CPU), and the two-row form gives the one-row product's value.
A sampled row under a different verify cap is not asserted equal: the cap changes which random numbers a round
draws, so only its distribution stays the same (test_sampling_context.py checks distributions).
"""
import functools
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import dflash_jax
from dflash_jax.sampling import Sampling
from conftest import inject_reference, reference_filter, tiny_drafter, tiny_hybrid, tiny_target

PROMPTS = [[5, 6, 7], list(range(12, 32)), [9, 1, 40, 2, 33, 8, 60], [3] * 11, [50, 51], list(range(1, 15))]
ROWS = [Sampling(), Sampling(temperature=0.8, top_k=8, seed=1), Sampling(),
        Sampling(temperature=1.0, top_p=0.9, seed=2), Sampling(), Sampling(temperature=0.7, min_p=0.1, seed=3)]
GREEDY = [i for i, s in enumerate(ROWS) if s.greedy]
SAMPLED = [i for i, s in enumerate(ROWS) if not s.greedy]
MAX_NEW = 20
VERIFY_T = 3
SLACK = 1e-4
UNSEEN = (9, 63)  # stop tokens no row reaches (asserted), so runs with and without real stops share one program


@pytest.fixture(scope="module")
def pair(target):
    """The shared tiny target and a drafter of block 4 with a sliding-window causal layer (window 4 < most
    contexts) and a full bidirectional one."""
    return target, tiny_drafter(target, 4, windows=(4, None), causal=(True, False))


@pytest.fixture(scope="module")
def runs(pair):
    """Runs of the module's pair, each made once: plain greedy, and the mixed speculative batch, per impl."""
    target, drafter = pair

    @functools.cache
    def plain(impl="xla"):
        return dflash_jax.generate(target, None, PROMPTS, max_new_tokens=MAX_NEW, impl=impl).tokens

    @functools.cache
    def mixed(stops=UNSEEN, impl="xla"):
        return dflash_jax.generate(target, drafter, PROMPTS, max_new_tokens=MAX_NEW, sampling=ROWS, stop_tokens=stops,
                                   verify_t=VERIFY_T, impl=impl)

    return types.SimpleNamespace(target=target, drafter=drafter, plain=plain, mixed=mixed)


def cut(row, stops):
    """`row` up to and including its first stop token."""
    first = next((k for k, t in enumerate(row) if t in stops), None)
    return row if first is None else row[:first + 1]


@pytest.fixture(scope="module")
def stops(runs):
    """One stop token from a sampled row's run without real stops (its 6th token), one from a greedy row's."""
    return (runs.mixed().tokens[SAMPLED[0]][5], runs.plain()[GREEDY[0]][6])


def test_greedy_rows_of_a_mixed_batch_equal_plain_decoding(runs):
    out = runs.mixed()
    for i in GREEDY:
        assert out.tokens[i] == runs.plain()[i], f"greedy row {i} beside sampled rows differs from plain decoding"
    for i in SAMPLED:
        assert out.tokens[i] != runs.plain()[i], f"sampled row {i} reproduces the greedy continuation"
    st = out.stats
    assert st.drafted == (VERIFY_T - 1) * st.rounds and sum(st.accept_hist[VERIFY_T:]) == 0, (
        f"verify_t={VERIFY_T} examines {VERIFY_T - 1} drafts a round: {st.drafted} drafted in {st.rounds} rounds, "
        f"histogram {st.accept_hist}")


def test_stop_tokens_cut_each_row_after_its_first_stop_and_change_nothing_before(runs, stops):
    free = runs.mixed().tokens
    assert all(len(row) == MAX_NEW for row in free), f"stop tokens {UNSEEN} must not occur: {free}"
    out = runs.mixed(stops).tokens
    assert out == [cut(row, stops) for row in free]
    assert len(out[SAMPLED[0]]) <= 6 and len(out[GREEDY[0]]) <= 7, "both stop tokens must cut their rows"
    for i, row in enumerate(out):
        assert all(t not in stops for t in row[:-1]), f"row {i} runs past a stop token"
        assert len(row) == MAX_NEW or row[-1] in stops, f"row {i} ended early without a stop token"


def test_sampled_rows_stay_in_the_targets_filtered_support(runs, stops):
    out = runs.mixed(stops).tokens
    for i in SAMPLED:
        seq = PROMPTS[i] + out[i]
        logits = np.asarray(runs.target.full_logits([seq]), np.float64)[0, len(PROMPTS[i]) - 1:len(seq) - 1]
        support = reference_filter(logits, ROWS[i], SLACK) > 0
        outside = [k for k, t in enumerate(out[i]) if not support[k, t]]
        assert not outside, f"row {i} ({ROWS[i]}): generated tokens {outside} lie outside the filtered support"


def test_pallas_generate_equals_xla(runs, stops):
    assert runs.plain("pallas") == runs.plain()
    got, want = runs.mixed(stops, "pallas"), runs.mixed(stops)
    assert got.tokens == want.tokens
    assert got.stats.accept_hist == want.stats.accept_hist


def test_pallas_session_bursts_equal_generate(runs, stops):
    """Greedy rows only: a sampled row resumed burst by burst is issue 20, item 9 (its own tests)."""
    whole = runs.mixed(stops, "pallas").tokens
    session = dflash_jax.Session(runs.target, runs.drafter, PROMPTS, max_new_tokens=MAX_NEW, sampling=ROWS,
                                 stop_tokens=stops, verify_t=VERIFY_T, impl="pallas")
    got = [[] for _ in PROMPTS]
    while not session.finished:
        for row, new in zip(got, session.burst(4).tokens):
            row.extend(new)
    for i in GREEDY:
        assert got[i] == whole[i], f"greedy row {i}: pallas bursts differ from one pallas generate call"


@pytest.mark.parametrize("make", [functools.partial(tiny_target, head_dim=16),
                                  functools.partial(tiny_hybrid, head_dim=16)], ids=["dense", "hybrid"])
def test_the_kernel_that_writes_the_cache_decodes_as_the_xla_path(monkeypatch, make):
    """With `WRITE_IN_KERNEL`, every attention layer of the target writes its block's K/V from inside the kernel
    (the scatter fallback is made to fail): plain and speculative greedy decoding, with injected proposals that
    reach every acceptance length (so rejected rows get overwritten), give the XLA path's tokens."""
    from pallas_kernels import windowed_attention as wa

    target = make()
    drafter = tiny_drafter(target, 4, tap_ids=(0, 1))
    nd, capacity, new = drafter.config.n_drafts, 64, 16
    prompts = PROMPTS[:3]
    want = dflash_jax.generate(target, None, prompts, max_new_tokens=new, capacity=capacity).tokens
    monkeypatch.setattr(wa, "WRITE_IN_KERNEL", True)

    def no_scatter(*_):
        raise AssertionError("the target's cache was written by write_rows, not by the kernel")

    monkeypatch.setattr(wa, "write_rows", no_scatter)
    jax.clear_caches()
    assert wa.writes_in_kernel(jnp.zeros((len(prompts), capacity, 2, 16)), "pallas")
    assert dflash_jax.generate(target, None, prompts, max_new_tokens=new, capacity=capacity,
                               impl="pallas").tokens == want
    assert dflash_jax.generate(target, drafter, prompts, max_new_tokens=new, capacity=capacity,
                               impl="pallas").tokens == want
    out = dflash_jax.Session(target, drafter, prompts, max_new_tokens=new, capacity=capacity, impl="pallas",
                             inject=inject_reference(want, new, nd)).run()
    assert out.tokens == want
    assert all(out.stats.accept_hist[k] for k in range(nd + 1)), f"lengths seen: {out.stats.accept_hist}"
    jax.clear_caches()


def _dots(fn, platform, *args):
    text = export.export(jax.jit(fn), platforms=[platform])(*args).mlir_module()
    return re.findall(r"dot_general [^\n]*?-> tensor<((?:\d+x)*\d+)x[a-z]", text)


@pytest.mark.parametrize("x_shape", [(1, 1, 64), (1, 64), (64,)], ids=["step", "row", "vector"])
def test_a_one_row_product_xla_would_strength_reduce_is_a_two_row_gemm_on_cuda(x_shape):
    """`layers.matmul` sends one row times a small weight through `as_two_rows` on CUDA only, leaves larger weights,
    more rows and other platforms as one product, and the two-row form computes the first row's values.

    The two-row values are compared bit for bit with a two-row product whose second row is not zero (the crop keeps
    the first row, the padding reaches nothing), and with a float64 product within float32 rounding: a one-row and a
    two-row product are different CPU kernels, and at the suite's optimisation level they sum in different orders."""
    from dflash_jax.targets import layers

    rng = np.random.RandomState(3)
    x = jnp.asarray(rng.randn(*x_shape), jnp.float32)
    w = jnp.asarray(rng.randn(64, 48), jnp.float32)
    assert _dots(layers.matmul, "cuda", x, w) == ["2x48"]
    assert _dots(layers.matmul, "cpu", x, w) == ["x".join(map(str, x_shape[:-1] + (48,)))]
    assert _dots(layers.matmul, "cuda", jnp.zeros((1, 2, 64)), w) == ["1x2x48"], "two rows are a GEMM already"
    k = 2048
    n = layers.STRENGTH_REDUCED_BELOW // k  # (n + 1) * k is past the threshold: XLA keeps it a GEMM
    big = jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
    assert _dots(layers.matmul, "cuda", jax.ShapeDtypeStruct((1, 1, k), jnp.bfloat16), big) == [f"1x1x{n}"]
    product = functools.partial(jnp.matmul, precision="highest", preferred_element_type=jnp.float32)
    got = layers.as_two_rows(product, x, w)
    assert got.shape == x_shape[:-1] + (48,) and got.dtype == jnp.float32
    other = jnp.stack([x.reshape(-1), jnp.asarray(rng.randn(64), jnp.float32)])
    np.testing.assert_array_equal(np.asarray(got).reshape(-1), np.asarray(product(other, w))[0])
    exact = np.asarray(x, np.float64).reshape(-1) @ np.asarray(w, np.float64)
    np.testing.assert_allclose(np.asarray(got, np.float64).reshape(-1), exact, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(jax.jit(layers.matmul)(x, w)), np.asarray(product(x, w)))
