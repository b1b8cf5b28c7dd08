"""Do the target's GEMMs stream their weights as fast at 16 rows (a verify) as at 1 (a step)?

A 16-row verify reads the same weights as a 1-row decode step, so on a memory-bound GPU it
should cost the same; `spec_round.py` measured it 14% slower. This times `x [M, K] @ W` for
each weight shape of a Qwen3-8B layer and its LM head, at M = 1, 16 and 64, with the weight
stored two ways: `in_out` `[K, N]` (how dflash-jax stores it) and `out_in` `[N, K]`
(Hugging Face's layout, contracted on its last axis). Each timing runs the product against
`--copies` distinct weights (more bytes than the L2 cache), `--reps` calls back to back with
one block at the end; it reports microseconds per product, the kernels XLA chose, and the
achieved bandwidth (weight bytes / time) over the copy bandwidth measured in the same run
(`common.hbm_bandwidth`, read plus write: a read-only GEMV can exceed 1).

    python bench/gemm_check.py [--tiny] [--out DIR]     # writes gemm_check.json
"""
from __future__ import annotations

import argparse
import re
import time

import jax
import jax.numpy as jnp

import common

LAYOUTS = ("in_out", "out_in")


def shapes(cfg) -> dict:
    """name -> (K, N) of the weights a decode step multiplies by."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    return {"wqkv": (h, cfg.q_width + 2 * cfg.kv_width), "wo": (cfg.q_width, h), "w_gate_up": (h, 2 * f),
            "w_down": (f, h), "lm_head": (h, cfg.vocab_size)}


def product(layout: str):
    """`x @ W` for each weight, in `layout`."""
    def run(x, weights):
        if layout == "in_out":
            return [x @ w for w in weights]
        return [jax.lax.dot_general(x, w, (((1,), (1,)), ((), ()))) for w in weights]
    return jax.jit(run)


def kernels(fn, *args) -> list:
    """What XLA lowered the products to: the custom-call targets and fusion kinds, sorted, once each."""
    text = fn.lower(*args).compile().as_text()
    found = re.findall(r'custom_call_target="([^"]+)"|"kind":"([^"]+)"', text)
    return sorted({a or b for a, b in found})


def measure(k: int, n: int, rows: int, layout: str, copies: int, reps: int, bandwidth: float, key) -> dict:
    keys = jax.random.split(key, copies + 1)
    shape = (k, n) if layout == "in_out" else (n, k)
    weights = [jax.random.normal(kk, shape, jnp.bfloat16) for kk in keys[1:]]
    x = jax.random.normal(keys[0], (rows, k), jnp.bfloat16)
    fn = product(layout)
    jax.block_until_ready(fn(x, weights))
    jax.block_until_ready(fn(x, weights))
    t0 = time.perf_counter()
    outs = [fn(x, weights) for _ in range(reps)]  # back to back: host dispatch overlaps the device
    jax.block_until_ready(outs)
    per = (time.perf_counter() - t0) / (reps * copies)
    weight_bytes = k * n * 2
    return {"K": k, "N": n, "rows": rows, "layout": layout, "kernels": kernels(fn, x, weights), "us": per * 1e6,
            "bandwidth_Bps": weight_bytes / per, "bandwidth_ratio": weight_bytes / per / bandwidth}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--copies", type=int, default=8, help="distinct weights per timing (8 x 100 MB > L2)")
    ap.add_argument("--reps", type=int, default=50, help="calls timed back to back")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU: tests the script, not the speed")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cfg = common.TINY if args.tiny else common.QWEN3_8B
    bandwidth = common.hbm_bandwidth(common.TINY_PROBE_GIB if args.tiny else 4.0)
    key = jax.random.key(0)
    records = []
    for name, (k, n) in shapes(cfg).items():
        copies = 1 if name == "lm_head" and not args.tiny else args.copies
        for rows in args.rows:
            for layout in LAYOUTS:
                key, sub = jax.random.split(key)
                rec = dict(weight=name, **measure(k, n, rows, layout, copies, args.reps, bandwidth, sub))
                records.append(rec)
                print(f"{name:10s} K {k:6d} N {n:6d} rows {rows:3d} {layout:7s} {rec['us']:9.1f} us "
                      f"{rec['bandwidth_ratio']:.2f} of HBM", flush=True)
    payload = common.environment(rows=args.rows, copies=args.copies, reps=args.reps, tiny=args.tiny)
    payload.update(hbm_bandwidth_Bps=bandwidth, model="Qwen3-8B shape" if not args.tiny else "tiny", records=records)
    common.write_json("gemm_check_tiny.json" if args.tiny else "gemm_check.json", payload, args.out)


if __name__ == "__main__":
    main()
