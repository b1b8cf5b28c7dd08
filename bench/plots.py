"""PNG plots next to the benchmark JSON in a results folder (matplotlib, Agg backend).

  plain_decode.png  ours vs the memory roofline vs transformers, tokens/s
  spec_round.png    per cell: draft / verify / commit+ingest stacked, the fused round, the plain step
  acceptance.png    speedup and its ceiling against the measured acceptance length
  sweep.png         tokens/s (plain, speculative) and speedup against batch, one line per prompt

    python bench/plots.py                       # every plot whose JSON is in bench/results
    python bench/plots.py --out DIR --tiny      # the *_tiny.json files in DIR
"""
from __future__ import annotations

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import common  # noqa: E402


def _title(d: dict, what: str) -> str:
    model = d.get("model") or d["settings"].get("model", "")
    return f"{what}\n{model} on {d['device']} (jax {d['jax_version']}, {d['date'][:10]})"


def plot_plain_decode(d: dict, path: str) -> None:
    names = ["ours", "roofline"] + [f"transformers ({p['cache_implementation']})" for p in d.get("peers", [])]
    values = [d["ours"]["tokens_per_s"], d["roofline_tokens_per_s"]] + [p["tokens_per_s"] for p in d.get("peers", [])]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.barh(names, values, color=["C0", "0.6"] + ["C1"] * (len(values) - 2))
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:.1f}", va="center")
    ax.set_xlabel("tokens/s")
    s = d["settings"]
    ax.set_title(_title(d, f"plain decoding, batch {s['batch']}, prompt {s['prompt']}: "
                           f"{d['roofline_ratio']:.1%} of roofline"), fontsize=9)
    _save(fig, path)


def plot_spec_round(d: dict, path: str) -> None:
    cells = d["cells"]
    labels = [f"b={c['batch']} p={c['prompt']}\nround/plain {c['round_over_plain_step']:.2f}\n"
              f"overhead {c['loop_overhead']:+.1%}" for c in cells]
    fig, ax = plt.subplots(figsize=(10, 1.6 + 1.2 * len(cells)))
    for i, c in enumerate(cells):
        ph, y = c["phases"], 3 * i
        left = 0.0
        for k, color in (("draft", "C0"), ("verify", "C1"), ("commit_ingest", "C2")):
            ms = ph[f"{k}_s"] * 1e3
            ax.barh(y + 2, ms, left=left, color=color, label=k if i == 0 else None)
            left += ms
        ax.barh(y + 1, c["round_s"] * 1e3, color="C3", label="fused round" if i == 0 else None)
        ax.barh(y, c["plain_step_s"] * 1e3, color="0.6", label="plain step" if i == 0 else None)
    ax.set_yticks([3 * i + 1 for i in range(len(cells))], labels, fontsize=8)
    ax.set_xlabel("ms")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(_title(d, "one speculative round: phases vs fused loop vs plain step"), fontsize=9)
    _save(fig, path)


def plot_acceptance(d: dict, path: str) -> None:
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for i, c in enumerate(c for c in d["cells"] if c.get("status") == "ok"):
        runs = c["runs"]
        tau = [r["tau_measured"] for r in runs]
        where = f"b={c['batch']} p={c['prompt']}"
        ax.plot(tau, [r["speedup"] for r in runs], "o-", color=f"C{i}", label=f"speedup, {where}")
        ax.plot(tau, [r["ceiling"] for r in runs], "x--", color=f"C{i}",
                label=f"ceiling tau x plain step / round, {where}")
    ax.axhline(1.0, color="0.6", lw=0.8)
    ax.set_xlabel("measured acceptance length (tokens per round)")
    ax.set_ylabel("speedup over plain decoding")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax.set_title(_title(d, "acceptance-controlled speculative decoding"), fontsize=9)
    _save(fig, path)


def plot_sweep(d: dict, path: str) -> None:
    rows = [r for r in d["table"] if r["status"] == "ok"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
    for i, prompt in enumerate(sorted({r["prompt"] for r in rows})):
        rs = sorted((r for r in rows if r["prompt"] == prompt), key=lambda r: r["batch"])
        x = [r["batch"] for r in rs]
        a.plot(x, [r["plain_tokens_per_s"] for r in rs], "o--", color=f"C{i}", label=f"plain, prompt {prompt}")
        a.plot(x, [r["spec_tokens_per_s"] for r in rs], "o-", color=f"C{i}", label=f"speculative, prompt {prompt}")
        b.plot(x, [r["speedup"] for r in rs], "o-", color=f"C{i}", label=f"prompt {prompt}")
    skipped = [f"b={r['batch']} p={r['prompt']}" for r in d["table"] if r["status"] != "ok"]
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    a.set_yscale("log")
    a.set_ylabel("tokens/s (all rows)")
    b.set_ylabel("speedup over plain")
    b.axhline(1.0, color="0.6", lw=0.8)
    tau = d["settings"]["taus"][0]
    fig.suptitle(_title(d, f"batch x prompt at acceptance length {tau}"
                           + (f" (skipped: {', '.join(skipped)})" if skipped else "")), fontsize=9)
    _save(fig, path)


def _save(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


PLOTS = {"plain_decode": plot_plain_decode, "spec_round": plot_spec_round, "acceptance": plot_acceptance,
         "sweep": plot_sweep}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    ap.add_argument("--tiny", action="store_true", help="plot the *_tiny.json files")
    args = ap.parse_args(argv)
    folder = args.out or common.RESULTS
    suffix = "_tiny" if args.tiny else ""
    made = []
    for name, plot in PLOTS.items():
        src = os.path.join(folder, f"{name}{suffix}.json")
        if os.path.exists(src):
            with open(src) as f:
                plot(json.load(f), os.path.join(folder, f"{name}{suffix}.png"))
            made.append(name)
    if not made:
        print(f"no benchmark JSON in {folder}")
    return made


if __name__ == "__main__":
    main()
