"""Weight precision (docs/architecture.md, "Weight precision"): the original's q8_0 and q4_0 and int8 per channel,
the dequantising product and its kernel, quantisation at load, save and reload, and what stays lossless."""
import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax
from conftest import random_params, target_param_shapes, tiny_drafter, tiny_gemma4, tiny_hybrid, tiny_target
from dflash_jax import cli, quant
from dflash_jax.config import CheckpointError, TargetConfig, policy
from dflash_jax.io import checkpoints
from dflash_jax.io.safetensors import SINGLE_FILE
from dflash_jax.targets.layers import matmul
from pallas_kernels import quant_matmul as qmm

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [1, 2, 3], list(range(12, 40))]
MAX_NEW = 24
U = 2.0 ** -8  # half a q8_0 step when the block's largest magnitude is 254 U (d = 2^-7, exact in float16)


# ---------------------------------------------------------------------------------------
# The formats, against hand-computed blocks and a transcription of the original's encoders.


def _seed_half_from_f32(v) -> int:
    """The original's `half_from_f32`, transcribed: round to nearest even, subnormal results flushed to zero."""
    b = int(np.float32(v).view(np.uint32))
    sign, exp, man = (b >> 16) & 0x8000, ((b >> 23) & 0xFF) - 127 + 15, b & 0x7FFFFF
    if exp <= 0:
        return sign
    if exp >= 31:
        return sign | 0x7C00
    h, rem = sign | (exp << 10) | (man >> 13), man & 0x1FFF
    return h + 1 if rem > 0x1000 or (rem == 0x1000 and h & 1) else h


def _seed_round(x) -> float:
    """Rust's f32::round: halves away from zero (exact for float32 values in double precision)."""
    return float(np.copysign(np.floor(abs(float(x)) + 0.5), x))


def _seed_encode_q8_0(blk) -> tuple:
    """The original's `encode_q8_0` on one block of 32 float32 values: (scale bits, 32 quants)."""
    amax = np.float32(0)
    for v in blk:
        amax = max(amax, abs(v))
    d = np.float32(amax / np.float32(127.0))
    inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
    return _seed_half_from_f32(d), [int(np.clip(_seed_round(np.float32(v * inv)), -127, 127)) for v in blk]


def _seed_encode_q4_0(blk) -> tuple:
    """The original's `encode_q4_0` on one block: (scale bits, 16 packed bytes)."""
    amax, mx = np.float32(0), np.float32(0)
    for v in blk:
        if abs(v) > amax:
            amax, mx = abs(v), v
    d = np.float32(mx / np.float32(-8.0))
    inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
    nib = [int(np.clip(np.float32(np.float32(v * inv) + np.float32(8.5)), 0.0, 15.0)) for v in blk]
    return _seed_half_from_f32(d), [nib[j] | (nib[j + 16] << 4) for j in range(16)]


def _column(*blocks) -> np.ndarray:
    """Blocks of 32 values stacked along the input axis as one output column: a `[32 n, 1]` weight."""
    return np.concatenate([np.asarray(b, np.float32) for b in blocks])[:, None]


def test_q8_0_encodes_a_hand_computed_block_with_halves_rounded_away_from_zero():
    c = np.zeros(32)
    c[:12] = [254, -5, 5, -1, 1, 3, -3, 0, 100, -100, 253, -253]  # in units of U: q = c / 2, halves away from zero
    data, scales = quant.encode(_column(c * U, np.zeros(32)), "q8_0")
    assert data.dtype == np.int8 and scales.dtype == np.float16 and data.shape == (64, 1) and scales.shape == (2, 1)
    want = [127, -3, 3, -1, 1, 2, -2, 0, 50, -50, 127, -127] + [0] * 20
    assert data[:32, 0].tolist() == want, "numpy's round-half-to-even would give -2, 2, 0, 0, 2, -2 here"
    assert scales.view(np.uint16)[:, 0].tolist() == [0x2000, 0x0000], "d = 2^-7 for the first block, 0 for zeros"
    assert data[32:, 0].tolist() == [0] * 32


def test_q4_0_encodes_a_hand_computed_block_in_the_original_nibble_order():
    v = np.zeros(32)
    v[0], v[5], v[16], v[17], v[1], v[2], v[3] = -1.0, 1.0, 0.875, 0.0625, -0.0625, 0.3, -0.5
    # the first value of largest magnitude (-1.0, before +1.0) sets d = -1 / -8 = 0.125; q = trunc(v * 8 + 8.5)
    pos = np.zeros(32)
    pos[0], pos[1] = 2.0, -1.75  # a positive extreme: d = -0.25, and the opposite extreme lands on 15
    data, scales = quant.encode(_column(v, pos, np.zeros(32)), "q4_0")
    assert data.dtype == np.uint8 and data.shape == (48, 1) and scales.shape == (3, 1)
    nib = [0, 8, 10, 4, 8, 15] + [8] * 10 + [15, 9] + [8] * 14
    assert data[:16, 0].tolist() == [nib[j] | (nib[j + 16] << 4) for j in range(16)]
    assert data[0, 0] == 0xF0, "byte 0 holds value 0 in its low nibble and value 16 in its high nibble"
    assert data[16:18, 0].tolist() == [0x80, 0x8F] and data[32:, 0].tolist() == [0x88] * 16
    assert scales.view(np.uint16)[:, 0].tolist() == [0x3000, 0xB400, 0x8000], "0.125, -0.25, and -0.0 for zeros"
    w = np.asarray(qmm.dequantize(jnp.asarray(data), jnp.asarray(scales), "q4_0"))[:, 0]
    assert w[[0, 5, 16, 17, 1, 2, 32, 33]].tolist() == [-1.0, 0.875, 0.875, 0.125, 0.0, 0.25, 2.0, -1.75]


