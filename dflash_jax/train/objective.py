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

A DFlash2 drafter adds its candidate selector's cross-entropy (`selector_ce`): per slot, over
the top-K candidates of the harvested logits, scored as the selector's walk scores them with
the text's token before the slot as predecessor (teacher forcing, as DSpark's Markov head).
Its metrics follow the greedy walk chained from the anchor, which is what inference drafts.

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
from dflash_jax.drafters import dflash2
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


def selector_ce(pred: jax.Array, succ: jax.Array, unary: jax.Array, cand: jax.Array, hp: jax.Array,
                prev: jax.Array, labels: jax.Array, weights) -> tuple:
    """(loss, masked share) of a DFlash2 candidate selector over its K candidates per slot.

    unary, cand `[..., n, K]` (the harvested logits' top-K values and ids), hp `[..., n, r]`,
    prev and labels `int[..., n]`, weights `[n]`. Slot k's scores are
    `dflash2.selector_scores(pred, succ, unary, cand, hp, prev)` and its target is the index of
    its label among its candidates. A slot whose label is not a candidate is masked out: the
    walk cannot draft it whatever the scores, so it has nothing to teach the selector (it
    counts as zero and the loss keeps `weighted_block_ce`'s scale and slot weights); the masked
    share is the fraction of such slots. The unary logits enter under `stop_gradient`: the
    backbone's CE already fits them over the whole vocabulary, and a gradient through the
    top-K would only add a second CE restricted to the slots whose label the backbone already
    ranks high, and would reshape the logits that pick the candidates. The selector learns
    the chain's correction to the backbone's ranking; its gradient still reaches the backbone
    through hp (the hidden rows), which must carry what the gate reads.
    """
    chex.assert_equal_shape((unary, cand))
    chex.assert_equal_shape((prev, labels))
    scores = dflash2.selector_scores(pred, succ, jax.lax.stop_gradient(unary), cand, hp, prev)
    hit = cand == labels[..., None]
    kept = jnp.any(hit, axis=-1)
    picked = jnp.take_along_axis(scores, jnp.argmax(hit, axis=-1)[..., None], axis=-1)[..., 0]
    ce = jnp.where(kept, jax.nn.logsumexp(scores, axis=-1) - picked, 0.0)
    w = jnp.asarray(weights, jnp.float32)
    blocks = math.prod(labels.shape[:-1])
    return jnp.sum(ce * w) / (blocks * jnp.sum(w)), 1.0 - jnp.mean(kept.astype(jnp.float32))


def greedy_walk(pred: jax.Array, succ: jax.Array, unary: jax.Array, cand: jax.Array, hp: jax.Array,
                anchor: jax.Array) -> jax.Array:
    """The drafts `int32[..., n]` of DFlash2's greedy selector walk from `anchor int[...]`, as `propose`
    takes them at temperature 0 (`dflash2.selector_walk` over the flattened leading axes)."""
    lead, (n, k) = anchor.shape, cand.shape[-2:]
    rows = math.prod(lead)
    drafts, _ = dflash2.selector_walk(pred, succ, unary.reshape(rows, n, k), cand.reshape(rows, n, k),
                                      hp.reshape(rows, n, hp.shape[-1]), anchor.reshape(rows),
                                      jnp.zeros((rows,), jnp.float32), jnp.zeros((rows, n), jnp.float32))
    return drafts.reshape(lead + (n,))


def cast(tree, dtype):
    """Floating leaves of `tree` in `dtype` (the compute copy of float32 master weights)."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _gather_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
    """`x [B, T, ...]` at per-row positions `idx [B, ...]` -> `[B, ..., rest of x]`."""
    flat = idx.reshape(idx.shape[0], -1)
    trailing = x.shape[2:]
    out = jnp.take_along_axis(x, flat.reshape(flat.shape + (1,) * len(trailing)), axis=1)
    return out.reshape(idx.shape + trailing)


def _dflash2_terms(drafter, target, h: jax.Array, text: jax.Array, wanted: jax.Array, target_choice: jax.Array,
                   weights) -> tuple:
    """(backbone CE + selector CE, greedy-walk drafts, metrics) of a DFlash2 drafter's block rows `h`."""
    logits, unary, cand, hp = drafter.candidates(target, h)
    pred, succ = drafter.params["selector_pred"], drafter.params["selector_succ"]
    backbone = weighted_block_ce(logits, wanted, weights)
    select, masked = selector_ce(pred, succ, unary, cand, hp, text[..., :-1], wanted, weights)
    argmax_len = acceptance_length(jnp.argmax(logits, axis=-1), target_choice).astype(jnp.float32)
    metrics = {"backbone_ce": backbone, "selector_ce": select, "selector_masked": masked,
               "argmax_acc_len": jnp.mean(argmax_len)}
    draft = greedy_walk(*jax.lax.stop_gradient((pred, succ, unary, cand, hp)), text[..., 0])
    return backbone + select, draft, metrics


def drafter_loss(params: dict, target_params: dict, tokens: jax.Array, anchors: jax.Array, *,
                 target_cfg: TargetConfig, cfg: DrafterConfig, weights, dtype, labels: str = "data",
                 confidence_weight: float = 1.0) -> tuple:
    """(loss, metrics) of the drafter's objective on windows `tokens [B, T]` with `anchors [B, A]`.

    `params` are the drafter's float32 master weights (cast to `dtype` here, so gradients
    come back in float32); `target_params` are already in `dtype` and stay frozen. `labels`
    is `TrainConfig.labels`. The harvested rows are scored: rows 1..b-1 predict offsets 1..b-1
    (mask-fill, DFlash and DFlash2) or rows 0..b-1 offsets 1..b (shifted, DSpark). A DSpark
    drafter's Markov head sees the text's token before each slot (teacher forcing), and its
    confidence head is trained by binary cross-entropy, weighted `confidence_weight`, toward the
    exact acceptance of its slot given the previous ones: whether the corrected argmax is the
    target's choice. A DFlash2 drafter adds `selector_ce` (same labels and slot weights), and its
    `acc_len` and `slot_acc` are those of the greedy walk (`argmax_acc_len`: of the per-slot
    argmax, the backbone alone).
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
    wanted = text[..., 1:] if labels == "data" else target_choice
    raw, metrics = None, {}
    if cfg.family == "dflash2":
        loss, draft, metrics = _dflash2_terms(drafter, target, h, text, wanted, target_choice, weights)
    else:
        logits = drafter.harvest_logits(target, h)
        if cfg.family == "dspark":
            logits, raw = drafter.teacher_forced(logits, h[..., cfg.first_row:, :], text[..., :-1])
        loss = weighted_block_ce(logits, wanted, weights)
        draft = jnp.argmax(logits, axis=-1)
    hit = (draft == target_choice).astype(jnp.float32)
    metrics.update(acc_len=jnp.mean(acceptance_length(draft, target_choice).astype(jnp.float32)),
                   slot_acc=jnp.mean(hit, axis=(0, 1)))
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
