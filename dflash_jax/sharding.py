"""Tensor-parallel and data-parallel placement: which mesh axis splits which dimension of every leaf.

Written once as tables, in the style of jax-llm-examples: each family's table maps a leaf's path (a
pattern over `"/".join(path)`) to the logical axis of each of its dimensions (heads, KV heads, MLP,
vocabulary, experts, value heads, batch), and `LOGICAL` maps logical axes to mesh axes; changing the
parallel layout is one edit of `LOGICAL`. XLA's SPMD partitioner does the rest: every collective
(the all-reduce after a row-split projection, the reduction of an argmax over a vocabulary split) is
inserted by the compiler, so the decoding loops stay one jitted `lax.while_loop` and no code here
communicates (docs/architecture.md, "Several GPUs and hosts").

A leaf matching no pattern, and every dimension whose logical axis is None, is replicated. A dimension
that its mesh axis does not divide is replicated too (e.g. 2 KV heads over 4 devices: each device holds
both), or refused with `strict=True`, naming the leaf, the dimension and the mesh size.

Fused leaves (q|k|v, gate|up, the Gated DeltaNet input projection) are split evenly along the fused
axis. That is correct under SPMD, but a shard boundary need not fall on a q/k/v or gate/up boundary, so
XLA moves some columns between devices after the projection (a per-device interleaved layout, written
at load time, would make it local: not done yet).
"""
from __future__ import annotations

import contextlib
import math
import re
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from dflash_jax import quant
from pallas_kernels.mesh import DP, TP

LOGICAL = {"batch": DP, "heads": TP, "kv_heads": TP, "value_heads": TP, "mlp": TP, "vocab": TP, "experts": TP}
"""Logical axis -> mesh axis: TP, tensor parallel (within a host's NVLink domain), or DP, batch rows (may cross
hosts); `pallas_kernels.mesh` names both, as the kernels split over them too."""

_ATTENTION = [
    (r"(.*/)?wqkv", (None, "heads")),   # fused q|k|v (hybrid: q|gate|k|v)
    (r"(.*/)?bqkv", ("heads",)),
    (r"(.*/)?wq", (None, "heads")),
    (r"(.*/)?wkv", (None, "kv_heads")),  # fused k|v of a drafter layer
    (r"(.*/)?wo", ("heads", None)),
]
_MLP = [
    (r"(.*/)?(w|shared|experts)_gate_up", ("experts", None, None)),  # stacked experts [E, in, out]
    (r"(.*/)?(w|shared|experts)_down", ("experts", None, None)),
    (r"(.*/)?(w|shared)_gate_up", (None, "mlp")),                   # fused gate|up
    (r"(.*/)?(w|shared)_down", ("mlp", None)),
]
_VOCAB = [
    (r"embed", ("vocab", None)),
    (r"lm_head", (None, "vocab")),
]

RULES = {
    "dense": _VOCAB + _ATTENTION + _MLP,
    "hybrid": _VOCAB + _ATTENTION + _MLP + [
        (r"(.*/)?in_proj", (None, "heads")),   # fused q|k|v, z, b, a of a Gated DeltaNet layer
        (r"(.*/)?out_proj", ("value_heads", None)),
    ],
    "gemma4": _VOCAB + _ATTENTION + _MLP + [
        (r"embed_per_layer", ("vocab", None)),
    ],
    "dflash": _ATTENTION + _MLP,
    "dspark": _ATTENTION + _MLP + [
        (r"markov_w1", ("vocab", None)),
        (r"markov_w2", (None, "vocab")),
    ],
    "dflash2": _ATTENTION + _MLP + [
        (r"selector_(pred|succ)", ("vocab", None)),
    ],
}
"""Family -> `[(path pattern, logical axes per dimension)]`; the first pattern that matches the whole path and
has one entry per dimension of the leaf wins."""

STATE_RULES = [
    (r"\.(k|v)\[\d+\]", ("batch", None, "kv_heads", None)),   # K/V [B, S, n_kv, head_dim]
    (r"\.ssm\[\d+\]", ("batch", "value_heads", None, None)),  # recurrent state [B, nv, hk, hv]
]
"""Decoding-state leaf (its `jax.tree_util.keystr`) -> logical axes; any other leaf splits its batch rows only."""


