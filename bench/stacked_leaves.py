"""Would fewer, stacked argument leaves cut a call's fixed cost without slowing the step (issue 16, item 4)?

A call's dispatch pays per argument leaf (`call_dispatch.py`: 291 target parameter leaves, 73 of the state's 105
leaves the target's K/V). Stacking each per-layer tensor into one `[L, ...]` leaf, sliced statically in the unrolled
layer loop, would leave a handful. This times a Qwen3-8B-shaped toy decode step (bf16, batch 1, XLA attention over
a 1,024-token cache, 64 steps in one `fori_loop`; `--tiny` shrinks all of it) three ways:
- `per_layer`: a leaf per layer and tensor, as the package keeps them;
- `stacked`: weights and K/V in `[L, ...]` leaves;
- `kv_stacked`: weights per layer, K/V in two `[L, ...]` leaves written at `(layer, row, position)`;
and for each a jitted no-op call over the same (donated K/V) leaves. Stacked weights reach their products through a
slice of the stack, which XLA may copy out first; three more variants compile with XLA options that might avoid
that copy: `stacked_slice_fusion` (the slice as an address offset of the product, XLA's dynamic-slice fusion, which
applies to library calls), `stacked_slice_fusion_cublas` (the same with cuBLAS in place of Triton GEMMs, so that it
has library calls to apply to) and `per_layer_cublas` (that one's baseline). The variants compiled with XLA's
defaults must end in the same hidden state, bit for bit (`same_state`); cuBLAS rounds otherwise than Triton's GEMMs,
and picks its own algorithms per call, so each variant records how far its state lies from per_layer's
(`state_rel_diff`). The compiled text's copies, slices and dynamic-slice fusions are counted.

    python bench/stacked_leaves.py           # GPU: stacked_leaves.json
    python bench/stacked_leaves.py --tiny    # CPU smoke test at small shapes: stacked_leaves_tiny.json
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import common

FULL = dict(layers=36, hidden=4096, ffn=12288, heads=32, kv_heads=8, head_dim=128, cache=1024, steps=64)
TINY = dict(layers=4, hidden=256, ffn=512, heads=4, kv_heads=2, head_dim=64, cache=128, steps=4)
FORMS = ("per_layer", "stacked", "kv_stacked")
SLICE_FUSION = {"xla_gpu_enable_dynamic_slice_fusion": True}
CUBLAS = {"xla_gpu_enable_triton_gemm": False}
VARIANTS = {"per_layer": ("per_layer", {}), "stacked": ("stacked", {}), "kv_stacked": ("kv_stacked", {}),
            "stacked_slice_fusion": ("stacked", SLICE_FUSION),
            "stacked_slice_fusion_cublas": ("stacked", {**SLICE_FUSION, **CUBLAS}),
            "per_layer_cublas": ("per_layer", CUBLAS)}
"""Each variant's (form, XLA compiler options)."""


def _rms(x, w):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6) * w).astype(x.dtype)


