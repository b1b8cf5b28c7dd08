"""Gated DeltaNet: the linear-attention mixer of hybrid Qwen3-Next / Qwen3.5 targets.

Per value head, a float32 state S [dk, dv] takes each position t as (Hugging Face
`torch_recurrent_gated_delta_rule`)

    S = exp(g_t) S;   u_t = beta_t (v_t - S^T k_t);   S = S + k_t u_t^T;   o_t = S^T q_t

g is a log-decay (<= 0) and beta a write strength in [0, 1]. The caller L2-normalises q and k, scales q by
dk**-0.5 and repeats the key heads up to the H value heads. Shapes: state [B, H, dk, dv]; q, k [B, C, H, dk];
v [B, C, H, dv]; g, beta [B, C, H]. Inputs may be bf16; the math is float32 and so are out and states.

`delta_chunk` takes C positions at once in the UT (WY) form: the C updates u solve one unit lower-triangular
system (I + A) u = beta (v - exp(G) k S0), A_ij = beta_i (k_i . k_j) exp(G_i - G_j) for j < i, G = cumsum(g);
then o_i = exp(G_i) q_i^T S0 + sum_{j <= i} (q_i . k_j) exp(G_i - G_j) u_j. The block's outputs need no state
after S0, so `delta_chunk` returns the outputs and the per-position updates u; the state after any prefix of n
positions is S_n = exp(g_n) S_{n-1} + k_n u_n^T folded from S0 (`state_at`), unrolled: elementwise work that XLA
fuses into one pass over the state.

This is how speculative decoding keeps any prefix of a verify block: `extend` returns, per position, the update
(k, u, g) that takes the state one position further (a few KB, where the states themselves are dk x dv floats per
head and position), and `commit` folds the kept ones into the state (docs/architecture.md, "State of each family").
Masking property, bit for bit in float32: a position with beta = 0 gets u = 0 exactly, and no row depends on a
later one, so masking the positions >= n of a block (beta = 0, g = 0) gives, at positions < n, exactly the unmasked
outputs and updates, and so `state_at(..., n)` the same state from either. A caller that wants the state after a
prefix folds it with `state_at` from `delta_chunk`'s updates: another program (a final state computed inside the
chunk) would compile to other fused code, whose rounding may differ in the last bit. `delta_rule` runs a whole
prompt chunk by chunk and updates the state with one matmul per chunk (fast, not bit-tied to `delta_chunk`).

`causal_conv` is the depthwise causal conv + SiLU in front of the mixer (Hugging Face `causal_conv1d_fn` /
`causal_conv1d_update`); `conv_state_at` selects its state after any prefix of a block.

`delta_chunk(..., impl="pallas")` runs one block in a Pallas kernel (Triton lowering, as the other kernels here):
one program per (row, value head, `DV_TILE` value channels) computes the scores, the system, its inverse, u and the
outputs on chip. XLA's form of the same block is a dozen small kernels per layer (batched triangular solve,
transposes, small einsums), which made the 9B-shaped hybrid's verify 1.45 plain steps on the H200
(bench/results/profile_round_qwen3.5-9b.json). The inverse of the unit lower-triangular I + A (A strictly lower, so
nilpotent) is the product (I - A)(I + A^2)(I + A^4)...: log2(C) small matmuls instead of C dependent row steps.
Zero entries stay exact zeros through it, so the masking property holds for the kernel too. `impl="xla"` is the
jnp reference and the CPU default.
"""
from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.mesh import per_device
from pallas_kernels.windowed_attention import _triton_compiler_params, where_lowered

IMPLS = ("xla", "pallas")
DV_TILE = 64
"""Value channels per program: the state tile [dk, DV_TILE] float32 stays in registers."""
NUM_WARPS = 4

F32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST
"""Every product here is float32: full float32 (a GPU would round it through TF32 by default)."""


