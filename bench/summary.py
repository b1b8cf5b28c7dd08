"""The latest measured value of each performance target, from the JSON in a results folder.

Writes `summary.json` (`summary_tiny.json` with `--tiny`) with the keys of `TARGETS`: plain_roofline_ratio,
round_over_plain_step, speedup_at_tau_6_5, loop_overhead, speedup_over_static_peer, speedup_at_tau_6_5_batch_64
(the sweep's batch 64 x prompt 512 cell), fixed_cost_per_call_s and the sampled rounds over greedy ones at batch 1
and 8, with one-hot and dense q (call_cost.py's cells), and prefill_share_of_peak (prefill.py). Also device,
jax_version, date, the source file of each number, and the run checks (compiles after warm-up, lossless, skipped
cells, whether injected proposals let XLA drop the drafter, plain decoding over the stricter read-only roofline);
prints target vs measured. A missing source leaves its value null. Each missed target gets `held_back_by`: what holds
it back, in a sentence and its numbers, from the files of `EVIDENCE` beside the sources (`HELD_BACK`: a step's and a
round's kernels from profile_round.json, the static peer against the roofline from plain_decode.json, a call's fixed
cost from call_dispatch.json, the sampling filter alone from sampling_filter.json where it is there, the fused round
against its phases from spec_round.json, the batch-64 round from sweep.json: every target has one); null when a file
it needs is missing.

With `--readme PATH` it also writes the targets as a Markdown table between two marker lines in PATH (`README_BEGIN`,
`README_END`): `run_all.sh` does so in README.md when it writes bench/results.

    python bench/summary.py                     # reads and writes bench/results
    python bench/summary.py --out DIR --strict  # exit status 1 if any run compiled after its warm-up
    python bench/summary.py --readme README.md  # and README's table
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
     lambda d: _row(d["table"], batch=64, prompt=512)["speedup"], ">=", 2.0,
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
EVIDENCE = ("profile_round", "call_dispatch", "sampling_filter")
"""Files that say why a target is missed (`held_back`): where a step's and a round's device time goes, what a call's
fixed cost is made of, what the sampling filter costs alone."""
GEMM_NAMES = ("gemm", "nvjet", "cublas", "dot")
"""Kernel names of matrix products: XLA's GEMM fusions, cuBLAS kernels, and on a CPU trace the dot ops."""


def _goal(key: str) -> float:
    """Target `key`'s goal, as TARGETS gives it."""
    return next(t[4] for t in TARGETS if t[0] == key)


def _row(rows: list, **match):
    """The first of `rows` whose fields equal `match` (a cell of batch x prompt, say), or None if none ran."""
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


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


def _is_gemm(name: str) -> bool:
    return any(g in name.lower() for g in GEMM_NAMES)


def _by_kind(section: dict) -> dict:
    return {k["name"].rstrip("_"): k["us"] for k in section["kinds"]}


def _plain_held_back(d: dict) -> dict:
    """Where a plain step's device time goes (profile_round.json's `plain_step`), against plain_decode.json's step."""
    prof, plain = d["profile_round"], d["plain_decode"]
    step = prof["plain_step"]
    gemm_us = sum(k["us"] for k in step["kinds"] if _is_gemm(k["name"]))
    gemms = sum(k["calls"] for k in step["kinds"] if _is_gemm(k["name"]))
    others = sorted((k for k in step["kinds"] if not _is_gemm(k["name"])), key=lambda k: -k["us"])
    rate = prof["weight_bytes"] / (gemm_us * 1e-6)
    step_us = plain["ours"]["decode_step_s"] * 1e6
    largest = ", ".join(f"{k['name']} {k['us']:.0f}" for k in others[:3])
    return {"what": f"a plain step takes {step_us:.0f} us; in its profile the GPU is busy {step['busy_us']:.0f} us a "
                    f"step: {gemms:.0f} GEMMs {gemm_us:.0f} us, reading the weights at {rate / 1e12:.2f} TB/s "
                    f"({rate / plain['hbm_bandwidth_Bps']:.2f} of the copy bandwidth), and "
                    f"{step['kernels'] - gemms:.0f} other kernels {step['busy_us'] - gemm_us:.0f} us ({largest} us)",
            "step_us": step_us, "busy_us": step["busy_us"], "gemm_us": gemm_us, "gemm_read_Bps": rate,
            "other_kernels": step["kernels"] - gemms, "other_us": step["busy_us"] - gemm_us,
            "ratio_with_gemms_alone": plain["step_bytes"] / plain["hbm_bandwidth_Bps"] / (gemm_us * 1e-6)}


