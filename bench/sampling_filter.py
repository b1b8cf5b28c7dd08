"""The sampling filter on the GPU: top-k/top-p by each of `sampling.FILTER_IMPLS`: one sort of the whole
vocabulary (`sampling._sorted_keep`, the rule), the candidate search (`sampling._candidate_keep`, which falls
back to the sort), the group search (`sampling._group_keep`, which falls back to the threshold search) and the
threshold search (`sampling._threshold_keep`, bisection over order keys, no sort or
top-k) with its passes' sums by each of `sampling.THRESHOLD_SUMS_CHOICES` (`pallas_kernels.key_sums`: the
kernel, which reads a row once a pass, in its Triton and its Mosaic GPU lowerings, or XLA's reduction, once a
pivot), over the rows a verify filters: batch x block 16 rows of a 151,936-token vocabulary.

Per cell: `{impl}_us`, microseconds of the whole `filtered_logprobs` under each of `IMPLS` (median of `--reps`
calls, each blocked); for each but the sort, `same_support_{impl}` (its support is the sort's),
`sort_over_{impl}`, and where the supports differ `{impl}_tokens_differing` and
`{impl}_differing_mass_distance_max` (how far from top_p the mass above a differing token lies: float rounding
when tiny); `same_support` is the candidates', as in earlier results; `candidates_exact`, whether the
candidates were exact for every row (else the search paid for them and then the sort); `groups_fit`, the same for
the group search (`sampling._group_cuts`, else it paid for its cuts and then the threshold search); and in the
cells of `PARTS_SETTING`, `part_*_us`, the searches' parts alone: the threshold search with the kernel at each of
`THRESHOLD_WAYS` parts a pass (`part_threshold_{ways}w_us`; `sampling.FILTER_WAYS`) and with XLA's sums
(`part_threshold_xla_{ways}w_us`), and the group search's cuts at each of `GROUP_SETTINGS`.
Settings: T 0.7 with top-k 50 and top-p 0.9 (issue 16's), top-k 20 with top-p 0.95 (Qwen3's recommended), top-p
0.9 alone, and top-p 0.9 over logits too flat for the candidates (the fallback's cost).

    python bench/sampling_filter.py            # H200: writes bench/results/sampling_filter.json
    python bench/sampling_filter.py --tiny     # CPU smoke test (the kernel's sums take the reference off a GPU)
"""
from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

import common
from dflash_jax import sampling as smp
from pallas_kernels import key_sums

THRESHOLD_WAYS = (8, 16, 32, 64)
"""Parts a pass of the threshold search, each timed with either sums (`part_threshold_{ways}w_us`,
`part_threshold_xla_{ways}w_us`; `sampling.FILTER_WAYS`)."""
IMPLS = {"sort": ("sort", "pallas"), "candidates": ("candidates", "pallas"), "threshold": ("threshold", "pallas"),
         "threshold_mosaic": ("threshold", "mosaic"), "threshold_xla": ("threshold", "xla"),
         "groups": ("groups", "pallas")}
"""The filters timed: name -> (`sampling.FILTER_IMPL`, `sampling.THRESHOLD_SUMS`)."""
SETTINGS = {"k50_p0.9": (50, 0.9, 3.0), "k20_p0.95": (20, 0.95, 3.0), "p0.9": (0, 0.9, 3.0),
            "p0.9_flat": (0, 0.9, 0.5)}
GROUP_SETTINGS = ((64, 64, 256), (128, 64, 256), (256, 32, 256))
"""(positions a group, groups gathered, candidates) of the group search, each timed alone
(`part_groups_{group}x{groups}_us`; `sampling.TOP_GROUP`, `TOP_GROUPS`, `TOP_CANDIDATES`)."""
PARTS_SETTING = "k50_p0.9"
"""The setting whose cells also time the parts (issue 16's; each part compiles once per cell)."""


def _filter(impl: str, sums: str):
    """`filtered_logprobs`, jitted, with `sampling.FILTER_IMPL` and `sampling.THRESHOLD_SUMS` set while it traces."""
    def run(logits, rp):
        saved = smp.FILTER_IMPL, smp.THRESHOLD_SUMS
        smp.FILTER_IMPL, smp.THRESHOLD_SUMS = impl, sums
        try:
            return smp.filtered_logprobs(logits, rp)
        finally:
            smp.FILTER_IMPL, smp.THRESHOLD_SUMS = saved
    return jax.jit(run)


def support_difference(z: np.ndarray, top_k: int, top_p: float, a, b) -> dict:
    """Where supports `a` and `b` (log-probs, -inf outside) differ: how many tokens, and for those the float64
    distance of the mass strictly above each from top_p, over the top-k-renormalised distribution (the rule's
    cut). Distances near float32 rounding say the two differ only in summation order at the cut."""
    diff = np.argwhere(np.isfinite(np.asarray(a)) != np.isfinite(np.asarray(b)))
    distances = []
    for row, token in diff[:32]:
        x = z[row].astype(np.float64)
        if 0 < top_k < x.size:
            x = np.where(x >= np.sort(x)[::-1][top_k - 1], x, -np.inf)
        p = np.exp(x - x.max())
        p /= p.sum()
        distances.append(abs(p[x > x[token]].sum() - top_p))
    return {"tokens_differing": int(len(diff)), "differing_mass_distance_max": max(distances, default=None)}


