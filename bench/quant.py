"""Weight precision on the GPU (docs/architecture.md, "Weight precision"), in three parts:

  kernel   `quant_matmul`: each impl (`quant_matmul.IMPLS`: the reference, the Pallas kernel, and "auto", the
           GPU default's choice) and the plain bf16 product, for every weight shape of the Qwen3-8B target and
           the z-lab drafter, at 1, 16 and 64 rows, per format: device time per call, the bytes it must read
           over the GEMV read bandwidth measured in the same run, and each impl's agreement with the reference
  drafter  per drafter precision (`--precisions`), the round on the bf16 Qwen3-8B-shaped target at each batch
           (default 1 and 16, prompt 512; `spec_round.measure_cell`): draft time per round, fused round over
           plain step, speedup at injected acceptance 6.5, and that the output equals plain decoding's
  target   plain decoding tokens/s of the target at each `--target-precisions` (default bf16 and int8) and batch
           (`plain_decode.measure`), and each over bf16

The drafter reads logits through the target's bf16 LM head, or, with `--heads copy` (the library's default for a
quantised drafter, `Drafter.with_head`), through its own copy of it in the drafter's precision; `--heads copy
target` times both (a bf16 drafter has no copy, so its one cell is "target").
Quantised weights are encoded on the device (`quant.quantize_params(..., xp=jnp)`): speed does not depend on the
values. Each run updates, in the results file, the cells of the parts it ran (keyed by precision, head and
batch) and redraws the plot, so the parts can run as separate commands (each under the 10-minute limit on the H200):

    python bench/quant.py --parts kernel target                  # H200
    python bench/quant.py --parts drafter --precisions bf16 q8_0
    python bench/quant.py --parts drafter --precisions q4_0 int8
    python bench/quant.py --parts kernel --sweep                 # first time the kernels' tile settings
    python bench/quant.py --tiny                                 # CPU smoke test of every part

`--quant-impl` sets the quantised product of the drafter and target parts (`quant_matmul.GPU_DEFAULT_IMPL`);
the other options are `spec_round.py`'s (`--batches`, `--prompts`, `--new`, `--reps`, `--out`, ...).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import acceptance as acc
import common
import plain_decode
import spec_round
from dflash_jax import quant
from dflash_jax.config import policy
from pallas_kernels import quant_matmul as qmm

PARTS = ("kernel", "drafter", "target")
TOLERANCE = 2e-2  # kernel against reference, relative to the reference's largest magnitude (bf16 products)
TAU = 6.5


WEIGHTS = ("wqkv", "wo", "w_gate_up", "w_down", "lm_head", "drafter_fc")


def weight_shapes(target_cfg, drafter_cfg) -> dict:
    """Name -> `[in, out]` of every distinct weight a decode step or a round multiplies by."""
    t, d = target_cfg, drafter_cfg
    return {"wqkv": (t.hidden_size, t.q_width + 2 * t.kv_width), "wo": (t.q_width, t.hidden_size),
            "w_gate_up": (t.hidden_size, 2 * t.intermediate_size), "w_down": (t.intermediate_size, t.hidden_size),
            "lm_head": (t.hidden_size, t.vocab_size), "drafter_fc": (d.n_taps * d.hidden_size, d.hidden_size)}


def _packed(key, shape: tuple, fmt: str):
    w = jax.random.normal(key, shape, jnp.float32) / np.sqrt(shape[0])
    q = quant.quantize_array(w, fmt, jnp.bfloat16, xp=jnp)
    return w.astype(jnp.bfloat16), q


def kernel_part(shapes: dict, rows: tuple, iters: int, calls: int) -> dict:
    """Per weight, format and row count: bf16, reference and kernel times, bytes, agreement."""
    bandwidth = common.hbm_read_bandwidth(common.TINY_PROBE_GIB if jax.default_backend() != "gpu" else 4.0)
    cells, key = [], jax.random.key(0)
    for i, (name, shape) in enumerate(shapes.items()):
        for j, fmt in enumerate(qmm.FORMATS):
            w, q = _packed(jax.random.fold_in(key, 8 * i + j), shape, fmt)
            for m in rows:
                x = jax.random.normal(jax.random.fold_in(key, m), (m, shape[0]), jnp.bfloat16)
                impls = {impl: functools.partial(qmm.quant_matmul, fmt=fmt, impl=impl) for impl in qmm.IMPLS}
                outs = {impl: np.asarray(f(x, q.data, q.scales), np.float32) for impl, f in impls.items()}
                ref, got = outs.pop("xla"), outs.values()
                rel = max(float(np.max(np.abs(g - ref)) / max(np.max(np.abs(ref)), 1e-6)) for g in got)
                row = {"weight": name, "shape": list(shape), "format": fmt, "rows": m, "rel_err": rel,
                       "ok": bool(all(np.isfinite(g).all() for g in got) and rel <= TOLERANCE),
                       "bytes": int(q.nbytes + x.nbytes + m * shape[1] * 2), "bf16_bytes": int(w.nbytes)}
                row["bf16_us"] = common.per_call_us(lambda a, b: a @ b, x, (w,), iters, calls)
                for impl, f in impls.items():
                    row[f"{impl}_us"] = common.per_call_us(lambda a, d, s, f=f: f(a, d, s), x, (q.data, q.scales),
                                                           iters, calls)
                row["roofline_us"] = 1e6 * row["bytes"] / bandwidth
                row["pallas_over_xla"] = row["pallas_us"] / row["xla_us"]
                row["best_over_bf16"] = min(row[f"{impl}_us"] for impl in impls) / row["bf16_us"]
                row["pallas_TBps"] = row["bytes"] / row["pallas_us"] / 1e6
                cells.append(row)
                times = ", ".join(f"{impl} {row[f'{impl}_us']:8.2f} us" for impl in impls)
                print(f"kernel {name:10s} {fmt:5s} rows {m:3d}: bf16 {row['bf16_us']:8.2f} us, {times}, roofline "
                      f"{row['roofline_us']:8.2f} us, rel err {rel:.1e}", flush=True)
    return {"cells": cells, "read_bandwidth_Bps": bandwidth, "tolerance_rel": TOLERANCE,
            "gpu_default_impl": qmm.GPU_DEFAULT_IMPL, "max_rows": qmm.MAX_ROWS,
            "gemv_tiles": qmm.GEMV_TILES._asdict(), "dot_tiles": qmm.DOT_TILES._asdict()}


SWEEP = {
    "gemv": [qmm.Tiles(bn, bk, programs, 4, 3) for bn, bk in ((64, 128), (128, 64), (256, 32), (256, 64))
             for programs in (264, 1056)],
    "dot": [qmm.Tiles(bn, bk, programs, 4, 3) for bn, bk in ((64, 256), (128, 128), (128, 256))
            for programs in (132, 264, 528)],
}
"""Tile settings `--sweep` times: one grid per kernel, the same on every weight, so one default can be chosen."""


def sweep_tiles(shapes: dict, formats: tuple, out_dir: str, iters: int, calls: int, tiny: bool) -> dict:
    """Each kernel (GEMV at 1 row, product at 16) over its `SWEEP` grid on the layer weights with the smallest N
    (wqkv) and the largest K (w_down), per format; rewrites `quant_sweep.json` after each setting, and ranks the
    settings by the geometric mean of their times over the weights and formats."""
    interpret = jax.default_backend() != "gpu"
    grids = {kernel: grid[:2] if tiny else grid for kernel, grid in SWEEP.items()}
    results = []
    for kernel, grid in grids.items():
        m = 1 if kernel == "gemv" else 16
        for name in ("wqkv", "w_down"):
            for fmt in formats:
                _, q = _packed(jax.random.key(1), shapes[name], fmt)
                x = jax.random.normal(jax.random.key(m), (m, shapes[name][0]), jnp.bfloat16)
                for tiles in grid:
                    fn = functools.partial(qmm._pallas_matmul, fmt=fmt, compute=jnp.dtype(jnp.bfloat16),
                                           interpret=interpret, tiles=tiles)
                    try:
                        us = common.per_call_us(lambda a, d, s: fn(a, d, s), x, (q.data, q.scales), iters, calls)
                    except Exception as e:  # a setting the GPU refuses (resources) is recorded, not fatal
                        us, error = None, f"{type(e).__name__}: {str(e)[:200]}"
                    else:
                        error = None
                    results.append({"kernel": kernel, "weight": name, "format": fmt, "rows": m, **tiles._asdict(),
                                    "us": us, "TBps": q.nbytes / us / 1e6 if us else None, "error": error})
                    print(f"sweep {kernel} {name} {fmt} rows {m}: {tuple(tiles)} "
                          f"{'%.2f us' % us if us else error}", flush=True)
                    common.write_json("quant_sweep.json", {**common.environment(), "cells": results,
                                                           "ranking": rank(results)}, out_dir)
    return {"cells": results, "ranking": rank(results)}


def rank(results: list) -> dict:
    """Per kernel, settings measured on every (weight, format) it ran, best geometric mean first."""
    out = {}
    for kernel in SWEEP:
        cells = [c for c in results if c["kernel"] == kernel]
        groups = {(c["weight"], c["format"]) for c in cells}
        by_tiles = {}
        for c in cells:
            by_tiles.setdefault(tuple(c[f] for f in qmm.Tiles._fields), []).append(c["us"])
        scored = [(float(np.exp(np.mean(np.log(v)))), t) for t, v in by_tiles.items()
                  if len(v) == len(groups) and all(v)]
        out[kernel] = [{"geomean_us": g, **dict(zip(qmm.Tiles._fields, t))} for g, t in sorted(scored)[:5]]
    return out


def head_variants(target, drafter, heads) -> dict:
    """`{head: drafter}` for each of `heads` ("copy", "target"), keyed by what the drafter holds: its copy's
    format, or "target" (a drafter whose precision makes no copy appears once). A cell's `head_read` says what
    its proposals read: past `quant_matmul.MAX_ROWS` draft rows a drafter reads the target's head
    (`Drafter.reads_head_copy`)."""
    out = {}
    for head in heads:
        d = drafter.with_head(target, head == "copy", env={}, xp=jnp)
        out.setdefault(d.head.fmt if d.head is not None else "target", d)
    return out


def drafter_part(target, drafter, args, counter) -> list:
    """`spec_round.measure_cell` per drafter precision, LM head and batch, reduced to the figures of the issue."""
    cells = []
    for precision in args.precisions:
        quantised = drafter.replace(params=quant.quantize_params(drafter.params, precision, xp=jnp))
        for head, d in head_variants(target, quantised, args.heads).items():
            for batch in args.batches:
                for prompt in args.prompts:
                    cells.append(drafter_cell(target, d, precision, head, batch, prompt, args, counter))
    return cells


def drafter_cell(target, d, precision: str, head: str, batch: int, prompt: int, args, counter) -> dict:
    """One drafter cell: the round's figures at `precision` with the drafter reading `head`."""
    rec = spec_round.measure_cell(target, d, batch, prompt, args, counter)
    run = min(rec["fused"], key=lambda r: abs(r["tau"] - TAU))
    read = head if d.reads_head_copy(batch * d.n_drafts) else "target"
    cell = {"precision": precision, "head": head, "head_read": read,
            "batch": batch, "prompt": prompt,
            "drafter_bytes": common.nbytes(d.params), "head_bytes": d.head.nbytes if d.head is not None else 0,
            "draft_s": rec["phases"]["draft_s"], "verify_s": rec["phases"]["verify_s"],
            "round_s": rec["round_s"], "plain_step_s": rec["plain_step_s"],
            "round_over_plain_step": rec["round_over_plain_step"], "tau": run["tau"],
            "tau_measured": run["tau_measured"], "speedup_at_tau_6_5": run["speedup"],
            "lossless": all(r["lossless"] for r in rec["fused"]) and rec["real_drafter"]["lossless"],
            "no_recompile": rec["no_recompile"]}
    print(f"drafter {precision:5s} head {head:6s} b={batch}: draft {cell['draft_s'] * 1e3:.3f} ms, round/plain "
          f"{rec['round_over_plain_step']:.3f}, speedup at tau {run['tau']} {run['speedup']:.2f}x", flush=True)
    return cell


