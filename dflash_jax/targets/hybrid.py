"""Hybrid targets (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) behind the Target interface (docs/architecture.md,
"Hybrid targets").

`HybridLM` interleaves Gated DeltaNet layers (`gdn.py`: conv and recurrent state) with gated full-attention
layers (a per-head output gate, zero-centred q/k norms, partial rotary; a KV cache), each followed by a SwiGLU
MLP or a mixture of experts with a shared expert (`moe.py`). Layers are unrolled in Python, as in `dense.py`.

Rollback is `commit` alone. `extend` writes the attention layers' K/V at `start` and returns as `pending`
what gives the linear layers' state after any position of the block: the conv window, and the recurrent
update of every position (`gdn.gated_delta_net`); `commit` moves `seq_len` and, per row, selects the conv
state and folds the recurrent state up to the last kept position. No replay of the model, no copy-back.
Prefill passes `valid` (the prompt positions of the chunk), and `pending` is then the state after them.
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

from dflash_jax.config.targets import HybridConfig
from dflash_jax.targets import dense, gdn, moe
from dflash_jax.targets.base import Target
from dflash_jax.targets.layers import (
    INIT_STD,
    apply_rope,
    block_attention_into_cache,
    masked_attention,
    matmul,
    merge_heads,
    rope_frequencies,
    split_heads,
    swiglu,
)
from pallas_kernels.gated_delta import conv_state_at, state_at

_ones, _zeros, _normal = nn.initializers.ones, nn.initializers.zeros, nn.initializers.normal(INIT_STD)


def _a_log(key, shape, dtype=jnp.float32):
    """log(A), A uniform in [1, 16) (transformers draws it from [0.01, 16); ours keeps fresh decays away from 1)."""
    return jnp.log(jax.random.uniform(key, shape, dtype, 1.0, 16.0))


@struct.dataclass
class HybridState:
    """`k, v`: per attention layer `[B, capacity, n_kv, head_dim]`; `conv`: per linear layer the last K-1 conv
    inputs `[B, K-1, conv_dim]`; `ssm`: per linear layer the recurrent state `f32[B, nv, hk, hv]`;
    `seq_len: int32[B]` positions committed."""

    k: tuple
    v: tuple
    conv: tuple
    ssm: tuple
    seq_len: jax.Array

    @property
    def capacity(self) -> Optional[int]:
        """Positions the K/V caches hold (None without attention layers: recurrent state has no length)."""
        return self.k[0].shape[1] if self.k else None


@struct.dataclass
class HybridPending:
    """What `commit` needs: the block's `start`, and per linear layer either what keeps any prefix
    (`per_position`: the conv window `[B, K-1+W, C]` and the recurrent updates `(k [B, W, nv, hk], u [B, W, nv, hv],
    g [B, W, nv])` float32, `gdn.gated_delta_net`) or the states after the block's `valid` positions."""

    start: jax.Array
    conv: tuple
    ssm: tuple
    per_position: bool = struct.field(pytree_node=False)


def centred_rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm scaled by `1 + weight`, in float32 (the hybrids store norm weights centred on zero)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


@functools.lru_cache(maxsize=None)
def _rope(cfg: HybridConfig) -> tuple[np.ndarray, float]:
    return rope_frequencies(cfg.rope, cfg.rotary_dim, cfg.max_position_embeddings)


def partial_rope(x: jax.Array, positions: jax.Array, cfg: HybridConfig) -> jax.Array:
    """RoPE on the leading `rotary_dim` channels of each head; the rest pass through."""
    inv_freq, scale = _rope(cfg)
    rd = cfg.rotary_dim
    return jnp.concatenate([apply_rope(x[..., :rd], positions, inv_freq, scale), x[..., rd:]], axis=-1)