def delta_chunk(state, q, k, v, g, beta, *, impl: str = "xla", interpret: bool | None = None):
    """C positions in the parallel form from `state`. Returns `(out f32[B, C, H, dv], u f32[B, C, H, dv])`: the
    outputs, and the updates from which `state_at(state, k, u, g, n)` gives the state after any n positions.
    `impl="pallas"` runs the kernel (module docstring; a single position takes the jnp form, which has no
    system to solve), per device on its heads and rows under a mesh (`mesh.per_device`); `interpret` as in
    `block_attention`."""
    _check_delta("delta_chunk", state, q, k, v, g, beta)
    if impl not in IMPLS:
        raise ValueError(f"delta_chunk: impl={impl!r} is not supported; choose one of {IMPLS}.")
    state, q, k, v, g, beta = (x.astype(F32) for x in (state, q, k, v, g, beta))
    if impl == "xla" or q.shape[1] == 1:
        out, u, _ = _chunk(state, q, k, v, g, beta)
        return out, u
    args = (state, q, k, v, jnp.cumsum(g, axis=1), beta)
    heads = (0, 2)  # [B, C, H, .]: every head is its own recurrence
    return per_device(where_lowered(_chunk_pallas, interpret), args, ((0, 1),) + (heads,) * 5, (heads, heads))


def _chunk_kernel(s_ref, q_ref, k_ref, v_ref, gc_ref, beta_ref, o_ref, u_ref, *, squarings):
    """One (row, head, value tile): the block's outputs and updates from the state tile, all on chip."""
    dot = functools.partial(lax.dot_general, precision=HIGHEST, preferred_element_type=F32)
    mm = functools.partial(dot, dimension_numbers=(((1,), (0,)), ((), ())))
    q, k, s0 = q_ref[...], k_ref[...], s_ref[...]
    gc, beta = gc_ref[...], beta_ref[...]
    c = q.shape[0]
    i = lax.broadcasted_iota(jnp.int32, (c, c), 0)
    j = lax.broadcasted_iota(jnp.int32, (c, c), 1)
    decay = jnp.exp(jnp.where(j <= i, gc[:, None] - gc[None, :], -jnp.inf))
    scores = dot(q, k, (((1,), (1,)), ((), ()))) * decay
    a = jnp.where(j < i, dot(k, k, (((1,), (1,)), ((), ()))) * decay * beta[:, None], 0.0)
    eye = jnp.where(i == j, 1.0, 0.0).astype(F32)
    inverse, power = eye - a, a
    for _ in range(squarings):  # (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...: A^C = 0
        power = mm(power, power)
        inverse = mm(inverse, eye + power)
    g_exp = jnp.exp(gc)[:, None]
    rhs = beta[:, None] * v_ref[...] - g_exp * mm(k * beta[:, None], s0)
    u = mm(inverse, rhs)
    u_ref[...] = u
    o_ref[...] = g_exp * mm(q, s0) + mm(scores, u)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """`x / sqrt(sum(x^2) + eps)` over the last axis, as the reference kernels compute it (the layer's q and k)."""
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def step_takes(conv_dim: int, key_heads: int, state_shape: tuple, kernel_size: int) -> bool:
    """Whether `delta_step` takes a layer: power-of-two key and value head widths and conv kernel (Triton's tiles),
    and q|k|v channels that split into whole key heads and value tiles."""
    _, heads, dk, dv = state_shape
    dt = min(DV_TILE, dv)
    pow2 = all(n >= 1 and n & (n - 1) == 0 for n in (dk, dv, kernel_size))
    return (pow2 and heads % key_heads == 0 and conv_dim == 2 * key_heads * dk + heads * dv
            and (2 * key_heads * dk) % dt == 0)


