"""Weight-only quantised products `x @ W` with W kept packed (docs/architecture.md, "Weight precision").

W is a weight leaf `[K, N]` (`[in, out]`, as every leaf is stored). Its formats, blocks running
along K, the input axis, as the original's blocks run along each output row:

- `int8`: `data int8 [K, N]`, `scales float32 [1, N]`: one scale per output channel, W = data * scale.
- `q8_0`: `data int8 [K, N]`, `scales float16 [K/32, N]`: W[k, n] = data[k, n] * scales[k // 32, n].
- `q4_0`: `data uint8 [K/2, N]`, `scales float16 [K/32, N]`. Packed row 16 b + j holds the offset
  values (q + 8, in 0..15) of W[32 b + j] in its low nibble and of W[32 b + 16 + j] in its high
  nibble, the original's order within a block; W = (nibble - 8) * scale.

Scales sit apart from the values (not interleaved per block as in the original's byte stream), so a
tile of either is one rectangular load.

Semantics (both impls): W is dequantised in float32 (value x scale), rounded to the compute dtype (the
model's, bf16 or float32), and multiplied with float32 accumulation; float32 products run at HIGHEST, as
every float32 product of the project does. The result is cast to `out_dtype`.

- `impl="xla"`, the reference: dequantise the whole weight, then one `jnp.matmul`. XLA may fuse the
  dequantisation into the product's operand; `bench/quant.py` measures whether it does.
- `impl="pallas"`: a GEMV/GEMM kernel for 1 to `MAX_ROWS` rows (Triton lowering) that reads the packed
  tiles and expands them in registers. Grid (row tile, column tile, K split): each program walks its
  share of K in tiles of `block_k` (a multiple of 32, so a tile holds whole blocks), dequantises the
  weight tile, and accumulates `[bm, bn]` in float32; the K splits (enough programs to fill the GPU when N
  is small) are summed afterwards in a fixed order. For q4_0, x's columns are first split into the low and
  high halves of each block (`[2, M, K/2]`), so the two nibble planes of a packed tile each meet their
  own half of x and nothing is interleaved in registers. More rows than `MAX_ROWS` (prefill) are a
  compute-bound GEMM and take the reference, as do weights whose N has no power-of-two factor of 16.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.windowed_attention import SMEM_BYTES, _triton_compiler_params, where_lowered

FORMATS = ("int8", "q8_0", "q4_0")
BLOCK = 32
"""Values per block of the block formats (q8_0, q4_0): one float16 scale each."""
IMPLS = ("xla", "pallas")
PACKED_DTYPES = {"int8": ("int8", "float32"), "q8_0": ("int8", "float16"), "q4_0": ("uint8", "float16")}
"""(values, scales) dtypes of each format."""

# The impl a quantised product uses on a GPU. The reference until bench/quant.py has timed the kernel on the
# H200 (it lowers to Triton here, and matches the reference in interpret mode, but has not run on a GPU yet).
GPU_DEFAULT_IMPL = "xla"

# Tile settings: first guesses for the lead's sweep (bench/quant.py --sweep), not yet measured.
MAX_ROWS = 64  # the most rows the kernel takes; more run the reference
BLOCK_N = 128  # largest column tile; the tile is the largest power of two <= this that divides N
BLOCK_K = 256  # largest K tile (a multiple of 32); the tile is the largest power of two <= this that divides K
TARGET_PROGRAMS = 264  # K is split until the grid has about this many programs (2 per H200 SM)
NUM_WARPS = 4
NUM_STAGES = 3


def default_impl(backend: str | None = None) -> str:
    """`GPU_DEFAULT_IMPL` on a GPU, else the reference (off a GPU Pallas only interprets)."""
    return GPU_DEFAULT_IMPL if (backend or jax.default_backend()) == "gpu" else "xla"


def packed_shapes(shape: tuple, fmt: str) -> tuple:
    """`(data shape, scales shape)` of a `[K, N]` weight in `fmt`."""
    k, n = shape
    data = (k // 2, n) if fmt == "q4_0" else (k, n)
    return data, ((1, n) if fmt == "int8" else (k // BLOCK, n))


def dequantize(data, scales, fmt: str):
    """The float32 weight `[K, N]` of packed `data` and `scales` in `fmt`."""
    f32 = jnp.float32
    if fmt == "int8":
        return data.astype(f32) * scales.astype(f32)
    nb, n = scales.shape
    if fmt == "q8_0":
        q = data.astype(f32).reshape(nb, BLOCK, n)
    else:
        planes = data.reshape(nb, BLOCK // 2, n)
        q = jnp.concatenate([planes & 0xF, planes >> 4], axis=1).astype(f32) - 8.0
    return (q * scales.astype(f32)[:, None, :]).reshape(nb * BLOCK, n)


def quant_matmul(x, data, scales, fmt: str, *, out_dtype=None, compute_dtype=None, impl: str = "xla",
                 interpret: bool | None = None):
    """`x [..., K] @ W` for W packed as `data`, `scales` in `fmt` (module docstring). `compute_dtype` is the
    model's (default x's); `out_dtype` defaults to it. `interpret` as for the other kernels: None runs the
    kernel compiled on CUDA and ROCm and interpreted elsewhere."""
    _check_inputs(x, data, scales, fmt, impl)
    compute = jnp.dtype(compute_dtype or x.dtype)
    out = jnp.dtype(out_dtype or compute)
    k, n = data.shape[0] * (2 if fmt == "q4_0" else 1), data.shape[1]
    rows = x.size // k
    if impl == "xla" or rows > MAX_ROWS or not kernel_fits(k, n):
        return _reference(x, data, scales, fmt, compute, out)
    kernel = where_lowered(functools.partial(_pallas_matmul, fmt=fmt, compute=compute), interpret)
    y = kernel(x.reshape(rows, k), data, scales)
    return y.reshape(*x.shape[:-1], n).astype(out)


def kernel_fits(k: int, n: int) -> bool:
    """Whether the kernel tiles a `[K, N]` weight: whole blocks along K, and a column tile of at least 16."""
    return k % BLOCK == 0 and (n & -n) >= 16


def _check_inputs(x, data, scales, fmt, impl) -> None:
    """Refuse a bad format, impl, dtype or shape here, with a sentence, instead of deep inside XLA."""
    if fmt not in FORMATS:
        raise ValueError(f"quant_matmul: fmt={fmt!r} is not a weight format; choose one of {FORMATS}.")
    if impl not in IMPLS:
        raise ValueError(f"quant_matmul: impl={impl!r} is not supported; choose one of {IMPLS}.")
    want = PACKED_DTYPES[fmt]
    if (str(data.dtype), str(scales.dtype)) != want:
        raise ValueError(f"quant_matmul: {fmt} holds data {want[0]} and scales {want[1]}; got {data.dtype} and "
                         f"{scales.dtype}.")
    if data.ndim != 2 or scales.ndim != 2:
        raise ValueError(f"quant_matmul: data {data.shape} and scales {scales.shape} must both be 2-D.")
    k = data.shape[0] * (2 if fmt == "q4_0" else 1)
    if packed_shapes((k, data.shape[1]), fmt) != (data.shape, scales.shape) or (fmt != "int8" and k % BLOCK):
        raise ValueError(f"quant_matmul: {fmt} data {data.shape} and scales {scales.shape} do not describe one "
                         f"weight [K, N] (expected {packed_shapes((k, data.shape[1]), fmt)}, K a multiple of "
                         f"{BLOCK} for the block formats).")
    if x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(f"quant_matmul: x {x.shape} must end in K = {k}, the weight's input width.")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"quant_matmul: x has dtype {x.dtype}; expected a floating dtype.")


def _precision(dtype):
    return lax.Precision.HIGHEST if dtype == jnp.float32 else None


def _reference(x, data, scales, fmt, compute, out):
    w = dequantize(data, scales, fmt).astype(compute)
    y = jnp.matmul(x.astype(compute), w, precision=_precision(compute), preferred_element_type=jnp.float32)
    return y.astype(out)


def _tile_scales(s, rows: int):
    """Scales `[rows / r, bn]` of a tile repeated to `[rows, bn]`, r rows each (r = 32, or 16 for a nibble plane)."""
    blocks, bn = s.shape
    return jnp.broadcast_to(s[:, None, :], (blocks, rows // blocks, bn)).reshape(rows, bn)


def _kernel(x_ref, w_ref, s_ref, o_ref, *, fmt: str, compute, block_k: int, steps: int):
    """One (row tile, column tile, K split): `steps` tiles of `block_k` inputs, float32 accumulation.

    x_ref: [bm, Ks] ([2, bm, Ks/2], the block halves, for q4_0); w_ref: [Ks, bn] ([Ks/2, bn] for q4_0);
    s_ref: [Ks/32, bn] ([1, bn] for int8); o_ref: [bm, bn] float32.
    """
    f32 = jnp.float32
    dot = functools.partial(lax.dot_general, dimension_numbers=(((1,), (0,)), ((), ())),
                            precision=_precision(compute), preferred_element_type=f32)
    blocks = block_k // BLOCK

    def step(t, acc):
        if fmt == "int8":
            w = w_ref[pl.ds(t * block_k, block_k), :].astype(f32) * s_ref[...].astype(f32)
            return acc + dot(x_ref[:, pl.ds(t * block_k, block_k)].astype(compute), w.astype(compute))
        s = s_ref[pl.ds(t * blocks, blocks), :].astype(f32)
        if fmt == "q8_0":
            w = w_ref[pl.ds(t * block_k, block_k), :].astype(f32) * _tile_scales(s, block_k)
            return acc + dot(x_ref[:, pl.ds(t * block_k, block_k)].astype(compute), w.astype(compute))
        half = block_k // 2
        packed = w_ref[pl.ds(t * half, half), :]
        s = _tile_scales(s, half)
        for plane, nibbles in enumerate((packed & 0xF, packed >> 4)):
            w = (nibbles.astype(f32) - 8.0) * s
            acc = acc + dot(x_ref[plane, :, pl.ds(t * half, half)].astype(compute), w.astype(compute))
        return acc

    o_ref[...] = lax.fori_loop(0, steps, step, jnp.zeros(o_ref.shape, f32))


def _largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of n that is <= at_most (at least 1)."""
    return max(d for d in range(1, max(1, min(n, at_most)) + 1) if n % d == 0)


