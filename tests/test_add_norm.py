"""The residual add fused with RMSNorm (`pallas_kernels.add_norm`), in Pallas interpret mode against its jnp
reference and the model's own two lines, and where the dense target uses it."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.config import policy
from dflash_jax.targets.layers import rms_norm
from pallas_kernels.add_norm import add_rms_norm, fits, reference
from conftest import tiny_drafter

EPS = 1e-6


def _inputs(shape, dtype, seed=0):
    x, d = (jax.random.normal(jax.random.key(seed + i), shape, jnp.float32).astype(dtype) for i in (0, 1))
    w = (1.0 + 0.1 * jax.random.normal(jax.random.key(seed + 2), shape[-1:], jnp.float32)).astype(dtype)
    return x, d, w


def test_reference_is_the_model_add_then_rms_norm():
    x, d, w = _inputs((3, 64), jnp.bfloat16)
    s, y = reference(x, d, w, EPS)
    np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(x + d, np.float32))
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(rms_norm(x + d, w, EPS), np.float32))


@pytest.mark.parametrize("shape", [(1, 64), (5, 256), (2, 8, 128)])
def test_kernel_matches_reference_in_float32(shape):
    x, d, w = _inputs(shape, jnp.float32)
    got = add_rms_norm(x, d, w, EPS, impl="pallas", interpret=True)
    want = reference(x, d, w, EPS)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-6, atol=1e-6)


def test_kernel_bf16_within_two_roundings_and_rows_independent():
    """bf16 output within two bf16 roundings of the reference (the normalised row, then its product with the
    weight, each rounded after a float32 mean summed in another order); a row gives the same bits alone as in a
    batch (a one-row step and a 16-row verify normalise a position alike)."""
    x, d, w = _inputs((16, 128), jnp.bfloat16, seed=3)
    s, y = add_rms_norm(x, d, w, EPS, impl="pallas", interpret=True)
    want = np.asarray(reference(x, d, w, EPS)[1], np.float32)
    np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=2 ** -6, atol=1e-6)
    for i in (0, 7, 15):
        _, alone = add_rms_norm(x[i:i + 1], d[i:i + 1], w, EPS, impl="pallas", interpret=True)
        np.testing.assert_array_equal(np.asarray(alone, np.float32), np.asarray(y[i:i + 1], np.float32))
    assert s.dtype == y.dtype == jnp.bfloat16


def test_widths_the_kernel_cannot_tile_take_the_reference():
    assert fits(4096) and fits(64) and not fits(2560) and not fits(3 * 1024) and not fits(1 << 15)
    x, d, w = _inputs((2, 96), jnp.float32)
    for got, want in zip(add_rms_norm(x, d, w, EPS, impl="pallas", interpret=True), reference(x, d, w, EPS)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_refusals_name_the_problem():
    x, d, w = _inputs((2, 64), jnp.float32)
    with pytest.raises(ValueError, match="impl='triton' is not supported; choose one of"):
        add_rms_norm(x, d, w, EPS, impl="triton")
    with pytest.raises(ValueError, match="must have one shape and dtype"):
        add_rms_norm(x, d[:1], w, EPS)
    with pytest.raises(ValueError, match="must have one shape and dtype"):
        add_rms_norm(x, d.astype(jnp.bfloat16), w, EPS)
    with pytest.raises(ValueError, match=r"weight \[32\] must be \[64\]"):
        add_rms_norm(x, d, w[:32], EPS)


def test_the_kernel_runs_where_attention_runs_one_and_the_switch_is_on():
    impls = ("xla", "pallas", "cudnn")
    assert [policy.fused_norm_impl(i, env={}) for i in impls] == (
        ["xla", "pallas", "pallas"] if policy.FUSED_NORM else ["xla"] * 3)
    assert [policy.fused_norm_impl(i, env={"DFLASH_FUSED_NORM": "1"}) for i in impls] == ["xla", "pallas", "pallas"]
    assert [policy.fused_norm_impl(i, env={"DFLASH_FUSED_NORM": "0"}) for i in impls] == ["xla"] * 3
    with pytest.raises(ValueError, match="DFLASH_FUSED_NORM='yes': unknown fused_norm; choices: 0, 1"):
        policy.fused_norm_impl("pallas", env={"DFLASH_FUSED_NORM": "yes"})


def test_dense_extend_and_draft_with_the_kernel_equal_the_reference(target, monkeypatch):
    """With the fused norm on, the tiny dense target's cached pass over a block (impl="pallas", the kernels in
    interpret mode) gives the hidden states and taps of the XLA path, and the drafter's block forward its
    hidden states (float32)."""
    monkeypatch.setenv("DFLASH_FUSED_NORM", "1")
    tokens = jnp.asarray([[3, 9, 27, 1, 5]], jnp.int32)
    start = jnp.zeros((1,), jnp.int32)
    taps = (0, target.config.num_layers - 1)
    runs = [target.extend(target.init_state(1, 16), tokens, start, taps, impl=impl) for impl in ("xla", "pallas")]
    for got, want in zip(runs[1][:2], runs[0][:2]):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    drafter = tiny_drafter(target, 4)
    state = drafter.init_state(1, 16)
    taps = jax.random.normal(jax.random.key(4), (1, 6, drafter.config.n_taps * target.config.hidden_size))
    state, _ = drafter.ingest(state, taps, jnp.zeros((1,), jnp.int32))
    x = target.embed(jnp.asarray([[7, 2, 2, 2]], jnp.int32))
    hidden = [drafter.draft_hidden(state, x, impl) for impl in ("xla", "pallas")]
    np.testing.assert_allclose(np.asarray(hidden[1]), np.asarray(hidden[0]), rtol=1e-5, atol=1e-5)
