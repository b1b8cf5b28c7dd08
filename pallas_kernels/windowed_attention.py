"""Block attention: W block queries over `[context cache ; block]` keys, with GQA and windows.

One entry point serves the drafter (b block rows over the draft cache, full / sliding-causal /
sliding-symmetric masks) and the target's verify and decode (W rows over the KV cache, causal
inside the block). `impl="xla"` is the plain jnp reference over the whole cache capacity;
`impl="pallas"` is a Pallas (Triton-lowered) GPU kernel whose work is bounded by the live
context length and the window, not by the capacity. `impl="cudnn"` is cuDNN's fused attention (through
`jax.nn.dot_product_attention`) for the causal, unwindowed attentions it takes, the kernel for the rest.

Kernel layout: the W block rows times the `nh // nkv` query heads of one KV head are packed into
one query tile (so 16 rows x 4 heads make a 64-row matmul instead of sixteen skinny ones). The
grid is (batch, kv head, query tile, context split); each program runs an online softmax in
float32 over its share of the live context tiles, and the last split also attends to the block
keys. Splits (flash-decoding) keep the GPU busy when batch x kv heads is small; their partial
results are merged in jnp.

`block_attention_into_cache` is a target's causal attention and its cache write in one: the kernel also writes
the block's K/V into the caches it aliases, in place of two scatter kernels after it.
"""
from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.mesh import per_device

IMPLS = ("xla", "pallas", "cudnn")
CUDNN_MAX_HEAD_DIM = 256
"""The widest head cuDNN's fused attention takes on Hopper (a multiple of 8); wider heads take the Pallas kernel."""

# Tile settings, picked with `bench/kernel_check.py --sweep` on an H200 (JAX 0.11.2).
BLOCK_Q = 64  # packed query rows per tile
BLOCK_K = 64  # keys per context tile
TARGET_PROGRAMS = 256  # context splits are added until the grid has about this many programs (132 SMs)
MIN_TILES_PER_SPLIT = 2
NUM_WARPS = 4
NUM_STAGES = 3
SMEM_BYTES = 232_448
"""Shared memory one H200 thread block may take: the bound every kernel's tiles and pipeline stages must fit."""
# Wide heads (Gemma-4's 512) shrink the tiles: a program's shared memory (one query tile and `num_stages` K and V
# tiles) must fit SMEM_BYTES, and its float32 accumulator must stay as small as the 64 x 256 that the
# head-128/256 sweep ran with.
ACC_ELEMENTS = 64 * 256

WRITE_IN_KERNEL = True
"""Whether `block_attention_into_cache` with `impl="pallas"` writes the block's K/V from inside the attention
kernel (fewer kernels a layer) or by `write_rows` after it. On: on the H200 (`bench/profile_round.py` without and
with `--scatter`, one lease, Qwen3-8B shape, batch 1, 2026-12-03) it took a plain step from 775 to 629
kernels and 4,562 to 4,368 us busy, and a fused round from 5,725 to 5,675 us; the attention kernel of a round went
from 224 to 238 us. (Before the block was written in one masked store, row by row, the round lost 102 us.)"""

_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite, so fully masked tiles never make NaN


def _triton_compiler_params(num_warps: int, num_stages: int):
    """Triton `CompilerParams` (selects the Triton lowering); its import path moved across JAX versions."""
    try:
        from jax.experimental.pallas import triton as pltriton

        params_cls = pltriton.CompilerParams
    except (ImportError, AttributeError):
        params_cls = pl.TritonCompilerParams
    return params_cls(num_warps=num_warps, num_stages=num_stages)


def where_lowered(kernel, interpret: bool | None):
    """`kernel(*args, interpret=...)` as one callable: `interpret` as given, or with None chosen where the program
    is lowered, not where it is traced (a CPU host may lower for CUDA): compiled on CUDA and ROCm, interpreted
    elsewhere."""
    if interpret is not None:
        return functools.partial(kernel, interpret=interpret)
    return lambda *args: lax.platform_dependent(*args, cuda=functools.partial(kernel, interpret=False),
                                                rocm=functools.partial(kernel, interpret=False),
                                                default=functools.partial(kernel, interpret=True))


def sees_context(q_pos, k_pos, ctx_len, window: int | None):
    """Whether a query at absolute position `q_pos` sees context key `k_pos` (broadcasting ints)."""
    seen = k_pos < ctx_len
    if window is not None:
        seen = seen & (q_pos - k_pos < window)
    return seen


