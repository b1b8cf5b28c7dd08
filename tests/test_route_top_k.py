"""The routing kernel (interpret mode) against its jnp reference and a float64 numpy oracle; ties, NaN logits,
cropped slots, the MoE block routed through it, the impl choice and refusals; its Mosaic GPU port in JAX's GPU
interpreter, and both lowerings for CUDA."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.targets import moe
from pallas_kernels.route_top_k import MAX_TOP_K, reference, route_top_k, supported


def numpy_route(logits, top_k, norm):
    """Float64 softmax, a stable sort (equal probabilities in expert order), optional renormalisation."""
    z = np.asarray(logits, np.float64)
    probs = np.exp(z - z.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    chosen = np.argsort(-probs, axis=1, kind="stable")[:, :top_k]
    w = np.take_along_axis(probs, chosen, axis=1)
    return (w / w.sum(1, keepdims=True) if norm else w), chosen


@pytest.mark.parametrize("rows, experts, top_k", [(1, 256, 8), (5, 16, 3), (3, 8, 8), (16, 64, 1), (2, 32, 16)])
@pytest.mark.parametrize("norm", [True, False])
def test_kernel_matches_reference_and_oracle(rows, experts, top_k, norm):
    logits = jnp.asarray(3 * np.random.default_rng(rows * experts + top_k).standard_normal((rows, experts)),
                         jnp.float32)
    w, idx = route_top_k(logits, top_k, norm, impl="pallas", interpret=True)
    w_ref, idx_ref = reference(logits, top_k, norm, jnp.float32)
    assert w.shape == idx.shape == (rows, top_k) and w.dtype == jnp.float32 and idx.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(idx_ref))
    np.testing.assert_allclose(np.asarray(w), np.asarray(w_ref), rtol=2e-6)
    w_np, idx_np = numpy_route(logits, top_k, norm)
    np.testing.assert_array_equal(np.asarray(idx), idx_np)
    np.testing.assert_allclose(np.asarray(w), w_np, rtol=1e-5)


def test_equal_probabilities_come_in_expert_order():
    """Ties, as `lax.top_k` orders them: the lower expert first, and no expert twice."""
    logits = jnp.asarray([[0.0, 2.0, 1.0, 2.0, 1.0, 2.0, 0.0, 1.0],
                          [1.0] * 8], jnp.float32)
    w, idx = route_top_k(logits, 5, False, impl="pallas", interpret=True)
    w_ref, idx_ref = reference(logits, 5, False, jnp.float32)
    np.testing.assert_array_equal(np.asarray(idx), [[1, 3, 5, 2, 4], [0, 1, 2, 3, 4]])
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(idx_ref))
    np.testing.assert_allclose(np.asarray(w), np.asarray(w_ref), rtol=1e-6)


def test_bf16_logits_give_bf16_weights_within_a_rounding():
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((4, 128)), jnp.bfloat16)
    w, idx = route_top_k(logits, 8, True, impl="pallas", interpret=True)
    w_ref, idx_ref = route_top_k(logits, 8, True)
    assert w.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(idx_ref))
    np.testing.assert_allclose(np.asarray(w, np.float32), np.asarray(w_ref, np.float32), rtol=2 ** -7)
    w32, _ = route_top_k(logits, 8, True, jnp.float32, impl="pallas", interpret=True)
    assert w32.dtype == jnp.float32 and float(jnp.max(jnp.abs(w32.sum(1) - 1))) < 1e-6


def test_nan_logits_still_name_experts_in_range():
    """A NaN row must not send an out-of-range expert to the expert kernels, which read weights by it."""
    logits = jnp.asarray([[np.nan] * 16, np.arange(16.0)], jnp.float32)
    _, idx = route_top_k(logits, 4, True, impl="pallas", interpret=True)
    assert np.all((np.asarray(idx) >= 0) & (np.asarray(idx) < 16)), idx
    np.testing.assert_array_equal(np.asarray(idx)[1], [15, 14, 13, 12])


def test_moe_block_routed_by_the_kernel_matches_the_reference(monkeypatch):
    """The block's `route` through the kernel (interpreted here; a GPU compiles it) gives the reference's output."""
    rng = np.random.default_rng(7)
    h, e, i, s = 16, 8, 12, 10
    shapes = {"router": (h, e), "w_gate_up": (e, h, 2 * i), "w_down": (e, i, h), "shared_gate_up": (h, 2 * s),
              "shared_down": (s, h), "shared_gate": (h, 1)}
    params = {k: jnp.asarray(rng.standard_normal(v) / np.sqrt(v[-2]), jnp.float32) for k, v in shapes.items()}
    params["router"] = params["router"] * 3
    x = jnp.asarray(rng.standard_normal((2, 5, h)), jnp.float32)
    expected = moe.moe_block(x, params, top_k=3, norm_topk_prob=True, impl="gather")
    monkeypatch.setattr(moe, "route_impl", lambda *args, **kwargs: "pallas")
    got = moe.moe_block(x, params, top_k=3, norm_topk_prob=True, impl="gather")
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-6)


def test_impl_choice(monkeypatch):
    assert moe.route_impl(256, 8, backend="gpu") == "pallas", "the Triton kernel by default (ROUTE_IMPL)"
    monkeypatch.setattr(moe, "ROUTE_IMPL", "xla")
    assert moe.route_impl(256, 8, backend="gpu") == "xla"
    monkeypatch.setattr(moe, "ROUTE_IMPL", "pallas")
    assert moe.route_impl(256, 8, backend="cpu") == "xla"
    assert moe.route_impl(60, 4, backend="gpu") == "xla", "60 experts: not a power of two"
    assert moe.route_impl(256, MAX_TOP_K + 1, backend="gpu") == "xla"
    assert moe.route_impl(64, 4, backend="gpu") == "pallas"
    monkeypatch.setattr(moe, "ROUTE_IMPL", "mosaic")
    assert moe.route_impl(256, 8, backend="gpu") == "mosaic"
    assert moe.route_impl(64, 4, backend="gpu") == "xla", "a Mosaic GPU row is a warpgroup's: 128 experts or more"
    assert supported(512, 10) and not supported(96, 2) and not supported(4, 8)
    assert supported(64, 4) and not supported(64, 4, "mosaic") and supported(128, 4, "mosaic")
    _, idx = moe.route(jnp.ones((2, 4)), jnp.eye(4, 8), 2, True)  # the CPU takes the reference
    assert idx.shape == (2, 2)
    monkeypatch.setattr(moe, "ROUTE_IMPL", "fast")
    with pytest.raises(ValueError, match=r"ROUTE_IMPL='fast' is not known; choose one of \('xla', 'pallas', 'mos"):
        moe.route(jnp.ones((2, 4)), jnp.eye(4, 8), 2, True)


def test_refusals():
    logits = jnp.zeros((2, 8), jnp.float32)
    with pytest.raises(ValueError, match="impl='fast'.*choose one of"):
        route_top_k(logits, 2, True, impl="fast")
    with pytest.raises(ValueError, match=r"power-of-two number of experts.*E = 6"):
        route_top_k(jnp.zeros((2, 6)), 2, True, impl="pallas", interpret=True)
    with pytest.raises(ValueError, match="top_k <= 16"):
        route_top_k(jnp.zeros((2, 32)), 17, True, impl="pallas", interpret=True)
    with pytest.raises(ValueError, match=r"top_k=9 must be an int in \[1, 8\]"):
        route_top_k(logits, 9, True)
    with pytest.raises(ValueError, match="top_k=True"):
        route_top_k(logits, True, True)
    with pytest.raises(ValueError, match="logits must be floating"):
        route_top_k(jnp.zeros((2, 8), jnp.int32), 2, True)
    with pytest.raises(ValueError, match="logits must be floating"):
        route_top_k(jnp.zeros((8,)), 2, True)


def test_jit_compiles_the_kernel_once_per_shape():
    run = jax.jit(lambda z: route_top_k(z, 2, True, impl="pallas", interpret=True))
    a = run(jnp.arange(16.0).reshape(2, 8))
    b = run(jnp.arange(16.0).reshape(2, 8)[::-1])
    np.testing.assert_array_equal(np.asarray(a[1]), [[7, 6], [7, 6]])
    np.testing.assert_array_equal(np.asarray(b[1]), [[7, 6], [7, 6]])
    assert run._cache_size() == 1


@pytest.mark.parametrize("rows, experts, top_k", [(1, 256, 8), (16, 256, 8), (4, 512, 10), (2, 128, 1)])
def test_the_kernel_lowers_to_triton_for_cuda(rows, experts, top_k):
    """The Pallas-to-Triton lowering runs here without a GPU (an op Triton cannot take fails at this step): the
    published routers' shapes (Qwen3.5-MoE 256 experts top-8, Qwen3-Next 512 top-10), a decode step and a verify."""
    fn = jax.jit(lambda z: route_top_k(z, top_k, True, impl="pallas"))
    text = fn.trace(jax.ShapeDtypeStruct((rows, experts), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1 and 'name = "route_top_k"' in text


@pytest.mark.parametrize("rows, experts, top_k, norm, dtype", [(1, 256, 8, True, jnp.bfloat16),
                                                               (3, 512, 10, False, jnp.float32),
                                                               (2, 128, 1, True, jnp.float32)])
def test_the_mosaic_port_matches_the_oracle(rows, experts, top_k, norm, dtype):
    """The Mosaic GPU program in JAX's GPU interpreter: the published routers' shapes, ties in expert order, and a
    NaN row still naming experts in range."""
    z = 3 * np.random.default_rng(experts + top_k).standard_normal((rows, experts))
    z[0, :4] = z[0].max() + 1  # four equal largest: the lowest expert first
    logits = jnp.asarray(z, dtype)
    w, idx = route_top_k(logits, top_k, norm, impl="mosaic", interpret=True)
    w_ref, idx_ref = reference(logits, top_k, norm, dtype)
    assert w.shape == idx.shape == (rows, top_k) and w.dtype == dtype and idx.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(idx_ref))
    np.testing.assert_array_equal(np.asarray(idx), numpy_route(np.asarray(logits, np.float64), top_k, norm)[1])
    np.testing.assert_allclose(np.asarray(w, np.float32), np.asarray(w_ref, np.float32),
                               rtol=2 ** -7 if dtype == jnp.bfloat16 else 2e-6)
    _, idx = route_top_k(jnp.full((1, experts), np.nan, jnp.float32), top_k, norm, impl="mosaic", interpret=True)
    assert np.all((np.asarray(idx) >= 0) & (np.asarray(idx) < experts)), idx


@pytest.mark.parametrize("rows, experts, top_k", [(1, 256, 8), (16, 256, 8), (4, 512, 10)])
def test_the_mosaic_port_lowers_for_cuda_and_takes_the_reference_elsewhere(rows, experts, top_k):
    fn = jax.jit(lambda z: route_top_k(z, top_k, True, impl="mosaic"))
    traced = fn.trace(jax.ShapeDtypeStruct((rows, experts), jnp.bfloat16))
    assert traced.lower(lowering_platforms=("cuda",)).as_text().count("custom_call @mosaic_gpu") == 1
    assert "mosaic_gpu" not in traced.lower(lowering_platforms=("cpu",)).as_text()
    with pytest.raises(ValueError, match=r"mosaic kernel takes a power-of-two number of experts of at least 128"):
        route_top_k(jnp.zeros((2, 64)), 2, True, impl="mosaic")
