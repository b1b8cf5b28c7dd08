"""What the Mosaic GPU kernels share: the interpreter that runs them off a GPU.

Pallas's Mosaic GPU lowering (`jax.experimental.pallas.mosaic_gpu`) is the GPU backend JAX keeps; its Triton
lowering is deprecated since JAX 0.11. A Mosaic GPU kernel copies its operands between global and shared memory
itself, so it runs off a GPU only in JAX's GPU interpreter, which simulates those copies, their barriers and the
warpgroup's threads. JAX does not export the interpreter's parameters yet; its own Mosaic GPU tests import them
from where they are defined, as here.
"""
from __future__ import annotations


def interpret_params(interpret: bool):
    """The `interpret=` of a Mosaic GPU kernel: the GPU interpreter's parameters, or None (compiled)."""
    if not interpret:
        return None
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()
