"""GPU check of `block_attention`: Pallas vs XLA agreement, then timings at the benchmark shapes.

    python bench/kernel_check.py [--out bench/results/kernel_check.json] [--iters 20] [--inner 20] [--sweep]

(1) Random bf16 inputs at several shapes (ragged lengths, windows, capacities that are not a
multiple of the tile): max abs error of `impl="pallas"` against `impl="xla"`, relative to the
reference's largest magnitude; any error above 2e-2 (1e-4 for a few of the shapes again in f32)
fails the run (exit status 1) after the report.
(2) Time per call of both at the drafter shapes (b=16 rows, nh=32, nkv=8, hd=128, capacity 9216,
ctx 512 / 8192, window None / 2048) and the target's verify (W=16) and decode (W=1) at batch 1,
4, 16: `*_us` is the median over `--iters` samples (`jax.block_until_ready` each) of one jitted
call that runs the attention `--inner` times in a `fori_loop` (output fed back as the next query),
divided by `--inner`: the device time per call as inside a jitted model, without the host round
trip of a lone dispatch.
(3) A table on stdout and JSON (device, jax version, date, every row) at `--out`.
`--sweep` also times Pallas tile settings at three long-context shapes (how the defaults were chosen).
Timings are recorded, never asserted.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402
from pallas_kernels import windowed_attention as wa  # noqa: E402

TOLERANCE = {"bfloat16": 2e-2, "float32": 1e-4}
CAPACITY = 9216
NH, NKV, HD = 32, 8, 128

# (name, batch, W, nh, nkv, hd, capacity, ctx_len per row, window, causal): all in bf16, the first
# F32_CHECKS also in f32
F32_CHECKS = 3
CHECK_SHAPES = [
    ("drafter ragged full", 4, 16, 32, 8, 128, 1000, [0, 1, 517, 1000], None, False),
    ("drafter ragged sliding", 4, 16, 32, 8, 128, 1000, [3, 100, 517, 999], 64, True),
    ("drafter symmetric window", 2, 16, 32, 8, 128, 300, [250, 7], 5, False),
    ("verify gqa2 hd64", 3, 16, 16, 8, 64, 777, [776, 64, 0], None, True),
    ("decode gqa4", 2, 1, 32, 8, 128, CAPACITY, [8192, 1], None, True),
    ("prefill chunk", 1, 100, 32, 8, 128, 500, [300], None, True),
    ("mha hd128", 2, 8, 8, 8, 128, 129, [129, 65], 32, True),
    ("verify gqa8 hd256 (Qwen3.5-35B-A3B)", 1, 16, 16, 2, 256, 600, [512], None, True),
    ("decode gqa8 hd256 (Qwen3.5-35B-A3B)", 1, 1, 16, 2, 256, 600, [512], None, True),
]


def timing_shapes() -> list[tuple]:
    """(name, batch, W, ctx_len, window, causal) at the benchmark shapes."""
    rows = []
    for ctx in (512, 8192):
        for window, causal in ((None, False), (2048, True)):
            rows.append((f"drafter ctx={ctx} window={window}", 16, 16, ctx, window, causal))
    for w, kind in ((16, "verify"), (1, "decode")):
        for ctx in (512, 8192):
            for batch in (1, 4, 16):
                rows.append((f"{kind} b={batch} ctx={ctx}", batch, w, ctx, None, True))
    return rows


def random_inputs(key, batch, w, nh, nkv, hd, capacity, dtype=jnp.bfloat16):
    """q, k_ctx, v_ctx, k_blk, v_blk with unit-normal entries."""
    shapes = [(batch, w, nh, hd), (batch, capacity, nkv, hd), (batch, capacity, nkv, hd),
              (batch, w, nkv, hd), (batch, w, nkv, hd)]
    keys = jax.random.split(key, len(shapes))
    return [jax.random.normal(k, s, jnp.float32).astype(dtype) for k, s in zip(keys, shapes)]


def attention_fn(impl: str, hd: int, causal: bool, window, **tiles):
    """`block_attention` with the static arguments bound (or the Pallas path with explicit tile settings)."""
    if tiles:
        return functools.partial(wa._pallas_attention, scale=hd ** -0.5, causal=causal, window=window,
                                 interpret=False, **tiles)
    return functools.partial(wa.block_attention, scale=hd ** -0.5, causal=causal, window=window, impl=impl)


def looped(fn, inner: int):
    """`fn` run `inner` times in one jitted `fori_loop` (static trip count), each output the next query."""
    def run(q, kc, vc, lens, kb, vb):
        return jax.lax.fori_loop(0, inner, lambda _, x: fn(x, kc, vc, lens, kb, vb), q)
    return jax.jit(run)


def median_us(fn, args, iters: int, inner: int) -> float:
    """Median wall time of `looped(fn, inner)` after a warm-up (compile) call, per inner call, in us."""
    run = looped(fn, inner)
    jax.block_until_ready(run(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(run(*args))
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times) / inner


def check_agreement(key) -> list[dict]:
    """Pallas vs XLA on random bf16 and f32 inputs; relative max abs error per shape."""
    results = []
    cases = ([("bfloat16", *shape) for shape in CHECK_SHAPES]
             + [("float32", *shape) for shape in CHECK_SHAPES[:F32_CHECKS]])
    for i, (dtype, name, batch, w, nh, nkv, hd, cap, lens, window, causal) in enumerate(cases):
        inputs = random_inputs(jax.random.fold_in(key, i), batch, w, nh, nkv, hd, cap, jnp.dtype(dtype))
        q, kc, vc, kb, vb = inputs
        ctx_len = jnp.asarray(lens, jnp.int32)
        ref, out = (jax.jit(attention_fn(impl, hd, causal, window))(q, kc, vc, ctx_len, kb, vb).astype(jnp.float32)
                    for impl in ("xla", "pallas"))
        max_err = float(jnp.max(jnp.abs(out - ref)))
        rel_err = max_err / max(float(jnp.max(jnp.abs(ref))), 1e-6)
        finite = bool(jnp.all(jnp.isfinite(out)))
        ok = finite and rel_err <= TOLERANCE[dtype]
        results.append({"name": name, "dtype": dtype, "batch": batch, "W": w, "nh": nh, "nkv": nkv, "hd": hd,
                        "capacity": cap, "ctx_len": lens, "window": window, "causal": causal,
                        "max_abs_err": max_err, "rel_err": rel_err, "finite": finite, "ok": ok})
        print(f"check {dtype:8s} {name:28s} max_abs_err={max_err:.3e} rel={rel_err:.3e} {'ok' if ok else 'FAIL'}",
              flush=True)
    return results


def time_shapes(key, iters: int, inner: int) -> list[dict]:
    """Median time of XLA and Pallas at the benchmark shapes."""
    results = []
    for i, (name, batch, w, ctx, window, causal) in enumerate(timing_shapes()):
        q, kc, vc, kb, vb = random_inputs(jax.random.fold_in(key, i), batch, w, NH, NKV, HD, CAPACITY)
        args = (q, kc, vc, jnp.full((batch,), ctx, jnp.int32), kb, vb)
        row = {"name": name, "batch": batch, "W": w, "ctx_len": ctx, "window": window, "causal": causal}
        for impl in wa.IMPLS:
            row[f"{impl}_us"] = median_us(attention_fn(impl, HD, causal, window), args, iters, inner)
        row["speedup"] = row["xla_us"] / row["pallas_us"]
        row["faster"] = "pallas" if row["speedup"] > 1.0 else "xla"
        results.append(row)
        print(f"time  {name:28s} xla={row['xla_us']:9.1f}us pallas={row['pallas_us']:9.1f}us x{row['speedup']:.2f}",
              flush=True)
        del q, kc, vc, kb, vb, args
    return results


def sweep_tiles(key, iters: int, inner: int) -> list[dict]:
    """Pallas tile settings at a drafter shape and batch-1 verify / decode shapes (long context)."""
    settings = [dict(block_k=bk, num_warps=nw, num_stages=ns) for bk in (32, 64, 128)
                for nw, ns in ((4, 2), (4, 3), (4, 4), (8, 3))]
    settings += [dict(kv_splits=s) for s in (1, 2, 4, 8, 16, 32, 64)]
    results = []
    for name, batch, w, window, causal in (("drafter b=16", 16, 16, None, False), ("verify b=1", 1, 16, None, True),
                                           ("decode b=1", 1, 1, None, True)):
        q, kc, vc, kb, vb = random_inputs(key, batch, w, NH, NKV, HD, CAPACITY)
        args = (q, kc, vc, jnp.full((batch,), 8192, jnp.int32), kb, vb)
        for tiles in settings:
            try:
                us = median_us(attention_fn("pallas", HD, causal, window, **tiles), args, iters, inner)
            except Exception as e:  # a tile setting the compiler refuses is a result, not a crash
                us = None
                print(f"sweep {name} {tiles}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            results.append({"name": name, "ctx_len": 8192, **tiles, "pallas_us": us})
            if us is not None:
                print(f"sweep {name:14s} {tiles} {us:9.1f}us", flush=True)
    return results


def print_table(rows: list[dict]) -> None:
    """Timing table: one line per shape."""
    print(f"\n{'shape':32s} {'xla us':>10s} {'pallas us':>10s} {'speedup':>8s}  faster   (device time per call)")
    for r in rows:
        print(f"{r['name']:32s} {r['xla_us']:10.1f} {r['pallas_us']:10.1f} {r['speedup']:8.2f}  {r['faster']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/kernel_check.json")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--inner", type=int, default=20)
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    key = jax.random.key(0)
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}", flush=True)
    report = {"device": device.device_kind, "platform": device.platform, "jax_version": jax.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "tolerance_rel": TOLERANCE, "iters": args.iters, "inner": args.inner,
              "defaults": {"block_q": wa.BLOCK_Q, "block_k": wa.BLOCK_K, "num_warps": wa.NUM_WARPS,
                           "num_stages": wa.NUM_STAGES, "target_programs": wa.TARGET_PROGRAMS}}
    report["checks"] = check_agreement(key)
    report["timings"] = time_shapes(key, args.iters, args.inner)
    if args.sweep:
        report["sweep"] = sweep_tiles(key, args.iters, args.inner)
    print_table(report["timings"])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")
    failed = [f"{c['name']} ({c['dtype']})" for c in report["checks"] if not c["ok"]]
    return common.exit_status(failed, TOLERANCE)


if __name__ == "__main__":
    sys.exit(main())
