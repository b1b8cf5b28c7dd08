"""Demo-pair tokenizer: a byte-level BPE trained on the corpus written by corpus.py.

Hugging Face `tokenizers` BPE with the GPT-2 byte-level pre-tokenizer (no prefix space) and
byte-level decoder, so any text round-trips exactly. The special tokens come first so their
ids are fixed: `<|endoftext|>` = 0 (document separator, eos, pad) and `<|mask|>` = 1 (the
DFlash drafter's mask token). Trained on train.txt only; held-out text never shapes merges.

Outputs in TOKDIR: tokenizer.json, tokenizer_config.json (loadable by
`transformers.AutoTokenizer`), stats.json, and with --encode train.npy / heldout.npy
(int32 token ids, documents separated by the eos id).

Usage: python bench/demo_pair/tokenizer.py --corpus DIR --vocab-size 4096 --out TOKDIR [--encode]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Iterable

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from corpus import EOT_TOKEN

MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = (EOT_TOKEN, MASK_TOKEN)  # ids 0 and 1, in this order
EOT_ID = 0
MASK_ID = 1
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)


def tokenizer_config() -> dict:
    """tokenizer_config.json for `transformers.AutoTokenizer` / `PreTrainedTokenizerFast`."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOT_TOKEN,
        "pad_token": EOT_TOKEN,
        "mask_token": MASK_TOKEN,
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
    }


def split_documents(text: str) -> list[str]:
    """The documents of a corpus file: the pieces between end-of-text markers."""
    return text.split(EOT_TOKEN)


def train_tokenizer(documents: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE of at most `vocab_size` tokens (specials at ids 0 and 1)."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size} is below {MIN_VOCAB_SIZE} (256 bytes + {len(SPECIAL_TOKENS)} "
            "special tokens); the demo uses 4096..8192"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer)
    ids = [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
    if ids != [EOT_ID, MASK_ID]:
        raise ValueError(f"special token ids came out {ids}, expected [{EOT_ID}, {MASK_ID}]")
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out_dir: Path) -> Path:
    """Write tokenizer.json and tokenizer_config.json to `out_dir`; return tokenizer.json's path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "tokenizer.json"
    tokenizer.save(str(path))
    config_json = json.dumps(tokenizer_config(), indent=1) + "\n"
    (out_dir / "tokenizer_config.json").write_text(config_json)
    return path


def encode_documents(tokenizer: Tokenizer, documents: list[str]) -> np.ndarray:
    """Token ids of `documents` (encoded in parallel) with the eos id between consecutive ones."""
    encodings = tokenizer.encode_batch(documents, add_special_tokens=False)
    pieces = []
    for i, enc in enumerate(encodings):
        if i:
            pieces.append(np.array([EOT_ID], dtype=np.int32))
        pieces.append(np.asarray(enc.ids, dtype=np.int32))
    return np.concatenate(pieces) if pieces else np.zeros((0,), np.int32)


def encode_corpus(tokenizer_json_path: str | Path, text_path: str | Path) -> np.ndarray:
    """int32 token ids of a corpus file: documents split at `<|endoftext|>`, eos id re-inserted.

    Equal to encoding the whole file in one call, but parallel over documents.
    """
    tokenizer = Tokenizer.from_file(str(tokenizer_json_path))
    text = Path(text_path).read_bytes().decode("utf-8")
    return encode_documents(tokenizer, split_documents(text))


def tokens_per_byte(tokenizer: Tokenizer, documents: list[str]) -> tuple[int, int]:
    """(tokens, UTF-8 bytes) over `documents`, separators excluded."""
    encodings = tokenizer.encode_batch(documents, add_special_tokens=False)
    return sum(len(e.ids) for e in encodings), sum(len(d.encode("utf-8")) for d in documents)


def read_documents(path: Path) -> list[str]:
    return split_documents(path.read_bytes().decode("utf-8"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--corpus", type=Path, required=True, help="corpus.py's output dir")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--out", type=Path, required=True, help="tokenizer output directory")
    parser.add_argument("--encode", action="store_true", help="write train.npy, heldout.npy")
    args = parser.parse_args(argv)
    paths = {name: args.corpus / f"{name}.txt" for name in ("train", "heldout")}
    missing = [str(p) for p in paths.values() if not p.is_file()]
    if missing:
        raise ValueError(
            f"corpus files {missing} not found; run corpus.py --out {args.corpus} first"
        )

    t0 = time.perf_counter()
    tokenizer = train_tokenizer(read_documents(paths["train"]), args.vocab_size)
    tokenizer_path = save_tokenizer(tokenizer, args.out)
    stats = {
        "vocab_size": tokenizer.get_vocab_size(),
        "train_seconds": round(time.perf_counter() - t0, 2),
    }
    n_tokens, n_bytes = tokens_per_byte(tokenizer, read_documents(paths["heldout"]))
    stats.update(
        heldout_tokens=n_tokens,
        heldout_bytes=n_bytes,
        heldout_tokens_per_byte=round(n_tokens / n_bytes, 4),
    )
    if args.encode:
        t0 = time.perf_counter()
        for name, path in paths.items():
            ids = encode_corpus(tokenizer_path, path)
            np.save(args.out / f"{name}.npy", ids)
            stats[f"{name}_npy_tokens"] = int(ids.size)
        stats["encode_seconds"] = round(time.perf_counter() - t0, 2)
    (args.out / "stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    print(json.dumps(stats, indent=1))


if __name__ == "__main__":
    main()
