"""Grouped dynamic causal convolution of DFlash2 (docs/architecture.md, "Pallas kernels").

For half `which` (0 = prepare, on a sublayer's input; 1 = finish, on its output), with k taps and
G groups of gs = H // G channels:

    out[n, t, c] = sum_{o < k, o <= t} (base[which, o, c] + dyn[n, t, which, o, c // gs]) * x[n, t - o, c]

a depthwise causal conv along the T rows of one block (zero before row 0: it never reaches into
the context), whose per-row kernel is a static base plus a dynamic per-group part, the raw
kernel-projection output viewed `[N, T, 2, k, G]`. Float32 accumulation, output in x.dtype.
`impl="xla"` is the jnp reference (XLA fuses it); `impl="pallas"` reads the projection output,
the base kernel and the shifted input in one pass and writes the output.

Kernel layout: the grid is (block, row chunk, channel tile). A program walks its rows in order
and keeps the previous k - 1 input rows of its tile in registers, so it reads each input row
once (and the k - 1 rows before its chunk). The dynamic kernel is gathered per channel
(`c // gs`), so any group size works. A channel tile is the largest power of two that divides H,
up to 512 (H 6656 = 13 x 512). Rows are cut into chunks until the grid has about 1024 programs.

Lowering: Triton. Mosaic GPU, the project's first choice, cannot express the per-channel group
weight on JAX 0.10, as lowering this kernel and a gather-free variant for CUDA shows:
- It has no register gather for `dyn[..., c // gs]`.
- The gather-free variant (tiles [groups, gs], the group weight broadcast along the trailing
  axis) needs a layout that broadcasts there. The strided layout broadcasts only along leading
  axes and needs 128 elements per array ("memref<32xbf16> must have a number of elements that
  is a multiple of 128"). The WGMMA layouts need rows in multiples of 64, and G = 416 is not
  one. Warpgroup semantics fail with "Layout inference failed to find a solution".
- Its BlockSpecs take no `pl.Element` offsets, so the row shift cannot come from the copy engine.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.windowed_attention import _triton_compiler_params, where_lowered

IMPLS = ("xla", "pallas")

# The impl a model uses on a GPU when none is asked for. On the H200 (bench/results/dynamic_conv.json and
# dynamic_conv_sweep.json, JAX 0.11.2) both impls take 13-25 us a call at the fixture geometry, bound by the
# launch rather than the bytes (0.1-7 us at the copy bandwidth), and neither wins consistently: the cells
# where Pallas led in one run it trailed in the other. The reference stays the default, since XLA can fuse
# it with its neighbours in a round and a custom call cannot be fused.
GPU_DEFAULT_IMPL = "xla"

# Tile settings: first guesses, not yet swept on a GPU (`bench/dynamic_conv.py --sweep` times them).
BLOCK_H = 512  # largest channel tile; the tile is the largest power of two <= this that divides H
TARGET_PROGRAMS = 1024  # rows are split into chunks until the grid has about this many programs (~8 per SM)
NUM_WARPS = 4
NUM_STAGES = 2


def default_impl(backend: str | None = None) -> str:
    """`GPU_DEFAULT_IMPL` on a GPU, else the jnp reference (off a GPU Pallas only interprets)."""
    return GPU_DEFAULT_IMPL if (backend or jax.default_backend()) == "gpu" else "xla"


def dynamic_conv(x, dyn, base, which: int, *, impl: str = "xla", interpret: bool | None = None):
    """One half of the grouped dynamic causal conv. Returns `[N, T, H]` in x.dtype.

    x: [N, T, H] (N independent blocks of T rows); dyn: [N, T, 2*k*G], the kernel projection's
    output (index `which*k*G + o*G + g`); base: [2, k, H]; which: 0 (prepare) or 1 (finish).
    k comes from base, G from dyn, gs = H // G. `interpret` runs the Pallas kernel in interpret
    mode; None (the default) does so on every platform but CUDA and ROCm, so `impl="pallas"`
    also runs (slowly) on a CPU.
    """
    _check_inputs(x, dyn, base, which, impl)
    if impl == "xla":
        return _xla_conv(x, dyn, base, which)
    return where_lowered(functools.partial(_pallas_conv, which=which), interpret)(x, dyn, base)


def _check_inputs(x, dyn, base, which, impl) -> None:
    """Refuse a bad `impl`, half or shape here, with a sentence, instead of deep inside XLA."""
    if impl not in IMPLS:
        raise ValueError(f"dynamic_conv: impl={impl!r} is not supported; choose one of {IMPLS}.")
    if isinstance(which, bool) or which not in (0, 1):
        raise ValueError(f"dynamic_conv: which={which!r} must be 0 (prepare) or 1 (finish).")
    expected_rank = {"x": "[N, T, H]", "dyn": "[N, T, 2*k*G]", "base": "[2, k, H]"}
    for name, a in (("x", x), ("dyn", dyn), ("base", base)):
        if a.ndim != 3:
            raise ValueError(f"dynamic_conv: {name} has shape {a.shape}; expected 3 dims {expected_rank[name]}.")
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise ValueError(f"dynamic_conv: {name} has dtype {a.dtype}; expected a floating dtype.")
    n, t, h = x.shape
    if min(n, t, h) == 0:
        raise ValueError(f"dynamic_conv: x has shape {x.shape}; every axis must be non-empty.")
    if base.shape[0] != 2 or base.shape[1] == 0 or base.shape[2] != h:
        raise ValueError(f"dynamic_conv: base has shape {base.shape}; expected [2, k, {h}] with k >= 1 "
                         f"for x {x.shape}.")
    k = base.shape[1]
    if dyn.shape[:2] != (n, t):
        raise ValueError(f"dynamic_conv: dyn has shape {dyn.shape}; its first two axes must be x's {(n, t)}.")
    if dyn.shape[2] == 0 or dyn.shape[2] % (2 * k):
        raise ValueError(f"dynamic_conv: dyn has {dyn.shape[2]} features; expected 2*k*G = a positive multiple "
                         f"of {2 * k} for k = {k} taps (base {base.shape}).")
    g = dyn.shape[2] // (2 * k)
    if h % g:
        raise ValueError(f"dynamic_conv: hidden size {h} is not a multiple of G = {g} groups "
                         f"(dyn {dyn.shape} = 2*k*G with k = {k}).")


def _xla_conv(x, dyn, base, which: int):
    """Reference: each tap is x shifted down o rows (zeros in), times base + the group's dyn weight."""
    n, t, h = x.shape
    k = base.shape[1]
    g = dyn.shape[2] // (2 * k)
    f32 = jnp.float32
    d = dyn.reshape(n, t, 2, k, g)[:, :, which].astype(f32)  # [N, T, k, G]
    b = base[which].astype(f32).reshape(k, g, h // g)
    xs = x.astype(f32).reshape(n, t, g, h // g)
    out = jnp.zeros(xs.shape, f32)
    for o in range(min(k, t)):
        shifted = jnp.pad(xs, ((0, 0), (o, 0), (0, 0), (0, 0)))[:, :t]
        out = out + (b[o] + d[:, :, o, :, None]) * shifted
    return out.reshape(n, t, h).astype(x.dtype)


def _kernel(x_ref, d_ref, b_ref, o_ref, *, taps: int, rows: int, group_size: int):
    """Rows [c * rows, (c + 1) * rows) of one block and one channel tile (c = program_id(1)).

    x_ref, o_ref: [T, bh]; d_ref: [T, k, G] (this half); b_ref: [k, bh] (this half).
    """
    width, bh = x_ref.shape
    f32 = jnp.float32
    first = pl.program_id(1) * rows
    channel = pl.program_id(2) * bh + lax.broadcasted_iota(jnp.int32, (bh,), 0)
    group = lax.div(channel, jnp.int32(group_size))
    base = [b_ref[o].astype(f32) for o in range(taps)]

    def row_before(t):
        """Input row t (< first) of the tile, zero before row 0."""
        return jnp.where(t >= 0, x_ref[jnp.maximum(t, 0)].astype(f32), 0.0)

    def step(t, previous):
        """Output row t from input rows t, t-1, ..., t-k+1; hands rows t, ..., t-k+2 on."""
        window = (x_ref[t].astype(f32),) + previous
        acc = (base[0] + d_ref[t, 0, group].astype(f32)) * window[0]
        for o in range(1, taps):
            acc = acc + (base[o] + d_ref[t, o, group].astype(f32)) * window[o]
        o_ref[t] = acc.astype(o_ref.dtype)
        return window[:-1]

    lax.fori_loop(first, jnp.minimum(first + rows, width), step,
                  tuple(row_before(first - o) for o in range(1, taps)))


def _channel_tile(h: int, cap: int = BLOCK_H) -> int:
    """Largest power of two <= cap that divides h (Triton tiles are powers of two)."""
    return min(h & -h, cap)


def _pallas_conv(x, dyn, base, *, which: int, interpret: bool, block_h: int | None = None, rows: int | None = None,
                 num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES):
    """Grid (block, row chunk, channel tile); tile sizes default from the shape (see the module docstring)."""
    n, t, h = x.shape
    k = base.shape[1]
    g = dyn.shape[2] // (2 * k)
    bh = _channel_tile(h) if block_h is None else block_h
    if h % bh or bh & (bh - 1):
        raise ValueError(f"dynamic_conv: block_h={bh} must be a power of two that divides H = {h}.")
    if rows is None:
        chunks = min(t, -(-TARGET_PROGRAMS // (n * (h // bh))))
        rows = -(-t // chunks)
    kernel = functools.partial(_kernel, taps=k, rows=rows, group_size=h // g)
    return pl.pallas_call(
        kernel,
        grid=(n, -(-t // rows), h // bh),
        in_specs=[
            pl.BlockSpec((None, t, bh), lambda i, c, j: (i, 0, j)),
            pl.BlockSpec((None, t, None, k, g), lambda i, c, j: (i, 0, which, 0, 0)),
            pl.BlockSpec((None, k, bh), lambda i, c, j: (which, 0, j)),
        ],
        out_specs=pl.BlockSpec((None, t, bh), lambda i, c, j: (i, 0, j)),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        compiler_params=_triton_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="dynamic_conv",
    )(x, dyn.reshape(n, t, 2, k, g), base)
