"""The drafter forward against an independent step-by-step numpy reference of docs/architecture.md, "DFlash"
(and "DFlash2": the dynamic convolutions around each sublayer and the selector walk).

The reference below imports nothing from `dflash_jax.targets` or `dflash_jax.drafters`: RMSNorm, rotate-half RoPE
(default rope, `inv_freq = theta^(-2i/d)`), GQA attention with an explicit loop over keys
deciding visibility from absolute positions, and SwiGLU are written out in float64 numpy.
One drafting step for one row:

    ctx = RMSNorm(taps @ fc, hidden_norm)                  context tokens at positions 0..T-1
    per layer: ctx K = RoPE(k_norm(ctx @ Wk)), ctx V = ctx @ Wv   (no input layernorm)
    x = embed([anchor, mask, ...]) * input_embedding_scale   block at positions T..T+b-1
    per layer: xn = RMSNorm(x, attn_norm); q, block k from xn (q_norm / k_norm, RoPE)
               x += attn(q, [ctx K ; block k], [ctx V ; block v]) @ Wo
               x += SwiGLU(RMSNorm(x, mlp_norm))
    h = RMSNorm(x, norm); logits of rows 1..b-1 = softcap(h @ lm_head * output_multiplier)

A query at position p sees a key at position k unless (causal and k > p), or
(window and p - k >= window), or (window, not causal and k - p >= window).

Library results are float32; the tolerance is relative to the largest reference value.
Tests that claim a mask feature matters also check that the reference *without* that
feature is far from the library, so a wrong mask could not pass by accident.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.api import propose
from dflash_jax.config import DrafterConfig, RopeConfig, TargetConfig
from dflash_jax.io.checkpoints import drafter_family, make_drafter, make_target
from dflash_jax.targets.dense import DenseTarget

TOL = 1e-5  # relative to the largest |reference| value, float32 library vs float64 reference
TEETH = 1e-2  # a mask variant counts as "different" beyond this relative distance

H, NH, NKV, HD, F, V = 32, 4, 2, 16, 48, 64  # q width 64 != H, GQA group of 2
THETA = 10000.0
EPS = 1e-6
MASK_ID = V - 1


# ---------------------------------------------------------------------------------------
# The numpy reference (float64).

def ref_rms(x, w):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS)


def ref_rope(x, positions):
    """Rotate-half RoPE of `x [T, heads, d]` at integer `positions [T]` (default rope)."""
    d = x.shape[-1]
    half = d // 2
    inv_freq = 1.0 / THETA ** (2.0 * np.arange(half) / d)
    ang = np.asarray(positions, np.float64)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def ref_visible(q_pos, k_pos, window, causal):
    """Whether a query at absolute position `q_pos` sees a key at `k_pos` under one layer's mask."""
    if causal and k_pos > q_pos:
        return False
    if window is not None and q_pos - k_pos >= window:
        return False
    if window is not None and not causal and k_pos - q_pos >= window:
        return False
    return True


def ref_attention(q, q_pos, k, v, k_pos, window, causal):
    """q `[Tq, NH, HD]` at `q_pos`, k/v `[Tk, NKV, HD]` at `k_pos`; explicit loops over keys."""
    out = np.zeros_like(q)
    group = q.shape[1] // k.shape[1]
    for i, qp in enumerate(q_pos):
        keys = [j for j, kp in enumerate(k_pos) if ref_visible(qp, kp, window, causal)]
        assert keys, f"query at position {qp} sees no key"
        for h in range(q.shape[1]):
            kv = h // group
            scores = np.array([q[i, h] @ k[j, kv] for j in keys]) / np.sqrt(q.shape[-1])
            p = np.exp(scores - scores.max())
            p /= p.sum()
            out[i, h] = sum(pj * v[j, kv] for pj, j in zip(p, keys))
    return out


def ref_swiglu(x, w_gate, w_up, w_down):
    g = x @ w_gate
    return (g / (1.0 + np.exp(-g)) * (x @ w_up)) @ w_down


