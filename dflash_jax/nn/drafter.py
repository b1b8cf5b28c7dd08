"""The DFlash drafter (DESIGN.md §4): context projection, block forward, harvest, LM head.

The drafter has no embedding table and no LM head of its own: it embeds the block with
the target's table and reads logits through the target's head.

Context tokens are projected once (`ingest`): `ctx = RMSNorm(fc(taps))`, then per layer
`k = RoPE(k_norm(k_proj(ctx)))`, `v = v_proj(ctx)`, written into the draft cache at their
absolute positions. A block `[anchor, mask, ...]` then runs through the layers with queries
from the block only and keys `[draft cache ; block]`; block K/V are never kept.
"""
from __future__ import annotations

import functools
from typing import Callable

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dflash_jax.cache import KVCache, init_kv, write_rows
from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.nn import dense
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
class Drafter:
    """A drafter: frozen census config (static) and its parameter pytree."""

    config: DrafterConfig = struct.field(pytree_node=False)
    params: dict

    def init_cache(self, batch: int, capacity: int) -> KVCache:
        c = self.config
        return init_kv(batch, capacity, c.num_layers, c.num_kv_heads, c.head_dim, self.params["fc"].dtype)


@functools.lru_cache(maxsize=None)
def _rope(cfg: DrafterConfig) -> tuple[np.ndarray, float]:
    # the census fills original_max_position_embeddings for scaled ropes, so no limit is needed here
    return rope_frequencies(cfg.rope, cfg.head_dim, 0)


def _kv(lp: dict, cfg: DrafterConfig, x: jax.Array, positions: jax.Array):
    k, v = jnp.split(x @ lp["wkv"], 2, axis=-1)
    k = rms_norm(split_heads(k, cfg.head_dim), lp["k_norm"], cfg.rms_norm_eps)
    inv_freq, scale = _rope(cfg)
    return apply_rope(k, positions, inv_freq, scale), split_heads(v, cfg.head_dim)


def context_features(params: dict, cfg: DrafterConfig, taps: jax.Array) -> jax.Array:
    """`ctx = RMSNorm_hidden(fc(taps))`: `[..., n_taps*H] -> [..., H]`."""
    return rms_norm(taps @ params["fc"], params["hidden_norm"], cfg.rms_norm_eps)


def context_kv(params: dict, cfg: DrafterConfig, taps: jax.Array, positions: jax.Array) -> list:
    """Per draft layer `(k, v)` of context tokens with taps `[B, T, n_taps*H]` at `positions [B, T]`."""
    ctx = context_features(params, cfg, taps)
    return [_kv(lp, cfg, ctx, positions) for lp in params["layers"]]


def ingest(params: dict, cfg: DrafterConfig, cache: KVCache, taps: jax.Array, start: jax.Array) -> KVCache:
    """Project context taps `[B, T, n_taps*H]` and write them at positions `start[b] + t`.

    `cache.seq_len` is left to the caller (it knows how many of the T rows are real).
    """
    b, t, _ = taps.shape
    chex.assert_shape(taps, (b, t, cfg.n_taps * cfg.hidden_size))
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    kvs = context_kv(params, cfg, taps, positions)
    return cache.replace(k=tuple(write_rows(kc, k, start) for kc, (k, _) in zip(cache.k, kvs)),
                         v=tuple(write_rows(vc, v, start) for vc, (_, v) in zip(cache.v, kvs)))


def _layers(params: dict, cfg: DrafterConfig, x: jax.Array, positions: jax.Array, attend: Callable) -> jax.Array:
    """The pre-norm residual stack over block rows; `attend(i, q, k, v)` does layer i's attention."""
    inv_freq, scale = _rope(cfg)
    for i, lp in enumerate(params["layers"]):
        xn = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
        q = rms_norm(split_heads(xn @ lp["wq"], cfg.head_dim), lp["q_norm"], cfg.rms_norm_eps)
        q = apply_rope(q, positions, inv_freq, scale)
        k, v = _kv(lp, cfg, xn, positions)
        x = x + merge_heads(attend(i, q, k, v)) @ lp["wo"]
        x = x + swiglu(rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps), lp["w_gate_up"], lp["w_down"])
    return rms_norm(x, params["norm"], cfg.rms_norm_eps)