def sees_block(q_idx, k_idx, width: int, causal: bool, window: int | None):
    """Whether block row `q_idx` sees block key `k_idx` (both in `[0, width)`; broadcasting ints)."""
    seen = k_idx < width
    if causal:
        seen = seen & (k_idx <= q_idx)
    if window is not None:
        seen = seen & (q_idx - k_idx < window)
        if not causal:
            seen = seen & (k_idx - q_idx < window)
    return seen


def block_attention(q, k_ctx, v_ctx, ctx_len, k_blk, v_blk, *, scale: float, causal: bool = True,
                    window: int | None = None, impl: str = "xla", interpret: bool | None = None):
    """Attention of W block queries over `[context ; block]` keys. Returns `[B, W, nh, hd]` in q.dtype.

    q: [B, W, nh, hd]; k_ctx, v_ctx: [B, S, nkv, hd] (a cache of capacity S); ctx_len: int32[B];
    k_blk, v_blk: [B, W, nkv, hd].
    Positions: context key j sits at position j (valid iff j < ctx_len[b]); block row i (query and
    key) sits at position ctx_len[b] + i. Query i sees context key j iff j < ctx_len and (window is
    None or (ctx_len+i) - j < window). Query i sees block key i' iff (not causal or i' <= i) and
    (window is None or (i - i' < window and (causal or i' - i < window))). Every row sees itself.
    GQA: query head h uses kv head h // (nh // nkv). Softmax in float32; output cast to q.dtype.
    ctx_len[b] must lie in [0, S]. `interpret` runs the Pallas kernel in interpret mode; None (the default) does
    so on every platform but CUDA and ROCm, where the Triton lowering exists, so `impl="pallas"` also runs
    (slowly) on a CPU. Under a mesh the kernel runs per device on its heads and rows (`mesh.per_device`).
    `impl="cudnn"` is `_cudnn_attention` where `cudnn_serves` says it can, else the Pallas kernel.
    """
    ctx_len = jnp.asarray(ctx_len)
    _check_inputs(q, k_ctx, v_ctx, ctx_len, k_blk, v_blk, window, impl)
    ctx_len = ctx_len.astype(jnp.int32)
    window = None if window is None else int(window)
    if impl == "xla":
        return _xla_attention(q, k_ctx, v_ctx, ctx_len, k_blk, v_blk, scale=float(scale), causal=causal,
                              window=window)
    if impl == "cudnn" and cudnn_serves(q, causal, window):
        return _cudnn_attention(q, k_ctx, v_ctx, ctx_len, k_blk, v_blk, scale=float(scale))
    run = where_lowered(functools.partial(_pallas_attention, scale=float(scale), causal=causal, window=window),
                        interpret)
    heads = (0, 2)  # [B, ., heads, hd]: query heads with their KV heads, split alike
    return per_device(run, (q, k_ctx, v_ctx, ctx_len, k_blk, v_blk), (heads, heads, heads, (0, None), heads, heads),
                      (heads,))


def write_rows(buf: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """Write `new [B, W, ...]` into `buf [B, S, ...]` at rows `start[b] + i`; rows past S are dropped.

    One in-place scatter kernel per write on the GPU, where a vmapped `dynamic_update_slice`
    took two (a read of the old rows, then a masked update) and shifted a block that overhangs
    the end instead of dropping its tail. (With one row per batch row, as in plain decoding,
    XLA still rewrites the scatter into that pair.)
    """
    b, w = new.shape[:2]
    if buf.shape[0] != b:
        raise ValueError(f"write_rows: the buffer holds {buf.shape[0]} rows and the block {b}.")
    rows = start.astype(jnp.int32)[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :]
    batch = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, w))
    return buf.at[batch, rows].set(new.astype(buf.dtype), mode="drop", unique_indices=True)


def writes_in_kernel(k_cache, impl: str) -> bool:
    """Whether `block_attention_into_cache` writes from inside the kernel: `WRITE_IN_KERNEL`, the Pallas kernel,
    and a cache the kernel's tiles take as it is (capacity >= BLOCK_K, head_dim a power of two >= 16), since a
    padded copy of the cache could not be written in place."""
    s, hd = k_cache.shape[1], k_cache.shape[3]
    return WRITE_IN_KERNEL and impl == "pallas" and s >= BLOCK_K and _padded_head_dim(hd) == hd


