"""Drafter training (docs/architecture.md "DFlash", the published objective) and small-LM pretraining.

A DFlash drafter learns to fill a block `[anchor, mask, ..., mask]` for a frozen target.
Per training sequence of `seq_len` tokens:

- anchors `a` are drawn uniformly from `[1, seq_len - block_size]` without replacement
  (anchor 0 would have no context; the upper bound keeps every block row inside the window);
- block j sits at positions `a_j .. a_j + b - 1`; its rows attend to the target's taps of
  positions `< a_j` and bidirectionally to the rows of their own block (never to other
  blocks), exactly as `draft_hidden` does at inference (`DFlashDrafter.train_hidden`);
- row k (k = 1..b-1) is read through the target's LM head and scored by cross-entropy
  against the true token `tok[a_j + k]`, weighted `exp(-(k - 1) / gamma)`: early slots
  matter most because a rejected slot voids every later one. DFlash uses gamma 7 for
  b = 16 (5 for b = 10, 4 for b = 8). The loss is the weighted mean over blocks and rows.
  With `TrainConfig.labels="target"` the label is instead the target's own argmax at that
  position (its teacher-forced choice), the token greedy verification would accept.

Windows are cut from one token stream with the eos id between documents; a window, a
block's context or a block may cross a document boundary. That is left in on purpose: it
is rare at these lengths and teaches the drafter what follows an eos.

Metrics (no extra target pass): per-slot top-1 agreement of the drafter with the target's
own argmax at the same position, and the acceptance length greedy speculative decoding
would see on this text, `1 + leading agreeing slots`, averaged over blocks. It is exact
when the text is the target's own greedy continuation and an estimate otherwise.
"""
from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.io import checkpoints


def loss_weights(block_size: int, gamma: float) -> np.ndarray:
    """Weight of block rows 1..b-1: `exp(-(k - 1) / gamma)`, float32 `[b - 1]`."""
    k = np.arange(1, block_size, dtype=np.float64)
    return np.exp(-(k - 1) / gamma).astype(np.float32)


def weighted_block_ce(logits: jax.Array, labels: jax.Array, weights) -> jax.Array:
    """Weighted mean cross-entropy: logits `[..., n, V]`, labels `[..., n]`, weights `[n]`.

    `sum(w_k * ce) / (blocks * sum(w))`: the weighting moves emphasis between slots without
    changing the loss scale.
    """
    chex.assert_equal_shape_prefix((logits, labels), labels.ndim)
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    ce = jax.nn.logsumexp(logits, axis=-1) - picked
    w = jnp.asarray(weights, jnp.float32)
    blocks = math.prod(labels.shape[:-1])
    return jnp.sum(ce * w) / (blocks * jnp.sum(w))


def acceptance_length(draft: jax.Array, target_choice: jax.Array) -> jax.Array:
    """Tokens one greedy round commits: `1 + leading slots where draft == target`, per block."""
    agree = (draft == target_choice).astype(jnp.int32)
    return 1 + jnp.sum(jnp.cumprod(agree, axis=-1), axis=-1)


def cast(tree, dtype):
    """Floating leaves of `tree` in `dtype` (the compute copy of float32 master weights)."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _gather_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
    """`x [B, T, ...]` at per-row positions `idx [B, ...]` -> `[B, ..., rest of x]`."""
    flat = idx.reshape(idx.shape[0], -1)
    trailing = x.shape[2:]
    out = jnp.take_along_axis(x, flat.reshape(flat.shape + (1,) * len(trailing)), axis=1)
    return out.reshape(idx.shape + trailing)


def drafter_loss(params: dict, target_params: dict, tokens: jax.Array, anchors: jax.Array, *,
                 target_cfg: TargetConfig, cfg: DrafterConfig, weights, dtype, labels: str = "data") -> tuple:
    """(loss, metrics) of the DFlash objective on windows `tokens [B, T]` with `anchors [B, A]`.

    `params` are the drafter's float32 master weights (cast to `dtype` here, so gradients
    come back in float32); `target_params` are already in `dtype` and stay frozen. `labels`
    is `TrainConfig.labels`. Rows 1..b-1 (the mask-fill harvest) are scored.
    """
    bsz, t = tokens.shape
    n_blocks, b = anchors.shape[1], cfg.block_size
    chex.assert_shape(anchors, (bsz, n_blocks))
    target = checkpoints.target_family(target_cfg).cls(target_cfg, target_params)
    drafter = checkpoints.drafter_family(cfg).cls(cfg, cast(params, dtype))
    h_all, taps = target.forward(tokens, drafter.tap_ids)
    taps, h_all = jax.lax.stop_gradient((taps, h_all))
    positions = anchors[:, :, None] + jnp.arange(b, dtype=jnp.int32)  # [B, A, b]
    block_tokens = _gather_rows(tokens, positions)
    # The target's own choice for row k is its argmax at position a + k - 1.
    target_choice = jnp.argmax(target.logits(_gather_rows(h_all, positions[..., :-1])), axis=-1)
    x = drafter.block_input(target, block_tokens[..., 0])
    h = drafter.train_hidden(taps, x, anchors)
    logits = drafter.harvest_logits(target, h)
    loss = weighted_block_ce(logits, block_tokens[..., 1:] if labels == "data" else target_choice, weights)
    draft = jnp.argmax(logits, axis=-1)
    metrics = {
        "acc_len": jnp.mean(acceptance_length(draft, target_choice).astype(jnp.float32)),
        "slot_acc": jnp.mean((draft == target_choice).astype(jnp.float32), axis=(0, 1)),
    }
    return loss, metrics


def lm_loss(params: dict, frozen, tokens: jax.Array, *, cfg: TargetConfig, dtype) -> tuple:
    """(loss, metrics) of next-token prediction on `tokens [B, T + 1]` (`frozen` is unused: None)."""
    del frozen
    target = checkpoints.target_family(cfg).cls(cfg, cast(params, dtype))
    logits = target.logits(target.forward(tokens[:, :-1])[0])
    labels = tokens[:, 1:]
    ce = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return jnp.mean(ce), {"acc": jnp.mean((jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32))}
