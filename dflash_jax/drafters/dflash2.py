"""The DFlash2 drafter: the DFlash backbone with a grouped dynamic convolution around each sublayer and a
candidate selector over the block's drafts (docs/architecture.md, "DFlash2").

- **Harvest** `dflash` (mask-fill): rows 1..b-1 are b-1 drafts; the census refuses the shifted one.
- **Layers.** Every layer is sliding-window attention, non-causal inside the block (a symmetric window).
  Around attention and around the MLP, a grouped dynamic causal convolution along the block's rows:
  `dyn = xn @ kernel_projection` (`[rows, 2, k, G]`); *prepare* convolves the sublayer's input with
  `base[0] + dyn[:, 0]`, *finish* its output with `base[1] + dyn[:, 1]` (`pallas_kernels/dynamic_conv.py`).
  The convolution is block-local: it never reads context rows, so nothing of it is kept between rounds
  and the drafter's state is the DFlash context cache alone.
- **Candidate selector.** The top-K of each harvested row's logits (after `output_multiplier` and the
  soft-cap, as the checkpoint config says: the original ranked raw logits), the hidden projection
  `hp = rows @ W_h [nd, r]`, and a walk left to right from the anchor:
  `score_k = unary_k + sum_r pred[prev, r] * hp[p, r] * succ[cand_k, r]`. Greedy takes the argmax; with
  `proposal='sample'` at T > 0 slot p draws from `softmax(score / T)` over its K candidates, and that
  distribution is the proposal's sparse q. Either way slot p + 1 walks from the token chosen at p.
"""
from __future__ import annotations

import functools
from typing import Callable

import chex
import jax
import jax.numpy as jnp
from flax import linen as nn

from dflash_jax import sampling as smp
from dflash_jax.drafters import dflash
from dflash_jax.drafters.base import Proposal, ProposeSettings
from dflash_jax.drafters.dflash import DFlashDrafter, DFlashLayer, DFlashModule
from dflash_jax.targets.base import Target
from dflash_jax.targets.layers import INIT_STD, exact, matmul, rms_norm
from pallas_kernels import dynamic_conv as dconv

_normal = nn.initializers.normal(INIT_STD)


def identity_kernel(key, shape, dtype=jnp.float32):
    """A base kernel `[2, k, H]` that passes rows through (tap 0 is one, later taps zero): a fresh
    DFlash2 layer starts as the DFlash layer plus a small dynamic part."""
    del key
    return jnp.zeros(shape, dtype).at[:, 0].set(1.0)


def conv_impl(impl: str) -> str:
    """The dynamic convolution's implementation for an attention `impl`: the reference with the reference,
    else the kernel module's default (the faster one on the GPU, by its benchmark)."""
    return "xla" if impl == "xla" else dconv.default_impl()


