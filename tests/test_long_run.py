"""A 16,384-token generation on the CPU: speculative decoding equals plain decoding token for token, leaves the
same target cache at every one of the 16k positions, and compiles nothing once the run has started.

The pair is as small as a pair can be (one row; two layers of one attention head of width 8), because every
decode step attends over the whole cache capacity, so the cost grows with the square of the length. Its greedy
output keeps varying over the whole run (70 distinct tokens in the first thousand, 6 in the last). Proposals come from
the plain continuation, injected with the first wrong slot one of 0..nd - 1 in half the rounds, so rounds reach every
acceptance length (and every rollback length) all the way along, in ~2,700 rounds instead of ~16,000. The run
is resumed in four bursts of different sizes, and compiles are counted (jax.monitoring) from the second burst
on. The second layer's K/V are computed from the first layer's attention over the whole context, so comparing
caches checks every position's context, not only its token. About 40 s on 2 CPU cores (plain decoding 12 s,
the bursts 20 s).
"""
import functools

import jax
import numpy as np
import pytest

import dflash_jax
from dflash_jax.config import RopeConfig, TargetConfig
from dflash_jax.decoding import plain as plain_loop
from dflash_jax.io.checkpoints import make_target
from conftest import inject_reference, random_params, target_param_shapes, tiny_drafter

pytestmark = pytest.mark.usefixtures("optimised_compiles")  # its programs run long

N_NEW = 16384
PROMPT = list(range(3, 20))
BURSTS = (2000, 6000, 4000, 4384)  # sizes differ: a size that reached a static argument would recompile
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@functools.cache
def pair():
    cfg = TargetConfig(arch="qwen3", vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=1,
                       num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6, rope=RopeConfig(10000.0),
                       max_position_embeddings=N_NEW + 64)
    target = make_target(cfg, random_params(target_param_shapes(cfg), 0, scale=0.3))
    return target, tiny_drafter(target, 8, windows=(None,), causal=(False,), tap_ids=(1,))


class CompileCounter:
    """Counts XLA backend compiles while active."""

    def __enter__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def _listen(self, event, duration, **kwargs):
        self.count += event == COMPILE_EVENT

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listen)


def plain_with_state(target):
    """`generate(target, None, ...)`, with the final decoding state kept (`plain.run` is wrapped for the call)."""
    kept, run = [], plain_loop.run

    def keep(*args):
        kept.append(run(*args))
        return kept[-1]

    plain_loop.run = keep
    try:
        tokens = dflash_jax.generate(target, None, [PROMPT], max_new_tokens=N_NEW).tokens[0]
    finally:
        plain_loop.run = run
    return tokens, kept[0].state


@functools.cache
def runs() -> dict:
    target, drafter = pair()
    plain, plain_state = plain_with_state(target)
    nd = drafter.n_drafts
    session = dflash_jax.Session(target, drafter, [PROMPT], max_new_tokens=N_NEW,
                                 inject=inject_reference([plain], N_NEW, nd, [1] * nd + [nd + 1]))
    got, compiles = [], []
    for size in BURSTS:
        with CompileCounter() as counter:
            got += session.burst(size).tokens[0]
        compiles.append(counter.count)
    return dict(plain=plain, plain_state=plain_state, spec=got, session=session, compiles=compiles)


def test_sixteen_thousand_speculative_tokens_equal_plain_decoding():
    r = runs()
    plain, got = np.asarray(r["plain"]), np.asarray(r["spec"])
    assert plain.shape == got.shape == (N_NEW,), f"plain made {plain.shape}, speculative {got.shape} tokens"
    diff = np.nonzero(plain != got)[0]
    assert diff.size == 0, f"speculative output leaves plain decoding at generated token {diff[0] if diff.size else 0}"
    windows = [len(set(r["plain"][a:a + 1000])) for a in range(0, N_NEW, 2048)]
    assert min(windows) >= 5, f"distinct tokens per 1000, every 2048: {windows}; the output should keep varying"
    hist = np.asarray(r["session"].stats.accept_hist)
    assert (hist > 0.02 * hist.sum()).all(), f"every acceptance length should be common; histogram {hist.tolist()}"


def test_no_compile_after_the_first_burst():
    compiles = runs()["compiles"]
    assert compiles[0] > 0, "the first burst compiles the loop (or the counter counts nothing)"
    assert compiles[1:] == [0] * (len(BURSTS) - 1), f"compiles per burst {compiles}: the run recompiled"


def test_speculative_target_cache_equals_the_plain_one_at_every_position():
    """Both runs hold the prompt and every generated token but the last (the next input): K/V of every layer at
    every position must agree, and so must the drafter's length."""
    r = runs()
    want, got = r["plain_state"], r["session"].state.target_state
    n = len(PROMPT) + N_NEW - 1
    np.testing.assert_array_equal(np.asarray(want.seq_len), [n])
    np.testing.assert_array_equal(np.asarray(got.seq_len), [n])
    np.testing.assert_array_equal(np.asarray(r["session"].state.drafter_state.seq_len), [n])
    for name in ("k", "v"):
        for layer, (a, b) in enumerate(zip(getattr(got, name), getattr(want, name))):
            a, b = np.asarray(a)[0, :n], np.asarray(b)[0, :n]
            bad = np.nonzero(np.abs(a - b).max(axis=(1, 2)) > 1e-4 * max(1.0, np.abs(b).max()))[0]
            assert bad.size == 0, f"layer {layer} {name} differs from plain decoding at position {bad[0]} of {n}"
