"""Demo pair, step 3: pretrain the tiny Qwen3 target on the encoded corpus and export it.

    python bench/demo_pair/train_target.py --data .work/demo/tok --out .work/demo/target [--steps N]

`--data` is the tokenizer step's output (tokenizer.json, tokenizer_config.json, train.npy,
heldout.npy). The model is a Qwen3ForCausalLM: hidden 256, 8 layers, 4 query heads and 2
KV heads of 64, SwiGLU 768, tied embeddings, rope theta 10000, vocab from the tokenizer
(about 7.35M parameters; refused above 8M). Next-token training on random 512-token
windows of train.npy, bfloat16 compute with float32 master weights (dflash_jax.train).

Defaults: 1500 steps of 64 x 512 tokens (49M tokens, about 14 passes over the 3.5M-token
training split; the held-out loss at the end says whether that overfits).

`--out` receives config.json + model.safetensors (bfloat16; `transformers` loads it with
`AutoModelForCausalLM.from_pretrained`), the tokenizer files, and train_log.json (configs,
logged losses, timings, held-out loss and perplexity on evenly spaced held-out windows).
Defaults are sized for about 4 minutes on one H200 including compilation; the timings
printed at the end say how to rescale `--steps`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from dflash_jax import train  # noqa: E402
from dflash_jax.io.checkpoints import make_target, write_target  # noqa: E402
from dflash_jax.config import RopeConfig, TargetConfig, target_to_hf_config  # noqa: E402

MAX_PARAMS = 8_000_000
EOT_TOKEN = "<|endoftext|>"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def demo_target_config(vocab_size: int, eos_id: int) -> TargetConfig:
    """The demo target's shape: a Qwen3 of about 7.35M parameters at vocab 4096."""
    return TargetConfig(
        arch="qwen3",
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=768,
        num_layers=8,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope=RopeConfig(theta=10000.0),
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        eos_token_ids=(eos_id,),
        dtype="bfloat16",
    )


def load_split(data_dir: Path, name: str) -> np.ndarray:
    path = data_dir / f"{name}.npy"
    if not path.is_file():
        raise ValueError(f"{path} not found; run bench/demo_pair/tokenizer.py --encode --out {data_dir} first")
    return np.load(path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="tokenizer output dir with train.npy, heldout.npy")
    parser.add_argument("--out", type=Path, required=True, help="output Qwen3ForCausalLM directory (new or empty)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier checkpoint in --out")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1.5e-3)
    parser.add_argument("--warmup-steps", type=int, default=None, help="default: min(200, steps // 10)")
    parser.add_argument("--dtype", default="bfloat16", choices=train.COMPUTE_DTYPES, help="compute dtype")
    parser.add_argument("--eval-batches", type=int, default=16, help="held-out batches for the final loss")
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-budget", type=float, default=None,
                        help="stop training after this many seconds (the schedule still spans --steps)")
    args = parser.parse_args(argv)

    tokenizer = Tokenizer.from_file(str(args.data / "tokenizer.json"))
    eos_id = tokenizer.token_to_id(EOT_TOKEN)
    if eos_id is None:
        raise ValueError(f"{args.data / 'tokenizer.json'} has no {EOT_TOKEN} token")
    cfg = demo_target_config(tokenizer.get_vocab_size(), eos_id)
    params = train.init_target(cfg, args.seed)
    n_params = train.param_count(params)
    print(f"target: {n_params:,} parameters ({target_to_hf_config(cfg)['architectures'][0]})", file=sys.stderr)
    assert n_params <= MAX_PARAMS, f"demo target has {n_params:,} parameters, above the {MAX_PARAMS:,} budget"

    tc = train.TrainConfig(
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
        warmup_steps=min(200, args.steps // 10) if args.warmup_steps is None else args.warmup_steps,
        weight_decay=0.1, grad_clip=1.0, seed=args.seed, compute_dtype=args.dtype, log_every=args.log_every,
        time_budget_s=args.time_budget,
    )
    train_data, heldout = load_split(args.data, "train"), load_split(args.data, "heldout")
    history = []
    t0 = time.perf_counter()
    params = train.pretrain_target(cfg, params, train_data, tc, history=history)
    train_s = time.perf_counter() - t0
    evaluation = train.evaluate_target(cfg, params, heldout, seq_len=args.seq_len, batch_size=args.batch_size,
                                       n_batches=args.eval_batches, compute_dtype=args.dtype)

    write_target(args.out, make_target(cfg, params), dtype="bfloat16", overwrite=args.overwrite)
    for name in TOKENIZER_FILES:
        shutil.copy(args.data / name, args.out / name)
    steady = history[-1]["tokens_per_s"] / (args.batch_size * args.seq_len)
    log = {
        "kind": "demo-target",
        "parameters": n_params,
        "target_config": target_to_hf_config(cfg),
        "train_config": dataclasses.asdict(tc),
        "train_tokens": int(train_data.shape[0]),
        "epochs": tc.steps * tc.batch_size * (tc.seq_len + 1) / train_data.shape[0],
        "first_step_s": history[0]["first_step_s"],
        "train_s": train_s,
        "steps_per_s": steady,
        "heldout": evaluation,
        "history": history,
    }
    train.write_log(args.out / "train_log.json", log)
    print(json.dumps({k: log[k] for k in ("parameters", "epochs", "first_step_s", "train_s", "steps_per_s", "heldout")},
                     indent=1))
    print(f"held-out loss {evaluation['loss']:.4f}, perplexity {evaluation['perplexity']:.2f}; "
          f"compile + first step {history[0]['first_step_s']:.1f}s, {steady:.2f} steps/s after; wrote {args.out}")


if __name__ == "__main__":
    main()
