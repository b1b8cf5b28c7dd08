"""Shared benchmark plumbing: model shapes, random weights on device, bandwidth, timing, JSON.

Benchmarks measure, they never assert: each writes JSON under `bench/results/` with the
device, JAX version, settings and ratios measured in the same run.
"""
from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dflash_jax import quant, sharding  # noqa: E402
from dflash_jax.config import DrafterConfig, RopeConfig, TargetConfig  # noqa: E402
from dflash_jax.drafters.base import Drafter  # noqa: E402
from dflash_jax.io import names  # noqa: E402
from dflash_jax.io.checkpoints import drafter_family, make_drafter, make_target, target_family  # noqa: E402
from dflash_jax.targets.base import Target  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
TINY_PROBE_GIB = 1 / 64  # bandwidth probe size under --tiny: it tests the script, and 0.25 GiB took ~45 s of CPU

QWEN3_8B = TargetConfig(arch="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope=RopeConfig(1e6),
                        max_position_embeddings=40960, dtype="bfloat16")
TINY = TargetConfig(arch="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                    num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope=RopeConfig(1e6), max_position_embeddings=40960,
                    dtype="float32")


def drafter_config(target: TargetConfig, block_size: int = 16, num_layers: int = 5, window=None) -> DrafterConfig:
    """The z-lab DFlash drafter shape for a target (Qwen3-8B: 5 layers, taps [1, 9, 17, 25, 33])."""
    n = target.num_layers
    taps = tuple(round(1 + i * (n - 4) / (num_layers - 1)) for i in range(num_layers)) if num_layers > 1 else (n // 2,)
    # an MoE target has no dense MLP width: give the drafter the dense Qwen3.5s' 3 x hidden
    ffn = target.intermediate_size or 3 * target.hidden_size
    return DrafterConfig(family="dflash", hidden_size=target.hidden_size, intermediate_size=ffn,
                         num_layers=num_layers, num_heads=target.num_heads, num_kv_heads=target.num_kv_heads,
                         head_dim=target.head_dim, rms_norm_eps=1e-6, rope=target.rope, block_size=block_size,
                         mask_token_id=target.vocab_size - 1, target_layer_ids=taps,
                         layer_window=(window,) * num_layers, causal=(window is not None,) * num_layers,
                         vocab_size=target.vocab_size)


def _random_tree(shapes, dtype, seed: int, place=None):
    """Random weights made on the device, one leaf at a time (no host copy of 16 GB), each handed to
    `place(path, leaf)` as it is made (`sharding.placer`: its shards of a mesh, so no device holds a whole 70B)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))

    def make(key, shape):
        if len(shape) == 1:
            return jnp.ones(shape, dtype)
        return (jax.random.normal(key, shape, jnp.float32) * (1.0 / np.sqrt(shape[0]))).astype(dtype)

    make = jax.jit(make, static_argnums=(1,))
    place = place or (lambda path, x: x)
    keys = jax.random.split(jax.random.key(seed), len(flat))
    return jax.tree.unflatten(treedef, [place(quant.path_keys(p), make(k, s)) for k, (p, s) in zip(keys, flat)])


RESIDUAL_SCALE = 0.1  # of the attention and MLP output projections in `random_target`
ROUTED_EXPERT_SCALE = 0.01  # of the routed experts' down projections (3-D `w_down`), beyond RESIDUAL_SCALE


def random_target(cfg: TargetConfig, dtype=jnp.bfloat16, seed: int = 0, mesh=None,
                  routed_expert_scale: float = ROUTED_EXPERT_SCALE) -> Target:
    """Random weights with a planted next-token map, so greedy argmax has a wide margin.

    Plain random weights make a chaotic model whose logits are nearly flat: a 16-row verify
    and a 1-row decode step, which round differently in bf16, then pick different argmaxes at
    most positions, and acceptance cannot be controlled from the plain continuation. Here the
    embedding rows are N(0, 1), the output projections of every layer are scaled by
    `RESIDUAL_SCALE` (the layers still run, and perturb, but the residual stays near the
    current token's embedding) and the LM head's column `j` is the embedding of token
    `perm[j]`, so the target predicts `perm^-1(current token)` with a margin of thousands of
    logits: a long non-repeating cycle. The routed experts of a mixture-of-experts layer are
    damped further (`routed_expert_scale`): a one-token step and a 16-token verify round
    differently, and at a random router's near-ties a token then picks another expert. Undamped,
    a bf16 Qwen3.5-35B-A3B shape's verify and steps parted by a mean of 80% after 40 layers
    (bench/results/step_verify.json; in float32 they agree to 1e-6); on a smaller shape on the
    CPU the damping took the logits' difference from 17% to 2.8% (step_verify_cpu.json). Speed
    does not depend on the values; every matrix keeps its shape and remains dense random bf16.
    With a `mesh` every leaf is placed by the family's sharding rules as it is made.
    """
    rules = target_family(cfg).sharding_rules()
    place = None if mesh is None else sharding.placer(rules, mesh)
    params = _random_tree(target_family(cfg).param_shapes(cfg), dtype, seed, place)
    k_embed, k_perm = jax.random.split(jax.random.key(seed + 7919))
    embed = jax.jit(lambda k: jax.random.normal(k, (cfg.vocab_size, cfg.hidden_size), jnp.float32).astype(dtype))(
        k_embed)
    params["embed"] = embed
    for layer in (params[f"layers_{i}"] for i in range(cfg.num_layers)):
        for name in ("wo", "out_proj", "w_down", "shared_down"):  # every output projection, of any family
            if name in layer:
                routed = name == "w_down" and layer[name].ndim == 3
                scale = RESIDUAL_SCALE * (routed_expert_scale if routed else 1.0)
                layer[name] = layer[name] * jnp.asarray(scale, dtype)
    if not cfg.tie_word_embeddings:
        params["lm_head"] = jax.jit(lambda e, k: jnp.take(e, jax.random.permutation(k, e.shape[0]), axis=0).T)(
            embed, k_perm)
    return make_target(cfg, params if mesh is None else sharding.shard_params(rules, params, mesh))


def random_drafter(cfg: DrafterConfig, dtype=jnp.bfloat16, seed: int = 1, mesh=None,
                   replicated: bool = False) -> Drafter:
    """Random weights, placed on `mesh` as they are made (sharded by the family's rules, or whole on every device)."""
    rules = drafter_family(cfg).sharding_rules(replicated)
    return make_drafter(cfg, _random_tree(drafter_family(cfg).param_shapes(cfg), dtype, seed,
                                          None if mesh is None else sharding.placer(rules, mesh)))


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def target_step_bytes(target: Target) -> int:
    """Weights a decode step must read: all of them (the embedding is gathered, not read,
    unless it is tied to the LM head)."""
    skip = 0 if target.config.tie_word_embeddings else target.params["embed"].size * target.params["embed"].dtype.itemsize
    return nbytes(target.params) - skip


def kv_bytes(cfg, live_tokens: float, batch: int = 1, itemsize: int = 2) -> float:
    """K and V bytes of `live_tokens` context tokens over every layer."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize * live_tokens * batch


def _bytes_per_s(fn, x, moved: int, reps: int, samples: int = 5) -> float:
    """`moved` bytes over the device time of one jitted `fn(x)` call: the median over `samples`
    of `reps` calls back to back blocked once at the end (the host round trip of a lone call
    would count as device time otherwise)."""
    jax.block_until_ready(fn(x))
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = fn(x)  # one stream runs them in order: the last one done means all are
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / reps)
    return moved / statistics.median(times)


def hbm_bandwidth(gib: float = 4.0, reps: int = 20) -> float:
    """Device-to-device streaming bandwidth in bytes/s: read + write of a large buffer."""
    n = int(gib * (1 << 30) // 4)
    return _bytes_per_s(jax.jit(lambda a: a * 1.0001 + 1.0), jnp.ones((n,), jnp.float32), 2 * n * 4, reps)


def hbm_read_bandwidth(gib: float = 4.0, reps: int = 20) -> float:
    """Weight-streaming bandwidth in bytes/s: a GEMV `x [1, 4096] @ W [4096, N]` over a large bf16 W.

    This is how a decode step reads its weights (an 8B LM head is `[4096, 151936]`), and it
    streams faster than the copy of `hbm_bandwidth` moves on an H200 (4.43 against 4.24 TB/s
    in `bench/results/plain_decode.json`), so a roofline over it is the stricter one.
    """
    k = 4096
    n = max(128, int(gib * (1 << 30) // (2 * k)) // 128 * 128)
    x = jax.random.normal(jax.random.key(0), (1, k), jnp.bfloat16)  # not a constant XLA could fold
    w = jnp.ones((k, n), jnp.bfloat16)
    return _bytes_per_s(jax.jit(lambda xw: xw[0] @ xw[1]), (x, w), k * n * 2, reps)


POOL_BYTES = 8 << 30  # the most weight copies `per_call_us` makes


def per_call_us(fn, x, consts, iters: int = 10, calls: int = 32) -> float:
    """Device time of one `fn(x, *consts)` in microseconds, as a decode step pays it.

    One jitted program makes `calls` calls in a row (unrolled: timed in a device loop, a 50 MB bf16 product took
    3x its read time, a fixed cost per iteration), each on its own copy of `consts` and its own buffer of `x`.
    Shared copies let XLA merge the dots that share a weight into one product (its dot merger): on the H200, 32
    calls cycling over two copies of an LM head timed at 7 us a call, against 280 us to read it once. Own copies
    also keep each call's weights out of the L2 cache, so it reads them from HBM as a step reads each layer's.
    The program at `calls` and at `2 * calls` is timed (median of `iters`) and the difference divided by
    `calls`, which cancels the launch (where noise leaves no difference, the longer program's time per call, an
    upper bound). `calls` shrinks so that the copies stay within `POOL_BYTES`."""
    size = sum(int(np.prod(c.shape)) * c.dtype.itemsize for c in jax.tree_util.tree_leaves(consts))
    calls = max(2, min(calls, POOL_BYTES // (2 * max(size, 1))))
    pool = [consts] + [jax.tree_util.tree_map(jnp.copy, consts) for _ in range(2 * calls - 1)]
    xs = [jnp.copy(x) for _ in range(2 * calls)]

    def program(n):
        return jax.jit(lambda a, p: [fn(a[i], *p[i]) for i in range(n)])

    once, twice = (timed(program(n), xs[:n], pool[:n], reps=iters)[0] for n in (calls, 2 * calls))
    return 1e6 * (twice - once) / calls if twice > once else 1e6 * twice / (2 * calls)  # noise: the upper bound


def timed(fn, *args, reps: int = 5, warmup: int = 1):
    """Median wall seconds of `fn(*args)` (its outputs blocked on) and the last output."""
    out = None
    for _ in range(warmup):
        out = jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None (with a line saying so) where matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return None
    return plt


def phase_bars(ax, i: int, phases: dict, plain_step_s: float) -> None:
    """At x = i on a matplotlib axis: one round's draft, verify and commit + ingest stacked (ms), beside the plain
    step; legend labels on the first bar only."""
    bottom = 0.0
    for key, color in (("draft_s", "tab:blue"), ("verify_s", "tab:orange"), ("commit_ingest_s", "tab:green")):
        ax.bar(i - 0.2, phases[key] * 1e3, 0.4, bottom=bottom, color=color, label=key[:-2] if i == 0 else None)
        bottom += phases[key] * 1e3
    ax.bar(i + 0.2, plain_step_s * 1e3, 0.4, color="gray", label="plain step" if i == 0 else None)


def environment(**settings) -> dict:
    dev = jax.devices()[0]
    return {"device": getattr(dev, "device_kind", str(dev)), "platform": dev.platform, "jax_version": jax.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "settings": settings}


def exit_status(failed: list, tolerance) -> int:
    """1 after naming the cells where the Pallas kernel disagreed with its reference (`failed`), else 0."""
    if failed:
        print(f"FAIL: pallas disagrees with xla beyond {tolerance} (relative) at: {failed}", file=sys.stderr)
        return 1
    return 0


def write_json(name: str, payload: dict, out_dir: str | None = None) -> str:
    out_dir = out_dir or RESULTS
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=float)
    print(f"wrote {path}")
    return path


def torch_peer_from_target(target: Target):
    """The same weights as a `transformers` Qwen3ForCausalLM on the GPU, or None when torch,
    transformers or CUDA are missing. Weights travel through DLPack and are split and
    transposed into the Hugging Face `[out, in]` layout on the GPU."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    from dflash_jax.config import target_to_hf_config

    cfg = target.config
    hf = {k: v for k, v in target_to_hf_config(cfg).items() if k not in ("architectures", "model_type", "torch_dtype")}
    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**hf))

    state = {}
    for p in target_family(cfg).name_map(cfg):  # the library's own name map, split on the GPU
        x = torch.from_dlpack(names.leaf(target.params, p.path))
        for name, part in zip(p.hf, torch.split(x, list(p.widths or (x.shape[-1],)), dim=-1)):
            state[name] = (part.T if p.transpose else part).contiguous()
    model.load_state_dict(state, assign=True, strict=True)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config, device="cuda")
    return model.eval()


