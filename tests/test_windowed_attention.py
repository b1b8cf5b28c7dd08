"""block_attention: the jnp reference against a numpy loop over the masking rules, and the Pallas
kernel (interpret mode) against the reference over shapes, lengths, windows, masks and GQA ratios."""
from __future__ import annotations

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from pallas_kernels import block_attention
from pallas_kernels import windowed_attention as wa

# (batch, W, nh, nkv, hd, capacity S, ctx_len per row, window, causal)
CASES = [
    pytest.param(2, 4, 4, 4, 16, 20, [0, 20], None, True, id="mha-empty-and-full-cache"),
    pytest.param(3, 8, 8, 4, 32, 100, [1, 57, 100], 5, False, id="gqa2-symmetric-window-below-W"),
    pytest.param(2, 16, 16, 4, 16, 300, [299, 7], 40, True, id="gqa4-splits-ragged-window-below-ctx"),
    pytest.param(1, 1, 8, 2, 16, 150, [150], None, True, id="decode-W1-ctx-equals-capacity"),
    pytest.param(1, 20, 8, 2, 16, 70, [65], 3, True, id="two-query-tiles-window-below-W"),
    pytest.param(1, 70, 2, 2, 16, 64, [10], None, False, id="two-block-key-tiles-bidirectional"),
    pytest.param(2, 5, 4, 1, 64, 130, [129, 64], 64, False, id="mqa-hd64-window-equals-tile"),
    pytest.param(2, 3, 4, 2, 24, 33, [2, 33], 2, True, id="hd-not-power-of-two"),
    pytest.param(1, 16, 8, 2, 16, 120, [100], 16, False, id="dflash2-symmetric-block-equals-window-long-ctx"),
]


def oracle(q, k_ctx, v_ctx, ctx_len, k_blk, v_blk, scale, causal, window):
    """The masking rules of the docstring, one key at a time, in float64."""
    q, k_ctx, v_ctx, k_blk, v_blk = (np.asarray(x, np.float64) for x in (q, k_ctx, v_ctx, k_blk, v_blk))
    b, w, nh, hd = q.shape
    s, nkv = k_ctx.shape[1], k_ctx.shape[2]
    out = np.zeros_like(q)
    for r in range(b):
        n = int(ctx_len[r])
        for h in range(nh):
            kv = h // (nh // nkv)
            for i in range(w):
                keys, values = [], []
                for j in range(s):
                    if j < n and (window is None or (n + i) - j < window):
                        keys.append(k_ctx[r, j, kv]), values.append(v_ctx[r, j, kv])
                for i2 in range(w):
                    in_window = window is None or (i - i2 < window and (causal or i2 - i < window))
                    if (not causal or i2 <= i) and in_window:
                        keys.append(k_blk[r, i2, kv]), values.append(v_blk[r, i2, kv])
                logits = np.stack(keys) @ q[r, i, h] * scale
                p = np.exp(logits - logits.max())
                out[r, i, h] = (p / p.sum()) @ np.stack(values)
    return out


def random_inputs(seed, b, w, nh, nkv, hd, s, dtype=jnp.float32):
    """q, k_ctx, v_ctx, k_blk, v_blk with unit-normal entries (cache slots past ctx_len hold junk too)."""
    rng = np.random.default_rng(seed)
    shapes = [(b, w, nh, hd), (b, s, nkv, hd), (b, s, nkv, hd), (b, w, nkv, hd), (b, w, nkv, hd)]
    return [jnp.asarray(rng.standard_normal(shape, np.float32), dtype) for shape in shapes]


_jitted_attention = jax.jit(block_attention, static_argnames=("scale", "causal", "window", "impl", "interpret"))


def run(impl, inputs, ctx_len, causal, window, scale=0.25):
    """block_attention jitted (one compile per case instead of one per eager op); Pallas in interpret mode."""
    q, kc, vc, kb, vb = inputs
    return _jitted_attention(q, kc, vc, jnp.asarray(ctx_len, jnp.int32), kb, vb, scale=scale, causal=causal,
                             window=window, impl=impl, interpret=impl != "xla")


@pytest.mark.parametrize("b, w, nh, nkv, hd, s, ctx_len, window, causal", CASES)
def test_xla_reference_follows_the_masking_rules(b, w, nh, nkv, hd, s, ctx_len, window, causal):
    inputs = random_inputs(0, b, w, nh, nkv, hd, s)
    got = run("xla", inputs, ctx_len, causal, window)
    want = oracle(*inputs[:3], ctx_len, *inputs[3:], 0.25, causal, window)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5,
                               err_msg="the jnp reference disagrees with the key-by-key oracle of the docstring")


