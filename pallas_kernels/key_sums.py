"""Sums over a row at or above each of several pivots: a pass of the sampling filter's threshold search
(docs/architecture.md, "Pallas kernels"):

    out[..., j] = sum over t of (values[..., t] if keys[..., t] >= pivots[..., j] else 0)

with uint32 order keys `[..., V]`, pivots `[..., P]` and `values` float32 `[..., V]` (a float32 mass), or
None (an int32 count). `impl="xla"` is the jnp reference. XLA reduces it as one row reduction per pivot and
so reads the row once per pivot: each pivot cost what a whole reduction does on the H200
(`sampling.FILTER_WAYS`). `impl="pallas"` (Triton) reads each chunk of a row once and compares it with all
the pivots in registers: the grid is (row, chunk), each program writes its chunk's P partial sums, and XLA adds
a row's partials. `impl="mosaic"` is the same grid in Pallas's Mosaic GPU lowering (`pallas_kernels/mosaic_gpu.py`):
each program copies its chunk of keys and values and its row's pivots into shared memory and reduces the chunk
once per pivot across the warpgroup. A count is exact every way; a mass adds its terms in another order, so two
ways can round apart in the last bits.

Rows are padded to whole chunks with the smallest key. The Triton program masks the keys past the row's end; the
Mosaic GPU one counts them, and their count comes off where a pivot is that smallest key (their values are zeros,
so no mass needs it). Pivots are padded, to a power of two for Triton's tiles and to 32 (the warpgroup's 128-byte
copy) for Mosaic GPU, and the padded pivots' sums are dropped.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_gpu
from pallas_kernels.mosaic_gpu import interpret_params
from pallas_kernels.windowed_attention import _triton_compiler_params, where_lowered

IMPLS = ("xla", "pallas", "mosaic")
TILE = 8192
"""Key-pivot comparisons a program holds at once: a chunk is `TILE // P` keys for P (padded) pivots."""
MIN_CHUNK = 128
NUM_WARPS = 4
_SIGN = 0x80000000
_MOSAIC_PIVOTS = 32
"""Mosaic GPU pivots are padded to a multiple of this: a warpgroup's copy moves a multiple of 128 bytes."""
_MOSAIC_LANES = 256
"""A Mosaic GPU copy moves at most this many elements along a dimension: a chunk is `[chunk / 256, 256]`."""


def reference(keys: jax.Array, pivots: jax.Array, values: jax.Array | None = None) -> jax.Array:
    """The module docstring's sums in jnp: `[..., P]`, int32 counts when `values` is None."""
    above = keys[..., None, :] >= pivots[..., :, None]
    if values is None:
        return jnp.sum(above, axis=-1, dtype=jnp.int32)
    return jnp.sum(jnp.where(above, values[..., None, :], 0.0), axis=-1)


