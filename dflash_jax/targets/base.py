"""The Target interface: what the decoding loops may ask of a target model (docs/architecture.md).

A target family is a frozen config (static) plus a parameter pytree, applied purely through
its Flax module. Its decoding state is a pytree with at least `seq_len: int32[B]` (positions
committed per row); everything else in it belongs to the family (K/V for attention layers,
recurrent state for linear-attention layers). Every method is pure and shape-static.

`extend` runs a block and returns `pending`: whatever the family needs to keep any prefix of
that block (the position itself for a KV cache, the state after every position for recurrent
layers). `commit(state, pending, kept)` then keeps the first `kept[b]` positions and drops
the rest; it is the only rollback there is. The loops call `extend` only at
`start == state.seq_len`.
"""
from __future__ import annotations

import abc
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


class ClassKeyedNode(struct.PyTreeNode):
    """A pytree node whose tree structure names its class: `node_type`, a static field set to the instance's class.
    JAX compares the tree structures of two dataclass pytree classes with the same fields by their static fields
    alone (not their classes, though their hashes differ), so a subclass with an equal config could be handed the
    compiled programs of its parent, as CI once saw a test's wrong rollback run with its sound parent's loop. The
    base of Target and Drafter."""

    node_type: Any = struct.field(pytree_node=False, default=None, kw_only=True, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "node_type", type(self))


class Target(ClassKeyedNode, abc.ABC):
    """A target model: `config` (static, hashable) and `params` (a plain pytree of arrays)."""

    config: Any = struct.field(pytree_node=False)
    params: dict

    @abc.abstractmethod
    def init_state(self, batch: int, capacity: int) -> Any:
        """An empty decoding state for `batch` rows of up to `capacity` positions (`seq_len` 0), every
        leaf a distinct buffer: the loops donate it."""

    @abc.abstractmethod
    def embed(self, tokens: jax.Array) -> jax.Array:
        """`int32[B, T] -> [B, T, H]`: the token embedding as a drafter must see it."""

    @abc.abstractmethod
    def extend(self, state, tokens: jax.Array, start: jax.Array, tap_ids: tuple = (), impl: str = "xla",
               valid: Optional[jax.Array] = None):
        """Run `tokens [B, W]` at positions `start[b] + i` over `state`.

        Returns `(hidden [B, W, H] final-normed, taps [B, W, n_taps*H] or None, state, pending)`;
        `taps` are the outputs of the decoder layers `tap_ids`, concatenated on features.
        `state.seq_len` is not moved: `commit` decides how much of the block stays. `valid [B]`, when
        given, promises that `commit` will keep exactly `valid[b]` positions (prefill knows it), so a
        recurrent family may keep only that state instead of one per position.
        """

    @abc.abstractmethod
    def logits(self, hidden: jax.Array, head=None) -> jax.Array:
        """The LM head on final-normed hidden states: `[..., H] -> float32[..., V]`. `head`, an `[H, V]` weight
        (float or `quant.QWeight`), stands in for the model's own (a drafter's quantised copy of it); what the
        family does after the product (a softcap) still applies."""

    def head_weight(self):
        """The LM head as the `[H, V]` weight `logits` multiplies by: `lm_head`, or the embedding's transpose
        when the two are tied."""
        return self.params["embed"].T if self.config.tie_word_embeddings else self.params["lm_head"]

    @abc.abstractmethod
    def commit(self, state, pending, kept: jax.Array):
        """Keep the first `kept[b]` positions of the last `extend` (0 keeps none): the only rollback."""

    def pending_bytes(self, batch: int, width: int) -> int:
        """Bytes `pending` holds between an `extend` of `width` positions and its `commit`, beyond the state
        (what the memory check adds to the caches): next to nothing unless the family keeps per-position state."""
        return 0

    @abc.abstractmethod
    def forward(self, tokens: jax.Array, tap_ids: tuple = ()) -> tuple:
        """Uncached causal forward of `[B, T]`: `(hidden [B, T, H] final-normed, taps or None)`."""

    def full_logits(self, token_ids) -> jax.Array:
        """Full causal forward without a state: `int[B, T] -> float32[B, T, V]` (for scoring text)."""
        tokens = check_token_ids(token_ids, self.config.vocab_size)
        return _full_logits(self, tokens)


def check_token_ids(token_ids, vocab_size: int) -> jax.Array:
    """Validate a 2-D array of token ids on the host; ValueError naming the problem."""
    arr = np.asarray(token_ids)
    if arr.ndim != 2:
        raise ValueError(f"token_ids must be 2-D [batch, time]; got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"token_ids is empty (shape {arr.shape}); give at least one token per row")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"token_ids must be integers; got dtype {arr.dtype}")
    if arr.min() < 0 or arr.max() >= vocab_size:
        raise ValueError(f"token id out of range [0, {vocab_size}): found min {arr.min()}, max {arr.max()}")
    return jnp.asarray(arr, jnp.int32)


@jax.jit
def _full_logits(target: Target, tokens: jax.Array) -> jax.Array:
    return target.logits(target.forward(tokens)[0])
