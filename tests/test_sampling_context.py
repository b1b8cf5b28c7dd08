"""Long sampled runs: every token speculative decoding emits is a draw from the target's own filtered
next-token distribution given the whole sequence before it, over ~40 rounds per row.

The short end-to-end tests (test_sampling_e2e.py) see at most two rounds, so a bug that only shows once the
context holds committed (or wrongly kept) drafts passes them. Here B rows (ragged prompts of 16 to 32 tokens)
generate L = 48 tokens each. The reference shares no code with the loop or with `dflash_jax.sampling`: the
teacher-forced conditionals come from the target's uncached forward (`full_logits`: no cache, no verify block,
no rollback) over prompt + generated tokens, filtered in float64 numpy (`conftest.reference_filter`:
temperature, top-k, top-p, min-p, in that order). Two checks:

1. Support: no token lies outside the reference's filtered support (with 1e-4 of slack at every cut, so float32
   against float64 rounding at a cut can never fail it). A context off by one position, or a nucleus taken before
   the temperature, puts tokens there.
2. Calibration (the Rosenblatt transform): with the tokens of each step ordered by decreasing reference
   probability, u = P(tokens before x) + U * p(x), U uniform from numpy. Under an exact sampler every u is uniform
   given all earlier steps, so the B * L values are iid U(0, 1), and by the DKW inequality (Massart's constant)
   their Kolmogorov-Smirnov distance to the uniform exceeds sqrt(ln(2 / DELTA) / (2n)) with probability < DELTA.

The target's distributions depend on the context: its q/k norm weights are scaled up so attention is sharp and
position-sensitive, and only a mild token bias (as in test_sampling_e2e.py) is shared with the drafter, so some
drafts are accepted and most rounds reject, which is where a rollback bug shows. Rows mix three sampling settings
(per-row `Sampling`), one of them a temperature below 1 with top-p, where the order of temperature and filters
matters.
"""
import dataclasses
import functools

import numpy as np
import pytest

import dflash_jax
from dflash_jax.drafters.dflash import DFlashDrafter
from dflash_jax.sampling import PROPOSALS, Sampling
from conftest import biased_target, damped_layers, reference_filter, tiny_drafter, tiny_target

V, H, LAYERS = 16, 32, 2
B, L = 384, 48
PROMPT_LENGTHS = (16, 33)  # [low, high): long prompts, so a position error against them shows
DELTA = 1e-6
SLACK = 1e-4  # tolerance at each filter's cut for the support check

QK_SCALE = 3.0  # q/k norm weights: sharp, position-sensitive attention
BIAS_DIM_SIZE, BIAS_SLOPE = 8.0, 0.2  # a mild shared token bias (see test_sampling_e2e.py) so drafts are accepted
CONTEXT_SCALE = 2.0
DRAFTER_DAMP = 0.3

ROW_SAMPLINGS = (
    Sampling(temperature=0.7, top_p=0.8, seed=11),
    Sampling(temperature=1.3, top_k=6, top_p=0.9, seed=11),
    Sampling(temperature=1.0, min_p=0.1, seed=11),
)


@functools.cache
def pair() -> tuple:
    base = tiny_target(0, vocab=V, layers=LAYERS, hidden=H)
    p = dict(base.params)
    for i in range(LAYERS):
        layer = p[f"layers_{i}"]
        p[f"layers_{i}"] = dict(layer, q_norm=QK_SCALE * layer["q_norm"], k_norm=QK_SCALE * layer["k_norm"])
    target = biased_target(base, p, BIAS_DIM_SIZE, BIAS_SLOPE, CONTEXT_SCALE)
    d = tiny_drafter(target, block_size=4, tap_ids=(0, 1))
    return target, DFlashDrafter(d.config, dict(d.params, **damped_layers(d, DRAFTER_DAMP)))


def prompts() -> list:
    rng = np.random.default_rng(0)
    return [rng.integers(0, V, rng.integers(*PROMPT_LENGTHS)).tolist() for _ in range(B)]