def chunk_size(pivots: int) -> int:
    """Keys a program reads for `pivots` pivots."""
    return max(MIN_CHUNK, TILE // _padded_pivots(pivots))


def _padded_pivots(pivots: int) -> int:
    return 1 << max(pivots - 1, 0).bit_length()


def row_sums(keys: jax.Array, values: jax.Array | None = None, *, pivots: int, impl: str = "xla",
             interpret: bool | None = None):
    """`(count, mass)`: functions of `pivots` pivots u32[..., pivots] -> the module docstring's sums over these
    rows, without values (int32) and with them (None when `values` is None). The kernel's padded signed keys and
    values are made here once, for every call of the two: a search calls them once a pass. `interpret` as for
    the other kernels: None runs the kernel compiled on CUDA and ROCm and interpreted elsewhere; for "mosaic",
    compiled on CUDA and the reference elsewhere (True runs JAX's GPU interpreter, slow but exact)."""
    if impl not in IMPLS:
        raise ValueError(f"key_sums: impl={impl!r} is not supported; choose one of {IMPLS}.")
    if keys.dtype != jnp.uint32:
        raise ValueError(f"key_sums: keys ({keys.dtype}) must be uint32 order keys.")
    if values is not None and (values.shape != keys.shape or values.dtype != jnp.float32):
        raise ValueError(f"key_sums: values {values.dtype}{list(values.shape)} must be float32 of the keys' "
                         f"shape {list(keys.shape)}.")
    lead, v = keys.shape[:-1], keys.shape[-1]
    rows, pp, chunk = math.prod(lead), _padded_pivots(pivots), chunk_size(pivots)
    if impl == "mosaic":
        chunk = max(chunk, _MOSAIC_LANES)
    vp = -(-v // chunk) * chunk

    def checked(pivots_: jax.Array) -> jax.Array:
        if pivots_.dtype != jnp.uint32 or pivots_.shape != lead + (pivots,):
            raise ValueError(f"key_sums: pivots {pivots_.dtype}{list(pivots_.shape)} must be uint32 order keys "
                             f"{list(lead + (pivots,))}: the keys' leading (row) dimensions and {pivots} a row.")
        return pivots_

    if impl == "xla":
        padded = values

        def run(pivots_: jax.Array, *row_values: jax.Array) -> jax.Array:
            return reference(keys, checked(pivots_), *row_values)
    else:
        # Signed int32 keys in the same order (both lowerings compare them natively): the sign bit flipped; the
        # padding is the smallest key, INT32_MIN.
        smallest = jnp.iinfo(jnp.int32).min
        signed = jnp.pad(jax.lax.bitcast_convert_type(keys.reshape(rows, v) ^ jnp.uint32(_SIGN), jnp.int32),
                         ((0, 0), (0, vp - v)), constant_values=smallest)
        padded = None if values is None else jnp.pad(values.reshape(rows, v), ((0, 0), (0, vp - v)))
        padded_pivots = pp if impl == "pallas" else -(-pivots // _MOSAIC_PIVOTS) * _MOSAIC_PIVOTS

        def kernel_sums(pivots_: jax.Array, *row_values: jax.Array, interpret: bool | None) -> jax.Array:
            piv = jax.lax.bitcast_convert_type(pivots_.reshape(rows, pivots) ^ jnp.uint32(_SIGN), jnp.int32)
            kernel = (functools.partial(_pallas_sums, width=v, chunk=chunk, mass=bool(row_values)) if impl == "pallas"
                      else functools.partial(_mosaic_sums, chunk=chunk, mass=bool(row_values), used=pivots))
            partials = where_lowered(kernel, interpret)(signed, jnp.pad(piv, ((0, 0), (0, padded_pivots - pivots))),
                                                        *row_values)
            sums = jnp.sum(partials, axis=1)[:, :pivots]
            if impl == "mosaic" and not row_values:  # the padding's keys, counted at the smallest pivot
                sums = sums - jnp.where(piv == smallest, vp - v, 0)
            return sums.reshape(lead + (pivots,))

        def unpadded(pivots_: jax.Array, *row_values: jax.Array) -> jax.Array:
            """The reference over the rows as given: what a Mosaic GPU program lowered off CUDA runs."""
            return reference(keys, pivots_, *([values] if row_values else []))

        def run(pivots_: jax.Array, *row_values: jax.Array) -> jax.Array:
            if impl == "pallas":
                return kernel_sums(checked(pivots_), *row_values, interpret=interpret)
            return mosaic_gpu.where_lowered(kernel_sums, interpret, unpadded)(checked(pivots_), *row_values)

    return run, None if values is None else (lambda pivots_: run(pivots_, padded))


def sum_at_or_above(keys: jax.Array, pivots: jax.Array, values: jax.Array | None = None, *, impl: str = "xla",
                    interpret: bool | None = None) -> jax.Array:
    """The module docstring's sums for one set of pivots (`row_sums` for a search that asks many)."""
    count, mass = row_sums(keys, values, pivots=pivots.shape[-1], impl=impl, interpret=interpret)
    return count(pivots) if values is None else mass(pivots)


def _kernel(keys_ref, pivots_ref, *refs, width: int, chunk: int):
    """One chunk of one row against all its pivots: [chunk] keys, [P] pivots -> [P] partial sums; keys at or past
    the row's `width` (the padding) count for none."""
    *values_ref, out_ref = refs
    inside = pl.program_id(1) * chunk + jnp.arange(chunk) < width
    above = inside[:, None] & (keys_ref[0, :][:, None] >= pivots_ref[0, :][None, :])
    if values_ref:
        out_ref[0, 0, :] = jnp.sum(jnp.where(above, values_ref[0][0, :][:, None], 0.0), axis=0)
    else:
        out_ref[0, 0, :] = jnp.sum(above.astype(jnp.int32), axis=0)


def _pallas_sums(keys, pivots, *values, width: int, chunk: int, mass: bool, interpret: bool):
    rows, vp = keys.shape
    pp = pivots.shape[1]
    n_chunks = vp // chunk
    row_chunk = pl.BlockSpec((1, chunk), lambda r, c: (r, c))
    in_specs = [row_chunk, pl.BlockSpec((1, pp), lambda r, c: (r, 0))] + [row_chunk] * len(values)
    return pl.pallas_call(
        functools.partial(_kernel, width=width, chunk=chunk),
        grid=(rows, n_chunks),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((1, 1, pp), lambda r, c: (r, c, 0)),
        out_shape=jax.ShapeDtypeStruct((rows, n_chunks, pp), jnp.float32 if mass else jnp.int32),
        compiler_params=_triton_compiler_params(NUM_WARPS, 1),
        interpret=interpret,
        name="key_sums",
    )(keys, pivots, *values)


def _mosaic_sums(keys, pivots, *values, chunk: int, mass: bool, used: int, interpret: bool):
    """The Mosaic GPU kernel: grid (row, chunk); partial sums `[rows, chunks, P]` of which the first `used` pivots'
    are written (the rest are the padding's, dropped by the caller)."""
    rows, vp = keys.shape
    pp = pivots.shape[1]
    dtype = jnp.float32 if mass else jnp.int32
    tile = (chunk // _MOSAIC_LANES, _MOSAIC_LANES)

    def body(keys_gmem, pivots_gmem, *refs):
        *values_gmem, out_gmem = refs
        r, c = jax.lax.axis_index("row"), jax.lax.axis_index("chunk")
        span = pl.ds(c * tile[0], tile[0])

        def scoped(out_smem, barriers, keys_smem, pivots_smem, *values_smem):
            copies = [(keys_gmem.at[r, span], keys_smem), (pivots_gmem.at[r], pivots_smem)]
            copies += [(src.at[r, span], dst) for src, dst in zip(values_gmem, values_smem)]
            for i, (src, dst) in enumerate(copies):
                plgpu.copy_gmem_to_smem(src, dst, barriers.at[i])
            for i in range(len(copies)):
                plgpu.barrier_wait(barriers.at[i])
            row_keys = keys_smem[...]
            row_values = values_smem[0][...] if mass else None
            for j in range(used):
                above = row_keys >= pivots_smem[j]
                out_smem[j] = (jnp.sum(jnp.where(above, row_values, 0.0)) if mass
                               else jnp.sum(above.astype(jnp.int32)))
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[r, c])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scoped, plgpu.SMEM((pp,), dtype), plgpu.Barrier(num_barriers=2 + mass),
                      plgpu.SMEM(tile, jnp.int32), plgpu.SMEM((pp,), jnp.int32),
                      *([plgpu.SMEM(tile, jnp.float32)] if mass else []))

    lanes = (rows, vp // _MOSAIC_LANES, _MOSAIC_LANES)
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((rows, vp // chunk, pp), dtype), grid=(rows, vp // chunk),
                        grid_names=("row", "chunk"), kernel_name="key_sums", interpret=interpret_params(interpret))(
        keys.reshape(lanes), pivots, *(v.reshape(lanes) for v in values))
