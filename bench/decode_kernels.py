"""The hybrid targets' decode-step kernel switches, each alone, on the plain decode step (GPU).

`moe.ROUTE_IMPL` ("pallas": the Triton routing kernel; "mosaic": its Mosaic GPU port) and `gdn.STEP_KERNEL` are read
when a program is traced. The plain decode loop (`decoding.plain.run`, `--new` tokens after a prompt of `--prompt`)
is compiled ahead of time once per setting: all off, each switch alone, all on (with the Triton routing kernel).
Then the settings are timed in turn, `--passes` times over, each run from a fresh copy of the same prefilled state,
so drift between passes hits every setting alike. `step_s` is the loop's median seconds over its `new - 1` steps;
`roofline_ratio` as `bench/hybrid.py` (bytes a step moves over the run's HBM read bandwidth); `over_off` the
setting's step over the all-off step.
A switch that has no layer to act on (no MoE layer) is not timed.

    python bench/decode_kernels.py                          # H200: writes bench/results/decode_kernels.json
    python bench/decode_kernels.py --models qwen3.5-9b      # one model
    python bench/decode_kernels.py --tiny                   # CPU smoke test (no kernel runs on a CPU)
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import common
import hybrid
from dflash_jax import sampling as smp
from dflash_jax.decoding import plain
from dflash_jax.decoding.common import pack_prompts, stop_array
from dflash_jax.targets import gdn, moe

SWITCHES = {"route": (moe, "ROUTE_IMPL", "pallas"), "route_mosaic": (moe, "ROUTE_IMPL", "mosaic"),
            "delta_step": (gdn, "STEP_KERNEL", True)}
"""Name -> (module, attribute, its value when on). Two more, each timed here and removed when it gained nothing:
`expert_matmul`'s on-chip repeat of one-row groups (2026-12-06), and the MoE block's shared expert run as one more
group of the expert products (2026-12-07, `bench/results/decode_kernels_shared_group_h100.json`)."""
OFF = {"ROUTE_IMPL": "xla", "STEP_KERNEL": False}
MOE_ONLY = ("route", "route_mosaic")


def settings(cfg) -> dict:
    """Setting name -> the switches it turns on: all off, each switch that has layers to act on, all on (one routing
    kernel: the Triton one)."""
    live = [s for s in SWITCHES if any(cfg.moe_layers) or s not in MOE_ONLY]
    out = {"off": ()} | {s: (s,) for s in live}
    every = tuple(s for s in live if s != "route_mosaic")
    return out | ({"all": every} if len(every) > 1 else {})


def set_switches(on) -> None:
    for module, attr, _ in SWITCHES.values():
        setattr(module, attr, OFF[attr])
    for name in on:
        module, attr, value = SWITCHES[name]
        setattr(module, attr, value)


def snapshot() -> list:
    """Every switch's attribute as it is now, to put back."""
    return [(module, attr, getattr(module, attr)) for module, attr, _ in SWITCHES.values()]


def truncated(cfg, layers: int | None):
    """`cfg` with its first `layers` layers (a card too small for the whole model), or `cfg` itself."""
    if not layers or layers >= cfg.num_layers:
        return cfg
    return dataclasses.replace(cfg, num_layers=layers, layer_types=cfg.layer_types[:layers],
                               moe_layers=cfg.moe_layers[:layers])


def measure(target, prompt: int, new: int, impl: str, passes: int) -> dict:
    """Each setting's compiled decode loop, timed in turn over `passes` passes (module docstring)."""
    cfg, defaults = target.config, snapshot()
    tokens = np.random.RandomState(0).randint(0, cfg.vocab_size - 2, (1, prompt))
    p = pack_prompts(tokens, cfg.vocab_size, None, None)
    loop = plain.PlainLoop(new, p.chunk, True, False, impl)
    rp, stops = smp.row_params([smp.Sampling()], 1), stop_array((), cfg.vocab_size)
    set_switches(())
    s0 = jax.block_until_ready(plain.start(loop, target, jnp.asarray(p.tokens), jnp.asarray(p.lengths),
                                           target.init_state(1, prompt + new), rp, stops))
    compiled, compile_s, switched = {}, {}, settings(cfg)
    for name, on in switched.items():
        set_switches(on)
        jax.clear_caches()
        t0 = time.perf_counter()
        compiled[name] = plain.run.lower(loop, target, s0, stops).compile()
        compile_s[name] = time.perf_counter() - t0
        print(f"compiled {name} in {compile_s[name]:.1f} s", flush=True)
    for module, attr, value in defaults:
        setattr(module, attr, value)
    jax.clear_caches()
    times = {name: [] for name in compiled}
    outputs = {}
    for _ in range(passes + 1):  # the first pass warms every program up and is not kept
        for name, run in compiled.items():
            s = jax.block_until_ready(jax.tree.map(jnp.copy, s0))
            t0 = time.perf_counter()
            out = jax.block_until_ready(run(target, s, stops))
            times[name].append(time.perf_counter() - t0)
            outputs[name] = np.asarray(out.out[0, :int(out.n_out[0])])
    cells = {name: {"on": list(switched[name]), "step_s": statistics.median(t[1:]) / (new - 1),
                    "pass_steps_s": [x / (new - 1) for x in t[1:]], "compile_s": compile_s[name],
                    "same_tokens_as_off": bool(np.array_equal(outputs[name], outputs["off"]))}
             for name, t in times.items()}
    for c in cells.values():
        c["over_off"] = c["step_s"] / cells["off"]["step_s"]
    return cells


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny random model (CPU smoke test)")
    ap.add_argument("--models", nargs="+", default=["qwen3.5-35b-a3b", "qwen3.5-9b"], choices=list(hybrid.MODELS))
    ap.add_argument("--layers", type=int, default=None, help="keep the first N layers (a card too small)")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--out", default=None, help="folder for the JSON (default bench/results)")
    args = ap.parse_args(argv)
    if args.new < 2 or args.passes < 1:
        ap.error("--new must be >= 2 and --passes >= 1")
    models = hybrid.TINY if args.tiny else {name: truncated(hybrid.MODELS[name], args.layers) for name in args.models}
    bandwidth = common.hbm_read_bandwidth(common.TINY_PROBE_GIB if args.tiny else 4.0)
    payload = common.environment(**vars(args)) | {"hbm_read_bytes_per_s": bandwidth, "models": {}}
    for name, cfg in models.items():
        target = common.random_target(cfg, jnp.float32 if args.tiny else jnp.bfloat16)
        cells = measure(target, args.prompt, args.new, "xla" if args.tiny else "pallas", args.passes)
        moved = hybrid.step_bytes(target, args.prompt + args.new / 2)
        for c in cells.values():
            c["roofline_ratio"] = moved["total"] / bandwidth / c["step_s"]
        payload["models"][name] = {"layers": cfg.num_layers, "bytes": moved, "cells": cells}
        for s, c in cells.items():
            print(f"{name} {s}: {c['step_s'] * 1e3:.3f} ms ({c['over_off']:.3f} of off), "
                  f"roofline {c['roofline_ratio']:.3f}, same tokens {c['same_tokens_as_off']}", flush=True)
        del target
        gc.collect()
        common.write_json(f"decode_kernels{'_tiny' if args.tiny else ''}.json", payload, args.out)
    return payload


if __name__ == "__main__":
    main()
