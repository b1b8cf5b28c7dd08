"""What a call of the compiled speculative loop costs beyond its rounds, and what a sampled round costs against a
greedy one (issue 16, items 3 and 4), both through `Session.burst`.

    python bench/call_cost.py                                        # H200: greedy, batch 1 (run_all.sh)
    python bench/call_cost.py --batches 1 8 --samplings greedy sampled sampled_dense   # issue 16's sampled rows
    python bench/call_cost.py --tiny                                 # CPU smoke test

Per cell (batch x sampling), one session of `acceptance.models` (the Qwen3-8B-shaped target with random bf16
weights and its DFlash drafter; prompt 512) is prefilled, then decoded by bursts whose sizes alternate between
`--sizes`. Every burst runs the same compiled loop (its limit is a traced value), so a burst takes
`fixed + rounds x round_s`: both come from a least-squares fit of the timed bursts, after `--warmup` bursts.
`rounds` counts loop rounds (a round advances every row once). Samplings (`SAMPLINGS`): greedy; sampled, i.e.
T 0.7 with top-p 0.9 and top-k 50 (issue 16's setting); the same with `proposal="sample"` (dense q).
`--filters` runs each sampled cell with each of the given `sampling.FILTER_IMPL` values (default: the
package's), the cell's `filter`. `round_over_greedy` is a cell's `round_s` over the greedy cell's of the same
batch. The drafter is random, so
few drafts are accepted; the round's cost does not depend on how many are.
The top-level `fixed_cost_per_call_s` is the greedy batch-1 cell's (target: at most 1 ms; traces showed about
13 ms), and `summary.json` reads it and the sampled ratios (target: 1.05, or 1.10 with dense q).
"""
from __future__ import annotations

import argparse
import itertools

import jax
import numpy as np

import acceptance as acc
import common
from dflash_jax import sampling as smp
from dflash_jax.decoding.session import Session
from dflash_jax.sampling import Sampling

TARGET_S = 1e-3
SAMPLINGS = {"greedy": Sampling(),
             "sampled": Sampling(temperature=0.7, top_p=0.9, top_k=50),
             "sampled_dense": Sampling(temperature=0.7, top_p=0.9, top_k=50, proposal="sample")}


def fit(bursts: list) -> tuple[float, float]:
    """`(fixed, per_round)` seconds of the least-squares line `seconds = fixed + rounds x per_round`."""
    rounds = np.asarray([b["rounds"] for b in bursts], np.float64)
    seconds = np.asarray([b["seconds"] for b in bursts], np.float64)
    if len(set(rounds.tolist())) < 2:
        raise ValueError(f"call_cost: the timed bursts all ran {rounds[0]:.0f} rounds; give --sizes that differ")
    per_round, fixed = np.polyfit(rounds, seconds, 1)
    return float(fixed), float(per_round)


def measure(target, drafter, batch: int, sampling: str, prompt: int, sizes: list, warmup: int,
            counter: acc.CompileCounter, filter_impl: str = smp.FILTER_IMPL) -> dict:
    """One cell: its bursts, the fit, and the compiles of its warm-up and of its timed bursts;
    `sampling.FILTER_IMPL` is `filter_impl` while the session runs (its loop is traced at the first burst)."""
    prompts = acc.make_prompts(batch, prompt, target.config.vocab_size, 0)
    jax.clear_caches()  # a cell's loop is traced afresh: jit's cache does not key on FILTER_IMPL
    start = counter.mark()
    saved, smp.FILTER_IMPL = smp.FILTER_IMPL, filter_impl
    try:
        session = Session(target, drafter, prompts, max_new_tokens=sum(sizes) + 1, sampling=SAMPLINGS[sampling])
        bursts = []
        for i, size in enumerate(sizes):
            if i == warmup:
                mark = counter.mark()
            b = session.burst(size)
            if i >= warmup:
                bursts.append({"size": size, "tokens": len(b.tokens[0]), "rounds": b.rounds // batch,
                               "seconds": b.wall_time_s})
    finally:
        smp.FILTER_IMPL = saved
    compiles = counter.since(mark)
    warmup_compiles = counter.since(start)["count"] - compiles["count"]
    fixed, per_round = fit(bursts)
    print(f"batch {batch} {sampling} ({filter_impl}): fixed cost per call {fixed * 1e3:.3f} ms, "
          f"{per_round * 1e3:.3f} ms a round ({len(bursts)} bursts, {compiles['count']} compiles)", flush=True)
    return {"batch": batch, "sampling": sampling, "filter": filter_impl, "bursts": bursts,
            "fixed_cost_per_call_s": fixed, "round_s": per_round, "compiles_in_warmup": warmup_compiles,
            "compiles_after_warmup": compiles, "no_recompile": compiles["count"] == 0}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny random models on the CPU: tests the script")
    ap.add_argument("--batches", type=int, nargs="+", default=[1])
    ap.add_argument("--samplings", nargs="+", default=["greedy"], choices=list(SAMPLINGS))
    ap.add_argument("--filters", nargs="+", default=[smp.FILTER_IMPL], choices=list(smp.FILTER_IMPLS),
                    help="sampling.FILTER_IMPL of the sampled cells, each in turn (default: the package's)")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 512; tiny 32)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 32], help="burst sizes (tokens), alternated")
    ap.add_argument("--bursts", type=int, default=12, help="timed bursts per cell")
    ap.add_argument("--warmup", type=int, default=2, help="untimed bursts first (compile, caches)")
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = ap.parse_args(argv)
    if min(args.sizes) < 1 or args.bursts < 2 or args.warmup < 1 or min(args.batches) < 1:
        ap.error("--sizes and --batches must be positive, --bursts at least 2 and --warmup at least 1")
    samplings = ["greedy"] + [s for s in dict.fromkeys(args.samplings) if s != "greedy"]  # each ratio's baseline
    prompt = args.prompt or (32 if args.tiny else 512)
    counter = acc.CompileCounter()
    target, drafter = acc.models(args.tiny)
    sizes = list(itertools.islice(itertools.cycle(args.sizes), args.warmup + args.bursts))
    cells = [measure(target, drafter, b, s, prompt, sizes, args.warmup, counter, f)
             for b, s in itertools.product(dict.fromkeys(args.batches), samplings)
             for f in (dict.fromkeys(args.filters) if s != "greedy" else [smp.FILTER_IMPL])]
    greedy = {c["batch"]: c["round_s"] for c in cells if c["sampling"] == "greedy"}
    for c in cells:
        c["round_over_greedy"] = c["round_s"] / greedy[c["batch"]]
    head = next((c for c in cells if (c["batch"], c["sampling"]) == (1, "greedy")), None)
    fixed = head and head["fixed_cost_per_call_s"]
    payload = common.environment(**vars(args)) | acc.describe(target, drafter, args.tiny) | {
        "prompt": prompt, "default_filter": smp.FILTER_IMPL, "cells": cells, "fixed_cost_per_call_s": fixed,
        "target_s": TARGET_S,
        "met": None if fixed is None else fixed <= TARGET_S, "no_recompile": all(c["no_recompile"] for c in cells)}
    common.write_json(f"call_cost{'_tiny' if args.tiny else ''}.json", payload, args.out)
    return payload


if __name__ == "__main__":
    main()