@functools.cache
def draws(proposal: str) -> dict:
    """One speculative run of B rows; its tokens [B, L], stats, and per step the reference distribution p [B, L, V]
    and the widened support [B, L, V] (bool)."""
    target, drafter = pair()
    rows = [dataclasses.replace(ROW_SAMPLINGS[i % len(ROW_SAMPLINGS)], proposal=proposal) for i in range(B)]
    ps = prompts()
    out = dflash_jax.generate(target, drafter, ps, max_new_tokens=L, sampling=rows)
    assert sorted({len(t) for t in out.tokens}) == [L], "every row must generate exactly L tokens (no stop tokens)"
    tokens = np.asarray(out.tokens, np.int64)
    seqs = np.zeros((B, PROMPT_LENGTHS[1] + L), np.int32)
    for i, (prompt, row) in enumerate(zip(ps, out.tokens)):
        seqs[i, :len(prompt) + L] = prompt + row
    logits = np.asarray(target.full_logits(seqs), np.float64)
    steps = np.stack([logits[i, len(prompt) - 1:len(prompt) - 1 + L] for i, prompt in enumerate(ps)])
    p = np.stack([reference_filter(steps[i], rows[i]) for i in range(B)])
    support = np.stack([reference_filter(steps[i], rows[i], SLACK) > 0 for i in range(B)])
    return dict(tokens=tokens, stats=out.stats, p=p, support=support, rows=rows)


def rosenblatt(p: np.ndarray, tokens: np.ndarray, rng) -> np.ndarray:
    """u = P(tokens ranked before x) + U * p(x), tokens ranked by decreasing p (ties by id)."""
    order = np.argsort(-p, axis=-1, kind="stable")
    ranked = np.take_along_axis(p, order, axis=-1)
    rank = np.argmax(order == tokens[..., None], axis=-1)[..., None]
    before = np.take_along_axis(np.cumsum(ranked, axis=-1) - ranked, rank, axis=-1)[..., 0]
    return before + rng.random(tokens.shape) * np.take_along_axis(ranked, rank, axis=-1)[..., 0]


def ks_to_uniform(u: np.ndarray) -> float:
    u = np.sort(u.ravel())
    i = np.arange(1, u.size + 1)
    return float(max(np.max(i / u.size - u), np.max(u - (i - 1) / u.size)))


@pytest.mark.parametrize("proposal", PROPOSALS)
def test_the_run_is_long_and_exercises_accept_and_reject(proposal):
    st = draws(proposal)["stats"]
    hist = np.asarray(st.accept_hist)
    assert st.rounds >= B * (L - 1) / 4, f"{st.rounds} rounds for {B} rows of {L} tokens: too few to be long"
    assert hist[0] > 0.5 * st.rounds and hist[1:].sum() > 0.05 * st.rounds, (
        f"{proposal}: rounds must mostly reject (rollback) and sometimes accept drafts; accept_hist {hist.tolist()}")


@pytest.mark.parametrize("proposal", PROPOSALS)
def test_every_token_lies_in_the_targets_filtered_support(proposal):
    d = draws(proposal)
    inside = np.take_along_axis(d["support"], d["tokens"][..., None], axis=-1)[..., 0]
    rows, steps = np.nonzero(~inside)
    assert rows.size == 0, (
        f"{proposal}: {rows.size} of {B * L} tokens lie outside the target's filtered support given their context; "
        f"first at row {rows[0]} ({d['rows'][rows[0]]}), generated token {steps[0]}")


@pytest.mark.parametrize("proposal", PROPOSALS)
def test_tokens_are_draws_from_the_targets_conditionals(proposal):
    d = draws(proposal)
    u = rosenblatt(d["p"], d["tokens"], np.random.default_rng(1))
    dist, bound = ks_to_uniform(u), float(np.sqrt(np.log(2 / DELTA) / (2 * u.size)))
    assert dist < bound, (
        f"{proposal}: the Rosenblatt transforms of {u.size} tokens are at KS distance {dist:.4f} from uniform; "
        f"an exact sampler exceeds {bound:.4f} with probability < {DELTA}")
