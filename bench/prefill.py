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
"""
from __future__ import annotations

import argparse
import functools

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


def time_prefill(target, prompts, chunk: int, reps: int) -> list:
    """Seconds of `reps` prefills at `chunk` positions per `extend`, after one warm-up at the same shapes."""
    return [dflash_jax.generate(target, None, prompts, max_new_tokens=1, prefill_chunk=chunk).stats.prefill_time_s
            for _ in range(reps + 1)][1:]


def cudnn_split_attention(q, k_ctx, v_ctx, ctx_len, k_blk, v_blk, scale: float, log2_stats: bool):
    """`block_attention` (causal) as two cuDNN calls merged by their softmax statistics: the block over the live
    context (padding mask at `ctx_len`, which must be >= 1) and the block over itself (causal). `log2_stats` reads
    cuDNN's statistics as base-2 logarithms instead of natural ones (the run reports which one agrees)."""
    attend = functools.partial(jax.nn.dot_product_attention, scale=scale, implementation="cudnn",
                               return_residual=True)
    o_ctx, l_ctx = attend(q, k_ctx, v_ctx, key_value_seq_lengths=ctx_len)
    o_blk, l_blk = attend(q, k_blk, v_blk, is_causal=True)
    l_ctx, l_blk = (x.astype(jnp.float32)[..., None] for x in (l_ctx, l_blk))
    base = 2.0 if log2_stats else jnp.e
    m = jnp.maximum(l_ctx, l_blk)
    w_ctx, w_blk = base ** (l_ctx - m), base ** (l_blk - m)
    out = (o_ctx.astype(jnp.float32) * w_ctx + o_blk.astype(jnp.float32) * w_blk) / (w_ctx + w_blk)
    return out.astype(q.dtype)


def attention_cells(cfg, prompt: int, chunks: list, reps: int) -> dict:
    """One layer's chunk attention at the mean context `prompt // 2`, per chunk: the library's kernel
    (`block_attention`, impl="pallas") against `cudnn_split_attention`, seconds and agreement, and the seconds the
    prefill's attention would take at that rate (`prompt / chunk` chunks x layers)."""
    cells = {}
    for c in chunks:
        capacity = -(-prompt // c) * c
        keys = jax.random.split(jax.random.key(c), 5)
        shape = lambda t, h: (1, t, h, cfg.head_dim)  # noqa: E731
        q = jax.random.normal(keys[0], shape(c, cfg.num_heads), jnp.bfloat16)
        kc, vc = (jax.random.normal(k, shape(capacity, cfg.num_kv_heads), jnp.bfloat16) for k in keys[1:3])
        kb, vb = (jax.random.normal(k, shape(c, cfg.num_kv_heads), jnp.bfloat16) for k in keys[3:5])
        ctx = jnp.full((1,), prompt // 2, jnp.int32)
        scale = cfg.head_dim ** -0.5
        ours = jax.jit(functools.partial(block_attention, scale=scale, causal=True, impl="pallas"))
        ref = ours(q, kc, vc, ctx, kb, vb).astype(jnp.float32)
        cell = {"context": prompt // 2, "capacity": capacity}
        cell["pallas_s"], _ = common.timed(ours, q, kc, vc, ctx, kb, vb, reps=reps, warmup=2)
        for log2 in (False, True):
            name = "cudnn_split_log2" if log2 else "cudnn_split"
            try:
                fn = jax.jit(functools.partial(cudnn_split_attention, scale=scale, log2_stats=log2))
                out = fn(q, kc, vc, ctx, kb, vb).astype(jnp.float32)
                cell[f"{name}_rel_err"] = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
                cell[f"{name}_s"], _ = common.timed(fn, q, kc, vc, ctx, kb, vb, reps=reps, warmup=2)
            except Exception as e:  # noqa: BLE001 - an unsupported shape is a result here
                cell[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        chunks_layers = prompt / c * cfg.num_layers
        cell |= {f"prefill_{k[:-2]}_s": v * chunks_layers for k, v in list(cell.items()) if k.endswith("_s")}
        print(f"chunk {c} attention at context {prompt // 2}: {cell}")
        cells[str(c)] = cell
    return cells


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny random model on the CPU: tests the script")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 32000; tiny 256)")
    ap.add_argument("--chunks", type=int, nargs="+", default=None,
                    help=f"prefill chunks to time (default: the policy's, {policy.PREFILL_CHUNK})")
    ap.add_argument("--reps", type=int, default=3)
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
    for c in chunks:
        times = time_prefill(target, prompts, c, args.reps)
        seconds = float(np.median(times))
        by_chunk[str(c)] = {"prefill_s": seconds, "prefill_runs_s": times, "tflops": flops / seconds / 1e12,
                            "share_of_stated_peak": weight_flops / seconds / STATED_PEAK_FLOPS,
                            "share_of_stated_peak_with_attention": flops / seconds / STATED_PEAK_FLOPS,
                            "share_of_gemm": flops / seconds / gemm}
        print(f"chunk {c}: prefill of {prompt} tokens {seconds:.3f} s, {flops / seconds / 1e12:.1f} TFLOP/s with "
              f"attention; weights only {weight_flops / seconds / STATED_PEAK_FLOPS:.2f} of "
              f"{STATED_PEAK_FLOPS / 1e12:.0f} TFLOP/s; {flops / seconds / gemm:.2f} of a {n}^3 product's "
              f"{gemm / 1e12:.1f} TFLOP/s")
    attention = attention_cells(target.config, prompt, chunks, args.reps + 2) if jax.default_backend() == "gpu" \
        else "skipped: cuDNN attention needs a GPU"
    default = by_chunk.get(str(policy.PREFILL_CHUNK))
    payload = common.environment(**vars(args)) | {
        "model": "tiny, random float32" if args.tiny else "Qwen3-8B shape, random bf16", "prompt": prompt,
        "weight_flops": weight_flops, "flops": flops, "stated_peak_flops": STATED_PEAK_FLOPS, "gemm_side": n,
        "gemm_flops_per_s": gemm, "target_share": TARGET_SHARE, "default_chunk": policy.PREFILL_CHUNK,
        "by_chunk": by_chunk, "attention": attention} | (default or {})
    common.write_json(f"prefill{'_tiny' if args.tiny else ''}.json", payload, args.out)
    return payload


if __name__ == "__main__":
    main()
