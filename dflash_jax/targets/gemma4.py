"""Gemma-4 targets behind the Target interface (docs/architecture.md, "Gemma-4 targets").

`Gemma4LM` is the Flax module: the embedding scaled by sqrt(hidden) (what a drafter embeds through), optional
per-layer embeddings, and layers unrolled in Python, as in `dense.py`. Each layer is sliding or full attention
with its type's heads and rope (q and k normed per head, v normed without a weight, attention scale 1; on full
layers with `attention_k_eq_v` the values are the keys before their norm and rope), norms before and after both
the attention and the MLP, a GeGLU MLP with a mixture of experts beside it when configured (`moe.py`), the
per-layer input, and a learned scalar on the layer's output. The LM head soft-caps the logits when configured.

State is a `KVCache` with one entry per layer before `first_shared_layer`: those layers compute K/V, and a
KV-shared layer attends over the cache and block K/V of the layer it shares with, keeping nothing of its own.
Full layers keep the whole capacity. Sliding layers attend through `block_attention`'s window over either the
whole capacity too, or a ring of `sliding_window + RING_SLACK` slots (`config.policy.sliding_cache`) holding
position p at slot p mod its length: a ring is gathered into position order before each attention. A block of
up to `RING_SLACK + 1` positions then overwrites only positions no later query can see, whatever `commit` keeps,
and a wider one (prefill) promises with `valid` what will be kept and writes only that. So `pending` is `start`
and `commit` moves `seq_len`, as for dense targets, for either kind of cache.
"""
from __future__ import annotations

import functools

from typing import Optional

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import struct

from dflash_jax.cache import KVCache, write_rows
from dflash_jax.config import RopeConfig, policy
from dflash_jax.config.targets import Gemma4Config
from dflash_jax.targets import dense, moe
from dflash_jax.targets.base import Target
from dflash_jax.targets.layers import (
    INIT_STD,
    apply_rope,
    block_attention,
    masked_attention,
    matmul,
    merge_heads,
    rope_frequencies,
    split_heads,
)

_ones, _normal = nn.initializers.ones, nn.initializers.normal(INIT_STD)