def label(cell: dict) -> str:
    """A drafter cell's name in the summary and the plot: its precision, "+head" where it read its own copy."""
    return cell["precision"] + ("" if cell.get("head", "target") == "target" else "+head")


def target_part(target, args) -> list:
    """Plain decoding per target precision and batch, and its ratio to bf16 at the same batch."""
    cells = []
    for precision in args.target_precisions:
        t = target.replace(params=quant.quantize_params(target.params, precision, xp=jnp))
        for batch in args.batches:
            res = plain_decode.measure(t, batch, args.prompts[0], args.new, args.impl, args.reps)
            cells.append({"precision": precision, "weight_bytes": common.target_step_bytes(t), **res})
            print(f"target {precision:5s} b={batch}: {res['tokens_per_s']:.1f} tok/s", flush=True)
        del t
    for c in cells:
        base = [b for b in cells if b["precision"] == "bf16" and b["batch"] == c["batch"]]
        c["over_bf16"] = c["tokens_per_s"] / base[0]["tokens_per_s"] if base else None
    return cells


def merge(old: list, new: list, keys: tuple) -> list:
    """`old` cells with those `new` measures again (same `keys`) replaced, then the new ones."""
    fresh = {tuple(c[k] for k in keys) for c in new}
    return [c for c in old if tuple(c[k] for k in keys) not in fresh] + new


