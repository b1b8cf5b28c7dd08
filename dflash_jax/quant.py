"""Weight precision (docs/architecture.md, "Weight precision"): quantised weight leaves, the original's
encoders, and which leaves each precision quantises.

A quantised leaf is a `QWeight`: the packed values, their scales, the format and the shape and dtype
of the float leaf it replaces (`pallas_kernels/quant_matmul.py` gives the layouts). It sits in the
params pytree where that leaf was, and `targets.layers.matmul` is the one place that multiplies by it.
Flax hands it to a module unboxed (`QWeight` is a Flax `AxisMetadata` box): as an `Unboxed`, which
is not a pytree, so Flax's check that a param has the module's shape sees the float shape and not the
packed arrays. The modules need no change: every weight they quantise is only ever passed to `matmul`.

Which leaves a precision quantises (`leaf_format`): the linear weights named in `ROLES`, by group,
when 2-D. Everything else keeps its float dtype: tables read by gather (embeddings, Markov W1, DFlash2
codebooks), norms, biases and other vectors, routers and one-column gates (small, and a quantised
router changes which experts run), and stacked MoE experts (a 3-D leaf: `moe.py` reads them through
`ragged_dot` and gathers, which take float weights).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from flax.core import meta

from dflash_jax.config import policy
from pallas_kernels import quant_matmul as qmm

ROLES = {
    "wqkv": "attention", "wq": "attention", "wkv": "attention", "wo": "attention",
    "in_proj": "attention", "out_proj": "attention",
    "w_gate_up": "mlp", "w_down": "mlp", "shared_gate_up": "mlp", "shared_down": "mlp",
    "lm_head": "lm head", "fc": "context projection",
    "attn_conv_proj": "conv projections", "mlp_conv_proj": "conv projections",
    "selector_hidden": "selector projection", "markov_w2": "markov head",
}
"""The weight leaves a precision may quantise (by leaf name; 2-D only) and the group each belongs to."""

_VALUES_PER_CHUNK = 1 << 24
"""Values encoded at a time on the host (a column slice of a weight), to bound the temporaries."""


class QWeight(struct.PyTreeNode, meta.AxisMetadata):
    """A quantised `[in, out]` weight: `data` and `scales` as `fmt` packs them; `shape` and `dtype` are the
    float leaf's (dtype is what the model computes in)."""

    data: jax.Array
    scales: jax.Array
    fmt: str = struct.field(pytree_node=False)
    shape: tuple = struct.field(pytree_node=False)
    dtype: Any = struct.field(pytree_node=False)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes + self.scales.nbytes)

    def unbox(self) -> "Unboxed":
        return Unboxed(self)

    def replace_boxed(self, val) -> "QWeight":
        if not isinstance(val, Unboxed):
            raise TypeError(f"a quantised weight holds packed values; cannot replace them with {type(val).__name__}")
        return val.weight

    def add_axis(self, index: int, params: dict) -> "QWeight":
        raise ValueError("a quantised weight cannot be stacked by a Flax transform (nn.scan, nn.vmap)")

    def remove_axis(self, index: int, params: dict) -> "QWeight":
        raise ValueError("a quantised weight cannot be stacked by a Flax transform (nn.scan, nn.vmap)")


@dataclasses.dataclass(frozen=True)
class Unboxed:
    """A `QWeight` as a module receives it from `self.param`: not a pytree, with the float leaf's shape."""

    weight: QWeight

    @property
    def shape(self) -> tuple:
        return self.weight.shape

    @property
    def dtype(self):
        return self.weight.dtype


def is_quantized(x) -> bool:
    return isinstance(x, (QWeight, Unboxed))


def matmul(x: jax.Array, w, preferred_element_type=None) -> jax.Array:
    """`x @ W` for a quantised W: the result dtype `jnp.matmul` gives for the float weight (or
    `preferred_element_type`), through the kernel module's default impl (`quant_matmul.default_impl`)."""
    w = w.weight if isinstance(w, Unboxed) else w
    compute = jnp.result_type(x.dtype, w.dtype)
    return qmm.quant_matmul(x, w.data, w.scales, w.fmt, compute_dtype=compute,
                            out_dtype=preferred_element_type or compute, impl=qmm.default_impl())


# ---------------------------------------------------------------------------------------
# Encoding: the original's q8_0 and q4_0 (`encode_q8_0`, `encode_q4_0`), and int8 per output channel.


def _round_half_away(x, xp):
    """Round to the nearest integer, halves away from zero (Rust's `f32::round`; numpy rounds halves to even)."""
    t = xp.trunc(x)
    return xp.where(xp.abs(x - t) >= 0.5, t + xp.sign(x), t)


def _inverse(d, xp):
    """1 / d where d != 0, else 0 (the original's `id`), without dividing by zero."""
    nonzero = d != 0
    return xp.where(nonzero, 1.0 / xp.where(nonzero, d, 1.0), 0.0).astype(xp.float32)


