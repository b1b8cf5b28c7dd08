"""Long-prompt prefill on the GPU (issue 16, item 6): seconds and its share of the bf16 matrix peak.

    python bench/prefill.py                  # H200: batch 1, a 32,000-token prompt (prefill.json)
    python bench/prefill.py --tiny           # CPU smoke test

The Qwen3-8B-shaped target (random bf16 weights) prefills a random prompt through `dflash_jax.generate` with one
new token; `prefill_s` is the median of `--reps` runs' `prefill_time_s` (prompt and first token) after one
warm-up. `weight_flops` are 2 x the layers' weight elements per prompt token and the LM head for the first token: the
count behind issue 16's figure (1.84 s, about 0.36 of the peak). `flops` adds the causal attention's
2 x P^2 x heads x head_dim per layer (QK^T and PV over the lower triangle), 40% of the work at 32,000 tokens.
Shares of a peak, each per count:
  `share_of_stated_peak`  weight FLOPs per second over issue 16's ~789 TFLOP/s for bf16 on the H200
                          (`STATED_PEAK_FLOPS`; target >= 0.60; `summary.json`'s `prefill_share_of_peak`);
  `share_of_stated_peak_with_attention`  the same with the attention counted;
  `share_of_gemm`         all FLOPs per second over a large bf16 product (`--gemm` cubed) timed in the same run.
`no_recompile`: no timed prefill compiled (each cell's `compiles_after_warmup`).
`by_chunk` holds every (`--attention`, `--chunks`) cell, the chunks' attention through the Pallas kernel or cuDNN
(`policy.PREFILL_ATTENTION`; on a CPU both run XLA's); the top-level figures are the library's defaults' cell.
`attention` times one layer's chunk attention alone at the mean context, either impl (GPU only).
`self_attention` times one layer's causal attention over `--self-attention` tokens (issue 16's 16,384) by cuDNN
and by JAX's own Mosaic GPU flash attention for Hopper (`jax.experimental.pallas.ops.gpu.attention_mgpu`, at each
of `MOSAIC_BLOCKS`, in float16 as its buffers are), with their FLOPs per second and the kernel's agreement with
cuDNN (GPU only): what a Mosaic GPU prefill kernel must beat, measured before one of ours is written.
"""
from __future__ import annotations

import argparse
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

import acceptance as acc
import common
import dflash_jax
from dflash_jax.config import policy
from pallas_kernels.windowed_attention import block_attention

STATED_PEAK_FLOPS = 789e12
TARGET_SHARE = 0.60
MOSAIC_BLOCKS = [(64, 128, 2), (64, 256, 2), (64, 128, 4)]
"""(block_q, block_kv, max_concurrent_steps) of JAX's Mosaic GPU flash attention (its own sweep's range)."""


def prefill_flops(target, prompt: int) -> tuple[float, float]:
    """`(weight_flops, attention_flops)` of prefilling one `prompt`-token row (module docstring)."""
    c, p = target.config, target.params
    layer_elements = sum(x.size for i in range(c.num_layers) for x in jax.tree.leaves(p[f"layers_{i}"])
                         if x.ndim >= 2)
    head = c.vocab_size * c.hidden_size
    return 2.0 * layer_elements * prompt + 2.0 * head, 2.0 * prompt ** 2 * c.num_heads * c.head_dim * c.num_layers


