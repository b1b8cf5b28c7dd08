"""Top-k routing of a mixture of experts after the router's product, in one kernel (docs/architecture.md,
"Pallas kernels"):

    probs = softmax(float32(logits));  weights, experts = top_k(probs, k);  weights /= sum(weights) (optional)

on router logits `[T, E]`; weights are returned in the requested dtype, experts as int32, both `[T, k]`, the
k largest first and equal probabilities in expert order (`lax.top_k`'s order). `impl="xla"` is the jnp reference.
On a GPU XLA makes five kernels of it: the softmax, a sort of every row for `top_k`, the renormalisation and
casts, about 8 us a layer of a decode step where each takes one or two (H200,
bench/results/profile_round_qwen3.5-35b-a3b.json: the sort alone 4 us). `impl="pallas"` (Triton) takes one row
a program: the softmax, k rounds of "largest, then lowest expert among the equal", the renormalisation and the
casts on chip. Its softmax sums in another order than XLA's, so a weight can differ from the reference in the
last bit, and so can the choice between two experts whose probabilities are that close. `impl="mosaic"` is the same
program in Pallas's Mosaic GPU lowering (`pallas_kernels/mosaic_gpu.py`): one warpgroup a row, the row and the
expert ids copied into shared memory, the k weights and ids written as scalars and copied out. The ids come in as an
input and the logits as float32 (converted before the kernel), so both load in one register layout: the GPU
interpreter takes no in-kernel iota or layout cast.

The Triton kernel needs E a power of two (Triton's tiles) and the Mosaic GPU one a power of two of at least 128 (a
warpgroup's row); both k at most `MAX_TOP_K` (its rounds are unrolled). `supported` says whether a shape qualifies.
"""
from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_gpu
from pallas_kernels.mosaic_gpu import interpret_params
from pallas_kernels.windowed_attention import _triton_compiler_params, where_lowered

IMPLS = ("xla", "pallas", "mosaic")
MAX_TOP_K = 16
NUM_WARPS = 1
"""A row of a few hundred logits is one warp's work: more warps would only add the reductions' synchronisation."""
_LANES = 256
"""A Mosaic GPU copy moves at most this many elements along a dimension: a row of E is `[E / 256, 256]`."""


def supported(num_experts: int, top_k: int, impl: str = "pallas") -> bool:
    """Whether the kernel of `impl` takes `num_experts` router columns and `top_k` chosen experts."""
    least = 128 if impl == "mosaic" else 1
    return num_experts >= least and num_experts & (num_experts - 1) == 0 and 1 <= top_k <= min(MAX_TOP_K, num_experts)


