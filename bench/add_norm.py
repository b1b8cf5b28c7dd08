"""The residual add fused with RMSNorm (`pallas_kernels.add_norm`, DFLASH_FUSED_NORM=1) against XLA's separate
ops, in one process on the same weights (issue 16, item 1: a change must pay in the target's plain step, its
16-row verify and the drafter). Per setting, `spec_round.measure_cell` at batch 1, prompt 512: the plain step
and its ratio to the copy roofline, the round's draft and verify phases, the fused round over the plain step,
the speedup at the injected acceptance, and whether every speculative run was lossless.

    python bench/add_norm.py                  # H200, Qwen3-8B shape, the z-lab drafter shape
    python bench/add_norm.py --tiny           # CPU smoke test (XLA attention: both settings run the reference)
"""
from __future__ import annotations

import os

import jax

import acceptance as acc
import common
import spec_round

SETTINGS = {"fused": "1", "unfused": "0"}
"""DFLASH_FUSED_NORM of each setting (`policy.fused_norm_impl`, read when a pass is traced)."""
TAU = 6.5


def main(argv=None):
    args = spec_round.parse_args(argv, __doc__, TAU)
    counter = acc.CompileCounter()
    target, drafter = acc.models(args.tiny)
    prompt = args.prompts[0]
    bw = common.hbm_bandwidth(common.TINY_PROBE_GIB if args.tiny else 4.0)
    step_bytes = common.target_step_bytes(target) + common.kv_bytes(target.config, prompt + args.new / 2)
    cells, before = {}, os.environ.get("DFLASH_FUSED_NORM")
    for name, switch in SETTINGS.items():
        os.environ["DFLASH_FUSED_NORM"] = switch
        jax.clear_caches()  # every program is traced again, under the switch
        rec = spec_round.measure_cell(target, drafter, 1, prompt, args, counter)
        run = min(rec["fused"], key=lambda r: abs(r["tau"] - TAU))
        cells[name] = {
            "plain_step_s": rec["plain_step_s"], "roofline_ratio": step_bytes / bw / rec["plain_step_s"],
            "draft_s": rec["phases"]["draft_s"], "verify_s": rec["phases"]["verify_s"], "round_s": rec["round_s"],
            "round_over_plain_step": rec["round_over_plain_step"], "tau_measured": run["tau_measured"],
            "speedup": run["speedup"], "no_recompile": rec["no_recompile"],
            "lossless": all(r["lossless"] for r in rec["fused"]) and rec["real_drafter"]["lossless"]}
        print(f"{name}: {cells[name]}", flush=True)
    if before is None:
        os.environ.pop("DFLASH_FUSED_NORM")
    else:
        os.environ["DFLASH_FUSED_NORM"] = before
    payload = common.environment(**vars(args)) | acc.describe(target, drafter, args.tiny) | {
        "batch": 1, "prompt": prompt, "hbm_bandwidth_Bps": bw, "step_bytes": step_bytes, "cells": cells,
        "fused_over_unfused_plain_tokens_per_s": cells["unfused"]["plain_step_s"] / cells["fused"]["plain_step_s"],
        "fused_over_unfused_round_s": cells["fused"]["round_s"] / cells["unfused"]["round_s"]}
    common.write_json(f"add_norm{'_tiny' if args.tiny else ''}.json", payload, args.out)
    return payload


if __name__ == "__main__":
    main()
