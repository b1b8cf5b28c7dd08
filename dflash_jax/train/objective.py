"""Drafter training (docs/architecture.md "DFlash", the published objective) and small-LM pretraining.

A DFlash drafter learns to fill a block `[anchor, mask, ..., mask]` for a frozen target.
Per training sequence of `seq_len` tokens:

- anchors `a` are drawn uniformly from `[1, seq_len - 1 - n_drafts]` without replacement
  (anchor 0 would have no context; the upper bound keeps every label inside the window);
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
                 target_cfg: TargetConfig, cfg: DrafterConfig, weights, dtype, labels: str = "data",
                 confidence_weight: float = 1.0) -> tuple:
    """(loss, metrics) of the drafter's objective on windows `tokens [B, T]` with `anchors [B, A]`.

    `params` are the drafter's float32 master weights (cast to `dtype` here, so gradients
    come back in float32); `target_params` are already in `dtype` and stay frozen. `labels`
    is `TrainConfig.labels`. The harvested rows are scored: rows 1..b-1 predict offsets 1..b-1
    (mask-fill, DFlash) or rows 0..b-1 offsets 1..b (shifted, DSpark). A DSpark drafter's Markov
    head sees the text's token before each slot (teacher forcing), and its confidence head is
    trained by binary cross-entropy, weighted `confidence_weight`, toward the exact acceptance
    of its slot given the previous ones: whether the corrected argmax is the target's choice.
    """
    bsz, t = tokens.shape
    n_blocks, n = anchors.shape[1], cfg.n_drafts
    chex.assert_shape(anchors, (bsz, n_blocks))
    target = checkpoints.target_family(target_cfg).cls(target_cfg, target_params)
    drafter = checkpoints.drafter_family(cfg).cls(cfg, cast(params, dtype))
    h_all, taps = target.forward(tokens, drafter.tap_ids)
    taps, h_all = jax.lax.stop_gradient((taps, h_all))
    offsets = anchors[:, :, None] + jnp.arange(n + 1, dtype=jnp.int32)  # [B, A, n + 1]: anchor, slots 1..n
    text = _gather_rows(tokens, offsets)
    # The target's own choice at offset k is its argmax at position a + k - 1.
    target_choice = jnp.argmax(target.logits(_gather_rows(h_all, offsets[..., :-1])), axis=-1)
    h = drafter.train_hidden(taps, drafter.block_input(target, text[..., 0]), anchors)
    logits = drafter.harvest_logits(target, h)
    raw = None
    if cfg.family == "dspark":
        logits, raw = drafter.teacher_forced(logits, h[..., cfg.first_row:, :], text[..., :-1])
    loss = weighted_block_ce(logits, text[..., 1:] if labels == "data" else target_choice, weights)
    draft = jnp.argmax(logits, axis=-1)
    hit = (draft == target_choice).astype(jnp.float32)
    metrics = {
        "acc_len": jnp.mean(acceptance_length(draft, target_choice).astype(jnp.float32)),
        "slot_acc": jnp.mean(hit, axis=(0, 1)),
    }
    if raw is not None:
        bce = jnp.mean(jax.nn.softplus(raw) - raw * jax.lax.stop_gradient(hit))
        loss = loss + confidence_weight * bce
        metrics["confidence_bce"] = bce
    return loss, metrics


def lm_loss(params: dict, frozen, tokens: jax.Array, *, cfg: TargetConfig, dtype) -> tuple:
    """(loss, metrics) of next-token prediction on `tokens [B, T + 1]` (`frozen` is unused: None)."""
    del frozen
    target = checkpoints.target_family(cfg).cls(cfg, cast(params, dtype))
    logits = target.logits(target.forward(tokens[:, :-1])[0])
    labels = tokens[:, 1:]
    ce = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return jnp.mean(ce), {"acc": jnp.mean((jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32))}
