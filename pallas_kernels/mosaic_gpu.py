"""What the Mosaic GPU kernels share: the interpreter that runs them off a GPU.

Pallas's Mosaic GPU lowering (`jax.experimental.pallas.mosaic_gpu`) is the GPU backend JAX keeps; its Triton
lowering is deprecated since JAX 0.11. A Mosaic GPU kernel copies its operands between global and shared memory
itself, so it runs off a GPU only in JAX's GPU interpreter, which simulates those copies, their barriers and the
warpgroup's threads; `where_lowered` runs the reference instead where a program is lowered for anything but CUDA.
JAX does not export the interpreter's parameters yet; its own Mosaic GPU tests import them
from where they are defined, as here.
"""
from __future__ import annotations

import functools

import jax


def where_lowered(kernel, interpret: bool | None, reference):
    """`kernel(*args, interpret=...)` as one callable, as `windowed_attention.where_lowered` makes it for Triton, but
    with None chosen where the program is lowered as the kernel compiled on CUDA and `reference(*args)` elsewhere:
    Mosaic GPU compiles for CUDA only, and its interpreter's callbacks cannot sit in a `platform_dependent` branch."""
    if interpret is not None:
        return functools.partial(kernel, interpret=interpret)
    return lambda *args: jax.lax.platform_dependent(*args, cuda=functools.partial(kernel, interpret=False),
                                                    default=reference)


def interpret_params(interpret: bool):
    """The `interpret=` of a Mosaic GPU kernel: the GPU interpreter's parameters, or None (compiled)."""
    if not interpret:
        return None
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()