def fit_stages(bm: int, bn: int, bk: int, x_itemsize: int, fmt: str, num_stages: int) -> int:
    """Pipeline stages cut until a program's shared memory fits `SMEM_BYTES`: per stage an x tile, a packed
    weight tile and its scales, plus the float32 `[bm, bn]` accumulator (64 q8_0 rows at 3 stages asked an H200
    for 233,472 bytes)."""
    packed = bk // 2 if fmt == "q4_0" else bk
    scales = 4 if fmt == "int8" else (bk // BLOCK) * 2
    per_stage = bm * bk * x_itemsize + packed * bn + scales * bn
    while num_stages > 1 and num_stages * per_stage + bm * bn * 4 > SMEM_BYTES:
        num_stages -= 1
    return num_stages


def _pallas_matmul(x, data, scales, *, fmt: str, compute, interpret: bool, block_n: int = BLOCK_N,
                   block_k: int = BLOCK_K, k_splits: int | None = None, num_warps: int = NUM_WARPS,
                   num_stages: int = NUM_STAGES):
    """Pad rows to a Triton tile, split K until the grid is full, run the kernel, sum the splits.

    Tiles: rows `bm` = the next power of two >= M (16 at least, `MAX_ROWS` at most); columns the largest
    power of two <= block_n dividing N; K the largest power of two <= block_k dividing K (a multiple of 32).
    The split count depends on K and N only, so a row's result does not depend on how many rows came with it."""
    m, k = x.shape
    n = data.shape[1]
    bm = min(MAX_ROWS, max(16, pl.next_power_of_2(m)))
    bn = min(n & -n, block_n)
    bk = min(k & -k, block_k)
    if bk % BLOCK or bn < 16:
        raise ValueError(f"quant_matmul: tiles K {bk} (from K = {k}) and N {bn} (from N = {n}) do not fit the "
                         f"kernel: K needs whole blocks of {BLOCK} and N a power-of-two factor of 16.")
    num_stages = fit_stages(bm, bn, bk, x.dtype.itemsize, fmt, num_stages)
    tiles = k // bk
    m_tiles, n_tiles = -(-m // bm), n // bn
    if k_splits is None:
        k_splits = _largest_divisor(tiles, -(-TARGET_PROGRAMS // n_tiles))
    if tiles % k_splits:
        raise ValueError(f"quant_matmul: k_splits={k_splits} does not divide the {tiles} K tiles of {bk}.")
    ks = k // k_splits
    xp = jnp.pad(x, ((0, m_tiles * bm - m), (0, 0)))
    if fmt == "q4_0":
        xp = xp.reshape(-1, k // BLOCK, 2, BLOCK // 2).transpose(2, 0, 1, 3).reshape(2, -1, k // 2)
        x_spec = pl.BlockSpec((2, bm, ks // 2), lambda i, j, p: (0, i, p))
        w_spec = pl.BlockSpec((ks // 2, bn), lambda i, j, p: (p, j))
    else:
        x_spec = pl.BlockSpec((bm, ks), lambda i, j, p: (i, p))
        w_spec = pl.BlockSpec((ks, bn), lambda i, j, p: (p, j))
    s_spec = (pl.BlockSpec((1, bn), lambda i, j, p: (0, j)) if fmt == "int8"
              else pl.BlockSpec((ks // BLOCK, bn), lambda i, j, p: (p, j)))
    kernel = functools.partial(_kernel, fmt=fmt, compute=compute, block_k=bk, steps=ks // bk)
    partial_sums = pl.pallas_call(
        kernel,
        grid=(m_tiles, n_tiles, k_splits),
        in_specs=[x_spec, w_spec, s_spec],
        out_specs=pl.BlockSpec((None, bm, bn), lambda i, j, p: (p, i, j)),
        out_shape=jax.ShapeDtypeStruct((k_splits, m_tiles * bm, n), jnp.float32),
        compiler_params=_triton_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name=f"quant_matmul_{fmt}",
    )(xp, data, scales)
    return partial_sums.sum(axis=0)[:m]
