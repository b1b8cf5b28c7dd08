"""expert_matmul: the jnp reference against a numpy loop, and the Pallas kernel (interpret mode) against the
reference over shapes that need padding, dead groups, repeated experts, tile overrides and bf16; refusals."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.expert_matmul import (BLOCK_K, BLOCK_N, IMPLS, NUM_STAGES, ROWS, expert_matmul, fit_tiles,
                                          padded_rows, smem_bytes)
from pallas_kernels.windowed_attention import SMEM_BYTES


def inputs(g, m, k, n, e, dtype=jnp.float32, seed=0):
    key = jax.random.key(seed)
    x = jax.random.normal(jax.random.fold_in(key, 0), (g, m, k), jnp.float32).astype(dtype)
    w = jax.random.normal(jax.random.fold_in(key, 1), (e, k, n), jnp.float32).astype(dtype)
    return x, w


def loop(x, w, expert):
    """One group at a time, in float64."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    return np.stack([x[g] @ w[e] if e >= 0 else np.zeros((x.shape[1], w.shape[2])) for g, e in enumerate(expert)])


# (groups, rows, K, N, experts, expert per group)
CASES = [
    pytest.param(1, 1, 32, 16, 4, [2], id="one-row-decode"),
    pytest.param(5, 3, 40, 24, 7, [3, 0, -1, 6, 3], id="padding-dead-and-repeated"),
    pytest.param(4, 17, 300, 70, 5, [4, 1, 0, -1], id="rows-over-one-tile-k-over-two-tiles"),
    pytest.param(3, 2, 16, 16, 3, [-1, -1, -1], id="all-dead"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("g,m,k,n,e,expert", CASES)
def test_matches_the_loop(impl, g, m, k, n, e, expert):
    x, w = inputs(g, m, k, n, e)
    out = expert_matmul(x, w, jnp.asarray(expert, jnp.int32), impl=impl)
    assert out.shape == (g, m, n) and out.dtype == jnp.float32
    ref = loop(x, w, expert)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-4 * np.abs(ref).max(initial=1.0))
    dead = np.asarray(expert) < 0
    assert np.all(np.asarray(out)[dead] == 0.0), "a dead group must give exact zeros"


def test_kernel_equals_reference_with_small_tiles_and_bf16():
    """Tile overrides (several K steps, several output tiles per group, with and without K splits) and bf16
    inputs: the kernel accumulates in float32 like the reference, so they agree to float32 rounding."""
    x, w = inputs(6, 4, 96, 48, 9, jnp.bfloat16, seed=3)
    expert = jnp.asarray([8, 2, 2, -1, 0, 5], jnp.int32)
    ref = expert_matmul(x, w, expert, impl="xla")
    for splits in (1, 3):  # one program per (group, tile), or K cut into 3 splits summed afterwards
        out = expert_matmul(x, w, expert, impl="pallas", block_k=32, block_n=16,
                            target_programs=1 if splits == 1 else 10**6)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-4)
    assert float(jnp.max(jnp.abs(ref))) > 1.0


def test_rows_are_padded_to_a_power_of_two_the_triton_lowering_accepts():
    """A verify of 3 x 16 tokens gives groups of 48 rows, which the Triton lowering refused on the H200 (it takes
    power-of-two blocks only); interpret mode accepts any shape, so the padding itself is checked here."""
    for m in range(1, 200):
        rows = padded_rows(m)
        assert rows >= max(m, ROWS) and rows & (rows - 1) == 0 and rows < 2 * max(m, ROWS), (m, rows)
    x, w = inputs(2, 48, 32, 16, 3, seed=7)
    expert = jnp.asarray([2, 0], jnp.int32)
    np.testing.assert_allclose(np.asarray(expert_matmul(x, w, expert, impl="pallas")), loop(x, w, [2, 0]),
                               rtol=1e-5, atol=1e-4)


