"""The latest measured value of each performance target, from the JSON in a results folder.

Writes `summary.json` (`summary_tiny.json` with `--tiny`) with the keys of `TARGETS`: plain_roofline_ratio,
round_over_plain_step, speedup_at_tau_6_5, loop_overhead, speedup_over_static_peer, speedup_at_tau_6_5_batch_64
(the sweep's batch 64 x prompt 512 cell), fixed_cost_per_call_s and the sampled rounds over greedy ones at batch 1
and 8, with one-hot and dense q (call_cost.py's cells), and prefill_share_of_peak (prefill.py). Also device,
jax_version, date, the source file of each number, and the run checks (compiles after warm-up, lossless, skipped
cells, whether injected proposals let XLA drop the drafter, plain decoding over the stricter read-only roofline);
prints target vs measured. A missing source leaves its value null.

    python bench/summary.py                     # reads and writes bench/results
    python bench/summary.py --out DIR --strict  # exit status 1 if any run compiled after its warm-up
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import common

# key, source, reader, comparison, target (README's benchmark table gives the same), what it is
TARGETS = (
    ("plain_roofline_ratio", "plain_decode", lambda d: d["roofline_ratio"], ">=", 0.85,
     "plain decoding tokens/s over the memory roofline"),
    ("round_over_plain_step", "spec_round", lambda d: d["headline"]["round_over_plain_step"], "<=", 1.20,
     "fused speculative round over one plain decode step (block 16)"),
    ("speedup_at_tau_6_5", "acceptance", lambda d: d["headline"]["speedup_at_tau_6_5"], ">=", 5.2,
     "speedup over plain at acceptance length 6.5"),
    ("loop_overhead", "spec_round", lambda d: d["headline"]["loop_overhead"], "<=", 0.05,
     "fused round over the sum of its phases, minus 1"),
    ("speedup_over_static_peer", "plain_decode", lambda d: d["speedup_over_static_peer"], ">=", 1.85,
     "plain tokens/s over transformers' static-cache generate on the same weights (warmed up with the timed shapes)"),
    ("speedup_at_tau_6_5_batch_64", "sweep",
     lambda d: next((r["speedup"] for r in d["table"] if (r["batch"], r["prompt"]) == (64, 512)), None), ">=", 2.0,
     "speedup over plain at acceptance length 6.5, batch 64, prompt 512 (a compute-bound verify)"),
    ("fixed_cost_per_call_s", "call_cost", lambda d: d["fixed_cost_per_call_s"], "<=", 1e-3,
     "seconds a call of the compiled speculative loop (Session.burst) costs beyond its rounds"),
    ("sampled_round_over_greedy_b1", "call_cost", lambda d: _ratio(d, 1, "sampled"), "<=", 1.05,
     "a round at T 0.7, top-p 0.9, top-k 50 over a greedy round, batch 1"),
    ("sampled_round_over_greedy_b8", "call_cost", lambda d: _ratio(d, 8, "sampled"), "<=", 1.05,
     "the same at batch 8"),
    ("dense_q_round_over_greedy_b1", "call_cost", lambda d: _ratio(d, 1, "sampled_dense"), "<=", 1.10,
     "a round at the same sampling with proposal='sample' (dense q) over a greedy round, batch 1"),
    ("dense_q_round_over_greedy_b8", "call_cost", lambda d: _ratio(d, 8, "sampled_dense"), "<=", 1.10,
     "the same at batch 8"),
    ("prefill_share_of_peak", "prefill", lambda d: d["share_of_stated_peak"], ">=", 0.60,
     "a 32,000-token prompt's prefill, weight FLOPs per second over ~789 TFLOP/s (bf16 on the H200)"),
)
SOURCES = ("plain_decode", "spec_round", "acceptance", "sweep", "call_cost", "prefill")


def _ratio(d: dict, batch: int, sampling: str):
    """call_cost.json's `round_over_greedy` of the cell `batch` x `sampling` with the package's filter (None if it
    did not run)."""
    default = d.get("default_filter")
    return next((c["round_over_greedy"] for c in d["cells"] if (c["batch"], c["sampling"]) == (batch, sampling)
                 and c.get("filter", default) == default),
                None)


def _load(folder: str, name: str, tiny: bool):
    path = os.path.join(folder, f"{name}{'_tiny' if tiny else ''}.json")
    if not os.path.exists(path):
        return None, path
    with open(path) as f:
        return json.load(f), path


def _measured_at(name: str, d: dict) -> dict:
    if name == "plain_decode":
        return {k: d["settings"].get(k) for k in ("batch", "prompt", "new", "impl")}
    head = d.get("headline") or {}
    return {k: head.get(k) for k in ("batch", "prompt", "tau", "tau_measured") if k in head}


def summarize(folder: str, tiny: bool) -> dict:
    data = {name: _load(folder, name, tiny) for name in SOURCES}
    out, targets, sources = {}, {}, {}
    for key, name, read, op, goal, what in TARGETS:
        d, path = data[name]
        try:
            value = float(read(d)) if d is not None else None
        except (KeyError, TypeError):
            value = None
        met = None if value is None else (value >= goal if op == ">=" else value <= goal)
        out[key] = value
        sources[key] = os.path.basename(path)
        targets[key] = {"target": f"{op} {goal}", "measured": value, "met": met, "what": what,
                        "source": os.path.basename(path), "source_date": d and d.get("date"),
                        "measured_at": _measured_at(name, d) if d else None}
    present = [d for d, _ in data.values() if d is not None]
    first = present[0] if present else {}
    checks = {"no_recompile": {}, "lossless": {}, "skipped_cells": [], "drafter_dropped_with_inject": None}
    for name, (d, path) in data.items():
        if d is None or name == "plain_decode":
            continue
        base = os.path.basename(path)
        checks["no_recompile"][base] = d.get("no_recompile")
        runs = [r for c in d.get("cells", []) for r in c.get("runs", []) + c.get("fused", [])]
        if runs:  # a file with speculative runs (call_cost's bursts are not compared)
            checks["lossless"][base] = all(r["lossless"] for r in runs)
        for c in d.get("cells", []):
            if c.get("status") not in (None, "ok"):
                checks["skipped_cells"].append({"file": base, "batch": c["batch"], "prompt": c["prompt"],
                                                "reason": c.get("reason")})
    # the stricter roofline (read-only bandwidth), where the plain run measured it; no target
    checks["plain_roofline_ratio_read"] = (data["plain_decode"][0] or {}).get("roofline_ratio_read")
    rounds = (data["spec_round"][0] or {}).get("cells", [])
    if rounds:
        checks["drafter_dropped_with_inject"] = any(c["phases"]["drafter_dropped_with_inject"] for c in rounds)
    devices = sorted({d.get("device") for d in present})
    return out | {
        "device": first.get("device"), "devices_seen": devices, "jax_version": first.get("jax_version"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "sources": sources, "targets": targets, "checks": checks,
        "all_targets_met": None if any(t["met"] is None for t in targets.values())
        else all(t["met"] for t in targets.values()),
    }


def print_table(s: dict) -> None:
    width = max(map(len, s["targets"]))
    print(f"{'target':<{width}} {'goal':>8} {'measured':>10}  met   source")
    for key, t in s["targets"].items():
        m = "-" if t["measured"] is None else f"{t['measured']:.3f}"
        met = {True: "yes", False: "NO", None: "-"}[t["met"]]
        print(f"{key:<{width}} {t['target']:>8} {m:>10}  {met:<4}  {t['source']}")
    c = s["checks"]
    print(f"no recompile after warm-up: {c['no_recompile']}")
    print(f"lossless (speculative == plain tokens): {c['lossless']}")
    if c["drafter_dropped_with_inject"]:
        print("WARNING: injected proposals let XLA drop the drafter (spec_round: draft_injected_s << draft_s): "
              "the acceptance-controlled figures do not pay for drafting")
    for cell in c["skipped_cells"]:
        print(f"skipped {cell['file']} batch {cell['batch']} prompt {cell['prompt']}: {cell['reason']}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    ap.add_argument("--tiny", action="store_true", help="summarize the *_tiny.json files")
    ap.add_argument("--strict", action="store_true", help="exit status 1 if a run compiled after its warm-up")
    args = ap.parse_args(argv)
    folder = args.out or common.RESULTS
    s = summarize(folder, args.tiny)
    common.write_json(f"summary{'_tiny' if args.tiny else ''}.json", s, folder)
    print_table(s)
    recompiled = [f for f, ok in s["checks"]["no_recompile"].items() if ok is False]
    if recompiled:
        print(f"FAIL: compiled after the warm-up in {recompiled}")
        if args.strict:
            sys.exit(1)
    return s


if __name__ == "__main__":
    main()