def make_mesh(tp: int = 1, dp: int = 1, devices: Optional[Sequence] = None) -> Mesh:
    """A `(dp, tp)` mesh over `devices` (default every device of every process): consecutive devices share a
    tensor-parallel group, so with one process per host `tp` stays within a host and `dp` crosses hosts."""
    devices = list(jax.devices() if devices is None else devices)
    if tp < 1 or dp < 1 or tp * dp != len(devices):
        raise ValueError(f"make_mesh: tp={tp} times dp={dp} must be the {len(devices)} devices there are")
    return Mesh(np.array(devices).reshape(dp, tp), (DP, TP), axis_types=(AxisType.Auto, AxisType.Auto))


def initialize_distributed(coordinator_address: str, num_processes: int, process_id: int, **kwargs) -> None:
    """`jax.distributed.initialize` for one process per host (CPU processes exchange over gloo); call it before
    anything else touches JAX, then build one global `make_mesh` in every process."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, **kwargs)


def check_mesh(mesh: Mesh) -> None:
    """Refuse a mesh without the tensor-parallel axis (a missing data-parallel axis replicates the batch)."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (see dflash_jax.sharding.make_mesh); "
                        f"got {type(mesh).__name__}")
    if TP not in mesh.axis_names:
        raise ValueError(f"the mesh has axes {tuple(mesh.axis_names)}; dflash_jax shards over an axis named {TP!r} "
                         f"(and batch rows over {DP!r}): build one with dflash_jax.sharding.make_mesh(tp=..., dp=...)")


def spec_for(name: str, shape: tuple, logical: Sequence, mesh: Mesh, strict: bool = False) -> PartitionSpec:
    """The PartitionSpec of leaf `name` of `shape` whose dimensions have the `logical` axes: each mapped to its
    mesh axis where that axis divides the dimension (else replicated, or refused with `strict`)."""
    out = []
    for dim, (size, axis) in enumerate(zip(shape, logical)):
        mesh_axis = LOGICAL.get(axis) if axis else None
        n = mesh.shape.get(mesh_axis, 1) if mesh_axis else 1
        if n > 1 and size % n:
            if strict:
                raise ValueError(f"{name}: dimension {dim} ({axis}, size {size}) does not split over mesh axis "
                                 f"{mesh_axis!r} of size {n}; use a mesh whose {mesh_axis!r} size divides {size}, "
                                 f"or strict=False to replicate that dimension")
            n = 1
        out.append(mesh_axis if n > 1 else None)
    while out and out[-1] is None:
        out.pop()
    return PartitionSpec(*out)


def logical_axes(rules: Sequence, name: str, ndim: int) -> tuple:
    """The logical axes of leaf `name` with `ndim` dimensions under `rules` (all None when no rule matches)."""
    for pattern, axes in rules:
        if len(axes) == ndim and re.fullmatch(pattern, name):
            return axes
    return (None,) * ndim


def param_spec(rules: Sequence, path: Sequence, leaf, mesh: Mesh, strict: bool = False):
    """The PartitionSpec of the param at `path` (a `quant.QWeight`: the spec of both its packed values and scales,
    split along the output axis only, where the float leaf's rule splits it)."""
    name = "/".join(path)
    if isinstance(leaf, quant.QWeight):
        axes = logical_axes(rules, name, len(leaf.shape))
        return spec_for(name, leaf.data.shape, (None,) * (leaf.data.ndim - 1) + (axes[-1],), mesh, strict)
    return spec_for(name, tuple(np.shape(leaf)), logical_axes(rules, name, np.ndim(leaf)), mesh, strict)


def place(value, spec: PartitionSpec, mesh: Mesh):
    """`value` (an array, or a `quant.QWeight` whose values and scales both take `spec`) on `mesh` as `spec` says."""
    sharding = NamedSharding(mesh, spec)
    if isinstance(value, quant.QWeight):
        return value.replace(data=jax.device_put(value.data, sharding),
                             scales=jax.device_put(value.scales, sharding))
    return jax.device_put(value, sharding)