def block_input(target_params: dict, cfg: DrafterConfig, anchor: jax.Array) -> jax.Array:
    """Embed `[anchor, mask, ..., mask]` (length b) with the target's table, times the input scale."""
    b = anchor.shape[0]
    mask = jnp.full((b, cfg.block_size - 1), cfg.mask_token_id, jnp.int32)
    tokens = jnp.concatenate([anchor[:, None].astype(jnp.int32), mask], axis=1)
    x = dense.embed(target_params, tokens)
    return x * jnp.asarray(cfg.input_embedding_scale, x.dtype) if cfg.input_embedding_scale != 1.0 else x


def draft_hidden(params: dict, cfg: DrafterConfig, cache: KVCache, x: jax.Array, impl: str = "xla") -> jax.Array:
    """Block forward at positions `cache.seq_len[b] + i` over the draft cache: `[B,b,H] -> [B,b,H]`."""
    b, w, _ = x.shape
    ctx_len = cache.seq_len
    positions = ctx_len[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :]

    def attend(i, q, k, v):
        return block_attention(q, cache.k[i], cache.v[i], ctx_len, k, v, scale=cfg.head_dim ** -0.5,
                               causal=cfg.causal[i], window=cfg.layer_window[i], impl=impl)

    return _layers(params, cfg, x, positions, attend)


def draft_logits(target_params: dict, target_cfg: TargetConfig, cfg: DrafterConfig, h: jax.Array) -> jax.Array:
    """Harvested rows -> target LM head -> `* output_multiplier` -> optional softcap (float32)."""
    logits = dense.lm_logits(target_params, target_cfg, h[:, cfg.first_row:])
    if cfg.output_multiplier != 1.0:
        logits = logits * cfg.output_multiplier
    if cfg.final_logit_softcapping:
        cap = cfg.final_logit_softcapping
        logits = cap * jnp.tanh(logits / cap)
    return logits


def block_mask(cfg: DrafterConfig, layer: int, anchors: jax.Array, seq_len: int) -> jax.Array:
    """Training mask for blocks at `anchors [B, A]`: rows `[B, A*b]` over keys `[T ; A*b]`.

    Block j's row r (position a_j + r) sees context positions `< a_j` (within the window) and
    the rows of its own block allowed by the layer's causality and window.
    """
    bsz, n_blocks = anchors.shape
    b, window, causal = cfg.block_size, cfg.layer_window[layer], cfg.causal[layer]
    r = jnp.arange(b)
    qpos = anchors[:, :, None] + r  # [B, A, b]
    kpos = jnp.arange(seq_len)
    ctx = kpos[None, None, None, :] < anchors[:, :, None, None]
    if window is not None:
        ctx &= qpos[..., None] - kpos < window
    same = jnp.eye(n_blocks, dtype=bool)[:, None, :, None]  # [A, 1, A, 1]
    d = r[:, None] - r[None, :]  # query row - key row
    inner = jnp.ones((b, b), bool)
    if causal:
        inner &= d >= 0
    if window is not None:
        inner &= (d < window) & (causal | (-d < window))
    blk = same & inner[None, :, None, :]  # [A, b, A, b]
    blk = jnp.broadcast_to(blk, (bsz, n_blocks, b, n_blocks, b)).reshape(bsz, n_blocks * b, n_blocks * b)
    ctx = jnp.broadcast_to(ctx, (bsz, n_blocks, b, seq_len)).reshape(bsz, n_blocks * b, seq_len)
    return jnp.concatenate([ctx, blk], axis=-1)


def draft_hidden_train(params: dict, cfg: DrafterConfig, taps: jax.Array, x: jax.Array,
                       anchors: jax.Array) -> jax.Array:
    """Training forward of many blocks at once: taps `[B,T,n*H]`, block inputs `x [B,A,b,H]`
    at `anchors [B,A]` -> hidden `[B,A,b,H]`. Same maths as `draft_hidden` with an explicit mask."""
    bsz, n_blocks, b, hidden = x.shape
    t = taps.shape[1]
    ctx_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (bsz, t))
    ctx_kv = context_kv(params, cfg, taps, ctx_pos)
    positions = (anchors[:, :, None] + jnp.arange(b, dtype=jnp.int32)).reshape(bsz, n_blocks * b)
    masks = [block_mask(cfg, i, anchors, t) for i in range(cfg.num_layers)]

    def attend(i, q, k, v):
        kc, vc = ctx_kv[i]
        return masked_attention(q, jnp.concatenate([kc, k], 1), jnp.concatenate([vc, v], 1), masks[i],
                                cfg.head_dim ** -0.5)

    h = _layers(params, cfg, x.reshape(bsz, n_blocks * b, hidden), positions, attend)
    return h.reshape(bsz, n_blocks, b, hidden)
