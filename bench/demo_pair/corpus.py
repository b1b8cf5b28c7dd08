"""Demo-pair corpus: the running Python's standard library, split into train and held-out.

Split rule: a stdlib `.py` file is *held out* when any directory component of its path
(relative to the stdlib root) is one of `test`, `tests` or `idle_test` -- the standard
library's test packages (`test/`, `unittest/test/`, `lib2to3/tests/`, `idlelib/idle_test/`,
...). Every other `.py` file is *training* data. `site-packages`/`dist-packages` are skipped
entirely, and so are files that are not valid UTF-8 or that contain the end-of-text marker.

Outputs (all byte-for-byte deterministic for a given Python installation):
  train.txt, heldout.txt  one document per file, exact file contents, sorted by relative
                          path, joined by `<|endoftext|>` (between documents, not after)
  prompts.json            held-out prompts: contiguous whole-line cuts of held-out files
  manifest.json           Python version, split rule, file/byte counts, sha256 of outputs

Usage: python bench/demo_pair/corpus.py --out DIR [--stdlib PATH] [--n-prompts 32]
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import sys
import sysconfig
from pathlib import Path

import numpy as np

EOT_TOKEN = "<|endoftext|>"
TEST_DIR_NAMES = frozenset({"test", "tests", "idle_test"})
SKIPPED_DIR_NAMES = frozenset({"site-packages", "dist-packages", "__pycache__"})
SPLIT_RULE = (
    "held-out = .py files with a directory component in {'test', 'tests', 'idle_test'}; "
    "train = all other .py files; site-packages, dist-packages, __pycache__ skipped; "
    "files that are not UTF-8 or contain '<|endoftext|>' skipped"
)


@dataclasses.dataclass(frozen=True)
class SourceFile:
    """One stdlib source file: POSIX path relative to the stdlib root, and its exact text."""

    relpath: str
    text: str


@dataclasses.dataclass(frozen=True)
class CorpusSplit:
    """Sorted training and held-out files, plus the files skipped and why."""

    train: tuple[SourceFile, ...]
    heldout: tuple[SourceFile, ...]
    skipped: tuple[tuple[str, str], ...]  # (relpath, reason)


def default_stdlib() -> Path:
    """The running interpreter's pure-Python standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relpath: str) -> bool:
    """True when a directory component of `relpath` names a test package."""
    return any(part in TEST_DIR_NAMES for part in relpath.split("/")[:-1])


def list_py_files(stdlib: Path) -> list[str]:
    """Relative POSIX paths of every `.py` file under `stdlib`, sorted, skipped dirs pruned."""
    if not stdlib.is_dir():
        raise ValueError(
            f"stdlib directory {str(stdlib)!r} does not exist; pass an existing directory"
        )
    found = []
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIR_NAMES]
        rel_root = Path(root).relative_to(stdlib)
        found.extend((rel_root / f).as_posix() for f in files if f.endswith(".py"))
    return sorted(found)