def _round_held_back(d: dict) -> dict:
    """What a round keeps the GPU busy with beyond a plain step (profile_round.json, the real drafter's rounds)."""
    prof = d["profile_round"]
    plain, rnd = _by_kind(prof["plain_step"]), _by_kind(prof["spec_round_real"])
    extra = sorted(((name, rnd.get(name, 0.0) - plain.get(name, 0.0)) for name in set(plain) | set(rnd)),
                   key=lambda e: -e[1])
    gemm = sum(e for name, e in extra if _is_gemm(name))
    busy = prof["spec_round_real"]["busy_us"] - prof["plain_step"]["busy_us"]
    largest = ", ".join(f"{name} +{e:.0f}" for name, e in [e for e in extra if not _is_gemm(e[0])][:4])
    return {"what": f"in the profile a round keeps the GPU busy {prof['round_over_step_busy']:.3f} plain steps; "
                    f"of its {busy:.0f} us beyond a step, GEMMs take {gemm:.0f} (the verify's 16 rows and the "
                    f"drafter's {prof['drafter_bytes'] / 1e9:.1f} GB of weights), other kernels the rest "
                    f"({largest} us)",
            "round_over_step_busy": prof["round_over_step_busy"], "extra_busy_us": busy, "extra_gemm_us": gemm,
            "extra_by_kind_us": dict(extra[:8])}


def _speedup_held_back(d: dict) -> dict:
    """A speedup is tokens a round over the round's cost in plain steps: what the round would have to cost."""
    head, ratio = d["acceptance"]["headline"], d["spec_round"]["headline"]["round_over_plain_step"]
    goal = _goal("speedup_at_tau_6_5")
    need = head["tau_measured"] / goal
    return {"what": f"the round: at acceptance {head['tau_measured']:.2f} a round of {ratio:.3f} plain steps caps the "
                    f"speedup near {head['ceiling']:.2f}x; {goal}x needs a round of about {need:.2f} plain steps "
                    "(see round_over_plain_step)",
            "round_over_plain_step": ratio, "ceiling": head["ceiling"], "round_needed": need}


def _loop_held_back(d: dict) -> dict:
    """The fused round against its phases, each jitted alone (spec_round.json's headline cell)."""
    sr = d["spec_round"]
    head = sr["headline"]
    ph = _row(sr["cells"], batch=head["batch"], prompt=head["prompt"])["phases"]
    return {"what": f"the fused round takes {head['round_s'] * 1e3:.2f} ms against {head['sum_of_phases_s'] * 1e3:.2f} "
                    f"ms for its phases jitted one at a time (draft {ph['draft_s'] * 1e3:.2f}, verify "
                    f"{ph['verify_s'] * 1e3:.2f}, commit and ingest {ph['commit_ingest_s'] * 1e3:.2f} ms)",
            "round_s": head["round_s"], "sum_of_phases_s": head["sum_of_phases_s"],
            "phases_s": {k: ph[k] for k in ("draft_s", "verify_s", "commit_ingest_s")}}


def _batch_64_held_back(d: dict) -> dict:
    """The round at batch 64 in plain steps of batch 64, against what the goal needs at the measured acceptance."""
    row = _row(d["sweep"]["table"], batch=64, prompt=512)
    goal = _goal("speedup_at_tau_6_5_batch_64")
    need = row["tau_measured"] / goal
    return {"what": f"the round: at batch 64 it takes {row['round_s'] * 1e3:.2f} ms, "
                    f"{row['round_over_plain_step']:.2f} plain steps of {row['plain_step_s'] * 1e3:.2f} ms, and "
                    f"accepts {row['tau_measured']:.2f} tokens; {goal}x needs a round of about {need:.2f} plain steps",
            "round_over_plain_step": row["round_over_plain_step"], "round_needed": need}


def _peer_held_back(d: dict) -> dict:
    """Both sides of the ratio against the roofline: how close to it ours would have to run."""
    p = d["plain_decode"]
    peer = _row(p["peers"], cache_implementation="static")["tokens_per_s"]
    roof = p["roofline_tokens_per_s"]
    goal = _goal("speedup_over_static_peer")
    return {"what": f"the peer: it decodes at {peer:.1f} tokens/s, {peer / roof:.2f} of the roofline "
                    f"({roof:.1f} tokens/s); {goal}x of it needs {goal * peer / roof:.2f} of the roofline, "
                    f"where ours runs at {p['roofline_ratio']:.2f}",
            "peer_roofline_ratio": peer / roof, "roofline_ratio_needed": goal * peer / roof}


