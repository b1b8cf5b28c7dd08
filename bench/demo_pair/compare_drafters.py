"""Held-out acceptance length of several drafters on one target, greedy and sampled.

All prompts decode as one ragged batch per setting; acceptance length is tokens committed per
round over all rounds (`Stats.acceptance_length`). Each greedy run is checked token-identical
to plain greedy decoding. Every drafter runs at T = 0 and at T = 0.7 with argmax proposals. By
default a DSpark drafter also runs its sampled chain and the mask-fill harvest, the wrong one for
its shifted training, which should accept almost nothing, and a DFlash2 drafter its sampled selector
walk (`proposal="sample"`); `--extras-for` keeps those extra cells to the drafters it names.

    python bench/demo_pair/compare_drafters.py --target T --drafters D1 D2 --prompts DATA/prompts.json --out F
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402
import dflash_jax  # noqa: E402
from dflash_jax import load_tokenizer  # noqa: E402


def settings(family: str, extras: bool = True) -> list:
    """(label, load overrides, Sampling) cells for a drafter family; `extras`: its family-specific cells too."""
    cells = [("T=0", {}, dflash_jax.Sampling()),
             ("T=0.7 argmax proposals", {}, dflash_jax.Sampling(temperature=0.7, seed=1))]
    if extras and family == "dspark":
        cells += [("T=0.7 sampled chain", {}, dflash_jax.Sampling(temperature=0.7, seed=1, proposal="sample")),
                  ("T=0 wrong (mask-fill) harvest", {"harvest": "dflash"}, dflash_jax.Sampling())]
    if extras and family == "dflash2":
        cells += [("T=0.7 sampled walk", {}, dflash_jax.Sampling(temperature=0.7, seed=1, proposal="sample"))]
    return cells


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="target directory with tokenizer.json")
    ap.add_argument("--drafters", nargs="+", required=True, help="drafter directories")
    ap.add_argument("--prompts", required=True, help="prompts.json from corpus.py")
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--out", required=True)
    ap.add_argument("--extras-for", nargs="*",
                    help="drafter directories that also run their family's extra cells (default: every drafter)")
    args = ap.parse_args(argv)
    extras_for = None if args.extras_for is None else {os.path.realpath(p) for p in args.extras_for}
    target = dflash_jax.load_target(args.target, "float32")
    tokenizer = load_tokenizer(args.target)
    prompts = [tokenizer.encode(p["text"]) for p in json.load(open(args.prompts))["prompts"][: args.n]]
    stops = target.config.eos_token_ids
    plain = dflash_jax.generate(target, None, prompts, max_new_tokens=args.new, stop_tokens=stops).tokens
    results = []
    for path in args.drafters:
        family = dflash_jax.load_drafter(path, target, "float32").config.family
        extras = extras_for is None or os.path.realpath(path) in extras_for
        for label, overrides, sampling in settings(family, extras):
            drafter = dflash_jax.load_drafter(path, target, "float32", **overrides)
            t0 = time.perf_counter()
            out = dflash_jax.generate(target, drafter, prompts, max_new_tokens=args.new, stop_tokens=stops,
                                      sampling=sampling)
            st = out.stats
            rec = {"drafter": path, "family": family, "setting": label, "harvest": drafter.config.harvest,
                   "verify_policy": drafter.config.verify_policy, "acceptance_length": st.acceptance_length,
                   "rounds": st.rounds, "drafted": st.drafted, "accepted": st.accepted, "generated": st.generated,
                   "identical_to_plain": out.tokens == plain if sampling.greedy else None,
                   "wall_s_with_compile": time.perf_counter() - t0}
            results.append(rec)
            differs = "" if rec["identical_to_plain"] in (None, True) else " NOT IDENTICAL"
            print(f"{family:7s} {label:32s} acceptance length {st.acceptance_length:.2f} "
                  f"({st.accepted}/{st.drafted} drafts accepted){differs}")
    payload = common.environment(target=args.target, n_prompts=len(prompts), new_tokens=args.new) | {"cells": results}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(payload, f, indent=1)
    return payload


if __name__ == "__main__":
    main()