def encode(w, fmt: str, xp=np) -> tuple:
    """`(data, scales)` of a float `[K, N]` weight in `fmt` (`quant_matmul`'s layouts), computed in float32 as the
    original computes it, step by step. `xp` is numpy (the host, exact) or jax.numpy (under `jit`, for benchmarks:
    XLA may rewrite the arithmetic, a division into a product by the reciprocal, so a last bit can differ)."""
    v = w.astype(xp.float32)
    k, n = v.shape
    if fmt == "int8":
        s = xp.max(xp.abs(v), axis=0, keepdims=True) / xp.float32(127.0)
        q = xp.clip(_round_half_away(v * _inverse(s, xp), xp), -127, 127).astype(xp.int8)
        return q, s.astype(xp.float32)
    blocks = v.reshape(k // qmm.BLOCK, qmm.BLOCK, n)
    if fmt == "q8_0":
        d = xp.max(xp.abs(blocks), axis=1) / xp.float32(127.0)
        q = xp.clip(_round_half_away(blocks * _inverse(d, xp)[:, None, :], xp), -127, 127).astype(xp.int8)
        return q.reshape(k, n), d.astype(xp.float16)
    first_max = xp.argmax(xp.abs(blocks), axis=1)[:, None, :]  # the first value of largest magnitude, signed
    d = xp.take_along_axis(blocks, first_max, axis=1)[:, 0, :] / xp.float32(-8.0)
    q = xp.clip(blocks * _inverse(d, xp)[:, None, :] + xp.float32(8.5), 0.0, 15.0).astype(xp.uint8)
    half = qmm.BLOCK // 2
    return (q[:, :half] | (q[:, half:] << 4)).reshape(k // 2, n), d.astype(xp.float16)


def _encode_host(w: np.ndarray, fmt: str) -> tuple:
    """`encode` on the host, a slice of columns at a time (the blocks run down the rows)."""
    step = max(1, _VALUES_PER_CHUNK // max(1, w.shape[0]))
    parts = [encode(w[:, i:i + step], fmt) for i in range(0, w.shape[1], step)]
    return tuple(np.concatenate(p, axis=1) for p in zip(*parts))


def check_fits(path: str, shape: tuple, fmt: str) -> None:
    """Refuse a weight `fmt` cannot pack, naming it: the block formats need whole blocks along the input axis."""
    if fmt != "int8" and shape[0] % qmm.BLOCK:
        raise ValueError(f"{path} [{shape[0]}, {shape[1]}]: {fmt} packs blocks of {qmm.BLOCK} along the input "
                         f"axis, and {shape[0]} inputs is not a multiple of {qmm.BLOCK}; choices: int8 (one scale "
                         "per output channel, any width), or bf16 (not quantised)")


def quantize_array(w, fmt: str, dtype=None, path: str = "weight", xp=np) -> QWeight:
    """A float `[in, out]` weight as a `QWeight` in `fmt`, computing in `dtype` (default w's). With numpy
    the encoding runs on the host, exactly as the original's; with jax.numpy on w's device."""
    shape = tuple(int(s) for s in w.shape)
    if len(shape) != 2:
        raise ValueError(f"{path}: only 2-D [in, out] weights are quantised; got shape {shape}")
    if fmt not in qmm.FORMATS:
        raise ValueError(f"{path}: unknown weight format {fmt!r}; choices: {', '.join(qmm.FORMATS)}")
    check_fits(path, shape, fmt)
    dtype = jnp.dtype(dtype or w.dtype)
    data, scales = _encode_host(np.asarray(w), fmt) if xp is np else _encode_jit(w, fmt)
    return QWeight(jnp.asarray(data), jnp.asarray(scales), fmt, shape, dtype)


_encode_jit = jax.jit(lambda w, fmt: encode(w, fmt, jnp), static_argnums=1)

def from_packed(data, scales, fmt: str, dtype) -> QWeight:
    """A `QWeight` over packed `data` and `scales` (as saved), refused unless they are one `fmt` weight."""
    k = data.shape[0] * (2 if fmt == "q4_0" else 1)
    shape = (int(k), int(data.shape[1]))
    dtypes = (str(data.dtype), str(scales.dtype))
    if fmt not in qmm.PACKED_DTYPES or dtypes != qmm.PACKED_DTYPES[fmt] or \
            qmm.packed_shapes(shape, fmt) != (tuple(data.shape), tuple(scales.shape)):
        raise ValueError(f"packed values {tuple(data.shape)} {dtypes[0]} and scales {tuple(scales.shape)} {dtypes[1]} "
                         f"are not one {fmt} weight (expected {qmm.PACKED_DTYPES.get(fmt)})")
    return QWeight(jnp.asarray(data), jnp.asarray(scales), fmt, shape, jnp.dtype(dtype))


# ---------------------------------------------------------------------------------------
# Which leaves a precision quantises.


def role_format(precision: str, role: str) -> Optional[str]:
    """The format of a weight of `role` under `precision`, None to keep it float.

    bf16 keeps every weight; int8, q8_0 and q4_0 quantise every group; mixed is the original's split,
    the MLP at q8_0 and the rest kept. The Markov head's W2 is q8_0 under any precision but bf16 and
    int8 (the original keeps it at q8_0 when everything else is q4_0, and under mixed)."""
    if precision == "bf16":
        return None
    if role == "markov head" and precision in ("q4_0", "mixed"):
        return "q8_0"
    if precision == "mixed":
        return "q8_0" if role == "mlp" else None
    return precision


def leaf_format(path: tuple, shape: tuple, precision: str) -> Optional[str]:
    """The format `precision` gives the leaf at `path` (a tuple of keys) of `shape`; None keeps it float."""
    role = ROLES.get(path[-1]) if len(shape) == 2 else None
    return role_format(precision, role) if role else None


def _key(k) -> str:
    return str(getattr(k, "key", getattr(k, "name", k)))


def path_keys(path) -> tuple:
    """A jax key path as a tuple of names: `(DictKey('layers_0'), DictKey('wo'))` -> `('layers_0', 'wo')`."""
    return tuple(_key(k) for k in path)


def _shaped_leaves(tree) -> list:
    """`(keys, shape)` of every leaf of a tree of shape tuples, arrays or quantised weights."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, tuple) or is_quantized(x))[0]
    return [(path_keys(p), x if isinstance(x, tuple) else tuple(np.shape(x))) for p, x in leaves]


def plan(shapes, precision: str) -> dict:
    """`{path: format}` of the leaves `precision` quantises, over a tree of shape tuples (or arrays); each
    refused with a sentence if its format cannot pack it."""
    if precision not in policy.PRECISIONS:
        raise ValueError(f"precision {precision!r} is unknown; choices: {', '.join(policy.PRECISIONS)}")
    out = {}
    for keys, shape in _shaped_leaves(shapes):
        fmt = leaf_format(keys, shape, precision)
        if fmt is not None:
            check_fits("/".join(keys), shape, fmt)
            out[keys] = fmt
    return out


def quantize_params(params, precision: str, xp=np):
    """`params` with the leaves `precision` quantises replaced by `QWeight`s (see `quantize_array` for `xp`)."""
    formats = plan(params, precision)

    def leaf(path, x):
        keys = path_keys(path)
        if keys not in formats:
            return x
        if is_quantized(x):
            raise ValueError(f"{'/'.join(keys)} is already quantised ({x.fmt if isinstance(x, QWeight) else 'packed'});"
                             " quantise the float model instead")
        return quantize_array(x, formats[keys], path="/".join(keys), xp=xp)

    return jax.tree_util.tree_map_with_path(leaf, params, is_leaf=is_quantized)


def quantize(model, precision: str):
    """A Target or Drafter with its weights quantised as `precision` says (`leaf_format`), encoded on the host
    exactly as the original encodes them. The model must hold float weights."""
    return model.replace(params=quantize_params(model.params, policy.precision(precision, env={})[0]))


def formats_of(params) -> dict:
    """`{path: format}` of the quantised leaves of `params`."""
    leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_quantized)[0]
    return {path_keys(p): x.fmt for p, x in leaves if isinstance(x, QWeight)}


def precision_of(params) -> str:
    """The precision whose plan `params` follows (bf16 when nothing is quantised), or ValueError."""
    found = formats_of(params)
    for precision in policy.PRECISIONS:
        try:
            if plan(params, precision) == found:
                return precision
        except ValueError:
            continue
    raise ValueError(f"the quantised leaves follow no precision's plan ({', '.join(policy.PRECISIONS)}): "
                     f"{dict(list(found.items())[:4])}")


def describe(shapes, precision: str) -> list:
    """One line per group of weights: its format under `precision` and how many tensors it holds, then what
    stays float."""
    formats = plan(shapes, precision)
    groups: dict = {}
    kept = experts = 0
    for keys, shape in _shaped_leaves(shapes):
        role = ROLES.get(keys[-1])
        if role and len(shape) == 2:
            groups.setdefault(role, []).append(formats.get(keys) or "float (kept)")
        elif role:
            experts += 1
        else:
            kept += 1
    order = list(dict.fromkeys(ROLES.values()))
    lines = [f"{role}: {', '.join(sorted(set(groups[role])))} ({_tensors(len(groups[role]))})"
             for role in sorted(groups, key=order.index)]
    if experts:
        lines.append(f"MoE experts: float (kept; {_tensors(experts)}, stacked)")
    lines.append(f"embeddings, norms, routers and small vectors: float (kept; {_tensors(kept)})")
    return lines


def _tensors(n: int) -> str:
    return f"{n} tensor{'' if n == 1 else 's'}"