def placer(rules: Sequence, mesh: Optional[Mesh], strict: bool = False):
    """`(path, value) -> value` placed by `rules` on `mesh` (for `io.names.load_params`, leaf by leaf); `jnp.asarray`
    to the default device without a mesh."""
    if mesh is None:
        return lambda path, value: value if isinstance(value, quant.QWeight) else jnp.asarray(value)
    check_mesh(mesh)
    return lambda path, value: place(value, param_spec(rules, path, value, mesh, strict), mesh)


def param_specs(rules: Sequence, params, mesh: Mesh, strict: bool = False):
    """The params pytree with the PartitionSpec of every leaf (QWeights as one leaf)."""
    return jax.tree_util.tree_map_with_path(lambda p, x: param_spec(rules, quant.path_keys(p), x, mesh, strict), params,
                                            is_leaf=quant.is_quantized)


def shard_params(rules: Sequence, params, mesh: Mesh, strict: bool = False):
    """`params` placed on `mesh` by `rules`, leaf by leaf."""
    check_mesh(mesh)
    specs = param_specs(rules, params, mesh, strict)
    return jax.tree.map(lambda x, s: place(x, s, mesh), params, specs, is_leaf=quant.is_quantized)


def mesh_of(params) -> Optional[Mesh]:
    """The mesh the params were placed on by these rules, or None (one device, as loaded without a mesh). The
    rules place every leaf, so the first one says: a call costs no walk over the params."""
    leaves = jax.tree.leaves(params)
    s = getattr(leaves[0], "sharding", None) if leaves else None
    return s.mesh if isinstance(s, NamedSharding) else None


def state_specs(state, mesh: Mesh):
    """The decoding state pytree with each leaf's PartitionSpec under `STATE_RULES` (never refused: a dimension the
    mesh does not divide is replicated, e.g. the batch of one row over two data-parallel groups)."""
    def spec(path, x):
        name = jax.tree_util.keystr(path)
        axes = logical_axes(STATE_RULES, name, x.ndim)
        if not any(axes) and x.ndim:
            axes = ("batch",) + (None,) * (x.ndim - 1)
        return spec_for(name, x.shape, axes, mesh)

    return jax.tree_util.tree_map_with_path(spec, state)


def device_bytes(shapes, mesh: Optional[Mesh]) -> int:
    """Bytes one device holds of a state of `shapes` (ShapeDtypeStructs) placed by `state_specs` on `mesh`
    (all of it without one)."""
    specs = jax.tree.leaves(state_specs(shapes, mesh), is_leaf=lambda s: isinstance(s, PartitionSpec)) if mesh \
        else [PartitionSpec()] * len(jax.tree.leaves(shapes))
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize
               // math.prod(mesh.shape[a] for a in spec if a is not None)
               for x, spec in zip(jax.tree.leaves(shapes), specs))


def place_state(model, state):
    """A fresh decoding state of `model` (a Target or Drafter) placed on the mesh of its params (as they are
    without one), K/V split by KV heads and recurrent state by value heads as the weights that write them."""
    mesh = mesh_of(model.params)
    if mesh is None:
        return state
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), state, state_specs(state, mesh))


def fetch(tree):
    """`jax.device_get` of `tree`, gathering from every process the arrays that span devices of other processes
    (a state split over hosts): each process gets the whole value."""
    def get(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return jax.device_get(x)

    if all(not isinstance(x, jax.Array) or x.is_fully_addressable for x in jax.tree.leaves(tree)):
        return jax.device_get(tree)
    return jax.tree.map(get, tree)


def models_mesh(*models) -> Optional[Mesh]:
    """The mesh of several devices that the params of `models` (Targets, Drafters, or None) are on, or None when
    each is on one device; models on two different meshes are refused."""
    meshes = {mesh for m in models if m is not None and (mesh := mesh_of(m.params)) is not None and mesh.size > 1}
    if len(meshes) > 1:
        raise ValueError(f"the target and the drafter are placed on different meshes "
                         f"({', '.join(sorted(str(dict(m.shape)) for m in meshes))}); place both on one")
    return next(iter(meshes), None)


def mesh_context(mesh: Optional[Mesh]):
    """`jax.set_mesh(mesh)` (`models_mesh`) around tracing and running the decoding loops: under it the Pallas
    kernels run per device (`pallas_kernels.mesh.per_device`); a null context without a mesh."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)