"""Pallas GPU kernels, each with a pure-jnp reference beside it (selected by `impl=`)."""
from pallas_kernels.windowed_attention import block_attention

__all__ = ["block_attention"]
