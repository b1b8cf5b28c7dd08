"""Caches as pytrees: the KV cache of dense targets and the DFlash drafter's context cache.

`commit` of either family moves `seq_len`: entries at or beyond it are masked by attention and
overwritten later, so nothing is ever copied back (docs/architecture.md, "State of each family").
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from flax import struct


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


def write_rows(buf: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """Write `new [B, W, ...]` into `buf [B, S, ...]` at rows `start[b] + i`; rows past S are dropped.

    One in-place scatter kernel per write on the GPU, where a vmapped `dynamic_update_slice`
    took two (a read of the old rows, then a masked update) and shifted a block that overhangs
    the end instead of dropping its tail. (With one row per batch row, as in plain decoding,
    XLA still rewrites the scatter into that pair.)
    """
    chex.assert_equal(buf.shape[0], new.shape[0])
    b, w = new.shape[:2]
    rows = start.astype(jnp.int32)[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :]
    batch = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, w))
    return buf.at[batch, rows].set(new.astype(buf.dtype), mode="drop", unique_indices=True)
