"""Grouped expert products for a few tokens: each group of rows times one expert's matrix.

    out[g] = x[g] @ w[expert[g]]        (float32 accumulation; groups with expert[g] < 0 give zeros)

x `[G, M, K]` (M rows per group, zero-padded; or `[1, M, K]`, the same rows for every group, as a decode step's
one token meets each of its k experts), w `[E, K, N]`, expert int32 `[G]`. The MoE block of a
hybrid target (dflash_jax/targets/moe.py, `impl="grouped"`) sorts its T*k (token, expert) rows by
expert into groups, one per distinct expert, so each chosen expert is read once however many of
the block's tokens chose it. That is what a decode step (1 token, 8 experts) and a verify (16 tokens,
about 100 distinct experts of 256) must read; `jax.lax.ragged_dot` walks every one of the E groups
and a gather copies each expert per token.

`impl="xla"` is the jnp reference (a gather of the G matrices, then one batched product).
`impl="pallas"` reads each live group's matrix straight from `w` (its index comes from `expert`,
so nothing is copied) in `[BLOCK_K, BLOCK_N]` tiles, software-pipelined; a dead group's program
runs no tile and writes zeros. Grid: (group, output tile, K split). A decode step has only k
groups of one row, so K is split until the grid has about `TARGET_PROGRAMS` programs (the H200
has 132 SMs); the splits' partial products are summed afterwards, in a fixed order. (Repeating a one-row group
to the tensor cores' 16 rows on chip, instead of padding it in memory by a kernel before the product, gained nothing
measurable on a 35B-A3B decode step, 3.217 against 3.223 ms on an H100, and was removed.)

Lowering: Triton. The expert index selects the matrix inside the kernel, a dynamic offset on
the weight's leading axis; Mosaic GPU on JAX 0.11 takes block offsets only from the grid
(BlockSpec index maps), and its WGMMA tiles need 64 rows where a group has 16.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.windowed_attention import SMEM_BYTES, _triton_compiler_params, where_lowered

IMPLS = ("xla", "pallas")
ROWS = 16
"""Rows per group are padded to a power of two of at least this (Triton's smallest matmul tile; the Triton
lowering takes only power-of-two block shapes: 48 rows, a verify of 3 x 16 tokens, failed to lower)."""

# Tile settings, picked with `bench/moe.py --sweep` on an H200 (JAX 0.11.2, bench/results/moe.json).
BLOCK_K = 128
BLOCK_N = 128
NUM_WARPS = 4
NUM_STAGES = 3
TARGET_PROGRAMS = 264


def expert_matmul(x: jax.Array, w: jax.Array, expert: jax.Array, *, impl: str = "xla",
                  interpret: bool | None = None, **tiles) -> jax.Array:
    """`float32[G, M, N]`: group g's rows `x[g]` times `w[expert[g]]`, zeros where `expert[g] < 0`.

    x `[G, M, K]` and w `[E, K, N]` share a floating dtype; expert int `[G]` in `[-1, E)`. float32
    inputs multiply at full float32 precision. `interpret` as in `block_attention`: None runs the
    kernel compiled on CUDA and interpreted elsewhere. `tiles` (block_k, block_n, num_warps,
    num_stages, target_programs) override the module's settings, for sweeps."""
    _check(x, w, expert, impl)
    expert = expert.astype(jnp.int32)
    if impl == "xla":
        return _reference(x, w, expert)
    return where_lowered(functools.partial(_pallas, **tiles), interpret)(x, w, expert)


def _precision(dtype):
    return lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT


def _reference(x, w, expert):
    x = jnp.broadcast_to(x, (expert.shape[0],) + x.shape[1:])
    mats = jnp.take(w, jnp.maximum(expert, 0), axis=0)
    out = jnp.einsum("gmk,gkn->gmn", x, mats, precision=_precision(x.dtype), preferred_element_type=jnp.float32)
    return jnp.where((expert >= 0)[:, None, None], out, 0.0)


def _kernel(e_ref, x_ref, w_ref, o_ref, *, block_k, block_n, steps, precision):
    """One (group, output tile, K split): `steps` tiles of the group's expert, accumulated in float32."""
    e = e_ref[()]
    cols = pl.ds(pl.program_id(1) * block_n, block_n)
    first = pl.program_id(2) * steps

    def step(t, acc):
        rows = pl.ds((first + t) * block_k, block_k)
        return acc + jnp.dot(x_ref[:, rows], w_ref[e, rows, cols], precision=precision,
                             preferred_element_type=jnp.float32)

    @pl.when(e >= 0)
    def _live():
        o_ref[...] = lax.fori_loop(0, steps, step, jnp.zeros(o_ref.shape, jnp.float32))

    @pl.when(e < 0)
    def _dead():
        o_ref[...] = jnp.zeros(o_ref.shape, jnp.float32)


