"""Batch x prompt sweep of plain and speculative decoding at acceptance length 6.5.

For each batch in `--batches` and prompt in `--prompts` (the drafter on a 2048 sliding window
for prompts longer than it): plain tokens/s (all rows together), speculative tokens/s with
injected proposals at `--taus` (see `acceptance.py`), the speedup and the round / plain step.
Cells are run smallest first; one that would not fit (a rough estimate of the caches and the
largest temporaries against the device's free memory) or that runs out of memory is recorded
as skipped with the reason. The JSON is rewritten after every cell.

The context is `synthetic` by default: zero caches with `seq_len = prompt` (a decode step
costs the same whatever the cached values), which saves each cell a prefill compile and, at
batch 64 x 8192, a prefill that needs the caches twice; `--context prefill` runs real prompts.

    python bench/sweep.py                          # H200: batch 1 4 16 64 x prompt 512 8192
    python bench/sweep.py --batches 1 16 --prompts 512
    python bench/sweep.py --tiny                   # CPU smoke test
"""
from __future__ import annotations

import argparse

import acceptance as acc
import common


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    acc.grid_args(ap, [1, 4, 16, 64], [512, 8192], [6.5], 256)
    ap.add_argument("--context", default="synthetic", choices=acc.CONTEXTS, help="how the prompt's caches are made")
    args = acc.finish_args(ap.parse_args(argv), [1, 4, 16, 64], [512, 8192], [6.5], 256, [1, 3], [32, 96])
    counter = acc.CompileCounter()
    target, drafter = acc.models(args.tiny)
    payload = common.environment(**vars(args)) | acc.describe(target, drafter, args.tiny)
    name = f"sweep{'_tiny' if args.tiny else ''}.json"

    def write(records):
        payload["cells"] = records
        payload["no_recompile"] = all(r.get("no_recompile", True) for r in records)
        payload["table"] = [_row(r) for r in records]
        common.write_json(name, payload, args.out)

    acc.measure_grid(target, drafter, args, counter, args.context, False, write)
    print(f"{'batch':>5} {'prompt':>6} {'plain tok/s':>12} {'spec tok/s':>12} {'speedup':>8} {'tau':>5}  status")
    for r in payload["table"]:
        if r["status"] == "ok":
            print(f"{r['batch']:>5} {r['prompt']:>6} {r['plain_tokens_per_s']:>12.1f} {r['spec_tokens_per_s']:>12.1f} "
                  f"{r['speedup']:>7.2f}x {r['tau_measured']:>5.2f}  ok")
        else:
            print(f"{r['batch']:>5} {r['prompt']:>6} {'':>12} {'':>12} {'':>8} {'':>5}  {r['status']}: {r['reason']}")
    if not payload["no_recompile"]:
        print("WARNING: compiled during the timed runs (see cells[].compiles.after_warmup)")
    return payload


def _row(r: dict) -> dict:
    """One flat line per cell: the figures the plot and the table read (first tau)."""
    row = {k: r.get(k) for k in ("batch", "prompt", "window", "status", "reason")}
    if r.get("status") != "ok":
        return row
    run = r["runs"][0]
    return row | {"plain_tokens_per_s": r["plain"]["tokens_per_s"], "plain_step_s": r["plain"]["step_s"],
                  "tau": run["tau"], "tau_measured": run["tau_measured"], "spec_tokens_per_s": run["tokens_per_s"],
                  "speedup": run["speedup"], "round_s": run["round_s"],
                  "round_over_plain_step": run["round_over_plain_step"], "ceiling": run["ceiling"],
                  "lossless": run["lossless"]}


if __name__ == "__main__":
    main()
