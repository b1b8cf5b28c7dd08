"""Training loops: drafter distillation (`objective.drafter_loss`) and small-LM pretraining.

Training is AdamW (b2 0.95, no decay on norms) with linear warmup and cosine decay to
zero, global-norm clipping, float32 master weights and a forward in `compute_dtype`, one
jitted step per batch. The target runs forward only; its LM head is applied to the
`[B, A, b-1]` rows that need it, never to the whole window.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import sys
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from dflash_jax.config import (
    FAMILY_NAMES,
    DrafterConfig,
    TargetConfig,
    check_fits_target,
    default_target_layer_ids,
    drafter_census,
    drafter_to_hf_config,
)
from dflash_jax import quant
from dflash_jax.io import checkpoints, publish
from dflash_jax.targets.base import Target
from dflash_jax.train.data import check_token_stream, sample_anchors, sample_windows
from dflash_jax.train.objective import cast, drafter_loss, lm_loss, loss_weights

COMPUTE_DTYPES = ("bfloat16", "float32")
LABELS = ("data", "target")


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
    the drafter the target's choices. `confidence_weight` scales a DSpark confidence head's
    cross-entropy against its slots' acceptance (the fixture's `confidence_head_alpha` is 1).
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
    confidence_weight: float = 1.0

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
                                     ("weight_decay", 0.0, True), ("confidence_weight", 0.0, True)):
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
# Parameters.


def init_target(cfg: TargetConfig, seed: int = 0) -> dict:
    """Float32 target params from the family's module (N(0, 0.02) weights, norms ones, biases zero)."""
    return checkpoints.target_family(cfg).init(cfg, seed)


TRAINABLE = (("dflash", "dflash"), ("dspark", "dspark"), ("dflash2", "dflash"))
"""(family, harvest) pairs with an objective: DFlash mask-fill, DSpark shifted, DFlash2 mask-fill."""
TRAINABLE_FAMILIES = tuple(family for family, _ in TRAINABLE)
DFLASH2_DEFAULTS = dict(selector_rank=256, selector_top_k=16, conv_kernel_size=2, conv_group_size=16)
"""`init_drafter`'s DFlash2 sizes: the published drafter's (tests/fixtures/dflash2-config.json)."""
FAMILY_ARGS = {"dspark": ("markov_rank", "confidence"),
               "dflash2": (*DFLASH2_DEFAULTS, "sliding_window")}
"""The keywords of `init_drafter` that only one family takes."""


def init_drafter(target_cfg: TargetConfig, *, num_layers: int, block_size: int, mask_token_id: int,
                 target_layer_ids=None, intermediate_size=None, num_heads=None, num_kv_heads=None,
                 head_dim=None, seed: int = 0, family: str = "dflash", markov_rank: Optional[int] = None,
                 confidence: bool = False, selector_rank: Optional[int] = None, selector_top_k: Optional[int] = None,
                 conv_kernel_size: Optional[int] = None, conv_group_size: Optional[int] = None,
                 sliding_window: Optional[int] = None) -> tuple:
    """(DrafterConfig, float32 params) of a fresh drafter for `target_cfg`.

    `family` "dflash" (mask-fill), "dspark" (shifted harvest; `markov_rank` adds a Markov
    head, `confidence` a confidence head, fed the Markov embedding when there is one) or
    "dflash2" (mask-fill; the candidate selector's `selector_rank` and `selector_top_k`, the
    convolutions' `conv_kernel_size` and `conv_group_size`, default the published drafter's
    `DFLASH2_DEFAULTS`). DFlash and DSpark layers are full attention; DFlash2 layers are all
    sliding attention, non-causal, with `sliding_window` (default the target's
    `max_position_embeddings`, so no context is dropped). A keyword of another family is
    refused. Shapes default to the target's; blocks are bidirectional. `target_layer_ids`
    defaults to the first reference's rule (`[N // 2]` for one draft layer, else
    `round(1 + i * (N - 4) / (n - 1))`). The config goes through the same census
    `read_drafter` applies, so what is trained is what will be loaded.
    """
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers {num_layers!r}: expected an integer >= 1")
    if family not in TRAINABLE_FAMILIES:
        raise ValueError(f"family {family!r} cannot be trained; choices: {', '.join(TRAINABLE_FAMILIES)}")
    if intermediate_size is None and not target_cfg.intermediate_size:
        raise ValueError(f"the {target_cfg.arch} target's MLPs are experts (no dense width to copy): pass "
                         "intermediate_size (--intermediate-size), the drafter's MLP width (e.g. 3 x hidden_size)")
    given = dict(markov_rank=markov_rank, confidence=confidence or None, selector_rank=selector_rank,
                 selector_top_k=selector_top_k, conv_kernel_size=conv_kernel_size, conv_group_size=conv_group_size,
                 sliding_window=sliding_window)
    for owner, names in FAMILY_ARGS.items():
        foreign = [n for n in names if given[n] is not None]
        if owner != family and foreign:
            raise ValueError(f"{', '.join(foreign)} set for family {family!r}: "
                             f"{'they are' if len(foreign) > 1 else 'it is'} {FAMILY_NAMES[owner]}'s; "
                             f"use family={owner!r}, or leave {'them' if len(foreign) > 1 else 'it'} unset")
    ids = default_target_layer_ids(target_cfg.num_layers, num_layers) if target_layer_ids is None else target_layer_ids
    heads, window = {}, None
    if family == "dspark":
        heads = dict(harvest="dspark", markov_rank=markov_rank,
                     confidence_in_dim=target_cfg.hidden_size + (markov_rank or 0) if confidence else None)
    elif family == "dflash2":
        heads = {k: default if given[k] is None else given[k] for k, default in DFLASH2_DEFAULTS.items()}
        window = target_cfg.max_position_embeddings if sliding_window is None else sliding_window
    cfg = DrafterConfig(
        family=family,
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
        layer_window=(window,) * num_layers,
        causal=(False,) * num_layers,
        vocab_size=target_cfg.vocab_size,
        num_target_layers=target_cfg.num_layers,
        **heads,
    )
    cfg = drafter_census(drafter_to_hf_config(cfg), target=target_cfg, env={})
    return cfg, checkpoints.drafter_family(cfg).init(cfg, seed)


