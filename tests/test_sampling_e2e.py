"""End to end: speculative sampling commits tokens distributed exactly as the target's own.

A tiny random target (vocab 16) and a DFlash drafter (block 4, 3 drafts) decode one 5-token
prompt in BATCH rows at once. Rows are independent streams (the row index is folded into
every key), so one batch is BATCH independent draws of the first three generated tokens, and
two seeds make N = 32768. Their empirical joint (16**3 cells) and per-position marginals are
compared with the exact joint, computed from the target's uncached forward over all 256
two-token continuations and filtered the same way, and with plain sampling, under the bound
`tv_bound(p, N)`: a TV that N exact draws exceed with probability below DELTA = 1e-6 (at
temperature 1 it is 0.055 for the joint, 0.020 for a marginal; spec-vs-plain 0.077).

The pair is built so the test has power and the accept path is busy. Hidden dim 0 of every
embedding carries a large shared component, and LM head row 0 turns it into a fixed token
bias (logit -BIAS_SLOPE * id), so the target's distributions are concentrated (the T = 1 joint
has sum(sqrt(p)) ~ 15 against sqrt(4096) = 64 for a flat one) yet still depend on the context
through the other LM head rows. The drafter's layer outputs are damped, so its logits stay
near the bias: its argmax is usually a likely target token and its sampled q overlaps p, and
roughly half of all drafts are accepted with either proposal.

A DSpark drafter on the same backbone (block 4, shifted harvest: 4 drafts) adds a Markov head,
so its sampled q is the chain's corrected distribution, and a confidence head under the
`confidence` policy, so rows verify different widths (2 to 5) in the same batch. A DFlash2 drafter
on it (block 4, symmetric windows of 4, dynamic convolutions near the identity) proposes by its
selector walk over the top 4 of 16 tokens: sampled, its q is sparse (the walk's distribution over
the candidates), and a residual that ignores q fails the same bound. The DFlash drafter also runs over a hybrid
target (a Gated DeltaNet layer and an attention layer, with the same token bias): its rejections roll the
recurrent state back through `commit`, and the committed tokens must still follow that target's exact joint. So
does it over a Gemma-4 target (sliding layers whose window of 4 the 8 positions outgrow, KV-shared layers, a scaled
embedding that the drafter embeds through, a soft-capped head).
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax
from dflash_jax import sampling as smp
from dflash_jax.decoding import speculative as spec
from dflash_jax.decoding.common import Stats
from dflash_jax.decoding.session import Session
from dflash_jax.drafters.dflash import DFlashDrafter
from dflash_jax.io.checkpoints import make_drafter
from dflash_jax.sampling import Sampling
from conftest import (
    biased_target,
    damped_layers,
    inverted_accept_length,
    residual_without_q,
    tiny_drafter,
    tiny_gemma4,
    tiny_hybrid,
    tiny_target,
)

pytestmark = pytest.mark.usefixtures("optimised_compiles")  # its programs run long

V = 16
H = 32
PROMPT = [3, 1, 4, 1, 5]
N_TOKENS = 3
BATCH = 16384
CAPACITY = 16  # prompt + 3 tokens + a verify block fit; keeps the batch's caches small
SPEC_SEEDS = (1, 2)
PLAIN_SEEDS = (101, 102)
N = BATCH * len(SPEC_SEEDS)
DELTA = 1e-6  # probability that a correct sampler exceeds one bound
MIN_ACCEPT_RATE = 0.1

BIAS_DIM_SIZE = 8.0  # added to hidden dim 0 of every embedding
BIAS_SLOPE = 0.8  # LM head row 0 gives token t the logit -BIAS_SLOPE * t along that component
CONTEXT_SCALE = 2.0  # LM head rows 1.. (the context-dependent part of the logits)
DRAFTER_DAMP = 0.3  # scale of the drafter layers' output projections

SAMPLINGS = {
    "t1": Sampling(temperature=1.0),
    "t1_topk8": Sampling(temperature=1.0, top_k=8),
    "t08_topp09": Sampling(temperature=0.8, top_p=0.9),
}
CASES = [(name, proposal, "dflash") for name in SAMPLINGS for proposal in smp.PROPOSALS]
CASES += [("t1", "argmax", "dspark"), ("t08_topp09", "sample", "dspark")]
CASES += [("t1", "sample", "dflash2"), ("t08_topp09", "sample", "dflash2"), ("t1_topk8", "argmax", "dflash2")]
HYBRID_CASES = [("t1", "sample", "dflash@hybrid"), ("t08_topp09", "argmax", "dflash@hybrid")]
GEMMA4_CASES = [("t08_topp09", "sample", "dflash@gemma4")]  # one case: the Gemma-4 tests' time budget
SELECTOR_RANK, SELECTOR_TOP_K, SELECTOR_SCALE = 4, 4, 0.05  # the walk's sparse q over 4 of 16 tokens
MARKOV_RANK = 4
MARKOV_SCALE = 0.25  # shifts every slot's q (and about 6% of argmax drafts) yet leaves drafts acceptable
CONFIDENCE_SCALE, CONFIDENCE_BIAS, TAU = 1.0, 4.2, 0.45  # widths 2..5 across contexts (mostly 4)


@functools.cache
def pair(family: str = "dflash") -> tuple:
    """(target, drafter) whose logits share a token bias (see the module docstring). The DSpark drafter
    adds a Markov head and a confidence head (per-row confidence widths) to the same backbone; `@hybrid`
    puts the drafter on a hybrid target (Gated DeltaNet and attention layers: `commit` selects its states),
    `@gemma4` on a Gemma-4 target."""
    family, _, kind = family.partition("@")
    make = {"hybrid": tiny_hybrid, "gemma4": tiny_gemma4}.get(kind, functools.partial(tiny_target, layers=2))
    base = make(0, vocab=V, hidden=H)
    target = biased_target(base, base.params, BIAS_DIM_SIZE, BIAS_SLOPE, CONTEXT_SCALE)
    d = tiny_drafter(target, block_size=4, tap_ids=(0, 1))
    layers = damped_layers(d, DRAFTER_DAMP)
    assert len(layers) == d.config.num_layers
    if family == "dflash":
        return target, DFlashDrafter(d.config, dict(d.params, **layers))
    rng = np.random.default_rng(5)
    if family == "dflash2":
        cfg = dataclasses.replace(d.config, family="dflash2", layer_window=(4, 4), causal=(False, False),
                                  selector_rank=SELECTOR_RANK, selector_top_k=SELECTOR_TOP_K, conv_kernel_size=2,
                                  conv_group_size=8)
        width = 2 * 2 * (H // 8)
        identity = np.zeros((2, 2, H))
        identity[:, 0] = 1.0  # tap 0 passes rows through
        for lp in layers.values():
            for name in ("attn_conv", "mlp_conv"):
                lp[f"{name}_base"] = jnp.asarray(identity + 0.1 * rng.standard_normal((2, 2, H)), jnp.float32)
                lp[f"{name}_proj"] = jnp.asarray(0.05 * rng.standard_normal((H, width)), jnp.float32)
        heads = {"selector_pred": rng.standard_normal((V, SELECTOR_RANK)),
                 "selector_succ": rng.standard_normal((V, SELECTOR_RANK)),
                 "selector_hidden": SELECTOR_SCALE * rng.standard_normal((H, SELECTOR_RANK))}
        return target, make_drafter(cfg, dict(d.params, **layers, **{k: jnp.asarray(v, jnp.float32)
                                                                       for k, v in heads.items()}))
    cfg = dataclasses.replace(d.config, family="dspark", harvest="dspark", markov_rank=MARKOV_RANK, markov=True,
                              confidence_in_dim=H + MARKOV_RANK, verify_policy="confidence", verify_tau=TAU,
                              adapt=True)
    heads = {"markov_w1": MARKOV_SCALE * rng.standard_normal((V, MARKOV_RANK)),
             "markov_w2": MARKOV_SCALE * rng.standard_normal((MARKOV_RANK, V)),
             "confidence_w": CONFIDENCE_SCALE * rng.standard_normal((H + MARKOV_RANK, 1)) * (np.arange(H + MARKOV_RANK)
                                                                                       > 0)[:, None],
             "confidence_b": np.full(1, CONFIDENCE_BIAS)}
    return target, make_drafter(cfg, dict(d.params, **layers, **{k: jnp.asarray(v, jnp.float32)
                                                                   for k, v in heads.items()}))


def tv(a, b) -> float:
    return 0.5 * float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).sum())


def tv_bound(p, n: int, two_sample: bool = False) -> float:
    """A TV that the empirical distribution of n iid draws from p exceeds with probability < DELTA
    (two_sample: the TV between two independent such empirical distributions).

    E|p_hat_i - p_i| <= sqrt(p_i (1 - p_i) / n) by Jensen (twice the variance for two samples);
    one draw moves the TV by at most 1/n, so McDiarmid adds sqrt(k ln(1/DELTA) / (2n)) for k samples.
    """
    k = 2 if two_sample else 1
    p = np.asarray(p, np.float64)
    return float(0.5 * np.sum(np.sqrt(k * p * (1 - p) / n)) + np.sqrt(k * np.log(1 / DELTA) / (2 * n)))


@functools.cache
def exact_joint(sampling: Sampling, family: str = "dflash") -> np.ndarray:
    """P(t1, t2, t3) f64[V, V, V] under the filtered target of `family`'s pair, from one uncached forward."""
    kind = family.partition("@")[2]
    target, _ = pair(f"dflash@{kind}" if kind else "dflash")
    seqs = np.array([PROMPT + [a, b] for a in range(V) for b in range(V)], np.int32)
    logits = target.full_logits(seqs)[:, len(PROMPT) - 1:]
    p = np.exp(np.asarray(smp.filtered_logprobs(logits, smp.row_params(sampling, len(seqs))), np.float64))
    p1, p2, p3 = p[0, 0], p[::V, 1], p[:, 2].reshape(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def joint_histogram(tokens: np.ndarray) -> np.ndarray:
    """Empirical P(t1, t2, t3) f64[V, V, V] from tokens [n, 3]."""
    cells = (tokens[:, 0] * V + tokens[:, 1]) * V + tokens[:, 2]
    return (np.bincount(cells, minlength=V**3) / len(tokens)).reshape(V, V, V)


def as_tokens(rows: list) -> np.ndarray:
    lengths = sorted({len(r) for r in rows})
    assert lengths == [N_TOKENS], f"every row must generate exactly {N_TOKENS} tokens; got lengths {lengths}"
    return np.asarray(rows, np.int64)


def speculative_batch(sampling: Sampling, family: str = "dflash") -> tuple[np.ndarray, Stats]:
    """(tokens [BATCH, 3], stats) of one speculative session over BATCH copies of the prompt."""
    target, drafter = pair(family)
    r = Session(target, drafter, [PROMPT] * BATCH, max_new_tokens=N_TOKENS, sampling=sampling,
                capacity=CAPACITY).run()
    return as_tokens(r.tokens), r.stats


@functools.cache
def speculative_draws(name: str, proposal: str, family: str = "dflash") -> tuple[np.ndarray, dict]:
    """(tokens [N, 3], accepted / drafted / accept_hist summed over SPEC_SEEDS)."""
    runs = [speculative_batch(dataclasses.replace(SAMPLINGS[name], seed=s, proposal=proposal), family)
            for s in SPEC_SEEDS]
    stats = {key: sum(getattr(st, key) for _, st in runs) for key in ("accepted", "drafted")}
    stats["accept_hist"] = np.sum([st.accept_hist for _, st in runs], axis=0)
    return np.concatenate([t for t, _ in runs]), stats


@functools.cache
def plain_draws(name: str) -> np.ndarray:
    """Tokens [N, 3] of plain sampling over PLAIN_SEEDS."""
    target, _ = pair()
    return np.concatenate([
        as_tokens(dflash_jax.generate(target, None, [PROMPT] * BATCH, max_new_tokens=N_TOKENS, capacity=CAPACITY,
                                      sampling=dataclasses.replace(SAMPLINGS[name], seed=s)).tokens)
        for s in PLAIN_SEEDS])


def distances(tokens: np.ndarray, exact: np.ndarray) -> dict:
    """{'joint' | 'token k': (TV to the exact distribution, tv_bound)} for tokens [n, 3]."""
    emp = joint_histogram(tokens)
    out = {"joint": (tv(emp, exact), tv_bound(exact, len(tokens)))}
    for pos in range(N_TOKENS):
        others = tuple(a for a in range(N_TOKENS) if a != pos)
        marginal = exact.sum(axis=others)
        out[f"token {pos + 1}"] = (tv(emp.sum(axis=others), marginal), tv_bound(marginal, len(tokens)))
    return out


@pytest.mark.parametrize("name, proposal, family", CASES + HYBRID_CASES + GEMMA4_CASES)
def test_speculative_joint_of_three_tokens_matches_the_target(name, proposal, family):
    exact = exact_joint(SAMPLINGS[name], family)
    tokens, _ = speculative_draws(name, proposal, family)
    for what, (d, bound) in distances(tokens, exact).items():
        assert d < bound, (f"{family} {name}/{proposal}: {what} of {N} speculative draws is TV {d:.4f} from the "
                           f"target's exact distribution; {N} exact draws exceed {bound:.4f} with probability "
                           f"< {DELTA}")


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_plain_sampling_matches_the_exact_joint(name):
    exact = exact_joint(SAMPLINGS[name])
    for what, (d, bound) in distances(plain_draws(name), exact).items():
        assert d < bound, (f"{name}: {what} of {N} plain draws is TV {d:.4f} from the exact distribution "
                           f"(bound {bound:.4f}); plain sampling or the exact reference is wrong")


@pytest.mark.parametrize("name, proposal, family", CASES)
def test_speculative_joint_matches_plain_sampling(name, proposal, family):
    d = tv(joint_histogram(speculative_draws(name, proposal, family)[0]), joint_histogram(plain_draws(name)))
    bound = tv_bound(exact_joint(SAMPLINGS[name]), N, two_sample=True)
    assert d < bound, (f"{family} {name}/{proposal}: speculative and plain joints of {N} draws each are TV "
                       f"{d:.4f} apart; "
                       f"two samples of one distribution exceed {bound:.4f} with probability < {DELTA}")


@pytest.mark.parametrize("name, proposal, family", CASES + HYBRID_CASES + GEMMA4_CASES)
def test_drafts_are_accepted_often_enough_to_exercise_the_accept_path(name, proposal, family):
    _, stats = speculative_draws(name, proposal, family)
    rate = stats["accepted"] / stats["drafted"]
    hist = stats["accept_hist"]
    assert rate > MIN_ACCEPT_RATE, f"{family} {name}/{proposal}: acceptance rate {rate:.3f} <= {MIN_ACCEPT_RATE}"
    assert hist[0] > 0.05 * hist.sum() and hist[2:].sum() > 0.05 * hist.sum(), (
        f"{family} {name}/{proposal}: rounds must both reject the first draft (residual path) and accept two or more "
        f"(tokens 2 and 3 both drafts) often; accept_hist {hist.tolist()}")


@pytest.mark.parametrize("proposal", smp.PROPOSALS)
def test_same_seed_gives_the_same_tokens_and_another_seed_different_ones(proposal):
    tokens, _ = speculative_draws("t1", proposal)
    first, second = tokens[:BATCH], tokens[BATCH:]
    again, _ = speculative_batch(dataclasses.replace(SAMPLINGS["t1"], seed=SPEC_SEEDS[0], proposal=proposal))
    np.testing.assert_array_equal(again, first, err_msg=f"{proposal}: the same seed must give the same tokens")
    differ = np.mean(np.any(first != second, axis=1))
    assert differ > 0.3, f"{proposal}: seeds {SPEC_SEEDS} must give different tokens; only {differ:.1%} of rows differ"


# --- teeth: a wrong rule fails the same check ----------------------------------------------


def _fresh_loops(monkeypatch):
    """New jits of the loop's entry points, each over a new function, so the patched rule is traced (jit caches
    traces by function: a new jit of the same function would reuse an earlier test's)."""
    for name in ("run", "run_burst"):
        fn = getattr(spec, name).__wrapped__
        monkeypatch.setattr(spec, name, jax.jit(lambda *args, fn=fn: fn(*args), static_argnums=0))


@pytest.mark.parametrize("rule, wrong, proposal, family", [
    ("accept_length", inverted_accept_length, "argmax", "dflash"),
    ("residual_logprobs", residual_without_q, "argmax", "dflash"),
    ("residual_logprobs", residual_without_q, "sample", "dflash"),
    ("residual_logprobs", residual_without_q, "sample", "dflash2"),
])
def test_teeth_a_wrong_rule_fails_the_check(monkeypatch, rule, wrong, proposal, family):
    traced = []

    def patched(*args):
        traced.append(rule)
        return wrong(*args)

    monkeypatch.setattr(smp, rule, patched)
    _fresh_loops(monkeypatch)
    tokens, _ = speculative_batch(dataclasses.replace(SAMPLINGS["t1"], seed=SPEC_SEEDS[0], proposal=proposal), family)
    assert traced, f"the patched {rule} was never traced: the teeth run used the real rule"
    found = distances(tokens, exact_joint(SAMPLINGS["t1"]))
    worst = max(found, key=lambda what: found[what][0] / found[what][1])
    d, bound = found[worst]
    assert d > 2 * bound, (f"a wrong {rule} ({family}, {proposal}) must fail the check clearly; its worst is {worst} at "
                           f"TV {d:.4f} against the bound {bound:.4f} for {BATCH} draws")
