"""Caches as pytrees: the KV cache of dense targets and the DFlash drafter's context cache.

`commit` of either family moves `seq_len`: entries at or beyond it are masked by attention and
overwritten later, so nothing is ever copied back (docs/architecture.md, "State of each family").
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from pallas_kernels.windowed_attention import write_rows

__all__ = ["KVCache", "init_kv", "write_rows"]  # write_rows lives beside the kernel that can do its work


@struct.dataclass
class KVCache:
    """Per attention layer `k, v: [B, capacity, n_kv, head_dim]`; `seq_len: int32[B]` tokens held."""

    k: tuple
    v: tuple
    seq_len: jax.Array

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]


def init_kv(batch: int, capacity: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype) -> KVCache:
    """An empty cache, zero-filled (JAX >= 0.11 `jnp.empty` is uninitialised)."""
    shape = (batch, capacity, num_kv_heads, head_dim)
    zeros = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
    return KVCache(k=zeros, v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                   seq_len=jnp.zeros((batch,), jnp.int32))


