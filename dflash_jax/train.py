"""Drafter training (DESIGN.md §4, the published DFlash objective) and small-LM pretraining.

A DFlash drafter learns to fill a block `[anchor, mask, ..., mask]` for a frozen target.
Per training sequence of `seq_len` tokens:

- anchors `a` are drawn uniformly from `[1, seq_len - block_size]` without replacement
  (anchor 0 would have no context; the upper bound keeps every block row inside the window);
- block j sits at positions `a_j .. a_j + b - 1`; its rows attend to the target's taps of
  positions `< a_j` and bidirectionally to the rows of their own block (never to other
  blocks), exactly as `draft_hidden` does at inference (`drafter.draft_hidden_train`);
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

Training is AdamW (b2 0.95, no decay on norms) with linear warmup and cosine decay to
zero, global-norm clipping, float32 master weights and a forward in `compute_dtype`, one
jitted step per batch. The target runs forward only; its LM head is applied to the
`[B, A, b-1]` rows that need it, never to the whole window.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tokenizers import Tokenizer

from dflash_jax import checkpoint
from dflash_jax.config import (
    CheckpointError,
    DrafterConfig,
    TargetConfig,
    default_target_layer_ids,
    drafter_census,
    drafter_to_hf_config,
)
from dflash_jax.nn import dense, drafter
from dflash_jax.nn.layers import rms_norm

COMPUTE_DTYPES = ("bfloat16", "float32")
LABELS = ("data", "target")
INIT_STD = 0.02  # transformers' initializer_range for Qwen3 / Llama
MASK_TOKEN = "<|mask|>"
EOT_TOKEN = "<|endoftext|>"
CORPUS_SUFFIXES = (".txt", ".py")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation and batching knobs shared by drafter training and target pretraining.

    `anchors_per_seq` blocks are trained per sequence (drafter only). `gamma` is the decay of
    the per-slot loss weight `exp(-(k-1)/gamma)`; 7 is DFlash's value for block size 16.
    `checkpoint_every` 0 writes only the final checkpoint; `log_every` sets how often the
    progress line and the log are updated (each update waits for the device).
    `time_budget_s` stops training at the first log point past that many seconds (the
    learning-rate schedule still spans `steps`), so a run fits a fixed machine lease.
    `labels` picks the drafter's targets: "data" is the published objective (the text's own
    next tokens); "target" uses the frozen target's argmax at each position instead, which is
    what greedy verification checks, so text the target would not have written still teaches
    the drafter the target's choices.
    """

    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 512
    anchors_per_seq: int = 16
    lr: float = 6e-4
    warmup_steps: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float = 7.0
    seed: int = 0
    compute_dtype: str = "bfloat16"
    checkpoint_every: int = 0
    log_every: int = 10
    time_budget_s: Optional[float] = None
    labels: str = "data"

    def __post_init__(self):
        for name in ("steps", "batch_size", "anchors_per_seq", "log_every"):
            _check_int(self, name, 1)
        _check_int(self, "seq_len", 2)
        for name in ("warmup_steps", "checkpoint_every", "seed"):
            _check_int(self, name, 0)
        if self.warmup_steps >= self.steps:
            raise ValueError(
                f"TrainConfig.warmup_steps {self.warmup_steps} must be below steps {self.steps} "
                "(the cosine decay needs at least one step)"
            )
        for name, low, inclusive in (("lr", 0.0, False), ("grad_clip", 0.0, False), ("gamma", 0.0, False),
                                     ("weight_decay", 0.0, True)):
            value = getattr(self, name)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not ok or value < low or (value == low and not inclusive):
                bound = f">= {low}" if inclusive else f"> {low}"
                raise ValueError(f"TrainConfig.{name} {value!r}: expected a finite number {bound}")
        if self.time_budget_s is not None and not (isinstance(self.time_budget_s, (int, float))
                                                   and self.time_budget_s > 0):
            raise ValueError(f"TrainConfig.time_budget_s {self.time_budget_s!r}: expected seconds > 0, or None")
        if self.labels not in LABELS:
            raise ValueError(f"TrainConfig.labels {self.labels!r} is not supported; choices: {', '.join(LABELS)}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(
                f"TrainConfig.compute_dtype {self.compute_dtype!r} is not supported; choices: "
                f"{', '.join(COMPUTE_DTYPES)}"
            )