def param_count(params) -> int:
    return int(sum(np.prod(np.shape(x)) for x in jax.tree.leaves(params)))


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


def _postfix(rec: dict) -> str:
    """The progress bar's figures at a log point: loss, the acceptance estimates, and the token rate (or,
    after the first step, how long compiling and that step took)."""
    parts = [f"loss {rec['loss']:.4f}"]
    if "acc_len" in rec:
        parts.append(f"acc-len {rec['acc_len']:.2f}")
    if "acc" in rec:
        parts.append(f"acc {rec['acc']:.3f}")
    if rec.get("tokens_per_s"):
        parts.append(f"{rec['tokens_per_s'] / 1e3:.1f}k tok/s")
    else:
        parts.append(f"compiled + 1 step in {rec['elapsed_s']:.1f}s")
    return " | ".join(parts)


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
    history = [] if history is None else history
    pending, t0, t_first = [], time.perf_counter(), None
    with tqdm(total=tc.steps, desc=label, unit="step", disable=not progress, file=sys.stderr) as bar:
        bar.set_postfix_str("compiling…")
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
                bar.set_postfix_str(_postfix(rec), refresh=False)
                bar.update(i - bar.n)
                if tc.time_budget_s is not None and now - t0 > tc.time_budget_s and i < tc.steps:
                    rec["stopped_early"] = f"time budget {tc.time_budget_s:g} s reached at step {i} of {tc.steps}"
                    break
            if on_checkpoint is not None and tc.checkpoint_every and i % tc.checkpoint_every == 0 and i < tc.steps:
                on_checkpoint(i, params)
        jax.block_until_ready(params)
    return params


# ---------------------------------------------------------------------------------------
# Public trainers and evaluation.


def check_drafter_for_target(target_cfg: TargetConfig, cfg: DrafterConfig, params, tc: TrainConfig) -> None:
    if (cfg.family, cfg.harvest) not in TRAINABLE:
        raise ValueError(
            f"only DFlash and DFlash2 drafters with the mask-fill harvest and DSpark drafters with the shifted "
            f"harvest can be trained; got family {cfg.family!r}, harvest {cfg.harvest!r}"
        )
    check_fits_target(cfg, target_cfg)
    quantized = quant.formats_of(params)
    if quantized:
        names = ", ".join(".".join(path) for path in list(quantized)[:3])
        raise ValueError(f"a drafter with quantised weights ({len(quantized)} tensors at {set(quantized.values())}, "
                         f"e.g. {names}) cannot be trained: gradients need float weights; load it with "
                         "precision='bf16' and quantise the trained drafter")
    if tc.seq_len > target_cfg.max_position_embeddings:
        raise ValueError(
            f"TrainConfig.seq_len {tc.seq_len} exceeds the target's max_position_embeddings "
            f"{target_cfg.max_position_embeddings}"
        )
    span = cfg.n_drafts + 1
    if tc.seq_len - span < tc.anchors_per_seq:
        raise ValueError(
            f"TrainConfig.anchors_per_seq {tc.anchors_per_seq} exceeds the {tc.seq_len - span} "
            f"possible anchors (seq_len {tc.seq_len} - span {span}: the anchor and its {cfg.n_drafts} labels)"
        )
    checkpoints.drafter_family(cfg).check(cfg, params)


