"""Sparse mixture-of-experts block of the hybrid Qwen3.5-MoE / Qwen3-Next targets.

Semantics of transformers' `Qwen3NextSparseMoeBlock`: router logits `x @ router` in x's dtype,
softmax in float32, top-k, optionally renormalised to sum 1, weights cast to x's dtype. Each chosen
expert e is a SwiGLU MLP (`w_gate_up[e] [H, 2I]`, `w_down[e] [I, H]`); the block output is
`sum_k weight_k * expert_k(x) + sigmoid(x @ shared_gate) * shared_swiglu(x)`. Weights are `[in, out]`.
Gemma-4 (`gemma4.py`) routes its own way around `route` and runs `experts` with a tanh-GELU gate. After the
router's product, a GPU can route in one kernel (`pallas_kernels/route_top_k.py`, `ROUTE_IMPL`).

The routed experts have three implementations (`MOE_IMPLS`), all accumulating in float32:
- `"grouped"`: the T*k (token, expert) rows sorted by expert into one group per distinct expert, each group
  multiplied by its expert's matrices read in place (`pallas_kernels/expert_matmul.py`, a Pallas kernel),
  then un-sorted (a gather, so the sum over k keeps a fixed order). Each chosen expert is read once.
- `"ragged"`: the same sorted rows multiplied by `jax.lax.ragged_dot` with one group per expert (all E).
- `"gather"`: each token's k experts' weights gathered (`[T, k, H, 2I]`) and contracted by einsum.
"""
from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

from dflash_jax.targets.layers import exact, matmul, swiglu
from pallas_kernels.expert_matmul import expert_matmul
from pallas_kernels.mesh import context_mesh
from pallas_kernels.route_top_k import IMPLS as ROUTE_IMPLS
from pallas_kernels.route_top_k import route_top_k
from pallas_kernels.route_top_k import supported as route_kernel_takes

MOE_IMPLS = ("grouped", "ragged", "gather")
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}
"""The gate activations of an expert's gated MLP: SwiGLU (Qwen) or GeGLU with tanh GELU (Gemma-4)."""

GROUPED_MAX_TOKENS = 16
"""On a GPU, blocks of up to this many tokens take `"grouped"`, wider ones (prefill chunks) `ragged_dot`. On the H200
(bench/results/moe_partial.json, Qwen3.5-35B-A3B experts, bf16, the whole block): grouped 0.069 / 0.130 / 0.282 ms
at 1 / 3 / 16 tokens, against the gather's 0.127 / 0.251 / 1.068 and `ragged_dot`'s 0.446 / 0.478 / 0.603. Wider
blocks keep `ragged_dot` until a full run decides: one of 3 samples a cell (the file's third run) timed 48 tokens
at 0.82 ms grouped against 1.00 with `ragged_dot`, and reversed the 1-token order (grouped 0.116, gather 0.061)."""

ROUTE_IMPL = "pallas"
"""How a GPU routes (`route_top_k`'s impl): "xla", XLA's five kernels; "pallas", `pallas_kernels/route_top_k.py`'s
kernel (softmax, top-k and renormalisation in one, Triton lowering); "mosaic", its Mosaic GPU port. "pallas": on an
H100 (bench/results/decode_kernels.json, the 35B-A3B shape cut to 32 layers, each setting compiled once and timed in
turn, passes within 0.5%) it took the decode step from 3.223 to 3.096 ms (3.9%), the Mosaic GPU port to 3.213."""

PARAM_KEYS = ("router", "w_gate_up", "w_down", "shared_gate_up", "shared_down", "shared_gate")


def default_impl(backend: str | None = None, tokens: int = 1) -> str:
    """The impl for a block of `tokens` tokens: on a GPU `"grouped"` up to `GROUPED_MAX_TOKENS`, else `"ragged"`;
    off a GPU always `"gather"` (there the Pallas kernel would run interpreted, and `ragged_dot` multiplies every
    row by every expert, a dense `[E, T*k, H]` expansion, while the gather touches only the chosen ones). Traced
    under a mesh of several devices (a sharded model: `dflash_jax.sharding.mesh_context`) also `"gather"`: XLA's
    partitioner splits it over the experts, while the grouped kernel routes rows across all of them on one device."""
    if not _kernels_run(backend):
        return "gather"
    return "grouped" if tokens <= GROUPED_MAX_TOKENS else "ragged"