def _fixed_cost_held_back(d: dict) -> dict:
    """What a call of the loop pays beyond its rounds (call_dispatch.json)."""
    rows, leaves = d["call_dispatch"]["rows"], d["call_dispatch"]["leaves"]
    empty, passing = rows["run_burst_0"], rows["passthrough_state"]
    n = leaves["target_params"] + leaves["drafter_params"] + leaves["state"]
    out = {"what": f"a call that runs no round costs {empty['total_s'] * 1e3:.2f} ms (dispatch "
                   f"{empty['dispatch_s'] * 1e3:.2f}, the report's fetch {empty['fetch_s'] * 1e3:.2f}); a program that "
                   f"takes the same {n} argument leaves and does nothing costs {passing['total_s'] * 1e3:.2f} ms",
           "no_round_call_s": empty["total_s"], "same_leaves_noop_s": passing["total_s"], "argument_leaves": n}
    fit = d["call_dispatch"].get("fit")
    if fit:
        out["what"] += f"; calls of rounds fit {fit['beyond_rounds_s'] * 1e3:.2f} ms beyond their rounds"
        out["beyond_rounds_s"] = fit["beyond_rounds_s"]
    return out


def _sampled_held_back(batch: int, sampling: str):
    def held(d: dict) -> dict:
        cells = {(c["batch"], c["sampling"]): c for c in d["call_cost"]["cells"]}
        greedy, cell = cells[(batch, "greedy")], cells[(batch, sampling)]
        extra = cell["round_s"] - greedy["round_s"]
        out = {"what": f"a round at batch {batch} costs {extra * 1e3:.2f} ms more than a greedy one "
                       f"({cell['round_s'] * 1e3:.2f} against {greedy['round_s'] * 1e3:.2f} ms)",
               "extra_per_round_s": extra}
        alone = _row((d.get("sampling_filter") or {}).get("cells", []), batch=batch, setting="k50_p0.9")
        impl = d["call_cost"].get("default_filter", "threshold")  # the filter the rounds above ran
        if alone and f"{impl}_us" in alone:
            out["what"] += (f"; the filter over a verify's {alone['rows']} rows alone took "
                            f"{alone[f'{impl}_us'] / 1e3:.2f} ms (sampling_filter.json)")
            out["filter_alone_s"] = alone[f"{impl}_us"] * 1e-6
        return out
    return held


def _prefill_held_back(d: dict) -> dict:
    p = d["prefill"]
    attention = 1 - p["weight_flops"] / p["flops"]
    return {"what": f"the prefill runs at {p['share_of_gemm']:.2f} of the same run's {p['gemm_side']}^3 product "
                    f"({p['gemm_flops_per_s'] / 1e12:.0f} TFLOP/s) with the attention counted; the target counts the "
                    f"weights' FLOPs alone, and the attention is {attention:.0%} of the work at this length",
            "share_of_gemm": p["share_of_gemm"], "attention_share_of_flops": attention}


HELD_BACK = {
    "plain_roofline_ratio": (("profile_round", "plain_decode"), _plain_held_back),
    "round_over_plain_step": (("profile_round",), _round_held_back),
    "speedup_at_tau_6_5": (("acceptance", "spec_round"), _speedup_held_back),
    "loop_overhead": (("spec_round",), _loop_held_back),
    "speedup_over_static_peer": (("plain_decode",), _peer_held_back),
    "speedup_at_tau_6_5_batch_64": (("sweep",), _batch_64_held_back),
    "fixed_cost_per_call_s": (("call_dispatch",), _fixed_cost_held_back),
    "sampled_round_over_greedy_b1": (("call_cost",), _sampled_held_back(1, "sampled")),
    "sampled_round_over_greedy_b8": (("call_cost",), _sampled_held_back(8, "sampled")),
    "dense_q_round_over_greedy_b1": (("call_cost",), _sampled_held_back(1, "sampled_dense")),
    "dense_q_round_over_greedy_b8": (("call_cost",), _sampled_held_back(8, "sampled_dense")),
    "prefill_share_of_peak": (("prefill",), _prefill_held_back),
}
"""Target key -> (the files it needs, what it reads from them): what holds a missed target back."""