def test_int8_has_one_scale_per_output_channel():
    w = np.array([[1.27, -0.5], [-0.635, 0.25], [0.0, -2.54]], np.float32)
    data, scales = quant.encode(w, "int8")
    assert scales.dtype == np.float32 and scales.shape == (1, 2)
    np.testing.assert_allclose(scales[0], [0.01, 0.02], rtol=1e-6)
    assert data.tolist() == [[127, -25], [-64, 13], [0, -127]], "0.635 / 0.01 = 63.5 rounds away to 64"


@pytest.mark.parametrize("fmt, seed_encode", [("q8_0", _seed_encode_q8_0), ("q4_0", _seed_encode_q4_0)])
def test_block_formats_match_the_original_encoders_transcribed(fmt, seed_encode):
    rng = np.random.RandomState(0)
    w = (rng.randn(32 * 6, 5) * rng.choice([0.01, 0.1, 1.0], (1, 5))).astype(np.float32)
    w[:32, 0] = np.round(w[:32, 0] * 64) / 64  # many exact halves and ties
    w[32:64, 1] = np.abs(w[32:64, 1])
    w[64:96, 2] = 0.0
    data, scales = quant.encode(w, fmt)
    for b in range(6):
        for n in range(5):
            bits, q = seed_encode(w[32 * b:32 * (b + 1), n])
            assert int(scales.view(np.uint16)[b, n]) == bits, (b, n)
            got = data[32 * b:32 * (b + 1), n] if fmt == "q8_0" else data[16 * b:16 * (b + 1), n]
            assert got.astype(int).tolist() == q, (b, n)


def test_a_scale_below_float16s_normal_range_is_kept_not_flushed_to_zero():
    """The original flushes a subnormal float16 scale to zero, which zeroes the whole block (every q8_0 block
    whose largest magnitude is under 0.0078); IEEE rounding keeps it (docs: known defects of the original)."""
    block = np.linspace(-1e-3, 1e-3, 32, dtype=np.float32)
    assert _seed_encode_q8_0(block)[0] == 0, "the transcription flushes it"
    data, scales = quant.encode(block[:, None], "q8_0")
    assert scales[0, 0] > 0
    w = np.asarray(qmm.dequantize(jnp.asarray(data), jnp.asarray(scales), "q8_0"))[:, 0]
    np.testing.assert_allclose(w, block, atol=1e-3 / 127)


@pytest.mark.parametrize("fmt", qmm.FORMATS)
def test_dequantised_weights_lie_within_a_step_and_requantise_to_the_same_bits(fmt):
    rng = np.random.RandomState(1)
    w = (rng.randn(128, 24) * 0.05).astype(np.float32)
    data, scales = quant.encode(w, fmt)
    back = np.asarray(qmm.dequantize(jnp.asarray(data), jnp.asarray(scales), fmt))
    step = np.abs(scales.astype(np.float32))
    step = np.repeat(step, 32, axis=0) if fmt != "int8" else step
    # half a step, plus the float16 rounding of the scale (quants come from the float32 scale, as in the original)
    # times the largest quant; q4_0's opposite extreme clamps at 7 steps where it would need 8: one step
    bound = {"int8": 0.5, "q8_0": 0.5 + 127 / 2048, "q4_0": 1.0 + 8 / 2048}[fmt]
    assert np.all(np.abs(back - w) <= step * bound + 1e-7), fmt
    again = quant.encode(back, fmt)
    assert np.array_equal(again[0], data) and np.array_equal(again[1].view(np.uint16), scales.view(np.uint16))


def test_weights_the_block_formats_cannot_pack_are_refused_naming_them_and_the_way_out():
    with pytest.raises(ValueError, match=r"layers_0/w_down \[48, 32\]: q8_0 packs blocks of 32.*choices: int8"):
        quant.quantize_array(np.zeros((48, 32)), "q8_0", path="layers_0/w_down")
    assert quant.quantize_array(np.zeros((48, 32)), "int8").shape == (48, 32), "int8 takes any width"
    with pytest.raises(ValueError, match=r"only 2-D \[in, out\] weights"):
        quant.quantize_array(np.zeros((2, 32, 32)), "q8_0")
    with pytest.raises(ValueError, match=r"unknown weight format 'q5_0'; choices: int8, q8_0, q4_0"):
        quant.quantize_array(np.zeros((32, 32)), "q5_0")
    cfg = TargetConfig(arch="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4,
                       num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope=tiny_target().config.rope)
    model = checkpoints.make_target(cfg, random_params(target_param_shapes(cfg), 0))
    with pytest.raises(ValueError, match=r"layers_0/w_down \[48, 32\]: q4_0"):
        quant.quantize(model, "int4")
    assert quant.formats_of(quant.quantize(model, "int8").params)[("layers_0", "w_down")] == "int8"


def test_packed_arrays_that_are_not_one_weight_are_refused():
    data, scales = quant.encode(np.ones((64, 16), np.float32), "q4_0")
    assert quant.from_packed(data, scales, "q4_0", jnp.float32).shape == (64, 16)
    with pytest.raises(ValueError, match=r"not one q8_0 weight"):
        quant.from_packed(data, scales, "q8_0", jnp.float32)
    with pytest.raises(ValueError, match=r"not one q4_0 weight"):
        quant.from_packed(data[:-1], scales, "q4_0", jnp.float32)


# ---------------------------------------------------------------------------------------
# The product: reference and kernel.


def _random_packed(rng, k: int, n: int, fmt: str):
    data, scales = quant.encode((rng.randn(k, n) * 0.1).astype(np.float32), fmt)
    return jnp.asarray(data), jnp.asarray(scales)


@pytest.mark.parametrize("fmt", qmm.FORMATS)
@pytest.mark.parametrize("m, k, n, dtype", [(1, 64, 48, jnp.float32), (5, 96, 16, jnp.float32),
                                            (16, 256, 128, jnp.bfloat16), (40, 64, 32, jnp.bfloat16)])
