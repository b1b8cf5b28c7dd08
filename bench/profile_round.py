"""Where a plain step's and a speculative round's device time goes, kernel by kernel.

Runs the compiled plain loop and the fused speculative loop, with injected proposals at a fixed
acceptance (the real drafter still running) and with the random drafter's own proposals
(`spec_round_real`: about one token a round, so the call's fixed start-up cost is spread over
six times more rounds), once each under `jax.profiler.trace`, reads the Perfetto trace it
writes, and sums the device events (GPU kernels and copies; on a CPU, the host's events of
HLO ops) per name. Per step (plain) or per round (speculative) it reports:

  wall_us  loop wall time / steps or rounds
  busy_us  union of the device events' intervals / steps or rounds
  idle_us  wall - busy: launch gaps and host work the device waits on (the profiler inflates
           both wall and idle; busy matches the unprofiled times)
  kernels  launched per step or round
  top      the `--top` names by time: calls and microseconds per step or round, share of busy
  kinds    the same, names grouped by kind (trailing numbers dropped: the unrolled layers'
           `fusion.12`, `fusion.47` are one kind)
  source   "device" (GPU kernels from CUPTI) or "host" (HLO ops run on the host: a CPU, or no CUPTI)

The gap between `busy` and the weight bytes over bandwidth says how much a step loses to
small kernels, and `top` says which ones.

    python bench/profile_round.py [--tiny] [--out DIR]     # writes profile_round.json
    python bench/profile_round.py --keep DIR                # also the traces and compiled HLO
    python bench/profile_round.py --model qwen3.5-9b        # a hybrid target of bench/hybrid.py: profile_round_qwen3.5-9b.json
    python bench/profile_round.py --precision int8          # the target's weights quantised: profile_round_int8.json
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import shutil
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import acceptance as acc
import common
import hybrid
from dflash_jax import quant
from dflash_jax.config import policy
from dflash_jax.decoding import plain
from dflash_jax.decoding import speculative as spec
from pallas_kernels import windowed_attention as wa

CONTAINERS = re.compile(r"(while|conditional|call)([._]\d+)*$")  # host events that wrap other ops' events


def device_events(trace: dict) -> tuple:
    """`(events, source)`: the complete ('X') events of the device processes ("device"), or,
    where the trace has none (a CPU, or a GPU without CUPTI), the host's events of HLO ops
    ("host": those naming an `hlo_op`, on whichever thread XLA ran them, minus the loops and
    calls that wrap the others)."""
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    device = [e for e in events if names.get(e["pid"], "").startswith("/device:")]
    if device:
        return device, "device"
    return [e for e in events if "hlo_op" in e.get("args", {}) and not CONTAINERS.match(e["name"])], "host"


def busy_us(events: list) -> float:
    """Length of the union of the events' [ts, ts + dur) intervals, microseconds."""
    total, end = 0.0, -np.inf
    for start, stop in sorted((e["ts"], e["ts"] + e["dur"]) for e in events):
        if start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def kind(name: str) -> str:
    """A kernel name without its trailing instance numbers (`loop_add_fusion.12` -> `loop_add_fusion`)."""
    return re.sub(r"([._]\d+)+$", "", name)


def ranked(events: list, key, units: int, busy: float, top: int) -> list:
    """The `top` groups of `events` by `key(name)`: calls and microseconds per unit, share of busy."""
    groups = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        g = groups[key(e["name"])]
        g[0] += 1
        g[1] += e["dur"]
    best = sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]
    return [{"name": n[:160], "calls": c / units, "us": t / units, "share_of_busy": t / units / busy}
            for n, (c, t) in best]


def summarize(found: tuple, wall_s: float, units: int, top: int) -> dict:
    events, source = found
    busy = busy_us(events) / units
    return {"source": source, "units": units, "wall_us": wall_s * 1e6 / units, "busy_us": busy,
            "idle_us": wall_s * 1e6 / units - busy, "kernels": len(events) / units,
            "top": ranked(events, lambda n: n, units, busy, top), "kinds": ranked(events, kind, units, busy, top)}


def traced(fn, log_dir: str):
    """`(result, wall seconds, trace dict)` of `fn()` run under the profiler."""
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        t0 = time.perf_counter()
        result = fn()
        wall = time.perf_counter() - t0
    path = sorted(glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "perfetto_trace.json.gz")))[-1]
    with gzip.open(path) as f:
        return result, wall, json.load(f)