def _drafter(cfg: DrafterConfig, params):
    return checkpoints.drafter_family(cfg).cls(cfg, params)


def _drafter_loss_fn(target_cfg: TargetConfig, cfg: DrafterConfig, tc: TrainConfig) -> Callable:
    return functools.partial(drafter_loss, target_cfg=target_cfg, cfg=cfg,
                             weights=loss_weights(cfg.n_drafts + 1, tc.gamma), dtype=jnp.dtype(tc.compute_dtype),
                             labels=tc.labels, confidence_weight=tc.confidence_weight)


def _drafter_batches(rng: np.random.Generator, data: np.ndarray, cfg: DrafterConfig, tc: TrainConfig) -> Callable:
    def next_batch():
        tokens = sample_windows(rng, data, tc.batch_size, tc.seq_len)
        return tokens, sample_anchors(rng, tc.batch_size, tc.anchors_per_seq, tc.seq_len, cfg.n_drafts + 1)

    return next_batch


def train_drafter(target: Target, data, drafter_cfg: DrafterConfig, params: dict, tc: TrainConfig, *,
                  out_dir=None, overwrite: bool = False, target_name: Optional[str] = None, progress: bool = True,
                  history: Optional[list] = None) -> dict:
    """Train a drafter (any family of `TRAINABLE`) for the frozen `target` on a 1-D token stream; return
    float32 params.

    With `out_dir`: a checkpoint of the family's format (bfloat16) at `out_dir/checkpoint-STEP`
    every `tc.checkpoint_every` steps, the final one in `out_dir` itself, and
    `out_dir/train_log.json` (config, logged metrics, timings). Its config records the target
    (`checkpoints.trained_for_record`, named `target_name`, the target folder's name, when
    given). The run is written into a temporary sibling and published whole at the end
    (`io/publish.py`): a non-empty `out_dir` is refused before training unless `overwrite`; an
    interrupted run leaves `out_dir` as it was, and its periodic checkpoints in the sibling the
    exception names. `history`, when given, is extended with the logged records.
    """
    tcfg = target.config
    check_drafter_for_target(tcfg, drafter_cfg, params, tc)
    data = check_token_stream(data, tcfg.vocab_size, tc.seq_len)
    trained_for = checkpoints.trained_for_record(tcfg, target_name)
    rng = np.random.default_rng(tc.seed)
    history = [] if history is None else history
    t0 = time.perf_counter()
    staging = contextlib.nullcontext() if out_dir is None else publish.staged(out_dir, overwrite, keep_on_error=True)
    with staging as stage:

        def save(step, p):
            checkpoints.write_drafter(os.path.join(stage, f"checkpoint-{step}"), _drafter(drafter_cfg, p),
                                      trained_for=trained_for)

        params = _fit(_drafter_loss_fn(tcfg, drafter_cfg, tc), params, cast(target.params, jnp.dtype(tc.compute_dtype)),
                      tc, _drafter_batches(rng, data, drafter_cfg, tc), tokens_per_step=tc.batch_size * tc.seq_len,
                      label="drafter", progress=progress, history=history,
                      on_checkpoint=save if stage is not None else None)
        if stage is not None:
            checkpoints.fill_drafter_folder(stage, _drafter(drafter_cfg, params), trained_for=trained_for)
            write_log(os.path.join(stage, "train_log.json"), {
                "kind": f"{drafter_cfg.family}-drafter",
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
    checkpoints.target_family(cfg).check(cfg, params)
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


def evaluate_drafter(target: Target, data, cfg: DrafterConfig, params: dict, tc: TrainConfig,
                     n_batches: int) -> dict:
    """Loss, acceptance-length estimate, per-slot agreement and the family's other metrics (e.g. DFlash2's
    `selector_masked`) on `n_batches` seeded batches of `data`."""
    check_drafter_for_target(target.config, cfg, params, tc)
    data = check_token_stream(data, target.config.vocab_size, tc.seq_len)
    dtype = jnp.dtype(tc.compute_dtype)
    fn = jax.jit(_drafter_loss_fn(target.config, cfg, tc))
    next_batch = _drafter_batches(np.random.default_rng(tc.seed + 1), data, cfg, tc)
    target_params = cast(target.params, dtype)
    results = jax.device_get([fn(params, target_params, *next_batch()) for _ in range(n_batches)])
    means = {k: np.mean([r[1][k] for r in results], axis=0).tolist() for k in results[0][1]}
    return {"loss": float(np.mean([r[0] for r in results])), **means,
            "blocks": n_batches * tc.batch_size * tc.anchors_per_seq}


def write_log(path, log: dict) -> None:
    with open(path, "w") as fh:
        json.dump(log, fh, indent=1)