def block_attention_into_cache(q, k_cache, v_cache, ctx_len, k_blk, v_blk, *, scale: float, impl: str = "xla",
                               interpret: bool | None = None):
    """A target's causal `block_attention` of the block over the cache, and the caches with the block's K/V
    written at rows `ctx_len[b] + i` (rows past the capacity dropped): `(out, (k_cache, v_cache))`, the pair
    being what a layer's `attend` hands back beside its output.

    Where `writes_in_kernel`, the attention kernel writes the rows into the caches, which it aliases (the
    program of query tile 0 and split 0 of each batch row and kv head, after its attention); its reads of the
    cache stop below `ctx_len`, so no program reads a row being written. Elsewhere: the attention, then
    `write_rows`. The two give the same values.
    """
    ctx_len = jnp.asarray(ctx_len)
    if not writes_in_kernel(k_cache, impl):
        out = block_attention(q, k_cache, v_cache, ctx_len, k_blk, v_blk, scale=scale, causal=True, impl=impl,
                              interpret=interpret)
        return out, (write_rows(k_cache, k_blk, ctx_len), write_rows(v_cache, v_blk, ctx_len))
    _check_inputs(q, k_cache, v_cache, ctx_len, k_blk, v_blk, None, impl)
    run = where_lowered(functools.partial(_pallas_attention, scale=float(scale), causal=True, window=None,
                                          write=True), interpret)
    heads = (0, 2)
    out, k_cache, v_cache = per_device(run, (q, k_cache, v_cache, ctx_len.astype(jnp.int32), k_blk, v_blk),
                                       (heads, heads, heads, (0, None), heads, heads), (heads, heads, heads))
    return out, (k_cache, v_cache)


def _check_inputs(q, k_ctx, v_ctx, ctx_len, k_blk, v_blk, window, impl) -> None:
    """Refuse a bad `impl`, window or shape here, with a sentence, instead of deep inside XLA."""
    if impl not in IMPLS:
        raise ValueError(f"block_attention: impl={impl!r} is not supported; choose one of {IMPLS}.")
    if window is not None and (not isinstance(window, numbers.Integral) or window < 1):
        raise ValueError(f"block_attention: window={window!r} must be None or a positive int.")
    arrays = {"q": q, "k_ctx": k_ctx, "v_ctx": v_ctx, "k_blk": k_blk, "v_blk": v_blk}
    for name, x in arrays.items():
        if x.ndim != 4:
            raise ValueError(f"block_attention: {name} has shape {x.shape}; expected 4 dims [B, T, heads, hd].")
    b, w, nh, hd = q.shape
    _, s, nkv, _ = k_ctx.shape
    expected = {"k_ctx": (b, s, nkv, hd), "v_ctx": (b, s, nkv, hd), "k_blk": (b, w, nkv, hd),
                "v_blk": (b, w, nkv, hd)}
    for name, shape in expected.items():
        if arrays[name].shape != shape:
            raise ValueError(f"block_attention: {name} has shape {arrays[name].shape}; expected {shape} "
                             f"from q {q.shape} and k_ctx {k_ctx.shape} ([B, S, nkv, hd] / [B, W, nkv, hd]).")
    if nkv == 0 or nh % nkv:
        raise ValueError(f"block_attention: {nh} query heads are not a multiple of {nkv} kv heads.")
    dtypes = {name: x.dtype for name, x in arrays.items()}
    if len(set(dtypes.values())) != 1:
        raise ValueError(f"block_attention: q, k and v must share one dtype; got {dtypes}.")
    if ctx_len.shape != (b,) or not jnp.issubdtype(ctx_len.dtype, jnp.integer):
        raise ValueError(f"block_attention: ctx_len must be an integer array of shape ({b},); "
                         f"got {ctx_len.dtype}{list(ctx_len.shape)}.")


