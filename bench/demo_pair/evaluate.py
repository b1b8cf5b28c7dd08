"""Held-out figures of a demo pair: acceptance length and tokens/s, plain vs speculative.

Prompts are cut from the standard library's `test` packages (never trained on); each is
continued greedily for `--new` tokens with the drafter and without it, one prompt at a time
(batch 1), after an untimed pass over the same prompts that compiles every program the
timed pass runs. Outputs must be identical.

    python bench/demo_pair/evaluate.py --pair dflash_jax/assets/demo --prompts DATA/prompts.json --out FILE
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import common  # noqa: E402
import dflash_jax  # noqa: E402
from dflash_jax.demo import load_demo  # noqa: E402


def evaluate(demo, prompts: list, new: int, block_size: int | None) -> dict:
    """Per-prompt greedy runs; returns means and the per-prompt records."""
    target, drafter = demo.target, demo.drafter
    ids = [demo.tokenizer.encode(p["text"]) for p in prompts]
    stops = target.config.eos_token_ids
    for x in ids:  # an untimed pass compiles every program the timed pass uses (prompt lengths fall in buckets)
        dflash_jax.generate(target, None, [x], max_new_tokens=new)
        dflash_jax.generate(target, drafter, [x], max_new_tokens=new)
    rows = []
    for p, x in zip(prompts, ids):
        t0 = time.perf_counter()
        plain = dflash_jax.generate(target, None, [x], max_new_tokens=new)
        plain_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        fast = dflash_jax.generate(target, drafter, [x], max_new_tokens=new)
        spec_s = time.perf_counter() - t0
        n = len(plain.tokens[0])
        rows.append({"file": p["file"], "prompt_tokens": len(x), "new_tokens": n,
                     "identical": plain.tokens[0] == fast.tokens[0],
                     "acceptance_length": fast.stats.acceptance_length, "rounds": fast.stats.rounds,
                     "plain_tokens_per_s": n / plain_s, "spec_tokens_per_s": n / spec_s,
                     "stopped_at_eos": bool(set(plain.tokens[0]) & set(stops))})
    total_new = sum(r["new_tokens"] for r in rows)
    committed = sum(r["acceptance_length"] * r["rounds"] for r in rows)
    plain_s = sum(r["new_tokens"] / r["plain_tokens_per_s"] for r in rows)
    spec_s = sum(r["new_tokens"] / r["spec_tokens_per_s"] for r in rows)
    return {
        "n_prompts": len(rows), "new_tokens": new, "block_size": drafter.config.block_size,
        "all_identical": all(r["identical"] for r in rows),
        "acceptance_length_mean": committed / sum(r["rounds"] for r in rows),
        "acceptance_length_mean_of_prompts": float(np.mean([r["acceptance_length"] for r in rows])),
        "plain_tokens_per_s": total_new / plain_s, "spec_tokens_per_s": total_new / spec_s,
        "speedup": plain_s / spec_s,
        "speedup_median_of_prompts": float(np.median([r["spec_tokens_per_s"] / r["plain_tokens_per_s"] for r in rows])),
        "prompts": rows,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default=None, help="folder with target/ and drafter/ (default: the bundled pair)")
    ap.add_argument("--prompts", required=True, help="prompts.json from corpus.py")
    ap.add_argument("--n", type=int, default=32, help="number of prompts (at least 20)")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--dtype", default=None, choices=[None, "bfloat16", "float32"])
    ap.add_argument("--out", required=True, help="JSON file to write")
    args = ap.parse_args(argv)
    kw = {"block_size": args.block_size} if args.block_size else {}
    demo = load_demo(args.dtype, **({"directory": args.pair} if args.pair else {}), **kw)
    prompts = json.load(open(args.prompts))["prompts"][: args.n]
    res = evaluate(demo, prompts, args.new, args.block_size)
    res.update(common.environment(pair=args.pair or "bundled", dtype=args.dtype or "checkpoint (bfloat16)"))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"{res['device']}: acceptance length {res['acceptance_length_mean']:.2f} over {res['n_prompts']} prompts, "
          f"plain {res['plain_tokens_per_s']:.1f} tok/s, speculative {res['spec_tokens_per_s']:.1f} tok/s "
          f"({res['speedup']:.2f}x), identical: {res['all_identical']}")


if __name__ == "__main__":
    main()