def test_kernel_equals_the_reference_in_interpret_mode(fmt, m, k, n, dtype):
    rng = np.random.RandomState(m + k)
    data, scales = _random_packed(rng, k, n, fmt)
    x = jnp.asarray(rng.randn(2, m, k), dtype)
    ref = qmm.quant_matmul(x, data, scales, fmt)
    got = qmm.quant_matmul(x, data, scales, fmt, impl="pallas", interpret=True)
    assert got.dtype == ref.dtype == dtype and got.shape == (2, m, n)
    want = np.asarray(x, np.float64) @ np.asarray(qmm.dequantize(data, scales, fmt).astype(dtype), np.float64)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(ref, np.float64), want, rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(ref, np.float64), rtol=tol, atol=tol)


@pytest.mark.parametrize("fmt", qmm.FORMATS)
@pytest.mark.parametrize("m", [1, 16])
def test_kernel_tiles_and_k_splits_sum_the_same_and_rows_do_not_affect_each_other(fmt, m):
    """The GEMV (one row) and the product kernel (more) give the same sums at any tiles and K split, and a
    row's result does not depend on the rows that came with it through the same kernel."""
    rng = np.random.RandomState(3)
    data, scales = _random_packed(rng, 256, 64, fmt)
    x = jnp.asarray(rng.randn(m, 256), jnp.float32)
    run = lambda a, k_splits=None, **tiles: qmm._pallas_matmul(
        a, data, scales, fmt=fmt, compute=jnp.dtype(jnp.float32), interpret=True, k_splits=k_splits,
        tiles=qmm.Tiles(**{**qmm.DOT_TILES._asdict(), **tiles}) if tiles else None)
    whole = run(x, block_n=64, block_k=256, k_splits=1)
    split = run(x, block_n=16, block_k=32, k_splits=4)
    np.testing.assert_allclose(np.asarray(split), np.asarray(whole), rtol=1e-5, atol=1e-5)
    want = np.asarray(x, np.float64) @ np.asarray(qmm.dequantize(data, scales, fmt), np.float64)
    np.testing.assert_allclose(np.asarray(whole), want, rtol=1e-5, atol=1e-5)
    if m > 1:
        assert np.array_equal(np.asarray(run(x[:3])), np.asarray(run(x))[:3]), "a row's result depends on its company"
    with pytest.raises(ValueError, match="k_splits=3 does not divide the 8 K tiles"):
        run(x, block_k=32, k_splits=3)


@pytest.mark.parametrize("fmt", qmm.FORMATS)
def test_the_gemvs_unrolled_walk_and_evicting_loads_give_the_loops_sums(fmt):
    """`Tiles.unroll` (straight-line K walk) and `Tiles.evict` (an L2 hint on the weight loads) change how the
    GEMV runs, not what it sums: the hint changes no bit; the unrolled walk adds the same products in the same
    order, so it agrees to float32 rounding (the compiler may fuse a multiply-add differently in straight-line
    code than in a loop body, as XLA:CPU does for int8 and q4_0 here)."""
    rng = np.random.RandomState(5)
    data, scales = _random_packed(rng, 512, 96, fmt)
    x = jnp.asarray(rng.randn(1, 512), jnp.float32)
    loop = qmm.Tiles(block_n=32, block_k=64, programs=6, num_warps=4, num_stages=1)
    run = lambda t: np.asarray(qmm._pallas_matmul(x, data, scales, fmt=fmt, compute=jnp.dtype(jnp.float32),
                                                  interpret=True, tiles=t))
    want, unrolled = run(loop), run(loop._replace(unroll=True))
    assert np.array_equal(run(loop._replace(evict=True)), want)
    assert np.array_equal(run(loop._replace(unroll=True, evict=True)), unrolled)
    np.testing.assert_allclose(unrolled, want, rtol=1e-6, atol=1e-6)
    exact = np.asarray(x, np.float64) @ np.asarray(qmm.dequantize(data, scales, fmt), np.float64)
    np.testing.assert_allclose(want, exact, rtol=1e-5, atol=1e-5)


def test_int8_takes_k_tiles_under_a_block_and_the_block_formats_round_them_up_to_one():
    rng = np.random.RandomState(6)
    x = jnp.asarray(rng.randn(1, 256), jnp.float32)
    tiles = qmm.Tiles(block_n=64, block_k=8, programs=8, num_warps=2, num_stages=1, unroll=True)
    data, scales = _random_packed(rng, 256, 64, "int8")
    got = qmm._pallas_matmul(x, data, scales, fmt="int8", compute=jnp.dtype(jnp.float32), interpret=True, tiles=tiles)
    np.testing.assert_allclose(np.asarray(got), np.asarray(qmm.quant_matmul(x, data, scales, "int8")), rtol=1e-5,
                               atol=1e-5)
    for fmt in ("q8_0", "q4_0"):  # the default GEMV tiles (K 16) serve every format
        data, scales = _random_packed(rng, 256, 64, fmt)
        run = lambda t: np.asarray(qmm._pallas_matmul(x, data, scales, fmt=fmt, compute=jnp.dtype(jnp.float32),
                                                      interpret=True, tiles=t))
        assert np.array_equal(run(tiles), run(tiles._replace(block_k=qmm.BLOCK)))


@pytest.mark.parametrize("fmt", qmm.FORMATS)
@pytest.mark.parametrize("bm", [16, 32, 64])
def test_kernel_stages_fit_shared_memory(fmt, bm):
    """At 64 q8_0 rows the default three stages asked an H200 for 233,472 bytes of shared memory (232,448 there):
    stages drop until the estimate fits, and only where they must (fewer rows ran at three)."""
    t = qmm.Tiles(block_n=128, block_k=256, programs=264, num_warps=4, num_stages=3)
    stages = qmm.fit_stages(bm, t.block_n, t.block_k, 2, fmt, t.num_stages)
    packed = t.block_k // 2 if fmt == "q4_0" else t.block_k
    scales = 4 if fmt == "int8" else t.block_k // qmm.BLOCK * 2
    per_stage = bm * t.block_k * 2 + packed * t.block_n + scales * t.block_n
    assert stages * per_stage + bm * t.block_n * 4 <= qmm.SMEM_BYTES
    assert stages == (2 if (fmt, bm) == ("q8_0", 64) else t.num_stages)