class HybridLayer(nn.Module):
    """One pre-norm layer: a token mixer (`kind` 'linear_attention' or 'full_attention'), then an MLP
    (experts when `moe`). `__call__(x, mix)` runs it with `mix(layer, normed x) -> (out, aux)`."""

    cfg: HybridConfig
    kind: str
    moe: bool

    def setup(self):
        c, h = self.cfg, self.cfg.hidden_size
        self.attn_norm = self.param("attn_norm", _zeros, (h,))
        self.mlp_norm = self.param("mlp_norm", _zeros, (h,))
        if self.kind == "linear_attention":
            nv = c.linear_num_value_heads
            self.in_proj = self.param("in_proj", _normal, (h, 2 * c.key_dim + 2 * c.value_dim + 2 * nv))
            self.conv = self.param("conv", _normal, (c.conv_dim, 1, c.linear_conv_kernel))
            self.dt_bias = self.param("dt_bias", _ones, (nv,))
            self.A_log = self.param("A_log", _a_log, (nv,))
            self.norm = self.param("norm", _ones, (c.linear_value_head_dim,))
            self.out_proj = self.param("out_proj", _normal, (c.value_dim, h))
        else:
            self.wqkv = self.param("wqkv", _normal, (h, 2 * c.q_width + 2 * c.kv_width))
            self.wo = self.param("wo", _normal, (c.q_width, h))
            self.q_norm = self.param("q_norm", _zeros, (c.head_dim,))
            self.k_norm = self.param("k_norm", _zeros, (c.head_dim,))
        if self.moe:
            e, i, s = c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
            self.router = self.param("router", _normal, (h, e))
            self.w_gate_up = self.param("w_gate_up", _normal, (e, h, 2 * i))
            self.w_down = self.param("w_down", _normal, (e, i, h))
            self.shared_gate_up = self.param("shared_gate_up", _normal, (h, 2 * s))
            self.shared_down = self.param("shared_down", _normal, (s, h))
            self.shared_gate = self.param("shared_gate", _normal, (h, 1))
        else:
            self.w_gate_up = self.param("w_gate_up", _normal, (h, 2 * c.intermediate_size))
            self.w_down = self.param("w_down", _normal, (c.intermediate_size, h))

    def __call__(self, x: jax.Array, mix):
        c = self.cfg
        o, aux = mix(self, centred_rms_norm(x, self.attn_norm, c.rms_norm_eps))
        x = x + o
        return x + self.mlp(centred_rms_norm(x, self.mlp_norm, c.rms_norm_eps)), aux

    def attention(self, x: jax.Array, positions: jax.Array, attend) -> tuple:
        """Gated attention: `(out, aux)`, `attend(q, k, v)` over whatever context returning `(output, aux)` (aux:
        what the caller wants back, the written caches or None); the output is scaled by `sigmoid(gate)`, the
        gate projected beside each head's query."""
        c = self.cfg
        b, w, _ = x.shape
        qg, k, v = jnp.split(matmul(x, self.wqkv), [2 * c.q_width, 2 * c.q_width + c.kv_width], axis=-1)
        qg = qg.reshape(b, w, c.num_heads, 2 * c.head_dim)
        q, gate = qg[..., :c.head_dim], qg[..., c.head_dim:].reshape(b, w, c.q_width)
        q = partial_rope(centred_rms_norm(q, self.q_norm, c.rms_norm_eps), positions, c)
        k = partial_rope(centred_rms_norm(split_heads(k, c.head_dim), self.k_norm, c.rms_norm_eps), positions, c)
        v = split_heads(v, c.head_dim)
        attended, aux = attend(q, k, v)
        return matmul(merge_heads(attended) * jax.nn.sigmoid(gate), self.wo), aux

    def linear_params(self) -> dict:
        return {n: getattr(self, n) for n in ("in_proj", "conv", "dt_bias", "A_log", "norm", "out_proj")}

    def mlp(self, x: jax.Array) -> jax.Array:
        if not self.moe:
            return swiglu(x, self.w_gate_up, self.w_down)
        c = self.cfg
        params = {n: getattr(self, n) for n in ("router", "w_gate_up", "w_down", "shared_gate_up", "shared_down",
                                                "shared_gate")}
        return moe.moe_block(x, params, top_k=c.num_experts_per_tok, norm_topk_prob=c.norm_topk_prob,
                             impl=moe.default_impl(tokens=x.shape[0] * x.shape[1]))


