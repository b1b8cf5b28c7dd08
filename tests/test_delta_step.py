"""delta_step, a Gated DeltaNet decode step in one kernel (interpret mode): against a float64 numpy step, against
the layer's jnp path (`gdn.gated_delta_net` at one position), through a hybrid's plain and speculative decoding,
its lowering to Triton for CUDA at Qwen3.5's shape, and what it refuses."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax
from conftest import tiny_drafter, tiny_hybrid
from dflash_jax.targets import gdn
from pallas_kernels.gated_delta import delta_step, step_takes


def numpy_step(window, conv_weight, g, beta, state, key_heads, dtype):
    """Float64: conv + SiLU (rounded to `dtype`, as the layer does), L2 norms, then one step of the recurrence."""
    b, heads, dk, dv = state.shape
    win = np.asarray(window, np.float64)
    y = np.einsum("bkc,ck->bc", win, np.asarray(conv_weight, np.float64)[:, 0, :])
    y = np.asarray(jnp.asarray(y / (1 + np.exp(-y)), jnp.float32).astype(dtype), np.float64)
    kd = key_heads * dk
    q = y[:, :kd].reshape(b, key_heads, dk)
    k = y[:, kd:2 * kd].reshape(b, key_heads, dk)
    v = y[:, 2 * kd:].reshape(b, heads, dv)
    rep = heads // key_heads
    q, k = np.repeat(norm(q), rep, axis=1) * dk ** -0.5, np.repeat(norm(k), rep, axis=1)
    s = np.asarray(state, np.float64) * np.exp(np.asarray(g, np.float64)[:, 0, :, None, None])
    u = np.asarray(beta, np.float64)[:, 0, :, None] * (v - np.einsum("bhkv,bhk->bhv", s, k))
    s = s + k[..., None] * u[:, :, None, :]
    return np.einsum("bhkv,bhk->bhv", s, q)[:, None], u[:, None], k[:, None]


def norm(x):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def random_step(seed, b=2, key_heads=2, heads=4, dk=16, dv=32, kernel=4, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    conv_dim = 2 * key_heads * dk + heads * dv
    window = jnp.asarray(rng.standard_normal((b, kernel, conv_dim)), dtype)
    conv_weight = jnp.asarray(rng.standard_normal((conv_dim, 1, kernel)) * 0.5, dtype)
    g = jnp.asarray(-rng.uniform(0.01, 2.0, (b, 1, heads)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0, 1, (b, 1, heads)), jnp.float32)
    state = jnp.asarray(rng.standard_normal((b, heads, dk, dv)) * 0.3, jnp.float32)
    return window, conv_weight, g, beta, state


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("dv", [32, 128])
def test_the_kernel_matches_a_float64_step(dtype, dv):
    """dv 128 splits each head into two value tiles, which read the same q and k and write the same k."""
    args = random_step(int(dv), dv=dv, dtype=dtype)
    out, u, k = delta_step(*args, key_heads=2, dtype=dtype, interpret=True)
    assert out.shape == u.shape == (2, 1, 4, dv) and k.shape == (2, 1, 4, 16) and out.dtype == jnp.float32
    for got, want in zip((out, u, k), numpy_step(*args, key_heads=2, dtype=dtype)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)


@pytest.fixture
def step_kernel(monkeypatch):
    """`gdn.STEP_KERNEL` on (the default since an H100 timed it), whatever the module's setting."""
    monkeypatch.setattr(gdn, "STEP_KERNEL", True)


def test_a_decode_step_of_the_layer_equals_its_jnp_path(step_kernel):
    """`gated_delta_net` at one position with a kernel impl takes `delta_step`; the output, the conv window and the
    updates (k, u, g) `commit` folds agree with the jnp path's."""
    target = tiny_hybrid(seed=3)
    cfg, p = target.config, target.params["layers_0"]
    params = {n: p[n] for n in ("in_proj", "conv", "dt_bias", "A_log", "norm", "out_proj")}
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 1, cfg.hidden_size)), jnp.float32)
    conv_state = jnp.asarray(rng.standard_normal((2, cfg.linear_conv_kernel - 1, cfg.conv_dim)), jnp.float32)
    ssm = jnp.asarray(rng.standard_normal((2, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                           cfg.linear_value_head_dim)) * 0.3, jnp.float32)
    assert gdn.step_kernel_takes(cfg, ssm)
    ref = gdn.gated_delta_net(cfg, params, x, conv_state, ssm, impl="xla")
    got = gdn.gated_delta_net(cfg, params, x, conv_state, ssm, impl="pallas")
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
        assert a.shape == b.shape
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_plain_and_speculative_decoding_through_the_kernel_agree(step_kernel):
    """A hybrid decoded with the kernels (plain steps through `delta_step`, verifies through `delta_chunk`'s kernel)
    gives the jnp path's tokens, and greedy speculative decoding gives the plain ones."""
    target = tiny_hybrid(seed=5)
    prompts = [[3, 4, 5, 6, 7], [9, 10]]
    plain = dflash_jax.generate(target, None, prompts, max_new_tokens=12, impl="pallas").tokens
    assert plain == dflash_jax.generate(target, None, prompts, max_new_tokens=12, impl="xla").tokens
    drafter = tiny_drafter(target, 4, tap_ids=(0, 1))
    assert dflash_jax.generate(target, drafter, prompts, max_new_tokens=12, impl="pallas").tokens == plain


def test_the_kernel_lowers_to_triton_for_cuda():
    """The Pallas-to-Triton lowering runs here without a GPU: Qwen3.5's linear layer (16 key heads of 128, 32 value
    heads of 128, conv kernel 4), bf16."""
    b, nk, nv, dk, dv, kernel = 1, 16, 32, 128, 128, 4
    conv_dim = 2 * nk * dk + nv * dv
    shapes = (jax.ShapeDtypeStruct((b, kernel, conv_dim), jnp.bfloat16),
              jax.ShapeDtypeStruct((conv_dim, 1, kernel), jnp.bfloat16),
              jax.ShapeDtypeStruct((b, 1, nv), jnp.float32), jax.ShapeDtypeStruct((b, 1, nv), jnp.float32),
              jax.ShapeDtypeStruct((b, nv, dk, dv), jnp.float32))
    fn = jax.jit(lambda *a: delta_step(*a, key_heads=nk, dtype=jnp.bfloat16))
    text = fn.trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1 and 'name = "delta_step"' in text


def test_shapes_the_kernel_does_not_take_are_refused_and_keep_the_jnp_path():
    assert step_takes(64, 2, (1, 4, 8, 8), 4) and step_takes(8192, 16, (1, 32, 128, 128), 4)
    assert not step_takes(2 * 2 * 8 + 4 * 12, 2, (1, 4, 8, 12), 4), "value heads of 12"
    assert not step_takes(64, 2, (1, 4, 8, 8), 3), "a conv kernel of 3"
    assert not step_takes(65, 2, (1, 4, 8, 8), 4), "channels that are not q|k|v"
    window, conv_weight, g, beta, state = random_step(1, dv=24)
    with pytest.raises(ValueError, match="does not fit the kernel: dk, dv and the conv kernel must be powers of two"):
        delta_step(window, conv_weight, g, beta, state, key_heads=2, dtype=jnp.float32, interpret=True)
