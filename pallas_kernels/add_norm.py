"""The residual add fused with the RMSNorm that follows it (docs/architecture.md, "Pallas kernels"):

    s = x + delta                    (in x's dtype)
    y = weight * (float32(s) * rsqrt(mean(float32(s) ** 2) + eps)).astype(s.dtype)

`impl="xla"` is the jnp reference: the add, then the models' `rms_norm` (defined here, the one RMSNorm of the
package). XLA runs them as three kernels a decode step (the add,
whose sum two consumers read, the sum of squares, and the scaling), each a launch for 8 KB of a 4096-wide row;
`impl="pallas"` (Triton) reads x and delta once and writes s and y, one program per row. A program does the same
arithmetic for a row whatever the number of rows, so a row's norm in a 16-row verify equals the same row's in a
one-row step. Rows wider than `MAX_WIDTH` or of a width that is not a power of two (Triton's tiles) take the
reference.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.windowed_attention import _triton_compiler_params, where_lowered

IMPLS = ("xla", "pallas")
MAX_WIDTH = 16384
NUM_WARPS = 4


def rms_norm(x, weight, eps: float):
    """RMSNorm computed in float32 and cast back, as Hugging Face Qwen3/Llama do: every model's (`targets.layers`
    re-exports it), and the kernel's arithmetic on a row."""
    xf = x.astype(jnp.float32)
    return weight * (xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def reference(x, delta, weight, eps: float):
    """`(x + delta, rms_norm(x + delta))` in jnp."""
    s = x + delta
    return s, rms_norm(s, weight, eps)


def fits(width: int) -> bool:
    """Whether the kernel takes rows of `width` (a power of two up to `MAX_WIDTH`)."""
    return 0 < width <= MAX_WIDTH and width & (width - 1) == 0


def add_rms_norm(x, delta, weight, eps: float, *, impl: str = "xla", interpret: bool | None = None):
    """`(s, y)` of the module docstring for `x`, `delta` `[..., H]` (one dtype) and `weight` `[H]`. `interpret` as
    for the other kernels: None runs the kernel compiled on CUDA and ROCm and interpreted elsewhere."""
    if impl not in IMPLS:
        raise ValueError(f"add_rms_norm: impl={impl!r} is not supported; choose one of {IMPLS}.")
    if x.shape != delta.shape or x.dtype != delta.dtype:
        raise ValueError(f"add_rms_norm: x {x.dtype}{list(x.shape)} and delta {delta.dtype}{list(delta.shape)} "
                         "must have one shape and dtype.")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"add_rms_norm: weight {list(weight.shape)} must be [{x.shape[-1]}], the rows' width.")
    width = x.shape[-1]
    if impl == "xla" or not fits(width):
        return reference(x, delta, weight, eps)
    rows = math.prod(x.shape[:-1])
    run = where_lowered(functools.partial(_pallas_add_rms_norm, eps=float(eps)), interpret)
    s, y = run(x.reshape(rows, width), delta.reshape(rows, width), weight.reshape(1, width))
    return s.reshape(x.shape), y.reshape(x.shape)


def _kernel(x_ref, d_ref, w_ref, s_ref, y_ref, *, eps: float):
    """The reference on one row's tiles."""
    s, y = reference(x_ref[...], d_ref[...], w_ref[...], eps)
    s_ref[...] = s
    y_ref[...] = y.astype(y_ref.dtype)


def _pallas_add_rms_norm(x, delta, weight, *, eps: float, interpret: bool):
    rows, width = x.shape
    row = pl.BlockSpec((1, width), lambda i: (i, 0))
    out_dtype = jnp.result_type(weight.dtype, x.dtype)
    return pl.pallas_call(
        functools.partial(_kernel, eps=eps),
        grid=(rows,),
        in_specs=[row, row, pl.BlockSpec((1, width), lambda i: (0, 0))],
        out_specs=[row, row],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(x.shape, out_dtype)],
        compiler_params=_triton_compiler_params(NUM_WARPS, 1),
        interpret=interpret,
        name="add_rms_norm",
    )(x, delta, weight)
