"""Every form of a quantised product on the GPU, per weight, format and row count, timed by
`common.per_call_us`: the evidence behind `quant_matmul.choose` and its tile settings (docs/architecture.md,
"Weight precision").

Forms: the plain bf16 product (`bf16`), the reference (`xla_ref`), one int8 row as XLA's column reduction
(`xla_colsum`) and over the transposed weight (`xla_T_rowsum`), the kernel at each setting of `GRID` (`pallas`),
one row padded to the 16-row product kernel (`pallas_dot16_for_1`), and on a GPU the int8 weight through JAX's
Hopper mixed-type matmul (`jax.experimental.pallas.ops.gpu.hopper_mixed_type_matmul_mgpu`, Mosaic GPU: the
transposed weight as its int8 left operand, x's rows padded to 16 as its right) at each setting of `MIXED`
(`mgpu_mixed`): what already exists, timed before a kernel of our own is written. Each cell records its time,
its read bandwidth (packed bytes over time) and its error against the reference. The JSON is rewritten after each cell,
and cells past `--budget` seconds are skipped, so a run cut short keeps what it measured.

    python bench/quant_probe.py --out DIR                          # H200: wqkv, w_down, LM head
    python bench/quant_probe.py --weights wo w_gate_up --out DIR
    python bench/quant_probe.py --tiny                             # CPU smoke test (interpret mode)
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import common
from dflash_jax import quant
from pallas_kernels import quant_matmul as qmm

SHAPES = {"wqkv": (4096, 6144), "wo": (4096, 4096), "w_gate_up": (4096, 24576), "w_down": (12288, 4096),
          "lm_head": (4096, 151936)}
"""Qwen3-8B's weights `[in, out]`."""
TINY_SHAPES = {"wqkv": (1024, 256), "w_down": (2048, 128)}
GRID = {1: [qmm.GEMV_TILES, qmm.Tiles(256, 64, 264, 4, 4), qmm.Tiles(128, 128, 132, 4, 4)],
        16: [qmm.DOT_TILES, qmm.Tiles(128, 128, 264, 4, 3), qmm.Tiles(128, 256, 132, 4, 4)]}
"""Kernel settings per row count: the default first."""
MIXED = [(64, 128, 4), (64, 256, 4), (64, 128, 8)]
"""(tile_m, tile_k, max_concurrent_steps) of the mixed-type matmul: one warpgroup per 64 output channels."""


def mixed_matmul(x, data_t, scales, tile_m: int, tile_k: int, steps: int):
    """`x @ W` for an int8 W through JAX's Hopper mixed-type matmul: `(W.T @ x.T).T * scales`, x padded to 16 rows."""
    from jax.experimental.pallas.ops.gpu import hopper_mixed_type_matmul_mgpu as mixed

    rows = x.shape[0]
    config = mixed.TuningConfig(tile_m=tile_m, tile_n=16, tile_k=tile_k, max_concurrent_steps=steps, epi_tile_n=16,
                                epi_tile_m=64, wg_dimension=mixed.MatmulDimension.M)
    xt = jnp.pad(x, ((0, (-rows) % 16), (0, 0))).T
    out = mixed.mixed_matmul_kernel(data_t, xt, out_dtype=jnp.float32, config=config)
    return (out[:, :rows].T * scales).astype(x.dtype)


