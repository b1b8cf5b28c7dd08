"""Gemma-4 on the GPU: a Gemma-4-31B-shaped dense target with random bf16 weights, batch 1, prompts 512 and 8192,
a 5-layer DFlash drafter at block 16.

The shape is the published google/gemma-4-31B text model's (`GEMMA4_31B`, written out here, nothing downloaded):
60 layers, five sliding-window layers (window 1024; 16 KV heads of 256) to each full one (4 KV heads of 512,
keys are values, proportional rope on a quarter of each head), hidden 5376, MLP 21504, vocabulary 262144 with
a tied head soft-capped at 30.

Per prompt and per kind of sliding-layer cache (`--sliding-caches`: `config.policy.sliding_cache`'s 'full', a
windowed mask over the whole capacity, and 'ring', window + RING_SLACK slots gathered into order):
  plain       tokens/s of the plain loop, and `roofline_ratio`: the bytes a step must move over the measured
              HBM read bandwidth, divided by the measured step. Bytes: every weight (of the embedding table only
              the row gathered: `common.target_step_bytes`), and the K/V a step reads: the last
              `sliding_window` positions of each sliding layer and the whole live context of each full layer.
  round       `spec_round.measure_cell`: the fused loop at injected acceptance 6.5, and one round split into
              draft, verify and commit (+ the drafter's ingest); `round_over_plain_step`.
Targets (issue 15): plain >= 0.80 of the roofline; round <= 1.3 plain steps.

Weights: `common.random_target` with the head untied (a planted next-token map needs its own head; a step reads
the same bytes, one embedding row and the whole head), then the embedding and head scaled so that the next token
of the map gets a logit of about `SELF_LOGIT` (inside the soft-cap's linear range: a random table's logits would
all saturate to the cap and tie), and the norms after attention and MLP at `POST_NORM`, so that layers perturb
the residual stream without drowning the embedding. Greedy decoding walks the map's long cycle with a wide
margin. Speed does not depend on the values.

    python bench/gemma4.py                 # H200: writes bench/results/gemma4.json and gemma4.png
    python bench/gemma4.py --tiny          # CPU smoke test
    python bench/gemma4.py --sliding-caches ring --prompts 8192
"""
from __future__ import annotations

import argparse
import dataclasses
import gc

import jax.numpy as jnp

import acceptance as acc
import common
import spec_round
from dflash_jax.config import Gemma4Config, RopeConfig, policy
from dflash_jax.io.checkpoints import make_target

_S, _F = "sliding_attention", "full_attention"
_PROPORTIONAL = RopeConfig(1e6, "proportional", (("partial_rotary_factor", 0.25),))
GEMMA4_31B = Gemma4Config(
    arch="gemma4", vocab_size=262144, hidden_size=5376, intermediate_size=21504, num_layers=60, num_heads=32,
    num_kv_heads=16, head_dim=256, rms_norm_eps=1e-6, rope=RopeConfig(10_000.0), tie_word_embeddings=True,
    max_position_embeddings=262144, dtype="bfloat16", layer_types=((_S,) * 5 + (_F,)) * 10, sliding_window=1024,
    global_head_dim=512, num_global_kv_heads=4, full_rope=_PROPORTIONAL, attention_k_eq_v=True,
    final_logit_softcapping=30.0)
TINY = Gemma4Config(
    arch="gemma4", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=6, num_heads=4, num_kv_heads=2,
    head_dim=16, rms_norm_eps=1e-6, rope=RopeConfig(10_000.0), tie_word_embeddings=True, max_position_embeddings=4096,
    dtype="float32", layer_types=(_S, _S, _F) * 2, sliding_window=16, global_head_dim=32, num_global_kv_heads=1,
    full_rope=_PROPORTIONAL, attention_k_eq_v=True, final_logit_softcapping=30.0)
PROMPTS, TINY_PROMPTS = (512, 8192), (64,)
TARGETS = {"roofline_ratio": 0.80, "round_over_plain_step": 1.3}
SELF_LOGIT = 30.0
POST_NORM = 1 / 256


def planted_target(cfg: Gemma4Config, dtype):
    """`common.random_target` with the head untied, and the embedding, head and post-norms set as the module
    docstring says."""
    cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    target = common.random_target(cfg, dtype)
    scale = jnp.asarray(SELF_LOGIT / cfg.hidden_size, dtype)
    params = dict(target.params, embed=target.params["embed"] * scale, lm_head=target.params["lm_head"] * scale)
    for i in range(cfg.num_layers):
        layer = dict(params[f"layers_{i}"])
        for name in ("post_attn_norm", "post_mlp_norm"):
            layer[name] = layer[name] * jnp.asarray(POST_NORM, dtype)
        params[f"layers_{i}"] = layer
    return make_target(cfg, params)