def gemm_flops_per_s(n: int, reps: int) -> float:
    """bf16 `[n, n] @ [n, n]` FLOP/s on this device (median of `reps`)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    seconds, _ = common.timed(jax.jit(lambda x: x @ x), a, reps=reps, warmup=2)
    return 2.0 * n ** 3 / seconds


def time_prefill(target, prompts, chunk: int, attention: str, reps: int,
                 counter: acc.CompileCounter) -> tuple[list, dict]:
    """Seconds of `reps` prefills at `chunk` positions per `extend` with `attention` as the chunks' impl (set in
    `policy.PREFILL_ATTENTION` for the GPU default, "pallas"), after one warm-up at the same shapes, and the
    compiles of the timed prefills (`CompileCounter.since`: none if the warm-up compiled every program)."""
    saved = dict(policy.PREFILL_ATTENTION)
    policy.PREFILL_ATTENTION["pallas"] = attention
    jax.clear_caches()  # the loop's static arguments do not name the prefill's impl: trace it again
    run = lambda: dflash_jax.generate(target, None, prompts, max_new_tokens=1,  # noqa: E731
                                      prefill_chunk=chunk).stats.prefill_time_s
    try:
        run()
        mark = counter.mark()
        return [run() for _ in range(reps)], counter.since(mark)
    finally:
        policy.PREFILL_ATTENTION.clear()
        policy.PREFILL_ATTENTION.update(saved)


def attention_cells(cfg, prompt: int, chunks: list, reps: int) -> dict:
    """One layer's chunk attention at the mean context `prompt // 2`, per chunk: `block_attention` with the Pallas
    kernel and with cuDNN (`impl="cudnn"`), seconds per call and cuDNN's agreement with the kernel."""
    cells = {}
    for c in chunks:
        capacity = -(-prompt // c) * c
        keys = jax.random.split(jax.random.key(c), 5)
        shape = lambda t, h: (1, t, h, cfg.head_dim)  # noqa: E731
        q = jax.random.normal(keys[0], shape(c, cfg.num_heads), jnp.bfloat16)
        kc, vc = (jax.random.normal(k, shape(capacity, cfg.num_kv_heads), jnp.bfloat16) for k in keys[1:3])
        kb, vb = (jax.random.normal(k, shape(c, cfg.num_kv_heads), jnp.bfloat16) for k in keys[3:5])
        ctx = jnp.full((1,), prompt // 2, jnp.int32)
        fns = {impl: jax.jit(functools.partial(block_attention, scale=cfg.head_dim ** -0.5, causal=True, impl=impl))
               for impl in ("pallas", "cudnn")}
        outs = {impl: fn(q, kc, vc, ctx, kb, vb).astype(jnp.float32) for impl, fn in fns.items()}
        cell = {"context": prompt // 2, "capacity": capacity, "cudnn_rel_err": float(
            jnp.linalg.norm(outs["cudnn"] - outs["pallas"]) / jnp.linalg.norm(outs["pallas"]))}
        for impl, fn in fns.items():
            cell[f"{impl}_s"], _ = common.timed(fn, q, kc, vc, ctx, kb, vb, reps=reps, warmup=2)
        print(f"chunk {c} attention at context {prompt // 2}: {cell}")
        cells[str(c)] = cell
    return cells


def self_attention_cell(cfg, n: int, reps: int) -> dict:
    """One layer's causal attention over `n` tokens (batch 1, the target's heads, bf16): cuDNN against JAX's Mosaic
    GPU flash attention at each of `MOSAIC_BLOCKS` (module docstring); a setting that fails records its error."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    keys = jax.random.split(jax.random.key(n), 3)
    q = jax.random.normal(keys[0], (1, n, cfg.num_heads, cfg.head_dim), jnp.bfloat16)
    k, v = (jax.random.normal(key, (1, n, cfg.num_kv_heads, cfg.head_dim), jnp.bfloat16) for key in keys[1:])
    flops = 2 * n * n * cfg.num_heads * cfg.head_dim  # QK^T and PV over the lower triangle
    fns = {"cudnn": jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn"))}

    def mosaic(q, k, v, config):
        # no softmax scale of its own: q comes in scaled, as cuDNN's default scales it; its shared-memory buffers are
        # float16, so it takes float16 (the same FLOPs)
        half = (q * cfg.head_dim ** -0.5).astype(jnp.float16), k.astype(jnp.float16), v.astype(jnp.float16)
        return attention_mgpu.attention(*half, config)

    for bq, bkv, steps in MOSAIC_BLOCKS:
        config = attention_mgpu.TuningConfig(block_q=bq, block_kv=bkv, max_concurrent_steps=steps, causal=True)
        fns[f"mosaic_{bq}_{bkv}_{steps}"] = jax.jit(functools.partial(mosaic, config=config))
    cell, ref = {"tokens": n, "flops": flops}, None
    for name, fn in fns.items():
        try:
            out = fn(q, k, v).astype(jnp.float32)
            seconds, _ = common.timed(fn, q, k, v, reps=reps, warmup=2)
        except Exception as e:  # a setting the GPU or this CUDA refuses is recorded, not fatal
            cell[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            continue
        ref = out if ref is None else ref
        cell[name] = {"s": seconds, "tflops": flops / seconds / 1e12,
                      "rel_err_vs_cudnn": float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))}
        print(f"self-attention over {n} tokens, {name}: {cell[name]}")
    return cell


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny random model on the CPU: tests the script")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 32000; tiny 256)")
    ap.add_argument("--chunks", type=int, nargs="+", default=None,
                    help=f"prefill chunks to time (default: the policy's, {policy.PREFILL_CHUNK})")
    ap.add_argument("--attention", nargs="+", default=["pallas", "cudnn"], choices=["pallas", "cudnn"],
                    help="the prefill chunks' attention impls to time (GPU; the default is cudnn)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--self-attention", type=int, default=16384,
                    help="tokens of the causal self-attention timed by cuDNN and Mosaic GPU (GPU; 0: skip)")
    ap.add_argument("--gemm", type=int, default=None, help="side of the peak product (default 8192; tiny 256)")
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = ap.parse_args(argv)
    prompt = args.prompt or (256 if args.tiny else 32000)
    n = args.gemm or (256 if args.tiny else 8192)
    if prompt < 1 or n < 1 or args.reps < 1:
        ap.error("--prompt, --gemm and --reps must be positive")
    chunks = args.chunks or [policy.PREFILL_CHUNK]
    for c in chunks:
        try:
            policy.prefill_chunk(c)
        except ValueError as e:
            ap.error(str(e))
    target = acc.models(args.tiny)[0]
    prompts = acc.make_prompts(1, prompt, target.config.vocab_size, 0)
    weight_flops, attention_flops = prefill_flops(target, prompt)
    flops = weight_flops + attention_flops
    gemm = gemm_flops_per_s(n, 10)
    by_chunk = {}
    counter = acc.CompileCounter()
    for attention, c in itertools.product(args.attention, chunks):
        times, compiles = time_prefill(target, prompts, c, attention, args.reps, counter)
        seconds = float(np.median(times))
        cell = by_chunk[f"{attention}_{c}"] = {
            "attention": attention, "chunk": c, "prefill_s": seconds, "prefill_runs_s": times,
            "compiles_after_warmup": compiles,
            "tflops": flops / seconds / 1e12, "share_of_stated_peak": weight_flops / seconds / STATED_PEAK_FLOPS,
            "share_of_stated_peak_with_attention": flops / seconds / STATED_PEAK_FLOPS,
            "share_of_gemm": flops / seconds / gemm}
        print(f"{attention} attention, chunk {c}: prefill of {prompt} tokens {seconds:.3f} s, {cell['tflops']:.1f} "
              f"TFLOP/s with attention; weights only {cell['share_of_stated_peak']:.2f} of "
              f"{STATED_PEAK_FLOPS / 1e12:.0f} TFLOP/s; {cell['share_of_gemm']:.2f} of a {n}^3 product's "
              f"{gemm / 1e12:.1f} TFLOP/s")
    attention = attention_cells(target.config, prompt, chunks, args.reps + 2) if jax.default_backend() == "gpu" \
        else "skipped: cuDNN attention needs a GPU"
    if jax.default_backend() != "gpu" or args.self_attention <= 0:
        self_attention = "skipped: needs a GPU and --self-attention > 0"
    else:
        self_attention = self_attention_cell(target.config, args.self_attention, args.reps + 2)
    default_attention = policy.prefill_attention("pallas", -(-prompt // policy.PREFILL_CHUNK))
    default = by_chunk.get(f"{default_attention}_{policy.PREFILL_CHUNK}")
    payload = common.environment(**vars(args)) | {
        "model": "tiny, random float32" if args.tiny else "Qwen3-8B shape, random bf16", "prompt": prompt,
        "weight_flops": weight_flops, "flops": flops, "stated_peak_flops": STATED_PEAK_FLOPS, "gemm_side": n,
        "gemm_flops_per_s": gemm, "target_share": TARGET_SHARE, "default_chunk": policy.PREFILL_CHUNK,
        "default_attention": default_attention,
        "no_recompile": all(c["compiles_after_warmup"]["count"] == 0 for c in by_chunk.values()),
        "by_chunk": by_chunk, "attention": attention, "self_attention": self_attention} | {
            k: v for k, v in (default or {}).items() if k not in ("attention", "chunk")}
    common.write_json(f"prefill{'_tiny' if args.tiny else ''}.json", payload, args.out)
    return payload


if __name__ == "__main__":
    main()