def forms(fmt: str, m: int, interpret: bool) -> dict:
    """Name -> (fn(x, *consts), which consts: "bf16", "packed" or "transposed", tiles or None)."""
    f32, bf = jnp.float32, jnp.dtype(jnp.bfloat16)
    out = {"bf16": (lambda a, b: a @ b, "bf16", None),
           "xla_ref": (lambda a, d, s: qmm.quant_matmul(a, d, s, fmt, impl="xla"), "packed", None)}
    if m == 1 and fmt == "int8":
        out["xla_colsum"] = (lambda a, d, s: qmm._column_reduction(a, d, s, bf), "packed", None)
        out["xla_T_rowsum"] = (lambda a, d, s: (jnp.sum(a.astype(f32) * d.astype(f32), 1) * s[0])[None].astype(bf),
                               "transposed", None)
    for i, tiles in enumerate(GRID[m]):
        fn = functools.partial(qmm._pallas_matmul, fmt=fmt, compute=bf, interpret=interpret, tiles=tiles)
        out[f"pallas_{i}"] = (lambda a, d, s, fn=fn: fn(a, d, s), "packed", tiles)
    if m == 1:
        fn = functools.partial(qmm._pallas_matmul, fmt=fmt, compute=bf, interpret=interpret)
        out["pallas_dot16_for_1"] = (lambda a, d, s, fn=fn: fn(jnp.pad(a, ((0, 15), (0, 0))), d, s)[:1], "packed",
                                     qmm.DOT_TILES)
    if fmt == "int8" and not interpret:
        for i, (tm, tk, steps) in enumerate(MIXED):
            fn = functools.partial(mixed_matmul, tile_m=tm, tile_k=tk, steps=steps)
            out[f"mgpu_mixed_{i}"] = (lambda a, d, s, fn=fn: fn(a, d, s), "transposed", (tm, tk, steps))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", nargs="+", default=["wqkv", "w_down", "lm_head"], choices=list(SHAPES))
    ap.add_argument("--formats", nargs="+", default=["int8", "q8_0"], choices=list(qmm.FORMATS))
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 16], choices=sorted(GRID))
    ap.add_argument("--forms", nargs="+", default=None, help="time only the forms named (default: every form)")
    ap.add_argument("--budget", type=float, default=270.0, help="seconds after which cells are skipped")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    t0, cells = time.time(), []
    shapes = TINY_SHAPES if args.tiny else {w: SHAPES[w] for w in args.weights}
    iters, calls = (1, 2) if args.tiny else (8, 16)
    name = f"quant_probe{'_tiny' if args.tiny else ''}.json"
    payload = {**common.environment(**vars(args)), "read_bandwidth_Bps": common.hbm_read_bandwidth(
        common.TINY_PROBE_GIB if args.tiny else 4.0), "cells": cells}
    for wname, shape in shapes.items():
        w32 = jax.random.normal(jax.random.key(0), shape, jnp.float32) / np.sqrt(shape[0])
        consts = {"bf16": (w32.astype(jnp.bfloat16),)}
        for fmt in args.formats:
            q = quant.quantize_array(w32, fmt, jnp.bfloat16, xp=jnp)
            consts["packed"] = (q.data, q.scales)
            consts["transposed"] = (jnp.asarray(q.data.T), q.scales) if fmt == "int8" else None
            for m in args.rows:
                x = jax.random.normal(jax.random.key(m), (m, shape[0]), jnp.bfloat16)
                ref = np.asarray(qmm.quant_matmul(x, q.data, q.scales, fmt, impl="xla"), np.float32)
                for form, (fn, which, tiles) in forms(fmt, m, args.tiny).items():
                    if (time.time() - t0 > args.budget or (form == "bf16" and fmt != args.formats[0])
                            or (args.forms and form not in args.forms)):
                        continue
                    cell = {"weight": wname, "shape": list(shape), "format": fmt, "rows": m, "form": form,
                            "tiles": list(tiles) if tiles else None}
                    try:
                        got = np.asarray(jax.jit(fn)(x, *consts[which]), np.float32)
                        us = common.per_call_us(fn, x, consts[which], iters, calls)
                    except Exception as e:  # a setting the GPU refuses (resources) is recorded, not fatal
                        cell["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    else:
                        cell.update(us=us, TBps=sum(int(c.nbytes) for c in consts[which]) / us / 1e6,
                                    rel_err=float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-6)))
                    cell["elapsed_s"] = time.time() - t0
                    cells.append(cell)
                    print(json.dumps(cell), flush=True)
                    common.write_json(name, payload, args.out)
            del q
        del w32, consts
    return payload


if __name__ == "__main__":
    main()
