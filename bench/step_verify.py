"""Does a target's verify compute what its one-token steps compute, on this device? Layer by layer.

    python bench/step_verify.py [--models M ...] [--prompt P] [--width W] [--layers N] [--dtype D]
                                [--variants impl/experts ...] [--set FIELD=INT ...] [--dense-mlp WIDTH]
                                [--routed-expert-scale S] [--out DIR]            # step_verify.json
    python bench/step_verify.py --tiny                                      # CPU smoke test

A model of `bench/hybrid.py` (random bf16 weights with `common.random_target`'s planted next-token map) prefills
a random prompt of P tokens; the next W tokens are then run three ways:
  verify   one `extend` of all W tokens over the prefilled state (what a speculative round runs);
  steps    W `extend`s of one token, each committed (what plain decoding runs);
  forward  the uncached causal forward over the P + W tokens (chunk-free attention, the chunked delta rule,
           the library's MoE impl for P + W tokens: `ragged_dot` on a GPU): an oracle of its own, run once.
Per variant (the attention / delta-rule `impl`, and the MoE block's routed-expert impl: `"auto"` is
`moe.default_impl` by block width, else one of `moe.MOE_IMPLS` for every width) and per pair of paths: for each
decoder layer the largest difference of its outputs over their largest magnitude (`layer_rel`), the first layer
above `--tolerance` (`first_layer_off`), the logits' relative difference, whether their argmaxes agree at every
position, and whether every output is finite. A pair with a layer above the tolerance fails the run (exit 1).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

import common
import hybrid
from dflash_jax.targets import moe

VARIANTS = (("pallas", "auto"), ("xla", "auto"), ("pallas", "gather"))
TINY_VARIANTS = (("pallas", "auto"), ("xla", "gather"), ("pallas", "grouped"))
TOLERANCE = 5e-2
PAIRS = (("verify", "steps"), ("verify", "forward"), ("steps", "forward"))


def moe_impl(name: str):
    """A context in which every MoE block takes `name` (`"auto"`: the library's own choice by width)."""
    if name == "auto":
        return contextlib.nullcontext()
    return mock.patch.object(moe, "default_impl", lambda backend=None, tokens=1: name)


def _shaped(taps, logits, layers: int) -> tuple:
    w = logits.shape[1]
    return (np.asarray(taps.astype(jnp.float32)).reshape(w, layers, -1), np.asarray(logits, np.float32).reshape(w, -1))


def run_forward(target, prompt: np.ndarray, width: int) -> tuple:
    """The forward path's `(taps [W, L, H], logits [W, V])` at the last `width` positions (the library's impls)."""
    c = target.config
    p = prompt.shape[1] - width

    @jax.jit
    def forward(target, tokens):
        h, taps = target.forward(tokens, tuple(range(c.num_layers)))
        return taps[:, p:], target.logits(h[:, p:])

    return _shaped(*forward(target, jnp.asarray(prompt, jnp.int32)), c.num_layers)


def run_paths(target, prompt: np.ndarray, width: int, impl: str) -> dict:
    """`{path: (taps [W, L, H] float32, logits [W, V] float32)}` for the verify and the steps (module docstring)."""
    c = target.config
    taps_ids = tuple(range(c.num_layers))
    p = prompt.shape[1] - width
    tokens = jnp.asarray(prompt, jnp.int32)

    @jax.jit
    def prefill(target):
        state = target.init_state(1, prompt.shape[1] + 1)
        _, _, state, pending = target.extend(state, tokens[:, :p], jnp.zeros((1,), jnp.int32), impl=impl,
                                             valid=jnp.full((1,), p, jnp.int32))
        return target.commit(state, pending, jnp.full((1,), p, jnp.int32))

    @jax.jit
    def block(target, state, toks, start):
        h, taps, state, pending = target.extend(state, toks, start, taps_ids, impl=impl)
        return taps, target.logits(h), target.commit(state, pending, jnp.full((1,), toks.shape[1], jnp.int32))

    state = prefill(target)
    out = {"verify": _shaped(*block(target, state, tokens[:, p:], jnp.full((1,), p, jnp.int32))[:2], c.num_layers)}
    taps, logits = [], []
    for i in range(width):
        t, lg, state = block(target, state, tokens[:, p + i:p + i + 1], jnp.full((1,), p + i, jnp.int32))
        taps.append(t)
        logits.append(lg)
    out["steps"] = _shaped(jnp.concatenate(taps, 1), jnp.concatenate(logits, 1), c.num_layers)
    return out


def compare(a, b, tolerance: float) -> dict:
    """Per-layer and logit differences of two paths' `(taps, logits)`, each over the larger magnitude; per layer
    also the largest magnitude and the mean absolute difference over the mean magnitude (`layer_mean_rel`)."""
    (ta, la), (tb, lb) = a, b
    scale = np.maximum(np.abs(ta).max(axis=(0, 2)), np.abs(tb).max(axis=(0, 2)))
    diff = np.abs(ta - tb)
    layer_rel = (diff.max(axis=(0, 2)) / np.maximum(scale, 1e-30)).tolist()
    mean_rel = (diff.mean(axis=(0, 2)) / np.maximum(np.abs(ta).mean(axis=(0, 2)), 1e-30)).tolist()
    off = [i for i, r in enumerate(layer_rel) if not r <= tolerance]
    logit_rel = float(np.abs(la - lb).max() / max(np.abs(la).max(), np.abs(lb).max(), 1e-30))
    agree = (la.argmax(-1) == lb.argmax(-1)).tolist()
    return {"layer_rel": layer_rel, "layer_mean_rel": mean_rel, "layer_max_abs": scale.tolist(),
            "first_layer_off": off[0] if off else None, "logit_rel": logit_rel,
            "argmax_agree": agree, "finite": bool(np.isfinite(ta).all() and np.isfinite(tb).all()
                                                  and np.isfinite(la).all() and np.isfinite(lb).all()),
            "ok": not off and logit_rel <= tolerance}


def reshaped(cfg, args, ap):
    """`cfg` with `--layers`, `--set` and `--dense-mlp` applied."""
    fields = {}
    for item in args.set:
        key, _, value = item.partition("=")
        current = getattr(cfg, key, None) if key in {f.name for f in dataclasses.fields(cfg)} else None
        if type(current) is not int or not value.lstrip("-").isdigit():
            ap.error(f"--set {item!r}: expected FIELD=INT with FIELD an integer field of {type(cfg).__name__}")
        fields[key] = int(value)
    layers = args.layers or cfg.num_layers
    fields |= {"num_layers": layers, "layer_types": cfg.layer_types[:layers], "moe_layers": cfg.moe_layers[:layers]}
    if args.dense_mlp:
        fields |= {"moe_layers": (False,) * layers, "intermediate_size": args.dense_mlp}
    return dataclasses.replace(cfg, **fields)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["qwen3.5-35b-a3b"], help=f"of {list(hybrid.MODELS)}")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--tolerance", type=float, default=TOLERANCE)
    ap.add_argument("--layers", type=int, default=None, help="keep only the first N decoder layers (faster)")
    ap.add_argument("--set", nargs="+", default=[], metavar="FIELD=INT",
                    help="integer config fields to override, e.g. num_experts=16 hidden_size=1024 (a smaller shape)")
    ap.add_argument("--dense-mlp", type=int, default=None, metavar="WIDTH",
                    help="a dense SwiGLU MLP of this width in every layer instead of the MoE block")
    ap.add_argument("--routed-expert-scale", type=float, default=common.ROUTED_EXPERT_SCALE,
                    help="`common.random_target`'s damping of the routed experts (1 leaves them undamped)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None, help="weights (default: bf16, "
                    "float32 with --tiny)")
    ap.add_argument("--variants", nargs="+", default=None,
                    help="impl/experts pairs, e.g. xla/gather (impl of ('xla', 'pallas'), experts 'auto' or of "
                         f"{moe.MOE_IMPLS}); default {['/'.join(v) for v in VARIANTS]}")
    ap.add_argument("--tiny", action="store_true", help="the tiny float32 hybrid on the CPU: tests the script")
    ap.add_argument("--out", default=None, help="output folder (default bench/results)")
    args = ap.parse_args(argv)
    models = hybrid.TINY if args.tiny else {name: hybrid.MODELS[name] for name in args.models}
    variants = [tuple(v.split("/")) for v in args.variants] if args.variants else (
        TINY_VARIANTS if args.tiny else VARIANTS)
    for impl, experts in variants:
        if impl not in ("xla", "pallas") or experts not in ("auto",) + moe.MOE_IMPLS:
            ap.error(f"variant {impl}/{experts}: impl is one of ('xla', 'pallas'), experts 'auto' or one of "
                     f"{moe.MOE_IMPLS}")
    dtype = jnp.dtype(args.dtype or ("float32" if args.tiny else "bfloat16"))
    payload = common.environment(**vars(args)) | {"variants": [list(v) for v in variants],
                                                    "routed_expert_scale": args.routed_expert_scale, "models": {}}
    failed = []
    for name, cfg in models.items():
        cfg = reshaped(cfg, args, ap)
        target = common.random_target(cfg, dtype, routed_expert_scale=args.routed_expert_scale)
        prompt = np.random.RandomState(0).randint(0, cfg.vocab_size, (1, args.prompt + args.width))
        forward = run_forward(target, prompt, args.width)
        cells = {}
        for impl, experts in variants:
            with moe_impl(experts):
                paths = run_paths(target, prompt, args.width, impl) | {"forward": forward}
            cell = {f"{a}_vs_{b}": compare(paths[a], paths[b], args.tolerance) for a, b in PAIRS}
            cells[f"{impl}/{experts}"] = cell
            for pair, r in cell.items():
                print(f"{name} {impl}/{experts} {pair}: first layer off {r['first_layer_off']}, logits rel "
                      f"{r['logit_rel']:.2e}, argmax agree {sum(r['argmax_agree'])}/{args.width}, "
                      f"finite {r['finite']}, per layer: rel {np.round(r['layer_rel'], 4).tolist()}, mean rel "
                      f"{np.round(r['layer_mean_rel'], 4).tolist()}, "
                      f"max abs {np.round(r['layer_max_abs'], 2).tolist()}", flush=True)
                if not r["ok"]:
                    failed.append(f"{name} {impl}/{experts} {pair}")
            payload["models"][name] = {"layer_types": list(cfg.layer_types), "moe_layers": list(cfg.moe_layers),
                                       "cells": cells}
            common.write_json(f"step_verify{'_tiny' if args.tiny else ''}.json", payload, args.out)
        del target
    if failed:
        print(f"FAIL: paths disagree: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