def delta_step(window, conv_weight, g, beta, state, *, key_heads: int, dtype, interpret: bool | None = None):
    """One position of a Gated DeltaNet layer in one kernel, from the conv window to the delta rule's output: the
    causal conv and SiLU of q|k|v (rounded to `dtype`, as `causal_conv` returns them), L2-normalised q (scaled by
    dk**-0.5) and k, and the recurrence of `delta_chunk` at one position, S^T k and S^T q read from the state tile.
    window `[B, K, conv_dim]` (the K-1 inputs before the position, then its own; conv_dim = 2 * key_heads * dk + H * dv,
    q|k|v); conv_weight `[conv_dim, 1, K]`; g, beta float32 `[B, 1, H]`; state float32 `[B, H, dk, dv]`. Returns
    `(out, u, k)` float32 `[B, 1, H, dv]`, `[B, 1, H, dv]` and `[B, 1, H, dk]` (k repeated to the value heads), what
    the jnp path (`causal_conv`, the normalisation, `delta_chunk`) gives a decode step, to float32 rounding. Where
    XLA makes about ten kernels of that, this is one program per (row, value head, `DV_TILE` value channels)."""
    kernel_size, conv_dim = window.shape[1], window.shape[2]
    if not step_takes(conv_dim, key_heads, state.shape, kernel_size):
        raise ValueError(f"delta_step: window {window.shape} with {key_heads} key heads and state {state.shape} does "
                         f"not fit the kernel: dk, dv and the conv kernel must be powers of two and conv_dim "
                         f"= 2 * key_heads * dk + H * dv.")
    call = functools.partial(_step_pallas, key_heads=key_heads, dtype=jnp.dtype(dtype))
    return where_lowered(call, interpret)(window, conv_weight, g.astype(F32), beta.astype(F32), state.astype(F32))


def _step_kernel(wq_ref, wk_ref, wv_ref, cq_ref, ck_ref, cv_ref, g_ref, beta_ref, s_ref, o_ref, u_ref, k_ref, *,
                 dtype, scale):
    """One (row, value head, value tile): conv, SiLU and norms of its q, k and v channels, then one delta step."""

    def conv(win_ref, w_ref):  # the taps in causal_conv's order, oldest input first
        y = 0
        for o in range(win_ref.shape[0]):
            y = y + w_ref[:, o].astype(F32) * win_ref[o, :].astype(F32)
        return jax.nn.silu(y).astype(dtype).astype(F32)

    q, k = l2_normalize(conv(wq_ref, cq_ref)) * scale, l2_normalize(conv(wk_ref, ck_ref))
    v = conv(wv_ref, cv_ref)
    s = s_ref[...]
    g_exp, beta = jnp.exp(g_ref[()]), beta_ref[()]
    u = beta * v - g_exp * jnp.sum((k * beta)[:, None] * s, axis=0)
    o_ref[...] = g_exp * jnp.sum(q[:, None] * s, axis=0) + jnp.sum(q * k) * u
    u_ref[...] = u
    k_ref[...] = k  # every value tile of the head writes the same k