def _layer(c: dict, x, w, kc, vc, pos, i=None):
    """One decoder layer at position `pos`; with `i`, `kc`/`vc` are the stacked `[L, B, S, KV, HD]` caches."""
    h, kv, hd, f = c["heads"], c["kv_heads"], c["head_dim"], c["ffn"]
    qkv = _rms(x, w["n1"]) @ w["wqkv"]
    q = _rms(qkv[:, :h * hd].reshape(1, h, hd), w["qn"])
    k = _rms(qkv[:, h * hd:(h + kv) * hd].reshape(1, kv, hd), w["kn"])
    v = qkv[:, (h + kv) * hd:].reshape(1, kv, hd)
    if i is None:
        kc = jax.lax.dynamic_update_slice(kc, k[None], (0, pos, 0, 0))
        vc = jax.lax.dynamic_update_slice(vc, v[None], (0, pos, 0, 0))
        kl, vl = kc, vc
    else:
        kc = jax.lax.dynamic_update_slice(kc, k[None, None], (i, 0, pos, 0, 0))
        vc = jax.lax.dynamic_update_slice(vc, v[None, None], (i, 0, pos, 0, 0))
        kl, vl = kc[i], vc[i]
    s = jnp.einsum("bkgd,bskd->bkgs", q.reshape(1, kv, h // kv, hd), kl, preferred_element_type=jnp.float32)
    s = jnp.where(jnp.arange(c["cache"]) <= pos, s / np.sqrt(hd), -jnp.inf)
    a = jnp.einsum("bkgs,bskd->bkgd", jax.nn.softmax(s, -1).astype(x.dtype), vl).reshape(1, h * hd)
    x = x + a @ w["wo"]
    gu = _rms(x, w["n2"]) @ w["wgu"]
    return x + (jax.nn.silu(gu[:, :f]) * gu[:, f:]) @ w["wd"], kc, vc


def _steps(c: dict, form: str):
    """The jitted `steps` decode steps of `form`: (weights, K, V, x) -> (x, K, V)."""
    def run(weights, kc, vc, x):
        def body(t, carry):
            x, kc, vc = carry
            if form == "per_layer":
                kc, vc = list(kc), list(vc)
            for i in range(c["layers"]):
                w = {n: a[i] for n, a in weights.items()} if form == "stacked" else weights[i]
                if form == "per_layer":
                    x, kc[i], vc[i] = _layer(c, x, w, kc[i], vc[i], t)
                else:
                    x, kc, vc = _layer(c, x, w, kc, vc, t, i)
            return x, kc, vc
        return jax.lax.fori_loop(0, c["steps"], body, (x, kc, vc))

    return jax.jit(run)


def _trees(c: dict, seed: int = 0):
    """Each form's (weights, K, V): the same values, stacked or split per layer."""
    d, hd = c["hidden"], c["head_dim"]
    shapes = dict(wqkv=(d, (c["heads"] + 2 * c["kv_heads"]) * hd), wo=(c["heads"] * hd, d), wgu=(d, 2 * c["ffn"]),
                  wd=(c["ffn"], d), n1=(d,), n2=(d,), qn=(hd,), kn=(hd,))
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    stacked = {n: (jax.random.normal(k, (c["layers"],) + s, jnp.float32) * 0.02).astype(jnp.bfloat16)
               for k, (n, s) in zip(keys, shapes.items())}
    split = [{n: a[i] for n, a in stacked.items()} for i in range(c["layers"])]
    cache = (c["layers"], 1, c["cache"], c["kv_heads"], hd)

    def kv(form):
        if form == "per_layer":
            return [jnp.zeros(cache[1:], jnp.bfloat16) for _ in range(c["layers"])]
        return jnp.zeros(cache, jnp.bfloat16)

    return {form: ((stacked if form == "stacked" else split), kv(form), kv(form)) for form in FORMS}


def _noop_call_s(w, kc, vc, x, calls: int) -> float:
    """Median seconds of a jitted call that takes the same leaves (K/V donated) and does nothing, fetch included."""
    f = jax.jit(lambda w, kc, vc, x: (kc, vc, x + 1), donate_argnums=(1, 2))
    kc, vc = jax.tree.map(jnp.copy, (kc, vc))
    times = []
    for _ in range(calls + 3):
        t0 = time.perf_counter()
        kc, vc, x = f(w, kc, vc, x)
        np.asarray(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="small shapes on the CPU: tests the script")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--calls", type=int, default=50, help="no-op calls timed per form (median)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                    help="the variants to time, in this order (default all); per_layer is always timed first")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    c = TINY if args.tiny else FULL
    trees = _trees(c)
    x = jnp.ones((1, c["hidden"]), jnp.bfloat16)
    weight_bytes = common.nbytes(trees["stacked"][0])
    payload = common.environment(tiny=args.tiny, reps=args.reps, calls=args.calls, **c)
    payload["weight_bytes"] = weight_bytes
    payload["forms"], states = {}, {}
    for name in dict.fromkeys(["per_layer", *args.variants]):
        form, options = VARIANTS[name]
        w, kc, vc = trees[form]
        compiled = _steps(c, form).lower(w, kc, vc, x).compile(options or None)
        text = compiled.as_text()
        step_s, (y, _, _) = common.timed(compiled, w, kc, vc, x, reps=args.reps)
        step_s, y = step_s / c["steps"], y.astype(jnp.float32)
        row = {"form": form, "xla_options": options, "step_s": step_s, "weight_read_Bps": weight_bytes / step_s,
               "copies": text.count(" copy("), "slices": text.count(" slice("),
               "dynamic_slice_fusions": text.count('"name":"dynamic_slice_fusion"'),
               "leaves": len(jax.tree.leaves((w, kc, vc, x))), "noop_call_s": _noop_call_s(w, kc, vc, x, args.calls),
               "x_sum": float(jnp.sum(y))}
        payload["forms"][name], states[name] = row, y
        print(f"{name:>27}: step {step_s * 1e3:.3f} ms ({row['weight_read_Bps'] / 1e12:.2f} TB/s of weights), "
              f"{row['copies']} copies, {row['slices']} slices, {row['dynamic_slice_fusions']} slice fusions; "
              f"no-op call over {row['leaves']} leaves {row['noop_call_s'] * 1e3:.3f} ms")
    base, y0 = payload["forms"]["per_layer"], states["per_layer"]
    for name, row in payload["forms"].items():
        row["state_rel_diff"] = float(jnp.linalg.norm(states[name] - y0) / jnp.linalg.norm(y0))
        row["step_over_per_layer"] = row["step_s"] / base["step_s"]
        row["noop_call_saved_s"] = base["noop_call_s"] - row["noop_call_s"]
    payload["same_state"] = all(r["state_rel_diff"] == 0 for r in payload["forms"].values() if not r["xla_options"])
    common.write_json("stacked_leaves_tiny.json" if args.tiny else "stacked_leaves.json", payload, args.out)
    return payload


if __name__ == "__main__":
    main()