def test_rows_past_the_kernel_and_untileable_widths_take_the_reference():
    rng = np.random.RandomState(4)
    data, scales = _random_packed(rng, 64, 24, "int8")  # N = 24: no power-of-two factor of 16
    x = jnp.asarray(rng.randn(3, 64), jnp.float32)
    assert not qmm.kernel_fits(64, 24) and qmm.kernel_fits(64, 48)
    assert np.array_equal(np.asarray(qmm.quant_matmul(x, data, scales, "int8", impl="pallas", interpret=True)),
                          np.asarray(qmm.quant_matmul(x, data, scales, "int8")))
    big = jnp.asarray(rng.randn(qmm.MAX_ROWS + 1, 64), jnp.float32)
    data, scales = _random_packed(rng, 64, 32, "int8")
    text = jax.jit(lambda a: qmm.quant_matmul(a, data, scales, "int8", impl="pallas")).lower(big).as_text()
    assert "pallas" not in text and "interpret" not in text.lower()
    for fmt in qmm.FORMATS:
        data, scales = _random_packed(rng, 64, 32, fmt)
        looped = lambda m: "stablehlo.while" in jax.jit(  # the interpreted kernel walks its grid; the reference cannot
            lambda a: qmm.quant_matmul(a, data, scales, fmt, impl="pallas")).lower(jnp.zeros((m, 64))).as_text()
        assert looped(qmm.MAX_ROWS), f"{fmt}: {qmm.MAX_ROWS} rows did not take the kernel"
        assert not looped(qmm.MAX_ROWS + 1), f"{fmt}: rows past the kernel took it"


@pytest.mark.parametrize("args, match", [
    (("x", "q5_0"), r"fmt='q5_0' is not a weight format"),
    (("x", "int8", "triton"), r"impl='triton' is not supported"),
    (("f16data", "q8_0"), r"q8_0 holds data int8 and scales float16; got float16"),
    (("x_wide", "q8_0"), r"x \(2, 33\) must end in K = 32"),
    (("short_scales", "q8_0"), r"do not describe one weight"),
    (("int_x", "q8_0"), r"x has dtype int32; expected a floating dtype"),
])
def test_bad_product_inputs_are_refused_with_a_sentence(args, match):
    data, scales = (jnp.asarray(a) for a in quant.encode(np.ones((32, 16), np.float32), "q8_0"))
    x, what = jnp.ones((2, 32), jnp.float32), args[0]
    if what == "f16data":
        data = data.astype(jnp.float16)
    if what == "x_wide":
        x = jnp.ones((2, 33), jnp.float32)
    if what == "short_scales":
        scales = scales[:0]
    if what == "int_x":
        x = jnp.ones((2, 32), jnp.int32)
    with pytest.raises(ValueError, match=match):
        qmm.quant_matmul(x, data, scales, args[1], impl=args[2] if len(args) > 2 else "xla")


def test_kernel_lowers_to_triton_for_cuda():
    """The Pallas-to-Triton lowering runs here without a GPU: an op Triton cannot take fails at this step (bf16,
    Qwen3-8B shapes, 1 and 16 rows, every format)."""
    for fmt in qmm.FORMATS:
        for m, k, n in ((1, 4096, 6144), (16, 12288, 4096)):
            data_shape, scale_shape = qmm.packed_shapes((k, n), fmt)
            args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
                    jax.ShapeDtypeStruct(data_shape, jnp.dtype(qmm.PACKED_DTYPES[fmt][0])),
                    jax.ShapeDtypeStruct(scale_shape, jnp.dtype(qmm.PACKED_DTYPES[fmt][1])))
            fn = jax.jit(lambda a, d, s: qmm.quant_matmul(a, d, s, fmt, impl="pallas"))
            text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            assert text.count("__gpu$xla.gpu.triton") == 1, f"{fmt} rows {m}: no Triton call"