def _kernels_run(backend: str | None) -> bool:
    """Whether this trace may take the GPU kernels: a GPU, and no mesh of several devices."""
    return (backend or jax.default_backend()) == "gpu" and context_mesh() is None


def route(x: jax.Array, w_router: jax.Array, top_k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """Top-k routing of tokens `x [T, H]` by `w_router [H, E]`: (weights `[T, k]` in x.dtype, experts int32 `[T, k]`).

    Probabilities are a float32 softmax of the logits; with `norm_topk_prob` the k chosen ones are
    rescaled to sum 1, else they keep their share of the whole softmax."""
    _check_route(x, w_router, top_k, norm_topk_prob)
    return route_top_k(matmul(x, w_router), int(top_k), norm_topk_prob, x.dtype,
                       impl=route_impl(w_router.shape[1], int(top_k)))


def route_impl(num_experts: int, top_k: int, backend: str | None = None) -> str:
    """`route_top_k`'s impl: `ROUTE_IMPL` on a GPU where its kernel takes the shape, else the reference (off a GPU
    the kernel would run interpreted; under a mesh of several devices XLA's partitioner splits the rows)."""
    if ROUTE_IMPL not in ROUTE_IMPLS:
        raise ValueError(f"moe: ROUTE_IMPL={ROUTE_IMPL!r} is not known; choose one of {ROUTE_IMPLS}.")
    if ROUTE_IMPL == "xla" or not _kernels_run(backend) or not route_kernel_takes(num_experts, top_k, ROUTE_IMPL):
        return "xla"
    return ROUTE_IMPL


def experts(x: jax.Array, weights: jax.Array, idx: jax.Array, w_gate_up: jax.Array, w_down: jax.Array,
            impl: str, activation: str = "silu") -> jax.Array:
    """`sum_k weights[t, k] * MLP_{idx[t, k]}(x[t])` for tokens `x [T, H]`, each expert a gated MLP (SwiGLU by
    default): `[T, H]` in x.dtype.

    weights `[T, k]`, idx int `[T, k]` in `[0, E)`, w_gate_up `[E, H, 2I]`, w_down `[E, I, H]`. The
    products accumulate in float32 (full float32 for float32 inputs); the gated activation is cast to
    x.dtype before the down projection, as transformers does. `activation` (of `ACTIVATIONS`) is the gate's."""
    _check_experts(x, weights, idx, w_gate_up, w_down, impl)
    if activation not in ACTIVATIONS:
        raise ValueError(f"moe: activation={activation!r} is not supported; choose one of {tuple(ACTIVATIONS)}.")
    act = ACTIVATIONS[activation]
    y = {"grouped": _grouped, "ragged": _ragged, "gather": _gather}[impl](x, idx, w_gate_up, w_down, act)
    return jnp.sum(weights.astype(jnp.float32)[..., None] * y, axis=1).astype(x.dtype)


def _ragged(x, idx, w_gate_up, w_down, act):
    """Per-(token, expert) outputs `[T, k, H]` float32 through one grouped matmul per projection."""
    t, k = idx.shape
    rows, sizes, order = _rows_by_expert(x, idx, w_gate_up.shape[0])
    h = jax.lax.ragged_dot(rows, w_gate_up, sizes, precision=exact(x, w_gate_up),
                           preferred_element_type=jnp.float32)
    gated = _gated_act(h, x.dtype, act)
    y = jax.lax.ragged_dot(gated, w_down, sizes, precision=exact(gated, w_down), preferred_element_type=jnp.float32)
    return jnp.take(y, jnp.argsort(order), axis=0).reshape(t, k, -1)


def _rows_by_expert(x, idx, num_experts):
    """The T*k (token, expert) rows of x sorted by expert, each group in token order; the group sizes
    `[E]` and the sorting permutation of the flattened idx."""
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return jnp.take(x, order // idx.shape[1], axis=0), sizes, order


def _grouped(x, idx, w_gate_up, w_down, act):
    """Per-(token, expert) outputs `[T, k, H]` float32: rows grouped by distinct expert, `G = min(E, T*k)` groups
    of up to T rows (an expert appears at most once per token); unused groups have expert -1 and cost nothing."""
    t, k = idx.shape
    if t == 1:  # a decode step: its k experts are distinct already, each meets the one row (shared, not copied)
        gated = _gated_act(expert_matmul(x[None], w_gate_up, idx[0], impl="pallas"), x.dtype, act)
        return expert_matmul(gated, w_down, idx[0], impl="pallas").reshape(1, k, -1)
    n = t * k
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    by_expert = flat[order]
    first = jnp.concatenate([jnp.ones((1,), bool), by_expert[1:] != by_expert[:-1]])
    group = jnp.cumsum(first) - 1
    slot = jnp.arange(n) - jax.lax.cummax(jnp.where(first, jnp.arange(n), 0))
    groups = min(w_gate_up.shape[0], n)
    expert = jnp.full((groups,), -1, jnp.int32).at[group].set(by_expert.astype(jnp.int32))
    rows = jnp.zeros((groups, t, x.shape[1]), x.dtype).at[group, slot].set(jnp.take(x, order // k, axis=0))
    gated = _gated_act(expert_matmul(rows, w_gate_up, expert, impl="pallas"), x.dtype, act)
    y = expert_matmul(gated, w_down, expert, impl="pallas")
    back = jnp.argsort(order)
    return y[group[back], slot[back]].reshape(t, k, -1)


def _gather(x, idx, w_gate_up, w_down, act):
    """Per-(token, expert) outputs `[T, k, H]` float32 from each token's k gathered expert matrices."""
    up = jnp.take(w_gate_up, idx, axis=0)  # [T, k, H, 2I]
    h = jnp.einsum("th,tkhi->tki", x, up, precision=exact(x, up), preferred_element_type=jnp.float32)
    gated = _gated_act(h, x.dtype, act)
    down = jnp.take(w_down, idx, axis=0)  # [T, k, I, H]
    return jnp.einsum("tki,tkih->tkh", gated, down, precision=exact(gated, down), preferred_element_type=jnp.float32)


def _gated_act(h, dtype, act):
    gate, up = jnp.split(h.astype(dtype), 2, axis=-1)
    return act(gate) * up


def moe_block(x: jax.Array, params: dict, *, top_k: int, norm_topk_prob: bool, impl: str) -> jax.Array:
    """The sparse MoE block on `x [B, W, H]`: routed experts plus the gated shared expert, `[B, W, H]`.

    params: `router [H, E]`, `w_gate_up [E, H, 2I]`, `w_down [E, I, H]`, `shared_gate_up [H, 2Is]`,
    `shared_down [Is, H]`, `shared_gate [H, 1]`."""
    _check_block(x, params, impl)
    tokens = x.reshape(-1, x.shape[-1])
    weights, idx = route(tokens, params["router"], top_k, norm_topk_prob)
    routed = experts(tokens, weights, idx, params["w_gate_up"], params["w_down"], impl)
    shared = jax.nn.sigmoid(matmul(tokens, params["shared_gate"])) * swiglu(
        tokens, params["shared_gate_up"], params["shared_down"])
    return (routed + shared).reshape(x.shape)


def _check_impl(impl) -> None:
    if impl not in MOE_IMPLS:
        raise ValueError(f"moe: impl={impl!r} is not supported; choose one of {MOE_IMPLS}.")


def _check_float(name: str, a) -> None:
    if not jnp.issubdtype(a.dtype, jnp.floating):
        raise ValueError(f"moe: {name} has dtype {a.dtype}; expected a floating dtype.")


def _check_route(x, w_router, top_k, norm_topk_prob) -> None:
    """Refuse bad routing arguments here, with a sentence, instead of deep inside XLA."""
    if x.ndim != 2 or w_router.ndim != 2 or w_router.shape[0] != x.shape[1]:
        raise ValueError(f"moe: route takes x [T, H] and router [H, E]; got x {x.shape} and router {w_router.shape}.")
    _check_float("x", x)
    _check_float("router", w_router)
    n_experts = w_router.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or not 1 <= top_k <= n_experts:
        raise ValueError(f"moe: top_k={top_k!r} must be an int in [1, {n_experts}] (the router has "
                         f"{n_experts} experts).")
    if not isinstance(norm_topk_prob, bool):
        raise ValueError(f"moe: norm_topk_prob={norm_topk_prob!r} must be True or False.")


def _check_experts(x, weights, idx, w_gate_up, w_down, impl) -> None:
    """Refuse a bad impl, dtype or shape before tracing the products."""
    _check_impl(impl)
    if x.ndim != 2 or w_gate_up.ndim != 3 or w_down.ndim != 3:
        raise ValueError(f"moe: experts take x [T, H], w_gate_up [E, H, 2I] and w_down [E, I, H]; got x {x.shape}, "
                         f"w_gate_up {w_gate_up.shape}, w_down {w_down.shape}.")
    e, h, two_i = w_gate_up.shape
    if h != x.shape[1] or two_i % 2 or w_down.shape != (e, two_i // 2, h):
        raise ValueError(f"moe: w_gate_up {w_gate_up.shape} and w_down {w_down.shape} do not fit x {x.shape}; "
                         f"expected [E, {x.shape[1]}, 2I] and [E, I, {x.shape[1]}].")
    if idx.ndim != 2 or idx.shape[0] != x.shape[0] or weights.shape != idx.shape:
        raise ValueError(f"moe: weights {weights.shape} and idx {idx.shape} must both be [T, k] with T = "
                         f"{x.shape[0]} tokens of x {x.shape}.")
    if not jnp.issubdtype(idx.dtype, jnp.integer):
        raise ValueError(f"moe: idx has dtype {idx.dtype}; expected integer expert ids in [0, {e}).")
    for name, a in (("x", x), ("weights", weights), ("w_gate_up", w_gate_up), ("w_down", w_down)):
        _check_float(name, a)


def _check_block(x, params, impl) -> None:
    _check_impl(impl)
    missing = [key for key in PARAM_KEYS if key not in params]
    if missing:
        raise ValueError(f"moe: params lack {missing}; moe_block needs {list(PARAM_KEYS)}.")
    if x.ndim != 3:
        raise ValueError(f"moe: moe_block takes x [B, W, H]; got shape {x.shape}.")
    router, w_gate_up = params["router"], params["w_gate_up"]
    if router.ndim != 2 or w_gate_up.ndim != 3 or router.shape[1] != w_gate_up.shape[0]:
        raise ValueError(f"moe: router {router.shape} and w_gate_up {w_gate_up.shape} must agree on the number of "
                         "experts E: router [H, E], w_gate_up [E, H, 2I].")
    h, s = x.shape[-1], params["shared_down"].shape
    if (params["shared_gate"].shape != (h, 1) or len(s) != 2 or s[1] != h
            or params["shared_gate_up"].shape != (h, 2 * s[0])):
        raise ValueError(f"moe: shared expert shapes gate_up {params['shared_gate_up'].shape}, down {s}, gate "
                         f"{params['shared_gate'].shape} do not fit H = {h}; expected [{h}, 2Is], [Is, {h}], [{h}, 1].")


__all__ = ["ACTIVATIONS", "GROUPED_MAX_TOKENS", "MOE_IMPLS", "PARAM_KEYS", "ROUTE_IMPL", "default_impl", "experts",
           "moe_block", "route", "route_impl"]