def _xla_attention(q, k_ctx, v_ctx, ctx_len, k_blk, v_blk, *, scale, causal, window):
    """Reference: scores over the full capacity and the block, masked, one float32 softmax."""
    b, w, nh, hd = q.shape
    s, nkv = k_ctx.shape[1], k_ctx.shape[2]
    qg = q.reshape(b, w, nkv, nh // nkv, hd)
    f32 = jnp.float32
    einsum = functools.partial(jnp.einsum, precision=lax.Precision.HIGHEST, preferred_element_type=f32)
    s_ctx = einsum("bwkgd,bskd->bkgws", qg, k_ctx) * scale
    s_blk = einsum("bwkgd,bukd->bkgwu", qg, k_blk) * scale
    q_pos = ctx_len[:, None, None] + jnp.arange(w)[None, :, None]
    ctx_mask = sees_context(q_pos, jnp.arange(s)[None, None, :], ctx_len[:, None, None], window)
    blk_mask = sees_block(jnp.arange(w)[:, None], jnp.arange(w)[None, :], w, causal, window)
    scores = jnp.concatenate([jnp.where(ctx_mask[:, None, None], s_ctx, -jnp.inf),
                              jnp.where(blk_mask, s_blk, -jnp.inf)], axis=-1)
    p = jax.nn.softmax(scores, axis=-1)
    out = (einsum("bkgws,bskd->bwkgd", p[..., :s], v_ctx.astype(f32))
           + einsum("bkgwu,bukd->bwkgd", p[..., s:], v_blk.astype(f32)))
    return out.reshape(b, w, nh, hd).astype(q.dtype)


def cudnn_serves(q, causal: bool, window) -> bool:
    """Whether `_cudnn_attention` computes this attention: causal, no window, a head cuDNN takes, and on a GPU
    a 16-bit dtype (off a GPU it runs through XLA's attention, in any dtype)."""
    hd = q.shape[-1]
    sixteen_bit = q.dtype in (jnp.bfloat16, jnp.float16) or jax.default_backend() != "gpu"
    return causal and window is None and hd <= CUDNN_MAX_HEAD_DIM and hd % 8 == 0 and sixteen_bit


def _cudnn_attention(q, k_ctx, v_ctx, ctx_len, k_blk, v_blk, *, scale):
    """Causal block attention as two fused attentions merged by their softmax statistics (log-sum-exp, natural
    log): the block over the live context (cuDNN's padding mask at `ctx_len`; its work is bounded by it), and the
    block over itself (cuDNN's causal mask, which aligns query i with key i). A row with no context takes the
    block's part alone. cuDNN on a GPU (on the H200 0.60 of the Pallas kernel's time for a 4096-token prefill
    chunk over 16,000 tokens of context, bench/results/prefill.json), `jax.nn.dot_product_attention`'s XLA form
    elsewhere."""
    attend = functools.partial(jax.nn.dot_product_attention, scale=scale, return_residual=True,
                               implementation="cudnn" if jax.default_backend() == "gpu" else "xla")
    o_ctx, l_ctx = attend(q, k_ctx, v_ctx, key_value_seq_lengths=jnp.maximum(ctx_len, 1))
    o_blk, l_blk = attend(q, k_blk, v_blk, is_causal=True)
    f32 = jnp.float32
    l_ctx = jnp.where((ctx_len > 0)[:, None, None], l_ctx.astype(f32), -jnp.inf)[..., None]
    l_blk = l_blk.astype(f32)[..., None]
    m = jnp.maximum(l_ctx, l_blk)
    w_ctx, w_blk = jnp.exp(l_ctx - m), jnp.exp(l_blk - m)
    return ((o_ctx.astype(f32) * w_ctx + o_blk.astype(f32) * w_blk) / (w_ctx + w_blk)).astype(q.dtype)


def _attend_tile(carry, q, k, v, visible, scale):
    """One online-softmax step of a query tile over one key tile (float32 state `o, m, l`).

    HIGHEST keeps float32 inputs out of TF32 (Triton's DEFAULT); bf16 inputs are unaffected.
    """
    o, m, l = carry
    dot = functools.partial(lax.dot_general, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    s = dot(q, k, (((1,), (1,)), ((), ()))) * scale
    s = jnp.where(visible, s, _MASKED)
    m_new = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    pv = dot(p.astype(v.dtype), v, (((1,), (0,)), ((), ())))
    return alpha[:, None] * o + pv, m_new, alpha * l + p.sum(axis=1)


def _kernel(len_ref, q_ref, kc_ref, vc_ref, kb_ref, vb_ref, o_ref, lse_ref, *written, scale, causal, window,
            group, width, block_k, block_b, n_splits):
    """One (batch row, kv head, query tile, context split): live context tiles, then block keys; with
    `written` (the aliased K and V caches), the first program of a (batch row, kv head) then writes the block."""
    rows, _ = q_ref.shape
    capacity = kc_ref.shape[0]
    ctx_len = len_ref[()]
    first_row = pl.program_id(2) * rows
    split = pl.program_id(3)
    q_idx = lax.div(lax.broadcasted_iota(jnp.int32, (rows, 1), 0) + first_row, jnp.int32(group))
    i_lo = lax.div(first_row, jnp.int32(group))
    i_hi = jnp.minimum(lax.div(first_row + rows - 1, jnp.int32(group)), width - 1)
    q = q_ref[...]

    def context_tile(t, carry):
        start = t * block_k
        offset = jnp.minimum(start, capacity - block_k)  # the last tile slides back inside the cache
        k_pos = offset + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        visible = (k_pos >= start) & sees_context(ctx_len + q_idx, k_pos, ctx_len, window)
        tile = pl.ds(offset, block_k)
        return _attend_tile(carry, q, kc_ref[tile, :], vc_ref[tile, :], visible, scale)

    def block_tile(t, carry):
        start = t * block_b
        k_idx = start + lax.broadcasted_iota(jnp.int32, (1, block_b), 1)
        visible = sees_block(q_idx, k_idx, width, causal, window)
        tile = pl.ds(start, block_b)
        return _attend_tile(carry, q, kb_ref[tile, :], vb_ref[tile, :], visible, scale)

    lo = 0 if window is None else jnp.maximum(ctx_len + i_lo - window + 1, 0)
    first, end = lax.div(lo, block_k), lax.div(ctx_len + block_k - 1, block_k)
    per_split = lax.div(end - first + n_splits - 1, n_splits)
    t_lo = first + split * per_split
    t_hi = jnp.minimum(t_lo + per_split, end)

    b_lo = 0 if window is None else jnp.maximum(i_lo - window + 1, 0)
    b_hi = i_hi + 1 if causal else (width if window is None else jnp.minimum(i_hi + window, width))
    b_first, b_end = lax.div(b_lo, block_b), lax.div(b_hi + block_b - 1, block_b)
    b_end = jnp.where(split == n_splits - 1, b_end, b_first)  # only the last split sees the block

    carry = (jnp.zeros(q.shape, jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
             jnp.zeros((rows,), jnp.float32))
    carry = lax.fori_loop(t_lo, t_hi, context_tile, carry)
    o, m, l = lax.fori_loop(b_first, b_end, block_tile, carry)
    o_ref[...] = (o / jnp.where(l == 0.0, 1.0, l)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)
    if written:
        _write_block(written, kb_ref, vb_ref, ctx_len, width, capacity,
                     (pl.program_id(2) == 0) & (split == 0))


def _write_block(written, kb_ref, vb_ref, ctx_len, width: int, capacity: int, writer) -> None:
    """Block rows `i < width` into the aliased caches at `ctx_len + i` (a row past the capacity is dropped), by
    the one program that `writer` marks: one masked store of the whole block tile, or, when the tile would
    overhang the cache (interpret mode would clamp that slice), one row at a time."""
    kc_out, vc_out = written
    rows = kb_ref.shape[0]
    fits = ctx_len + rows <= capacity

    @pl.when(writer & fits)
    def _():
        mask = lax.broadcasted_iota(jnp.int32, kb_ref.shape, 0) < width
        plt.store(kc_out.at[pl.ds(ctx_len, rows), :], kb_ref[...], mask=mask)
        plt.store(vc_out.at[pl.ds(ctx_len, rows), :], vb_ref[...], mask=mask)

    @pl.when(writer & jnp.logical_not(fits))
    def _():
        def row(i, carry):
            @pl.when(ctx_len + i < capacity)
            def _():
                kc_out[pl.ds(ctx_len + i, 1), :] = kb_ref[pl.ds(i, 1), :]
                vc_out[pl.ds(ctx_len + i, 1), :] = vb_ref[pl.ds(i, 1), :]

            return carry

        lax.fori_loop(0, width, row, 0)


def _padded_head_dim(hd: int) -> int:
    """Triton tiles: power-of-two sizes, at least 16 along every matmul dimension."""
    return max(16, pl.next_power_of_2(hd))


def _pad_axis(x, axis: int, size: int):
    """Zero-pad `x` along `axis` up to `size` (no copy when already that size)."""
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


def _round_up(n: int, m: int) -> int:
    """Smallest multiple of `m` that is >= `n`."""
    return -(-n // m) * m


def fit_tiles(hd_p: int, itemsize: int, block_q: int, block_k: int, num_stages: int) -> tuple[int, int, int]:
    """`(block_q, block_k, num_stages)` shrunk until the accumulator and the shared memory fit (see SMEM_BYTES):
    fewer query rows first, then fewer pipeline stages, then shorter key tiles."""
    block_q = max(16, min(block_q, ACC_ELEMENTS // hd_p))
    while (block_q + 2 * num_stages * block_k) * hd_p * itemsize > SMEM_BYTES:
        if num_stages > 2:
            num_stages -= 1
        elif block_k > 16:
            block_k //= 2
        else:
            break
    return block_q, block_k, num_stages


def _kv_spec(length: int, hd: int) -> pl.BlockSpec:
    """All `length` keys of one (batch row, kv head) of a `[B, length, nkv, hd]` array."""
    return pl.BlockSpec((None, length, None, hd), lambda i, h, t, p: (i, 0, h, 0))


def _pallas_attention(q, k_ctx, v_ctx, ctx_len, k_blk, v_blk, *, scale, causal, window, interpret,
                      block_q: int = BLOCK_Q, block_k: int = BLOCK_K, kv_splits: int | None = None,
                      num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES, write: bool = False):
    """Pack queries per kv head, pad to Triton-friendly tiles, run the kernel, merge the splits. With `write`
    (`writes_in_kernel` holds: the cache is not padded) the kernel also writes the block into the caches, which
    it aliases, and returns them after the output."""
    b, w, nh, hd = q.shape
    s, nkv = k_ctx.shape[1], k_ctx.shape[2]
    group = nh // nkv
    hd_p = _padded_head_dim(hd)
    block_q, block_k, num_stages = fit_tiles(hd_p, k_ctx.dtype.itemsize, block_q, block_k, num_stages)
    rows = min(block_q, max(16, pl.next_power_of_2(w * group)))
    packed_rows = _round_up(w * group, rows)
    block_b = min(block_k, max(16, pl.next_power_of_2(w)))
    q_tiles = packed_rows // rows
    if kv_splits is None:
        kv_splits = min(-(-TARGET_PROGRAMS // (b * nkv * q_tiles)), -(-s // (block_k * MIN_TILES_PER_SPLIT)))
    n_splits = max(1, kv_splits)

    qp = q.reshape(b, w, nkv, group, hd).transpose(0, 2, 1, 3, 4).reshape(b, nkv, w * group, hd)
    qp = _pad_axis(_pad_axis(qp, 2, packed_rows), 3, hd_p)
    k_ctx, v_ctx = (_pad_axis(_pad_axis(x, 1, max(s, block_k)), 3, hd_p) for x in (k_ctx, v_ctx))
    k_blk, v_blk = (_pad_axis(_pad_axis(x, 1, _round_up(w, block_b)), 3, hd_p) for x in (k_blk, v_blk))

    out_dtype = q.dtype if n_splits == 1 else jnp.float32
    kernel = functools.partial(_kernel, scale=scale, causal=causal, window=window, group=group, width=w,
                               block_k=block_k, block_b=block_b, n_splits=n_splits)
    caches = [k_ctx, v_ctx] if write else []
    o, lse, *caches = pl.pallas_call(
        kernel,
        grid=(b, nkv, q_tiles, n_splits),
        in_specs=[
            pl.BlockSpec((None,), lambda i, h, t, p: (i,)),
            pl.BlockSpec((None, None, rows, hd_p), lambda i, h, t, p: (i, h, t, 0)),
            _kv_spec(k_ctx.shape[1], hd_p), _kv_spec(k_ctx.shape[1], hd_p),
            _kv_spec(k_blk.shape[1], hd_p), _kv_spec(k_blk.shape[1], hd_p),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, hd_p), lambda i, h, t, p: (i, h, p, t, 0)),
            pl.BlockSpec((None, None, None, rows), lambda i, h, t, p: (i, h, p, t)),
            *(_kv_spec(x.shape[1], hd_p) for x in caches),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, nkv, n_splits, packed_rows, hd_p), out_dtype),
            jax.ShapeDtypeStruct((b, nkv, n_splits, packed_rows), jnp.float32),
            *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in caches),
        ],
        input_output_aliases={2: 2, 3: 3} if write else {},
        compiler_params=_triton_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="block_attention",
    )(ctx_len, qp, k_ctx, v_ctx, k_blk, v_blk)

    if n_splits == 1:
        o = o[:, :, 0]
    else:
        weight = jnp.exp(lse - lse.max(axis=2, keepdims=True))
        o = (weight[..., None] * o).sum(axis=2) / weight.sum(axis=2)[..., None]
    o = o[:, :, : w * group, :hd].reshape(b, nkv, w, group, hd).transpose(0, 2, 1, 3, 4)
    o = o.reshape(b, w, nh, hd).astype(q.dtype)
    return (o, *caches) if write else o
