"""A DFlash2 round against a DFlash round of the same depth, over one target of the DFlash2 checkpoint's shape.

The target is random bf16 with the shape the published DFlash2 drafter serves (tests/fixtures/dflash2-config.json):
hidden 6656, 52 layers, vocabulary 202,048, 32 query heads and 8 KV heads of 128 (attention width 4096), SwiGLU
19,968. The DFlash2 drafter is that checkpoint's census (5 sliding layers, window 2048, non-causal, block 16,
dynamic convolutions of kernel 2 over groups of 16, selector rank 256 over the top 16); the DFlash drafter has the
same depth, shapes and taps without them. Each runs `spec_round.measure_cell`: its phases alone (draft, verify,
commit + ingest), the fused round on its own proposals, the plain step, and the speedup at injected acceptance
`--taus`. `comparison` holds the DFlash2 / DFlash ratios measured in the same run.

    python bench/dflash2_round.py           # H200: batch 1, prompt 512
    python bench/dflash2_round.py --tiny    # CPU smoke test
"""
from __future__ import annotations

import dataclasses
import json
import os

import jax.numpy as jnp

import acceptance as acc
import common
import spec_round
from dflash_jax.config import RopeConfig, TargetConfig, drafter_census

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures",
                       "dflash2-config.json")
TARGET_30B = TargetConfig(arch="qwen3", vocab_size=202048, hidden_size=6656, intermediate_size=19968, num_layers=52,
                          num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope=RopeConfig(5e5),
                          max_position_embeddings=131072, dtype="bfloat16")


def drafter_configs(target: TargetConfig, tiny: bool) -> dict:
    """{'dflash': ..., 'dflash2': ...}: the fixture's DFlash2 census (tiny: the same layout at the tiny target's
    sizes) and a DFlash drafter of the same depth, shapes and taps."""
    with open(FIXTURE) as f:
        d = json.load(f)
    if tiny:
        d.update(hidden_size=target.hidden_size, intermediate_size=target.intermediate_size, num_hidden_layers=2,
                 num_attention_heads=target.num_heads, num_key_value_heads=target.num_kv_heads,
                 head_dim=target.head_dim, vocab_size=target.vocab_size, num_target_layers=target.num_layers,
                 layer_types=["sliding_attention"] * 2, sliding_window=64)
        d["dflash_config"].update(target_layer_ids=[0, target.num_layers - 1], mask_token_id=target.vocab_size - 1,
                                  selector_rank=8, selector_top_k=4)
    d2 = drafter_census(d, target=target, env={})
    plain = dataclasses.replace(d2, family="dflash", selector_rank=None, selector_top_k=None, conv_kernel_size=None,
                                conv_group_size=None, output_multiplier=1.0, final_logit_softcapping=None)
    return {"dflash": plain, "dflash2": d2}


def main(argv=None):
    args = spec_round.parse_args(argv, __doc__, 6.5)
    counter = acc.CompileCounter()
    tcfg, dtype = (common.TINY, jnp.float32) if args.tiny else (TARGET_30B, jnp.bfloat16)
    target = common.random_target(tcfg, dtype)
    payload = common.environment(**vars(args)) | {
        "model": "tiny, random float32" if args.tiny else "DFlash2 fixture's target shape, random bf16",
        "target": {k: getattr(tcfg, k) for k in ("hidden_size", "num_layers", "vocab_size", "intermediate_size",
                                                 "num_heads", "num_kv_heads", "head_dim")},
        "weight_bytes": common.target_step_bytes(target), "cells": {}}
    for family, cfg in drafter_configs(tcfg, args.tiny).items():
        drafter = common.random_drafter(cfg, dtype)
        payload["drafter_bytes_" + family] = common.nbytes(drafter.params)
        cells = [spec_round.measure_cell(target, drafter, b, p, args, counter)
                 for b, p in acc.grid_cells(args.batches, args.prompts)]
        payload["cells"][family] = cells
        del drafter
    pairs = zip(payload["cells"]["dflash"], payload["cells"]["dflash2"])
    payload["comparison"] = [{
        "batch": a["batch"], "prompt": a["prompt"],
        "draft_ms": {"dflash": 1e3 * a["phases"]["draft_s"], "dflash2": 1e3 * b["phases"]["draft_s"]},
        "round_ms": {"dflash": 1e3 * a["round_s"], "dflash2": 1e3 * b["round_s"]},
        "plain_step_ms": 1e3 * a["plain_step_s"],
        "dflash2_over_dflash": {"draft": b["phases"]["draft_s"] / a["phases"]["draft_s"],
                                "round": b["round_s"] / a["round_s"]},
        "round_over_plain_step": {"dflash": a["round_over_plain_step"], "dflash2": b["round_over_plain_step"]},
        "speedup_at_tau": {"dflash": {str(f["tau"]): f["speedup"] for f in a["fused"]},
                           "dflash2": {str(f["tau"]): f["speedup"] for f in b["fused"]}},
        "lossless": a["real_drafter"]["lossless"] and b["real_drafter"]["lossless"],
    } for a, b in pairs]
    for c in payload["comparison"]:
        print(f"b={c['batch']} p={c['prompt']}: draft {c['draft_ms']['dflash']:.3f} -> {c['draft_ms']['dflash2']:.3f} ms"
              f" (x{c['dflash2_over_dflash']['draft']:.3f}), round {c['round_ms']['dflash']:.3f} -> "
              f"{c['round_ms']['dflash2']:.3f} ms (x{c['dflash2_over_dflash']['round']:.3f}), plain step "
              f"{c['plain_step_ms']:.3f} ms, speedups {c['speedup_at_tau']}")
    common.write_json(f"dflash2_round{'_tiny' if args.tiny else ''}.json", payload, args.out)
    return payload


if __name__ == "__main__":
    main()