def part_times(z, top_k, top_p, reps: int) -> dict:
    """Microseconds of the searches' parts alone over these rows: a full descending sort, one `lax.top_k` of 64
    over the vocabulary, the candidate search's grouped `lax.top_k`, the whole threshold search with either
    sums at each number of ways, and the group search's cuts at each of `GROUP_SETTINGS`."""
    v = z.shape[-1]
    n_groups = -(-v // smp.FILTER_GROUP)
    grouped = jnp.pad(z, ((0, 0), (0, n_groups * smp.FILTER_GROUP - v)), constant_values=-jnp.inf)
    parts = {"part_sort_us": (jax.jit(lambda x: jnp.sort(x, axis=-1, descending=True)), (z,)),
             "part_top64_us": (jax.jit(lambda x: jax.lax.top_k(x, 64)[0]), (z,)),
             "part_grouped_top16_us": (jax.jit(lambda x: jax.lax.top_k(
                 x.reshape(x.shape[0], n_groups, smp.FILTER_GROUP), smp.FILTER_PER_GROUP)[0]), (grouped,))}
    searches = (("threshold", smp._threshold_keep_where_compiled),
                ("threshold_xla", functools.partial(smp._threshold_keep, impl="xla")))
    for name, keep in searches:
        for ways in THRESHOLD_WAYS:
            search = functools.partial(keep, ways=ways)
            parts[f"part_{name}_{ways}w_us"] = (jax.jit(search), (z, top_k, top_p))
    for group, groups, width in GROUP_SETTINGS:
        cuts = functools.partial(smp._group_cuts, group=group, groups=groups, width=width)
        parts[f"part_groups_{group}x{groups}_us"] = (jax.jit(cuts), (z, top_k, top_p))
    return {name: common.timed(fn, *args, reps=reps, warmup=2)[0] * 1e6 for name, (fn, args) in parts.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="small vocabulary on the CPU (smoke test)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    vocab, block = (4096, 4) if args.tiny else (151936, 16)
    impls = {name: _filter(*setting) for name, setting in IMPLS.items()}
    cells = []
    for batch in args.batches:
        rows = batch * block
        for name, (top_k, top_p, scale) in SETTINGS.items():
            logits = jnp.asarray(np.random.default_rng(0).normal(size=(rows, vocab)) * scale, jnp.float32)
            rp = smp.row_params(smp.Sampling(temperature=0.7, top_k=top_k, top_p=top_p), rows)
            z = logits / 0.7
            top_k_rows, top_p_rows = smp._per_row(rp.top_k, z), smp._per_row(rp.top_p, z)
            exact, _ = jax.jit(smp._candidate_cuts)(z, top_k_rows, top_p_rows)
            fits, _ = jax.jit(smp._group_cuts)(z, top_k_rows, top_p_rows)
            cell = {"batch": batch, "rows": rows, "vocab": vocab, "setting": name, "top_k": top_k, "top_p": top_p,
                    "logit_scale": scale, "candidates_exact": bool(jnp.all(exact)), "groups_fit": bool(jnp.all(fits))}
            outs = {}
            for impl, fn in impls.items():
                seconds, outs[impl] = common.timed(fn, logits, rp, reps=args.reps, warmup=2)
                cell[f"{impl}_us"] = seconds * 1e6
            for impl in [impl for impl in impls if impl != "sort"]:
                cell[f"same_support_{impl}"] = bool(jnp.array_equal(jnp.isfinite(outs[impl]),
                                                                    jnp.isfinite(outs["sort"])))
                difference = support_difference(np.asarray(z), top_k, top_p, outs[impl], outs["sort"])
                cell |= {f"{impl}_{key}": value for key, value in difference.items()}
                cell[f"sort_over_{impl}"] = cell["sort_us"] / cell[f"{impl}_us"]
            cell["same_support"] = cell["same_support_candidates"]
            if name == PARTS_SETTING:
                cell |= part_times(z, top_k_rows, top_p_rows, args.reps)
            print(cell)
            cells.append(cell)
    payload = common.environment(**vars(args)) | {"filter_group": smp.FILTER_GROUP,
                                                  "filter_per_group": smp.FILTER_PER_GROUP,
                                                  "filter_ways": smp.FILTER_WAYS, "key_sums_tile": key_sums.TILE,
                                                  "cells": cells}
    common.write_json(f"sampling_filter{'_tiny' if args.tiny else ''}.json", payload, args.out)
    return payload


if __name__ == "__main__":
    main()
