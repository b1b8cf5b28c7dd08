"""gated_delta: the chunked Gated DeltaNet and the causal conv against float64 numpy loops over the recurrence,
against Hugging Face's own torch functions, and the masking property commit relies on, bit for bit."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gated_delta import causal_conv, conv_state_at, delta_chunk, delta_rule, state_at

chunk_jit = jax.jit(delta_chunk, static_argnames="impl")
fold_jit = jax.jit(state_at)
rule_jit = jax.jit(delta_rule, static_argnames="chunk")
conv_jit = jax.jit(causal_conv)
state_at_jit = jax.jit(conv_state_at, static_argnames="kernel_size")


def loop_delta(state, q, k, v, g, beta):
    """float64 recurrence: S = exp(g) S; u = beta (v - S^T k); S += k u^T; o = S^T q. Returns (out, states)."""
    s, q, k, v, g, beta = (np.asarray(x, np.float64) for x in (state, q, k, v, g, beta))
    outs, states = [], []
    for t in range(q.shape[1]):
        s = s * np.exp(g[:, t])[..., None, None]
        u = beta[:, t, :, None] * (v[:, t] - np.einsum("bhkv,bhk->bhv", s, k[:, t]))
        s = s + k[:, t, :, :, None] * u[:, :, None, :]
        outs.append(np.einsum("bhkv,bhk->bhv", s, q[:, t]))
        states.append(s)
    return np.stack(outs, 1), np.stack(states, 1)


def loop_conv(x, conv_state, weight):
    """float64 depthwise causal conv + SiLU, one output position at a time."""
    x, conv_state, weight = (np.asarray(a, np.float64) for a in (x, conv_state, weight))
    window = np.concatenate([conv_state, x], axis=1)
    taps = weight.shape[2]
    y = np.stack([np.einsum("bkc,ck->bc", window[:, t:t + taps], weight[:, 0]) for t in range(x.shape[1])], 1)
    return y / (1 + np.exp(-y))


def delta_inputs(seed, b, t, h, dk, dv, dtype=jnp.float32):
    """state, q, k, v, g, beta: q and k L2-normalised (q also scaled by dk**-0.5), g in [-1, 0], beta in [0, 1]."""
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal((b, t, h, dk)) for _ in range(2))
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) * dk ** -0.5
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    arrays = (rng.standard_normal((b, h, dk, dv)), q, k, rng.standard_normal((b, t, h, dv)),
              -rng.uniform(0, 1, (b, t, h)), rng.uniform(0, 1, (b, t, h)))
    return [jnp.asarray(a, jnp.float32).astype(dtype) for a in arrays]


def torch_paths(*fns):
    """transformers' torch functions themselves where a hub-kernel decorator wraps them (`__wrapped__`); transformers
    5.25 wraps some in a module without it, which on CPU tensors runs the same torch path."""
    return tuple(getattr(f, "__wrapped__", f) for f in fns)


def rel_err(got, want) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))


def states_of(state, k, u, g):
    """The state after every position `[B, C, ...]`, each folded by `state_at` (as a commit keeping n would)."""
    b, c = u.shape[:2]
    return jnp.stack([fold_jit(state, k, u, g, jnp.full((b,), n, jnp.int32)) for n in range(1, c + 1)], 1)


@pytest.mark.parametrize("b,c,h,dk,dv", [(2, 1, 3, 8, 4), (2, 16, 2, 8, 16), (1, 64, 2, 16, 8)],
                         ids=["C1", "C16", "C64"])
def test_delta_chunk_matches_loop(b, c, h, dk, dv):
    inputs = delta_inputs(c, b, c, h, dk, dv)
    want_out, want_states = loop_delta(*inputs)
    out, u = chunk_jit(*inputs)
    assert out.dtype == u.dtype == jnp.float32
    assert u.shape == (b, c, h, dv)
    states = states_of(inputs[0], inputs[2], u, inputs[4])
    assert rel_err(out, want_out) < 1e-5
    assert rel_err(states, want_states) < 1e-5
    np.testing.assert_array_equal(fold_jit(inputs[0], inputs[2], u, inputs[4], jnp.zeros((b,), jnp.int32)),
                                  inputs[0])


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("c", [16, 64])
def test_masking_is_bit_exact(c, impl):
    """Positions >= n[b] masked (beta = 0, g = 0, and fresh q, k, v there): the outputs and updates before n are
    the unmasked ones bit for bit, the masked updates are exact zeros, and so the state folded to n from either is
    the same to the last bit (what the replay oracle of a commit relies on)."""
    n = np.array([0, 1, c // 2 + 1, c])
    inputs = delta_inputs(1, 4, c, 2, 8, 8)
    state, q, k, v, g, beta = inputs
    other = delta_inputs(2, 4, c, 2, 8, 8)
    late = jnp.asarray(np.arange(c)[None, :, None] >= n[:, None, None])  # [B, C, 1]
    masked = [state] + [jnp.where(late[..., None], b_, a_) for a_, b_ in zip((q, k, v), other[1:4])]
    masked += [jnp.where(late, 0.0, g), jnp.where(late, 0.0, beta)]
    out, u = chunk_jit(*inputs, impl=impl)
    m_out, m_u = chunk_jit(*masked, impl=impl)
    final = fold_jit(state, k, u, g, jnp.asarray(n))
    m_final = fold_jit(state, masked[2], m_u, masked[4], jnp.asarray(n))
    want = loop_delta(*inputs)[1]
    for row, n_row in enumerate(n):
        assert np.array_equal(m_out[row, :n_row], out[row, :n_row])
        assert np.array_equal(m_u[row, :n_row], u[row, :n_row])
        assert not np.any(np.asarray(m_u[row, n_row:])), "a masked position's update must be an exact zero"
        assert np.array_equal(m_final[row], final[row])
        before = np.asarray(state[row]) if n_row == 0 else want[row, n_row - 1]
        np.testing.assert_allclose(final[row], before, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("b,c,h,dk,dv", [(2, 16, 2, 8, 16), (1, 5, 3, 16, 8), (1, 33, 2, 8, 24), (1, 16, 1, 128, 128)],
                         ids=["verify", "short-padded", "two-powers-padded", "9b-head"])
def test_kernel_matches_the_reference(b, c, h, dk, dv):
    """The Pallas block (interpreted) against the jnp form: padding of C, dk and dv, and a full-size head."""
    inputs = delta_inputs(7, b, c, h, dk, dv)
    out, u = chunk_jit(*inputs, impl="pallas")
    want_out, want_u = chunk_jit(*inputs)
    assert out.shape == want_out.shape and u.shape == want_u.shape
    assert rel_err(out, np.asarray(want_out, np.float64)) < 1e-5
    assert rel_err(u, np.asarray(want_u, np.float64)) < 1e-5
    assert rel_err(out, loop_delta(*inputs)[0]) < 1e-5


def test_delta_rule_matches_loop_and_chunk():
    inputs = delta_inputs(3, 2, 37, 2, 8, 4)
    want_out, want_states = loop_delta(*inputs)
    whole_out, whole_u = chunk_jit(*inputs)
    whole_final = fold_jit(inputs[0], inputs[2], whole_u, inputs[4], jnp.full((2,), 37, jnp.int32))
    for chunk in (16, 64):  # 37 = 2 * 16 + 5 (padded tail), and one chunk of min(64, 37)
        out, final = rule_jit(*inputs, chunk=chunk)
        assert out.shape == want_out.shape and final.shape == want_states[:, -1].shape
        assert rel_err(out, want_out) < 1e-5
        assert rel_err(final, want_states[:, -1]) < 1e-5
        np.testing.assert_allclose(out, whole_out, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(final, whole_final, rtol=1e-5, atol=1e-5)


def test_delta_rule_split_prompt_threads_state():
    """Two calls of 17 positions (each ending in a padded chunk) with the state threaded equal one call of 34."""
    state, q, k, v, g, beta = delta_inputs(4, 2, 34, 2, 8, 4)
    out, final = rule_jit(state, q, k, v, g, beta, chunk=8)
    out1, s1 = rule_jit(state, *(x[:, :17] for x in (q, k, v, g, beta)), chunk=8)
    out2, s2 = rule_jit(s1, *(x[:, 17:] for x in (q, k, v, g, beta)), chunk=8)
    np.testing.assert_allclose(np.concatenate([out1, out2], axis=1), out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(s2, final, rtol=1e-5, atol=1e-6)


def test_matches_transformers_gated_delta():
    """An external oracle: Hugging Face's torch chunked and recurrent rules, with grouped key heads (repeated
    here as the caller does) and q normalised but not scaled (Hugging Face scales it by dk**-0.5 inside)."""
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    rng = np.random.default_rng(5)
    b, t, hk, hv, dk, dv = 2, 20, 2, 4, 16, 8
    q, k = (rng.standard_normal((b, t, hk, dk)).astype(np.float32) for _ in range(2))
    q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
    v = rng.standard_normal((b, t, hv, dv)).astype(np.float32)
    g = -rng.uniform(0, 1, (b, t, hv)).astype(np.float32)
    beta = rng.uniform(0, 1, (b, t, hv)).astype(np.float32)
    state = rng.standard_normal((b, hv, dk, dv)).astype(np.float32)
    torch_args = [torch.from_numpy(x) for x in (q, k, v, g, beta)]
    options = dict(initial_state=torch.from_numpy(state), output_final_state=True, use_qk_l2norm_in_kernel=False)
    chunk_rule, loop_rule = torch_paths(hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule)
    hf_chunk = chunk_rule(*torch_args, chunk_size=8, **options)
    hf_loop = loop_rule(*torch_args, **options)

    ours = (jnp.asarray(state), jnp.asarray(np.repeat(q, hv // hk, axis=2) * dk ** -0.5),
            jnp.asarray(np.repeat(k, hv // hk, axis=2)), *(jnp.asarray(x) for x in (v, g, beta)))
    out_rule, final_rule = rule_jit(*ours, chunk=8)
    out_chunk, u = chunk_jit(*ours)
    final_chunk = fold_jit(ours[0], ours[2], u, ours[4], jnp.full((b,), t, jnp.int32))
    for want_out, want_final in (hf_chunk, hf_loop):
        for out, final in ((out_rule, final_rule), (out_chunk, final_chunk)):
            np.testing.assert_allclose(out, want_out.numpy(), rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(final, want_final.numpy(), rtol=1e-4, atol=1e-5)


def conv_inputs(seed, b, w, c, taps, dtype=jnp.float32):
    """x [B, W, C], conv_state [B, K-1, C], weight [C, 1, K]."""
    rng = np.random.default_rng(seed)
    shapes = [(b, w, c), (b, taps - 1, c), (c, 1, taps)]
    return [jnp.asarray(rng.standard_normal(s), jnp.float32).astype(dtype) for s in shapes]


@pytest.mark.parametrize("taps", [1, 4])
def test_causal_conv_matches_loop(taps):
    x, conv_state, weight = conv_inputs(6, 2, 5, 6, taps)
    y, window = conv_jit(x, conv_state, weight)
    assert y.dtype == x.dtype and y.shape == x.shape
    np.testing.assert_allclose(y, loop_conv(x, conv_state, weight), rtol=1e-6, atol=1e-6)
    assert np.array_equal(window, np.concatenate([conv_state, x], axis=1))
    full = np.concatenate([conv_state, x], axis=1)
    for n in range(x.shape[1] + 1):
        got = state_at_jit(window, jnp.full((2,), n, jnp.int32), kernel_size=taps)
        assert np.array_equal(got, full[:, n:n + taps - 1])  # the last K-1 inputs after n positions
    mixed = state_at_jit(window, jnp.array([0, 5]), kernel_size=taps)
    assert np.array_equal(mixed[0], conv_state[0]) and np.array_equal(mixed[1], full[1, 5:5 + taps - 1])


def test_causal_conv_threads_the_window_across_blocks():
    x, conv_state, weight = conv_inputs(7, 2, 7, 6, 4)
    y, _ = conv_jit(x, conv_state, weight)
    y1, window1 = conv_jit(x[:, :3], conv_state, weight)
    y2, _ = conv_jit(x[:, 3:], state_at_jit(window1, jnp.full((2,), 3), kernel_size=4), weight)
    assert np.array_equal(np.concatenate([y1, y2], axis=1), y)


def test_causal_conv_matches_transformers():
    """External oracle: Hugging Face's torch causal_conv1d_fn (zero history) and causal_conv1d_update (a K-wide
    state whose oldest column no output reads, updated in place to the state after the block)."""
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    conv_fn, conv_update = torch_paths(hf.causal_conv1d_fn, hf.causal_conv1d_update)
    x, conv_state, weight = (np.array(a) for a in conv_inputs(8, 2, 5, 6, 4))
    channels_first = torch.from_numpy(x.transpose(0, 2, 1).copy())
    fresh = conv_fn(channels_first, torch.from_numpy(weight[:, 0]), activation="silu")
    y, _ = causal_conv(jnp.asarray(x), jnp.zeros_like(conv_state), jnp.asarray(weight))
    np.testing.assert_allclose(y, fresh.numpy().transpose(0, 2, 1), rtol=1e-5, atol=1e-6)
    hf_state = torch.from_numpy(np.concatenate([np.ones_like(conv_state[:, :1]), conv_state], 1).transpose(0, 2, 1)
                                .copy())
    updated = conv_update(channels_first, hf_state, torch.from_numpy(weight[:, 0]), activation="silu")
    y, window = causal_conv(jnp.asarray(x), jnp.asarray(conv_state), jnp.asarray(weight))
    np.testing.assert_allclose(y, updated.numpy().transpose(0, 2, 1), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(conv_state_at(window, jnp.full((2,), 5), kernel_size=4),
                                  hf_state.numpy().transpose(0, 2, 1)[:, 1:])


def test_bf16_inputs_run_in_float32():
    """bf16 inputs are upcast: float32 results, as exact as float32 inputs on the same values."""
    inputs = delta_inputs(9, 1, 16, 2, 8, 8, dtype=jnp.bfloat16)
    want_out, want_states = loop_delta(*(np.asarray(x, np.float32) for x in inputs))
    out, u = chunk_jit(*inputs)
    states = states_of(inputs[0], inputs[2], u, inputs[4])
    out_rule, final = rule_jit(*inputs, chunk=8)
    for got, want in ((out, want_out), (states, want_states), (out_rule, want_out), (final, want_states[:, -1])):
        assert got.dtype == jnp.float32 and np.isfinite(np.asarray(got)).all()
        assert rel_err(got, want) < 1e-5
    x, conv_state, weight = conv_inputs(10, 1, 4, 6, 4, dtype=jnp.bfloat16)
    y, window = conv_jit(x, conv_state, weight)
    assert y.dtype == window.dtype == jnp.bfloat16 and np.isfinite(np.asarray(y, np.float32)).all()
    want = loop_conv(*(np.asarray(a, np.float32) for a in (x, conv_state, weight)))
    np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=1e-2, atol=1e-2)


def _bad_delta(**changes):
    names = ("state", "q", "k", "v", "g", "beta")
    arrays = dict(zip(names, delta_inputs(0, 1, 2, 2, 4, 3)))
    arrays.update(changes)
    return arrays


@pytest.mark.parametrize("changes,match", [
    (dict(q=jnp.zeros((1, 2, 2))), r"q has shape \(1, 2, 2\); expected \[B, C, H, dk\]"),
    (dict(g=jnp.zeros((1, 2, 2), jnp.int32)), "g has dtype int32; expected a floating dtype"),
    (dict(k=jnp.zeros((1, 2, 2, 5))), r"k has shape \(1, 2, 2, 5\); expected \(1, 2, 2, 4\)"),
    (dict(state=jnp.zeros((1, 2, 3, 4))), r"state has shape \(1, 2, 3, 4\); expected \(1, 2, 4, 3\)"),
    (dict(beta=jnp.zeros((1, 2, 3))), r"beta has shape \(1, 2, 3\); expected \(1, 2, 2\)"),
    (dict(q=jnp.zeros((1, 0, 2, 4))), "must have every axis non-empty"),
])
def test_delta_refuses_bad_inputs(changes, match):
    for fn, kwargs in ((delta_chunk, {}), (delta_rule, {})):
        with pytest.raises(ValueError, match=match):
            fn(**_bad_delta(**changes), **kwargs)


def test_delta_chunk_refuses_a_bad_impl_and_state_at_bad_lengths():
    with pytest.raises(ValueError, match=r"impl='triton' is not supported; choose one of \('xla', 'pallas'\)"):
        delta_chunk(**_bad_delta(), impl="triton")
    state, q, k, v, g, beta = delta_inputs(0, 2, 4, 2, 8, 8)
    _, u = delta_chunk(state, q, k, v, g, beta)
    for n in (jnp.zeros((3,), jnp.int32), jnp.zeros((2,), jnp.float32)):
        with pytest.raises(ValueError, match=r"state_at: expected .* integer n \[B\]"):
            state_at(state, k, u, g, n)


@pytest.mark.parametrize("chunk", [0, -3, 2.5, True])
def test_delta_rule_refuses_bad_chunk(chunk):
    with pytest.raises(ValueError, match=f"delta_rule: chunk={chunk!r} must be a positive int"):
        delta_rule(**_bad_delta(), chunk=chunk)


@pytest.mark.parametrize("which,value,match", [
    ("x", jnp.zeros((2, 5)), r"x has shape \(2, 5\); expected \[B, W, C\]"),
    ("x", jnp.zeros((2, 0, 6)), "every axis must be non-empty"),
    ("weight", jnp.zeros((6, 4)), r"weight has shape \(6, 4\); expected \[C, 1, K\]"),
    ("weight", jnp.zeros((5, 1, 4)), r"weight has shape \(5, 1, 4\); expected \[6, 1, K\]"),
    ("conv_state", jnp.zeros((2, 2, 6)), r"conv_state has shape \(2, 2, 6\); expected \(2, 3, 6\)"),
    ("conv_state", jnp.zeros((2, 3, 6), jnp.bfloat16), "conv_state has dtype bfloat16; expected x's float32"),
    ("x", jnp.zeros((2, 5, 6), jnp.int32), "x has dtype int32; expected a floating dtype"),
])
def test_causal_conv_refuses_bad_inputs(which, value, match):
    arrays = dict(zip(("x", "conv_state", "weight"), conv_inputs(0, 2, 5, 6, 4)))
    arrays[which] = value
    with pytest.raises(ValueError, match=match):
        causal_conv(**arrays)


@pytest.mark.parametrize("window,n,kernel_size,match", [
    (jnp.zeros((2, 8, 6)), jnp.zeros((2,), jnp.int32), 0, "kernel_size=0 must be a positive int"),
    (jnp.zeros((2, 3, 6)), jnp.zeros((2,), jnp.int32), 4, r"window has shape \(2, 3, 6\); expected \[B, K-1\+W, C\]"),
    (jnp.zeros((2, 8, 6)), jnp.zeros((3,), jnp.int32), 4, r"n must be an integer array of shape \(2,\)"),
    (jnp.zeros((2, 8, 6)), jnp.zeros((2,)), 4, r"got float32\[2\]"),
])
def test_conv_state_at_refuses_bad_inputs(window, n, kernel_size, match):
    with pytest.raises(ValueError, match=match):
        conv_state_at(window, n, kernel_size=kernel_size)