def reference(logits: jax.Array, top_k: int, norm_topk_prob: bool, dtype) -> tuple[jax.Array, jax.Array]:
    """The module docstring's routing in jnp: `(weights [T, k] in dtype, experts int32 [T, k])`."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, chosen = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(dtype), chosen.astype(jnp.int32)


def route_top_k(logits: jax.Array, top_k: int, norm_topk_prob: bool, dtype=None, *, impl: str = "xla",
                interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """Routing of router `logits [T, E]` (module docstring); `dtype` that of the weights (default: the logits').
    `interpret` as for the other kernels: None runs the kernel compiled on CUDA and ROCm, interpreted elsewhere; for
    "mosaic", compiled on CUDA and the reference elsewhere (True: JAX's GPU interpreter)."""
    if impl not in IMPLS:
        raise ValueError(f"route_top_k: impl={impl!r} is not supported; choose one of {IMPLS}.")
    if logits.ndim != 2 or not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(f"route_top_k: logits must be floating [T, E]; got {logits.dtype}{list(logits.shape)}.")
    n_experts = logits.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or not 1 <= top_k <= n_experts:
        raise ValueError(f"route_top_k: top_k={top_k!r} must be an int in [1, {n_experts}] (E = {n_experts}).")
    dtype = logits.dtype if dtype is None else jnp.dtype(dtype)
    if impl == "xla":
        return reference(logits, int(top_k), norm_topk_prob, dtype)
    if not supported(n_experts, int(top_k), impl):
        least = " of at least 128" if impl == "mosaic" else ""
        raise ValueError(f"route_top_k: the {impl} kernel takes a power-of-two number of experts{least} and top_k <= "
                         f"{MAX_TOP_K}; got E = {n_experts}, top_k = {top_k}. Use impl='xla'.")
    if impl == "pallas":
        call = functools.partial(_pallas_route, top_k=int(top_k), norm=bool(norm_topk_prob), dtype=dtype)
        return where_lowered(call, interpret)(logits)
    call = functools.partial(_mosaic_route, top_k=int(top_k), norm=bool(norm_topk_prob), dtype=dtype)
    return mosaic_gpu.where_lowered(call, interpret, functools.partial(
        reference, top_k=int(top_k), norm_topk_prob=norm_topk_prob, dtype=dtype))(logits)


def _kernel(logits_ref, weights_ref, experts_ref, *, top_k: int, norm: bool):
    """One row: softmax, then k rounds each taking the largest probability left (the lowest expert among equals)."""
    logits = logits_ref[0, :].astype(jnp.float32)
    n = logits.shape[0]
    unnormalised = jnp.exp(logits - jnp.max(logits))
    probs = unnormalised / jnp.sum(unnormalised)
    expert = jnp.arange(n, dtype=jnp.int32)
    slot = jnp.arange(weights_ref.shape[1], dtype=jnp.int32)
    weights = jnp.zeros(slot.shape, jnp.float32)
    chosen = jnp.zeros(slot.shape, jnp.int32)
    left = probs
    for j in range(top_k):
        best = jnp.max(left)
        first = jnp.minimum(jnp.min(jnp.where(left == best, expert, n)), n - 1)  # NaN logits: still an expert
        weights = jnp.where(slot == j, best, weights)
        chosen = jnp.where(slot == j, first, chosen)
        left = jnp.where(expert == first, -1.0, left)  # probabilities are >= 0: a taken expert is never the largest
    if norm:
        weights = weights / jnp.sum(weights)  # the padding slots hold 0
    weights_ref[0, :] = weights.astype(weights_ref.dtype)
    experts_ref[0, :] = chosen


def _row(r):
    return r, 0


def _pallas_route(logits, *, top_k: int, norm: bool, dtype, interpret: bool):
    rows, n_experts = logits.shape
    slots = 1 << max(top_k - 1, 0).bit_length()  # Triton's tiles are powers of two; the extra slots are cropped
    weights, chosen = pl.pallas_call(
        functools.partial(_kernel, top_k=top_k, norm=norm),
        grid=(rows,),
        in_specs=[pl.BlockSpec((1, n_experts), _row)],
        out_specs=[pl.BlockSpec((1, slots), _row), pl.BlockSpec((1, slots), _row)],
        out_shape=[jax.ShapeDtypeStruct((rows, slots), dtype), jax.ShapeDtypeStruct((rows, slots), jnp.int32)],
        compiler_params=_triton_compiler_params(NUM_WARPS, 1),
        interpret=interpret,
        name="route_top_k",
    )(logits)
    return (weights, chosen) if slots == top_k else (weights[:, :top_k], chosen[:, :top_k])


def _mosaic_route(logits, *, top_k: int, norm: bool, dtype, interpret: bool):
    """The Mosaic GPU program, one row a program (module docstring)."""
    rows, n_experts = logits.shape
    tile = (n_experts // min(n_experts, _LANES), min(n_experts, _LANES))
    slots = (128 // jnp.dtype(dtype).itemsize, 32)  # a copy moves a multiple of 128 bytes; the extra slots are cropped

    def body(logits_gmem, ids_gmem, weights_gmem, experts_gmem):
        r = jax.lax.axis_index("row")

        def scoped(logits_smem, ids_smem, weights_smem, experts_smem, barriers):
            plgpu.copy_gmem_to_smem(logits_gmem.at[r], logits_smem, barriers.at[0])
            plgpu.copy_gmem_to_smem(ids_gmem, ids_smem, barriers.at[1])
            plgpu.barrier_wait(barriers.at[0])
            plgpu.barrier_wait(barriers.at[1])
            z, expert = logits_smem[...], ids_smem[...]
            unnormalised = jnp.exp(z - jnp.max(z))
            left = unnormalised / jnp.sum(unnormalised)
            weights, chosen = [], []
            for _ in range(top_k):
                best = jnp.max(left)
                first = jnp.minimum(jnp.min(jnp.where(left == best, expert, n_experts)), n_experts - 1)
                weights.append(best)
                chosen.append(first)
                left = jnp.where(expert == first, -1.0, left)
            total = sum(weights[1:], weights[0])
            for j in range(top_k):
                weights_smem[j] = (weights[j] / total if norm else weights[j]).astype(dtype)
                experts_smem[j] = chosen[j]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(weights_smem, weights_gmem.at[r])
            plgpu.copy_smem_to_gmem(experts_smem, experts_gmem.at[r])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scoped, plgpu.SMEM(tile, jnp.float32), plgpu.SMEM(tile, jnp.int32),
                      plgpu.SMEM(slots[:1], dtype), plgpu.SMEM(slots[1:], jnp.int32), plgpu.Barrier(num_barriers=2))

    out_type = (jax.ShapeDtypeStruct((rows, slots[0]), dtype), jax.ShapeDtypeStruct((rows, slots[1]), jnp.int32))
    kernel = plgpu.kernel(body, out_type=out_type, grid=(rows,), grid_names=("row",), kernel_name="route_top_k",
                          interpret=interpret_params(interpret))
    weights, chosen = kernel(logits.astype(jnp.float32).reshape((rows,) + tile),
                             jnp.arange(n_experts, dtype=jnp.int32).reshape(tile))
    return weights[:, :top_k], chosen[:, :top_k]


__all__ = ["IMPLS", "MAX_TOP_K", "reference", "route_top_k", "supported"]
