"""Building blocks shared by the target and the drafter: RMSNorm, RoPE, GQA attention, SwiGLU.

All functions are pure over arrays; weights are stored `[in, out]` (converted by the name
maps in `io/names.py`), so projections are `x @ W`, through `matmul` (full float32 for float32 models; quantised
weights through their dequantising product).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dflash_jax import quant
from dflash_jax.config import RopeConfig
from pallas_kernels.windowed_attention import block_attention, block_attention_into_cache

INIT_STD = 0.02
"""Standard deviation of fresh weights: transformers' `initializer_range` for Qwen3 / Llama."""


def init_module(module_cls, cfg, seed: int, *args) -> dict:
    """`module_cls(cfg).init(key(seed), *args)["params"]`, traced with the default rope of the same theta:
    parameters do not depend on rope scaling, so shapes stay readable for any rope the census takes."""
    cfg = dataclasses.replace(cfg, rope=RopeConfig(cfg.rope.theta))
    return module_cls(cfg).init(jax.random.key(seed), *args)["params"]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32 and cast back, as Hugging Face Qwen3/Llama do."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def rope_frequencies(rope: RopeConfig, head_dim: int, max_position_embeddings: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies `[head_dim // 2]` and the cos/sin scale for `default`, `llama3`, `yarn`.

    Computed once on the host in float32, following `transformers.modeling_rope_utils`.
    """
    base, dim = rope.theta, head_dim
    inv_freq = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    if rope.rope_type == "default":
        return inv_freq.astype(np.float32), 1.0
    orig = rope.get("original_max_position_embeddings") or max_position_embeddings
    if not orig:
        raise ValueError(f"rope type {rope.rope_type!r} needs original_max_position_embeddings (in the rope "
                         "scaling parameters or the config's max_position_embeddings); neither is set")
    if rope.rope_type == "llama3":
        factor = rope.get("factor")
        low, high = rope.get("low_freq_factor"), rope.get("high_freq_factor")
        low_wavelen, high_wavelen = orig / low, orig / high
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (orig / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
    if rope.rope_type == "yarn":
        factor = rope.get("factor") or max_position_embeddings / orig
        attention_factor = rope.get("attention_factor")
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")

        def get_mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if attention_factor is None:
            if mscale and mscale_all_dim:
                attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
            else:
                attention_factor = get_mscale(factor)
        beta_fast = rope.get("beta_fast") or 32
        beta_slow = rope.get("beta_slow") or 1

        def correction_dim(rotations):
            return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

        lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
        if rope.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - lo) / (hi - lo), 0, 1)
        extrapolation = 1 - ramp
        pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
        inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
        return inv.astype(np.float32), float(attention_factor)
    raise ValueError(f"rope_type {rope.rope_type!r} is not supported; supported: default, llama3, yarn")


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, scale: float) -> jax.Array:
    """Rotate `x [B, T, heads, hd]` (rotate-half layout) at integer `positions [B, T]`."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos = (jnp.cos(emb) * scale).astype(x.dtype)[:, :, None, :]
    sin = (jnp.sin(emb) * scale).astype(x.dtype)[:, :, None, :]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def exact(*arrays):
    """The matmul precision of a model's products: HIGHEST when an operand is float32, else the default.
    A GPU rounds float32 products through TF32 by default, and a 16-row verify then rounds a near-tie
    differently from a one-row step, so float32 greedy decoding would not be token-identical to plain
    decoding. bf16 products are left as they are (the same program as without a precision)."""
    return jax.lax.Precision.HIGHEST if any(a.dtype == jnp.float32 for a in arrays) else None


STRENGTH_REDUCED_BELOW = 10_000_000
"""XLA:GPU rewrites a vector-matrix product `x [K] @ w [K, N]` with `(N + 1) * K` below this many elements
(its `ShouldStrengthReduceDotToReduce`; a one-row `x` counts, its unit dimensions dropped) into a multiply
and a reduce, and on JAX 0.11 leaves the multiply unfused: a kernel writes the whole `[K, N]` product and a
second reads it back. In the Qwen3.5-35B-A3B shape's decode step those were the linear layers' output
projection, the router and the shared expert's gate/up, 1.57 ms of the step's 4.71 busy (H200,
bench/results/profile_round_qwen3.5-35b-a3b_before_two_rows.json); as two rows the step took 3.48 ms
(profile_round_qwen3.5-35b-a3b.json, with the attention kernel's K/V write also on)."""


def matmul(x: jax.Array, w: jax.Array, **kwargs) -> jax.Array:
    """`x @ w` at the precision `exact` gives (`kwargs` go to `jnp.matmul`, e.g. `preferred_element_type`); a
    quantised w (`quant.QWeight`) goes to its dequantising product. Every weight product of every family comes here.
    On CUDA a one-row product that XLA would strength-reduce runs as two rows (a zero row added, its output
    dropped), which XLA keeps a GEMM that reads `w` once (`STRENGTH_REDUCED_BELOW`)."""
    if quant.is_quantized(w):
        return quant.matmul(x, w, **kwargs)
    product = functools.partial(jnp.matmul, precision=exact(x, w), **kwargs)
    if math.prod(x.shape[:-1]) == 1 and w.ndim == 2 and (w.shape[1] + 1) * w.shape[0] < STRENGTH_REDUCED_BELOW:
        return lax.platform_dependent(x, w, cuda=functools.partial(as_two_rows, product), default=product)
    return product(x, w)


def as_two_rows(product, x: jax.Array, w: jax.Array) -> jax.Array:
    """`product(x, w)` for a one-row `x`, computed on `[x; 0]` and cropped to the first row."""
    rows = jnp.pad(x.reshape(1, x.shape[-1]), ((0, 1), (0, 0)))
    return product(rows, w)[:1].reshape(*x.shape[:-1], w.shape[-1])


def swiglu(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """SwiGLU MLP with gate and up fused into one `[H, 2F]` projection."""
    gate, up = jnp.split(matmul(x, w_gate_up), 2, axis=-1)
    return matmul(jax.nn.silu(gate) * up, w_down)


def split_heads(x: jax.Array, head_dim: int) -> jax.Array:
    return x.reshape(*x.shape[:-1], x.shape[-1] // head_dim, head_dim)


def merge_heads(x: jax.Array) -> jax.Array:
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float) -> jax.Array:
    """Plain GQA attention with an explicit mask: q `[B,Tq,nh,hd]`, k/v `[B,Tk,nkv,hd]`, mask `[B,Tq,Tk]`.

    Used where the mask is not the cache/block shape of `block_attention` (uncached forward,
    drafter training). Softmax in float32.
    """
    b, tq, nh, hd = q.shape
    nkv = k.shape[2]
    qg = q.reshape(b, tq, nkv, nh // nkv, hd)
    s = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, precision=exact(q), preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    o = jnp.einsum("bkgqs,bskd->bqkgd", p, v, precision=exact(v), preferred_element_type=jnp.float32)
    return o.reshape(b, tq, nh, hd).astype(q.dtype)


__all__ = [
    "INIT_STD",
    "init_module",
    "apply_rope",
    "block_attention",
    "block_attention_into_cache",
    "exact",
    "masked_attention",
    "matmul",
    "merge_heads",
    "rms_norm",
    "rope_frequencies",
    "split_heads",
    "swiglu",
]