def _check_int(tc: TrainConfig, name: str, low: int) -> None:
    value = getattr(tc, name)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"TrainConfig.{name} {value!r}: expected an integer >= {low}")


# ---------------------------------------------------------------------------------------
# The objective and its metrics.


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


def _cast(tree, dtype):
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
    is `TrainConfig.labels`.
    """
    bsz, t = tokens.shape
    n_blocks, b, hidden = anchors.shape[1], cfg.block_size, target_cfg.hidden_size
    chex.assert_shape(anchors, (bsz, n_blocks))
    last = target_cfg.num_layers - 1
    _, taps = dense.forward(target_params, target_cfg, tokens, tuple(cfg.target_layer_ids) + (last,))
    taps = jax.lax.stop_gradient(taps)
    taps, final = taps[..., :-hidden], taps[..., -hidden:]
    positions = anchors[:, :, None] + jnp.arange(b, dtype=jnp.int32)  # [B, A, b]
    block_tokens = _gather_rows(tokens, positions)
    # The target's own choice for row k is its argmax at position a + k - 1.
    h_target = rms_norm(_gather_rows(final, positions[..., :-1]), target_params["final_norm"], target_cfg.rms_norm_eps)
    target_choice = jnp.argmax(dense.lm_logits(target_params, target_cfg, h_target), axis=-1)
    x = drafter.block_input(target_params, cfg, block_tokens[..., 0].reshape(-1))
    h = drafter.draft_hidden_train(_cast(params, dtype), cfg, taps, x.reshape(bsz, n_blocks, b, hidden), anchors)
    logits = drafter.draft_logits(target_params, target_cfg, cfg, h.reshape(bsz * n_blocks, b, hidden))
    logits = logits.reshape(bsz, n_blocks, b - 1, -1)
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
    logits, _ = dense.forward(_cast(params, dtype), cfg, tokens[:, :-1])
    labels = tokens[:, 1:]
    ce = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return jnp.mean(ce), {"acc": jnp.mean((jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32))}


# ---------------------------------------------------------------------------------------
# Parameters.


def _normal(key, shape) -> jax.Array:
    return INIT_STD * jax.random.normal(key, shape, jnp.float32)


def _init_tree(shapes, seed: int):
    """Float32 params for a tree of shapes: 1-D leaves (norm weights) ones, others N(0, 0.02)."""
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda s: isinstance(s, tuple))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    params = [jnp.ones(s, jnp.float32) if len(s) == 1 else _normal(k, s) for k, s in zip(keys, leaves)]
    return jax.tree.unflatten(treedef, params)


def init_target(cfg: TargetConfig, seed: int = 0) -> dict:
    """Float32 target params initialised like transformers (N(0, 0.02), norms ones, biases zero)."""
    params = _init_tree(checkpoint.target_param_shapes(cfg), seed)
    for layer in params["layers"]:
        for name in ("bqkv", "bo"):
            if name in layer:
                layer[name] = jnp.zeros_like(layer[name])
    return params


def init_drafter(target_cfg: TargetConfig, *, num_layers: int, block_size: int, mask_token_id: int,
                 target_layer_ids=None, intermediate_size=None, num_heads=None, num_kv_heads=None,
                 head_dim=None, seed: int = 0) -> tuple:
    """(DrafterConfig, float32 params) of a fresh DFlash drafter for `target_cfg`.

    Shapes default to the target's; every layer is full attention, bidirectional inside the
    block. `target_layer_ids` defaults to the first reference's rule (`[N // 2]` for one
    draft layer, else `round(1 + i * (N - 4) / (n - 1))`). The config goes through the same
    census `read_drafter` applies, so what is trained is what will be loaded.
    """
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers {num_layers!r}: expected an integer >= 1")
    ids = default_target_layer_ids(target_cfg.num_layers, num_layers) if target_layer_ids is None else target_layer_ids
    cfg = DrafterConfig(
        family="dflash",
        hidden_size=target_cfg.hidden_size,
        intermediate_size=intermediate_size or target_cfg.intermediate_size,
        num_layers=num_layers,
        num_heads=num_heads or target_cfg.num_heads,
        num_kv_heads=num_kv_heads or target_cfg.num_kv_heads,
        head_dim=head_dim or target_cfg.head_dim,
        rms_norm_eps=target_cfg.rms_norm_eps,
        rope=target_cfg.rope,
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=tuple(ids),
        layer_window=(None,) * num_layers,
        causal=(False,) * num_layers,
        vocab_size=target_cfg.vocab_size,
        num_target_layers=target_cfg.num_layers,
    )
    cfg = drafter_census(drafter_to_hf_config(cfg), target=target_cfg, env={})
    return cfg, _init_tree(checkpoint.drafter_param_shapes(cfg), seed)


def param_count(params) -> int:
    return int(sum(np.prod(np.shape(x)) for x in jax.tree.leaves(params)))


def _check_param_shapes(expected, params, what: str) -> None:
    """Refuse params whose tree or leaf shapes differ from the config's layout, before tracing."""
    name = jax.tree_util.keystr
    want = {name(k): s for k, s in jax.tree_util.tree_flatten_with_path(
        expected, is_leaf=lambda s: isinstance(s, tuple))[0]}
    got = {name(k): tuple(np.shape(x)) for k, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    wrong = [f"{k}: {got.get(k, 'missing')} (expected {want.get(k, 'nothing')})"
             for k in sorted(set(want) | set(got)) if want.get(k) != got.get(k)]
    if wrong:
        raise ValueError(f"{what} params do not match the config: {'; '.join(wrong[:8])}")


# ---------------------------------------------------------------------------------------
# Batches.


def check_token_stream(data, vocab_size: int, min_len: int, what: str = "data") -> np.ndarray:
    """A 1-D int32 token stream with ids in range and at least `min_len` tokens, or ValueError."""
    arr = np.asarray(data)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{what}: expected a 1-D integer token stream; got shape {arr.shape}, dtype {arr.dtype}")
    if arr.size < min_len:
        raise ValueError(f"{what}: {arr.size} tokens, fewer than one training window ({min_len}); "
                         "use more text or a shorter seq_len")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"{what}: token ids must be in [0, {vocab_size}); found min {lo}, max {hi}")
    return arr.astype(np.int32, copy=False)