def _splits(programs: int, k_steps: int, target: int) -> int:
    """The largest divisor of `k_steps` not above the splits that bring `programs` up to about `target`."""
    want = max(1, min(k_steps, -(-target // programs)))
    return max(d for d in range(1, want + 1) if k_steps % d == 0)


def _pallas(x, w, expert, *, interpret, block_k: int = BLOCK_K, block_n: int = BLOCK_N,
            num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES, target_programs: int = TARGET_PROGRAMS):
    """Pad rows to `padded_rows`, K and N to their tiles (zeros add nothing), run the grid, sum the splits, crop."""
    g, m, k = expert.shape[0], x.shape[1], x.shape[2]
    n = w.shape[2]
    mp = padded_rows(m)
    block_k, block_n, num_stages = fit_tiles(mp, x.dtype.itemsize, min(block_k, max(16, pl.next_power_of_2(k))),
                                             min(block_n, max(16, pl.next_power_of_2(n))), num_stages)
    kp, np_ = _round_up(k, block_k), _round_up(n, block_n)
    x = jnp.pad(x, ((0, 0), (0, mp - m), (0, kp - k)))
    if (kp, np_) != (k, n):
        w = jnp.pad(w, ((0, 0), (0, kp - k), (0, np_ - n)))
    n_tiles = np_ // block_n
    splits = _splits(g * n_tiles, kp // block_k, target_programs)
    kernel = functools.partial(_kernel, block_k=block_k, block_n=block_n, steps=kp // block_k // splits,
                               precision=_precision(x.dtype))
    out = pl.pallas_call(
        kernel,
        grid=(g, n_tiles, splits),
        in_specs=[
            pl.BlockSpec((None,), lambda i, j, s: (i,)),
            pl.BlockSpec((None, mp, kp), _group_rows(x)),
            pl.BlockSpec(w.shape, lambda i, j, s: (0, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, mp, block_n), lambda i, j, s: (s, i, 0, j)),
        out_shape=jax.ShapeDtypeStruct((splits, g, mp, np_), jnp.float32),
        compiler_params=_triton_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="expert_matmul",
    )(expert, x, w)
    return jnp.sum(out, axis=0)[:, :m, :n]


def _group_rows(x):
    """The index map of x's block: group i's rows, or the one shared group's."""
    if x.shape[0] == 1:
        return lambda i, j, s: (0, 0, 0)
    return lambda i, j, s: (i, 0, 0)


def smem_bytes(rows: int, itemsize: int, block_k: int, block_n: int, num_stages: int) -> int:
    """Shared memory a program takes: per pipeline stage an x tile and a weight tile. This is what the H200
    asked for at 512 bf16 rows with the default tiles (491,520 bytes, over `SMEM_BYTES`)."""
    return num_stages * (rows * block_k + block_k * block_n) * itemsize


def fit_tiles(rows: int, itemsize: int, block_k: int, block_n: int, num_stages: int) -> tuple[int, int, int]:
    """`(block_k, block_n, num_stages)` cut until `smem_bytes` fits `SMEM_BYTES`: stages down to 2, then K and N
    tiles halved down to 16, then one stage; groups too tall even for that are refused."""
    while smem_bytes(rows, itemsize, block_k, block_n, num_stages) > SMEM_BYTES:
        if num_stages > 2:
            num_stages -= 1
        elif block_k > 16:
            block_k //= 2
        elif block_n > 16:
            block_n //= 2
        elif num_stages > 1:
            num_stages -= 1
        else:
            raise ValueError(f"expert_matmul: groups of {rows} rows of {itemsize}-byte values do not fit one "
                             f"program's shared memory ({SMEM_BYTES} bytes) at any tile; pass fewer rows per group.")
    return block_k, block_n, num_stages


def padded_rows(m: int) -> int:
    """The rows a group of `m` is padded to: the power of two at or above `m`, at least `ROWS`."""
    return max(ROWS, pl.next_power_of_2(m))


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _check(x, w, expert, impl) -> None:
    """Refuse a bad impl, dtype or shape here, with a sentence, instead of deep inside XLA."""
    if impl not in IMPLS:
        raise ValueError(f"expert_matmul: impl={impl!r} is not supported; choose one of {IMPLS}.")
    if (x.ndim != 3 or w.ndim != 3 or expert.ndim != 1 or x.shape[2] != w.shape[1]
            or x.shape[0] not in (1, expert.shape[0])):
        raise ValueError(f"expert_matmul: takes x [G, M, K] (or [1, M, K], shared by every group), w [E, K, N] and "
                         f"expert [G]; got x {x.shape}, w {w.shape}, expert {expert.shape}.")
    if x.dtype != w.dtype or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"expert_matmul: x and w must share one floating dtype; got {x.dtype} and {w.dtype}.")
    if not jnp.issubdtype(expert.dtype, jnp.integer):
        raise ValueError(f"expert_matmul: expert has dtype {expert.dtype}; expected integer ids in [-1, {w.shape[0]}).")


__all__ = ["IMPLS", "expert_matmul"]