def _torch_compiles() -> int | None:
    """Frames torch's compiler has compiled so far in this process (None where the counter is missing)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return None
    return sum(counters["frames"].values()) if "frames" in counters else 0


def hf_generate_tokens_per_s(model, prompt_len: int, new_tokens: int, static_cache: bool = False,
                             warmups: int = 2, reps: int = 2) -> dict:
    """`transformers` greedy generate on the same weights: tokens/s (median of `reps`).

    The warm-up runs exactly the timed call (same prompt, same number of new tokens, same cache) `warmups`
    times: a static cache is sized by the call, so a shorter warm-up left `generate` to re-make the cache and
    recompile inside the timed runs. `compiles_in_timed_runs` (torch's compiled-frame counter) shows it did not."""
    import torch

    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    ids = torch.randint(0, model.config.vocab_size - 2, (1, prompt_len), device=model.device)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    if static_cache:
        model.generation_config.cache_implementation = "static"
    try:
        for _ in range(warmups):
            model.generate(ids, **kw)
        sync()
        before, times = _torch_compiles(), []
        for _ in range(reps):
            t0 = time.perf_counter()
            model.generate(ids, **kw)
            sync()
            times.append(time.perf_counter() - t0)
        after = _torch_compiles()
    finally:
        model.generation_config.cache_implementation = None
    return {"tokens_per_s": new_tokens / statistics.median(times), "new_tokens": new_tokens, "prompt": prompt_len,
            "warmups": warmups, "reps": reps, "cache_implementation": "static" if static_cache else "dynamic",
            "attn_implementation": model.config._attn_implementation,
            "compiles_in_timed_runs": None if before is None or after is None else after - before}
