"""Tensor parallel on two GPUs: a Llama-3.1-70B-shaped target (80 layers, hidden 8192, 64 heads, 8 KV heads, MLP
28672, vocabulary 128256; the rope is a plain one, which costs the same) with a 5-layer DFlash drafter, at batch 1
and 16, on a `tp=2` mesh; and Qwen3-8B on one and on two GPUs. Random bf16 weights (`common.random_target`'s
planted next-token map), placed by `dflash_jax.sharding`'s rules as they are made; prompt 512.

Per cell (`spec_round.measure_cell`):
  plain       tokens/s of the plain loop, and `roofline_ratio`: the bytes a step moves (every weight but the
              embedding, and the K/V at the mean live context) over `tp` times one GPU's measured HBM read
              bandwidth, divided by the measured step (each GPU reads its half of the weights and the cache)
  round       the fused loop at injected acceptance 6.5 (`speedup_at_tau`), the round's phases, and whether
              speculative decoding equals plain decoding on the mesh
  tp_speedup  Qwen3-8B's plain tokens/s on two GPUs over one
  replicated_drafter_round_over_sharded  the 70B's fused round at batch 1 with the drafter whole on both GPUs
              over the round with it sharded (below 1: replicate the small drafter)

`runs_recompiled` counts compiles of the timed loops after their warm-up (0: the fused loop keeps its state's
placement from call to call). On a mesh the separately jitted phases may recompile once (`no_recompile` false):
XLA lays a state leaf out differently at a step's output than `place_state` did at its input, so the second call of
a chained phase sees a new input sharding; the phase medians then hold no compile, the first call being dropped
only when `--phase-reps` > 1.

Not yet run on two H200s: no figures.

    python bench/sharded.py              # 2 x H200: writes bench/results/sharded.json
    python bench/sharded.py --tiny       # CPU smoke test on 2 virtual devices
"""
from __future__ import annotations

import os
import sys

if "--tiny" in sys.argv:  # the virtual devices must exist before JAX starts
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"

import dataclasses  # noqa: E402
import gc  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import acceptance as acc  # noqa: E402
import common  # noqa: E402
import spec_round  # noqa: E402
from dflash_jax import sharding  # noqa: E402
from dflash_jax.config import RopeConfig, TargetConfig  # noqa: E402

LLAMA_70B = TargetConfig(arch="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
                         num_heads=64, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope=RopeConfig(5e5),
                         max_position_embeddings=131072, dtype="bfloat16")
CELLS = [("llama-3.1-70b", LLAMA_70B, 2, (1, 16), False), ("llama-3.1-70b", LLAMA_70B, 2, (1,), True),
         ("qwen3-8b", common.QWEN3_8B, 1, (1,), False), ("qwen3-8b", common.QWEN3_8B, 2, (1,), False)]
"""(model, config, tensor-parallel GPUs, batches, whether the drafter is replicated instead of sharded)."""
TINY_CELLS = [("tiny", common.TINY, 1, (1,), False), ("tiny", common.TINY, 2, (1,), False),
              ("tiny", common.TINY, 2, (1,), True)]


def step_bytes(target, live_tokens: float, batch: int) -> dict:
    """Bytes one plain decode step moves over all devices: the weights it reads and the K/V it attends over."""
    weights = common.target_step_bytes(target)
    kv = common.kv_bytes(target.config, live_tokens, batch, target.params["embed"].dtype.itemsize)
    return {"weights": weights, "kv": kv, "total": weights + kv}


def measure(name: str, cfg: TargetConfig, tp: int, batch: int, replicated: bool, args, counter,
            bandwidth: float) -> dict:
    mesh = sharding.make_mesh(tp=tp, devices=jax.devices()[:tp]) if tp > 1 else None  # one GPU: as loaded
    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    target = common.random_target(cfg, dtype, mesh=mesh)
    drafter = common.random_drafter(common.drafter_config(cfg, 16, 2 if args.tiny else 5), dtype, mesh=mesh,
                                    replicated=replicated)
    rec = spec_round.measure_cell(target, drafter, batch, args.prompts[0], args, counter)
    moved = step_bytes(target, args.prompts[0] + args.new / 2, batch)
    roofline_s = moved["total"] / (tp * bandwidth)
    at_tau = rec["fused"][0]
    out = {"model": name, "tp": tp, "batch": batch, "drafter": "replicated" if replicated else "sharded",
           "bytes": moved, "roofline_s": roofline_s,
           "plain_tokens_per_s": rec["plain"]["tokens_per_s"], "plain_step_s": rec["plain"]["step_s"],
           "roofline_ratio": roofline_s / rec["plain"]["step_s"], "round_over_plain_step": rec["round_over_plain_step"],
           "tau": at_tau.get("tau_measured"), "speedup_at_tau": at_tau.get("speedup"),
           "lossless": rec["real_drafter"]["lossless"] and all(c["lossless"] for c in rec["fused"]),
           "runs_recompiled": rec["compiles"]["after_warmup_runs"]["count"], "no_recompile": rec["no_recompile"],
           "round": rec}
    print(f"{name} tp={tp} batch={batch} drafter {out['drafter']}: "
          f"{({k: v for k, v in out.items() if k not in ('round', 'bytes')})}")
    del target, drafter
    gc.collect()
    return out


def main(argv=None):
    args = spec_round.parse_args(argv, __doc__, 6.5)
    cells = TINY_CELLS if args.tiny else CELLS
    need = max(tp for _, _, tp, _, _ in cells)
    if len(jax.devices()) < need:
        raise SystemExit(f"bench/sharded.py needs {need} devices; found {len(jax.devices())}")
    counter = acc.CompileCounter()
    bandwidth = common.hbm_read_bandwidth(common.TINY_PROBE_GIB if args.tiny else 4.0)
    payload = common.environment(**vars(args)) | {"devices": len(jax.devices()), "hbm_read_bytes_per_s": bandwidth,
                                                  "cells": []}
    payload["configs"] = {name: {k: v for k, v in dataclasses.asdict(cfg).items() if k != "rope"}
                          for name, cfg, _, _, _ in cells}
    for name, cfg, tp, batches, replicated in cells:
        payload["cells"] += [measure(name, cfg, tp, b, replicated, args, counter, bandwidth) for b in batches]
    by = {(c["model"], c["tp"], c["batch"], c["drafter"]): c for c in payload["cells"]}
    small, big = ("tiny", "tiny") if args.tiny else ("qwen3-8b", "llama-3.1-70b")
    payload["tp_speedup"] = (by[(small, 2, 1, "sharded")]["plain_tokens_per_s"]
                             / by[(small, 1, 1, "sharded")]["plain_tokens_per_s"])
    payload["replicated_drafter_round_over_sharded"] = (by[(big, 2, 1, "replicated")]["round"]["round_s"]
                                                         / by[(big, 2, 1, "sharded")]["round"]["round_s"])
    common.write_json(f"sharded{'_tiny' if args.tiny else ''}.json", payload, args.out)
    return payload


if __name__ == "__main__":
    main()
