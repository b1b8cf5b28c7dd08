"""Hybrid targets on the GPU: a Qwen3.5-9B-shaped hybrid and a Qwen3.5-35B-A3B-shaped MoE hybrid, random
bf16 weights (with `common.random_target`'s planted next-token map), batch 1, prompt 512, a 5-layer DFlash
drafter at block 16.

Per model:
  plain       tokens/s of the plain loop, and `roofline_ratio`: the bytes a step must move over the measured
              HBM read bandwidth, divided by the measured step. Bytes: every weight a step reads (for an
              MoE, the router, shared expert and only the `num_experts_per_tok` routed experts each MoE
              layer uses for the token, not all of them), the K/V of the attention layers at the mean
              live context, and the recurrent and conv states read and written.
  round       `spec_round.measure_cell`: the fused loop at injected acceptance 6.5, and one round split into
              draft, verify and commit (+ the drafter's ingest); `round_over_plain_step`.
  rollback    the price of keeping any prefix: a verify whose `extend` returns every position's recurrent
              update and whose `commit` folds the state after the 6th (`per_position_s`), against the same
              verify keeping the whole block (`keep_all_s`: what a verify costs when nothing is rolled back)
              and the replay a checkpoint design pays instead (`replay_s`: a verify keeping the whole block,
              then the kept prefix run again from the pre-verify state).
Targets (issue 14): plain >= 0.75 of the roofline; round <= 1.35 plain steps. A model whose speculative
output differs from its plain output fails the run (exit status 1, after the JSON is written).

    python bench/hybrid.py                 # H200: writes bench/results/hybrid.json and hybrid.png
    python bench/hybrid.py --tiny          # CPU smoke test
"""
from __future__ import annotations

import argparse
import functools
import gc
import sys

import jax
import jax.numpy as jnp
import numpy as np

import acceptance as acc
import common
import spec_round
from dflash_jax.config import HybridConfig, RopeConfig

_PATTERN = ("linear_attention",) * 3 + ("full_attention",)
_LINEAR = dict(rotary_dim=64, linear_conv_kernel=4, linear_num_key_heads=16, linear_num_value_heads=32,
               linear_key_head_dim=128, linear_value_head_dim=128, rms_norm_eps=1e-6, rope=RopeConfig(1e7),
               max_position_embeddings=262144, vocab_size=248320, num_heads=16, head_dim=256, dtype="bfloat16")
MODELS = {
    "qwen3.5-9b": HybridConfig(arch="qwen3_5", hidden_size=4096, intermediate_size=12288, num_layers=32, num_kv_heads=4,
                               layer_types=_PATTERN * 8, moe_layers=(False,) * 32, **_LINEAR),
    "qwen3.5-35b-a3b": HybridConfig(arch="qwen3_5_moe", hidden_size=2048, intermediate_size=0, num_layers=40,
                                    num_kv_heads=2, layer_types=_PATTERN * 10, moe_layers=(True,) * 40,
                                    num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                                    shared_expert_intermediate_size=512, **_LINEAR),
}
TINY = {"tiny-hybrid": HybridConfig(
    arch="qwen3_next", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
    head_dim=16, rms_norm_eps=1e-6, rope=RopeConfig(1e6), max_position_embeddings=4096, dtype="float32",
    layer_types=_PATTERN, rotary_dim=4, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
    linear_value_head_dim=8, moe_layers=(True, False, True, True), num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=32)}
TARGETS = {"roofline_ratio": 0.75, "round_over_plain_step": 1.35}


def step_bytes(target, live_tokens: float, batch: int = 1) -> dict:
    """Bytes one plain decode step moves (module docstring), by kind."""
    c, p = target.config, target.params
    experts = 0
    for i, moe in enumerate(c.moe_layers):
        if moe:
            lp = p[f"layers_{i}"]
            per_expert = (lp["w_gate_up"].nbytes + lp["w_down"].nbytes) // c.num_experts
            experts += (lp["w_gate_up"].nbytes + lp["w_down"].nbytes) - min(batch * c.num_experts_per_tok,
                                                                            c.num_experts) * per_expert
    weights = common.target_step_bytes(target) - experts
    item = p["embed"].dtype.itemsize
    kv = 2 * len(c.attention_layers) * c.num_kv_heads * c.head_dim * item * live_tokens * batch
    ssm = len(c.linear_layers) * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    conv = len(c.linear_layers) * (c.linear_conv_kernel - 1) * c.conv_dim * item
    recurrent = 2 * (ssm + conv) * batch
    return {"weights": weights, "kv": kv, "recurrent": recurrent, "total": weights + kv + recurrent,
            "routed_experts_skipped": experts}


@functools.partial(jax.jit, static_argnames="mode")
def _verify(target, state, block, start, kept, mode: str):
    """A verify of `block` at `start` and its commit of `kept`, by `mode` (module docstring, "rollback")."""
    w = block.shape[1]
    if mode == "per_position":
        h, _, st, pending = target.extend(state, block, start)
        return jnp.argmax(target.logits(h), -1), target.commit(st, pending, kept)
    h, _, st, pending = target.extend(state, block, start, valid=jnp.full_like(kept, w))
    choice = jnp.argmax(target.logits(h), -1)
    if mode == "keep_all":
        return choice, target.commit(st, pending, jnp.full_like(kept, w))
    _, _, st, pending = target.extend(state, block, start, valid=kept)
    return choice, target.commit(st, pending, kept)


