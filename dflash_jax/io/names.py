"""Name maps: how a family's parameter pytree is made of Hugging Face tensors.

Each family keeps one map beside its module (`targets/dense_names.py`, `drafters/dflash_names.py`):
a list of `Param`s, each one leaf of our pytree and the Hugging Face tensors it is made of.
From the map and the module's own shapes this file derives the three things that used to be
written by hand per family: the tensors a checkpoint must hold, loading, and writing back.

Hugging Face stores linear weights `[out, in]`; our leaves store them `[in, out]` (the forward
does `x @ W`), with fused projections (q|k|v, gate|up) concatenated along the last axis. This is
the only place where layouts change.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm


@dataclasses.dataclass(frozen=True)
class Param:
    """One leaf at `path` made of the Hugging Face tensors `hf`, concatenated along our last axis.

    `widths` gives each tensor's share of that axis (None: one tensor, the whole axis);
    `transpose` marks linear weights (Hugging Face `[out, in]`, ours `[in, out]`).
    """

    path: tuple
    hf: tuple
    widths: Optional[tuple] = None
    transpose: bool = False

    def pieces(self, shape: tuple) -> list:
        """`(hf name, hf shape)` of each tensor of a leaf of `shape`."""
        widths = self.widths or (shape[-1],)
        if len(widths) != len(self.hf) or sum(widths) != shape[-1]:
            raise ValueError(f"name map entry {self.path}: widths {widths} do not split a leaf of shape {shape}")
        out = []
        for name, w in zip(self.hf, widths):
            ours = tuple(shape[:-1]) + (w,)
            out.append((name, ours[::-1] if self.transpose else ours))
        return out


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


def hf_shapes(names: Sequence[Param], shapes) -> dict:
    """Hugging Face name -> shape that a checkpoint must hold, from the map and the module's shapes."""
    return {n: s for p in names for n, s in p.pieces(tuple(leaf(shapes, p.path)))}


def load_params(names: Sequence[Param], get: Callable) -> dict:
    """Our pytree from `get(hf name) -> np.ndarray`, one leaf at a time, each moved to the device. A load
    that takes over a second shows a progress bar on a terminal's stderr."""
    params: dict = {}
    with tqdm(total=sum(len(p.hf) for p in names), desc="loading weights", unit="tensor", delay=1.0, leave=False,
              disable=None) as bar:
        for p in names:
            arrays = [get(n).T if p.transpose else get(n) for n in p.hf]
            _set(params, p.path, jnp.asarray(arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=-1)))
            bar.update(len(p.hf))
    return params


def hf_tensors(names: Sequence[Param], params, dtype) -> dict:
    """Hugging Face name -> contiguous numpy array in `dtype`, the inverse of `load_params`."""
    np_dtype = jnp.dtype(dtype)
    out = {}
    for p in names:
        x = np.asarray(leaf(params, p.path))
        cuts = np.cumsum(p.widths or (x.shape[-1],))[:-1]
        for name, part in zip(p.hf, np.split(x, cuts, axis=-1)):
            out[name] = np.ascontiguousarray((part.T if p.transpose else part).astype(np_dtype))
    return out


def check_params(expected, params, what: str) -> None:
    """Refuse a params pytree whose structure or leaf shapes differ from `expected` (a tree of shapes)."""
    name = jax.tree_util.keystr
    want = {name(k): s for k, s in jax.tree_util.tree_flatten_with_path(
        expected, is_leaf=lambda s: isinstance(s, tuple))[0]}
    got = {name(k): tuple(np.shape(x)) for k, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    wrong = [f"{k}: {got.get(k, 'missing')} (expected {want.get(k, 'nothing')})"
             for k in sorted(set(want) | set(got)) if want.get(k) != got.get(k)]
    if wrong:
        raise ValueError(f"{what} params do not match the config: {'; '.join(wrong[:8])}")