def sample_windows(rng: np.random.Generator, data: np.ndarray, batch_size: int, length: int) -> np.ndarray:
    """`int32 [batch_size, length]`: windows at uniform random starts in the stream."""
    starts = rng.integers(0, data.shape[0] - length + 1, size=batch_size)
    return data[starts[:, None] + np.arange(length)]


def sample_anchors(rng: np.random.Generator, batch_size: int, n_anchors: int, seq_len: int,
                   block_size: int) -> np.ndarray:
    """`int32 [batch_size, n_anchors]`, sorted per row: distinct anchors in `[1, seq_len - block_size]`."""
    n_choices = seq_len - block_size
    if n_anchors > n_choices:
        raise ValueError(
            f"anchors_per_seq {n_anchors} exceeds the {n_choices} possible anchors of a window "
            f"(seq_len {seq_len} - block_size {block_size}); lower anchors_per_seq or raise seq_len"
        )
    picks = np.argsort(rng.random((batch_size, n_choices)), axis=1)[:, :n_anchors]
    return (np.sort(picks, axis=1) + 1).astype(np.int32)


# ---------------------------------------------------------------------------------------
# The loop shared by both trainers.


def make_optimizer(tc: TrainConfig) -> tuple:
    """(optimizer, schedule): global-norm clipping then AdamW under warmup + cosine decay."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, tc.lr, tc.warmup_steps, tc.steps)
    decay_mask = functools.partial(jax.tree.map, lambda x: x.ndim > 1)
    optimizer = optax.chain(
        optax.clip_by_global_norm(tc.grad_clip),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=tc.weight_decay, mask=decay_mask),
    )
    return optimizer, schedule


def _global_norm(tree) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def _make_step(loss_fn: Callable, optimizer, schedule) -> Callable:
    """Jitted `(params, opt_state, frozen, update_index, *batch) -> (params, opt_state, metrics)`."""

    def step(params, opt_state, frozen, index, *batch):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, frozen, *batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        metrics = {**metrics, "loss": loss, "grad_norm": _global_norm(grads), "lr": schedule(index)}
        return optax.apply_updates(params, updates), opt_state, metrics

    donate = () if jax.default_backend() == "cpu" else (0, 1)  # the CPU backend cannot donate
    return jax.jit(step, donate_argnums=donate)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class _Progress:
    """One status line on stderr, rewritten in place on a terminal, one line per update otherwise."""

    def __init__(self, label: str, enabled: bool):
        self.label, self.enabled = label, enabled
        self.inplace = enabled and sys.stderr.isatty()
        self.width = 0

    def update(self, rec: dict, steps: int) -> None:
        if not self.enabled:
            return
        parts = [f"{self.label} {rec['step']}/{steps}", f"loss {rec['loss']:.4f}"]
        if "acc_len" in rec:
            parts.append(f"acc-len {rec['acc_len']:.2f}")
        if "acc" in rec:
            parts.append(f"acc {rec['acc']:.3f}")
        if rec.get("tokens_per_s"):
            parts += [f"{rec['tokens_per_s'] / 1e3:.1f}k tok/s", f"ETA {_duration(rec['eta_s'])}"]
        else:
            parts.append(f"compiled+1 step in {_duration(rec['elapsed_s'])}")
        line = " | ".join(parts)
        if self.inplace:
            sys.stderr.write("\r" + line.ljust(self.width))
            self.width = len(line)
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.inplace and self.width:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _summarise(pending: list) -> dict:
    """Mean of each metric over the steps since the last log line."""
    fetched = jax.device_get(pending)
    return {k: np.mean([m[k] for m in fetched], axis=0) for k in fetched[0]}


def _fit(loss_fn: Callable, params, frozen, tc: TrainConfig, next_batch: Callable, *, tokens_per_step: int,
         label: str, progress: bool, history: Optional[list], on_checkpoint: Optional[Callable] = None):
    """Run `tc.steps` optimizer steps; log means every `tc.log_every` steps into `history`."""
    optimizer, schedule = make_optimizer(tc)
    params = jax.tree.map(lambda x: jnp.array(x, jnp.float32), params)  # a private float32 master copy
    opt_state = optimizer.init(params)
    step = _make_step(loss_fn, optimizer, schedule)
    bar = _Progress(label, progress)
    history = [] if history is None else history
    pending, t0, t_first = [], time.perf_counter(), None
    for i in range(1, tc.steps + 1):
        params, opt_state, metrics = step(params, opt_state, frozen, np.int32(i - 1), *next_batch())
        pending.append(metrics)
        if i == 1:
            jax.block_until_ready(metrics)
            t_first = time.perf_counter()
        if i == 1 or i % tc.log_every == 0 or i == tc.steps:
            rec = {k: v.tolist() for k, v in _summarise(pending).items()}
            pending = []
            now = time.perf_counter()
            rate = (i - 1) / (now - t_first) if i > 1 else 0.0
            rec.update(step=i, elapsed_s=now - t0,
                       tokens_per_s=rate * tokens_per_step, eta_s=(tc.steps - i) / rate if rate else None)
            if i == 1:
                rec["first_step_s"] = t_first - t0
            history.append(rec)
            bar.update(rec, tc.steps)
            if tc.time_budget_s is not None and now - t0 > tc.time_budget_s and i < tc.steps:
                rec["stopped_early"] = f"time budget {tc.time_budget_s:g} s reached at step {i} of {tc.steps}"
                break
        if on_checkpoint is not None and tc.checkpoint_every and i % tc.checkpoint_every == 0 and i < tc.steps:
            on_checkpoint(i, params)
    jax.block_until_ready(params)
    bar.close()
    return params


# ---------------------------------------------------------------------------------------
# Public trainers and evaluation.


def _check_drafter_for_target(target_cfg: TargetConfig, cfg: DrafterConfig, params, tc: TrainConfig) -> None:
    if cfg.family != "dflash" or cfg.harvest != "dflash":
        raise ValueError(
            f"only DFlash drafters with the mask-fill harvest can be trained; got family {cfg.family!r}, "
            f"harvest {cfg.harvest!r}"
        )
    if cfg.hidden_size != target_cfg.hidden_size:
        raise ValueError(f"drafter hidden_size {cfg.hidden_size} != target hidden_size {target_cfg.hidden_size}")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < target_cfg.num_layers]
    if bad:
        raise ValueError(f"target_layer_ids {bad} are outside the target's layers 0..{target_cfg.num_layers - 1}")
    if not 0 <= cfg.mask_token_id < target_cfg.vocab_size:
        raise ValueError(
            f"mask_token_id {cfg.mask_token_id} is outside the target vocabulary ({target_cfg.vocab_size})"
        )
    if tc.seq_len > target_cfg.max_position_embeddings:
        raise ValueError(
            f"TrainConfig.seq_len {tc.seq_len} exceeds the target's max_position_embeddings "
            f"{target_cfg.max_position_embeddings}"
        )
    if tc.seq_len - cfg.block_size < tc.anchors_per_seq:
        raise ValueError(
            f"TrainConfig.anchors_per_seq {tc.anchors_per_seq} exceeds the {tc.seq_len - cfg.block_size} "
            f"possible anchors (seq_len {tc.seq_len} - block_size {cfg.block_size})"
        )
    _check_param_shapes(checkpoint.drafter_param_shapes(cfg), params, "drafter")


def _drafter_loss_fn(target_cfg: TargetConfig, cfg: DrafterConfig, tc: TrainConfig) -> Callable:
    return functools.partial(drafter_loss, target_cfg=target_cfg, cfg=cfg,
                             weights=loss_weights(cfg.block_size, tc.gamma), dtype=jnp.dtype(tc.compute_dtype),
                             labels=tc.labels)


def _drafter_batches(rng: np.random.Generator, data: np.ndarray, cfg: DrafterConfig, tc: TrainConfig) -> Callable:
    def next_batch():
        tokens = sample_windows(rng, data, tc.batch_size, tc.seq_len)
        return tokens, sample_anchors(rng, tc.batch_size, tc.anchors_per_seq, tc.seq_len, cfg.block_size)

    return next_batch


def train_drafter(target: dense.Target, data, drafter_cfg: DrafterConfig, params: dict, tc: TrainConfig, *,
                  out_dir=None, progress: bool = True, history: Optional[list] = None) -> dict:
    """Train a DFlash drafter for the frozen `target` on a 1-D token stream; return float32 params.

    With `out_dir`: a z-lab DFlashDraftModel checkpoint (bfloat16) at `out_dir/checkpoint-STEP`
    every `tc.checkpoint_every` steps, the final one in `out_dir` itself, and
    `out_dir/train_log.json` (config, logged metrics, timings). `history`, when given, is
    extended with the logged records.
    """
    tcfg = target.config
    _check_drafter_for_target(tcfg, drafter_cfg, params, tc)
    data = check_token_stream(data, tcfg.vocab_size, tc.seq_len)
    rng = np.random.default_rng(tc.seed)
    history = [] if history is None else history
    t0 = time.perf_counter()

    def save(step, p):
        checkpoint.write_drafter(os.path.join(os.fspath(out_dir), f"checkpoint-{step}"), drafter_cfg, p)

    params = _fit(_drafter_loss_fn(tcfg, drafter_cfg, tc), params, _cast(target.params, jnp.dtype(tc.compute_dtype)),
                  tc, _drafter_batches(rng, data, drafter_cfg, tc), tokens_per_step=tc.batch_size * tc.seq_len,
                  label="drafter", progress=progress, history=history,
                  on_checkpoint=save if out_dir is not None else None)
    if out_dir is not None:
        checkpoint.write_drafter(out_dir, drafter_cfg, params)
        write_log(os.path.join(os.fspath(out_dir), "train_log.json"), {
            "kind": "dflash-drafter",
            "train_config": dataclasses.asdict(tc),
            "drafter_config": drafter_to_hf_config(drafter_cfg),
            "drafter_parameters": param_count(params),
            "data_tokens": int(data.shape[0]),
            "wall_s": time.perf_counter() - t0,
            "history": history,
        })
    return params


def pretrain_target(cfg: TargetConfig, params: dict, data, tc: TrainConfig, *, progress: bool = True,
                    history: Optional[list] = None) -> dict:
    """Next-token LM training of a target on a 1-D token stream (windows of seq_len + 1); float32 params."""
    _check_param_shapes(checkpoint.target_param_shapes(cfg), params, "target")
    if tc.seq_len > cfg.max_position_embeddings:
        raise ValueError(
            f"TrainConfig.seq_len {tc.seq_len} exceeds max_position_embeddings {cfg.max_position_embeddings}"
        )
    data = check_token_stream(data, cfg.vocab_size, tc.seq_len + 1)
    rng = np.random.default_rng(tc.seed)
    loss_fn = functools.partial(lm_loss, cfg=cfg, dtype=jnp.dtype(tc.compute_dtype))

    def next_batch():
        return (sample_windows(rng, data, tc.batch_size, tc.seq_len + 1),)

    return _fit(loss_fn, params, None, tc, next_batch, tokens_per_step=tc.batch_size * tc.seq_len,
                label="target", progress=progress, history=history)


def evaluate_target(cfg: TargetConfig, params: dict, data, *, seq_len: int, batch_size: int, n_batches: int,
                    compute_dtype: str = "bfloat16") -> dict:
    """Mean next-token loss, perplexity and top-1 accuracy on `n_batches * batch_size` evenly spaced windows."""
    data = check_token_stream(data, cfg.vocab_size, seq_len + 1)
    n = batch_size * n_batches
    starts = np.linspace(0, data.shape[0] - seq_len - 1, n).astype(np.int64)
    windows = data[starts[:, None] + np.arange(seq_len + 1)]
    fn = jax.jit(functools.partial(lm_loss, cfg=cfg, dtype=jnp.dtype(compute_dtype)))
    results = [fn(params, None, windows[i * batch_size:(i + 1) * batch_size]) for i in range(n_batches)]
    loss = float(np.mean([float(r[0]) for r in results]))
    acc = float(np.mean([float(r[1]["acc"]) for r in results]))
    return {"loss": loss, "perplexity": math.exp(loss), "accuracy": acc, "tokens": n * seq_len}


def evaluate_drafter(target: dense.Target, data, cfg: DrafterConfig, params: dict, tc: TrainConfig,
                     n_batches: int) -> dict:
    """Loss, acceptance-length estimate and per-slot agreement on `n_batches` seeded batches of `data`."""
    _check_drafter_for_target(target.config, cfg, params, tc)
    data = check_token_stream(data, target.config.vocab_size, tc.seq_len)
    dtype = jnp.dtype(tc.compute_dtype)
    fn = jax.jit(_drafter_loss_fn(target.config, cfg, tc))
    next_batch = _drafter_batches(np.random.default_rng(tc.seed + 1), data, cfg, tc)
    target_params = _cast(target.params, dtype)
    results = jax.device_get([fn(params, target_params, *next_batch()) for _ in range(n_batches)])
    return {
        "loss": float(np.mean([r[0] for r in results])),
        "acc_len": float(np.mean([r[1]["acc_len"] for r in results])),
        "slot_acc": np.mean([r[1]["slot_acc"] for r in results], axis=0).tolist(),
        "blocks": n_batches * tc.batch_size * tc.anchors_per_seq,
    }


def write_log(path, log: dict) -> None:
    with open(path, "w") as fh:
        json.dump(log, fh, indent=1)


# ---------------------------------------------------------------------------------------
# Corpus and the `dflash-jax train-drafter` command.


def corpus_files(path) -> list:
    """The text files of a corpus: the file itself, or every .txt/.py under a directory (sorted)."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ValueError(f"corpus {path}: no such file or directory")
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in CORPUS_SUFFIXES)
    if not files:
        raise ValueError(f"corpus directory {path} has no {' or '.join(CORPUS_SUFFIXES)} files")
    return files


