"""DSpark verify widths on the GPU: bucketed static blocks (`lax.switch`) against the full block, and
the batch verify budget (docs/architecture.md, "DSpark").

The verify width only caps how many drafts a round examines; it never changes the output. With
one static block the target still verifies all nd + 1 rows, so a narrow width saves nothing;
`verify_buckets` lets a round verify a smaller block when every active row's width fits.

- `buckets`: a DSpark drafter (Qwen3-8B z-lab shape, random bf16, no heads) under the ladder
  policy, with injected proposals whose first wrong slot is always k. Every round after the first
  then accepts k drafts and asks for width k + 2. Each cell times the round with the full block
  and with `--buckets`, at batch 1, 16 and 64.
- `budget`: the same drafter with a confidence head under `confidence-slot` (random heads, so
  rows ask for different widths), injected acceptance tau, buckets on. It compares no budget
  with a budget of `--budget-per-row` drafts a row, at batch 16 and 64: round time, acceptance
  length and tokens/s.

Each setting is compiled by an untimed run first. Outputs of every timed run must equal plain
greedy decoding.

    python bench/verify_width.py                                        # H200, both experiments
    python bench/verify_width.py --experiments budget --batches 16 64   # the budget cells alone
    python bench/verify_width.py --tiny                                 # CPU smoke test
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import jax.numpy as jnp
import numpy as np

import acceptance as acc
import common
import dflash_jax
from dflash_jax.io.checkpoints import make_drafter


def dspark_drafter(target, tiny: bool, confidence: bool):
    base = common.drafter_config(target.config, 16, 2 if tiny else 5)
    h, rank = target.config.hidden_size, 16 if tiny else 256
    cfg = dataclasses.replace(base, family="dspark", harvest="dspark", markov_rank=rank, markov=True,
                              confidence_in_dim=h + rank if confidence else None,
                              verify_policy="confidence-slot" if confidence else "ladder", adapt=True)
    dtype = jnp.float32 if tiny else jnp.bfloat16
    params = common._random_tree(common.drafter_family(cfg).param_shapes(cfg), dtype, 1)
    if confidence:  # centre the random confidence logits near the threshold so widths spread over 2..nd+1
        params["confidence_b"] = jnp.full((1,), 0.5, dtype)
        params["confidence_w"] = params["confidence_w"] * jnp.asarray(0.05, dtype)
    return make_drafter(cfg, params)


def timed(target, drafter, prompts, new: int, inject, **kw) -> dict:
    """One untimed run (compiles), then a timed one: round time over loop iterations."""
    runs = []
    for _ in range(2):
        t0 = time.perf_counter()
        out = dflash_jax.Session(target, drafter, prompts, max_new_tokens=new, inject=inject, **kw).run()
        runs.append((out, time.perf_counter() - t0))
    out, _ = runs[-1]
    st = out.stats
    iterations = max(st.per_row["rounds"])
    return {"round_s": st.decode_time_s / iterations, "decode_s": st.decode_time_s, "iterations": iterations,
            "acceptance_length": st.acceptance_length, "drafted_per_round": st.drafted / max(st.rounds, 1),
            "tokens_per_s": st.generated / st.decode_time_s, "tokens": out.tokens}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--buckets", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--accepts", type=int, nargs="+", default=[2, 6, 16], help="k: drafts every round accepts")
    ap.add_argument("--tau", type=float, default=6.5, help="injected acceptance length for the budget cells")
    ap.add_argument("--budget-per-row", type=int, default=6)
    ap.add_argument("--experiments", nargs="+", default=["buckets", "budget"], choices=["buckets", "budget"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    batches = args.batches or ([1, 4] if args.tiny else [1, 16, 64])
    if args.tiny:
        args.prompt, args.new, args.accepts = 32, 24, [2, 15]
    target = common.random_target(common.TINY if args.tiny else common.QWEN3_8B,
                                  jnp.float32 if args.tiny else jnp.bfloat16)
    cells = []
    payload = common.environment(**vars(args)) | {"cells": cells}

    def save():  # after every cell, so a run cut short keeps what it measured
        common.write_json(f"verify_width{'_tiny' if args.tiny else ''}.json", payload, args.out)

    for confidence in (False, True):
        if ("budget" if confidence else "buckets") not in args.experiments:
            continue
        drafter = dspark_drafter(target, args.tiny, confidence)
        nd = drafter.n_drafts
        for batch in batches:
            if confidence and batch == 1:
                continue
            prompts = acc.make_prompts(batch, args.prompt, target.config.vocab_size, 0)
            plain = np.asarray(dflash_jax.generate(target, None, prompts, max_new_tokens=args.new).tokens)
            if not confidence:
                for k in args.accepts:
                    inject = acc.injected(plain, np.eye(nd + 1)[min(k, nd)], args.new, nd)
                    full = timed(target, drafter, prompts, args.new, inject)
                    bucketed = timed(target, drafter, prompts, args.new, inject, verify_buckets=tuple(args.buckets))
                    same = full.pop("tokens") == bucketed.pop("tokens") == plain.tolist()
                    cells.append({"experiment": "buckets", "batch": batch, "accepted_per_round": k,
                                  "full_block": full, "bucketed": bucketed, "identical": same,
                                  "round_ratio": bucketed["round_s"] / full["round_s"]})
                    save()
                    print(f"buckets b={batch} k={k}: full {full['round_s'] * 1e3:.3f} ms, bucketed "
                          f"{bucketed['round_s'] * 1e3:.3f} ms a round ({cells[-1]['round_ratio']:.3f}); "
                          f"identical {same}")
                continue
            inject = acc.injected(plain, acc.first_wrong_probs(args.tau, nd), args.new, nd)
            budget = args.budget_per_row * batch
            base = timed(target, drafter, prompts, args.new, inject, verify_buckets=tuple(args.buckets))
            spent = timed(target, drafter.replace(config=dataclasses.replace(drafter.config, verify_budget=budget)),
                          prompts, args.new, inject, verify_buckets=tuple(args.buckets))
            same = base.pop("tokens") == spent.pop("tokens") == plain.tolist()
            cells.append({"experiment": "budget", "batch": batch, "budget": budget, "per_row": base,
                          "batch_budget": spent, "identical": same,
                          "tokens_per_s_ratio": spent["tokens_per_s"] / base["tokens_per_s"]})
            save()
            print(f"budget b={batch} ({budget} drafts): per-row {base['tokens_per_s']:.0f} tok/s "
                  f"(tau {base['acceptance_length']:.2f}, {base['round_s'] * 1e3:.3f} ms), budget "
                  f"{spent['tokens_per_s']:.0f} tok/s (tau {spent['acceptance_length']:.2f}, "
                  f"{spent['round_s'] * 1e3:.3f} ms); identical {same}")
    return payload


if __name__ == "__main__":
    main()
