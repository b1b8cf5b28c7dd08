"""The fixed cost of one call of the compiled speculative loop (issue 16, item 4), through `Session.burst`.

    python bench/call_cost.py            # H200: writes bench/results/call_cost.json
    python bench/call_cost.py --tiny     # CPU smoke test

One session (`acceptance.models`: the Qwen3-8B-shaped target with random bf16 weights and its DFlash drafter,
batch 1, prompt 512) is prefilled, then decoded by bursts whose sizes alternate between `--sizes`. Every burst
runs the same compiled loop (its limit is a traced value), so wall time per burst is `fixed + rounds x round_s`.
`fixed_cost_per_call_s` and `round_s` come from a least-squares fit of the timed bursts, after `--warmup` bursts.
Each burst's rounds, tokens and seconds are in `bursts`; `no_recompile` says no timed burst compiled.
`fixed_cost_per_call_s` goes into `summary.json` (target: at most 1 ms; traces showed about 13 ms).
"""
from __future__ import annotations

import argparse
import itertools

import numpy as np

import acceptance as acc
import common
from dflash_jax.decoding.session import Session

TARGET_S = 1e-3


def fit(bursts: list) -> tuple[float, float]:
    """`(fixed, per_round)` seconds of the least-squares line `seconds = fixed + rounds x per_round`."""
    rounds = np.asarray([b["rounds"] for b in bursts], np.float64)
    seconds = np.asarray([b["seconds"] for b in bursts], np.float64)
    if len(set(rounds.tolist())) < 2:
        raise ValueError(f"call_cost: the timed bursts all ran {rounds[0]:.0f} rounds; give --sizes that differ")
    per_round, fixed = np.polyfit(rounds, seconds, 1)
    return float(fixed), float(per_round)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny random models on the CPU: tests the script")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 512; tiny 32)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 32], help="burst sizes (tokens), alternated")
    ap.add_argument("--bursts", type=int, default=12, help="timed bursts")
    ap.add_argument("--warmup", type=int, default=2, help="untimed bursts first (compile, caches)")
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = ap.parse_args(argv)
    if min(args.sizes) < 1 or args.bursts < 2 or args.warmup < 1:
        ap.error("--sizes must be positive, --bursts at least 2 and --warmup at least 1")
    prompt = args.prompt or (32 if args.tiny else 512)
    counter = acc.CompileCounter()
    target, drafter = acc.models(args.tiny)
    sizes = list(itertools.islice(itertools.cycle(args.sizes), args.warmup + args.bursts))
    prompts = acc.make_prompts(1, prompt, target.config.vocab_size, 0)
    session = Session(target, drafter, prompts, max_new_tokens=sum(sizes) + 1)
    bursts = []
    for i, size in enumerate(sizes):
        if i == args.warmup:
            mark = counter.mark()
        b = session.burst(size)
        if i >= args.warmup:
            bursts.append({"size": size, "tokens": len(b.tokens[0]), "rounds": b.rounds, "seconds": b.wall_time_s})
    compiles = counter.since(mark)
    fixed, per_round = fit(bursts)
    payload = common.environment(**vars(args)) | acc.describe(target, drafter, args.tiny) | {
        "prompt": prompt, "bursts": bursts, "fixed_cost_per_call_s": fixed, "round_s": per_round,
        "target_s": TARGET_S, "met": fixed <= TARGET_S, "compiles_after_warmup": compiles,
        "no_recompile": compiles["count"] == 0}
    print(f"fixed cost per call {fixed * 1e3:.3f} ms (target <= {TARGET_S * 1e3:.0f} ms), "
          f"{per_round * 1e3:.3f} ms a round, over {len(bursts)} bursts")
    common.write_json(f"call_cost{'_tiny' if args.tiny else ''}.json", payload, args.out)
    return payload


if __name__ == "__main__":
    main()