@pytest.mark.parametrize("b, w, nh, nkv, hd, s, ctx_len, window, causal", CASES)
def test_pallas_kernel_matches_reference(b, w, nh, nkv, hd, s, ctx_len, window, causal):
    inputs = random_inputs(1, b, w, nh, nkv, hd, s)
    got = run("pallas", inputs, ctx_len, causal, window)
    want = run("xla", inputs, ctx_len, causal, window)
    assert got.shape == (b, w, nh, hd) and got.dtype == jnp.float32, "output must be [B, W, nh, hd] in q.dtype"
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5,
                               err_msg="the Pallas kernel disagrees with the jnp reference")


@pytest.mark.parametrize("b, w, nh, nkv, hd, s, ctx_len, window, causal", CASES)
def test_cudnn_impl_matches_reference(b, w, nh, nkv, hd, s, ctx_len, window, causal):
    """`impl="cudnn"`: the context and block attentions merged by their log-sum-exps (here through XLA's form of
    `jax.nn.dot_product_attention`, as off a GPU), or the Pallas kernel where cuDNN cannot serve (a window, a
    bidirectional block, a head not a multiple of 8)."""
    inputs = random_inputs(7, b, w, nh, nkv, hd, s)
    assert wa.cudnn_serves(inputs[0], causal, window) == (causal and window is None and hd % 8 == 0)
    got = run("cudnn", inputs, ctx_len, causal, window)
    want = run("xla", inputs, ctx_len, causal, window)
    assert got.shape == (b, w, nh, hd) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5,
                               err_msg="the merged context and block attentions disagree with the jnp reference")


def test_cudnn_impl_takes_heads_up_to_256_only():
    q = jnp.zeros((1, 4, 2, 256), jnp.float32)
    assert wa.cudnn_serves(q, True, None) and not wa.cudnn_serves(jnp.zeros((1, 4, 2, 512)), True, None), \
        "cuDNN takes heads up to 256 on Hopper; Gemma-4's 512 takes the Pallas kernel"


@settings(max_examples=8, deadline=None)
@given(st.data())
def test_pallas_kernel_matches_reference_on_random_shapes(data):
    nkv = data.draw(st.sampled_from([1, 2]), label="nkv")
    group = data.draw(st.sampled_from([1, 2, 4]), label="group")
    b, w = data.draw(st.integers(1, 3), label="b"), data.draw(st.integers(1, 18), label="W")
    s = data.draw(st.integers(1, 200), label="S")
    ctx_len = data.draw(st.lists(st.integers(0, s), min_size=b, max_size=b), label="ctx_len")
    window = data.draw(st.one_of(st.none(), st.integers(1, 80)), label="window")
    causal = data.draw(st.booleans(), label="causal")
    inputs = random_inputs(2, b, w, nkv * group, nkv, 16, s)
    got = run("pallas", inputs, ctx_len, causal, window)
    want = run("xla", inputs, ctx_len, causal, window)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5,
                               err_msg="the Pallas kernel disagrees with the jnp reference")


def test_bf16_inputs_give_bf16_output_close_to_reference():
    inputs = random_inputs(3, 2, 16, 8, 2, 32, 90, dtype=jnp.bfloat16)
    got = run("pallas", inputs, [90, 33], True, 20)
    want = run("xla", inputs, [90, 33], True, 20)
    assert got.dtype == jnp.bfloat16, "the output must come back in q.dtype"
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2,
                               err_msg="bf16 kernel (float32 accumulation) strays from the reference")


@pytest.mark.parametrize("hd, itemsize", [(128, 2), (256, 2), (512, 2), (512, 4)])
def test_tiles_fit_shared_memory_and_the_accumulator_for_every_head_width(hd, itemsize):
    block_q, block_k, stages = wa.fit_tiles(hd, itemsize, wa.BLOCK_Q, wa.BLOCK_K, wa.NUM_STAGES)
    assert (block_q + 2 * stages * block_k) * hd * itemsize <= wa.SMEM_BYTES, "tiles overflow shared memory"
    assert block_q * hd <= wa.ACC_ELEMENTS, "the float32 accumulator outgrows the swept size"
    if hd * itemsize <= 512:
        assert (block_q, block_k, stages) == (wa.BLOCK_Q, wa.BLOCK_K, wa.NUM_STAGES), "swept tiles were changed"