def load_corpus(path, tokenizer=None, separator: Optional[int] = None) -> np.ndarray:
    """A 1-D int32 token stream from a `.npy` stream, a text file or a directory of text files.

    Text is encoded with `tokenizer` (a `tokenizers.Tokenizer`), one document per file,
    with `separator` (the eos id) between documents when given.
    """
    path = Path(path)
    if path.suffix == ".npy":
        arr = np.load(path)
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{path}: expected a 1-D integer token stream; got shape {arr.shape}, dtype {arr.dtype}")
        return arr.astype(np.int32)
    if tokenizer is None:
        raise ValueError(f"corpus {path} is text: a tokenizer (the target's tokenizer.json) is needed to encode it")
    docs = []
    for file in corpus_files(path):
        try:
            docs.append(file.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ValueError(f"corpus file {file} is not UTF-8 text ({e})") from e
    pieces = []
    for i, enc in enumerate(tokenizer.encode_batch(docs, add_special_tokens=False)):
        if i and separator is not None:
            pieces.append(np.array([separator], np.int32))
        pieces.append(np.asarray(enc.ids, np.int32))
    return np.concatenate(pieces)


def add_cli(subparsers) -> None:
    """Register `train-drafter` on an argparse subparsers object."""
    d = TrainConfig()
    p = subparsers.add_parser(
        "train-drafter",
        help="train a DFlash drafter for a Hugging Face target on a text corpus",
        description="Train a DFlash drafter (z-lab DFlashDraftModel format) for a frozen Qwen3/Llama target.",
    )
    p.add_argument("--target", required=True, help="target directory: config.json, *.safetensors, tokenizer.json")
    p.add_argument("--corpus", required=True,
                   help="a text file, a directory of .txt/.py files (one document each), or a .npy token stream")
    p.add_argument("--out", required=True, help="output directory for the drafter checkpoint and train_log.json")
    p.add_argument("--layers", type=int, default=2,
                   help="draft layers (default 2; published Qwen3-8B drafters use 5)")
    p.add_argument("--block-size", type=int, default=16, help="block size b: anchor + b-1 drafts (default 16)")
    p.add_argument("--mask-token-id", type=int,
                   help=f"mask token id (default: the tokenizer's {MASK_TOKEN}; required if it has none)")
    p.add_argument("--target-layer-ids", type=lambda s: tuple(int(x) for x in s.split(",")),
                   help="comma-separated target layers to tap (default: the reference rule)")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--anchors-per-seq", type=int, default=d.anchors_per_seq)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup-steps", type=int, help="default: min(100, steps // 10)")
    p.add_argument("--gamma", type=float, default=d.gamma,
                   help="slot weight decay exp(-(k-1)/gamma) (default 7, DFlash's for b=16; 5 for b=10, 4 for b=8)")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, help="0: final checkpoint only")
    p.add_argument("--dtype", default=d.compute_dtype, choices=COMPUTE_DTYPES, help="compute dtype")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--time-budget", type=float, help="stop after this many seconds and export (default: no limit)")
    p.add_argument("--labels", default=d.labels, choices=LABELS,
                   help="data: the corpus's next tokens (published objective, default); target: the target's "
                        "argmax at each position (learns the target's choices from any text)")
    p.set_defaults(func=cli_train_drafter)


