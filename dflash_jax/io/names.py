"""Name maps: how a family's parameter pytree is made of Hugging Face tensors.

Each family keeps one map beside its module (`targets/dense_names.py`, `drafters/dflash_names.py`):
a list of `Param`s, each one leaf of our pytree and the Hugging Face tensors it is made of.
From the map and the module's own shapes this file derives the three things that used to be
written by hand per family: the tensors a checkpoint must hold, loading, and writing back.

Hugging Face stores linear weights `[out, in]`; our leaves store them `[in, out]` (the forward
does `x @ W`), with fused projections (q|k|v, gate|up) concatenated along the last axis. This is
the only place where layouts change.

A quantised leaf (`quant.QWeight`) is stored as two tensors per Hugging Face name, both `[out, ...]` as
the float tensor was: `NAME` holds the packed values (int8 `[out, in]`, or uint8 `[out, in/2]` for
q4_0) and `NAME_scale` the scales (float16 `[out, in/32]` for the block formats, float32 `[out, 1]`
for int8), compressed-tensors' naming. Packing runs along the input axis, so a fused leaf splits and
joins along its output axis exactly as a float one.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from dflash_jax import quant, sharding
from pallas_kernels.quant_matmul import PACKED_DTYPES, packed_shapes

SCALE_SUFFIX = "_scale"
"""The scales of quantised tensor NAME are stored as NAME + SCALE_SUFFIX."""


@dataclasses.dataclass(frozen=True)
class Param:
    """One leaf at `path` made of the Hugging Face tensors `hf`, concatenated along our last axis.

    `widths` gives each tensor's share of that axis (None: one tensor, the whole axis);
    `transpose` marks linear weights (Hugging Face `[..., out, in]`, ours `[..., in, out]`: the last two
    axes swap). `experts` > 0 stacks that many experts on a new leading axis, each name in `hf` holding
    `{e}` for the expert's index (a checkpoint with one tensor per expert).
    """

    path: tuple
    hf: tuple
    widths: Optional[tuple] = None
    transpose: bool = False
    experts: int = 0

    def names(self) -> list:
        """The Hugging Face names of every tensor of the leaf, expert-major."""
        if not self.experts:
            return list(self.hf)
        return [name.format(e=e) for e in range(self.experts) for name in self.hf]

    def pieces(self, shape: tuple) -> list:
        """`(hf name, hf shape)` of each tensor of a leaf of `shape`."""
        inner = tuple(shape[1:]) if self.experts else tuple(shape)
        widths = self.widths or (inner[-1],)
        if len(widths) != len(self.hf) or sum(widths) != inner[-1]:
            raise ValueError(f"name map entry {self.path}: widths {widths} do not split a leaf of shape {shape}")
        shapes = [_hf_layout(inner[:-1] + (w,), self.transpose) for w in widths]
        return list(zip(self.names(), shapes * max(self.experts, 1)))

    def assemble(self, get: Callable) -> np.ndarray:
        """The leaf from `get(hf name) -> np.ndarray`."""
        arrays = [np.swapaxes(get(n), -1, -2) if self.transpose else get(n) for n in self.names()]
        groups = [arrays[i:i + len(self.hf)] for i in range(0, len(arrays), len(self.hf))]
        parts = [g[0] if len(g) == 1 else np.concatenate(g, axis=-1) for g in groups]
        return np.stack(parts) if self.experts else parts[0]

    def split(self, x: np.ndarray) -> list:
        """`(hf name, array)` of each tensor of the leaf `x`: the inverse of `assemble`."""
        cuts = np.cumsum(self.widths or (x.shape[-1],))[:-1]
        out = []
        for part in (list(x) if self.experts else [x]):
            out += [np.swapaxes(p, -1, -2) if self.transpose else p for p in np.split(part, cuts, axis=-1)]
        return list(zip(self.names(), out))


def _hf_layout(shape: tuple, transpose: bool) -> tuple:
    return shape[:-2] + (shape[-1], shape[-2]) if transpose else shape


def leaf(tree, path: Sequence):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict, path: Sequence, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def shape_tree(shapes) -> dict:
    """Module shapes (a tree of `ShapeDtypeStruct`) as a tree of plain shape tuples."""
    return jax.tree.map(lambda s: tuple(s.shape), shapes)


def hf_shapes(names: Sequence[Param], shapes, formats: Optional[dict] = None) -> dict:
    """Hugging Face name -> shape that a checkpoint must hold, from the map and the module's shapes; the leaves
    in `formats` (path -> format, a checkpoint saved quantised) as their packed values and scales."""
    out = {}
    for p in names:
        shape = tuple(leaf(shapes, p.path))
        if formats and p.path in formats:
            data, scales = packed_shapes(shape, formats[p.path])
            out.update(p.pieces(data))
            out.update({n + SCALE_SUFFIX: s for n, s in p.pieces(scales)})
        else:
            out.update(p.pieces(shape))
    return out


def packed_dtypes(names: Sequence[Param], formats: dict) -> dict:
    """Hugging Face name -> numpy dtype name of every packed tensor (values and scales) of the leaves in
    `formats` (path -> format), for a checkpoint saved quantised."""
    out = {}
    for p in names:
        if p.path in formats:
            values, scales = PACKED_DTYPES[formats[p.path]]
            out.update({n: values for n in p.names()})
            out.update({n + SCALE_SUFFIX: scales for n in p.names()})
    return out


def load_params(names: Sequence[Param], get: Callable, formats: Optional[dict] = None, stored: bool = False,
                dtype=None, place: Optional[Callable] = None) -> dict:
    """Our pytree from `get(hf name, raw=False) -> np.ndarray`, one leaf at a time, each moved to the device by
    `place(path, value)` (`sharding.placer`: the default device, or its shards of a mesh) as soon as it is read.
    The leaves in `formats` (path -> format) become `quant.QWeight`s computing in `dtype`: read packed
    (`get(name, raw=True)`, as stored) when the checkpoint was saved quantised (`stored`), else quantised
    here from the float values. A load that takes over a second shows a progress bar on a terminal's stderr."""
    formats = formats or {}
    place = place or sharding.placer((), None)
    params: dict = {}
    with tqdm(total=sum(len(p.names()) for p in names), desc="loading weights", unit="tensor", delay=1.0,
              leave=False, disable=None) as bar:
        for p in names:
            fmt = formats.get(p.path)
            if fmt is None:
                value = p.assemble(get)
            elif stored:
                value = quant.from_packed(p.assemble(lambda n: get(n, raw=True)),
                                          p.assemble(lambda n: get(n + SCALE_SUFFIX, raw=True)), fmt, dtype)
            else:
                value = quant.quantize_array(p.assemble(get), fmt, dtype, path="/".join(p.path))
            _set(params, p.path, place(p.path, value))
            bar.update(len(p.names()))
    return params