def test_auto_takes_the_measured_form_and_its_column_reduction_equals_the_reference(monkeypatch):
    """`impl="auto"` (the GPU default): one row through an int8 LM head takes XLA's column reduction, everything else
    the kernel for its rows (one int8 row through a layer's weight the GEMV); each form gives the reference's
    result."""
    big = qmm.REDUCE_MIN_ELEMENTS
    assert qmm.choose("int8", 1, 4096, 151936) == "reduce", "Qwen3's LM head"
    assert qmm.choose("int8", 1, 4096, big // 4096) == "reduce"
    assert qmm.choose("int8", 1, 4096, big // 4096 - 16) == qmm.choose("int8", 1, 4096, 24576) == "pallas"
    assert qmm.choose("int8", 2, 4096, big // 4096) == "pallas"
    assert {qmm.choose(f, m, 4096, big // 4096) for f in ("q8_0", "q4_0") for m in (1, 16)} == {"pallas"}
    rng = np.random.RandomState(7)
    data, scales = _random_packed(rng, 256, 96, "int8")
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jnp.asarray(rng.randn(1, 1, 256), jnp.float32)
        ref = qmm.quant_matmul(x, data, scales, "int8", compute_dtype=dtype)
        got = qmm._column_reduction(x.astype(dtype), data, scales, jnp.dtype(dtype))
        assert got.shape == ref.shape == (1, 1, 96) and got.dtype == ref.dtype == dtype
        tol = 1e-5 if dtype == jnp.float32 else 1e-2
        np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(ref, np.float64), rtol=tol, atol=tol)
        with monkeypatch.context() as m:  # this weight counts as large: auto's dispatch takes the reduction
            m.setattr(qmm, "REDUCE_MIN_ELEMENTS", 256 * 96)
            assert qmm.choose("int8", 1, 256, 96) == "reduce"
            auto = qmm.quant_matmul(x, data, scales, "int8", compute_dtype=dtype, impl="auto")
        assert np.array_equal(np.asarray(auto, np.float32), np.asarray(got, np.float32))
    x = jnp.asarray(rng.randn(3, 256), jnp.float32)
    np.testing.assert_allclose(np.asarray(qmm.quant_matmul(x, data, scales, "int8", impl="auto")),
                               np.asarray(qmm.quant_matmul(x, data, scales, "int8")), rtol=1e-5, atol=1e-5)


def test_default_impl_is_the_reference_off_gpu_and_a_known_impl_on_gpu():
    assert qmm.default_impl("cpu") == "xla"
    assert qmm.default_impl("gpu") == qmm.GPU_DEFAULT_IMPL in qmm.IMPLS


def test_matmul_dispatches_a_quantised_weight_and_leaves_float_products_as_they_were():
    rng = np.random.RandomState(5)
    w = (rng.randn(64, 32) * 0.1).astype(np.float32)
    x = jnp.asarray(rng.randn(3, 64), jnp.float32)
    q = quant.quantize_array(w, "q8_0")
    np.testing.assert_array_equal(np.asarray(matmul(x, q)), np.asarray(qmm.quant_matmul(x, q.data, q.scales, "q8_0")))
    assert matmul(x.astype(jnp.bfloat16), quant.quantize_array(w, "q8_0", jnp.bfloat16)).dtype == jnp.bfloat16
    assert matmul(x, q, preferred_element_type=jnp.float32).dtype == jnp.float32
    plain = matmul(x, jnp.asarray(w))
    assert np.array_equal(np.asarray(plain), np.asarray(jnp.matmul(x, jnp.asarray(w), precision="highest")))


# ---------------------------------------------------------------------------------------
# Precision: policy, plans, quantised models.


def test_precision_resolves_keyword_then_environment_then_default_and_refuses_unknown_values():
    assert policy.precision(None, env={}) == ("bf16", "census")
    assert policy.precision(None, env={"DFLASH_PREC": "int4"}) == ("q4_0", "DFLASH_PREC")
    assert policy.precision("q8_0", env={"DFLASH_PREC": "int4"}) == ("q8_0", "keyword")
    assert policy.precision(None, env={"DFLASH_PREC": "q4_0"}, target=True) == ("bf16", "census"), \
        "DFLASH_PREC is the drafter's: a quantised target would change the output"
    assert policy.precision(None, env={"DFLASH_TARGET_PREC": "int8"}, target=True) == ("int8", "DFLASH_TARGET_PREC")
    assert policy.precision(None, env={}, default="mixed") == ("mixed", "census")
    with pytest.raises(ValueError, match=r"precision='fp8' \(keyword\): unknown precision; choices: bf16, int8, "
                                         r"q8_0, q4_0, mixed, int4"):
        policy.precision("fp8", env={})
    with pytest.raises(ValueError, match=r"DFLASH_TARGET_PREC='q3': unknown target_precision"):
        policy.precision(None, env={"DFLASH_TARGET_PREC": "q3"}, target=True)


def test_each_precision_quantises_the_groups_the_original_does():
    shapes = {"fc": (64, 32), "norm": (32,), "markov_w1": (64, 32), "markov_w2": (32, 64),
              "layers_0": {"wq": (32, 32), "w_gate_up": (32, 128), "w_down": (64, 32), "attn_norm": (32,),
                           "attn_conv_proj": (32, 16)},
              "layers_1": {"router": (32, 8), "w_gate_up": (8, 32, 64), "shared_down": (64, 32)}}
    mlp = {("layers_0", "w_gate_up"), ("layers_0", "w_down"), ("layers_1", "shared_down")}
    linear = {("fc",), ("markov_w2",), ("layers_0", "wq"), ("layers_0", "attn_conv_proj")} | mlp
    assert quant.plan(shapes, "bf16") == {}
    assert quant.plan(shapes, "q8_0") == {p: "q8_0" for p in linear}
    assert quant.plan(shapes, "q4_0") == {**{p: "q4_0" for p in linear}, ("markov_w2",): "q8_0"}
    assert quant.plan(shapes, "int8") == {p: "int8" for p in linear}
    assert quant.plan(shapes, "mixed") == {**{p: "q8_0" for p in mlp}, ("markov_w2",): "q8_0"}
    lines = quant.describe(shapes, "mixed")
    assert "mlp: q8_0 (3 tensors)" in lines and "attention: float (kept) (1 tensor)" in lines
    assert any(line.startswith("MoE experts: float (kept; 1 tensor") for line in lines)
    with pytest.raises(ValueError, match="precision 'int4' is unknown"):
        quant.plan(shapes, "int4")  # aliases resolve in the policy, before a plan


def test_quantize_refuses_a_quantised_model_and_unknown_precisions(target):
    q = quant.quantize(target, "q8_0")
    assert quant.precision_of(q.params) == "q8_0" and quant.precision_of(target.params) == "bf16"
    with pytest.raises(ValueError, match=r"already quantised \(q8_0\); quantise the float model"):
        quant.quantize(q, "q4_0")
    with pytest.raises(ValueError, match="unknown precision"):
        quant.quantize(target, "q6_k")


@pytest.fixture(scope="module")
def plain(target):
    return dflash_jax.generate(target, None, PROMPTS, max_new_tokens=MAX_NEW).tokens


@pytest.mark.parametrize("precision", ["q8_0", "q4_0"])
def test_greedy_speculative_with_a_quantised_drafter_equals_plain_greedy(target, plain, precision):
    drafter = quant.quantize(tiny_drafter(target, 8), precision)
    assert quant.formats_of(drafter.params), "nothing was quantised"
    out = dflash_jax.generate(target, drafter, PROMPTS, max_new_tokens=MAX_NEW)
    assert out.tokens == plain, f"{precision} drafter: speculative output differs from plain greedy"


@pytest.mark.parametrize("precision", ["q8_0", "q4_0", "int8"])
def test_a_quantised_drafter_proposes_through_its_own_copy_of_the_targets_head_and_stays_lossless(
        target, plain, precision, monkeypatch):
    monkeypatch.delenv("DFLASH_PROPOSAL_HEAD", raising=False)
    drafter = quant.quantize(tiny_drafter(target, 8), precision)
    headed = drafter.with_head(target)
    head = np.asarray(target.params["lm_head"])
    assert headed.head.fmt == precision and headed.head.shape == head.shape
    want = quant.quantize_array(head, precision)
    assert np.array_equal(headed.head.data, want.data) and np.array_equal(headed.head.scales, want.scales)
    h = jax.random.normal(jax.random.PRNGKey(3), (2, 8, target.config.hidden_size), jnp.float32)
    got = np.asarray(headed.harvest_logits(target, h))
    ref = np.asarray(h[:, 1:]) @ np.asarray(qmm.dequantize(want.data, want.scales, precision), np.float32)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    assert np.abs(got - np.asarray(drafter.harvest_logits(target, h))).max() > 1e-4, "the target's head was read"
    out = dflash_jax.generate(target, headed, PROMPTS, max_new_tokens=MAX_NEW)
    assert out.tokens == plain, f"{precision} drafter with its head copy: speculative output differs from plain"
    for batch, rows, copy in ((4, 17, True), (5, 16, False)):  # 64 draft rows read the copy in place, 75 cannot
        wide = jax.random.normal(jax.random.PRNGKey(batch), (batch, rows, target.config.hidden_size), jnp.float32)
        same = np.array_equal(headed.harvest_logits(target, wide), drafter.harvest_logits(target, wide))
        assert same != copy, f"{batch * (rows - 1)} draft rows should read the {'copy' if copy else 'target head'}"


def test_no_head_copy_is_made_for_a_float_head_or_when_switched_off(target, monkeypatch):
    monkeypatch.delenv("DFLASH_PROPOSAL_HEAD", raising=False)
    float_drafter = tiny_drafter(target, 4)
    q8 = quant.quantize(float_drafter, "q8_0")
    assert float_drafter.with_head(target).head is None, "bf16 keeps the head float"
    assert quant.quantize(float_drafter, "mixed").with_head(target).head is None, "mixed keeps the head float"
    assert q8.with_head(quant.quantize(target, "int8")).head is None, "the target's head is already quantised"
    assert q8.with_head(target, enabled=False).head is None
    assert q8.with_head(target).with_head(target, enabled=False).head is None, "switching it off drops a copy"
    monkeypatch.setenv("DFLASH_PROPOSAL_HEAD", "0")
    assert q8.with_head(target).head is None
    assert q8.with_head(target, enabled=True).head is not None, "the keyword outranks the environment"
    monkeypatch.setenv("DFLASH_PROPOSAL_HEAD", "yes")
    with pytest.raises(ValueError, match=r"DFLASH_PROPOSAL_HEAD='yes': unknown proposal_head; choices: 0, 1"):
        q8.with_head(target)


def test_a_tied_head_is_copied_from_the_embedding_and_a_softcap_still_applies(monkeypatch):
    monkeypatch.delenv("DFLASH_PROPOSAL_HEAD", raising=False)
    tied = tiny_target(0)
    tied = tied.replace(config=dataclasses.replace(tied.config, tie_word_embeddings=True),
                        params={k: v for k, v in tied.params.items() if k != "lm_head"})
    headed = quant.quantize(tiny_drafter(tied, 4), "q8_0").with_head(tied)
    assert np.array_equal(headed.head.data, quant.quantize_array(np.asarray(tied.params["embed"]).T, "q8_0").data)
    gemma = tiny_gemma4()
    headed = quant.quantize(tiny_drafter(gemma, 4, tap_ids=(0, 2)), "q8_0").with_head(gemma)
    h = 50.0 * jax.random.normal(jax.random.PRNGKey(4), (1, 4, gemma.config.hidden_size), jnp.float32)
    logits = np.asarray(gemma.logits(h, headed.head))
    cap = gemma.config.final_logit_softcapping
    assert np.abs(logits).max() < cap and np.abs(logits).max() > 0.5 * cap, "the soft-cap is Gemma-4's, copy or not"


def test_a_quantised_target_decodes_speculatively_as_it_decodes_plainly(target, plain):
    qt = quant.quantize(target, "q4_0")
    own = dflash_jax.generate(qt, None, PROMPTS, max_new_tokens=MAX_NEW).tokens
    assert own != plain, "a quantised random target should change some tokens (else this test has no teeth)"
    spec = dflash_jax.generate(qt, quant.quantize(tiny_drafter(target, 4), "int8"), PROMPTS, max_new_tokens=MAX_NEW)
    assert spec.tokens == own


def test_a_quantised_hybrid_target_runs_through_the_same_product():
    """Gated DeltaNet projections, gated attention and the MLP of a hybrid take quantised weights unchanged."""
    hybrid = tiny_hybrid()
    qt = quant.quantize(hybrid, "int8")
    assert {k[-1] for k in quant.formats_of(qt.params)} >= {"in_proj", "out_proj", "wqkv", "wo", "w_gate_up"}
    tokens = np.asarray([PROMPTS[2]])
    ref, got = (np.asarray(m.full_logits(tokens)) for m in (hybrid, qt))
    assert 1e-4 < np.abs(got - ref).max() <= 0.05 * np.abs(ref).max()


@pytest.fixture(scope="module")
def demo_logits():
    demo = dflash_jax.load_demo()
    source = "import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n        return f.readlines()\n" * 4
    ids = np.asarray([demo.tokenizer.encode(source)[:96]])
    return demo, ids, np.asarray(demo.target.full_logits(ids))


# measured on the demo target (96 tokens): max |dlogit| int8 0.11, q8_0 0.09, mixed 0.06, q4_0 1.5; mean TV of the
# next-token distribution 0.006, 0.004, 0.003, 0.07. The bounds leave about 2x.
LOGIT_TOLERANCE = {"int8": (0.25, 0.02), "q8_0": (0.2, 0.02), "mixed": (0.15, 0.01), "q4_0": (3.0, 0.15)}


@pytest.mark.parametrize("precision", ["int8", "q8_0", "q4_0"])
def test_a_quantised_targets_logits_stay_near_the_float_targets(demo_logits, precision):
    demo, ids, ref = demo_logits
    got = np.asarray(quant.quantize(demo.target, precision).full_logits(ids))
    max_abs, mean_tv = LOGIT_TOLERANCE[precision]
    err = np.abs(got - ref).max()
    p, q = (jax.nn.softmax(jnp.asarray(a), axis=-1) for a in (ref, got))
    tv = float(0.5 * jnp.abs(p - q).sum(-1).mean())
    assert 1e-4 < err <= max_abs, f"{precision}: max |logit difference| {err}"
    assert tv <= mean_tv, f"{precision}: mean total variation {tv}"


def test_demo_drafters_of_the_other_families_draft_from_quantised_heads():
    """DSpark's Markov W2 and DFlash2's convolution and selector projections go through the same product."""
    for family, head in (("dspark", "markov_w2"), ("dflash2", "selector_hidden")):
        demo = dflash_jax.load_demo(drafter=family, precision="q4_0")
        formats = quant.formats_of(demo.drafter.params)
        assert formats[(head,)] == ("q8_0" if family == "dspark" else "q4_0"), "the original keeps W2 at q8_0"
        ids = demo.tokenizer.encode("def read_file(path):")
        prop = dflash_jax.propose(demo.target, demo.drafter, [ids])
        assert np.isfinite(prop.logits).all() and (prop.tokens >= 0).all(), family


# ---------------------------------------------------------------------------------------
# Loading, saving, reloading.


def _same(a, b) -> bool:
    return all(jax.tree.leaves(jax.tree.map(lambda x, y: bool(np.array_equal(np.asarray(x), np.asarray(y))), a, b)))


@pytest.mark.parametrize("precision", ["q8_0", "q4_0", "int8", "mixed"])
def test_quantised_models_save_and_reload_to_identical_params(tmp_path, target, precision):
    qt, qd = quant.quantize(target, precision), quant.quantize(tiny_drafter(target, 4), precision)
    checkpoints.write_target(tmp_path / "t", qt, "float32")
    checkpoints.write_drafter(tmp_path / "d", qd, "float32")
    for folder in ("t", "d"):
        with open(tmp_path / folder / "config.json") as f:
            assert json.load(f)["dflash_jax"]["precision"] == precision
    t2 = dflash_jax.load_target(tmp_path / "t")
    d2 = dflash_jax.load_drafter(tmp_path / "d", t2)
    assert jax.tree.structure(t2.params) == jax.tree.structure(qt.params) and _same(t2.params, qt.params)
    assert jax.tree.structure(d2.params) == jax.tree.structure(qd.params) and _same(d2.params, qd.params)
    assert dflash_jax.load_drafter(tmp_path / "d", t2, precision=precision).params is not None


def test_loading_quantises_as_quantize_does_and_a_float_save_keeps_no_precision(tmp_path, target):
    drafter = tiny_drafter(target, 4)
    checkpoints.write_drafter(tmp_path / "d", drafter, "float32")
    with open(tmp_path / "d" / "config.json") as f:
        assert "precision" not in json.load(f).get("dflash_jax", {})
    loaded = dflash_jax.load_drafter(tmp_path / "d", target, precision="q4_0")
    assert _same(loaded.params, quant.quantize(drafter, "q4_0").params)
    assert loaded.head.fmt == "q4_0", "a drafter loaded with its float-headed target copies the head"
    assert dflash_jax.load_drafter(tmp_path / "d", target, precision="q4_0", proposal_head=False).head is None
    assert dflash_jax.load_drafter(tmp_path / "d", precision="q4_0").head is None, "no target, nothing to copy"


def test_the_environment_sets_the_drafters_precision_and_not_the_targets(tmp_path, target, monkeypatch):
    checkpoints.write_target(tmp_path / "t", target, "float32")
    checkpoints.write_drafter(tmp_path / "d", tiny_drafter(target, 4), "float32")
    monkeypatch.setenv("DFLASH_PREC", "int4")
    t = dflash_jax.load_target(tmp_path / "t")
    assert quant.precision_of(t.params) == "bf16"
    assert quant.precision_of(dflash_jax.load_drafter(tmp_path / "d", t).params) == "q4_0"
    assert quant.precision_of(dflash_jax.load_drafter(tmp_path / "d", t, precision="bf16").params) == "bf16"
    monkeypatch.setenv("DFLASH_TARGET_PREC", "mixed")
    assert quant.precision_of(dflash_jax.load_target(tmp_path / "t").params) == "mixed"


def test_a_checkpoint_saved_quantised_loads_only_at_its_precision(tmp_path, target, monkeypatch):
    checkpoints.write_drafter(tmp_path / "d", quant.quantize(tiny_drafter(target, 4), "q8_0"), "float32")
    with pytest.raises(CheckpointError, match=r"saved quantised at q8_0; the precision keyword asks for q4_0.*"
                                              r"Load the float checkpoint"):
        dflash_jax.load_drafter(tmp_path / "d", target, precision="int4")
    monkeypatch.setenv("DFLASH_PREC", "bf16")
    with pytest.raises(CheckpointError, match=r"DFLASH_PREC asks for bf16"):
        dflash_jax.load_drafter(tmp_path / "d", target)


def test_broken_quantised_checkpoints_are_refused_naming_the_tensor(tmp_path, target):
    from safetensors.numpy import load_file, save_file

    checkpoints.write_target(tmp_path / "t", quant.quantize(target, "q8_0"), "float32")
    file = tmp_path / "t" / SINGLE_FILE
    tensors = load_file(file)
    name = "model.layers.0.self_attn.o_proj.weight"
    save_file({**tensors, name: tensors[name].astype(np.float32)}, file)
    with pytest.raises(CheckpointError, match=rf"{name} is F32 in .*, expected I8"):
        dflash_jax.load_target(tmp_path / "t")
    save_file({n: a for n, a in tensors.items() if n != name + "_scale"}, file)
    with pytest.raises(CheckpointError, match=rf"{name}_scale"):
        dflash_jax.load_target(tmp_path / "t")
    save_file(tensors, file)
    config = json.loads((tmp_path / "t" / "config.json").read_text())
    config["dflash_jax"]["precision"] = "q2_k"
    (tmp_path / "t" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"dflash_jax.precision is 'q2_k'; expected one of bf16, int8"):
        dflash_jax.load_target(tmp_path / "t")


# ---------------------------------------------------------------------------------------
# Where it shows: inspect and the command line.


def test_inspect_shows_each_groups_precision(tmp_path, target, capsys, monkeypatch):
    monkeypatch.delenv("DFLASH_PREC", raising=False)
    checkpoints.write_drafter(tmp_path / "d", tiny_drafter(target, 4), "float32")
    checkpoints.write_target(tmp_path / "t", quant.quantize(target, "int8"), "float32")
    assert cli.main(["inspect", str(tmp_path / "d"), "--precision", "mixed"]) == 0
    out = capsys.readouterr().out
    assert "precision: mixed (--precision; the checkpoint holds float weights)" in out
    assert "  mlp: q8_0 (4 tensors)" in out and "  attention: float (kept) (6 tensors)" in out
    assert "lm head" not in out, "mixed keeps the head float: no copy"
    assert cli.main(["inspect", str(tmp_path / "d"), "--precision", "q4_0"]) == 0
    assert "  lm head: the target's; loaded with a target whose head is float, a q4_0 copy of it" in \
        capsys.readouterr().out
    assert cli.main(["inspect", str(tmp_path / "t")]) == 0
    out = capsys.readouterr().out
    assert "precision: int8 (as saved; the checkpoint holds int8)" in out and "  lm head: int8 (1 tensor)" in out
    assert "embeddings, norms, routers and small vectors: float (kept;" in out
    assert cli.main(["inspect", str(tmp_path / "t"), "--precision", "q4_0"]) == 1
    assert "saved quantised at int8" in capsys.readouterr().err


def test_generate_takes_the_drafters_and_the_targets_precision(capsys):
    assert cli.main(["generate", "--prompt", "def f(x):", "--max-new-tokens", "4", "--precision", "q8_0",
                     "--target-precision", "int8"]) == 0
    assert "(block size 16, drafter q8_0 (LM head copy q8_0), target int8)" in capsys.readouterr().err, \
        "the demo target's head is its tied embedding, which stays float, so the drafter copies it"
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--prompt", "x", "--precision", "fp4"])
    assert e.value.code == 2


# ---------------------------------------------------------------------------------------
# The H200 benchmark's CPU mode.


def test_bench_quant_tiny_measures_every_part_and_stays_lossless(tmp_path):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import quant as bench_quant

    payload = bench_quant.main(["--tiny", "--out", str(tmp_path), "--precisions", "q8_0", "--batches", "1",
                                "--reps", "1", "--new", "16", "--calls", "2", "--phase-reps", "1", "--taus", "6.5",
                                "--heads", "copy", "target"])
    assert (tmp_path / "quant_tiny.json").exists() and (tmp_path / "quant_tiny.png").exists()
    assert all(c["ok"] for c in payload["kernel"]["cells"]), "the kernel disagrees with the reference"
    assert all(c["lossless"] and c["no_recompile"] for c in payload["drafter_round"]["cells"])
    assert {c["precision"] for c in payload["target_plain"]["cells"]} == {"bf16", "int8"}
    assert set(payload["summary"]) >= {"q8_0_b1_round_over_plain_step", "q8_0_head_copy_b1_round_over_plain_step",
                                       "target_int8_b1_tokens_per_s_over_bf16"}
    heads = {c["head"]: c["head_bytes"] for c in payload["drafter_round"]["cells"]}
    assert set(heads) == {"q8_0", "target"} and heads["q8_0"] > 0 == heads["target"]
    again = bench_quant.main(["--tiny", "--out", str(tmp_path), "--parts", "target", "--target-precisions", "bf16",
                              "--batches", "1", "--reps", "1", "--new", "16"])
    kept = {(c["precision"], c["head"]) for c in again["drafter_round"]["cells"]}
    assert kept == {("q8_0", "q8_0"), ("q8_0", "target")}, "a later part's run keeps the others"


def test_training_a_quantised_drafter_is_refused_naming_the_way_out():
    from dflash_jax import train

    target = tiny_target(0)
    drafter = dflash_jax.quantize(tiny_drafter(target, 4), "q8_0")
    tc = train.TrainConfig(steps=2, warmup_steps=0, seq_len=16, anchors_per_seq=4, batch_size=1)
    with pytest.raises(ValueError, match=r"quantised weights .* cannot be trained: .* precision='bf16'"):
        train.train_drafter(target, np.arange(64) % target.config.vocab_size, drafter.config, drafter.params, tc,
                            progress=False)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_one_int8_row_through_a_layers_weight_takes_the_default_gemv_and_gets_the_references_sums(dtype):
    """`impl="auto"` sends one row through a layer's int8 weight to the GEMV at `GEMV_TILES` (interpret mode): the
    same result as calling it so, and the reference's within the compute dtype's rounding."""
    rng = np.random.RandomState(3)
    data, scales = _random_packed(rng, 256, 96, "int8")
    assert qmm.choose("int8", 1, 256, 96) == "pallas"
    x = jnp.asarray(rng.randn(1, 256), dtype)
    one = qmm.quant_matmul(x, data, scales, "int8", impl="auto", interpret=True)
    gemv = qmm._pallas_matmul(x, data, scales, fmt="int8", compute=jnp.dtype(dtype), interpret=True,
                              tiles=qmm.GEMV_TILES)
    assert np.array_equal(np.asarray(one, np.float32), np.asarray(gemv.astype(dtype), np.float32))
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(one, np.float32), np.asarray(qmm.quant_matmul(x, data, scales, "int8"),
                               np.float32), rtol=tol, atol=tol)