def held_back(key: str, data: dict):
    """What holds target `key` back, from the files in `data` (name -> payload or None); None when a file it needs is
    missing or lacks a cell."""
    needs, read = HELD_BACK.get(key, ((), None))
    if read is None or any(data.get(name) is None for name in needs):
        return None
    try:
        return read(data) | {"from": [f"{name}.json" for name in needs]}
    except (KeyError, TypeError, ZeroDivisionError):
        return None


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
    loaded = {name: d for name, (d, _) in data.items()} | {name: _load(folder, name, tiny)[0] for name in EVIDENCE}
    for key, t in targets.items():
        if t["met"] is False:
            t["held_back_by"] = held_back(key, loaded)
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
        if t.get("held_back_by"):
            print(f"{'':<{width}}   held back: {t['held_back_by']['what']}")
    c = s["checks"]
    print(f"no recompile after warm-up: {c['no_recompile']}")
    print(f"lossless (speculative == plain tokens): {c['lossless']}")
    if c["drafter_dropped_with_inject"]:
        print("WARNING: injected proposals let XLA drop the drafter (spec_round: draft_injected_s << draft_s): "
              "the acceptance-controlled figures do not pay for drafting")
    for cell in c["skipped_cells"]:
        print(f"skipped {cell['file']} batch {cell['batch']} prompt {cell['prompt']}: {cell['reason']}")


README_BEGIN = "<!-- bench/summary.py --readme writes the table from here -->"
README_END = "<!-- bench/summary.py --readme writes the table to here -->"


def _shown(key: str, v) -> str:
    """A target's value as the README shows it: seconds in ms, ratios to three places."""
    if v is None:
        return "-"
    return f"{v * 1e3:.2f} ms" if key.endswith("_s") else f"{v:.3f}"


def readme_table(s: dict) -> str:
    """The summary as a Markdown table: each target's figure, value, goal (met or not), source and date, and what
    holds a missed one back."""
    lines = [f"{s['device']}, JAX {s['jax_version']}; summarised {s['date'][:10]} by `bench/summary.py`.", "",
             "| figure | measured | target | source | what holds it back |", "|---|---|---|---|---|"]
    ops = {t[0]: t[3] for t in TARGETS}
    for key, t in s["targets"].items():
        met = {True: "✓", False: "✗", None: "not measured"}[t["met"]]
        when = (t.get("source_date") or "")[:10]
        why = (t.get("held_back_by") or {}).get("what", "")
        goal = f"{'≥' if ops[key] == '>=' else '≤'} {_shown(key, _goal(key))} {met}"
        cells = (f"{t['what']} (`{key}`)", _shown(key, t["measured"]), goal, f"`{t['source']}` {when}", why)
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def update_readme(path: str, table: str) -> None:
    """Replace what lies between the README's two markers with `table`; refuse a README without them."""
    with open(path) as f:
        text = f.read()
    begin, end = text.find(README_BEGIN), text.find(README_END)
    if text.count(README_BEGIN) != 1 or text.count(README_END) != 1 or end < begin:
        raise SystemExit(f"{path}: the summary table goes between one line {README_BEGIN!r} and one line "
                         f"{README_END!r} after it; add them where the table belongs")
    with open(path, "w") as f:
        f.write(text[:begin + len(README_BEGIN)] + "\n" + table + "\n" + text[end:])
    print(f"wrote the summary table into {path}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    ap.add_argument("--tiny", action="store_true", help="summarize the *_tiny.json files")
    ap.add_argument("--strict", action="store_true", help="exit status 1 if a run compiled after its warm-up")
    ap.add_argument("--readme", default=None, metavar="PATH",
                    help="also write the summary as a table between the markers in PATH (run_all.sh: README.md)")
    args = ap.parse_args(argv)
    folder = args.out or common.RESULTS
    s = summarize(folder, args.tiny)
    common.write_json(f"summary{'_tiny' if args.tiny else ''}.json", s, folder)
    print_table(s)
    if args.readme:
        update_readme(args.readme, readme_table(s))
    recompiled = [f for f, ok in s["checks"]["no_recompile"].items() if ok is False]
    if recompiled:
        print(f"FAIL: compiled after the warm-up in {recompiled}")
        if args.strict:
            sys.exit(1)
    return s


if __name__ == "__main__":
    main()
