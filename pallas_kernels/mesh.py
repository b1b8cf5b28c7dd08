"""Kernels under a mesh. A Pallas call is one device's program, which XLA's SPMD partitioner cannot split, so a
kernel traced inside `jax.set_mesh(mesh)` (the decoding loops set the mesh of a sharded model:
`dflash_jax.sharding.mesh_context`) runs under `shard_map`, each device on its own heads and batch rows. Without a
mesh, or where the heads (rows) do not split evenly over it, the call is left as it is.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import jax
from jax.sharding import PartitionSpec

TP, DP = "tp", "dp"
"""The mesh axes (`dflash_jax.sharding` builds its meshes over them): heads split over TP, batch rows over DP."""

Dims = tuple[Optional[int], Optional[int]]
"""(batch dimension, head dimension) of one array; None where it has none."""


def context_mesh():
    """The mesh `jax.set_mesh` set around this trace, when it spans several devices over a `TP` axis; else None."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty or mesh.size == 1 or TP not in mesh.axis_names else mesh


def per_device(fn: Callable, args: Sequence, in_dims: Sequence[Dims], out_dims: Sequence[Dims]):
    """`fn(*args)`, run per device of the mesh in context when one is set: the args split along their batch and
    head dimensions (`in_dims`), the outputs (a tuple, or one array for a single `out_dims`) joined along theirs.
    `fn` must treat every head and batch row independently (attention heads with their KV heads, delta-rule heads)."""
    mesh = context_mesh()
    if mesh is None:
        return fn(*args)
    shape = dict(zip(mesh.axis_names, mesh.axis_sizes))

    def divides(axis: str, pos: int) -> bool:
        n = shape.get(axis, 1)
        return n > 1 and all(x.shape[d[pos]] % n == 0 for x, d in zip(args, in_dims) if d[pos] is not None)

    split = {DP: divides(DP, 0), TP: divides(TP, 1)}
    if not any(split.values()):
        return fn(*args)

    def spec(ndim: int, dims: Dims) -> PartitionSpec:
        axes = [None] * ndim
        for axis, d in zip((DP, TP), dims):
            if d is not None and split[axis]:
                axes[d] = axis
        return PartitionSpec(*axes)

    outs = jax.eval_shape(fn, *args)
    single = not isinstance(outs, (tuple, list))
    out_specs = tuple(spec(o.ndim, d) for o, d in zip([outs] if single else outs, out_dims))
    run = jax.shard_map(fn, mesh=mesh, in_specs=tuple(spec(x.ndim, d) for x, d in zip(args, in_dims)),
                        out_specs=out_specs[0] if single else out_specs, check_vma=False)
    return run(*args)