def _tokenizer(target_dir) -> Optional[Tokenizer]:
    path = os.path.join(os.fspath(target_dir), "tokenizer.json")
    return Tokenizer.from_file(path) if os.path.isfile(path) else None


def _prepare(args) -> tuple:
    """(Target, data, DrafterConfig, params, TrainConfig) for the command, refusing bad input early."""
    tc = TrainConfig(
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, anchors_per_seq=args.anchors_per_seq,
        lr=args.lr, warmup_steps=min(100, args.steps // 10) if args.warmup_steps is None else args.warmup_steps,
        gamma=args.gamma, seed=args.seed, compute_dtype=args.dtype, checkpoint_every=args.checkpoint_every,
        time_budget_s=args.time_budget, labels=args.labels,
    )
    tokenizer = _tokenizer(args.target)
    mask_id = args.mask_token_id
    if mask_id is None:
        mask_id = tokenizer.token_to_id(MASK_TOKEN) if tokenizer is not None else None
        if mask_id is None:
            raise ValueError(
                f"the target's tokenizer has no {MASK_TOKEN} token (or {args.target} has no tokenizer.json); "
                "pass --mask-token-id with the id of a token the target never produces"
            )
    if tokenizer is None and Path(args.corpus).suffix != ".npy":
        raise ValueError(f"{args.target} has no tokenizer.json, needed to tokenize the text corpus {args.corpus}")
    cfg, params = checkpoint.read_target(args.target, dtype=args.dtype)
    separator = tokenizer.token_to_id(EOT_TOKEN) if tokenizer is not None else None
    if separator is None and cfg.eos_token_ids:
        separator = cfg.eos_token_ids[0]
    data = load_corpus(args.corpus, tokenizer, separator)
    dcfg, dparams = init_drafter(cfg, num_layers=args.layers, block_size=args.block_size, mask_token_id=mask_id,
                                 target_layer_ids=args.target_layer_ids, seed=args.seed)
    target = dense.Target(config=cfg, params=params)
    _check_drafter_for_target(cfg, dcfg, dparams, tc)
    check_token_stream(data, cfg.vocab_size, tc.seq_len, f"corpus {args.corpus}")
    return target, data, dcfg, dparams, tc


def cli_train_drafter(args) -> int:
    """`dflash-jax train-drafter`: tokenize the corpus, train, export; 1 with the reason if refused."""
    try:
        target, data, dcfg, dparams, tc = _prepare(args)
    except (CheckpointError, ValueError, OSError) as e:
        print(f"refused: {e}", file=sys.stderr)
        return 1
    print(f"corpus: {data.shape[0]:,} tokens; drafter: {dcfg.num_layers} layers, {param_count(dparams):,} "
          f"parameters, taps {list(dcfg.target_layer_ids)}, block size {dcfg.block_size}, "
          f"mask token {dcfg.mask_token_id}", file=sys.stderr)
    history = []
    train_drafter(target, data, dcfg, dparams, tc, out_dir=args.out, history=history)
    print(f"wrote {args.out} (acceptance-length estimate on training batches {history[-1]['acc_len']:.2f})")
    return 0