def measure_rollback(target, prompt: int, width: int, kept: int, reps: int) -> dict:
    """Median seconds of each rollback mode on a state `prompt` positions in, keeping `kept` of `width`."""
    state = target.init_state(1, prompt + 2 * width)
    state = state.replace(seq_len=jnp.full((1,), prompt, jnp.int32))
    block = jnp.asarray(np.random.RandomState(0).randint(0, target.config.vocab_size, (1, width)), jnp.int32)
    start, keep = jnp.full((1,), prompt, jnp.int32), jnp.full((1,), kept, jnp.int32)
    out = {"width": width, "kept": kept}
    for mode in ("per_position", "keep_all", "replay"):
        out[f"{mode}_s"], _ = common.timed(_verify, target, state, block, start, keep, mode, reps=reps, warmup=2)
    out["per_position_over_keep_all"] = out["per_position_s"] / out["keep_all_s"]
    out["replay_over_keep_all"] = out["replay_s"] / out["keep_all_s"]
    return out


def plot(payload: dict, path: str) -> None:
    """Round phases against the plain step, and the three rollback modes, per model."""
    plt = common.pyplot()
    if plt is None:
        return
    names = list(payload["models"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for i, name in enumerate(names):
        m = payload["models"][name]
        common.phase_bars(a, i, m["round"]["phases"], m["plain"]["step_s"])
        for j, mode in enumerate(("per_position", "keep_all", "replay")):
            b.bar(i + (j - 1) * 0.27, m["rollback"][f"{mode}_s"] * 1e3, 0.27, color=f"C{j}",
                  label=mode if i == 0 else None)
    for ax, title in ((a, "round phases vs plain step (ms)"), (b, "verify + commit, by rollback (ms)")):
        ax.set_xticks(range(len(names)), names)
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None):
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--models", nargs="+", default=list(MODELS), help=f"of {list(MODELS)}")
    ours, rest = pre.parse_known_args(argv)
    args = spec_round.parse_args(rest, __doc__, 6.5)
    models = TINY if args.tiny else {name: MODELS[name] for name in ours.models}
    counter = acc.CompileCounter()
    bandwidth = common.hbm_read_bandwidth(common.TINY_PROBE_GIB if args.tiny else 4.0)
    payload = common.environment(**vars(args), models=list(models)) | {"hbm_read_bytes_per_s": bandwidth,
                                                                         "targets": TARGETS, "models": {}}
    for name, cfg in models.items():
        dtype = jnp.float32 if args.tiny else jnp.bfloat16
        target = common.random_target(cfg, dtype)
        drafter = common.random_drafter(common.drafter_config(cfg, 16, 2 if args.tiny else 5), dtype)
        rec = spec_round.measure_cell(target, drafter, 1, args.prompts[0], args, counter)
        moved = step_bytes(target, args.prompts[0] + args.new / 2)
        plain = rec["plain"] | {"bytes": moved, "roofline_s": moved["total"] / bandwidth}
        plain["roofline_ratio"] = plain["roofline_s"] / plain["step_s"]
        rollback = measure_rollback(target, args.prompts[0], drafter.config.block_size, 6, args.phase_reps)
        at_tau = rec["fused"][0]
        payload["models"][name] = {
            "config": {k: v for k, v in vars(cfg).items() if k not in ("rope", "layer_types", "moe_layers")},
            "weight_bytes": common.nbytes(target.params), "plain": plain, "round": rec, "rollback": rollback,
            "headline": {"plain_tokens_per_s": plain["tokens_per_s"], "roofline_ratio": plain["roofline_ratio"],
                         "round_over_plain_step": rec["round_over_plain_step"],
                         "spec_tokens_per_s_at_tau": at_tau.get("tokens_per_s"), "tau": at_tau.get("tau_measured"),
                         "speedup_at_tau": at_tau.get("speedup"),
                         "lossless": rec["real_drafter"]["lossless"] and all(r["lossless"] for r in rec["fused"]),
                         "per_position_over_keep_all": rollback["per_position_over_keep_all"],
                         "replay_over_keep_all": rollback["replay_over_keep_all"]}}
        print(f"{name}: {payload['models'][name]['headline']}")
        del target, drafter, rec
        gc.collect()
    suffix = "_tiny" if args.tiny else ""
    path = common.write_json(f"hybrid{suffix}.json", payload, args.out)
    plot(payload, path[:-len(".json")] + ".png")
    failed = [name for name, m in payload["models"].items() if not m["headline"]["lossless"]]
    if failed:
        print(f"FAIL: speculative output differs from plain decoding on {failed}", file=sys.stderr)
        sys.exit(1)
    return payload


if __name__ == "__main__":
    main()
