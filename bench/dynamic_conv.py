"""Is the Pallas dynamic conv faster than XLA's fusion of the jnp reference? (DFlash2, bf16)

    python bench/dynamic_conv.py [--tiny] [--sweep] [--out DIR]     # writes dynamic_conv.json

The DFlash2 fixture's geometry (H 6656, groups of 16 so G 416, k 2, blocks of T 16 rows), bf16, for
N = 1, 4, 16, 64 blocks:
(1) Agreement: per N and half, the max abs error of `impl="pallas"` against `impl="xla"` over the
reference's largest magnitude; above 2e-2 the run fails (exit status 1) after the report.
(2) `cells`: per N, half (prepare, finish) and impl, `*_us` is the device time per call
(`common.per_call_us`: `--inner` calls unrolled in one program, each on its own copy of the arguments,
against twice as many, median of `--iters`; a device loop added a fixed cost to every iteration).
`layer` rows time prepare as a layer runs it: the kernel projection `x @ W` (W [H, 2kG]) then the conv.
`bytes` is what a call must move (x and the output, this half of dyn and of base; for `layer`, W instead
of dyn), `roofline_us` those bytes over the copy bandwidth measured in the same run
(`common.hbm_bandwidth`). The whole working set of a call fits in an H200's 50 MB L2, so a call can beat
that roofline.
(3) `--sweep` also times Pallas tile settings (block_h x rows per program x num_stages) at the
smallest and the largest N, prepare only.
`--tiny` runs a tiny geometry on the CPU (Pallas in interpret mode): it tests the script, not the speed.
"""
from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp

import common
from pallas_kernels import dynamic_conv as dc

TOLERANCE = 2e-2
REAL = {"h": 6656, "gs": 16, "k": 2, "t": 16, "batches": (1, 4, 16, 64)}
TINY = {"h": 64, "gs": 4, "k": 2, "t": 4, "batches": (2,)}
HALVES = {0: "prepare", 1: "finish"}


