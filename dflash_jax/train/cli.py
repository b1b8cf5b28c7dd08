"""`dflash-jax train-drafter`: tokenize a corpus, train a DFlash, DSpark or DFlash2 drafter for a target, export
it."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

from tokenizers import Tokenizer

from dflash_jax.config import CheckpointError
from dflash_jax.io import checkpoints, publish
from dflash_jax.train.data import check_token_stream, load_corpus
from dflash_jax.train.loop import (
    COMPUTE_DTYPES,
    DFLASH2_DEFAULTS,
    LABELS,
    TRAINABLE_FAMILIES,
    TrainConfig,
    check_drafter_for_target,
    init_drafter,
    param_count,
    train_drafter,
)

MASK_TOKEN = "<|mask|>"
EOT_TOKEN = "<|endoftext|>"
REFUSALS = (CheckpointError, ValueError, OSError)
"""What the `dflash-jax` commands report as a one-line refusal (UnicodeError is a ValueError)."""


def refuse(error: BaseException, debug: bool = False) -> int:
    """Print `error` as one `refused:` line on stderr and return the exit status 1; with `debug`, re-raise it.
    Shared by every subcommand (`dflash_jax/cli.py` imports it: this module cannot import that one)."""
    if debug:
        raise error
    text = "; ".join([str(error) or type(error).__name__, *getattr(error, "__notes__", ())])
    print(f"refused: {' '.join(text.split())}", file=sys.stderr)
    return 1


def add_family_args(p) -> None:
    """`--family` and its size flags: which drafter family to train, with which heads."""
    p.add_argument("--family", default="dflash", choices=list(TRAINABLE_FAMILIES),
                   help="dflash: mask-fill (rows 1..b-1); dspark: shifted labels (rows 0..b-1) and optional heads; "
                        "dflash2: mask-fill with dynamic convolutions and a candidate selector")
    p.add_argument("--markov-rank", type=int, help="DSpark: add a Markov head of this rank")
    p.add_argument("--confidence", action="store_true", help="DSpark: add a confidence head (sizes verify windows)")
    d = DFLASH2_DEFAULTS
    p.add_argument("--selector-rank", type=int,
                   help=f"DFlash2: the selector's codebook rank (default {d['selector_rank']})")
    p.add_argument("--selector-top-k", type=int,
                   help=f"DFlash2: candidates per slot the selector walks over (default {d['selector_top_k']})")
    p.add_argument("--conv-kernel-size", type=int,
                   help=f"DFlash2: taps of the dynamic convolutions (default {d['conv_kernel_size']})")
    p.add_argument("--conv-group-size", type=int,
                   help=f"DFlash2: channels sharing one dynamic kernel (default {d['conv_group_size']}; it must "
                        "divide the hidden size)")
    p.add_argument("--sliding-window", type=int,
                   help="DFlash2: the layers' symmetric window (default the target's max_position_embeddings)")


def family_kwargs(args) -> dict:
    """`init_drafter` keywords from `add_family_args`'s flags."""
    return dict(family=args.family, markov_rank=args.markov_rank, confidence=args.confidence,
                selector_rank=args.selector_rank, selector_top_k=args.selector_top_k,
                conv_kernel_size=args.conv_kernel_size, conv_group_size=args.conv_group_size,
                sliding_window=args.sliding_window)