def test_tiles_shrink_to_fit_shared_memory_for_tall_groups():
    """The H200 refused 512 bf16 rows per group at the default tiles (it asked for 491,520 bytes); the fitted
    tiles fit, and the short groups of a decode step or a verify keep the swept defaults."""
    defaults = (BLOCK_K, BLOCK_N, NUM_STAGES)
    assert smem_bytes(512, 2, *defaults) == 491_520 > SMEM_BYTES
    assert fit_tiles(16, 2, *defaults) == fit_tiles(16, 4, *defaults) == defaults
    for rows in (64, 256, 512, 2048):
        for itemsize in (2, 4):
            tiles = fit_tiles(rows, itemsize, *defaults)
            assert smem_bytes(rows, itemsize, *tiles) <= SMEM_BYTES and min(tiles[:2]) >= 16, (rows, itemsize, tiles)
    with pytest.raises(ValueError, match="rows"):
        fit_tiles(16384, 4, *defaults)


def test_one_row_groups_and_shared_rows():
    """A decode step's groups of one row, and x given once, `[1, M, K]`, for every group (the step's one token meets
    each of its k experts): the kernel gives the reference's product; dead groups stay exact zeros."""
    x, w = inputs(4, 1, 96, 48, 6, jnp.bfloat16, seed=11)
    expert = jnp.asarray([5, 0, -1, 3], jnp.int32)
    ref = loop(x, w, [5, 0, -1, 3])
    for splits in (1, 3):
        out = expert_matmul(x, w, expert, impl="pallas", block_k=32, block_n=16,
                            target_programs=1 if splits == 1 else 10**6)
        assert out.shape == (4, 1, 48)
        np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-4, atol=1e-3)
        assert np.all(np.asarray(out)[2] == 0.0)
    shared = x[:1]
    ref = loop(jnp.broadcast_to(shared, x.shape), w, [5, 0, -1, 3])
    for impl in IMPLS:
        out = expert_matmul(shared, w, expert, impl=impl)
        assert out.shape == (4, 1, 48), impl
        np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-4, atol=1e-3, err_msg=impl)
    wide = inputs(1, 3, 96, 48, 6, seed=12)[0]
    np.testing.assert_allclose(np.asarray(expert_matmul(wide, w.astype(jnp.float32), expert, impl="pallas")),
                               loop(jnp.broadcast_to(wide, (4, 3, 96)), w, [5, 0, -1, 3]), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("groups, rows", [(1, 1), (8, 1), (8, 16)])
def test_the_kernel_lowers_to_triton_for_cuda(groups, rows):
    """The Pallas-to-Triton lowering runs here without a GPU: a decode step's shared row and its
    8 one-row groups, and a verify's groups of 16, through Qwen3.5-35B-A3B's expert shape."""
    fn = jax.jit(lambda x, w, e: expert_matmul(x, w, e, impl="pallas"))
    args = (jax.ShapeDtypeStruct((groups, rows, 2048), jnp.bfloat16),
            jax.ShapeDtypeStruct((256, 2048, 1024), jnp.bfloat16), jax.ShapeDtypeStruct((8,), jnp.int32))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1 and 'name = "expert_matmul"' in text


def test_jit_gives_the_eager_output():
    x, w = inputs(3, 2, 32, 32, 4, seed=5)
    expert = jnp.asarray([1, 3, -1], jnp.int32)
    fn = jax.jit(lambda a, b, c: expert_matmul(a, b, c, impl="pallas"))
    np.testing.assert_array_equal(np.asarray(fn(x, w, expert)), np.asarray(expert_matmul(x, w, expert,
                                                                                         impl="pallas")))


def test_bad_arguments_are_refused():
    x, w = inputs(2, 1, 16, 16, 3)
    expert = jnp.asarray([0, 1], jnp.int32)
    with pytest.raises(ValueError, match=r"impl='triton' is not supported; choose one of \('xla', 'pallas'\)"):
        expert_matmul(x, w, expert, impl="triton")
    with pytest.raises(ValueError, match=r"takes x \[G, M, K\] \(or \[1, M, K\], shared by every group\)"):
        expert_matmul(x[:, :, :8], w, expert)
    with pytest.raises(ValueError, match=r"takes x \[G, M, K\]"):
        expert_matmul(x, w, expert[:1])
    with pytest.raises(ValueError, match="share one floating dtype"):
        expert_matmul(x.astype(jnp.bfloat16), w, expert)
    with pytest.raises(ValueError, match="expected integer ids"):
        expert_matmul(x, w, expert.astype(jnp.float32))