def test_pallas_kernel_matches_reference_with_gemma4_wide_heads():
    inputs = random_inputs(6, 1, 16, 8, 1, 512, 100, dtype=jnp.bfloat16)
    got = run("pallas", inputs, [70], True, None)
    want = run("xla", inputs, [70], True, None)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2,
                               err_msg="shrunk tiles for head_dim 512 stray from the reference")


def test_pallas_kernel_never_touches_cache_tiles_outside_the_live_window():
    tile, ctx_len, window = wa.BLOCK_K, 3 * wa.BLOCK_K + 5, 2 * wa.BLOCK_K
    b, w, nh, nkv, hd, s = 1, 4, 4, 2, 16, 6 * wa.BLOCK_K
    q, kc, vc, kb, vb = random_inputs(4, b, w, nh, nkv, hd, s)
    live = np.zeros(s, bool)
    live[(ctx_len - window + 1) // tile * tile: -(-ctx_len // tile) * tile] = True
    kc_poisoned, vc_poisoned = (jnp.where(live[None, :, None, None], x, jnp.nan) for x in (kc, vc))
    got = run("pallas", (q, kc_poisoned, vc_poisoned, kb, vb), [ctx_len], True, window)
    want = run("xla", (q, kc, vc, kb, vb), [ctx_len], True, window)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5,
                               err_msg="NaN in tiles past ctx_len or before the window reached the output: "
                                       "the kernel's work is not bounded by the live length and the window")


def test_unknown_impl_is_refused_with_the_choices():
    inputs = random_inputs(5, 1, 2, 2, 1, 16, 8)
    with pytest.raises(ValueError, match=r"impl='triton'.*\('xla', 'pallas', 'cudnn'\)"):
        run("triton", inputs, [3], True, None)


@pytest.mark.parametrize("bad, match", [
    ({"k_blk": (1, 3, 1, 16)}, "k_blk has shape"),
    ({"v_ctx": (1, 9, 1, 16)}, "v_ctx has shape"),
    ({"q": (1, 2, 2, 8)}, "k_ctx has shape"),
    ({"q": (1, 2, 3, 16), "k_ctx": (1, 8, 2, 16), "v_ctx": (1, 8, 2, 16), "k_blk": (1, 2, 2, 16),
      "v_blk": (1, 2, 2, 16)}, "not a multiple"),
    ({"q": (2, 16)}, "4 dims"),
])
def test_mismatched_shapes_are_refused(bad, match):
    shapes = {"q": (1, 2, 2, 16), "k_ctx": (1, 8, 1, 16), "v_ctx": (1, 8, 1, 16), "k_blk": (1, 2, 1, 16),
              "v_blk": (1, 2, 1, 16), **bad}
    arrays = {name: jnp.zeros(shape, jnp.float32) for name, shape in shapes.items()}
    with pytest.raises(ValueError, match=match):
        block_attention(arrays["q"], arrays["k_ctx"], arrays["v_ctx"], jnp.zeros(1, jnp.int32), arrays["k_blk"],
                        arrays["v_blk"], scale=1.0)


def test_bad_ctx_len_window_and_mixed_dtypes_are_refused():
    q, kc, vc, kb, vb = random_inputs(6, 2, 2, 2, 1, 16, 8)
    with pytest.raises(ValueError, match="ctx_len must be an integer array of shape \\(2,\\)"):
        block_attention(q, kc, vc, jnp.zeros(3, jnp.int32), kb, vb, scale=1.0)
    with pytest.raises(ValueError, match="ctx_len must be an integer array"):
        block_attention(q, kc, vc, jnp.zeros(2, jnp.float32), kb, vb, scale=1.0)
    with pytest.raises(ValueError, match="window=0 must be None or a positive int"):
        block_attention(q, kc, vc, jnp.zeros(2, jnp.int32), kb, vb, scale=1.0, window=0)
    with pytest.raises(ValueError, match="share one dtype"):
        block_attention(q, kc.astype(jnp.bfloat16), vc, jnp.zeros(2, jnp.int32), kb, vb, scale=1.0)


@pytest.mark.parametrize("w, window, causal", [(1, None, True), (16, None, True), (16, 2048, True), (16, None, False)],
                         ids=["decode", "verify", "drafter-sliding", "drafter-full"])
