"""Gated DeltaNet, the linear-attention layer of the hybrid targets (docs/architecture.md, "Hybrid targets").

    in_proj -> causal depthwise conv (with state) + SiLU on q|k|v -> L2-normalised q, k
    -> gated delta rule over the recurrent state (gates g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b))
    -> gated RMSNorm with z -> out_proj

Pure functions over a parameter dict (`HybridLayer` holds the parameters). The delta rule itself is in
`pallas_kernels/gated_delta.py`: the chunked form for wide blocks, and per-position states for `extend`, so
that `commit` can keep any prefix of a verify block. Recurrent state is float32.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from dflash_jax.config.targets import HybridConfig
from dflash_jax.targets.layers import matmul
from pallas_kernels.gated_delta import (causal_conv, conv_state_at, delta_chunk, delta_rule, delta_step,
                                        l2_normalize, state_at, step_takes)
from pallas_kernels.mesh import context_mesh

STEP_KERNEL = True
"""Whether a decode step (one position, `impl` not "xla") runs the layer from its conv window to the delta rule's
output in one kernel (`gated_delta.delta_step`) instead of XLA's ten or so. On: alone it took the 35B-A3B shape's
decode step (32 layers) from 3.223 to 3.140 ms on an H100, 2.6% (bench/results/decode_kernels.json, each setting
compiled once and timed in turn, passes within 0.5%)."""

GDN_CHUNK = 64
"""Positions per chunk of the chunked delta rule; a block this wide or wider with `valid` (a prefill chunk) takes
that form, which keeps one state per chunk instead of one per position."""


def split_projection(cfg: HybridConfig, p: jax.Array) -> tuple:
    """The fused input projection `[B, W, P]` -> `(q|k|v [B, W, conv_dim], z [B, W, nv, hv], b, a [B, W, nv])`.

    Qwen3.5 stores q|k|v, z, b, a one after another; Qwen3-Next interleaves q, k, v, z (and b, a) per key head.
    """
    b, w = p.shape[:2]
    nk, nv, hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, \
        cfg.linear_value_head_dim
    kd, vd, r = cfg.key_dim, cfg.value_dim, nv // nk
    if cfg.arch == "qwen3_next":
        qkvz = p[..., :2 * kd + 2 * vd].reshape(b, w, nk, 2 * hk + 2 * r * hv)
        q, k, v, z = jnp.split(qkvz, [hk, 2 * hk, 2 * hk + r * hv], axis=-1)
        ba = p[..., 2 * kd + 2 * vd:].reshape(b, w, nk, 2 * r)
        mixed = jnp.concatenate([q.reshape(b, w, kd), k.reshape(b, w, kd), v.reshape(b, w, vd)], axis=-1)
        return mixed, z.reshape(b, w, nv, hv), ba[..., :r].reshape(b, w, nv), ba[..., r:].reshape(b, w, nv)
    mixed, z, beta, a = jnp.split(p, [2 * kd + vd, 2 * kd + 2 * vd, 2 * kd + 2 * vd + nv], axis=-1)
    return mixed, z.reshape(b, w, nv, hv), beta, a


def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm of `x` times `silu(gate)`, the gate in float32 (transformers' `RMSNormGated`)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return ((weight * xf.astype(x.dtype)) * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


def gated_delta_net(cfg: HybridConfig, p: dict, x: jax.Array, conv_state: jax.Array, ssm_state: jax.Array,
                    valid: Optional[jax.Array] = None, impl: str = "xla") -> tuple:
    """The layer on normed `x [B, W, H]` after `conv_state [B, K-1, conv_dim]` and `ssm_state f32[B, nv, hk, hv]`.

    Returns `(out [B, W, H], conv, ssm)`. Without `valid`: `conv` is the window `[B, K-1+W, conv_dim]` holding
    the conv state after every position, and `ssm` the per-position updates `(k, u, g)` from which
    `gated_delta.state_at` folds the state after any prefix, so that any prefix can be kept. With `valid [B]`:
    positions from `valid[b]` on are padding (gates masked so they leave the state as it is) and `conv`, `ssm` are
    the states after the first `valid[b]` positions. `impl`, the attention's, picks `delta_chunk`'s form for blocks
    narrower than `GDN_CHUNK`: the reference with "xla", the "pallas" kernel with any other; with any other, a
    decode step (one position, no `valid`) runs from the conv window on in one kernel (`step_kernel_takes`).
    """
    b, w, _ = x.shape
    nk = cfg.linear_num_key_heads
    mixed, z, beta, a = split_projection(cfg, matmul(x, p["in_proj"]))
    beta = jax.nn.sigmoid(beta).astype(jnp.float32)
    g = -jnp.exp(p["A_log"].astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32)
                                                                    + p["dt_bias"].astype(jnp.float32))
    if w == 1 and valid is None and impl != "xla" and step_kernel_takes(cfg, ssm_state):
        conv = jnp.concatenate([conv_state, mixed], axis=1)
        o, u, k = delta_step(conv, p["conv"], g, beta, ssm_state, key_heads=nk, dtype=x.dtype)
        ssm = (k, u, g)
    else:
        o, conv, ssm = _mixer(cfg, p, mixed, beta, g, conv_state, ssm_state, valid, impl)
    o = gated_rms_norm(o.astype(x.dtype), z, p["norm"], cfg.rms_norm_eps)
    return matmul(o.reshape(b, w, cfg.value_dim), p["out_proj"]), conv, ssm


def _mixer(cfg: HybridConfig, p: dict, mixed, beta, g, conv_state, ssm_state, valid, impl) -> tuple:
    """The jnp path from the projected q|k|v to the delta rule's output: `(out, conv, ssm)` as `gated_delta_net`."""
    b, w, _ = mixed.shape
    nk, nv, hk = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim
    y, window = causal_conv(mixed, conv_state, p["conv"])
    q, k, v = jnp.split(y, [cfg.key_dim, 2 * cfg.key_dim], axis=-1)
    if valid is not None:
        live = (jnp.arange(w, dtype=jnp.int32)[None, :] < valid[:, None])[..., None]
        beta, g = jnp.where(live, beta, 0.0), jnp.where(live, g, 0.0)
    r = nv // nk
    q = jnp.repeat(l2_normalize(q.reshape(b, w, nk, hk).astype(jnp.float32)), r, axis=2) * hk ** -0.5
    k = jnp.repeat(l2_normalize(k.reshape(b, w, nk, hk).astype(jnp.float32)), r, axis=2)
    v = v.reshape(b, w, nv, cfg.linear_value_head_dim).astype(jnp.float32)
    if valid is not None and w >= GDN_CHUNK:
        o, ssm = delta_rule(ssm_state, q, k, v, g, beta, chunk=GDN_CHUNK)
    else:
        o, u = delta_chunk(ssm_state, q, k, v, g, beta, impl="xla" if impl == "xla" else "pallas")
        # a narrow block folds its state from the same updates as a verify's commit: bit for bit
        ssm = (k, u, g) if valid is None else state_at(ssm_state, k, u, g, valid)
    conv = window if valid is None else conv_state_at(window, valid, kernel_size=cfg.linear_conv_kernel)
    return o, conv, ssm


def step_kernel_takes(cfg: HybridConfig, ssm_state: jax.Array) -> bool:
    """Whether a decode step runs `gated_delta.delta_step` (`STEP_KERNEL`, the layer's shape, no mesh: the kernel
    reads q|k|v by channel blocks, which a split over heads would not keep whole)."""
    return (STEP_KERNEL and context_mesh() is None
            and step_takes(cfg.conv_dim, cfg.linear_num_key_heads, ssm_state.shape, cfg.linear_conv_kernel))


def forward(cfg: HybridConfig, p: dict, x: jax.Array) -> jax.Array:
    """The layer over a whole sequence from empty state (the uncached forward): the chunked delta rule."""
    b, t, _ = x.shape
    conv0 = jnp.zeros((b, cfg.linear_conv_kernel - 1, cfg.conv_dim), x.dtype)
    ssm0 = jnp.zeros((b, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
                     jnp.float32)
    return gated_delta_net(cfg, p, x, conv0, ssm0, valid=jnp.full((b,), t, jnp.int32))[0]