def gemma_norm(x: jax.Array, weight, eps: float) -> jax.Array:
    """RMSNorm in float32, times `weight` (None: no weight) in float32, cast back, as transformers' Gemma-4."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf if weight is None else xf * weight.astype(jnp.float32)).astype(x.dtype)


def gelu(x: jax.Array) -> jax.Array:
    """`gelu_pytorch_tanh`."""
    return jax.nn.gelu(x, approximate=True)


@functools.lru_cache(maxsize=None)
def rope_for(rope: RopeConfig, head_dim: int, max_position_embeddings: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies `[head_dim // 2]` and cos/sin scale. A 'proportional' rope keeps the first
    `partial_rotary_factor * head_dim // 2` frequencies of a full-width rope and zeroes the rest (those channel
    pairs pass through), all divided by `factor`, as transformers computes it."""
    if rope.rope_type != "proportional":
        return rope_frequencies(rope, head_dim, max_position_embeddings)
    angles = int(rope.get("partial_rotary_factor") * head_dim // 2)
    rotated = 1.0 / (np.float32(rope.theta) ** (np.arange(0, 2 * angles, 2, dtype=np.float32) / head_dim))
    inv_freq = np.concatenate([rotated, np.zeros(head_dim // 2 - angles, np.float32)])
    return (inv_freq / np.float32(rope.get("factor", 1.0))).astype(np.float32), 1.0


def layer_rope(cfg: Gemma4Config, i: int) -> tuple[np.ndarray, float]:
    """Layer i's rope: its type's, over its type's head_dim."""
    rope = cfg.full_rope if cfg.is_full(i) else cfg.rope
    return rope_for(rope, cfg.layer_head_dim(i), cfg.max_position_embeddings)


def ring_view(buf: jax.Array, ctx_len: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A ring `[B, S, ...]` (position p at slot p mod S) in position order, and how many of its slots hold context:
    view slot j holds position `ctx_len - held + j`, `held = min(ctx_len, S)`. Attention over the view with
    `held` as its context length sees the same distances between queries and keys as over the positions."""
    size = buf.shape[1]
    held = jnp.minimum(ctx_len, size)
    slots = (ctx_len - held)[:, None] + jnp.arange(size, dtype=jnp.int32)[None, :]
    return jnp.take_along_axis(buf, (slots % size).reshape(*slots.shape, *(1,) * (buf.ndim - 2)), axis=1), held


def ring_write(buf: jax.Array, new: jax.Array, start: jax.Array, valid: Optional[jax.Array]) -> jax.Array:
    """Write `new [B, W, ...]` at positions `start[b] + i` into a ring `[B, S, ...]`. With `valid`, only the last
    min(valid, S) of the first `valid` positions (the rest are never kept, or overwritten at once)."""
    b, w = new.shape[:2]
    size = buf.shape[1]
    i = jnp.arange(w, dtype=jnp.int32)[None, :]
    slots = (start.astype(jnp.int32)[:, None] + i) % size
    if valid is not None:
        written = (i < valid[:, None]) & (i >= valid[:, None] - size)
        slots = jnp.where(written, slots, size + i)  # past the end, each its own: dropped
    batch = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, w))
    return buf.at[batch, slots].set(new.astype(buf.dtype), mode="drop", unique_indices=True)


class Gemma4Layer(nn.Module):
    """Decoder layer `index`. `__call__(x, positions, attend, ple, shared)` runs it with `attend(q, k, v)` over
    whatever context; a KV-shared layer takes its `(k, v)` from `shared`. Returns `(x_out, (k, v))`."""

    cfg: Gemma4Config
    index: int

    def setup(self):
        c, i, h = self.cfg, self.index, self.cfg.hidden_size
        hd = c.layer_head_dim(i)
        kv = c.layer_kv_heads(i) * hd
        own = kv * (1 if c.layer_k_eq_v(i) else 2) if self.owns_kv else 0
        self.attn_norm = self.param("attn_norm", _ones, (h,))
        self.wqkv = self.param("wqkv", _normal, (h, c.num_heads * hd + own))
        self.q_norm = self.param("q_norm", _ones, (hd,))
        if self.owns_kv:
            self.k_norm = self.param("k_norm", _ones, (hd,))
        self.wo = self.param("wo", _normal, (c.num_heads * hd, h))
        self.post_attn_norm = self.param("post_attn_norm", _ones, (h,))
        self.mlp_norm = self.param("mlp_norm", _ones, (h,))
        self.w_gate_up = self.param("w_gate_up", _normal, (h, 2 * c.mlp_width(i)))
        self.w_down = self.param("w_down", _normal, (c.mlp_width(i), h))
        self.post_mlp_norm = self.param("post_mlp_norm", _ones, (h,))
        if c.num_experts:
            e, m = c.num_experts, c.moe_intermediate_size
            self.router = self.param("router", _normal, (h, e))
            self.router_scale = self.param("router_scale", _ones, (h,))
            self.expert_scale = self.param("expert_scale", _ones, (e,))
            self.experts_gate_up = self.param("experts_gate_up", _normal, (e, h, 2 * m))
            self.experts_down = self.param("experts_down", _normal, (e, m, h))
            self.experts_norm = self.param("experts_norm", _ones, (h,))
            self.post_mlp_norm_1 = self.param("post_mlp_norm_1", _ones, (h,))
            self.post_experts_norm = self.param("post_experts_norm", _ones, (h,))
        if c.hidden_size_per_layer_input:
            p = c.hidden_size_per_layer_input
            self.ple_gate = self.param("ple_gate", _normal, (h, p))
            self.ple_proj = self.param("ple_proj", _normal, (p, h))
            self.ple_norm = self.param("ple_norm", _ones, (h,))
        self.layer_scalar = self.param("layer_scalar", _ones, (1,))

    @property
    def owns_kv(self) -> bool:
        return self.cfg.kv_sources[self.index] == self.index

    def _norm(self, x, weight):
        return gemma_norm(x, weight, self.cfg.rms_norm_eps)

    def qkv(self, x: jax.Array, positions: jax.Array, shared):
        """q normed and rotated; k normed and rotated and v normed (values are raw keys under k = v), or `shared`."""
        c, i = self.cfg, self.index
        hd = c.layer_head_dim(i)
        q_width, kv_width = c.num_heads * hd, c.layer_kv_heads(i) * hd
        inv_freq, scale = layer_rope(c, i)
        proj = matmul(x, self.wqkv)
        q = apply_rope(self._norm(split_heads(proj[..., :q_width], hd), self.q_norm), positions, inv_freq, scale)
        if not self.owns_kv:
            return (q, *shared)
        k = split_heads(proj[..., q_width:q_width + kv_width], hd)
        v = k if c.layer_k_eq_v(i) else split_heads(proj[..., q_width + kv_width:], hd)
        return q, apply_rope(self._norm(k, self.k_norm), positions, inv_freq, scale), self._norm(v, None)

    def experts(self, x: jax.Array, residual: jax.Array) -> jax.Array:
        """The MoE branch on the layer's residual: routed by a weightless norm times `router_scale / sqrt(H)`,
        softmax over all experts, top-k renormalised, each weight times its expert's `expert_scale`."""
        c = self.cfg
        tokens = residual.reshape(-1, c.hidden_size)
        routed = self._norm(tokens, None) * self.router_scale * c.hidden_size ** -0.5
        weights, idx = moe.route(routed, self.router, c.top_k_experts, norm_topk_prob=True)
        weights = weights * jnp.take(self.expert_scale, idx)
        y = moe.experts(self._norm(tokens, self.experts_norm), weights, idx, self.experts_gate_up, self.experts_down,
                        impl=moe.default_impl(tokens=tokens.shape[0]), activation="gelu_tanh")
        return self._norm(x, self.post_mlp_norm_1) + self._norm(y.reshape(x.shape), self.post_experts_norm)

    def __call__(self, x: jax.Array, positions: jax.Array, attend, ple=None, shared=None):
        q, k, v = self.qkv(self._norm(x, self.attn_norm), positions, shared)
        x = x + self._norm(matmul(merge_heads(attend(q, k, v)), self.wo), self.post_attn_norm)
        h = self._norm(x, self.mlp_norm)
        gate, up = jnp.split(matmul(h, self.w_gate_up), 2, axis=-1)
        h = matmul(gelu(gate) * up, self.w_down)
        if self.cfg.num_experts:
            h = self.experts(h, x)
        x = x + self._norm(h, self.post_mlp_norm)
        if ple is not None:
            x = x + self._norm(matmul(gelu(matmul(x, self.ple_gate)) * ple, self.ple_proj), self.ple_norm)
        return x * self.layer_scalar, (k, v)


class Gemma4LM(dense.DenseLM):
    """Scaled embedding, per-layer embeddings (when configured), `num_layers` Gemma4Layers (`layers_{i}`), final
    norm, LM head (tied or not) with the soft-cap."""

    cfg: Gemma4Config

    def setup(self):
        super().setup()
        c = self.cfg
        if c.hidden_size_per_layer_input:
            width = c.num_layers * c.hidden_size_per_layer_input
            self.embed_per_layer = self.param("embed_per_layer", _normal, (c.vocab_size_per_layer_input, width))
            self.ple_projection = self.param("ple_projection", _normal, (c.hidden_size, width))
            self.ple_projection_norm = self.param("ple_projection_norm", _ones, (c.hidden_size_per_layer_input,))

    def make_layers(self) -> list:
        return [Gemma4Layer(self.cfg, i) for i in range(self.cfg.num_layers)]

    def embed(self, tokens: jax.Array) -> jax.Array:
        """The token embedding times sqrt(hidden_size), the scale rounded to the table's dtype as transformers does."""
        table = self.embedding
        return jnp.take(table, tokens, axis=0) * jnp.asarray(self.cfg.hidden_size ** 0.5, table.dtype)

    def logits(self, h: jax.Array, head=None) -> jax.Array:
        """LM head in float32 (`head` as for `DenseLM.logits`), then `cap * tanh(logits / cap)` with
        `final_logit_softcapping`."""
        logits = super().logits(h, head)
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else cap * jnp.tanh(logits / cap)

    def per_layer_inputs(self, tokens: jax.Array, x: jax.Array) -> jax.Array:
        """`[B, T, num_layers, P]`: the normed projection of the embedding `x` plus the per-layer table's rows
        (times sqrt(P)), over sqrt(2)."""
        c = self.cfg
        shape = (*tokens.shape, c.num_layers, c.hidden_size_per_layer_input)
        table = self.embed_per_layer
        rows = jnp.take(table, tokens, axis=0) * jnp.asarray(c.hidden_size_per_layer_input ** 0.5, table.dtype)
        proj = (matmul(x, self.ple_projection) * c.hidden_size ** -0.5).reshape(shape)
        proj = gemma_norm(proj, self.ple_projection_norm, c.rms_norm_eps)
        return (proj + rows.reshape(shape)) * 2 ** -0.5

    def run_layers(self, tokens: jax.Array, positions: jax.Array, attend):
        """Every layer over `tokens` at `positions`, `attend(i, q, k, v)` being layer i's attention. Returns
        `(h final-normed, outputs per layer, (k, v) per layer)`."""
        c = self.cfg
        x = self.embed(tokens)
        ple = self.per_layer_inputs(tokens, x) if c.hidden_size_per_layer_input else None
        outputs, kv = [], []
        for i, layer in enumerate(self.layers):
            source = c.kv_sources[i]
            x, block_kv = layer(x, positions, functools.partial(attend, i), None if ple is None else ple[:, :, i],
                                None if source == i else kv[source])
            outputs.append(x)
            kv.append(block_kv)
        return gemma_norm(x, self.final_norm, c.rms_norm_eps), outputs, kv

    def forward(self, tokens: jax.Array, tap_ids: tuple = ()):
        """Uncached causal forward: `(h [B, T, H] final-normed, taps or None)`."""
        c = self.cfg
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        q, k = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
        masks = {"full_attention": k <= q, "sliding_attention": (k <= q) & (q - k < c.sliding_window)}

        def attend(i, q, k, v):
            return masked_attention(q, k, v, jnp.broadcast_to(masks[c.layer_types[i]], (b, t, t)), 1.0)

        h, outputs, _ = self.run_layers(tokens, positions, attend)
        return h, dense.concat_taps(outputs, tap_ids)

    def extend(self, cache: KVCache, tokens: jax.Array, start: jax.Array, tap_ids: tuple = (), impl: str = "xla",
               valid: Optional[jax.Array] = None):
        """Block `tokens [B, W]` at positions `start[b] + i` over the cache; the K/V of the layers that own a
        cache written (a ring's as `ring_write` says). A layer sees its cache source's positions `< start[b]`
        (within the window on sliding layers) plus the block causally. Returns `(h [B, W, H] final-normed,
        taps or None, cache)`."""
        c = self.cfg
        b, w = tokens.shape
        chex.assert_shape(start, (b,))
        positions = start[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :]
        owners = range(c.first_shared_layer)
        slots, capacity = min(k.shape[1] for k in cache.k), max(k.shape[1] for k in cache.k)
        rings = {i for i in owners if cache.k[i].shape[1] < capacity}  # sliding layers only: full ones hold it all
        widest = slots - c.sliding_window + 1
        if rings and valid is None and w > widest:
            raise ValueError(f"a block of {w} positions over a ring of {slots} slots (window {c.sliding_window}) "
                             f"could overwrite positions later queries see: give `valid` (prefill), use blocks of at "
                             f"most {widest} positions, or sliding_cache='full'")

        def view(i):
            if i not in rings:
                return cache.k[i], cache.v[i], start
            (k, held), (v, _) = ring_view(cache.k[i], start), ring_view(cache.v[i], start)
            return k, v, held

        views = {i: view(i) for i in owners}

        def attend(i, q, k, v):
            kc, vc, held = views[c.kv_sources[i]]
            window = None if c.is_full(i) else c.sliding_window
            return block_attention(q, kc, vc, held, k, v, scale=1.0, causal=True, window=window, impl=impl)

        h, outputs, kv = self.run_layers(tokens, positions, attend)

        def write(i, buf, new):
            return ring_write(buf, new, start, valid) if i in rings else write_rows(buf, new, start)

        cache = cache.replace(k=tuple(write(i, cache.k[i], kv[i][0]) for i in owners),
                              v=tuple(write(i, cache.v[i], kv[i][1]) for i in owners))
        return h, dense.concat_taps(outputs, tap_ids), cache

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Logits of an uncached forward (what `init` traces to create every parameter)."""
        return self.logits(self.forward(tokens)[0])


init_params = functools.partial(dense.init_params, module_cls=Gemma4LM)
"""Float32 params: N(0, 0.02) weights, norms, scales and layer scalars one."""
param_shapes = functools.partial(dense.param_shapes, module_cls=Gemma4LM)


class Gemma4Target(Target):
    """A Gemma-4 target (`config` a `Gemma4Config`): `Gemma4LM` applied purely to `params`; its state is a KV
    cache of each layer that computes K/V (per-layer head_dim and KV heads). `sliding_cache` ('full' or 'ring';
    None: `config.policy.sliding_cache`'s default) is how `init_state` sizes the sliding layers' caches."""

    sliding_cache: Optional[str] = struct.field(pytree_node=False, default=None)

    def _apply(self, method, *args):
        return Gemma4LM(self.config).apply({"params": self.params}, *args, method=method)

    def init_state(self, batch: int, capacity: int) -> KVCache:
        c = self.config
        dtype = self.params["embed"].dtype
        ring = policy.sliding_cache(self.sliding_cache) == "ring"
        slots = min(capacity, c.sliding_window + policy.RING_SLACK) if ring else capacity
        shapes = [(batch, capacity if c.is_full(i) else slots, c.layer_kv_heads(i), c.layer_head_dim(i))
                  for i in range(c.first_shared_layer)]
        return KVCache(k=tuple(jnp.zeros(s, dtype) for s in shapes), v=tuple(jnp.zeros(s, dtype) for s in shapes),
                       seq_len=jnp.zeros((batch,), jnp.int32))

    def embed(self, tokens: jax.Array) -> jax.Array:
        return self._apply(Gemma4LM.embed, tokens)

    def extend(self, state: KVCache, tokens: jax.Array, start: jax.Array, tap_ids: tuple = (), impl: str = "xla",
               valid=None):
        h, taps, state = self._apply(Gemma4LM.extend, state, tokens, start, tap_ids, impl, valid)
        return h, taps, state, start

    def logits(self, hidden: jax.Array, head=None) -> jax.Array:
        return self._apply(Gemma4LM.logits, hidden, head)

    def commit(self, state: KVCache, pending: jax.Array, kept: jax.Array) -> KVCache:
        return state.replace(seq_len=(pending + kept).astype(jnp.int32))

    def forward(self, tokens: jax.Array, tap_ids: tuple = ()) -> tuple:
        return self._apply(Gemma4LM.forward, tokens, tap_ids)
