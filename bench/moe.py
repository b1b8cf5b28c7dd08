"""Which routed-expert impl of the MoE block is faster on a GPU, and how fast does it read the experts? (bf16)

    python bench/moe.py [--quick] [--sweep] [--geometry G] [--iters N] [--inner N] [--out FILE]   # moe.json

Geometries: Qwen3.5-35B-A3B (E 256, H 2048, I 512, k 8, shared expert 512) and a sanity point with
2048x1536 gate/up experts (Qwen3-30B-A3B: E 128, H 2048, I 768, k 8; given the same shared expert, since
`moe_block` always has one); `--geometry` picks some. Tokens T = batch x verify width in (1x1, 3x1, 1x16,
3x16, 4x16, 8x16), random bf16 weights and a random router.
(0) `--sweep`: `expert_matmul` alone (pallas_kernels/expert_matmul.py), the gate/up and the down product of
the first geometry, per tile setting, at 1 and 16 tokens: microseconds a call and the live experts' bytes
over that time.
(1) Agreement: per geometry and T, every impl against `impl="gather"`, max abs error over
the largest magnitude; above 2e-2 the run fails (exit status 1) after the report.
(2) `cells`: per geometry and T, `<impl>_ms` is the device time of one `moe_block` call
(`common.per_call_us`: `--inner` calls unrolled in one program, each on its own copy of the weights,
against twice as many, median of `--iters`; a device loop added a fixed cost to every iteration).
`bytes` is what a call must read at least: the distinct experts its tokens chose (`distinct_experts`)
times one expert's bytes, plus the shared expert and the router.
`<impl>_TBps` is those bytes over the time, and `<impl>_over_read_bw` the same over the GEMV
weight-streaming bandwidth measured in this run (`common.hbm_read_bandwidth`). `gate_up_dot_ms` times
the first `ragged_dot` alone (the T*k sorted rows by `w_gate_up`), timed the same way.
`faster` names the faster impl per cell.
`--quick` (alias `--tiny`) runs tiny shapes on the CPU: it tests the script, not the speed.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax

import common
from dflash_jax.targets import moe
from pallas_kernels import expert_matmul as em

TOLERANCE = 2e-2
GEOMETRIES = {
    "qwen3.5-35b-a3b": {"e": 256, "h": 2048, "i": 512, "k": 8, "shared": 512},
    "qwen3-30b-a3b-experts": {"e": 128, "h": 2048, "i": 768, "k": 8, "shared": 512},
}
QUICK = {"tiny": {"e": 8, "h": 64, "i": 32, "k": 2, "shared": 32}}
TOKENS = ((1, 1), (3, 1), (1, 16), (3, 16), (4, 16), (8, 16))  # (batch, verify width)
QUICK_TOKENS = ((1, 1), (3, 4))
SWEEP = {"block_k": (128, 256), "block_n": (32, 64, 128), "num_warps": (4,), "num_stages": (3, 4)}
QUICK_SWEEP = {"block_k": (16,), "block_n": (16,), "num_warps": (4,), "num_stages": (3,)}


def random_params(key, geo: dict) -> dict:
    """bf16 weights made on the device, `[in, out]`, each scaled by 1/sqrt(in)."""
    e, h, i, s = geo["e"], geo["h"], geo["i"], geo["shared"]
    shapes = {"router": (h, e), "w_gate_up": (e, h, 2 * i), "w_down": (e, i, h), "shared_gate_up": (h, 2 * s),
              "shared_down": (s, h), "shared_gate": (h, 1)}

    @functools.partial(jax.jit, static_argnums=1)
    def make(key, shape):
        return (jax.random.normal(key, shape, jnp.float32) / shape[-2] ** 0.5).astype(jnp.bfloat16)

    keys = jax.random.split(key, len(shapes))
    return {name: make(k, shape) for k, (name, shape) in zip(keys, shapes.items())}


def block_fn(geo: dict, impl: str):
    return functools.partial(moe.moe_block, top_k=geo["k"], norm_topk_prob=True, impl=impl)


def per_call_ms(block, x, params, iters: int, inner: int) -> float:
    """Device time of one `block` call (`common.per_call_us` over `inner` calls), in ms."""
    return 1e-3 * common.per_call_us(block, x, (params,), iters, inner)


def distinct_experts(x, params, geo: dict) -> int:
    """The distinct experts x's tokens choose: what a call on x must read."""
    _, idx = moe.route(x.reshape(-1, geo["h"]), params["router"], geo["k"], True)
    return int(jnp.sum(jnp.bincount(idx.reshape(-1), length=geo["e"]) > 0))


