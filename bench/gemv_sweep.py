"""A quantised product's kernel settings (`quant_matmul.Tiles`) swept over each Qwen3-8B layer weight and timed on
the GPU's own clock (CUPTI), beside the bf16 product and `impl="auto"`'s current form in the same run
(docs/architecture.md, "Weight precision"): one int8 row (a decode step of an int8 target) by default, or 16 rows
in q8_0 or int8 (a drafter's block, a verify) with `--rows 16`.

Each form is one jitted program making `C` calls, each on its own copy of the weight (together past the L2
cache, so every call reads HBM as a decode step does). All programs of a weight run under one profiler trace,
`--reps` times each with a pause between runs; the trace's device kernels then fall into one cluster per run, and
a form's time per call is the median over its runs of the cluster's span (first kernel's start to last kernel's
end, the K-split sum included) over `C`. `busy_us` is the kernels' own time without the gaps between them.

Forms: `bf16` (x @ W in bf16), `auto` (`quant_matmul(impl="auto")`), `default` (`GEMV_TILES` for one row,
`DOT_TILES` for more), for one row `dot16` (the row padded into the 16-row product kernel), the sweep
`<gemv|dot>_<block_n>x<block_k>_w<warps>_p<programs>[_unroll][_evict]`, and, for one int8 row,
`T<block_n>x<block_k>_w<warps>_p<programs>`: a GEMV over the transposed weight `[N, K]` (a layout the package does
not store; it tells whether the layout is what holds the kernel back). The three best settings of the first pass
are timed again with `evict_first` loads (and, for one row, looped).

    python bench/gemv_sweep.py --out DIR                          # H200: one int8 row
    python bench/gemv_sweep.py --rows 16 --fmt q8_0 --out DIR     # a q8_0 drafter's block
    python bench/gemv_sweep.py --quick --out DIR                  # the defaults against the baselines only
    python bench/gemv_sweep.py --tiny                             # CPU smoke test (interpret mode, host events)
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

import common
from profile_round import device_events, traced
from dflash_jax import quant
from pallas_kernels import quant_matmul as qmm
from pallas_kernels.windowed_attention import _triton_compiler_params

SHAPES = {"wqkv": (4096, 6144), "w_gate_up": (4096, 24576), "w_down": (12288, 4096), "wo": (4096, 4096)}
TINY_SHAPES = {"wqkv": (256, 512), "w_down": (512, 256)}
GRID = [(128, 16, 1), (256, 8, 1), (256, 16, 2), (512, 8, 2), (128, 32, 2), (256, 16, 4), (256, 32, 4),
        (512, 16, 4), (1024, 8, 4), (512, 32, 8), (1024, 16, 8), (2048, 8, 8)]
"""(block_n, block_k, num_warps) of the unrolled GEMV: float32 accumulators per thread (bk * bn / threads) of
32 to 64."""
PROGRAMS = (528, 1056, 2112)
DOT_GRID = [(64, 128, 4), (128, 128, 4), (128, 64, 4), (128, 256, 8), (256, 64, 8), (64, 256, 4)]
"""(block_n, block_k, num_warps) of the product kernel at more rows, each looped (3 stages) and unrolled."""
DOT_PROGRAMS = (264, 528)
T_GRID = [(8, 1024, 4), (16, 512, 4), (32, 256, 4), (16, 256, 2), (64, 256, 8)]
"""(block_n, block_k, num_warps) of the transposed GEMV."""
MAX_SPLIT_SHARE = 0.1  # settings whose K-split partial sums exceed this share of the weight's bytes are skipped
GAP_US = 2000.0  # device idle time that separates two runs in the trace


def t_gemv(x, data_t, scales, *, bn: int, bk: int, warps: int, programs: int, interpret: bool):
    """`x [1, K] @ W` with W's int8 values stored transposed, `[N, K]`: (row tile, K split) programs each sum
    `[bn, bk]` tiles against x's row slice into a float32 accumulator, reduced over K at the end."""
    n, k = data_t.shape
    bn, bk = min(bn, n & -n), min(bk, k & -k)
    n_tiles, k_tiles = n // bn, k // bk
    splits = max(d for d in range(1, k_tiles + 1) if k_tiles % d == 0 and d <= -(-programs // n_tiles))
    ks = k // splits

    def kernel(x_ref, w_ref, s_ref, o_ref):
        acc = jnp.zeros((bn, bk), jnp.float32)
        for t in range(ks // bk):
            w = w_ref[:, pl.ds(t * bk, bk)].astype(jnp.float32)
            acc = acc + w * x_ref[:, pl.ds(t * bk, bk)].astype(jnp.float32)
        o_ref[...] = (jnp.sum(acc, axis=1) * s_ref[0, :])[None, :]

    parts = pl.pallas_call(
        kernel, grid=(n_tiles, splits),
        in_specs=[pl.BlockSpec((1, ks), lambda j, p: (0, p)), pl.BlockSpec((bn, ks), lambda j, p: (j, p)),
                  pl.BlockSpec((1, bn), lambda j, p: (0, j))],
        out_specs=pl.BlockSpec((None, 1, bn), lambda j, p: (p, 0, j)),
        out_shape=jax.ShapeDtypeStruct((splits, 1, n), jnp.float32),
        compiler_params=_triton_compiler_params(warps, 1), interpret=interpret, name="t_gemv_int8",
    )(x, data_t, scales)
    return parts.sum(axis=0)


def split_share(k: int, n: int, tiles: qmm.Tiles, rows: int) -> float:
    """The K-split partial sums' bytes (float32, the kernel's row tile) over the int8 weight's, as
    `_pallas_matmul` splits it."""
    bn, bk = min(n & -n, tiles.block_n), min(k & -k, tiles.block_k)
    k_tiles, n_tiles = k // bk, n // bn
    splits = qmm._largest_divisor(k_tiles, -(-tiles.programs // n_tiles))
    return splits * n * 4 * (1 if rows == 1 else max(16, rows)) / (k * n)


def grid_tiles(rows: int, tiny: bool) -> list:
    """The first pass's settings: unrolled GEMVs for one row; the product kernel looped and unrolled for more."""
    if rows == 1:
        grid, programs = (GRID[:2], (4, 8)) if tiny else (GRID, PROGRAMS)
        return [qmm.Tiles(bn, bk, p, w, 1, unroll=True) for bn, bk, w in grid for p in programs]
    grid, programs = (DOT_GRID[:1], (4,)) if tiny else (DOT_GRID, DOT_PROGRAMS)
    return [qmm.Tiles(bn, bk, p, w, 3, unroll=u) for bn, bk, w in grid for p in programs for u in (False, True)]


def forms(k: int, n: int, fmt: str, rows: int, interpret: bool, tiny: bool, quick: bool) -> dict:
    """Name -> (fn(x, data, scales, bf16 weight, transposed data), tiles or None) of the first pass (`quick`: the
    baselines and defaults alone)."""
    bf = jnp.dtype(jnp.bfloat16)
    out = {"bf16": (lambda a, d, s, w, dt: a @ w, None),
           "auto": (lambda a, d, s, w, dt: qmm.quant_matmul(a, d, s, fmt, impl="auto", interpret=interpret), None)}
    kernel = functools.partial(qmm._pallas_matmul, fmt=fmt, compute=bf, interpret=interpret)
    default = qmm.GEMV_TILES if rows == 1 else qmm.DOT_TILES
    out["default"] = (lambda a, d, s, w, dt: kernel(a, d, s, tiles=default), default)
    if rows == 1:
        out["dot16"] = (lambda a, d, s, w, dt: kernel(jnp.pad(a, ((0, 15), (0, 0))), d, s)[:1], None)
    if quick:
        return out
    for tiles in grid_tiles(rows, tiny):
        small_splits = tiny or split_share(k, n, tiles, rows) <= MAX_SPLIT_SHARE  # tiny K: every split is large
        if small_splits and (fmt == "int8" or tiles.block_k % qmm.BLOCK == 0):
            out[label(tiles, rows)] = (lambda a, d, s, w, dt, t=tiles: kernel(a, d, s, tiles=t), tiles)
    if rows == 1 and fmt == "int8":
        for bn, bk, warps in T_GRID:
            for p in ((4,) if tiny else PROGRAMS[:2]):
                fn = functools.partial(t_gemv, bn=bn, bk=bk, warps=warps, programs=p, interpret=interpret)
                out[f"T{bn}x{bk}_w{warps}_p{p}"] = (lambda a, d, s, w, dt, fn=fn: fn(a, dt, s), None)
    return out


def label(t: qmm.Tiles, rows: int) -> str:
    return (f"{'gemv' if rows == 1 else 'dot'}_{t.block_n}x{t.block_k}_w{t.num_warps}_p{t.programs}"
            + ("_unroll" if t.unroll else "") + ("_evict" if t.evict else ""))


def clusters(events: list) -> list:
    """Device events split into runs at idle gaps longer than `GAP_US`: `[(span_us, busy_us)]` in time order."""
    runs, current, end = [], [], -math.inf
    for e in sorted(events, key=lambda e: e["ts"]):
        if current and e["ts"] - end > GAP_US:
            runs.append(current)
            current = []
        current.append(e)
        end = max(end, e["ts"] + e["dur"])
    if current:
        runs.append(current)
    return [(max(e["ts"] + e["dur"] for e in r) - min(e["ts"] for e in r), sum(e["dur"] for e in r)) for r in runs]


def time_forms(named: dict, args_list: list, reps: int, log_dir: str) -> dict:
    """Compile and check each program, then run them all under one trace: name -> stats per call."""
    calls = len(args_list)
    programs = {name: jax.jit(lambda al, fn=fn: [fn(*a) for a in al]) for name, (fn, _) in named.items()}
    ready = {}
    for name, prog in programs.items():
        t0 = time.perf_counter()
        try:
            ready[name] = (prog, jax.block_until_ready(prog(args_list)), time.perf_counter() - t0)
        except Exception as err:  # a setting Triton refuses is a result, not the end of the sweep
            ready[name] = (None, f"{type(err).__name__}: {str(err)[:300]}", time.perf_counter() - t0)
    order = [name for name, (prog, _, _) in ready.items() if prog is not None]

    def run_all():
        for name in order:
            for _ in range(reps):
                jax.block_until_ready(ready[name][0](args_list))
                time.sleep(2 * GAP_US / 1e6)

    walls = {}
    for name in order:  # wall-clock per call as well, for a trace without device events
        t0 = time.perf_counter()
        for _ in range(reps):
            jax.block_until_ready(ready[name][0](args_list))
        walls[name] = 1e6 * (time.perf_counter() - t0) / (reps * calls)
    _, _, trace = traced(run_all, log_dir)
    events, source = device_events(trace)
    runs = clusters(events) if source == "device" else []
    stats = {}
    aligned = len(runs) == reps * len(order)
    for i, name in enumerate(order):
        cell = {"compile_and_first_run_s": ready[name][2], "wall_us": walls[name], "source": source}
        if aligned:
            mine = runs[i * reps:(i + 1) * reps]
            cell["us"] = statistics.median(s for s, _ in mine) / calls
            cell["busy_us"] = statistics.median(b for _, b in mine) / calls
        stats[name] = (cell, ready[name][1])
    failed = {name: ready[name][1] for name in ready if ready[name][0] is None}
    return {"stats": stats, "failed": failed, "runs_found": len(runs), "runs_expected": reps * len(order)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--rows", type=int, default=1, choices=[1, 16])
    ap.add_argument("--fmt", default="int8", choices=["int8", "q8_0"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--budget", type=float, default=330.0, help="seconds after which weights are skipped")
    ap.add_argument("--quick", action="store_true", help="time the baselines and the package's defaults only")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    t0 = time.time()
    interpret = args.tiny or jax.default_backend() != "gpu"
    shapes = TINY_SHAPES if args.tiny else {w: SHAPES[w] for w in args.weights}
    name = f"gemv_sweep{'' if (args.rows, args.fmt) == (1, 'int8') else f'_{args.fmt}_{args.rows}'}"
    name += ("_quick" if args.quick else "") + ("_tiny.json" if args.tiny else ".json")
    payload = {**common.environment(**vars(args)), "weights": {}}
    if not args.tiny:
        payload["read_bandwidth_Bps"] = common.hbm_read_bandwidth(4.0)
    for wname, (k, n) in shapes.items():
        if time.time() - t0 > args.budget:
            payload["weights"][wname] = {"skipped": "budget"}
            continue
        w32 = jax.random.normal(jax.random.key(0), (k, n), jnp.float32) / np.sqrt(k)
        q = quant.quantize_array(w32, args.fmt, jnp.bfloat16, xp=jnp)
        calls = 2 if args.tiny else int(min(8, max(3, math.ceil(100e6 / (k * n)))))
        args_list = [(jax.random.normal(jax.random.key(i + 1), (args.rows, k), jnp.bfloat16), jnp.copy(q.data),
                      q.scales, w32.astype(jnp.bfloat16) if i == 0 else jnp.copy(w32.astype(jnp.bfloat16)),
                      jnp.asarray(q.data.T) if args.fmt == "int8" and args.rows == 1 else None)
                     for i in range(calls)]
        ref = [np.asarray(qmm.quant_matmul(a[0], a[1], a[2], args.fmt, impl="xla"), np.float32) for a in args_list]
        named = forms(k, n, args.fmt, args.rows, interpret, args.tiny, args.quick)
        with tempfile.TemporaryDirectory() as tmp:
            first = time_forms(named, args_list, args.reps, os.path.join(tmp, "first"))
            best = sorted((cell.get("us", cell["wall_us"]), nm) for nm, (cell, _) in first["stats"].items()
                          if named[nm][1] is not None and nm != "default" and not args.quick)[:3]
            again = {}
            for _, nm in best:
                t = named[nm][1]
                for variant in ((t._replace(unroll=False),) if args.rows == 1 else ()) + (t._replace(evict=True),):
                    if label(variant, args.rows) not in named:
                        again[label(variant, args.rows)] = (lambda a, d, s, w, dt, v=variant: qmm._pallas_matmul(
                            a, d, s, fmt=args.fmt, compute=jnp.dtype(jnp.bfloat16), interpret=interpret, tiles=v),
                            variant)
            second = time_forms(again, args_list, args.reps, os.path.join(tmp, "second")) if again else None
        cells = []
        for result, table in ((first, named), (second, again)):
            if result is None:
                continue
            for nm, (cell, outs) in result["stats"].items():
                got = np.asarray(outs[0], np.float32)
                rel = float(np.max(np.abs(got - ref[0])) / max(np.max(np.abs(ref[0])), 1e-30))
                tiles = table[nm][1]
                moved = k * n * 2 if nm == "bf16" else q.data.size + q.scales.size * q.scales.dtype.itemsize
                us = cell.get("us", cell["wall_us"])
                cells.append({"form": nm, **cell, "TBps": moved / us / 1e6, "rel_err": rel,
                              "tiles": tiles._asdict() if tiles is not None else None,
                              "split_share": split_share(k, n, tiles, args.rows) if tiles is not None else None})
        payload["weights"][wname] = {
            "shape": [k, n], "calls": calls, "cells": sorted(cells, key=lambda c: c.get("us", c["wall_us"])),
            "failed": {**first["failed"], **(second["failed"] if second else {})},
            "runs": [first["runs_found"], first["runs_expected"]]
            + ([second["runs_found"], second["runs_expected"]] if second else [])}
        common.write_json(name, payload, args.out)
        for c in payload["weights"][wname]["cells"][:6]:
            us = c.get("us", c["wall_us"])
            print(f"{wname} {c['form']}: {us:.2f} us {c['TBps']:.2f} TB/s err {c['rel_err']:.1e}")
        auto = next(c for c in cells if c["form"] == "auto")
        print(f"{wname} auto: {auto.get('us', auto['wall_us']):.2f} us; bf16: "
              f"{next(c for c in cells if c['form'] == 'bf16').get('us', 0):.2f} us")
    payload["elapsed_s"] = time.time() - t0
    common.write_json(name, payload, args.out)
    return payload


if __name__ == "__main__":
    main()