def ref_conv(x, dyn, base, which: int, group_size: int):
    """The grouped dynamic causal convolution of rows `x [b, H]`, written out row by row: row t is
    `sum_o (base[which, o] + dyn[t, which, o, group of c]) * x[t - o]` over taps o <= t (DFlash2)."""
    b, h = x.shape
    k = base.shape[1]
    d = dyn.reshape(b, 2, k, h // group_size)
    group = np.arange(h) // group_size
    out = np.zeros_like(x)
    for t in range(b):
        for o in range(min(k, t + 1)):
            out[t] += (base[which, o] + d[t, which, o, group]) * x[t - o]
    return out


def ref_walk(pred, succ, logits, hp, anchor: int, top_k: int) -> list:
    """The DFlash2 selector's greedy walk: slot p ranks its top-K logits by `logit + (pred[prev] * hp[p]) .
    succ[cand]` and walks on from the winner."""
    path, prev = [], anchor
    for p in range(logits.shape[0]):
        cand = np.argsort(-logits[p], kind="stable")[:top_k]
        scores = logits[p][cand] + succ[cand] @ (pred[prev] * hp[p])
        prev = int(cand[np.argmax(scores)])
        path.append(prev)
    return path


def ref_layer_weights(lp):
    """The fused library layout split back into the separate projections of the checkpoint."""
    kw = lp["wkv"].shape[1] // 2
    fw = lp["w_gate_up"].shape[1] // 2
    return dict(wq=lp["wq"], wk=lp["wkv"][:, :kw], wv=lp["wkv"][:, kw:], wo=lp["wo"],
                gate=lp["w_gate_up"][:, :fw], up=lp["w_gate_up"][:, fw:], down=lp["w_down"],
                attn_norm=lp["attn_norm"], mlp_norm=lp["mlp_norm"], q_norm=lp["q_norm"], k_norm=lp["k_norm"])


def f64(a):
    return np.asarray(a, np.float64)


def heads(a):
    """`[T, n*HD] -> [T, n, HD]`."""
    return a.reshape(a.shape[0], -1, HD)


def reference_step(dparams, cfg: DrafterConfig, embed, lm_head, taps, anchor, conv: bool = True):
    """One drafting step for one row: taps `[T, n_taps*H]`, anchor token -> (h [b, H], logits [b-1, V]).
    A DFlash2 config adds the convolutions around each sublayer (unless `conv` is False: a teeth variant)."""
    conv = conv and cfg.family == "dflash2"
    p = jax.tree_util.tree_map(f64, dparams)
    taps = f64(taps)
    t, b = taps.shape[0], cfg.block_size
    ctx_pos = np.arange(t)
    blk_pos = t + np.arange(b)
    ctx = ref_rms(taps @ p["fc"], p["hidden_norm"])
    x = f64(embed)[[anchor] + [cfg.mask_token_id] * (b - 1)] * cfg.input_embedding_scale
    for i in range(cfg.num_layers):
        lp = p[f"layers_{i}"]
        w = ref_layer_weights(lp)
        ctx_k = ref_rope(ref_rms(heads(ctx @ w["wk"]), w["k_norm"]), ctx_pos)
        ctx_v = heads(ctx @ w["wv"])
        xn = ref_rms(x, w["attn_norm"])
        if conv:
            dyn = xn @ lp["attn_conv_proj"]
            xn = ref_conv(xn, dyn, lp["attn_conv_base"], 0, cfg.conv_group_size)
        q = ref_rope(ref_rms(heads(xn @ w["wq"]), w["q_norm"]), blk_pos)
        blk_k = ref_rope(ref_rms(heads(xn @ w["wk"]), w["k_norm"]), blk_pos)
        blk_v = heads(xn @ w["wv"])
        attn = ref_attention(q, blk_pos, np.concatenate([ctx_k, blk_k]), np.concatenate([ctx_v, blk_v]),
                             np.concatenate([ctx_pos, blk_pos]), cfg.layer_window[i], cfg.causal[i])
        out = attn.reshape(b, -1) @ w["wo"]
        x = x + (ref_conv(out, dyn, lp["attn_conv_base"], 1, cfg.conv_group_size) if conv else out)
        xn = ref_rms(x, w["mlp_norm"])
        if conv:
            dyn = xn @ lp["mlp_conv_proj"]
            xn = ref_conv(xn, dyn, lp["mlp_conv_base"], 0, cfg.conv_group_size)
        out = ref_swiglu(xn, w["gate"], w["up"], w["down"])
        x = x + (ref_conv(out, dyn, lp["mlp_conv_base"], 1, cfg.conv_group_size) if conv else out)
    h = ref_rms(x, p["norm"])
    logits = (h[1:] @ f64(lm_head)) * cfg.output_multiplier
    if cfg.final_logit_softcapping:
        cap = cfg.final_logit_softcapping
        logits = cap * np.tanh(logits / cap)
    return h, logits


# ---------------------------------------------------------------------------------------
# Random weights and configs.

def drafter_config(windows, causal, block_size, n_taps=2, family="dflash", **kw) -> DrafterConfig:
    return DrafterConfig(
        family=family, hidden_size=H, intermediate_size=F, num_layers=len(windows), num_heads=NH,
        num_kv_heads=NKV, head_dim=HD, rms_norm_eps=EPS, rope=RopeConfig(THETA), block_size=block_size,
        mask_token_id=MASK_ID, target_layer_ids=tuple(range(n_taps)), layer_window=tuple(windows),
        causal=tuple(causal), vocab_size=V, **kw)


def target_config(num_layers=1) -> TargetConfig:
    return TargetConfig(arch="qwen3", vocab_size=V, hidden_size=H, intermediate_size=F, num_layers=num_layers,
                        num_heads=NH, num_kv_heads=NKV, head_dim=HD, rms_norm_eps=EPS, rope=RopeConfig(THETA))


def normal(rng, shape, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)


def norm_weight(rng, n):
    return jnp.asarray(1.0 + 0.2 * rng.standard_normal(n), jnp.float32)


def random_drafter(rng, cfg: DrafterConfig) -> dict:
    def layer():
        return {"attn_norm": norm_weight(rng, H), "wq": normal(rng, (H, NH * HD), H ** -0.5),
                "wkv": normal(rng, (H, 2 * NKV * HD), H ** -0.5), "q_norm": norm_weight(rng, HD),
                "k_norm": norm_weight(rng, HD), "wo": normal(rng, (NH * HD, H), (NH * HD) ** -0.5),
                "mlp_norm": norm_weight(rng, H), "w_gate_up": normal(rng, (H, 2 * F), H ** -0.5),
                "w_down": normal(rng, (F, H), F ** -0.5)}

    def conv(layer_params):
        width = 2 * cfg.conv_kernel_size * (H // cfg.conv_group_size)
        for name in ("attn_conv", "mlp_conv"):
            base = np.zeros((2, cfg.conv_kernel_size, H))
            base[:, 0] = 1.0
            layer_params[f"{name}_base"] = jnp.asarray(base + 0.3 * rng.standard_normal(base.shape), jnp.float32)
            layer_params[f"{name}_proj"] = normal(rng, (H, width), 0.5 * H ** -0.5)
        return layer_params

    d2 = cfg.family == "dflash2"
    params = {"fc": normal(rng, (cfg.n_taps * H, H), (cfg.n_taps * H) ** -0.5), "hidden_norm": norm_weight(rng, H),
              "norm": norm_weight(rng, H), **{f"layers_{i}": conv(layer()) if d2 else layer()
                                              for i in range(cfg.num_layers)}}
    if d2:
        r = cfg.selector_rank
        params.update(selector_pred=normal(rng, (V, r)), selector_succ=normal(rng, (V, r)),
                      selector_hidden=normal(rng, (H, r), H ** -0.5))
    return params


def random_target(rng, num_layers: int) -> dict:
    def layer():
        return {"attn_norm": norm_weight(rng, H), "wqkv": normal(rng, (H, (NH + 2 * NKV) * HD), H ** -0.5),
                "q_norm": norm_weight(rng, HD), "k_norm": norm_weight(rng, HD),
                "wo": normal(rng, (NH * HD, H), (NH * HD) ** -0.5), "mlp_norm": norm_weight(rng, H),
                "w_gate_up": normal(rng, (H, 2 * F), H ** -0.5), "w_down": normal(rng, (F, H), F ** -0.5)}

    return {"embed": normal(rng, (V, H)), **{f"layers_{i}": layer() for i in range(num_layers)},
            "final_norm": norm_weight(rng, H), "lm_head": normal(rng, (H, V), H ** -0.5)}


def head_only_target(rng) -> dict:
    """The two target tensors the drafter reads: the embedding table and the LM head."""
    return {"embed": normal(rng, (V, H)), "lm_head": normal(rng, (H, V), H ** -0.5)}


def head_target(tparams: dict) -> DenseTarget:
    """A one-layer Target around the embedding table and LM head of `tparams`; the drafter reads
    nothing else of it, so its layer and final norm are zero placeholders."""
    filler = jax.tree.map(jnp.zeros_like, random_target(np.random.default_rng(0), 1))
    return make_target(target_config(), {**filler, **tparams})


# ---------------------------------------------------------------------------------------
# Library side and comparison helpers.

@functools.partial(jax.jit, static_argnums=1)
def library_step(dparams, cfg, tparams, taps, ctx_lens, anchors):
    """ingest (all rows at start 0) -> commit seq_len per row -> block_input -> draft_hidden -> harvest_logits."""
    bsz, t, _ = taps.shape
    drafter, target = drafter_family(cfg).cls(cfg, dparams), head_target(tparams)
    state = drafter.init_state(bsz, t + cfg.block_size + 4)
    state, pending = drafter.ingest(state, taps, jnp.zeros((bsz,), jnp.int32))
    state = drafter.commit(state, pending, ctx_lens)
    h = drafter.draft_hidden(state, drafter.block_input(target, anchors))
    return h, drafter.harvest_logits(target, h)


@functools.partial(jax.jit, static_argnums=1)
def library_train(dparams, cfg, tparams, taps, anchor_tokens, anchors):
    """Block inputs for each anchor `[B, A]`, then `train_hidden`."""
    drafter, target = drafter_family(cfg).cls(cfg, dparams), head_target(tparams)
    x = jax.vmap(lambda a: drafter.block_input(target, a), in_axes=1, out_axes=1)(anchor_tokens)
    return drafter.train_hidden(taps, x, anchors)


def rel_err(actual, expected) -> float:
    expected = np.asarray(expected, np.float64)
    return float(np.max(np.abs(np.asarray(actual, np.float64) - expected)) / np.max(np.abs(expected)))


def assert_close(actual, expected, what: str):
    assert np.shape(actual) == np.shape(expected), f"{what}: shape {np.shape(actual)} != {np.shape(expected)}"
    err = rel_err(actual, expected)
    assert err <= TOL, f"{what}: library differs from the §4 reference by {err:.2e} (relative) > {TOL}"


@dataclasses.dataclass
class Case:
    """One checked row: the weights, inputs and the library's outputs."""

    cfg: DrafterConfig
    dparams: dict
    tparams: dict
    taps: np.ndarray
    anchor: int
    h: np.ndarray
    logits: np.ndarray


def check_single_row(cfg, seed, t) -> Case:
    """Library vs reference for one row with T context tokens."""
    rng = np.random.default_rng(seed)
    dparams, tparams = random_drafter(rng, cfg), head_only_target(rng)
    taps = rng.standard_normal((1, t, cfg.n_taps * H)).astype(np.float32)
    anchor = int(rng.integers(0, V - 1))
    h, logits = library_step(dparams, cfg, tparams, jnp.asarray(taps), jnp.asarray([t], jnp.int32),
                             jnp.asarray([anchor], jnp.int32))
    ref_h, ref_logits = reference_step(dparams, cfg, tparams["embed"], tparams["lm_head"], taps[0], anchor)
    assert_close(h[0], ref_h, "hidden states")
    assert_close(logits[0], ref_logits, "logits of rows 1..b-1")
    return Case(cfg, dparams, tparams, taps[0], anchor, np.asarray(h[0]), np.asarray(logits[0]))


def assert_variant_differs(case: Case, what: str, conv: bool = True, **changes):
    """The reference with `changes` to the config (or without DFlash2's convolutions) must be far from the
    library: the feature matters."""
    alt_h, alt_logits = reference_step(case.dparams, dataclasses.replace(case.cfg, **changes),
                                       case.tparams["embed"], case.tparams["lm_head"], case.taps, case.anchor, conv)
    err = max(rel_err(case.h, alt_h), rel_err(case.logits, alt_logits))
    assert err > TEETH, f"{what}: changing {changes} moves the result by only {err:.2e}; the case does not test it"


# ---------------------------------------------------------------------------------------
# Tests.

def test_full_attention_bidirectional_block_matches_reference():
    case = check_single_row(drafter_config([None, None], [False, False], block_size=4), seed=0, t=6)
    assert_variant_differs(case, "bidirectional block", causal=(True, True))


def test_sliding_causal_drops_context_beyond_window():
    case = check_single_row(drafter_config([4, 4], [True, True], block_size=6), seed=1, t=12)
    assert_variant_differs(case, "sliding window over a longer context", layer_window=(None, None))


def test_sliding_symmetric_window_smaller_than_block_limits_future_keys():
    case = check_single_row(drafter_config([3, 3], [False, False], block_size=8), seed=2, t=10)
    assert_variant_differs(case, "future side of the symmetric window", causal=(True, True))
    assert_variant_differs(case, "symmetric window", layer_window=(None, None))


def test_mixed_layer_drafter_applies_each_layers_mask():
    cfg = drafter_config([None, 4, None, 3], [False, True, True, False], block_size=5, n_taps=3)
    case = check_single_row(cfg, seed=3, t=9)
    assert_variant_differs(case, "per-layer masks", layer_window=(None,) * 4, causal=(False,) * 4)


def test_embedding_scale_output_multiplier_and_softcap_follow_reference():
    cfg = drafter_config([None, 3], [False, True], block_size=4, input_embedding_scale=0.37,
                         output_multiplier=2.5, final_logit_softcapping=1.5)
    case = check_single_row(cfg, seed=4, t=7)
    assert np.abs(case.logits).max() > 0.75 * 1.5, "softcapped logits should reach the nonlinear part of tanh"
    assert_variant_differs(case, "input_embedding_scale", input_embedding_scale=1.0)
    assert_variant_differs(case, "output_multiplier", output_multiplier=1.0)
    assert_variant_differs(case, "softcap", final_logit_softcapping=None)


def test_ragged_batch_rows_see_only_their_own_context():
    cfg = drafter_config([None, 4], [False, True], block_size=5)
    rng = np.random.default_rng(5)
    dparams, tparams = random_drafter(rng, cfg), head_only_target(rng)
    lens = [12, 7]
    taps = rng.standard_normal((2, max(lens), cfg.n_taps * H)).astype(np.float32)
    taps[1, lens[1]:] = 50.0 * rng.standard_normal((max(lens) - lens[1], cfg.n_taps * H))  # junk past seq_len
    anchors = [3, 17]
    h, logits = library_step(dparams, cfg, tparams, jnp.asarray(taps), jnp.asarray(lens, jnp.int32),
                             jnp.asarray(anchors, jnp.int32))
    for row, (t, a) in enumerate(zip(lens, anchors)):
        ref_h, ref_logits = reference_step(dparams, cfg, tparams["embed"], tparams["lm_head"], taps[row, :t], a)
        assert_close(h[row], ref_h, f"row {row} (context {t}) hidden states")
        assert_close(logits[row], ref_logits, f"row {row} (context {t}) logits")


@pytest.mark.parametrize("windows,causal", [((None, 3), (False, True)), ((3, None), (False, True))],
                         ids=["full-bidir+sliding-causal", "sliding-symmetric+full-causal"])
def test_training_forward_matches_reference_at_each_anchor(windows, causal):
    cfg = drafter_config(windows, causal, block_size=4)
    rng = np.random.default_rng(6)
    dparams, tparams = random_drafter(rng, cfg), head_only_target(rng)
    t = 14
    taps = rng.standard_normal((2, t, cfg.n_taps * H)).astype(np.float32)
    tokens = rng.integers(0, V - 1, size=(2, t))
    anchors = np.array([[3, 9], [6, 8]])  # row 1's blocks overlap in position: they must not see each other
    anchor_tokens = jnp.asarray(np.take_along_axis(tokens, anchors, axis=1), jnp.int32)
    h = np.asarray(library_train(dparams, cfg, tparams, jnp.asarray(taps), anchor_tokens,
                                 jnp.asarray(anchors, jnp.int32)))
    for row in range(2):
        for j, a in enumerate(anchors[row]):
            ref_h, _ = reference_step(dparams, cfg, tparams["embed"], tparams["lm_head"], taps[row, :a],
                                      int(tokens[row, a]))
            assert_close(h[row, j], ref_h, f"training block at anchor {a} (row {row}) hidden states")


def test_propose_on_a_real_target_matches_reference_with_target_taps():
    tcfg = target_config(num_layers=3)
    cfg = drafter_config([4, None], [True, False], block_size=4, n_taps=2)
    cfg = dataclasses.replace(cfg, target_layer_ids=(0, 2))
    rng = np.random.default_rng(7)
    target = make_target(tcfg, random_target(rng, tcfg.num_layers))
    drafter = make_drafter(cfg, random_drafter(rng, cfg))
    prompts = [list(rng.integers(0, V - 1, size=9)), list(rng.integers(0, V - 1, size=5))]
    prop = propose(target, drafter, prompts)
    assert prop.logits.shape == (2, cfg.n_drafts, V), f"proposal logits shape {prop.logits.shape}"
    for row, prompt in enumerate(prompts):
        tokens = jnp.asarray([prompt], jnp.int32)
        target_h, taps = target.forward(tokens, cfg.target_layer_ids)
        target_logits = target.logits(target_h)
        first = int(np.argmax(np.asarray(target_logits)[0, -1]))
        assert int(prop.anchor[row]) == first, f"row {row}: anchor {prop.anchor[row]} != target argmax {first}"
        _, ref_logits = reference_step(drafter.params, cfg, target.params["embed"], target.params["lm_head"],
                                       np.asarray(taps)[0], first)
        assert_close(prop.logits[row], ref_logits, f"propose row {row} (prompt length {len(prompt)}) logits")
        np.testing.assert_array_equal(prop.tokens[row], np.argmax(ref_logits, -1),
                                      err_msg=f"row {row}: greedy drafts are the argmax of the reference logits")


# ---------------------------------------------------------------------------------------
# DFlash2: the convolutions around each sublayer, and the selector walk.

def dflash2_config(block_size: int = 4, window: int = 4, **kw) -> DrafterConfig:
    return drafter_config([window, window], [False, False], block_size, family="dflash2", selector_rank=4,
                          selector_top_k=5, conv_kernel_size=kw.pop("conv_kernel_size", 2), conv_group_size=8, **kw)


@pytest.mark.parametrize("kernel", [2, 3])
def test_dflash2_block_forward_matches_reference(kernel):
    case = check_single_row(dflash2_config(conv_kernel_size=kernel), seed=8, t=11)
    assert_variant_differs(case, "the dynamic convolutions", conv=False)
    assert_variant_differs(case, "the symmetric window over a longer context", layer_window=(None, None))


def test_dflash2_training_blocks_convolve_each_block_alone():
    cfg = dflash2_config(block_size=4, window=4)
    rng = np.random.default_rng(9)
    dparams, tparams = random_drafter(rng, cfg), head_only_target(rng)
    t = 14
    taps = rng.standard_normal((1, t, cfg.n_taps * H)).astype(np.float32)
    tokens = rng.integers(0, V - 1, size=(1, t))
    anchors = np.array([[3, 7, 9]])  # adjacent blocks: a convolution crossing them would read the block before
    anchor_tokens = jnp.asarray(np.take_along_axis(tokens, anchors, axis=1), jnp.int32)
    h = np.asarray(library_train(dparams, cfg, tparams, jnp.asarray(taps), anchor_tokens,
                                 jnp.asarray(anchors, jnp.int32)))
    for j, a in enumerate(anchors[0]):
        ref_h, _ = reference_step(dparams, cfg, tparams["embed"], tparams["lm_head"], taps[0, :a], int(tokens[0, a]))
        assert_close(h[0, j], ref_h, f"DFlash2 training block at anchor {a} hidden states")


def test_dflash2_propose_walks_the_selector_over_the_reference_logits():
    tcfg = target_config(num_layers=3)
    cfg = dataclasses.replace(dflash2_config(block_size=8, window=8), target_layer_ids=(0, 2))
    rng = np.random.default_rng(10)
    target = make_target(tcfg, random_target(rng, tcfg.num_layers))
    dparams = random_drafter(rng, cfg)
    dparams.update(selector_pred=3.0 * dparams["selector_pred"], selector_succ=3.0 * dparams["selector_succ"])
    drafter = make_drafter(cfg, dparams)
    prompts = [list(rng.integers(0, V - 1, size=9)), list(rng.integers(0, V - 1, size=5))]
    prop = propose(target, drafter, prompts)
    p = jax.tree_util.tree_map(f64, dparams)
    for row, prompt in enumerate(prompts):
        _, taps = target.forward(jnp.asarray([prompt], jnp.int32), cfg.target_layer_ids)
        anchor = int(prop.anchor[row])
        ref_h, ref_logits = reference_step(dparams, cfg, target.params["embed"], target.params["lm_head"],
                                           np.asarray(taps)[0], anchor)
        assert_close(prop.logits[row], ref_logits, f"DFlash2 propose row {row} logits")
        path = ref_walk(p["selector_pred"], p["selector_succ"], ref_logits, ref_h[1:] @ p["selector_hidden"],
                        anchor, cfg.selector_top_k)
        np.testing.assert_array_equal(prop.tokens[row], path, err_msg=f"row {row}: drafts are the selector's walk")
        assert list(np.argmax(ref_logits, -1)) != path, f"row {row}: the selector must change some draft here"
