"""Demo pair, step 4: train a DFlash (or, with `--family dspark` / `dflash2`, a DSpark or DFlash2) drafter
(block 16) for the demo target and export it.

    python bench/demo_pair/train_drafter.py --target .work/demo/target --data .work/demo/tok --out .work/demo/drafter

Three draft layers at the target's shapes (full attention; DFlash2's symmetric windows) tapping target layers 1, 3, 5
(the reference rule for 3 draft layers over 8), about 2.56M parameters (refused above
3M; a DFlash2 drafter with `--selector-rank 32` has 2.93M), mask token `<|mask|>` from the
target's tokenizer. Trained with `dflash_jax.train.train_drafter` on train.npy; `--out` receives
the family's checkpoint (config.json + model.safetensors, bfloat16) and train_log.json, to which the
held-out evaluation (loss, acceptance-length estimate, per-slot agreement with the target's
argmax) is added. Defaults are sized for about 3 minutes on one H200.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from dflash_jax import train  # noqa: E402
from dflash_jax.io.checkpoints import read_target  # noqa: E402
from dflash_jax.train.cli import add_family_args, family_kwargs  # noqa: E402

MAX_PARAMS = 3_000_000
BLOCK_SIZE = 16
MASK_TOKEN = "<|mask|>"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True, help="train_target.py's output directory")
    parser.add_argument("--data", type=Path, required=True, help="tokenizer output dir with train.npy, heldout.npy")
    parser.add_argument("--out", type=Path, required=True, help="output drafter directory (new or empty)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier checkpoint in --out")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--anchors-per-seq", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=None, help="default: min(100, steps // 10)")
    parser.add_argument("--gamma", type=float, default=7.0, help="slot weight decay (DFlash: 7 for b=16)")
    parser.add_argument("--dtype", default="bfloat16", choices=train.COMPUTE_DTYPES, help="compute dtype")
    parser.add_argument("--eval-batches", type=int, default=8, help="held-out batches for the final estimate")
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-file", type=Path, default=None,
                        help="training token stream (.npy); default DATA/train.npy (distill.py writes a better one)")
    parser.add_argument("--labels", default="data", choices=train.LABELS,
                        help="drafter targets: the text's tokens, or the target's argmax (TrainConfig.labels)")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="stop training after this many seconds (the schedule still spans --steps)")
    add_family_args(parser)
    args = parser.parse_args(argv)

    target = read_target(args.target, dtype=args.dtype)
    cfg = target.config
    mask_id = Tokenizer.from_file(str(args.target / "tokenizer.json")).token_to_id(MASK_TOKEN)
    if mask_id is None:
        raise ValueError(f"{args.target / 'tokenizer.json'} has no {MASK_TOKEN} token")
    dcfg, dparams = train.init_drafter(cfg, num_layers=args.layers, block_size=BLOCK_SIZE, mask_token_id=mask_id,
                                       seed=args.seed, **family_kwargs(args))
    n_params = train.param_count(dparams)
    print(f"drafter: {n_params:,} parameters, {dcfg.num_layers} layers, taps {list(dcfg.target_layer_ids)}, "
          f"block size {dcfg.block_size}, mask token {mask_id}", file=sys.stderr)
    assert n_params <= MAX_PARAMS, f"demo drafter has {n_params:,} parameters, above the {MAX_PARAMS:,} budget"

    tc = train.TrainConfig(
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, anchors_per_seq=args.anchors_per_seq,
        lr=args.lr, warmup_steps=min(100, args.steps // 10) if args.warmup_steps is None else args.warmup_steps,
        weight_decay=0.01, grad_clip=1.0, gamma=args.gamma, seed=args.seed, compute_dtype=args.dtype,
        log_every=args.log_every, time_budget_s=args.time_budget, labels=args.labels,
    )
    train_data = np.load(args.train_file or args.data / "train.npy").astype(np.int32)
    heldout = np.load(args.data / "heldout.npy").astype(np.int32)
    history = []
    t0 = time.perf_counter()
    dparams = train.train_drafter(target, train_data, dcfg, dparams, tc, out_dir=args.out,
                                   overwrite=args.overwrite, target_name=args.target.resolve().name, history=history)
    train_s = time.perf_counter() - t0
    evaluation = train.evaluate_drafter(target, heldout, dcfg, dparams, tc, n_batches=args.eval_batches)

    log_path = args.out / "train_log.json"
    log = json.loads(log_path.read_text())
    steady = history[-1]["tokens_per_s"] / (args.batch_size * args.seq_len)
    log.update(train_s=train_s, first_step_s=history[0]["first_step_s"], steps_per_s=steady, heldout=evaluation)
    train.write_log(log_path, log)
    print(json.dumps({"parameters": n_params, "first_step_s": log["first_step_s"], "train_s": train_s,
                      "steps_per_s": steady, "heldout": evaluation}, indent=1))
    print(f"held-out acceptance-length estimate {evaluation['acc_len']:.2f} (loss {evaluation['loss']:.4f}); "
          f"compile + first step {log['first_step_s']:.1f}s, {steady:.2f} steps/s after; wrote {args.out}")


if __name__ == "__main__":
    main()
