"""Long generations on the GPU: tokens/s over a 32,768-token run, so a slowdown with context shows.

Qwen3-8B shape (random bf16 weights with the planted next-token map of `common.random_target`),
batch 1, a short prompt, then `--new` tokens decoded in segments of `--segment` tokens. Plain
decoding runs the library's plain loop segment by segment (`PlainLoop.run` with the row's limit
raised each time: the same compiled program for every segment); speculative decoding runs a
`Session` with proposals injected at acceptance `--tau` (copied from the plain run) and one
`burst` per segment. Each segment is timed blocked; its tokens/s and the context it ended at are
recorded. Speculative output must equal plain output.

    python bench/long_context.py                 # H200, 32,768 tokens
    python bench/long_context.py --tiny          # CPU smoke test
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import acceptance as acc
import common
import dflash_jax
from dflash_jax import sampling as smp
from dflash_jax.config import policy
from dflash_jax.decoding import plain
from dflash_jax.decoding.common import pack_prompts, stop_array


def plain_segments(target, prompt: np.ndarray, new: int, segment: int, segments: int | None = None) -> tuple:
    """Plain greedy decoding, `segment` tokens at a time (the first `segments` of them when given);
    the tokens and one record per segment."""
    p = pack_prompts(prompt, target.config.vocab_size)
    loop = plain.PlainLoop(new, p.chunk, True, False, policy.attention_impl(None))
    stops = stop_array((), target.config.vocab_size)
    s = plain.start(loop, target, jnp.asarray(p.tokens), jnp.asarray(p.lengths),
                    target.init_state(p.batch, p.lengths.max() + new + 1), smp.row_params(smp.Sampling(), 1), stops)
    s = jax.block_until_ready(s)
    records, n_out = [], 1
    while n_out < new and len(records) != segments:
        limit = min(new, n_out + segment)
        s = s.replace(limit=jnp.full_like(s.limit, limit), done=jnp.zeros_like(s.done))
        t0 = time.perf_counter()
        s = jax.block_until_ready(plain.run(loop, target, s, stops))
        dt = time.perf_counter() - t0
        got = int(s.n_out[0])
        records.append({"context": int(p.lengths[0]) + got, "tokens": got - n_out, "time_s": dt,
                        "tokens_per_s": (got - n_out) / dt})
        n_out = got
    return np.asarray(s.out[0, :new]), records


def spec_segments(target, drafter, prompt: np.ndarray, new: int, segment: int, inject,
                  segments: int | None = None) -> tuple:
    """Speculative greedy decoding with injected proposals, one burst per segment."""
    session = dflash_jax.Session(target, drafter, prompt, max_new_tokens=new, inject=inject)
    tokens, records = [], []
    while len(tokens) < new and len(records) != segments:
        b = session.burst(segment)
        if not b.tokens[0]:
            break
        tokens += b.tokens[0]
        records.append({"context": int(prompt.shape[1]) + len(tokens), "tokens": len(b.tokens[0]),
                        "time_s": b.wall_time_s, "tokens_per_s": len(b.tokens[0]) / b.wall_time_s,
                        "rounds": b.rounds, "acceptance_length": len(b.tokens[0]) / max(b.rounds, 1)})
    return np.asarray(tokens), records


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=32768)
    ap.add_argument("--segment", type=int, default=2048)
    ap.add_argument("--tau", type=float, default=6.5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.tiny:
        args.prompt, args.new, args.segment = 16, 512, 128
    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    target = common.random_target(common.TINY if args.tiny else common.QWEN3_8B, dtype)
    drafter = common.random_drafter(common.drafter_config(target.config, 16, 2 if args.tiny else 5), dtype)
    prompt = acc.make_prompts(1, args.prompt, target.config.vocab_size, 0)
    payload = common.environment(**vars(args)) | {"attention": policy.attention_impl(None)}

    plain_segments(target, prompt, args.new, args.segment, 2)  # compiles: the same programs as the timed run
    ref, plain_rec = plain_segments(target, prompt, args.new, args.segment)
    inject = acc.injected(ref[None], acc.first_wrong_probs(args.tau, drafter.n_drafts), args.new, drafter.n_drafts)
    spec_segments(target, drafter, prompt, args.new, args.segment, inject, 2)
    got, spec_rec = spec_segments(target, drafter, prompt, args.new, args.segment, inject)
    identical = got.tolist() == ref.tolist()

    def total(records):
        n, t = sum(r["tokens"] for r in records), sum(r["time_s"] for r in records)
        return {"tokens": n, "time_s": t, "tokens_per_s": n / t}

    payload |= {"identical": identical, "plain": {"segments": plain_rec, "run": total(plain_rec)},
                "speculative": {"segments": spec_rec, "run": total(spec_rec)},
                "speedup": total(spec_rec)["tokens_per_s"] / total(plain_rec)["tokens_per_s"],
                "slowdown_last_over_first": {
                    "plain": plain_rec[0]["tokens_per_s"] / plain_rec[-1]["tokens_per_s"],
                    "speculative": spec_rec[0]["tokens_per_s"] / spec_rec[-1]["tokens_per_s"]}}
    path = common.write_json(f"long_context{'_tiny' if args.tiny else ''}.json", payload, args.out)
    for name in ("plain", "speculative"):
        rec = payload[name]["segments"]
        print(f"{name}: {payload[name]['run']['tokens_per_s']:.1f} tok/s over the run; first segment "
              f"{rec[0]['tokens_per_s']:.1f}, last {rec[-1]['tokens_per_s']:.1f} (context {rec[-1]['context']})")
    print(f"speedup {payload['speedup']:.2f}x, identical {identical}; wrote {path}")
    return payload


if __name__ == "__main__":
    main()