def read_source(path: Path) -> str | None:
    """Exact UTF-8 text of `path` (line endings untouched), or None if it is not UTF-8."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return None


def split_stdlib(stdlib: Path) -> CorpusSplit:
    """Read every stdlib `.py` file and split it into training and held-out documents."""
    train, heldout, skipped = [], [], []
    for relpath in list_py_files(stdlib):
        text = read_source(stdlib / relpath)
        if text is None:
            skipped.append((relpath, "not valid UTF-8"))
        elif EOT_TOKEN in text:
            skipped.append((relpath, f"contains {EOT_TOKEN}"))
        else:
            (heldout if is_heldout(relpath) else train).append(SourceFile(relpath, text))
    return CorpusSplit(tuple(train), tuple(heldout), tuple(skipped))


def join_documents(files: tuple[SourceFile, ...]) -> str:
    """One document per file, joined by the end-of-text marker."""
    return EOT_TOKEN.join(f.text for f in files)


def line_starts(text: str) -> np.ndarray:
    """Character offsets at which the lines of `text` start, plus `len(text)` as the last end."""
    starts = [0] + [i + 1 for i, ch in enumerate(text) if ch == "\n" and i + 1 < len(text)]
    return np.asarray(starts + [len(text)], dtype=np.int64)


def is_mostly_whitespace(text: str) -> bool:
    """True when fewer than half of the characters of `text` are non-whitespace."""
    return 2 * sum(not ch.isspace() for ch in text) < len(text)


def cut_prompt(source: SourceFile, prompt_chars: int, rng: np.random.Generator) -> dict | None:
    """A whole-line cut of at most `prompt_chars` characters from a random line of `source`.

    The start leaves at least `prompt_chars` characters of the file after the cut's nominal
    end, so every prompt has a real continuation. Returns None when the file is too short,
    the cut is shorter than half of `prompt_chars` (very long lines), or mostly whitespace.
    """
    bounds = line_starts(source.text)
    candidates = bounds[:-1][bounds[:-1] + 2 * prompt_chars <= len(source.text)]
    if candidates.size == 0:
        return None
    start = int(rng.choice(candidates))
    end = int(bounds[bounds <= start + prompt_chars][-1])
    text = source.text[start:end]
    if 2 * len(text) < prompt_chars or is_mostly_whitespace(text):
        return None
    return {
        "file": source.relpath,
        "char_start": start,
        "char_end": end,
        "line_start": int(np.searchsorted(bounds, start)),
        "line_end": int(np.searchsorted(bounds, end)),
        "text": text,
    }


def cut_prompts(
    heldout: tuple[SourceFile, ...], n_prompts: int, prompt_chars: int, seed: int
) -> list[dict]:
    """`n_prompts` prompts from distinct held-out files visited in a seeded random order."""
    if n_prompts < 1 or prompt_chars < 1:
        raise ValueError(
            f"n_prompts={n_prompts} and prompt_chars={prompt_chars} must both be >= 1"
        )
    rng = np.random.default_rng(seed)
    prompts = []
    for index in rng.permutation(len(heldout)):
        prompt = cut_prompt(heldout[index], prompt_chars, rng)
        if prompt is not None:
            prompts.append({"index": len(prompts), **prompt})
        if len(prompts) == n_prompts:
            return prompts
    raise ValueError(
        f"only {len(prompts)} of {len(heldout)} held-out files yield a {prompt_chars}-character "
        f"prompt, fewer than n_prompts={n_prompts}; lower --n-prompts or --prompt-chars"
    )


def sha256_file(path: Path) -> str:
    """Hex sha256 of the bytes of `path`."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_text(path: Path, text: str) -> int:
    """Write `text` as UTF-8 with no newline translation; return the number of bytes."""
    data = text.encode("utf-8")
    path.write_bytes(data)
    return len(data)


def build_corpus(
    out_dir: Path,
    stdlib: Path | None = None,
    n_prompts: int = 32,
    prompt_chars: int = 600,
    seed: int = 0,
) -> dict:
    """Write train.txt, heldout.txt, prompts.json and manifest.json; return the manifest."""
    stdlib = default_stdlib() if stdlib is None else Path(stdlib)
    split = split_stdlib(stdlib)
    if not split.train or not split.heldout:
        raise ValueError(
            f"stdlib {str(stdlib)!r} gave {len(split.train)} training and {len(split.heldout)} "
            "held-out files; both must be non-empty (is the `test` package installed? "
            "Debian/Ubuntu ship it separately as libpython3.X-testsuite)"
        )
    prompts = cut_prompts(split.heldout, n_prompts, prompt_chars, seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = {
        "python_version": sys.version,
        "python_implementation": platform.python_implementation(),
        "stdlib": str(stdlib),
        "split_rule": SPLIT_RULE,
        "eot_token": EOT_TOKEN,
        "skipped": [{"file": f, "reason": r} for f, r in split.skipped],
    }
    for name, files in (("train", split.train), ("heldout", split.heldout)):
        path = out_dir / f"{name}.txt"
        n_bytes = write_text(path, join_documents(files))
        manifest[name] = {
            "files": len(files),
            "bytes": n_bytes,
            "document_bytes": sum(len(f.text.encode("utf-8")) for f in files),
            "sha256": sha256_file(path),
        }
    prompts_path = out_dir / "prompts.json"
    prompts_doc = {"seed": seed, "prompt_chars": prompt_chars, "prompts": prompts}
    write_text(prompts_path, json.dumps(prompts_doc, indent=1, ensure_ascii=False) + "\n")
    manifest["prompts"] = {"count": len(prompts), "sha256": sha256_file(prompts_path)}
    write_text(out_dir / "manifest.json", json.dumps(manifest, indent=1) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument(
        "--stdlib", type=Path, default=None, help="stdlib root (default: the running Python's)"
    )
    parser.add_argument("--n-prompts", type=int, default=32)
    parser.add_argument("--prompt-chars", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    manifest = build_corpus(args.out, args.stdlib, args.n_prompts, args.prompt_chars, args.seed)
    summary = {"python": platform.python_version()}
    summary.update({k: manifest[k] for k in ("train", "heldout", "prompts")})
    summary["skipped"] = len(manifest["skipped"])
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
