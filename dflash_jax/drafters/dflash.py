"""The DFlash drafter behind the Drafter interface (docs/architecture.md, "DFlash").

The drafter has no embedding table and no LM head of its own: it embeds the block with the
target's table and reads logits through the target's head (`Target.embed`, `Target.logits`).

Context tokens are projected once (`ingest`): `ctx = RMSNorm(fc(taps))`, then per layer
`k = RoPE(k_norm(k_proj(ctx)))`, `v = v_proj(ctx)`, written into the draft cache at their
absolute positions. A block `[anchor, mask, ..., mask]` then runs through the layers with
queries from the block only and keys `[draft cache ; block]`; block K/V are never kept.

Harvest: `dflash` (mask-fill) reads rows 1..b-1 as b-1 drafts; `dspark` (shifted) reads rows
0..b-1 as b drafts. Proposals are the argmax with one-hot q unless `proposal='sample'` at
T > 0, which draws each slot independently from its filtered distribution (dense q).
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from dflash_jax import sampling as smp
from dflash_jax.cache import KVCache, init_kv, write_rows
from dflash_jax.config import DrafterConfig
from dflash_jax.drafters.base import Drafter, Proposal, ProposeSettings
from dflash_jax.targets.base import Target
from dflash_jax.targets.layers import (
    INIT_STD,
    apply_rope,
    block_attention,
    init_module,
    masked_attention,
    matmul,
    merge_heads,
    rms_norm,
    rope_frequencies,
    split_heads,
    swiglu,
)

_ones, _normal = nn.initializers.ones, nn.initializers.normal(INIT_STD)


@functools.lru_cache(maxsize=None)
def _rope(cfg: DrafterConfig) -> tuple[np.ndarray, float]:
    # the census fills original_max_position_embeddings for scaled ropes, so no limit is needed here
    return rope_frequencies(cfg.rope, cfg.head_dim, 0)


class DFlashLayer(nn.Module):
    """One pre-norm draft layer: queries from block rows, keys/values from context and block."""

    cfg: DrafterConfig

    def setup(self):
        c = self.cfg
        h, f = c.hidden_size, c.intermediate_size
        self.attn_norm = self.param("attn_norm", _ones, (h,))
        self.wq = self.param("wq", _normal, (h, c.q_width))
        self.wkv = self.param("wkv", _normal, (h, 2 * c.kv_width))
        self.q_norm = self.param("q_norm", _ones, (c.head_dim,))
        self.k_norm = self.param("k_norm", _ones, (c.head_dim,))
        self.wo = self.param("wo", _normal, (c.q_width, h))
        self.mlp_norm = self.param("mlp_norm", _ones, (h,))
        self.w_gate_up = self.param("w_gate_up", _normal, (h, 2 * f))
        self.w_down = self.param("w_down", _normal, (f, h))

    def kv(self, x: jax.Array, positions: jax.Array):
        """Keys (k_norm, RoPE) and values of normed inputs `x [B, T, H]` at `positions [B, T]`."""
        c = self.cfg
        k, v = jnp.split(matmul(x, self.wkv), 2, axis=-1)
        k = rms_norm(split_heads(k, c.head_dim), self.k_norm, c.rms_norm_eps)
        inv_freq, scale = _rope(c)
        return apply_rope(k, positions, inv_freq, scale), split_heads(v, c.head_dim)

    def attention(self, xn: jax.Array, positions: jax.Array, attend: Callable) -> jax.Array:
        """The attention sublayer on normed block rows `xn [B, W, H]` (without the residual)."""
        c = self.cfg
        q = rms_norm(split_heads(matmul(xn, self.wq), c.head_dim), self.q_norm, c.rms_norm_eps)
        inv_freq, scale = _rope(c)
        q = apply_rope(q, positions, inv_freq, scale)
        k, v = self.kv(xn, positions)
        return matmul(merge_heads(attend(q, k, v)), self.wo)

    def mlp(self, xn: jax.Array) -> jax.Array:
        """The SwiGLU sublayer on normed rows (without the residual)."""
        return swiglu(xn, self.w_gate_up, self.w_down)

    def __call__(self, x: jax.Array, positions: jax.Array, attend: Callable, impl: str = "xla") -> jax.Array:
        """Block rows `x [B, W, H]`; `attend(q, k, v)` is this layer's attention (block k/v given); `impl`
        picks the kernels of families that have more (DFlash has none)."""
        c = self.cfg
        x = x + self.attention(rms_norm(x, self.attn_norm, c.rms_norm_eps), positions, attend)
        return x + self.mlp(rms_norm(x, self.mlp_norm, c.rms_norm_eps))


class DFlashModule(nn.Module):
    """`fc` and `hidden_norm` (context projection), `num_layers` DFlashLayers (`layers_{i}`), `norm`."""

    cfg: DrafterConfig
    layer_cls = DFlashLayer  # a family's layer (a class attribute, not a module field)

    def setup(self):
        c = self.cfg
        self.fc = self.param("fc", _normal, (c.n_taps * c.hidden_size, c.hidden_size))
        self.hidden_norm = self.param("hidden_norm", _ones, (c.hidden_size,))
        self.layers = [self.layer_cls(c) for _ in range(c.num_layers)]
        self.norm = self.param("norm", _ones, (c.hidden_size,))

    def context_kv(self, taps: jax.Array, positions: jax.Array) -> list:
        """Per layer `(k, v)` of context tokens: `ctx = RMSNorm_hidden(fc(taps))` projected once."""
        ctx = rms_norm(matmul(taps, self.fc), self.hidden_norm, self.cfg.rms_norm_eps)
        return [layer.kv(ctx, positions) for layer in self.layers]

    def ingest(self, cache: KVCache, taps: jax.Array, start: jax.Array) -> KVCache:
        """Project context taps `[B, T, n_taps*H]` and write them at positions `start[b] + t`."""
        b, t, _ = taps.shape
        chex.assert_shape(taps, (b, t, self.cfg.n_taps * self.cfg.hidden_size))
        positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        kvs = self.context_kv(taps, positions)
        return cache.replace(k=tuple(write_rows(kc, k, start) for kc, (k, _) in zip(cache.k, kvs)),
                             v=tuple(write_rows(vc, v, start) for vc, (_, v) in zip(cache.v, kvs)))

    def _stack(self, x: jax.Array, positions: jax.Array, attend: Callable, impl: str = "xla") -> jax.Array:
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, functools.partial(attend, i), impl)
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps)

    def draft_hidden(self, cache: KVCache, x: jax.Array, impl: str = "xla") -> jax.Array:
        """Block forward at positions `cache.seq_len[b] + i` over the draft cache: `[B,b,H] -> [B,b,H]`."""
        c = self.cfg
        ctx_len = cache.seq_len
        positions = ctx_len[:, None] + jnp.arange(x.shape[1], dtype=jnp.int32)[None, :]

        def attend(i, q, k, v):
            return block_attention(q, cache.k[i], cache.v[i], ctx_len, k, v, scale=c.head_dim ** -0.5,
                                   causal=c.causal[i], window=c.layer_window[i], impl=impl)

        return self._stack(x, positions, attend, impl)

    def train_hidden(self, taps: jax.Array, x: jax.Array, anchors: jax.Array) -> jax.Array:
        """Training forward of many blocks at once: taps `[B,T,n*H]`, block inputs `x [B,A,b,H]`
        at `anchors [B,A]` -> hidden `[B,A,b,H]`. Same maths as `draft_hidden` with an explicit mask."""
        c = self.cfg
        bsz, n_blocks, b, hidden = x.shape
        t = taps.shape[1]
        ctx_kv = self.context_kv(taps, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (bsz, t)))
        positions = (anchors[:, :, None] + jnp.arange(b, dtype=jnp.int32)).reshape(bsz, n_blocks * b)
        masks = [block_mask(c, i, anchors, t) for i in range(c.num_layers)]

        def attend(i, q, k, v):
            kc, vc = ctx_kv[i]
            return masked_attention(q, jnp.concatenate([kc, k], 1), jnp.concatenate([vc, v], 1), masks[i],
                                    c.head_dim ** -0.5)

        h = self._stack(x.reshape(bsz, n_blocks * b, hidden), positions, attend)
        return h.reshape(bsz, n_blocks, b, hidden)

    def __call__(self, taps: jax.Array, x: jax.Array, anchors: jax.Array) -> jax.Array:
        """`train_hidden` (what `init` traces to create every parameter)."""
        return self.train_hidden(taps, x, anchors)


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


def init_args(cfg: DrafterConfig) -> tuple:
    """A one-block input for `init` (taps, block rows, anchors)."""
    return (jnp.zeros((1, 1, cfg.n_taps * cfg.hidden_size)), jnp.zeros((1, 1, cfg.block_size, cfg.hidden_size)),
            jnp.ones((1, 1), jnp.int32))


def init_params(cfg: DrafterConfig, seed: int = 0, module_cls=DFlashModule) -> dict:
    """Float32 params of a drafter module (the DFlash one, or a family's that extends it), traced on one
    block: N(0, 0.02) weights, norms ones, and whatever initialisers the family's heads declare."""
    return init_module(module_cls, cfg, seed, *init_args(cfg))


@functools.lru_cache(maxsize=None)
def param_shapes(cfg: DrafterConfig, module_cls=DFlashModule):
    """The parameter pytree of `cfg` as `ShapeDtypeStruct`s, straight from the module."""
    return jax.eval_shape(functools.partial(init_params, cfg, 0, module_cls))


class DFlashDrafter(Drafter):
    """A DFlash drafter: `DFlashModule` applied purely to `params`; its state is the draft context cache."""

    module_cls = DFlashModule

    def _apply(self, method, *args):
        return self.module_cls(self.config).apply({"params": self.params}, *args, method=method)

    def init_state(self, batch: int, capacity: int) -> KVCache:
        c = self.config
        return init_kv(batch, capacity, c.num_layers, c.num_kv_heads, c.head_dim, self.params["fc"].dtype)

    def ingest(self, state: KVCache, taps: jax.Array, start: jax.Array, proposal: Optional[Proposal] = None):
        return self._apply(DFlashModule.ingest, state, taps, start), start

    def commit(self, state: KVCache, pending: jax.Array, kept: jax.Array) -> KVCache:
        return state.replace(seq_len=(pending + kept).astype(jnp.int32))

    def block_input(self, target: Target, anchor: jax.Array) -> jax.Array:
        """Embed `[anchor, mask, ..., mask]` (length b) with the target's table, times the input scale."""
        c = self.config
        mask = jnp.full(anchor.shape + (c.block_size - 1,), c.mask_token_id, jnp.int32)
        x = target.embed(jnp.concatenate([anchor[..., None].astype(jnp.int32), mask], axis=-1))
        return x * jnp.asarray(c.input_embedding_scale, x.dtype) if c.input_embedding_scale != 1.0 else x

    def harvest_logits(self, target: Target, h: jax.Array) -> jax.Array:
        """Harvested rows (the census's harvest: rows 1..b-1 for `dflash`, 0..b-1 for `dspark`) -> target LM head
        -> `* output_multiplier` -> optional softcap (float32). The head is the drafter's copy where
        `reads_head_copy` says so, else the target's."""
        c = self.config
        rows = h[..., c.first_row:, :]
        logits = target.logits(rows, self.head if self.reads_head_copy(math.prod(rows.shape[:-1])) else None)
        if c.output_multiplier != 1.0:
            logits = logits * c.output_multiplier
        if c.final_logit_softcapping:
            logits = c.final_logit_softcapping * jnp.tanh(logits / c.final_logit_softcapping)
        return logits

    def draft_hidden(self, state: KVCache, x: jax.Array, impl: str = "xla") -> jax.Array:
        return self._apply(DFlashModule.draft_hidden, state, x, impl)

    def train_hidden(self, taps: jax.Array, x: jax.Array, anchors: jax.Array) -> jax.Array:
        return self._apply(DFlashModule.train_hidden, taps, x, anchors)

    def propose(self, state: KVCache, target: Target, anchor: jax.Array, rp: smp.RowParams, counter: jax.Array,
                settings: ProposeSettings) -> Proposal:
        h = self.draft_hidden(state, self.block_input(target, anchor), settings.impl)
        logits = self.harvest_logits(target, h)
        if settings.proposal == "sample" and not settings.greedy:
            logp = smp.filtered_logprobs(logits, rp)
            keys = smp.rng_key(rp.seed, counter, smp.STREAM_DRAFT)
            drafts = jax.vmap(lambda k, lp: jax.random.categorical(k, lp, axis=-1))(keys, logp).astype(jnp.int32)
            q = smp.DenseQ(jnp.exp(logp))
        else:
            drafts, q = jnp.argmax(logits, -1).astype(jnp.int32), smp.OneHotQ()
        width = jnp.full(anchor.shape, settings.verify_cap, jnp.int32)
        return Proposal(drafts=drafts, q=q, verify_width=width, logits=logits)
