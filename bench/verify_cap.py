"""Speculative speedup against the verify cap (`verify_t`) per batch size (issue 16, item 5).

A round verifies a block of `verify_t` rows (the anchor and `verify_t - 1` drafts, `speculative.Loop`), so a
cap below nd + 1 trades accepted drafts for a cheaper verify. At batch 1 the verify reads weights and a narrow
block saves little; at batch 64 x 16 rows it is compute-bound. Per batch, the Qwen3-8B-shaped target and its
z-lab-shaped DFlash drafter (random bf16, `acceptance.models`; prompt 512, synthetic context) decode with
injected proposals at acceptance `--tau` (`--dist`, default geometric: each draft right with the same
probability, so a cap cuts the long acceptances a real drafter has) for each `--caps` value. Each cell records
tokens/s, the speedup over plain decoding measured in the same run, the acceptance length the cap leaves, and
whether the output equals plain decoding. `best_cap` per batch is the fastest. The JSON is rewritten after each
batch, so a run cut short keeps the batches it finished.

    python bench/verify_cap.py                                   # H200: batches 1, 16, 64; caps 4 8 12 16
    python bench/verify_cap.py --batches 64 --caps 8 12 16
    python bench/verify_cap.py --tiny                            # CPU smoke test
"""
from __future__ import annotations

import argparse
import dataclasses

import acceptance as acc
import common
from dflash_jax.config import policy


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--caps", type=int, nargs="+", default=[4, 8, 12, 16])
    ap.add_argument("--tau", type=float, default=6.5)
    ap.add_argument("--dist", default="geometric", choices=acc.DISTRIBUTIONS)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--impl", default=None, choices=["xla", "pallas"], help="default: pallas on GPU")
    ap.add_argument("--tiny", action="store_true", help="tiny float32 models on the CPU: tests the script")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    target, drafter = acc.models(args.tiny)
    nd = drafter.config.n_drafts
    caps = sorted({min(c, nd + 1) for c in args.caps})
    if caps[0] < 2:
        ap.error(f"--caps must be at least 2 (the anchor and one draft); got {args.caps}")
    prompt, new = (32, 32) if args.tiny else (args.prompt, args.new)
    impl = policy.attention_impl(args.impl)
    counter = acc.CompileCounter()
    cells = []
    payload = common.environment(**vars(args)) | acc.describe(target, drafter, args.tiny) | {"caps": caps,
                                                                                              "cells": cells}
    for batch in args.batches:
        cell = acc.open_cell(target, drafter, batch, prompt, new, impl, "synthetic")
        plain_tokens, _, _ = cell.run_plain()
        plain = acc.measure_plain(cell, args.reps, plain_tokens)
        reference, runs = plain_tokens, []
        for cap in caps:
            cell = dataclasses.replace(cell, loop=dataclasses.replace(cell.loop, verify_cap=cap))
            cell.run_spec(cell.injected(reference, acc.first_wrong_probs(args.tau, nd, args.dist)))  # compiles
            mark = counter.mark()
            rec, reference = acc.measure_tau(cell, args.tau, args.dist, args.reps, 3, reference, plain_tokens)
            rec = acc.with_plain(rec, plain, None) | {"verify_cap": cap,
                                                      "no_recompile": counter.since(mark)["count"] == 0}
            runs.append(rec)
            print(f"b={batch} cap {cap:2d}: tau {rec['tau_measured']:.2f}, {rec['tokens_per_s']:.1f} tok/s, speedup "
                  f"{rec['speedup']:.2f}x, round / plain step {rec['round_over_plain_step']:.2f}, lossless "
                  f"{rec['lossless']}", flush=True)
        best = max(runs, key=lambda r: r["speedup"])
        cells.append({"batch": batch, "prompt": prompt, "plain": plain, "runs": runs, "best_cap": best["verify_cap"],
                      "best_speedup": best["speedup"], "full_block_speedup": runs[-1]["speedup"]})
        payload.update(lossless=all(r["lossless"] for c in cells for r in c["runs"]),
                       no_recompile=all(r["no_recompile"] for c in cells for r in c["runs"]))
        common.write_json(f"verify_cap{'_tiny' if args.tiny else ''}.json", payload, args.out)  # after each batch
    return payload


if __name__ == "__main__":
    main()