def gate_up_dot_ms(x, params, geo: dict, iters: int, inner: int) -> float:
    """The first grouped matmul of `impl="ragged"` alone, on x's routing (`common.per_call_us`), in ms."""
    tokens = x.reshape(-1, geo["h"])
    _, idx = moe.route(tokens, params["router"], geo["k"], True)
    rows, sizes, _ = moe._rows_by_expert(tokens, idx, geo["e"])
    dot = functools.partial(lax.ragged_dot, preferred_element_type=jnp.float32)
    return 1e-3 * common.per_call_us(lambda r, w, n: dot(r, w, n), rows, (params["w_gate_up"], sizes), iters, inner)


def expert_bytes(geo: dict) -> int:
    return 2 * 3 * geo["h"] * geo["i"]


def fixed_bytes(geo: dict) -> int:
    """The shared expert (gate/up, down, its gate) and the router, read by every call."""
    h = geo["h"]
    return 2 * (3 * h * geo["shared"] + h + h * geo["e"])


def check_agreement(key, geos: dict, tokens) -> list[dict]:
    """Each impl against gather at every T of each geometry: relative max abs error. Every T, because the grouped
    kernel takes a path of its own at one token (no sort) and each T sets its own group count."""
    results = []
    for g, (name, geo) in enumerate(geos.items()):
        params = random_params(jax.random.fold_in(key, g), geo)
        for b, w in tokens:
            x = jax.random.normal(jax.random.fold_in(key, 1000 + g), (b, w, geo["h"]), jnp.bfloat16)
            ref = jax.jit(block_fn(geo, "gather"))(x, params).astype(jnp.float32)
            for impl in (i for i in moe.MOE_IMPLS if i != "gather"):
                out = jax.jit(block_fn(geo, impl))(x, params).astype(jnp.float32)
                max_err = float(jnp.max(jnp.abs(out - ref)))
                rel_err = max_err / max(float(jnp.max(jnp.abs(ref))), 1e-6)
                ok = bool(jnp.all(jnp.isfinite(out))) and rel_err <= TOLERANCE
                results.append({"geometry": name, "impl": impl, "T": b * w, "max_abs_err": max_err,
                                "rel_err": rel_err, "ok": ok})
                print(f"check {name} {impl} T={b * w} max_abs_err={max_err:.3e} rel={rel_err:.3e} "
                      f"{'ok' if ok else 'FAIL'}", flush=True)
    return results


def time_cells(key, geos: dict, tokens, read_bw: float, iters: int, inner: int) -> list[dict]:
    cells = []
    for g, (name, geo) in enumerate(geos.items()):
        params = random_params(jax.random.fold_in(key, g), geo)
        for b, w in tokens:
            x = jax.random.normal(jax.random.fold_in(key, 1000 * (g + 1) + b * w), (b, w, geo["h"]), jnp.bfloat16)
            distinct = distinct_experts(x, params, geo)
            row = {"geometry": name, "batch": b, "width": w, "T": b * w, "rows": b * w * geo["k"],
                   "distinct_experts": distinct, "bytes": distinct * expert_bytes(geo) + fixed_bytes(geo)}
            for impl in moe.MOE_IMPLS:
                ms = per_call_ms(block_fn(geo, impl), x, params, iters, inner)
                row[f"{impl}_ms"] = ms
                row[f"{impl}_TBps"] = row["bytes"] / (ms * 1e-3) / 1e12
                row[f"{impl}_over_read_bw"] = row["bytes"] / (ms * 1e-3) / read_bw
            row["gate_up_dot_ms"] = gate_up_dot_ms(x, params, geo, iters, inner)
            row["faster"] = min(moe.MOE_IMPLS, key=lambda impl: row[f"{impl}_ms"])
            cells.append(row)
            times = " ".join(f"{impl}={row[f'{impl}_ms']:.4f}ms ({row[f'{impl}_TBps']:.2f} TB/s)"
                             for impl in moe.MOE_IMPLS)
            print(f"time {name} T={b * w:3d} distinct={distinct:6.1f} {times} "
                  f"gate_up_dot={row['gate_up_dot_ms']:.4f}ms", flush=True)
    return cells