def summarise(payload: dict) -> dict:
    """The issue's figures, where measured: the q8_0 drafter's round over a plain step and its speedup at 6.5,
    and the int8 target's plain tokens/s over bf16, per batch."""
    out = {}
    for c in payload.get("drafter_round", {}).get("cells", []):
        name = label(c).replace("+head", "_head_copy")
        out[f"{name}_b{c['batch']}_round_over_plain_step"] = c["round_over_plain_step"]
        out[f"{name}_b{c['batch']}_speedup_at_tau_6_5"] = c["speedup_at_tau_6_5"]
    for c in payload.get("target_plain", {}).get("cells", []):
        if c["precision"] != "bf16" and c["over_bf16"] is not None:
            out[f"target_{c['precision']}_b{c['batch']}_tokens_per_s_over_bf16"] = c["over_bf16"]
    return out


def plot(payload: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drafter = payload.get("drafter_round", {}).get("cells", [])
    target = payload.get("target_plain", {}).get("cells", [])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    panels = ((axes[0], drafter, "round_over_plain_step", "fused round / plain step (drafter precision)"),
              (axes[1], drafter, "speedup_at_tau_6_5", "speedup at acceptance 6.5 (drafter precision)"),
              (axes[2], target, "over_bf16", "plain tokens/s over bf16 (target precision)"))
    for ax, cells, key, title in panels:
        batches = sorted({c["batch"] for c in cells})
        name = label if cells is drafter else (lambda c: c["precision"])
        precisions = list(dict.fromkeys(name(c) for c in cells))
        width = 0.8 / max(len(batches), 1)
        for i, b in enumerate(batches):
            values = [next((c[key] or 0.0 for c in cells if name(c) == p and c["batch"] == b), 0.0)
                      for p in precisions]
            ax.bar(np.arange(len(precisions)) + i * width, values, width, label=f"batch {b}")
            for x, v in zip(np.arange(len(precisions)) + i * width, values):
                ax.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(np.arange(len(precisions)) + width * (len(batches) - 1) / 2, precisions)
        ax.set_title(title, fontsize=9)
        if cells:
            ax.legend(fontsize=8)
    fig.suptitle(f"weight precision, {payload.get('model', '')} on {payload['device']} (jax {payload['jax_version']})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv):
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    ap.add_argument("--precisions", nargs="+", default=["bf16", "q8_0", "q4_0"], choices=list(policy.PRECISIONS),
                    help="drafter precisions")
    ap.add_argument("--target-precisions", nargs="+", default=["bf16", "int8"], choices=list(policy.PRECISIONS))
    ap.add_argument("--heads", nargs="+", default=["copy"], choices=["copy", "target"],
                    help="drafter part: the LM head a quantised drafter reads: its own copy in its precision (the "
                         "library's default) or the target's")
    ap.add_argument("--quant-impl", default=None, choices=list(qmm.IMPLS),
                    help="quantised product of the drafter and target parts on the GPU (default: quant_matmul's)")
    ap.add_argument("--sweep", action="store_true",
                    help="kernel part: first time tile settings, and run the rest of the command with the best")
    ap.add_argument("--kernel-rows", nargs="+", type=int, default=[1, 16, 64], help="kernel part: rows per cell")
    ap.add_argument("--kernel-weights", nargs="+", default=list(WEIGHTS), choices=list(WEIGHTS),
                    help="kernel part: the weights timed")
    ap.add_argument("--sweep-formats", nargs="+", default=["int8", "q8_0"], choices=list(qmm.FORMATS))
    ap.add_argument("--iters", type=int, default=10, help="kernel part: timed samples per cell (median)")
    ap.add_argument("--kernel-calls", type=int, default=32, help="kernel part: calls per sample, in one jitted program")
    ours, rest = ap.parse_known_args(argv)
    batches_given = "--batches" in (rest or [])
    args = spec_round.parse_args(rest, __doc__, TAU)
    if not batches_given:
        args.batches = [1, 2] if args.tiny else [1, 16]
    return argparse.Namespace(**vars(args), **vars(ours))


def main(argv=None):
    args = parse_args(argv)
    if args.quant_impl:
        qmm.GPU_DEFAULT_IMPL = args.quant_impl
    name = f"quant{'_tiny' if args.tiny else ''}"
    out_dir = args.out or common.RESULTS
    path = os.path.join(out_dir, f"{name}.json")
    previous = {}
    if os.path.exists(path):
        with open(path) as f:
            previous = json.load(f)
    target, drafter = acc.models(args.tiny)
    payload = {**previous, **common.environment(**vars(args)), **acc.describe(target, drafter, args.tiny),
               "quant_impl": qmm.default_impl()}
    if "kernel" in args.parts:
        shapes = weight_shapes(target.config, drafter.config)
        iters, calls = (1, 2) if args.tiny else (args.iters, args.kernel_calls)
        if args.sweep:
            payload["sweep"] = sweep_tiles(shapes, tuple(args.sweep_formats), out_dir, iters if args.tiny else 5,
                                           calls if args.tiny else 16, args.tiny)
            for kernel, ranked in payload["sweep"]["ranking"].items():
                if ranked:
                    setattr(qmm, f"{kernel.upper()}_TILES", qmm.Tiles(**{f: ranked[0][f] for f in qmm.Tiles._fields}))
        shapes = {k: shapes[k] for k in (("w_down", "drafter_fc") if args.tiny else args.kernel_weights)}
        payload["kernel"] = kernel_part(shapes, (1, 16) if args.tiny else tuple(args.kernel_rows), iters, calls)
        common.write_json(f"{name}.json", payload, out_dir)  # each part is kept should a later one not finish
    if "target" in args.parts:
        cells = target_part(target, args)
        payload["target_plain"] = {"cells": merge(previous.get("target_plain", {}).get("cells", []), cells,
                                                  ("precision", "batch"))}
        common.write_json(f"{name}.json", {**payload, "summary": summarise(payload)}, out_dir)
    if "drafter" in args.parts:
        cells = drafter_part(target, drafter, args, acc.CompileCounter())
        # cells from before the head column read the target's head
        earlier = [{"head": "target", **c} for c in previous.get("drafter_round", {}).get("cells", [])]
        payload["drafter_round"] = {"cells": merge(earlier, cells, ("precision", "head", "batch", "prompt"))}
    payload["summary"] = summarise(payload)
    common.write_json(f"{name}.json", payload, out_dir)
    plot(payload, os.path.join(out_dir, f"{name}.png"))
    failed = [f"{c['weight']} {c['format']} rows {c['rows']}" for c in payload.get("kernel", {}).get("cells", [])
              if not c["ok"]]
    if common.exit_status(failed, TOLERANCE):
        sys.exit(1)
    return payload


if __name__ == "__main__":
    main()