def keep(dest: str, log_dir: str, cell: acc.Cell, reference: np.ndarray, probs: np.ndarray) -> None:
    """Copy the traces under `log_dir` to `dest` and write the plain and speculative loops'
    compiled HLO text beside them (the trace's kernel names are the HLO's fusion names)."""
    os.makedirs(dest, exist_ok=True)
    for path in glob.glob(os.path.join(log_dir, "*", "plugins", "profile", "*", "perfetto_trace.json.gz")):
        shutil.copy(path, os.path.join(dest, path[len(log_dir) + 1:].split(os.sep)[0] + ".perfetto_trace.json.gz"))
    programs = {"plain": plain.run.lower(cell.plain_loop(), cell.target, cell.plain_state(), cell.stop_tokens),
                "spec": spec.run.lower(cell.loop, cell.target, cell.drafter,
                                       cell.spec_state(cell.injected(reference, probs)), cell.stop_tokens)}
    for name, lowered in programs.items():
        with open(os.path.join(dest, f"{name}.hlo.txt"), "w") as f:
            f.write(lowered.compile().as_text())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--tau", type=float, default=6.0, help="injected acceptance length (integer: every round alike)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--impl", default=None, choices=["xla", "pallas"], help="default: pallas on GPU")
    ap.add_argument("--tiny", action="store_true", help="tiny float32 model on the CPU: tests the script")
    ap.add_argument("--model", default="qwen3-8b", choices=["qwen3-8b", *hybrid.MODELS],
                    help="the target's shape (random bf16); hybrids as in bench/hybrid.py, with the 5-layer drafter")
    ap.add_argument("--precision", default="bf16", choices=list(policy.PRECISIONS),
                    help="the target's weight precision (quantised on the device; the drafter stays bf16)")
    ap.add_argument("--scatter", action="store_true",
                    help="the target writes the block's K/V with write_rows after attention, not from inside the "
                         "kernel (WRITE_IN_KERNEL off): profile_round_scatter.json")
    ap.add_argument("--out", default=None)
    ap.add_argument("--keep", default=None, metavar="DIR",
                    help="also copy the Perfetto traces and write the loops' compiled HLO text here")
    args = ap.parse_args(argv)
    impl = policy.attention_impl(args.impl)
    wa.WRITE_IN_KERNEL = not args.scatter
    prompt, new = (32, 32) if args.tiny else (args.prompt, args.new)
    if args.model == "qwen3-8b" or args.tiny:
        target, drafter = acc.models(args.tiny)
    else:
        cfg = hybrid.MODELS[args.model]
        target, drafter = common.random_target(cfg), common.random_drafter(common.drafter_config(cfg, 16, 5))
    if args.precision != "bf16":
        target = target.replace(params=quant.quantize_params(target.params, args.precision, xp=jnp))
    cell = acc.open_cell(target, drafter, args.batch, prompt, new, impl, "synthetic")
    reference, _, _ = cell.run_plain()
    probs = acc.first_wrong_probs(args.tau, cell.nd)
    cell.run_spec(cell.injected(reference, probs))  # compiles, as run_plain did; each run donates its proposals
    cell.run_spec(None)
    cell.run_plain()
    with tempfile.TemporaryDirectory() as tmp:
        (_, plain_wall, steps), _, plain_trace = traced(cell.run_plain, os.path.join(tmp, "plain"))
        run, spec_wall, spec_trace = traced(lambda: cell.run_spec(cell.injected(reference, probs)),
                                           os.path.join(tmp, "spec"))
        real, real_wall, real_trace = traced(lambda: cell.run_spec(None), os.path.join(tmp, "real"))
        if args.keep:
            keep(args.keep, tmp, cell, reference, probs)
    plain = summarize(device_events(plain_trace), plain_wall, steps, args.top)
    spec_inj = summarize(device_events(spec_trace), spec_wall, int(np.max(run.stats.rounds)), args.top)
    spec_real = summarize(device_events(real_trace), real_wall, int(np.max(real.stats.rounds)), args.top)
    payload = common.environment(batch=args.batch, prompt=prompt, new=new, tau=args.tau, impl=impl, tiny=args.tiny,
                                 model=args.model, precision=args.precision,
                                 write_in_kernel=wa.WRITE_IN_KERNEL)
    payload.update(weight_bytes=common.target_step_bytes(target), drafter_bytes=common.nbytes(drafter.params),
                   plain_step=plain, spec_round=spec_inj, spec_round_real=spec_real,
                   round_over_step_busy=spec_inj["busy_us"] / plain["busy_us"])
    for label, s in (("plain step", plain), ("spec round (injected)", spec_inj), ("spec round (real drafter)", spec_real)):
        print(f"{label}: wall {s['wall_us']:.0f} us, busy {s['busy_us']:.0f} us, idle {s['idle_us']:.0f} us, "
              f"{s['kernels']:.0f} kernels")
        for k in s["top"][:10]:
            print(f"   {k['us']:8.1f} us  {k['calls']:6.1f}x  {k['share_of_busy']:5.1%}  {k['name'][:90]}")
    name = "profile_round" + ("_tiny" if args.tiny else "" if args.model == "qwen3-8b" else f"_{args.model}")
    name += "" if args.precision == "bf16" else f"_{args.precision}"
    name += "_scatter" if args.scatter else ""
    common.write_json(f"{name}.json", payload, args.out)


if __name__ == "__main__":
    main()
