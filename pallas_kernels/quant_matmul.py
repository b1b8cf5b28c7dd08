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

Semantics: W is dequantised in float32 (value x scale) and multiplied with float32 accumulation; float32
products run at HIGHEST, as every float32 product of the project does. The result is cast to `out_dtype`. An int8
weight's one scale per output channel multiplies the sums (`(x @ q) * s`, exact in the values: every int8 is a
bf16), so its product reads the int8 values and nothing else. The block formats' scales vary along K and are
applied to the weight: the reference and the product kernel round the scaled weight to the compute dtype (the
model's, bf16 or float32) and multiply on the tensor cores; the GEMV keeps it in float32.

- `impl="xla"`, the reference: dequantise the whole weight (int8: convert it), then one `jnp.matmul`. XLA fuses
  int8's convert into its product (on the H200 it reads the int8 values: `bench/results/quant_probe.json`), but
  not the block formats' scaling, whose weight it writes out dequantised first.
- `impl="pallas"` (Triton lowering), for 1 to `MAX_ROWS` rows, reads the packed tiles and expands them in
  registers. Grid (row tile, column tile, K split): each program walks its share of K in tiles of `block_k` (a
  multiple of 32, so a tile holds whole blocks), and the K splits (enough programs to fill the GPU when N is
  small) are summed afterwards in a fixed order. One row takes a GEMV: multiply-adds into a `[block_k, bn]`
  float32 accumulator and one sum over K at the end, as a tensor-core tile of 16 rows would waste 15 of them.
  More rows take the product kernel: a `[bm, bn]` accumulator on the tensor cores. For q4_0, x's columns are
  first split into the low and high halves of each block (`[2, M, K/2]`), so the two nibble planes of a packed
  tile each meet their own half of x and nothing is interleaved in registers. More rows than `MAX_ROWS`
  (prefill) are a compute-bound GEMM and take the reference, as do weights whose N has no power-of-two factor
  of 16. A GEMV's K walk is straight-line code (`Tiles.unroll`): a layer's weight is read in a few microseconds,
  a handful of memory latencies, so every tile's load must be in flight before the arithmetic waits on the first.
- `impl="auto"`, the GPU default: the form measured fastest (`choose`). One int8 row through the LM head
  (`REDUCE_MIN_ELEMENTS`) takes `sum(x[:, None] * q, 0) * s`, which XLA fuses into one column reduction over the
  int8 values; everything else takes the kernel as above.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.windowed_attention import SMEM_BYTES, _triton_compiler_params, where_lowered

FORMATS = ("int8", "q8_0", "q4_0")
BLOCK = 32
"""Values per block of the block formats (q8_0, q4_0): one float16 scale each."""
IMPLS = ("xla", "pallas", "auto")
PACKED_DTYPES = {"int8": ("int8", "float32"), "q8_0": ("int8", "float16"), "q4_0": ("uint8", "float16")}
"""(values, scales) dtypes of each format."""

# The impl a quantised product uses on a GPU. bench/quant_probe.py on the H200 (bench/results/quant_probe.json,
# common.per_call_us) timed every form at 1 and 16 rows on each weight shape of Qwen3-8B: for q8_0 the kernel took a
# quarter to a half of the reference's time everywhere, and one int8 row through the LM head took the column
# reduction fastest (193.7 us against the GEMV's 348.2). One int8 row through a layer's weight takes the unrolled
# GEMV (`GEMV_TILES`): bench/gemv_sweep.py, CUPTI-timed (bench/results/gemv_sweep.json), put it ahead of the row
# padded into the 16-row product kernel, the form used before.
GPU_DEFAULT_IMPL = "auto"
REDUCE_MIN_ELEMENTS = 1 << 28
"""The weight size (K x N) from which one int8 row takes the column reduction: the LM head (622M elements, 177.7 us
in the step against the product kernel's 215 at 16 rows, whose column tile its vocabulary's factor 32 caps), not a
layer's weights (w_gate_up, 101M, is the largest)."""

MAX_ROWS = 64
"""The most rows the kernels take; more run the reference. Row tiles of 64 past it lost to the reference on an H100
(bench/results/quant_drafter_b16_rows_h100.json): at 240 rows, each tile expanding the same packed tiles again, q8_0's
w_gate_up took 387 us against the reference's 252 (bf16: 106), its LM head 1,868 against 1,351 (bf16: 476)."""


class Tiles(NamedTuple):
    """A kernel's tile settings: the largest column and K tiles (each shrinks to the largest power of two that
    divides its dimension), the programs K is split towards, and Triton's warps and pipeline stages. `unroll`
    walks a program's K tiles in straight-line code instead of a loop, so every tile's load is issued before the
    arithmetic that waits on it; `evict` marks the packed weights, read once, first out of the L2 cache."""

    block_n: int
    block_k: int
    programs: int
    num_warps: int
    num_stages: int
    unroll: bool = False
    evict: bool = False


# GEMV_TILES: the least time per layer of bench/gemv_sweep.py (bench/results/gemv_sweep.json, one int8 row, CUPTI
# clock, H100 and JAX 0.11.2): on wqkv and w_gate_up 14.8 and 39.0 us, against 17.4 and 45.9 for the row padded
# into the product kernel, 16.4 and 54.7 for the looped GEMV of 128 x 64 tiles that was the default, and 19.3 and
# 66.2 for the bf16 product; the same GEMV over a transposed `[N, K]` weight took 18.7 and 67.3 (the unrolled walk
# pays, the layout does not matter). On a later lease (gemv_sweep_quick.json) wqkv / w_gate_up / w_down / wo took
# 15.0 / 38.7 / 23.7 / 11.0 us against the padded row's 17.5 / 46.1 / 25.8 / 12.6: 88 us a layer against 102.
# Without a K split (each program walking all of K for 32 to 128 columns, so no partial sums are written and summed
# after the kernel) the int8 step took 2.8x to 8x longer on an H100 (bench/results/int8_gemv_no_split_h100.json).
# DOT_TILES: the best of bench/quant.py --sweep on the H200 (bench/results/quant_sweep.json; geometric mean over wqkv
# and w_down, int8 and q8_0), 23.5 us at 16 rows.
GEMV_TILES = Tiles(block_n=256, block_k=16, programs=1056, num_warps=4, num_stages=1, unroll=True, evict=True)
DOT_TILES = Tiles(block_n=128, block_k=128, programs=264, num_warps=4, num_stages=3)


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
    if impl == "auto":
        impl = choose(fmt, rows, k, n)
    if impl == "reduce":
        return _column_reduction(x.astype(compute), data, scales, out)
    if impl == "xla" or not kernel_takes(rows, k, n):
        return _reference(x, data, scales, fmt, compute, out)
    kernel = where_lowered(functools.partial(_pallas_matmul, fmt=fmt, compute=compute), interpret)
    y = kernel(x.reshape(rows, k), data, scales)
    return y.reshape(*x.shape[:-1], n).astype(out)


def choose(fmt: str, rows: int, k: int, n: int) -> str:
    """`impl="auto"`'s form (module docstring): "reduce" (the column reduction) or "pallas" (the kernel for the row
    count)."""
    return "reduce" if fmt == "int8" and rows == 1 and k * n >= REDUCE_MIN_ELEMENTS else "pallas"


def kernel_takes(rows: int, k: int, n: int) -> bool:
    """Whether the kernels take a product of `rows` rows by a `[K, N]` weight, reading it packed in place; the
    reference instead expands the whole weight first, more bytes than the float weight would move."""
    return rows <= MAX_ROWS and kernel_fits(k, n)


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
    x = x.astype(compute)
    if fmt == "int8":
        y = jnp.matmul(x, data.astype(compute), precision=_precision(compute), preferred_element_type=jnp.float32)
        return (y * scales[0].astype(jnp.float32)).astype(out)
    w = dequantize(data, scales, fmt).astype(compute)
    return jnp.matmul(x, w, precision=_precision(compute), preferred_element_type=jnp.float32).astype(out)


def _column_reduction(x, data, scales, out):
    """One row through an int8 weight as XLA's fused multiply and column sum, in float32 (the reference's exact
    products, summed in another order)."""
    f32 = jnp.float32
    y = jnp.sum(x.reshape(-1, 1).astype(f32) * data.astype(f32), axis=0) * scales[0].astype(f32)
    return y.reshape(*x.shape[:-1], data.shape[1]).astype(out)


def _tile_scales(s, rows: int):
    """Scales `[rows / r, bn]` of a tile repeated to `[rows, bn]`, r rows each (r = 32, or 16 for a nibble plane)."""
    blocks, bn = s.shape
    return jnp.broadcast_to(s[:, None, :], (blocks, rows // blocks, bn)).reshape(rows, bn)


def _rows(ref, start, length: int, evict: bool):
    """Rows `[start, start + length)` of a weight ref, loaded marked first out of the L2 cache when `evict`."""
    if evict:
        return plt.load(ref.at[pl.ds(start, length), :], eviction_policy="evict_first")
    return ref[pl.ds(start, length), :]


def _weight_tiles(w_ref, s_ref, t, fmt: str, block_k: int, evict: bool):
    """The float32 weight tiles of step `t`, each with the slice of x's columns it meets: `[(start, length,
    tile)]`, one for int8 and q8_0, two nibble planes for q4_0. int8 tiles stay unscaled (its one scale per
    output channel multiplies the sums)."""
    f32 = jnp.float32
    if fmt == "int8":
        return [(t * block_k, block_k, _rows(w_ref, t * block_k, block_k, evict).astype(f32))]
    blocks = block_k // BLOCK
    s = s_ref[pl.ds(t * blocks, blocks), :].astype(f32)
    if fmt == "q8_0":
        w = _rows(w_ref, t * block_k, block_k, evict).astype(f32)
        return [(t * block_k, block_k, w * _tile_scales(s, block_k))]
    half = block_k // 2
    packed = _rows(w_ref, t * half, half, evict)
    s = _tile_scales(s, half)
    return [(t * half, half, (nibbles.astype(f32) - 8.0) * s) for nibbles in (packed & 0xF, packed >> 4)]


def _x_tile(x_ref, plane: int, start, length: int, fmt: str, column: bool):
    """x's columns `[start, start + length)` (of nibble plane `plane` for q4_0): `[length, 1]` for the GEMV,
    `[bm, length]` for the product."""
    cols = pl.ds(start, length)
    if fmt == "q4_0":
        return x_ref[plane, cols, :] if column else x_ref[plane, :, cols]
    return x_ref[cols, :] if column else x_ref[:, cols]


def _walk(step, steps: int, acc, unroll: bool):
    """`step(t, acc)` for t in 0..steps-1: a loop, or straight-line code when `unroll`."""
    if not unroll:
        return lax.fori_loop(0, steps, step, acc)
    for t in range(steps):
        acc = step(t, acc)
    return acc


def _gemv_kernel(x_ref, w_ref, s_ref, o_ref, *, fmt: str, block_k: int, steps: int, unroll: bool, evict: bool):
    """One row: (column tile, K split) walks `steps` tiles of `block_k` inputs (a loop, or straight-line code
    when `unroll`), multiplying each dequantised float32 tile by x's column slice into a `[block_k, bn]` float32
    accumulator, summed over K once at the end (a cross-thread sum per tile would cost more than the tile's
    arithmetic).

    x_ref: [Ks, 1] ([2, Ks/2, 1], the block halves, for q4_0); w_ref, s_ref as for `_kernel`; o_ref: [1, bn]."""
    f32 = jnp.float32

    def step(t, acc):
        for plane, (start, length, w) in enumerate(_weight_tiles(w_ref, s_ref, t, fmt, block_k, evict)):
            acc = acc + _x_tile(x_ref, plane, start, length, fmt, column=True).astype(f32) * w
        return acc

    rows = block_k // 2 if fmt == "q4_0" else block_k
    y = jnp.sum(_walk(step, steps, jnp.zeros((rows, o_ref.shape[-1]), f32), unroll), axis=0, keepdims=True)
    o_ref[...] = y * s_ref[...].astype(f32) if fmt == "int8" else y


def _kernel(x_ref, w_ref, s_ref, o_ref, *, fmt: str, compute, block_k: int, steps: int, unroll: bool,
            evict: bool):
    """Rows 2 to `MAX_ROWS`: (row tile, column tile, K split) walks `steps` tiles of `block_k` inputs (a loop,
    or straight-line code when `unroll`), each dequantised tile rounded to the compute dtype and multiplied on the
    tensor cores, float32 accumulation.

    x_ref: [bm, Ks] ([2, bm, Ks/2] for q4_0); w_ref: [Ks, bn] ([Ks/2, bn] for q4_0); s_ref: [Ks/32, bn]
    ([1, bn] for int8); o_ref: [bm, bn] float32."""
    f32 = jnp.float32
    dot = functools.partial(lax.dot_general, dimension_numbers=(((1,), (0,)), ((), ())),
                            precision=_precision(compute), preferred_element_type=f32)

    def step(t, acc):
        for plane, (start, length, w) in enumerate(_weight_tiles(w_ref, s_ref, t, fmt, block_k, evict)):
            acc = acc + dot(_x_tile(x_ref, plane, start, length, fmt, column=False).astype(compute), w.astype(compute))
        return acc

    y = _walk(step, steps, jnp.zeros(o_ref.shape, f32), unroll)
    o_ref[...] = y * s_ref[...].astype(f32) if fmt == "int8" else y


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


def _pallas_matmul(x, data, scales, *, fmt: str, compute, interpret: bool, tiles: Tiles | None = None,
                   k_splits: int | None = None):
    """Pick the GEMV (one row) or the product kernel, split K until the grid is full, run it, sum the splits.

    Tiles (`tiles`, default `GEMV_TILES` or `DOT_TILES`): rows `bm` = the next power of two >= M (16 at least,
    `MAX_ROWS` at most; 1 for the GEMV); columns the largest power of two <= block_n dividing N; K the largest
    power of two <= block_k dividing K (for the block formats at least a block: a multiple of 32). The split count
    depends on K, N and the tiles only, so a row's result does not depend on how many rows came with it beyond which
    kernel runs."""
    m, k = x.shape
    n = data.shape[1]
    gemv = m == 1
    tiles = tiles or (GEMV_TILES if gemv else DOT_TILES)
    bm = 1 if gemv else min(MAX_ROWS, max(16, pl.next_power_of_2(m)))
    bn = min(n & -n, tiles.block_n)
    bk = min(k & -k, tiles.block_k if fmt == "int8" else max(BLOCK, tiles.block_k))
    if (fmt != "int8" and bk % BLOCK) or bn < 16:
        raise ValueError(f"quant_matmul: tiles K {bk} (from K = {k}) and N {bn} (from N = {n}) do not fit the "
                         f"kernel: {fmt} K tiles need whole blocks of {BLOCK}, and N a power-of-two factor of 16.")
    num_stages = fit_stages(bm, bn, bk, x.dtype.itemsize, fmt, tiles.num_stages)
    k_tiles = k // bk
    m_tiles, n_tiles = -(-m // bm), n // bn
    if k_splits is None:
        k_splits = _largest_divisor(k_tiles, -(-tiles.programs // n_tiles))
    if k_tiles % k_splits:
        raise ValueError(f"quant_matmul: k_splits={k_splits} does not divide the {k_tiles} K tiles of {bk}.")
    ks = k // k_splits
    xp = x if gemv else jnp.pad(x, ((0, m_tiles * bm - m), (0, 0)))
    if fmt == "q4_0":
        xp = xp.reshape(-1, k // BLOCK, 2, BLOCK // 2).transpose(2, 0, 1, 3).reshape(2, -1, k // 2)
        w_spec = pl.BlockSpec((ks // 2, bn), lambda i, j, p: (p, j))
        if gemv:
            xp = xp.transpose(0, 2, 1)
            x_spec = pl.BlockSpec((2, ks // 2, 1), lambda i, j, p: (0, p, 0))
        else:
            x_spec = pl.BlockSpec((2, bm, ks // 2), lambda i, j, p: (0, i, p))
    else:
        w_spec = pl.BlockSpec((ks, bn), lambda i, j, p: (p, j))
        if gemv:
            xp = xp.reshape(k, 1)
            x_spec = pl.BlockSpec((ks, 1), lambda i, j, p: (p, 0))
        else:
            x_spec = pl.BlockSpec((bm, ks), lambda i, j, p: (i, p))
    s_spec = (pl.BlockSpec((1, bn), lambda i, j, p: (0, j)) if fmt == "int8"
              else pl.BlockSpec((ks // BLOCK, bn), lambda i, j, p: (p, j)))
    if gemv:
        kernel = functools.partial(_gemv_kernel, fmt=fmt, block_k=bk, steps=ks // bk, unroll=tiles.unroll,
                                   evict=tiles.evict)
    else:
        kernel = functools.partial(_kernel, fmt=fmt, compute=compute, block_k=bk, steps=ks // bk, unroll=tiles.unroll,
                                   evict=tiles.evict)
    partial_sums = pl.pallas_call(
        kernel,
        grid=(m_tiles, n_tiles, k_splits),
        in_specs=[x_spec, w_spec, s_spec],
        out_specs=pl.BlockSpec((None, bm, bn), lambda i, j, p: (p, i, j)),
        out_shape=jax.ShapeDtypeStruct((k_splits, m_tiles * bm, n), jnp.float32),
        compiler_params=_triton_compiler_params(tiles.num_warps, num_stages),
        interpret=interpret,
        name=f"quant_{'gemv' if gemv else 'matmul'}_{fmt}",
    )(xp, data, scales)
    return (partial_sums[0] if k_splits == 1 else partial_sums.sum(axis=0))[:m]