def sweep_tiles(key, geo: dict, grid: dict, iters: int, inner: int) -> list[dict]:
    """`expert_matmul` alone (the gate/up and the down product of one geometry) per tile setting, at 1 token
    (k live groups of 1 row) and at 16 (the distinct experts of 16 random routings, groups of up to 16 rows)."""
    params = random_params(key, geo)
    rows = []
    for t in (1, 16):
        idx = jnp.stack([jax.random.permutation(jax.random.fold_in(key, 7 + r), geo["e"])[:geo["k"]]
                         for r in range(t)])
        uniq = jnp.unique(idx)
        groups = min(geo["e"], t * geo["k"])
        expert = jnp.full((groups,), -1, jnp.int32).at[:uniq.shape[0]].set(uniq.astype(jnp.int32))
        for name, w in (("gate_up", params["w_gate_up"]), ("down", params["w_down"])):
            x = jax.random.normal(jax.random.fold_in(key, t), (groups, t, w.shape[1]), jnp.bfloat16)
            live_bytes = int(uniq.shape[0]) * w.shape[1] * w.shape[2] * 2
            for tiles in itertools.product(*grid.values()):
                setting = dict(zip(grid, tiles))

                us = common.per_call_us(functools.partial(em.expert_matmul, expert=expert, impl="pallas", **setting),
                                        x, (w,), iters, inner)
                rows.append({"T": t, "product": name, **setting, "us": us, "live_experts": int(uniq.shape[0]),
                             "TBps": live_bytes / (us * 1e-6) / 1e12})
                print(f"sweep T={t:2d} {name:7s} {setting} {us:8.2f} us {rows[-1]['TBps']:.2f} TB/s", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=20, help="timed samples per cell (median)")
    ap.add_argument("--inner", type=int, default=20, help="calls per sample, unrolled in one program")
    ap.add_argument("--quick", "--tiny", action="store_true", help="tiny shapes on the CPU: tests the script")
    ap.add_argument("--out", default=None, help="output JSON file (default bench/results/moe.json)")
    ap.add_argument("--sweep", action="store_true", help="also time expert_matmul's tile settings (first geometry)")
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), action="append",
                    help="time only these geometries (repeatable; default all)")
    args = ap.parse_args(argv)
    geos, tokens = (QUICK, QUICK_TOKENS) if args.quick else (GEOMETRIES, TOKENS)
    if args.geometry and not args.quick:
        geos = {name: geo for name, geo in geos.items() if name in args.geometry}
    iters, inner = (2, 2) if args.quick else (args.iters, args.inner)
    key = jax.random.key(0)
    read_bw = common.hbm_read_bandwidth(common.TINY_PROBE_GIB if args.quick else 4.0)
    payload = common.environment(iters=iters, inner=inner, quick=args.quick)
    payload.update(geometries=geos, tokens=[{"batch": b, "width": w} for b, w in tokens], dtype="bfloat16",
                   norm_topk_prob=True, read_bandwidth_Bps=read_bw, tolerance_rel=TOLERANCE,
                   grouped_max_tokens=moe.GROUPED_MAX_TOKENS)
    if args.sweep:
        payload["sweep"] = sweep_tiles(key, next(iter(geos.values())), QUICK_SWEEP if args.quick else SWEEP,
                                       iters, inner)
    payload["checks"] = check_agreement(key, geos, tokens)
    payload["cells"] = time_cells(key, geos, tokens, read_bw, iters, inner)
    payload["faster_by_T"] = {name: {str(c["T"]): c["faster"] for c in payload["cells"] if c["geometry"] == name}
                              for name in geos}
    heads = "".join(f" {impl + ' ms':>11s} {'TB/s':>6s}" for impl in moe.MOE_IMPLS)
    print(f"\n{'geometry':24s} {'T':>3s} {'distinct':>8s}{heads} {'faster':>7s}")
    for c in payload["cells"]:
        times = "".join(f" {c[f'{impl}_ms']:11.4f} {c[f'{impl}_TBps']:6.2f}" for impl in moe.MOE_IMPLS)
        print(f"{c['geometry']:24s} {c['T']:3d} {c['distinct_experts']:8.1f}{times} {c['faster']:>7s}")
    out = args.out or os.path.join(common.RESULTS, "moe_quick.json" if args.quick else "moe.json")
    common.write_json(os.path.basename(out), payload, os.path.dirname(os.path.abspath(out)))
    failed = [f"{c['geometry']} {c['impl']} T={c['T']}" for c in payload["checks"] if not c["ok"]]
    if failed:
        print(f"FAIL: disagrees with gather beyond {TOLERANCE} (relative) at: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
