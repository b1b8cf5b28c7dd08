"""Plain greedy decoding on a Qwen3-8B-shaped target with random bf16 weights (GPU).

Reports tokens/s, the memory roofline (weights + live KV bytes per step over the HBM
bandwidth measured in this run), their ratio, and `transformers` generate on the same
weights in the same process. `roofline_ratio` uses the copy bandwidth (read + write, as
GPU.md measures it); `roofline_ratio_read` the stricter rate at which a GEMV streams a weight.

    python bench/plain_decode.py                 # H200: batch 1, prompt 512, 256 new tokens
    python bench/plain_decode.py --tiny          # CPU smoke test of the script
"""
from __future__ import annotations

import argparse
import gc

import numpy as np

import common
import dflash_jax
from dflash_jax.config import policy


def measure(target, batch: int, prompt: int, new: int, impl: str, reps: int) -> dict:
    rng = np.random.RandomState(0)
    prompts = rng.randint(0, target.config.vocab_size - 2, (batch, prompt))

    def run(n):
        return dflash_jax.generate(target, None, prompts, max_new_tokens=n, impl=impl)

    t_full, out = common.timed(lambda: run(new), reps=reps)
    t_one, _ = common.timed(lambda: run(1), reps=reps)
    assert all(len(t) == new for t in out.tokens)
    decode_s = (t_full - t_one) / (new - 1)
    return {"batch": batch, "prompt": prompt, "new_tokens": new, "impl": impl, "end_to_end_s": t_full,
            "prefill_and_first_token_s": t_one, "decode_step_s": decode_s, "tokens_per_s": batch / decode_s}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny random model (CPU smoke test)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--impl", default=None, choices=["xla", "pallas"], help="default: pallas on GPU")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--peer-tokens", type=int, default=64, help="new tokens for the transformers peer (0: skip)")
    ap.add_argument("--peer-static", action="store_true",
                    help="also time the static-cache peer (compiles a while; warmed up with the timed shapes)")
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = ap.parse_args(argv)

    args.impl = policy.attention_impl(args.impl)
    cfg = common.TINY if args.tiny else common.QWEN3_8B
    target = common.random_target(cfg)
    bw = common.hbm_bandwidth(common.TINY_PROBE_GIB if args.tiny else 4.0)
    bw_read = common.hbm_read_bandwidth(common.TINY_PROBE_GIB if args.tiny else 4.0)
    res = measure(target, args.batch, args.prompt, args.new, args.impl, args.reps)
    step_bytes = common.target_step_bytes(target) + common.kv_bytes(cfg, args.prompt + args.new / 2, args.batch)
    roofline = bw / step_bytes * args.batch
    payload = common.environment(model="Qwen3-8B shape, random bf16" if not args.tiny else "tiny", **vars(args))
    payload.update(hbm_bandwidth_Bps=bw, weight_bytes=common.target_step_bytes(target), step_bytes=step_bytes,
                   roofline_tokens_per_s=roofline, ours=res, roofline_ratio=res["tokens_per_s"] / roofline,
                   hbm_read_bandwidth_Bps=bw_read,
                   roofline_ratio_read=res["tokens_per_s"] / (bw_read / step_bytes * args.batch))
    print(f"ours: {res['tokens_per_s']:.1f} tok/s  roofline {roofline:.1f} tok/s  ratio {payload['roofline_ratio']:.3f} "
          f"(GEMV read bandwidth {bw_read / 1e12:.2f} TB/s: ratio {payload['roofline_ratio_read']:.3f})")
    if args.peer_tokens and not args.tiny:
        model = common.torch_peer_from_target(target)
        if model is not None:
            peers = [common.hf_generate_tokens_per_s(model, args.prompt, args.peer_tokens)]
            if args.peer_static:
                peers.append(common.hf_generate_tokens_per_s(model, args.prompt, args.peer_tokens, static_cache=True))
            payload["peers"] = peers
            best = max(p["tokens_per_s"] for p in peers)
            payload["speedup_over_best_peer"] = res["tokens_per_s"] / best
            static = [p for p in peers if p["cache_implementation"] == "static"]
            if static:
                payload["speedup_over_static_peer"] = res["tokens_per_s"] / static[0]["tokens_per_s"]
            for p in peers:
                print(f"transformers ({p['cache_implementation']} cache): {p['tokens_per_s']:.1f} tok/s, "
                      f"{p['compiles_in_timed_runs']} compiles in its timed runs")
            del model
            gc.collect()
    common.write_json(f"plain_decode{'_tiny' if args.tiny else ''}.json", payload, args.out)
    return payload


if __name__ == "__main__":
    main()