def _step_pallas(window, conv_weight, g, beta, state, *, key_heads, dtype, interpret):
    b, heads, dk, dv = state.shape
    kernel_size = window.shape[1]
    dt = min(DV_TILE, dv)
    rep, v_first, v_tiles = heads // key_heads, 2 * key_heads * dk // dt, dv // dt

    def channels(width, block):
        return (pl.BlockSpec((None, kernel_size, width), lambda r, h, t: (r, 0, block(h, t))),
                pl.BlockSpec((width, None, kernel_size), lambda r, h, t: (block(h, t), 0, 0)))

    (wq, cq), (wk, ck), (wv, cv) = (channels(dk, lambda h, t: h // rep),
                                    channels(dk, lambda h, t: key_heads + h // rep),
                                    channels(dt, lambda h, t: v_first + h * v_tiles + t))
    gate = pl.BlockSpec((None, None, None), lambda r, h, t: (r, 0, h))
    values = pl.BlockSpec((None, None, None, dt), lambda r, h, t: (r, 0, h, t))
    out, u, k = pl.pallas_call(
        functools.partial(_step_kernel, dtype=dtype, scale=dk ** -0.5),
        grid=(b, heads, v_tiles),
        in_specs=[wq, wk, wv, cq, ck, cv, gate, gate,
                  pl.BlockSpec((None, None, dk, dt), lambda r, h, t: (r, h, 0, t))],
        out_specs=[values, values, pl.BlockSpec((None, None, None, dk), lambda r, h, t: (r, 0, h, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, 1, heads, dv), F32)] * 2 + [jax.ShapeDtypeStruct((b, 1, heads, dk), F32)],
        compiler_params=_triton_compiler_params(NUM_WARPS, 1),
        interpret=interpret,
        name="delta_step",
    )(window, window, window, conv_weight, conv_weight, conv_weight, g, beta, state)
    return out, u, k


def _chunk_pallas(state, q, k, v, gcum, beta, *, interpret):
    """Pad C to a power of two >= 16 (padded rows: beta = 0, so u = 0, and no earlier row reads them; the cumulative
    decay carried on), dk with zeros to one as well, and dv to the value tile; run the grid; crop."""
    b, c, h, dk = q.shape
    dv = v.shape[-1]
    cp, dkp = max(16, pl.next_power_of_2(c)), max(16, pl.next_power_of_2(dk))
    dt = min(DV_TILE, max(16, pl.next_power_of_2(dv)))
    dvp = -(-dv // dt) * dt

    def pad(x, sizes, mode="constant"):
        return jnp.pad(x, [(0, size - n) for n, size in zip(x.shape, sizes)], mode=mode)

    q, k = (pad(x, (b, cp, h, dkp)) for x in (q, k))
    v, state = pad(v, (b, cp, h, dvp)), pad(state, (b, h, dkp, dvp))
    gcum, beta = pad(gcum, (b, cp, h), mode="edge"), pad(beta, (b, cp, h))
    keys = pl.BlockSpec((None, cp, None, dkp), lambda r, hh, t: (r, 0, hh, 0))
    values = pl.BlockSpec((None, cp, None, dt), lambda r, hh, t: (r, 0, hh, t))
    per_position = pl.BlockSpec((None, cp, None), lambda r, hh, t: (r, 0, hh))
    out, u = pl.pallas_call(
        functools.partial(_chunk_kernel, squarings=cp.bit_length() - 2),
        grid=(b, h, dvp // dt),
        in_specs=[pl.BlockSpec((None, None, dkp, dt), lambda r, hh, t: (r, hh, 0, t)), keys, keys, values,
                  per_position, per_position],
        out_specs=[values, values],
        out_shape=[jax.ShapeDtypeStruct((b, cp, h, dvp), F32)] * 2,
        compiler_params=_triton_compiler_params(NUM_WARPS, 1),
        interpret=interpret,
        name="delta_chunk",
    )(state, q, k, v, gcum, beta)
    return out[:, :c, :, :dv], u[:, :c, :, :dv]


def state_at(state, k, u, g, n):
    """Per row, the state after the first `n[b]` positions of a block: `state [B, H, dk, dv]` (before it) with the
    updates `S = exp(g_i) S + k_i u_i^T` of positions i < n[b] applied in order. k: [B, C, H, dk]; u: `delta_chunk`'s
    [B, C, H, dv]; g: [B, C, H]; n: int[B] in 0..C. The C steps are unrolled so that XLA fuses them into one pass."""
    b, c = u.shape[:2]
    n = jnp.asarray(n)
    if n.shape != (b,) or not jnp.issubdtype(n.dtype, jnp.integer) or k.shape[:2] != (b, c) or g.shape[:2] != (b, c):
        raise ValueError(f"state_at: expected k [B, C, H, dk], u [B, C, H, dv], g [B, C, H] and integer n [B]; got "
                         f"k {k.shape}, u {u.shape}, g {g.shape}, n {n.dtype}{list(n.shape)}.")
    # decays and updates materialised first: fused into the fold, their producers (exp, an L2 norm) would run once
    # per state entry and position (33M exps a layer at the 9B shape)
    k, u, decay = lax.optimization_barrier((k.astype(F32), u, jnp.exp(g.astype(F32))))
    s = state.astype(F32)
    for i in range(c):
        step = decay[:, i][..., None, None] * s + k[:, i, :, :, None] * u[:, i, :, None, :]
        s = jnp.where((i < n)[:, None, None, None], step, s)
    return s


def delta_rule(state, q, k, v, g, beta, *, chunk: int = 64):
    """A whole sequence of any length T as a scan over chunks of `min(chunk, T)` positions (the tail padded with
    beta = 0, g = 0, which leaves the state unchanged): memory bounded by one chunk. Returns
    `(out f32[B, T, H, dv], final state f32[B, H, dk, dv])`."""
    _check_delta("delta_rule", state, q, k, v, g, beta)
    if isinstance(chunk, bool) or not isinstance(chunk, numbers.Integral) or chunk < 1:
        raise ValueError(f"delta_rule: chunk={chunk!r} must be a positive int.")
    b, t, h, _ = q.shape
    c = min(int(chunk), t)
    n = -(-t // c)

    def chunks(x):
        x = jnp.pad(x.astype(F32), [(0, 0), (0, n * c - t)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(b, n, c, *x.shape[2:]), 1, 0)

    def step(s, x):
        q_c, k_c, v_c, g_c, beta_c = x
        out_c, u, gcum = _chunk(s, q_c, k_c, v_c, g_c, beta_c)
        last = gcum[..., -1:]  # [B, H, 1]
        k_decayed = k_c * jnp.moveaxis(jnp.exp(last - gcum), 1, 2)[..., None]
        s = jnp.exp(last)[..., None] * s + jnp.einsum("bchk,bchv->bhkv", k_decayed, u, precision=HIGHEST)
        return s, out_c

    final, out = lax.scan(step, state.astype(F32), tuple(chunks(x) for x in (q, k, v, g, beta)))
    return jnp.moveaxis(out, 0, 1).reshape(b, n * c, h, -1)[:, :t], final


def _chunk(state, q, k, v, g, beta):
    """Float32 UT form of one chunk from state S0: returns `(out [B, C, H, dv], u [B, C, H, dv], G [B, H, C])`,
    the outputs, the per-position updates and the cumulative log-decay. Row i reads only rows <= i, and a row with
    beta = 0 gets u = 0 exactly."""
    c = q.shape[1]
    gcum = jnp.moveaxis(jnp.cumsum(g, axis=1), 1, 2)  # [B, H, C]
    seen = jnp.tril(jnp.ones((c, c), bool))
    decay = jnp.exp(jnp.where(seen, gcum[..., :, None] - gcum[..., None, :], -jnp.inf))  # [B, H, i, j]
    p = HIGHEST
    scores = jnp.einsum("bihk,bjhk->bhij", q, k, precision=p) * decay
    a = jnp.einsum("bihk,bjhk->bhij", k, k, precision=p) * decay * jnp.moveaxis(beta, 1, 2)[..., None]
    g_exp = jnp.exp(gcum)[..., None]  # [B, H, C, 1]
    rhs = jnp.moveaxis(beta[..., None] * v, 1, 2) - g_exp * jnp.einsum("bchk,bhkv->bhcv", k * beta[..., None],
                                                                        state, precision=p)
    if c == 1:  # one position: the unit-diagonal system is the identity (a decode step skips the solve)
        u = rhs
    else:
        u = jax.scipy.linalg.solve_triangular(jnp.where(seen, a, 0.0), rhs, lower=True, unit_diagonal=True)
    out = g_exp * jnp.einsum("bchk,bhkv->bhcv", q, state, precision=p) + jnp.einsum("bhij,bhjv->bhiv", scores, u,
                                                                                  precision=p)
    return jnp.moveaxis(out, 2, 1), jnp.moveaxis(u, 2, 1), gcum


def causal_conv(x, conv_state, weight):
    """Depthwise causal conv of a block, then SiLU. x: [B, W, C]; conv_state: [B, K-1, C], the K-1 inputs before
    the block, oldest first, in x.dtype; weight: [C, 1, K] (Hugging Face's `conv1d.weight`, no bias). Computed in
    float32. Returns `(y [B, W, C] in x.dtype, window [B, K-1+W, C])`: window = concat(conv_state, x), and the
    state after position i is window[:, i+1 : i+K] (`conv_state_at`)."""
    _check_conv(x, conv_state, weight)
    w = x.shape[1]
    window = jnp.concatenate([conv_state, x], axis=1)
    taps = weight[:, 0, :].astype(F32)  # [C, K]
    wide = window.astype(F32)
    y = sum(taps[:, o] * wide[:, o:o + w] for o in range(taps.shape[1]))
    return jax.nn.silu(y).astype(x.dtype), window


def conv_state_at(window, n, *, kernel_size: int):
    """The conv state after the first n[b] positions of a block: window[b, n[b] : n[b] + K-1], [B, K-1, C].
    window: `causal_conv`'s [B, K-1+W, C]; n: int[B] in 0..W (lax.dynamic_slice clamps values outside)."""
    n = jnp.asarray(n)
    if isinstance(kernel_size, bool) or not isinstance(kernel_size, numbers.Integral) or kernel_size < 1:
        raise ValueError(f"conv_state_at: kernel_size={kernel_size!r} must be a positive int.")
    if window.ndim != 3 or window.shape[1] < kernel_size:
        raise ValueError(f"conv_state_at: window has shape {window.shape}; expected [B, K-1+W, C] with "
                         f"W >= 1 for kernel_size K = {kernel_size}.")
    if n.shape != window.shape[:1] or not jnp.issubdtype(n.dtype, jnp.integer):
        raise ValueError(f"conv_state_at: n must be an integer array of shape ({window.shape[0]},); "
                         f"got {n.dtype}{list(n.shape)}.")
    take = jax.vmap(lambda row, start: lax.dynamic_slice_in_dim(row, start, kernel_size - 1, axis=0))
    return take(window, n.astype(jnp.int32))


def _check_delta(fn, state, q, k, v, g, beta) -> None:
    """Refuse bad shapes and dtypes here, with a sentence, instead of deep inside XLA."""
    arrays = {"state": state, "q": q, "k": k, "v": v, "g": g, "beta": beta}
    layout = {"state": "[B, H, dk, dv]", "q": "[B, C, H, dk]", "k": "[B, C, H, dk]", "v": "[B, C, H, dv]",
              "g": "[B, C, H]", "beta": "[B, C, H]"}
    _check_floating(fn, arrays, layout)
    if 0 in q.shape or 0 in v.shape:
        raise ValueError(f"{fn}: q {q.shape} and v {v.shape} must have every axis non-empty.")
    b, c, h, dk = q.shape
    dv = v.shape[-1]
    expected = {"state": (b, h, dk, dv), "k": (b, c, h, dk), "v": (b, c, h, dv), "g": (b, c, h), "beta": (b, c, h)}
    for name, shape in expected.items():
        if arrays[name].shape != shape:
            raise ValueError(f"{fn}: {name} has shape {arrays[name].shape}; expected {shape} ({layout[name]}) "
                             f"from q {q.shape} and v {v.shape}.")


def _check_conv(x, conv_state, weight) -> None:
    """Refuse bad shapes and dtypes here, with a sentence, instead of deep inside XLA."""
    _check_floating("causal_conv", {"x": x, "conv_state": conv_state, "weight": weight},
                    {"x": "[B, W, C]", "conv_state": "[B, K-1, C]", "weight": "[C, 1, K]"})
    b, w, c = x.shape
    if min(b, w, c) == 0:
        raise ValueError(f"causal_conv: x has shape {x.shape}; every axis must be non-empty.")
    if weight.shape[:2] != (c, 1) or weight.shape[2] == 0:
        raise ValueError(f"causal_conv: weight has shape {weight.shape}; expected [{c}, 1, K] with K >= 1 "
                         f"for x {x.shape}.")
    expected = (b, weight.shape[2] - 1, c)
    if conv_state.shape != expected:
        raise ValueError(f"causal_conv: conv_state has shape {conv_state.shape}; expected {expected} "
                         f"([B, K-1, C]) from x {x.shape} and weight {weight.shape}.")
    if conv_state.dtype != x.dtype:
        raise ValueError(f"causal_conv: conv_state has dtype {conv_state.dtype}; expected x's {x.dtype} "
                         f"(the window joins them).")


def _check_floating(fn, arrays: dict, layout: dict) -> None:
    """Each named array has the rank of its layout (e.g. "[B, C, H]") and a floating dtype."""
    for name, x in arrays.items():
        if x.ndim != layout[name].count(",") + 1:
            raise ValueError(f"{fn}: {name} has shape {x.shape}; expected {layout[name]}.")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{fn}: {name} has dtype {x.dtype}; expected a floating dtype.")