def hf_tensors(names: Sequence[Param], params, dtype) -> dict:
    """Hugging Face name -> contiguous numpy array, float leaves in `dtype`, quantised ones as packed values and
    scales (`SCALE_SUFFIX`): the inverse of `load_params`."""
    np_dtype = jnp.dtype(dtype)
    out = {}
    for p in names:
        x = leaf(params, p.path)
        if isinstance(x, quant.QWeight):
            out.update((n, np.ascontiguousarray(a)) for n, a in p.split(np.asarray(x.data)))
            out.update((n + SCALE_SUFFIX, np.ascontiguousarray(a)) for n, a in p.split(np.asarray(x.scales)))
            continue
        for name, part in p.split(np.asarray(x)):
            out[name] = np.ascontiguousarray(part.astype(np_dtype))
    return out


def check_params(expected, params, what: str) -> None:
    """Refuse a params pytree whose structure or leaf shapes differ from `expected` (a tree of shapes)."""
    name = jax.tree_util.keystr
    want = {name(k): s for k, s in jax.tree_util.tree_flatten_with_path(
        expected, is_leaf=lambda s: isinstance(s, tuple))[0]}
    got = {name(k): tuple(np.shape(x))
           for k, x in jax.tree_util.tree_flatten_with_path(params, is_leaf=quant.is_quantized)[0]}
    wrong = [f"{k}: {got.get(k, 'missing')} (expected {want.get(k, 'nothing')})"
             for k in sorted(set(want) | set(got)) if want.get(k) != got.get(k)]
    if wrong:
        raise ValueError(f"{what} params do not match the config: {'; '.join(wrong[:8])}")

