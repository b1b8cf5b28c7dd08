"""dynamic_conv: the jnp reference against a numpy loop over the formula, and the Pallas kernel
(interpret mode) against the reference on random shapes and on the DFlash2 fixture's geometry."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from pallas_kernels import dynamic_conv as dc
from pallas_kernels.dynamic_conv import dynamic_conv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the fixture's drafter: hidden 6656, conv_group_size 16 (G 416), conv_kernel_size 2, blocks of 16 rows
REAL_H, REAL_GS, REAL_K, REAL_T = 6656, 16, 2, 16


def oracle(x, dyn, base, which):
    """out[n, t, c] = sum_{o < k, o <= t} (base[which, o, c] + dyn[n, t, which*k*G + o*G + c // gs]) * x[n, t-o, c]."""
    x, dyn, base = (np.asarray(a, np.float64) for a in (x, dyn, base))
    n, t, h = x.shape
    k = base.shape[1]
    g = dyn.shape[2] // (2 * k)
    out = np.zeros_like(x)
    for i in range(n):
        for r in range(t):
            for o in range(min(k, r + 1)):
                weight = base[which, o] + dyn[i, r, which * k * g + o * g + np.arange(h) // (h // g)]
                out[i, r] += weight * x[i, r - o]
    return out


def random_inputs(seed, n, t, h, groups, k, dtype=jnp.float32):
    """x [n, t, h], dyn [n, t, 2*k*groups], base [2, k, h] with unit-normal entries."""
    rng = np.random.default_rng(seed)
    shapes = [(n, t, h), (n, t, 2 * k * groups), (2, k, h)]
    return [jnp.asarray(rng.standard_normal(shape, np.float32), dtype) for shape in shapes]


@functools.partial(jax.jit, static_argnames=("impl", "block_h", "rows"))
def both_halves(x, dyn, base, impl, block_h=None, rows=None):
    """Prepare and finish in one program (one compile); the Pallas path in interpret mode."""
    if impl == "xla" or (block_h, rows) == (None, None):
        return tuple(dynamic_conv(x, dyn, base, which, impl=impl, interpret=True) for which in (0, 1))
    return tuple(dc._pallas_conv(x, dyn, base, which=which, interpret=True, block_h=block_h, rows=rows)
                 for which in (0, 1))


# (N, T, H, G, k)
ORACLE_CASES = [
    pytest.param(2, 4, 12, 3, 1, id="k1-pointwise"),
    pytest.param(1, 5, 12, 4, 2, id="k2-gs3"),
    pytest.param(2, 3, 10, 5, 3, id="k3-gs2"),
    pytest.param(3, 16, 48, 3, 2, id="k2-gs16-T16"),
    pytest.param(1, 2, 6, 2, 3, id="T-below-k"),
    pytest.param(2, 1, 4, 4, 2, id="T1-gs1"),
]


@pytest.mark.parametrize("n, t, h, groups, k", ORACLE_CASES)
def test_xla_reference_follows_the_formula(n, t, h, groups, k):
    x, dyn, base = random_inputs(0, n, t, h, groups, k)
    for which, got in enumerate(both_halves(x, dyn, base, "xla")):
        np.testing.assert_allclose(np.asarray(got), oracle(x, dyn, base, which), atol=1e-5, rtol=1e-5,
                                   err_msg=f"the jnp reference (which={which}) disagrees with the formula")


@pytest.mark.parametrize("n, t, h, groups, k", ORACLE_CASES)
def test_pallas_kernel_matches_reference(n, t, h, groups, k):
    x, dyn, base = random_inputs(1, n, t, h, groups, k)
    for which, (got, want) in enumerate(zip(both_halves(x, dyn, base, "pallas"), both_halves(x, dyn, base, "xla"))):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5,
                                   err_msg=f"the Pallas kernel (which={which}) disagrees with the jnp reference")


@settings(max_examples=12, deadline=None)
@given(st.data())
def test_pallas_kernel_matches_reference_on_random_shapes(data):
    """Random geometry and, half the time, explicit tiles: ragged row chunks, several channel tiles."""
    n = data.draw(st.integers(1, 3), label="N")
    t = data.draw(st.integers(1, 9), label="T")
    k = data.draw(st.integers(1, 3), label="k")
    groups = data.draw(st.sampled_from([1, 2, 3, 4, 8]), label="G")
    h = groups * data.draw(st.sampled_from([1, 2, 3, 4, 16]), label="gs")
    tiles = data.draw(st.booleans(), label="explicit tiles")
    block_h = rows = None
    if tiles:
        block_h = data.draw(st.sampled_from([b for b in (1, 2, 4, 8) if h % b == 0]), label="block_h")
        rows = data.draw(st.integers(1, t), label="rows")
    x, dyn, base = random_inputs(2, n, t, h, groups, k)
    got = both_halves(x, dyn, base, "pallas", block_h, rows)
    want = both_halves(x, dyn, base, "xla")
    for which in (0, 1):
        np.testing.assert_allclose(np.asarray(got[which]), np.asarray(want[which]), atol=1e-5, rtol=1e-5,
                                   err_msg=f"the Pallas kernel (which={which}) disagrees with the jnp reference")


@pytest.mark.parametrize("n, rows", [(1, None), (2, 3)], ids=["N1-default-tiles", "N2-ragged-3-row-chunks"])
def test_pallas_kernel_matches_reference_at_the_real_geometry(n, rows):
    """H 6656 = 13 tiles of 512, G 416 groups of 16, k 2, T 16: the default tiles (one row per program),
    and chunks of 3 rows, each carrying the row before it (the last chunk holds one row)."""
    x, dyn, base = random_inputs(3, n, REAL_T, REAL_H, REAL_H // REAL_GS, REAL_K)
    got = both_halves(x, dyn, base, "pallas", rows=rows)
    want = both_halves(x, dyn, base, "xla")
    for which in (0, 1):
        np.testing.assert_allclose(np.asarray(got[which]), np.asarray(want[which]), atol=1e-5, rtol=1e-5,
                                   err_msg=f"the Pallas kernel (which={which}) disagrees at the real geometry")
        np.testing.assert_allclose(np.asarray(want[which]), oracle(x, dyn, base, which), atol=1e-4, rtol=1e-5,
                                   err_msg=f"the jnp reference (which={which}) disagrees with the formula")


@pytest.mark.parametrize("impl", dc.IMPLS)
def test_blocks_are_independent_and_rows_causal(impl):
    """NaN in block 0 or in block 1's later rows never reaches block 1's output rows before them."""
    n, t, h, groups, k = 2, 6, 24, 3, 3
    x, dyn, base = random_inputs(4, n, t, h, groups, k)
    clean = both_halves(x, dyn, base, impl)
    poisoned_x = x.at[0].set(jnp.nan).at[1, 4:].set(jnp.nan)
    poisoned_dyn = dyn.at[0].set(jnp.nan).at[1, 4:].set(jnp.nan)
    for which, got in enumerate(both_halves(poisoned_x, poisoned_dyn, base, impl)):
        np.testing.assert_array_equal(np.asarray(got[1, :4]), np.asarray(clean[which][1, :4]),
                                      err_msg="block 1's rows 0..3 changed with block 0 or its own later rows")
        # row 0 sees only itself: tap 0 alone
        d0 = np.asarray(dyn[1, 0, which * k * groups: which * k * groups + groups]).repeat(h // groups)
        np.testing.assert_allclose(np.asarray(got[1, 0]), (np.asarray(base[which, 0]) + d0) * np.asarray(x[1, 0]),
                                   atol=1e-6, rtol=1e-6, err_msg="row 0 reached before the block")


def test_bf16_inputs_give_bf16_output_close_to_reference():
    x, dyn, base = random_inputs(5, 2, REAL_T, 1024, 64, REAL_K, dtype=jnp.bfloat16)
    want = [oracle(x, dyn, base, which) for which in (0, 1)]
    for impl in dc.IMPLS:
        for which, got in enumerate(both_halves(x, dyn, base, impl)):
            assert got.dtype == jnp.bfloat16, "the output must come back in x.dtype"
            np.testing.assert_allclose(np.asarray(got, np.float32), want[which], atol=3e-2, rtol=2e-2,
                                       err_msg=f"bf16 {impl} (float32 accumulation) strays from the formula")


def test_pallas_kernel_lowers_to_triton_for_cuda():
    """The Pallas-to-Triton lowering runs here without a GPU: an op Triton cannot take fails at this
    step (bf16, the real geometry, both halves, at the smallest and largest benchmarked batch)."""
    for n in (1, 64):
        x = jax.ShapeDtypeStruct((n, REAL_T, REAL_H), jnp.bfloat16)
        dyn = jax.ShapeDtypeStruct((n, REAL_T, 2 * REAL_K * (REAL_H // REAL_GS)), jnp.bfloat16)
        base = jax.ShapeDtypeStruct((2, REAL_K, REAL_H), jnp.bfloat16)
        fn = jax.jit(lambda a, d, b: [dynamic_conv(a, d, b, which, impl="pallas") for which in (0, 1)])
        text = fn.trace(x, dyn, base).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 2, f"N={n}: the two halves did not lower to two Triton calls"


def test_default_impl_is_the_reference_off_gpu_and_a_known_impl_on_gpu():
    assert dc.default_impl("cpu") == "xla", "Pallas only interprets off a GPU: the reference must be the default"
    assert dc.default_impl("gpu") == dc.GPU_DEFAULT_IMPL
    assert dc.GPU_DEFAULT_IMPL in dc.IMPLS


def _arrays(x=(1, 4, 12), dyn=(1, 4, 12), base=(2, 3, 12), dtype=jnp.float32):
    """Valid by default: k 3, G 2, gs 6."""
    return [jnp.zeros(shape, dtype) for shape in (x, dyn, base)]


@pytest.mark.parametrize("kwargs, match", [
    ({"impl": "triton"}, r"impl='triton'.*\('xla', 'pallas'\)"),
    ({"which": 2}, r"which=2 must be 0 \(prepare\) or 1 \(finish\)"),
    ({"which": -1}, "which=-1 must be 0"),
    ({"which": True}, "which=True must be 0"),
])
def test_bad_impl_and_half_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dynamic_conv(*_arrays(), **{"which": 0, **kwargs})


@pytest.mark.parametrize("shapes, match", [
    ({"x": (4, 12)}, r"x has shape \(4, 12\); expected 3 dims \[N, T, H\]"),
    ({"dyn": (1, 4, 3, 4)}, r"dyn has shape \(1, 4, 3, 4\); expected 3 dims"),
    ({"base": (3, 12)}, r"base has shape \(3, 12\); expected 3 dims \[2, k, H\]"),
    ({"x": (1, 0, 12), "dyn": (1, 0, 12)}, "every axis must be non-empty"),
    ({"base": (3, 3, 12)}, r"base has shape \(3, 3, 12\); expected \[2, k, 12\]"),
    ({"base": (2, 0, 12)}, r"expected \[2, k, 12\] with k >= 1"),
    ({"base": (2, 3, 10)}, r"base has shape \(2, 3, 10\); expected \[2, k, 12\]"),
    ({"dyn": (2, 4, 12)}, r"dyn has shape \(2, 4, 12\); its first two axes must be x's \(1, 4\)"),
    ({"dyn": (1, 5, 12)}, "its first two axes"),
    ({"dyn": (1, 4, 10)}, r"dyn has 10 features; expected 2\*k\*G = a positive multiple of 6 for k = 3"),
    ({"dyn": (1, 4, 0)}, "dyn has 0 features"),
    ({"dyn": (1, 4, 30)}, r"hidden size 12 is not a multiple of G = 5 groups"),
])
def test_mismatched_shapes_are_refused(shapes, match):
    x, dyn, base = _arrays(**shapes)
    for impl in dc.IMPLS:
        with pytest.raises(ValueError, match=match):
            dynamic_conv(x, dyn, base, 0, impl=impl)


def test_integer_inputs_and_bad_tiles_are_refused():
    x, dyn, base = _arrays()
    with pytest.raises(ValueError, match="dyn has dtype int32; expected a floating dtype"):
        dynamic_conv(x, dyn.astype(jnp.int32), base, 1)
    with pytest.raises(ValueError, match="block_h=8 must be a power of two that divides H = 12"):
        dc._pallas_conv(x, dyn, base, which=0, interpret=True, block_h=8)
    with pytest.raises(ValueError, match="block_h=3 must be a power of two"):
        dc._pallas_conv(x, dyn, base, which=0, interpret=True, block_h=3)


def test_benchmark_tiny_run_writes_agreeing_cells(tmp_path):
    """`bench/dynamic_conv.py --tiny` (CPU, Pallas interpreted): speed is not asserted, the report is."""
    run = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "dynamic_conv.py"), "--tiny", "--sweep",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with open(tmp_path / "dynamic_conv_tiny.json") as f:
        report = json.load(f)
    assert report["checks"] and all(c["ok"] for c in report["checks"]), report["checks"]
    halves = {(c["N"], c["half"]) for c in report["cells"]}
    assert halves == {(n, h) for n in (2,) for h in ("prepare", "finish", "layer")}, halves
    for c in report["cells"]:
        assert c["xla_us"] > 0 and c["pallas_us"] > 0 and c["bytes"] > 0 and c["roofline_us"] > 0, c
    assert report["sweep"] and all(s["pallas_us"] > 0 for s in report["sweep"]), report.get("sweep")
    assert report["settings"]["tiny"] is True and report["gpu_default_impl"] in dc.IMPLS
