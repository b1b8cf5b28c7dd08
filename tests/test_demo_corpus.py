"""Demo-pair corpus and tokenizer (bench/demo_pair): split rule, determinism, prompts, BPE."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

DEMO_DIR = Path(__file__).resolve().parents[1] / "bench" / "demo_pair"
sys.path.insert(0, str(DEMO_DIR))
import corpus  # noqa: E402
import tokenizer as demo_tokenizer  # noqa: E402

PROMPT_CHARS = 80


def _code(name: str, n_lines: int = 30) -> str:
    """A small Python-looking file whose lines are distinct."""
    lines = [f"def {name}_{i}(x):\n    return x + {i}  # é\n" for i in range(n_lines // 2)]
    return f'"""Module {name}."""\n' + "".join(lines)


FAKE_STDLIB = {
    "os_like.py": _code("os_like"),
    "test_at_top.py": _code("top"),  # a file named test_*, not inside a test dir: training
    "testing/helpers.py": _code("helpers"),  # 'testing' is not a test-package name
    "pkg/__init__.py": "",
    "pkg/core.py": "x = 1\r\ny = 2\r\n",  # CRLF kept exactly
    "pkg/test/test_core.py": _code("test_core"),
    "pkg/tests/helper.py": _code("helper"),
    "test/test_alpha.py": _code("alpha"),
    "test/support/util.py": _code("util"),
    "idlelib/idle_test/test_editor.py": _code("editor"),
    "idlelib/editor.py": _code("editor_impl"),
    "test/tiny.py": "pass\n",  # too short to cut a prompt from
    "site-packages/thirdparty.py": _code("thirdparty"),
    "site-packages/test/test_thirdparty.py": _code("thirdparty_test"),
    "pkg/notes.txt": "not python\n",
}
EXPECTED_TRAIN = [
    "idlelib/editor.py", "os_like.py", "pkg/__init__.py", "pkg/core.py",
    "test_at_top.py", "testing/helpers.py",
]
EXPECTED_HELDOUT = [
    "idlelib/idle_test/test_editor.py", "pkg/test/test_core.py", "pkg/tests/helper.py",
    "test/support/util.py", "test/test_alpha.py", "test/tiny.py",
]
OUTPUTS = ("train.txt", "heldout.txt", "prompts.json", "manifest.json")


@pytest.fixture
def fake_stdlib(tmp_path: Path) -> Path:
    root = tmp_path / "stdlib"
    for rel, text in FAKE_STDLIB.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(text.encode("utf-8"))
    (root / "test" / "latin1.py").write_bytes("# caf\xe9\n".encode("latin-1"))
    return root


def _build(stdlib: Path, out: Path, n_prompts: int = 3, seed: int = 0) -> dict:
    return corpus.build_corpus(
        out, stdlib, n_prompts=n_prompts, prompt_chars=PROMPT_CHARS, seed=seed
    )


def test_split_holds_out_exactly_the_files_inside_test_package_dirs(fake_stdlib):
    split = corpus.split_stdlib(fake_stdlib)
    assert [f.relpath for f in split.train] == EXPECTED_TRAIN, (
        "train = sorted .py files with no test/tests/idle_test directory component"
    )
    assert [f.relpath for f in split.heldout] == EXPECTED_HELDOUT, (
        "held-out = sorted .py files under a test/tests/idle_test directory"
    )


def test_site_packages_are_ignored_and_non_utf8_files_are_skipped_with_a_reason(fake_stdlib):
    split = corpus.split_stdlib(fake_stdlib)
    every = [f.relpath for f in split.train + split.heldout]
    assert not any("site-packages" in p for p in every), "site-packages never enters the corpus"
    assert split.skipped == (("test/latin1.py", "not valid UTF-8"),), (
        "the latin-1 file is skipped and reported"
    )


def test_train_txt_is_exact_file_contents_joined_by_end_of_text(fake_stdlib, tmp_path):
    _build(fake_stdlib, tmp_path / "out")
    train = (tmp_path / "out" / "train.txt").read_bytes().decode("utf-8")
    assert train.split(corpus.EOT_TOKEN) == [FAKE_STDLIB[p] for p in EXPECTED_TRAIN], (
        "one document per file, sorted, byte-exact (CRLF kept), separated by <|endoftext|>"
    )


def test_manifest_counts_and_hashes_match_the_outputs(fake_stdlib, tmp_path):
    out = tmp_path / "out"
    manifest = _build(fake_stdlib, out)
    assert json.loads((out / "manifest.json").read_text()) == manifest, (
        "manifest.json holds the returned manifest"
    )
    for name, expected in (("train", EXPECTED_TRAIN), ("heldout", EXPECTED_HELDOUT)):
        path = out / f"{name}.txt"
        assert manifest[name]["files"] == len(expected), f"{name} file count"
        assert manifest[name]["bytes"] == path.stat().st_size, f"{name} bytes is the file size"
        assert manifest[name]["sha256"] == corpus.sha256_file(path), f"{name} sha256 is the file's"
    assert manifest["prompts"]["sha256"] == corpus.sha256_file(out / "prompts.json"), (
        "prompts sha256 is the file's"
    )


def test_build_corpus_is_byte_for_byte_deterministic(fake_stdlib, tmp_path):
    for run in ("a", "b"):
        _build(fake_stdlib, tmp_path / run, n_prompts=4, seed=7)
    for name in OUTPUTS:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), (
            f"{name} differs between two runs over the same stdlib"
        )


def test_prompts_are_whole_line_cuts_of_distinct_heldout_files(fake_stdlib, tmp_path):
    _build(fake_stdlib, tmp_path / "out", n_prompts=5)
    prompts = json.loads((tmp_path / "out" / "prompts.json").read_text())["prompts"]
    assert len(prompts) == 5, "asked for 5 prompts"
    assert len({p["file"] for p in prompts}) == 5, "each prompt comes from a different file"
    for p in prompts:
        assert p["file"] in EXPECTED_HELDOUT and p["file"] != "test/tiny.py", (
            f"{p['file']} must be a held-out file long enough to cut from"
        )
        text = FAKE_STDLIB[p["file"]]
        start, end = p["char_start"], p["char_end"]
        assert text[start:end] == p["text"], "the prompt is the recorded slice of its file"
        assert start == 0 or text[start - 1] == "\n", "the prompt starts at a line boundary"
        assert text[end - 1] == "\n", "the prompt ends at a line boundary"
        assert PROMPT_CHARS // 2 <= len(p["text"]) <= PROMPT_CHARS, "about prompt_chars long"
        assert len(text) - start >= 2 * PROMPT_CHARS, "the file continues past the prompt"


def test_mostly_whitespace_cuts_are_not_prompts():
    assert corpus.is_mostly_whitespace("\n\n        \n  x\n"), "1 of 15 characters is non-space"
    assert not corpus.is_mostly_whitespace("    return x + 1\n"), "indented code is a valid prompt"


def test_too_few_promptable_files_is_a_value_error(fake_stdlib, tmp_path):
    with pytest.raises(ValueError, match="n_prompts=6"):
        _build(fake_stdlib, tmp_path / "out", n_prompts=6)


def test_stdlib_without_test_packages_is_a_value_error(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "mod.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="held-out"):
        corpus.build_corpus(tmp_path / "out", tmp_path / "lib")


TOKENIZER_DOCS = [FAKE_STDLIB[p] for p in EXPECTED_TRAIN] * 3


@pytest.fixture(scope="module")
def tiny_tokenizer():
    return demo_tokenizer.train_tokenizer(TOKENIZER_DOCS, vocab_size=300)


def test_special_tokens_have_ids_zero_and_one(tiny_tokenizer):
    assert tiny_tokenizer.token_to_id("<|endoftext|>") == 0, "eos id is fixed at 0"
    assert tiny_tokenizer.token_to_id("<|mask|>") == 1, "mask id is fixed at 1"
    assert 258 < tiny_tokenizer.get_vocab_size() <= 300, (
        "256 bytes + 2 specials + some merges, within the requested cap"
    )


@pytest.mark.parametrize("text", [
    "def f(x):\n    return x\r\n",
    "  leading spaces and trailing  \n\n\t\ttabs",
    "unicode: héllo 世界 🐍 \x00\x7f",
    "",
])
def test_byte_level_bpe_round_trips_text_exactly(tiny_tokenizer, text):
    ids = tiny_tokenizer.encode(text, add_special_tokens=False).ids
    assert tiny_tokenizer.decode(ids) == text, (
        "byte-level BPE without prefix space decodes to the exact input"
    )


def test_vocab_size_below_bytes_plus_specials_is_a_value_error():
    with pytest.raises(ValueError, match="vocab_size=200"):
        demo_tokenizer.train_tokenizer(TOKENIZER_DOCS, vocab_size=200)


def test_encode_corpus_puts_eos_between_documents(tiny_tokenizer, tmp_path):
    docs = ["import os\n", "x = 1\n", "def f():\n    pass\n"]
    text_path = tmp_path / "c.txt"
    text_path.write_bytes(corpus.EOT_TOKEN.join(docs).encode("utf-8"))
    tok_path = demo_tokenizer.save_tokenizer(tiny_tokenizer, tmp_path / "tok")
    ids = demo_tokenizer.encode_corpus(tok_path, text_path)
    assert ids.dtype == np.int32, "token ids are int32"
    eos_at = np.flatnonzero(ids == 0)
    assert len(eos_at) == len(docs) - 1, "one eos between consecutive documents, none at the ends"
    for doc, piece in zip(docs, np.split(ids, eos_at)):
        piece = piece[piece != 0]
        assert tiny_tokenizer.decode(piece.tolist()) == doc, "each segment decodes to its document"
    whole_text = text_path.read_text(encoding="utf-8")
    whole = tiny_tokenizer.encode(whole_text, add_special_tokens=False).ids
    assert ids.tolist() == whole, "batched per-document encoding equals encoding the whole file"


def test_cli_writes_token_arrays_equal_to_encode_corpus(fake_stdlib, tmp_path):
    _build(fake_stdlib, tmp_path / "corpus")
    tok_dir = tmp_path / "tok"
    demo_tokenizer.main([
        "--corpus", str(tmp_path / "corpus"), "--vocab-size", "300",
        "--out", str(tok_dir), "--encode",
    ])
    for name in ("train", "heldout"):
        expected = demo_tokenizer.encode_corpus(
            tok_dir / "tokenizer.json", tmp_path / "corpus" / f"{name}.txt"
        )
        np.testing.assert_array_equal(
            np.load(tok_dir / f"{name}.npy"), expected,
            err_msg=f"{name}.npy must be encode_corpus of {name}.txt",
        )
    stats = json.loads((tok_dir / "stats.json").read_text())
    assert 0 < stats["heldout_tokens_per_byte"] <= 1, (
        "byte-level BPE never needs more than one token per byte"
    )


def test_transformers_loads_the_saved_tokenizer_with_eos_and_mask(tiny_tokenizer, tmp_path):
    transformers = pytest.importorskip("transformers")
    demo_tokenizer.save_tokenizer(tiny_tokenizer, tmp_path / "tok")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert (hf.eos_token, hf.eos_token_id) == ("<|endoftext|>", 0), "eos is <|endoftext|> at id 0"
    assert (hf.mask_token, hf.mask_token_id) == ("<|mask|>", 1), "mask is <|mask|> at id 1"
    text = "def g(y):\n    return  y\r\n"
    ids = hf(text)["input_ids"]
    assert ids == tiny_tokenizer.encode(text, add_special_tokens=False).ids, (
        "transformers adds no bos/eos on encode"
    )
    assert hf.decode(ids) == text, "transformers decodes byte-exactly (no space clean-up)"