def add_cli(subparsers) -> None:
    """Register `train-drafter` on an argparse subparsers object."""
    d = TrainConfig()
    p = subparsers.add_parser(
        "train-drafter",
        help="train a DFlash, DSpark or DFlash2 drafter for a Hugging Face target on a text corpus",
        description="Train a DFlash (DFlashDraftModel), DSpark (DSparkDraftModel) or DFlash2 (DFlash2DraftModel) "
                    "drafter for a frozen Qwen3/Llama target.",
    )
    p.add_argument("--target", required=True, help="target directory: config.json, *.safetensors, tokenizer.json")
    p.add_argument("--corpus", required=True,
                   help="a text file, a directory of .txt/.py files (one document each), or a .npy token stream")
    p.add_argument("--out", required=True,
                   help="output directory for the drafter checkpoint and train_log.json (new or empty)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the whole contents of a non-empty --out holding an earlier checkpoint")
    p.add_argument("--layers", type=int, default=2,
                   help="draft layers (default 2; published Qwen3-8B drafters use 5)")
    p.add_argument("--block-size", type=int, default=16, help="block size b: anchor + b-1 drafts (default 16)")
    p.add_argument("--intermediate-size", type=int,
                   help="the drafter's MLP width (default the target's; required for a target whose MLPs are experts)")
    p.add_argument("--mask-token-id", type=int,
                   help=f"mask token id (default: the tokenizer's {MASK_TOKEN}; required if it has none)")
    p.add_argument("--target-layer-ids", type=lambda s: tuple(int(x) for x in s.split(",")),
                   help="comma-separated target layers to tap (default: the reference rule)")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--anchors-per-seq", type=int, default=d.anchors_per_seq)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup-steps", type=int, help="default: min(100, steps // 10)")
    p.add_argument("--gamma", type=float, default=d.gamma,
                   help="slot weight decay exp(-(k-1)/gamma) (default 7, DFlash's for b=16; 5 for b=10, 4 for b=8)")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, help="0: final checkpoint only")
    p.add_argument("--dtype", default=d.compute_dtype, choices=COMPUTE_DTYPES, help="compute dtype")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--time-budget", type=float, help="stop after this many seconds and export (default: no limit)")
    p.add_argument("--labels", default=d.labels, choices=LABELS,
                   help="data: the corpus's next tokens (published objective, default); target: the target's "
                        "argmax at each position (learns the target's choices from any text)")
    add_family_args(p)
    p.set_defaults(func=cli_train_drafter)


def _tokenizer(target_dir) -> Optional[Tokenizer]:
    path = os.path.join(os.fspath(target_dir), "tokenizer.json")
    return Tokenizer.from_file(path) if os.path.isfile(path) else None


def _prepare(args) -> tuple:
    """(Target, data, DrafterConfig, params, TrainConfig) for the command, refusing bad input early."""
    publish.destination(args.out, args.overwrite)
    tc = TrainConfig(
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, anchors_per_seq=args.anchors_per_seq,
        lr=args.lr, warmup_steps=min(100, args.steps // 10) if args.warmup_steps is None else args.warmup_steps,
        gamma=args.gamma, seed=args.seed, compute_dtype=args.dtype, checkpoint_every=args.checkpoint_every,
        time_budget_s=args.time_budget, labels=args.labels,
    )
    tokenizer = _tokenizer(args.target)
    mask_id = args.mask_token_id
    if mask_id is None:
        mask_id = tokenizer.token_to_id(MASK_TOKEN) if tokenizer is not None else None
        if mask_id is None:
            raise ValueError(
                f"the target's tokenizer has no {MASK_TOKEN} token (or {args.target} has no tokenizer.json); "
                "pass --mask-token-id with the id of a token the target never produces"
            )
    if tokenizer is None and Path(args.corpus).suffix != ".npy":
        raise ValueError(f"{args.target} has no tokenizer.json, needed to tokenize the text corpus {args.corpus}")
    target = checkpoints.read_target(args.target, dtype=args.dtype)
    cfg = target.config
    separator = tokenizer.token_to_id(EOT_TOKEN) if tokenizer is not None else None
    if separator is None and cfg.eos_token_ids:
        separator = cfg.eos_token_ids[0]
    data = load_corpus(args.corpus, tokenizer, separator)
    dcfg, dparams = init_drafter(cfg, num_layers=args.layers, block_size=args.block_size, mask_token_id=mask_id,
                                 target_layer_ids=args.target_layer_ids, intermediate_size=args.intermediate_size,
                                 seed=args.seed, **family_kwargs(args))
    check_drafter_for_target(cfg, dcfg, dparams, tc)
    check_token_stream(data, cfg.vocab_size, tc.seq_len, f"corpus {args.corpus}")
    return target, data, dcfg, dparams, tc


def cli_train_drafter(args) -> int:
    """`dflash-jax train-drafter`: tokenize the corpus, train, export; 1 with the reason if refused."""
    try:
        target, data, dcfg, dparams, tc = _prepare(args)
    except REFUSALS as e:
        return refuse(e, getattr(args, "debug", False))
    print(f"corpus: {data.shape[0]:,} tokens; drafter: {dcfg.num_layers} layers, {param_count(dparams):,} "
          f"parameters, taps {list(dcfg.target_layer_ids)}, block size {dcfg.block_size}, "
          f"mask token {dcfg.mask_token_id}", file=sys.stderr)
    history = []
    train_drafter(target, data, dcfg, dparams, tc, out_dir=args.out, overwrite=args.overwrite,
                  target_name=os.path.basename(os.path.abspath(args.target)), history=history)
    print(f"wrote {args.out} (acceptance-length estimate on training batches {history[-1]['acc_len']:.2f})")
    return 0
