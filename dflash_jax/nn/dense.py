"""Dense decoder targets (Qwen3, Llama): uncached forward, cached `extend`, LM head.

`extend` is the one cached forward: it runs a `[B, W]` block at per-row start positions
over the KV cache and writes the block's K/V. Chunked prefill and speculative verify are
both `extend` calls; the caller decides how far `seq_len` moves.
"""
from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dflash_jax.cache import KVCache, init_kv, write_rows
from dflash_jax.config import TargetConfig
from dflash_jax.nn.layers import (
    apply_rope,
    block_attention,
    masked_attention,
    merge_heads,
    rms_norm,
    rope_frequencies,
    split_heads,
    swiglu,
)


@struct.dataclass
class Target:
    """A target model: frozen config (static) and its parameter pytree."""

    config: TargetConfig = struct.field(pytree_node=False)
    params: dict

    def logits(self, token_ids) -> jax.Array:
        """Full causal forward without a cache: `int[B, T] -> float32[B, T, V]`."""
        tokens = check_token_ids(token_ids, self.config.vocab_size)
        return _jit_logits(self, tokens)

    def init_cache(self, batch: int, capacity: int) -> KVCache:
        c = self.config
        return init_kv(batch, capacity, c.num_layers, c.num_kv_heads, c.head_dim, self.params["embed"].dtype)

    def prefill(self, cache: KVCache, tokens, lengths, tap_ids: tuple = (), impl: str = "xla"):
        """Right-padded prompts `tokens [B, T]` with per-row `lengths [B]` into an empty cache.

        Returns `(logits f32[B, T, V], taps [B, T, n_taps*H] or None, cache)` with
        `cache.seq_len = lengths`. (Generation uses the chunked `decode.prefill`, which keeps
        only the last row's logits.)
        """
        lengths = jnp.asarray(lengths, jnp.int32)
        start = jnp.zeros_like(lengths)
        h, taps, cache = extend(self.params, self.config, cache, jnp.asarray(tokens, jnp.int32), start, tap_ids, impl)
        return lm_logits(self.params, self.config, h), taps, cache.replace(seq_len=lengths)

    def verify(self, cache: KVCache, tokens, start, tap_ids: tuple = (), impl: str = "xla"):
        """A `[B, W]` block at per-row positions `start [B]`: `(logits f32[B, W, V], taps, cache)`.

        The block's K/V are written; `cache.seq_len` is unchanged, so the caller commits the
        accepted prefix by moving it (rolling back is not moving it).
        """
        start = jnp.asarray(start, jnp.int32)
        h, taps, cache = extend(self.params, self.config, cache, jnp.asarray(tokens, jnp.int32), start, tap_ids, impl)
        return lm_logits(self.params, self.config, h), taps, cache


def check_token_ids(token_ids, vocab_size: int) -> jax.Array:
    """Validate a 2-D array of token ids on the host; ValueError naming the problem."""
    arr = np.asarray(token_ids)
    if arr.ndim != 2:
        raise ValueError(f"token_ids must be 2-D [batch, time]; got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"token_ids is empty (shape {arr.shape}); give at least one token per row")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"token_ids must be integers; got dtype {arr.dtype}")
    if arr.min() < 0 or arr.max() >= vocab_size:
        raise ValueError(f"token id out of range [0, {vocab_size}): found min {arr.min()}, max {arr.max()}")
    return jnp.asarray(arr, jnp.int32)


@functools.lru_cache(maxsize=None)
def _rope(cfg: TargetConfig) -> tuple[np.ndarray, float]:
    return rope_frequencies(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)


def _qkv(lp: dict, cfg: TargetConfig, x: jax.Array, positions: jax.Array):
    """Fused q/k/v projection, per-head q/k norm (Qwen3) and RoPE."""
    qkv = x @ lp["wqkv"]
    if "bqkv" in lp:
        qkv = qkv + lp["bqkv"]
    q, k, v = jnp.split(qkv, [cfg.q_width, cfg.q_width + cfg.kv_width], axis=-1)
    q, k, v = (split_heads(t, cfg.head_dim) for t in (q, k, v))
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    inv_freq, scale = _rope(cfg)
    return apply_rope(q, positions, inv_freq, scale), apply_rope(k, positions, inv_freq, scale), v


def _out(lp: dict, attn: jax.Array) -> jax.Array:
    o = merge_heads(attn) @ lp["wo"]
    return o + lp["bo"] if "bo" in lp else o


def _mlp(lp: dict, cfg: TargetConfig, x: jax.Array) -> jax.Array:
    return x + swiglu(rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps), lp["w_gate_up"], lp["w_down"])


def embed(params: dict, tokens: jax.Array) -> jax.Array:
    return jnp.take(params["embed"], tokens, axis=0)


def lm_logits(params: dict, cfg: TargetConfig, h: jax.Array) -> jax.Array:
    """LM head on final-normed hidden states, in float32."""
    w = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    return jnp.matmul(h, w, preferred_element_type=jnp.float32)


def _taps(outputs: list, tap_ids: tuple) -> jax.Array | None:
    return jnp.concatenate([outputs[i] for i in tap_ids], axis=-1) if tap_ids else None


def forward(params: dict, cfg: TargetConfig, tokens: jax.Array, tap_ids: tuple = ()):
    """Uncached causal forward. Returns `(logits f32[B,T,V], taps [B,T,n_taps*H] or None)`."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    x = embed(params, tokens)
    outputs = []
    for lp in params["layers"]:
        q, k, v = _qkv(lp, cfg, rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps), positions)
        x = x + _out(lp, masked_attention(q, k, v, mask, cfg.head_dim ** -0.5))
        x = _mlp(lp, cfg, x)
        outputs.append(x)
    h = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    return lm_logits(params, cfg, h), _taps(outputs, tap_ids)


def extend(params: dict, cfg: TargetConfig, cache: KVCache, tokens: jax.Array, start: jax.Array,
           tap_ids: tuple = (), impl: str = "xla"):
    """Run block `tokens [B, W]` at positions `start[b] + i` over the cache and write its K/V.

    Attention sees cache entries `< start[b]` plus the block causally. `cache.seq_len` is left
    unchanged: the caller commits. Returns `(h [B,W,H] final-normed, taps or None, cache)`.
    """
    b, w = tokens.shape
    chex.assert_shape(start, (b,))
    positions = start[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :]
    x = embed(params, tokens)
    outputs, ks, vs = [], [], []
    for lp, kc, vc in zip(params["layers"], cache.k, cache.v):
        q, k, v = _qkv(lp, cfg, rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps), positions)
        attn = block_attention(q, kc, vc, start, k, v, scale=cfg.head_dim ** -0.5, causal=True, impl=impl)
        ks.append(write_rows(kc, k, start))
        vs.append(write_rows(vc, v, start))
        x = _mlp(lp, cfg, x + _out(lp, attn))
        outputs.append(x)
    h = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    return h, _taps(outputs, tap_ids), cache.replace(k=tuple(ks), v=tuple(vs))


@jax.jit
def _jit_logits(target: Target, tokens: jax.Array) -> jax.Array:
    return forward(target.params, target.config, tokens)[0]
