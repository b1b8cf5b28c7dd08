"""The sampling filter on the GPU: top-k/top-p by the candidate search (`sampling._candidate_keep`) against one
sort of the whole vocabulary (`sampling._sorted_keep`, the rule it falls back to and `sampling.FILTER_IMPL`'s
default), over the rows a verify filters: batch x block 16 rows of a 151,936-token vocabulary.

Per cell: microseconds of the whole `filtered_logprobs` either way (median of `--reps` calls, each blocked),
whether the two supports are identical, and whether the candidates were exact for every row (else the search
paid for the candidates and then the sort). Settings: T 0.7 with top-k 50 and top-p 0.9 (issue 16's), top-p
0.9 alone, and top-p 0.9 over logits too flat for the candidates (the fallback's cost).

    python bench/sampling_filter.py            # H200: writes bench/results/sampling_filter.json
    python bench/sampling_filter.py --tiny     # CPU smoke test
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import common
from dflash_jax import sampling as smp

SETTINGS = {"k50_p0.9": (50, 0.9, 3.0), "p0.9": (0, 0.9, 3.0), "p0.9_flat": (0, 0.9, 0.5)}


def _filter(impl: str):
    """`filtered_logprobs`, jitted, with `sampling.FILTER_IMPL` set to `impl` while it traces."""
    def run(logits, rp):
        saved = smp.FILTER_IMPL
        smp.FILTER_IMPL = impl
        try:
            return smp.filtered_logprobs(logits, rp)
        finally:
            smp.FILTER_IMPL = saved
    return jax.jit(run)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="small vocabulary on the CPU (smoke test)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    vocab, block = (4096, 4) if args.tiny else (151936, 16)
    impls = {impl: _filter(impl) for impl in smp.FILTER_IMPLS}
    cells = []
    for batch in args.batches:
        rows = batch * block
        for name, (top_k, top_p, scale) in SETTINGS.items():
            logits = jnp.asarray(np.random.default_rng(0).normal(size=(rows, vocab)) * scale, jnp.float32)
            rp = smp.row_params(smp.Sampling(temperature=0.7, top_k=top_k, top_p=top_p), rows)
            z = logits / 0.7
            exact, _ = jax.jit(smp._candidate_cuts)(z, smp._per_row(rp.top_k, z), smp._per_row(rp.top_p, z))
            cell = {"batch": batch, "rows": rows, "vocab": vocab, "setting": name, "top_k": top_k, "top_p": top_p,
                    "logit_scale": scale, "candidates_exact": bool(jnp.all(exact))}
            outs = {}
            for impl, fn in impls.items():
                seconds, outs[impl] = common.timed(fn, logits, rp, reps=args.reps, warmup=2)
                cell[f"{impl}_us"] = seconds * 1e6
            cell["same_support"] = bool(jnp.array_equal(jnp.isfinite(outs["candidates"]), jnp.isfinite(outs["sort"])))
            cell["sort_over_candidates"] = cell["sort_us"] / cell["candidates_us"]
            print(cell)
            cells.append(cell)
    payload = common.environment(**vars(args)) | {"filter_group": smp.FILTER_GROUP,
                                                  "filter_per_group": smp.FILTER_PER_GROUP, "cells": cells}
    common.write_json(f"sampling_filter{'_tiny' if args.tiny else ''}.json", payload, args.out)
    return payload


if __name__ == "__main__":
    main()
