"""What a drafter's weight precision costs in acceptance: the bundled demo drafter's held-out acceptance length
at each precision (docs/architecture.md, "Weight precision"). The target stays float, so every output must
still equal plain decoding's.

The prompts are the demo pair's held-out set (`bench/demo_pair/corpus.py`: cuts of the running Python's
standard-library test packages, seed 0, as `prompts.json`), each continued greedily for `--new` tokens with and
without the drafter (`bench/demo_pair/evaluate.py`, batch 1, timed after an untimed pass that compiles).

    python bench/quant_acceptance.py                      # 32 prompts, bf16 q8_0 q4_0 int8 mixed (CPU: ~8 min)
    python bench/quant_acceptance.py --n 8 --precisions bf16 q8_0 q4_0
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_pair"))

import jax  # noqa: E402

import common  # noqa: E402
import corpus  # noqa: E402
import evaluate  # noqa: E402
from dflash_jax.config import policy  # noqa: E402
from dflash_jax.demo import load_demo  # noqa: E402

PROMPT_CHARS, SEED = 600, 0  # corpus.py's defaults: the prompts of bench/results/demo_eval_cpu.json


def heldout_prompts(n: int) -> list:
    """The first `n` held-out prompts `corpus.py` writes to prompts.json with its defaults."""
    split = corpus.split_stdlib(corpus.default_stdlib())
    if not split.heldout:
        raise SystemExit("this Python has no standard-library test packages (Debian/Ubuntu: libpython3.X-testsuite), "
                         "so there are no held-out prompts")
    return corpus.cut_prompts(split.heldout, n, PROMPT_CHARS, SEED)


def weight_bytes(params) -> int:
    """Bytes the drafter's weights hold on the device (packed values and scales for quantised leaves)."""
    return sum(x.nbytes for x in jax.tree.leaves(params))


def measure(precisions: list, heads: list, n: int, new: int, dtype: str, drafter: str) -> dict:
    """Rows keyed by precision, "+head" where the drafter read its own copy of the target's LM head
    (`Drafter.with_head`; `heads`: "copy", "target" or both) rather than the target's."""
    prompts = heldout_prompts(n)
    rows = {}
    for precision in precisions:
        for head in heads:
            demo = load_demo(dtype, drafter=drafter, precision=precision, proposal_head=head == "copy")
            copy = demo.drafter.head
            name = precision + ("+head" if copy is not None else "")
            if name in rows:
                continue
            res = evaluate.evaluate(demo, prompts, new, None)
            rows[name] = {"head": copy.fmt if copy is not None else "target",
                          "drafter_weight_bytes": weight_bytes(demo.drafter.params),
                          "head_bytes": copy.nbytes if copy is not None else 0,
                          **{k: v for k, v in res.items() if k != "prompts"}}
            print(f"{name:>10}: acceptance length {res['acceptance_length_mean']:.2f} (mean of prompts "
                  f"{res['acceptance_length_mean_of_prompts']:.2f}), outputs identical: {res['all_identical']}, "
                  f"drafter weights {rows[name]['drafter_weight_bytes'] / 2**20:.2f} MiB", flush=True)
    return {"precisions": rows, "n_prompts": len(prompts), "new_tokens": new, "drafter": drafter,
            **common.environment(dtype=dtype, prompt_chars=PROMPT_CHARS, seed=SEED)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precisions", nargs="+", default=["bf16", "q8_0", "q4_0", "int8", "mixed"],
                    choices=list(policy.PRECISIONS))
    ap.add_argument("--heads", nargs="+", default=["copy", "target"], choices=["copy", "target"],
                    help="the LM head a quantised drafter reads: its own copy (the library's default), the target's")
    ap.add_argument("--n", type=int, default=32, help="held-out prompts (the first n of prompts.json)")
    ap.add_argument("--new", type=int, default=128, help="new tokens per prompt")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--drafter", default="dflash", help="which bundled demo drafter")
    ap.add_argument("--out", default=os.path.join(common.RESULTS, "demo_quant_acceptance_cpu.json"))
    args = ap.parse_args(argv)
    report = measure(args.precisions, args.heads, args.n, args.new, args.dtype, args.drafter)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