def step_bytes(target, live_tokens: float, batch: int = 1) -> dict:
    """Bytes one plain decode step moves (module docstring), by kind."""
    c = target.config
    item = target.params["embed"].dtype.itemsize
    weights = common.target_step_bytes(target)
    kv = sum(2 * c.layer_kv_heads(i) * c.layer_head_dim(i) * item * batch
             * (live_tokens if c.is_full(i) else min(live_tokens, c.sliding_window))
             for i in range(c.first_shared_layer))
    return {"weights": weights, "kv": kv, "total": weights + kv}


def plot(payload: dict, path: str) -> None:
    """Round phases against the plain step, per prompt and sliding cache."""
    plt = common.pyplot()
    if plt is None:
        return
    cells = payload["cells"]
    fig, ax = plt.subplots(figsize=(3 + 1.5 * len(cells), 4))
    for i, m in enumerate(cells):
        common.phase_bars(ax, i, m["round"]["phases"], m["plain"]["step_s"])
    ax.set_xticks(range(len(cells)), [f"prompt {m['prompt']}\n{m['sliding_cache']}" for m in cells])
    ax.set_title(f"{payload['model']}: round phases vs plain step (ms)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None):
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--prompts", type=int, nargs="+", default=None, help=f"prompt lengths (default {PROMPTS})")
    pre.add_argument("--sliding-caches", nargs="+", default=list(policy.SLIDING_CACHES),
                     choices=policy.SLIDING_CACHES, help="kinds of sliding-layer cache to measure (default both)")
    ours, rest = pre.parse_known_args(argv)
    args = spec_round.parse_args(rest, __doc__, 6.5)
    args.prompts = ours.prompts or (TINY_PROMPTS if args.tiny else PROMPTS)
    cfg, name = (TINY, "tiny-gemma4") if args.tiny else (GEMMA4_31B, "gemma-4-31b")
    counter = acc.CompileCounter()
    bandwidth = common.hbm_read_bandwidth(common.TINY_PROBE_GIB if args.tiny else 4.0)
    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    target = planted_target(cfg, dtype)
    cfg = target.config
    drafter = common.random_drafter(common.drafter_config(cfg, 16, 2 if args.tiny else 5), dtype)
    payload = common.environment(**vars(args)) | {
        "model": name, "hbm_read_bytes_per_s": bandwidth, "targets": TARGETS,
        "config": {k: v for k, v in vars(cfg).items() if k not in ("rope", "full_rope", "layer_types")},
        "ring_slack": policy.RING_SLACK, "weight_bytes": common.nbytes(target.params), "cells": []}
    for kind, prompt in ((kind, prompt) for kind in ours.sliding_caches for prompt in args.prompts):
        rec = spec_round.measure_cell(target.replace(sliding_cache=kind), drafter, 1, prompt, args, counter)
        moved = step_bytes(target, prompt + args.new / 2)
        plain = rec["plain"] | {"bytes": moved, "roofline_s": moved["total"] / bandwidth}
        plain["roofline_ratio"] = plain["roofline_s"] / plain["step_s"]
        at_tau = rec["fused"][0]
        payload["cells"].append({
            "prompt": prompt, "sliding_cache": kind, "plain": plain, "round": rec,
            "headline": {"plain_tokens_per_s": plain["tokens_per_s"], "roofline_ratio": plain["roofline_ratio"],
                         "round_over_plain_step": rec["round_over_plain_step"],
                         "spec_tokens_per_s_at_tau": at_tau.get("tokens_per_s"), "tau": at_tau.get("tau_measured"),
                         "speedup_at_tau": at_tau.get("speedup"), "lossless": at_tau.get("lossless"),
                         "no_recompile": rec["no_recompile"]}})
        print(f"{name} prompt {prompt}, {kind} sliding cache: {payload['cells'][-1]['headline']}")
        path = common.write_json(f"gemma4{'_tiny' if args.tiny else ''}.json", payload, args.out)
        del rec
        gc.collect()
    plot(payload, path[:-len(".json")] + ".png")
    return payload


if __name__ == "__main__":
    main()