class DFlash2Layer(DFlashLayer):
    """A DFlash layer whose attention and MLP each sit between a prepare and a finish convolution."""

    def setup(self):
        super().setup()
        c = self.cfg
        h, k = c.hidden_size, c.conv_kernel_size
        width = 2 * k * (h // c.conv_group_size)
        self.attn_conv_base = self.param("attn_conv_base", identity_kernel, (2, k, h))
        self.attn_conv_proj = self.param("attn_conv_proj", _normal, (h, width))
        self.mlp_conv_base = self.param("mlp_conv_base", identity_kernel, (2, k, h))
        self.mlp_conv_proj = self.param("mlp_conv_proj", _normal, (h, width))

    def convolved(self, sublayer: Callable, base: jax.Array, proj: jax.Array, xn: jax.Array, impl: str):
        """prepare -> `sublayer` -> finish on normed rows `xn [B, N*b, H]`, N blocks of b rows, each alone."""
        b, h = self.cfg.block_size, xn.shape[-1]
        dyn = matmul(xn, proj).reshape(-1, b, proj.shape[-1])

        def conv(x, which):
            return dconv.dynamic_conv(x.reshape(-1, b, h), dyn, base, which, impl=conv_impl(impl)).reshape(x.shape)

        return conv(sublayer(conv(xn, 0)), 1)

    def __call__(self, x: jax.Array, positions: jax.Array, attend: Callable, impl: str = "xla") -> jax.Array:
        c = self.cfg
        attention = functools.partial(self.attention, positions=positions, attend=attend)
        x = x + self.convolved(attention, self.attn_conv_base, self.attn_conv_proj,
                               rms_norm(x, self.attn_norm, c.rms_norm_eps), impl)
        return x + self.convolved(self.mlp, self.mlp_conv_base, self.mlp_conv_proj,
                                  rms_norm(x, self.mlp_norm, c.rms_norm_eps), impl)


class DFlash2Module(DFlashModule):
    """The DFlash backbone of DFlash2 layers, plus the selector's codebooks `selector_pred`,
    `selector_succ [V, r]` and hidden projection `selector_hidden [H, r]`."""

    layer_cls = DFlash2Layer

    def setup(self):
        super().setup()
        c = self.cfg
        self.selector_pred = self.param("selector_pred", _normal, (c.vocab_size, c.selector_rank))
        self.selector_succ = self.param("selector_succ", _normal, (c.vocab_size, c.selector_rank))
        self.selector_hidden = self.param("selector_hidden", _normal, (c.hidden_size, c.selector_rank))

    def hidden_projection(self, rows: jax.Array) -> jax.Array:
        """`hp = rows @ W_h`: harvested rows `[..., nd, H]` -> float32 `[..., nd, r]`."""
        return matmul(rows, self.selector_hidden, preferred_element_type=jnp.float32)

    def codebooks(self) -> tuple:
        return self.selector_pred, self.selector_succ


def selector_scores(pred: jax.Array, succ: jax.Array, unary: jax.Array, cand: jax.Array, hp: jax.Array,
                    prev: jax.Array) -> jax.Array:
    """`unary + (pred[prev] * hp) . succ[cand]` per candidate: unary, cand `[..., K]`, hp `[..., r]`,
    prev `int[...]` -> float32 `[..., K]`."""
    gate = jnp.take(pred, prev, axis=0).astype(jnp.float32) * hp.astype(jnp.float32)
    rows = jnp.take(succ, cand, axis=0).astype(jnp.float32)
    return unary.astype(jnp.float32) + jnp.einsum("...r,...kr->...k", gate, rows, precision=exact(gate))


def selector_walk(pred: jax.Array, succ: jax.Array, unary: jax.Array, cand: jax.Array, hp: jax.Array,
                  anchor: jax.Array, temperature: jax.Array, uniforms: jax.Array) -> tuple:
    """The left-to-right walk over the slots (a `lax.scan`) -> `(drafts int32[B, nd], q float32[B, nd, K])`.

    unary, cand: `[B, nd, K]` top-K values and token ids per slot; hp `[B, nd, r]`; anchor `int[B]`;
    temperature `float[B]` (rows at 0 take the argmax, first on ties); uniforms `[B, nd]` in [0, 1).
    A sampled slot takes the first candidate whose cumulative probability exceeds its uniform (the
    argmax when rounding leaves none); q is each slot's distribution over its candidates (one-hot for
    greedy rows). Every slot walks from the token chosen at the slot before.
    """
    b, nd, k = cand.shape
    chex.assert_shape([unary], (b, nd, k))
    chex.assert_shape([hp], (b, nd, None))
    chex.assert_shape([uniforms], (b, nd))
    greedy = temperature <= 0
    temp = jnp.where(greedy, 1.0, temperature).astype(jnp.float32)[:, None]

    def slot(prev, xs):
        un, cd, h, u = xs
        scores = selector_scores(pred, succ, un, cd, h, prev)
        best = jnp.argmax(scores, axis=-1)
        probs = jax.nn.softmax(scores / temp, axis=-1)
        under = u[:, None] < jnp.cumsum(probs, axis=-1)
        drawn = jnp.where(jnp.any(under, axis=-1), jnp.argmax(under, axis=-1), jnp.argmax(probs, axis=-1))
        pick = jnp.where(greedy, best, drawn)
        q = jnp.where(greedy[:, None], jax.nn.one_hot(best, k, dtype=jnp.float32), probs)
        tok = jnp.take_along_axis(cd, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)
        return tok, (tok, q)

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (unary, cand, hp, uniforms))
    _, (drafts, q) = jax.lax.scan(slot, anchor.astype(jnp.int32), xs)
    return jnp.moveaxis(drafts, 0, 1), jnp.moveaxis(q, 0, 1)


init_params = functools.partial(dflash.init_params, module_cls=DFlash2Module)
"""Float32 params: the backbone's, identity base kernels, N(0, 0.02) projections and codebooks."""
param_shapes = functools.partial(dflash.param_shapes, module_cls=DFlash2Module)


class DFlash2Drafter(DFlashDrafter):
    """A DFlash2 drafter: `DFlash2Module` applied purely; its state is the DFlash context cache (the
    convolution is block-local, so nothing else survives a round)."""

    module_cls = DFlash2Module

    def candidates(self, target: Target, h: jax.Array) -> tuple:
        """`(logits, unary, cand, hp)` of the block's hidden rows `h [..., b, H]`: the harvested logits
        (scaled, soft-capped), their top-K values and ids, and the hidden projection."""
        logits = self.harvest_logits(target, h)
        unary, cand = jax.lax.top_k(logits, self.config.selector_top_k)
        hp = self._apply(DFlash2Module.hidden_projection, h[..., self.config.first_row:, :])
        return logits, unary, cand.astype(jnp.int32), hp

    def propose(self, state, target: Target, anchor: jax.Array, rp: smp.RowParams, counter: jax.Array,
                settings: ProposeSettings) -> Proposal:
        h = self.draft_hidden(state, self.block_input(target, anchor), settings.impl)
        logits, unary, cand, hp = self.candidates(target, h)
        b, nd = cand.shape[:2]
        sample = settings.proposal == "sample" and not settings.greedy
        if sample:
            keys = smp.rng_key(rp.seed, counter, smp.STREAM_DRAFT)
            uniforms = jax.vmap(lambda key: jax.random.uniform(key, (nd,)))(keys)
            temperature = rp.temperature
        else:
            uniforms, temperature = jnp.zeros((b, nd), jnp.float32), jnp.zeros((b,), jnp.float32)
        pred, succ = self._apply(DFlash2Module.codebooks)
        drafts, q = selector_walk(pred, succ, unary, cand, hp, anchor, temperature, uniforms)
        width = jnp.full(anchor.shape, settings.verify_cap, jnp.int32)
        return Proposal(drafts=drafts, q=smp.SparseQ(cand, q) if sample else smp.OneHotQ(), verify_width=width,
                        logits=logits)