def test_pallas_kernel_lowers_to_triton_for_cuda(w, window, causal):
    """The Pallas-to-Triton lowering runs here without a GPU: an op Triton cannot take fails
    at this step, before any GPU sees the kernel (bf16, the benchmark's head shapes)."""
    q = jax.ShapeDtypeStruct((1, w, 32, 128), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((1, 768, 8, 128), jnp.bfloat16)
    block = jax.ShapeDtypeStruct((1, w, 8, 128), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
    fn = jax.jit(functools.partial(block_attention, scale=0.1, causal=causal, window=window, impl="pallas"))
    text = fn.trace(q, cache, cache, lengths, block, block).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1, "the kernel did not lower to one Triton call"


_jitted_into_cache = jax.jit(wa.block_attention_into_cache, static_argnames=("scale", "impl", "interpret"))

# (batch, W, nh, nkv, hd, capacity S, ctx_len per row): the block at the start, the block's last row on the last
# slot, a verify block overhanging the capacity (its tail dropped), one row a step, GQA 4
INTO_CACHE = [
    pytest.param(2, 1, 8, 2, 16, 64, [0, 63], id="decode-first-and-last-slot"),
    pytest.param(2, 16, 8, 2, 16, 70, [5, 60], id="verify-overhangs-the-capacity"),
    pytest.param(1, 5, 16, 4, 32, 200, [137], id="gqa4-odd-width"),
    pytest.param(3, 4, 4, 4, 16, 64, [64, 0, 30], id="full-cache-writes-nothing"),
]


@pytest.mark.parametrize("b, w, nh, nkv, hd, s, ctx_len", INTO_CACHE)
def test_the_kernel_writes_the_block_into_the_caches_it_aliases_as_the_scatter_does(monkeypatch, b, w, nh, nkv, hd,
                                                                                   s, ctx_len):
    q, kc, vc, kb, vb = random_inputs(9, b, w, nh, nkv, hd, s)
    lengths = jnp.asarray(ctx_len, jnp.int32)
    want = _jitted_into_cache(q, kc, vc, lengths, kb, vb, scale=0.25, impl="xla")
    monkeypatch.setattr(wa, "WRITE_IN_KERNEL", True)
    assert wa.writes_in_kernel(kc, "pallas") and not wa.writes_in_kernel(kc, "xla")
    jaxpr = str(jax.make_jaxpr(functools.partial(wa.block_attention_into_cache, scale=0.25, impl="pallas",
                                                 interpret=True))(q, kc, vc, lengths, kb, vb))
    assert "scatter" not in jaxpr and "input_output_aliases=((2, 2), (3, 3))" in jaxpr, \
        "the block must be written by the kernel into its aliased caches, not scattered after it"
    got = jax.jit(functools.partial(wa.block_attention_into_cache, scale=0.25, impl="pallas", interpret=True))(
        q, kc, vc, lengths, kb, vb)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), atol=1e-5, rtol=1e-5,
                               err_msg="the writing kernel's attention disagrees with the jnp reference")
    for name, g, r in (("k", got[1][0], want[1][0]), ("v", got[1][1], want[1][1])):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r),
                                      err_msg=f"the {name} cache the kernel wrote differs from write_rows'")


@pytest.mark.parametrize("hd, s", [(16, 32), (24, 100)], ids=["capacity-below-a-key-tile", "hd-not-power-of-two"])
def test_a_cache_the_kernel_would_pad_is_written_by_the_scatter(monkeypatch, hd, s):
    """The kernel cannot write in place into a padded copy, so these caches take the attention, then write_rows."""
    monkeypatch.setattr(wa, "WRITE_IN_KERNEL", True)
    q, kc, vc, kb, vb = random_inputs(10, 2, 3, 4, 2, hd, s)
    assert not wa.writes_in_kernel(kc, "pallas")
    lengths = jnp.asarray([0, s - 1], jnp.int32)
    out, (k, v) = _jitted_into_cache(q, kc, vc, lengths, kb, vb, scale=0.25, impl="pallas", interpret=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(run("xla", (q, kc, vc, kb, vb), lengths, True, None)),
                               atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(k), np.asarray(wa.write_rows(kc, kb, lengths)))
    np.testing.assert_array_equal(np.asarray(v[1, s - 1]), np.asarray(vb[1, 0]))


def test_the_writing_kernel_lowers_to_one_triton_call_with_both_caches_aliased(monkeypatch):
    monkeypatch.setattr(wa, "WRITE_IN_KERNEL", True)
    q = jax.ShapeDtypeStruct((1, 1, 32, 128), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((1, 768, 8, 128), jnp.bfloat16)
    block = jax.ShapeDtypeStruct((1, 1, 8, 128), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
    fn = jax.jit(functools.partial(wa.block_attention_into_cache, scale=0.1, impl="pallas", interpret=False))
    text = fn.trace(q, cache, cache, lengths, block, block).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "scatter" not in text
    assert "output_operand_aliases" in text, "the caches must be aliased to the kernel's outputs"
