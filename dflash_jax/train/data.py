"""Training data: token streams from text or `.npy`, random windows and block anchors."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

CORPUS_SUFFIXES = (".txt", ".py")


def check_token_stream(data, vocab_size: int, min_len: int, what: str = "data") -> np.ndarray:
    """A 1-D int32 token stream with ids in range and at least `min_len` tokens, or ValueError."""
    arr = np.asarray(data)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{what}: expected a 1-D integer token stream; got shape {arr.shape}, dtype {arr.dtype}")
    if arr.size < min_len:
        raise ValueError(f"{what}: {arr.size} tokens, fewer than one training window ({min_len}); "
                         "use more text or a shorter seq_len")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"{what}: token ids must be in [0, {vocab_size}); found min {lo}, max {hi}")
    return arr.astype(np.int32, copy=False)


def sample_windows(rng: np.random.Generator, data: np.ndarray, batch_size: int, length: int) -> np.ndarray:
    """`int32 [batch_size, length]`: windows at uniform random starts in the stream."""
    starts = rng.integers(0, data.shape[0] - length + 1, size=batch_size)
    return data[starts[:, None] + np.arange(length)]


def sample_anchors(rng: np.random.Generator, batch_size: int, n_anchors: int, seq_len: int, span: int) -> np.ndarray:
    """`int32 [batch_size, n_anchors]`, sorted per row: distinct anchors in `[1, seq_len - span]`.

    `span` is the anchor plus the slots it labels: the block size for the mask-fill harvest,
    one more for the shifted one (its last row predicts the token after the block)."""
    n_choices = seq_len - span
    if n_anchors > n_choices:
        raise ValueError(
            f"anchors_per_seq {n_anchors} exceeds the {n_choices} possible anchors of a window "
            f"(seq_len {seq_len} - span {span}); lower anchors_per_seq or raise seq_len"
        )
    picks = np.argsort(rng.random((batch_size, n_choices)), axis=1)[:, :n_anchors]
    return (np.sort(picks, axis=1) + 1).astype(np.int32)


def corpus_files(path) -> list:
    """The text files of a corpus: the file itself, or every .txt/.py under a directory (sorted)."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ValueError(f"corpus {path}: no such file or directory")
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in CORPUS_SUFFIXES)
    if not files:
        raise ValueError(f"corpus directory {path} has no {' or '.join(CORPUS_SUFFIXES)} files")
    return files


def load_corpus(path, tokenizer=None, separator: Optional[int] = None) -> np.ndarray:
    """A 1-D int32 token stream from a `.npy` stream, a text file or a directory of text files.

    Text is encoded with `tokenizer` (a `tokenizers.Tokenizer`), one document per file,
    with `separator` (the eos id) between documents when given.
    """
    path = Path(path)
    if path.suffix == ".npy":
        arr = np.load(path)
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{path}: expected a 1-D integer token stream; got shape {arr.shape}, dtype {arr.dtype}")
        return arr.astype(np.int32)
    if tokenizer is None:
        raise ValueError(f"corpus {path} is text: a tokenizer (the target's tokenizer.json) is needed to encode it")
    docs = []
    for file in corpus_files(path):
        try:
            docs.append(file.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ValueError(f"corpus file {file} is not UTF-8 text ({e})") from e
    pieces = []
    for i, enc in enumerate(tokenizer.encode_batch(docs, add_special_tokens=False)):
        if i and separator is not None:
            pieces.append(np.array([separator], np.int32))
        pieces.append(np.asarray(enc.ids, np.int32))
    return np.concatenate(pieces)