class HybridLM(dense.DenseLM):
    """Embedding, `num_layers` HybridLayers (`layers_{i}`), final norm (centred), LM head (tied or not): the
    dense model's embedding and head around other layers."""

    cfg: HybridConfig
    final_norm_init = staticmethod(_zeros)

    def make_layers(self) -> list:
        c = self.cfg
        return [HybridLayer(c, kind, moe_layer) for kind, moe_layer in zip(c.layer_types, c.moe_layers)]

    def forward(self, tokens: jax.Array, tap_ids: tuple = ()):
        """Uncached causal forward: `(h [B, T, H] final-normed, taps or None)`."""
        c = self.cfg
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
        scale = c.head_dim ** -0.5

        def attention(layer, h):
            return layer.attention(h, positions, lambda q, k, v: (masked_attention(q, k, v, mask, scale), None))

        def linear(layer, h):
            return gdn.forward(c, layer.linear_params(), h), None

        x, outputs = self.embed(tokens), []
        for layer in self.layers:
            x, _ = layer(x, linear if layer.kind == "linear_attention" else attention)
            outputs.append(x)
        return centred_rms_norm(x, self.final_norm, c.rms_norm_eps), dense.concat_taps(outputs, tap_ids)

    def extend(self, state: HybridState, tokens: jax.Array, start: jax.Array, tap_ids: tuple = (),
               impl: str = "xla", valid: Optional[jax.Array] = None):
        """Block `tokens [B, W]` at positions `start[b] + i`: `(h, taps, state, pending)` (module docstring)."""
        c = self.cfg
        b, w = tokens.shape
        chex.assert_shape(start, (b,))
        positions = start[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :]
        x, outputs = self.embed(tokens), []
        ks, vs, convs, ssms = [], [], [], []
        for layer in self.layers:
            if layer.kind == "linear_attention":
                n = len(convs)

                def linear(lyr, h, n=n):
                    o, conv, ssm = gdn.gated_delta_net(c, lyr.linear_params(), h, state.conv[n], state.ssm[n], valid,
                                                       impl)
                    return o, (conv, ssm)

                x, (conv, ssm) = layer(x, linear)
                convs.append(conv)
                ssms.append(ssm)
            else:
                kc, vc = state.k[len(ks)], state.v[len(ks)]

                def attention(lyr, h, kc=kc, vc=vc):
                    return lyr.attention(h, positions, lambda q, k, v: block_attention_into_cache(
                        q, kc, vc, start, k, v, scale=c.head_dim ** -0.5, impl=impl))

                x, (kc, vc) = layer(x, attention)
                ks.append(kc)
                vs.append(vc)
            outputs.append(x)
        pending = HybridPending(start=start, conv=tuple(convs), ssm=tuple(ssms), per_position=valid is None)
        h = centred_rms_norm(x, self.final_norm, c.rms_norm_eps)
        return h, dense.concat_taps(outputs, tap_ids), state.replace(k=tuple(ks), v=tuple(vs)), pending

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Logits of an uncached forward (what `init` traces to create every parameter)."""
        return self.logits(self.forward(tokens)[0])


init_params = functools.partial(dense.init_params, module_cls=HybridLM)
"""Float32 params: N(0, 0.02) weights, centred norms zero, the gated norm one, `A_log` as `_a_log`."""
param_shapes = functools.partial(dense.param_shapes, module_cls=HybridLM)


class HybridTarget(Target):
    """A Qwen3.5 / Qwen3.5-MoE / Qwen3-Next target (`config` a `HybridConfig`): `HybridLM` applied purely."""

    def _apply(self, method, *args):
        return HybridLM(self.config).apply({"params": self.params}, *args, method=method)

    def init_state(self, batch: int, capacity: int) -> HybridState:
        c = self.config
        dtype = self.params["embed"].dtype
        kv = (batch, capacity, c.num_kv_heads, c.head_dim)
        n_attn, n_lin = len(c.attention_layers), len(c.linear_layers)
        ssm = (batch, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
        return HybridState(
            k=tuple(jnp.zeros(kv, dtype) for _ in range(n_attn)), v=tuple(jnp.zeros(kv, dtype) for _ in range(n_attn)),
            conv=tuple(jnp.zeros((batch, c.linear_conv_kernel - 1, c.conv_dim), dtype) for _ in range(n_lin)),
            ssm=tuple(jnp.zeros(ssm, jnp.float32) for _ in range(n_lin)), seq_len=jnp.zeros((batch,), jnp.int32))

    def embed(self, tokens: jax.Array) -> jax.Array:
        return self._apply(HybridLM.embed, tokens)

    def pending_bytes(self, batch: int, width: int) -> int:
        """Per linear layer, the conv window and the float32 recurrent updates (k, u, g) of every position."""
        c = self.config
        window = (c.linear_conv_kernel - 1 + width) * c.conv_dim * self.params["embed"].dtype.itemsize
        states = width * c.linear_num_value_heads * (c.linear_key_head_dim + c.linear_value_head_dim + 1) * 4
        return batch * len(c.linear_layers) * (window + states)

    def extend(self, state: HybridState, tokens: jax.Array, start: jax.Array, tap_ids: tuple = (), impl: str = "xla",
               valid: Optional[jax.Array] = None):
        return self._apply(HybridLM.extend, state, tokens, start, tap_ids, impl, valid)

    def logits(self, hidden: jax.Array, head=None) -> jax.Array:
        return self._apply(HybridLM.logits, hidden, head)

    def commit(self, state: HybridState, pending: HybridPending, kept: jax.Array) -> HybridState:
        kept = kept.astype(jnp.int32)
        if pending.per_position:
            k = self.config.linear_conv_kernel
            conv = tuple(conv_state_at(window, kept, kernel_size=k) for window in pending.conv)
            ssm = tuple(state_at(old, *updates, kept) for old, updates in zip(state.ssm, pending.ssm))
        else:
            conv, ssm = pending.conv, pending.ssm
        return state.replace(conv=conv, ssm=ssm, seq_len=(pending.start + kept).astype(jnp.int32))

    def forward(self, tokens: jax.Array, tap_ids: tuple = ()) -> tuple:
        return self._apply(HybridLM.forward, tokens, tap_ids)