def random_inputs(key, n: int, geo: dict):
    """x [n, T, H] unit normal; dyn, base scaled so a looped conv neither grows nor dies out; W [H, 2kG]."""
    h, k, t = geo["h"], geo["k"], geo["t"]
    width = 2 * k * (h // geo["gs"])
    kx, kd, kb, kw = jax.random.split(key, 4)
    normal = lambda key, shape, scale: (scale * jax.random.normal(key, shape, jnp.float32)).astype(jnp.bfloat16)
    return (normal(kx, (n, t, h), 1.0), normal(kd, (n, t, width), 0.5), normal(kb, (2, k, h), 0.5),
            normal(kw, (h, width), 0.1 / h ** 0.5))


def conv_fn(impl: str, which: int, **tiles):
    """`dynamic_conv` with its static arguments bound, or the Pallas path with explicit tiles."""
    if tiles:
        interpret = jax.default_backend() != "gpu"
        return functools.partial(dc._pallas_conv, which=which, interpret=interpret, **tiles)
    return functools.partial(dc.dynamic_conv, which=which, impl=impl)


def conv_bytes(n: int, geo: dict) -> int:
    """x read, output written, one half of dyn and of base read (bf16)."""
    h, k, t = geo["h"], geo["k"], geo["t"]
    return 2 * (2 * n * t * h + n * t * k * (h // geo["gs"]) + k * h)


def layer_bytes(n: int, geo: dict) -> int:
    """x and W read, output written, one half of base read (dyn can stay on chip)."""
    h, k, t = geo["h"], geo["k"], geo["t"]
    return 2 * (2 * n * t * h + h * 2 * k * (h // geo["gs"]) + k * h)


def check_agreement(key, geo: dict) -> list[dict]:
    """Pallas against XLA at every N and half, relative max abs error."""
    results = []
    for n in geo["batches"]:
        x, dyn, base, _ = random_inputs(jax.random.fold_in(key, n), n, geo)
        for which, half in HALVES.items():
            ref, out = (jax.jit(conv_fn(impl, which))(x, dyn, base).astype(jnp.float32) for impl in dc.IMPLS)
            max_err = float(jnp.max(jnp.abs(out - ref)))
            rel_err = max_err / max(float(jnp.max(jnp.abs(ref))), 1e-6)
            ok = bool(jnp.all(jnp.isfinite(out))) and rel_err <= TOLERANCE
            results.append({"N": n, "half": half, "max_abs_err": max_err, "rel_err": rel_err, "ok": ok})
            print(f"check N={n:3d} {half:8s} max_abs_err={max_err:.3e} rel={rel_err:.3e} {'ok' if ok else 'FAIL'}",
                  flush=True)
    return results


def time_cells(key, geo: dict, bandwidth: float, iters: int, inner: int) -> list[dict]:
    """Both impls per N and half, and prepare after the projection matmul (`layer`)."""
    cells = []
    for n in geo["batches"]:
        x, dyn, base, w = random_inputs(jax.random.fold_in(key, n), n, geo)
        for half in (*HALVES.values(), "layer"):
            row = {"N": n, "rows_total": n * geo["t"], "half": half}
            for impl in dc.IMPLS:
                if half == "layer":
                    conv = conv_fn(impl, 0)
                    row[f"{impl}_us"] = common.per_call_us(lambda a, w_, b: conv(a, a @ w_, b), x, (w, base), iters,
                                                           inner)
                else:
                    conv = conv_fn(impl, 1 if half == "finish" else 0)
                    row[f"{impl}_us"] = common.per_call_us(conv, x, (dyn, base), iters, inner)
            row["bytes"] = layer_bytes(n, geo) if half == "layer" else conv_bytes(n, geo)
            row["roofline_us"] = 1e6 * row["bytes"] / bandwidth
            row["speedup"] = row["xla_us"] / row["pallas_us"]
            row["faster"] = "pallas" if row["speedup"] > 1.0 else "xla"
            for impl in dc.IMPLS:
                row[f"{impl}_over_roofline"] = row[f"{impl}_us"] / row["roofline_us"]
            cells.append(row)
            print(f"time N={n:3d} {half:8s} xla={row['xla_us']:8.2f}us pallas={row['pallas_us']:8.2f}us "
                  f"x{row['speedup']:.2f} roofline={row['roofline_us']:.2f}us", flush=True)
    return cells


def sweep_tiles(key, geo: dict, iters: int, inner: int) -> list[dict]:
    """Pallas prepare at the smallest and largest N over channel tiles, rows per program and stages."""
    tiles = [b for b in (2 ** i for i in range(10)) if geo["h"] % b == 0][-2:]  # 256, 512 at H 6656
    results = []
    for n in sorted({geo["batches"][0], geo["batches"][-1]}):
        x, dyn, base, _ = random_inputs(jax.random.fold_in(key, n), n, geo)
        for block_h in tiles:
            for rows in sorted({1, 4, geo["t"]}):
                for stages in (1, 3):
                    fn = conv_fn("pallas", 0, block_h=block_h, rows=rows, num_stages=stages)
                    us = common.per_call_us(fn, x, (dyn, base), iters, inner)
                    results.append({"N": n, "block_h": block_h, "rows": rows, "num_stages": stages, "pallas_us": us})
                    print(f"sweep N={n:3d} block_h={block_h:3d} rows={rows:2d} stages={stages} {us:8.2f}us", flush=True)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=20, help="timed samples per cell (median)")
    ap.add_argument("--inner", type=int, default=50, help="calls per sample, unrolled in one program")
    ap.add_argument("--sweep", action="store_true", help="also time Pallas tile settings")
    ap.add_argument("--tiny", action="store_true", help="tiny geometry on the CPU: tests the script, not the speed")
    ap.add_argument("--out", default=None, help="output folder (default bench/results)")
    args = ap.parse_args(argv)
    geo = TINY if args.tiny else REAL
    iters, inner = (2, 2) if args.tiny else (args.iters, args.inner)
    key = jax.random.key(0)
    bandwidth = common.hbm_bandwidth(common.TINY_PROBE_GIB if args.tiny else 4.0)
    payload = common.environment(iters=iters, inner=inner, sweep=args.sweep, tiny=args.tiny)
    payload.update(geometry={**geo, "G": geo["h"] // geo["gs"], "dtype": "bfloat16"}, hbm_bandwidth_Bps=bandwidth,
                   tolerance_rel=TOLERANCE, gpu_default_impl=dc.GPU_DEFAULT_IMPL,
                   tiles={"block_h": dc.BLOCK_H, "target_programs": dc.TARGET_PROGRAMS, "num_warps": dc.NUM_WARPS,
                          "num_stages": dc.NUM_STAGES})
    payload["checks"] = check_agreement(key, geo)
    payload["cells"] = time_cells(key, geo, bandwidth, iters, inner)
    payload["pallas_faster_in"] = [f"N={c['N']} {c['half']}" for c in payload["cells"] if c["faster"] == "pallas"]
    if args.sweep:
        payload["sweep"] = sweep_tiles(key, geo, iters, inner)
    print(f"\n{'N':>4s} {'half':8s} {'xla us':>9s} {'pallas us':>9s} {'speedup':>8s} {'roofline us':>11s}")
    for c in payload["cells"]:
        print(f"{c['N']:4d} {c['half']:8s} {c['xla_us']:9.2f} {c['pallas_us']:9.2f} {c['speedup']:8.2f} "
              f"{c['roofline_us']:11.2f}")
    common.write_json("dynamic_conv_tiny.json" if args.tiny else "dynamic_conv.json", payload, args.out)
    failed = [f"N={c['N']} {c['half']}" for c in payload["checks"] if not c["ok"]]
    return common.exit_status(failed, TOLERANCE)


if __name__ == "__main__":
    sys.exit(main())
