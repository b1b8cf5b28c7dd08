"""key_sums: the jnp reference against numpy, the Pallas kernel in both lowerings (Triton's interpret mode and JAX's
GPU interpreter for Mosaic GPU) against the reference, their lowerings for CUDA, the refusals, and the sampling
filter's threshold search through them."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import sampling as S
from pallas_kernels import key_sums as K

TOP = 2**32 - 1
interpreted = functools.partial(K.sum_at_or_above, impl="pallas", interpret=True)
mosaic = functools.partial(K.sum_at_or_above, impl="mosaic", interpret=True)


def _keys(rng, shape):
    """Random uint32 keys with the range's ends and repeats among them."""
    keys = rng.integers(0, 2**32, shape, dtype=np.uint64)
    flat = keys.reshape(-1)
    if flat.size > 12:
        flat[:4] = [0, TOP, 1, TOP - 1]
        flat[4:12] = flat[12]
    return keys.astype(np.uint32)


@pytest.mark.parametrize("lead, v, p", [((3,), 1000, 7), ((2, 3), 300, 1), ((1,), 5000, 15), ((4,), 64, 16),
                                        ((2,), 777, 31), ((1, 1), 1, 2)])
def test_the_kernel_gives_the_reference_counts_and_masses(lead, v, p):
    """Any vocabulary (ragged against the chunk, shorter than one), any pivot count (padded to a power of two),
    any leading dimensions: counts exactly, masses to float32 summation order. Both equal numpy."""
    rng = np.random.default_rng(v + p)
    keys = _keys(rng, lead + (v,))
    pivots = rng.integers(0, 2**32, lead + (p,), dtype=np.uint64).astype(np.uint32)
    pivots.reshape(-1)[0] = 0  # every key is >= 0: the whole row
    if p > 1:
        pivots.reshape(-1)[1] = TOP
    values = rng.random(lead + (v,)).astype(np.float32)
    above = keys.astype(np.uint64)[..., None, :] >= pivots.astype(np.uint64)[..., :, None]
    want_count, want_mass = above.sum(-1), np.where(above, values[..., None, :].astype(np.float64), 0).sum(-1)
    for fn in (K.reference, interpreted, mosaic):
        count = fn(jnp.asarray(keys), jnp.asarray(pivots))
        mass = fn(jnp.asarray(keys), jnp.asarray(pivots), jnp.asarray(values))
        assert count.dtype == jnp.int32 and mass.dtype == jnp.float32
        assert count.shape == mass.shape == lead + (p,)
        np.testing.assert_array_equal(np.asarray(count), want_count)
        np.testing.assert_allclose(np.asarray(mass), want_mass, rtol=2e-6, atol=1e-6)
    assert int(np.asarray(interpreted(jnp.asarray(keys), jnp.asarray(pivots))).reshape(-1)[0]) == v


@pytest.mark.parametrize("fn", [interpreted, mosaic], ids=["triton", "mosaic"])
def test_padding_never_counts(fn):
    """The padded keys (the smallest key) and pivots leave every sum as it was: a row of v keys all 0 against
    pivot 0 counts v, not the chunk (the Mosaic GPU program counts the padding there and it is taken off)."""
    v = 3
    keys, pivots = jnp.zeros((2, v), jnp.uint32), jnp.zeros((2, 3), jnp.uint32)
    assert K.chunk_size(3) > v
    np.testing.assert_array_equal(np.asarray(fn(keys, pivots)), np.full((2, 3), v))
    np.testing.assert_array_equal(np.asarray(fn(keys, pivots + 1)), np.zeros((2, 3)))
    np.testing.assert_array_equal(np.asarray(fn(keys, pivots, jnp.ones((2, v), jnp.float32))), np.full((2, 3), v))


@pytest.mark.parametrize("p", [1, 2, 7, 15, 31])
def test_the_kernel_lowers_to_triton_for_cuda(p):
    """The Pallas-to-Triton lowering runs here without a GPU (an op Triton cannot take fails at this step): a
    verify's rows of a real vocabulary, counts and masses."""
    keys = jax.ShapeDtypeStruct((16, 151936), jnp.uint32)
    pivots = jax.ShapeDtypeStruct((16, p), jnp.uint32)
    values = jax.ShapeDtypeStruct((16, 151936), jnp.float32)
    fn = jax.jit(lambda k, q, w: (K.sum_at_or_above(k, q, impl="pallas"), K.sum_at_or_above(k, q, w, impl="pallas")))
    text = fn.trace(keys, pivots, values).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2 and 'name = "key_sums"' in text


@pytest.mark.parametrize("p", [1, 7, 31, 33])
def test_the_kernel_lowers_to_mosaic_gpu_for_cuda_and_takes_the_reference_elsewhere(p):
    """Mosaic GPU's lowering also runs without a GPU (its copy and layout limits fail here); a program lowered for
    the CPU holds the reference."""
    keys = jax.ShapeDtypeStruct((16, 151936), jnp.uint32)
    pivots = jax.ShapeDtypeStruct((16, p), jnp.uint32)
    values = jax.ShapeDtypeStruct((16, 151936), jnp.float32)
    fn = jax.jit(lambda k, q, w: (K.sum_at_or_above(k, q, impl="mosaic"), K.sum_at_or_above(k, q, w, impl="mosaic")))
    traced = fn.trace(keys, pivots, values)
    assert traced.lower(lowering_platforms=("cuda",)).as_text().count("custom_call @mosaic_gpu") == 2
    assert "mosaic_gpu" not in traced.lower(lowering_platforms=("cpu",)).as_text()


@pytest.mark.parametrize("kwargs, match", [
    ({"impl": "cub"}, r"impl='cub' is not supported; choose one of \('xla', 'pallas', 'mosaic'\)"),
    ({"keys": np.zeros((2, 8), np.int32)}, "must be uint32 order keys"),
    ({"pivots": np.zeros((3, 2), np.uint32)}, r"leading \(row\) dimensions"),
    ({"values": np.zeros((2, 8), np.float16)}, "must be float32 of the keys' shape"),
    ({"values": np.zeros((2, 9), np.float32)}, "must be float32 of the keys' shape"),
])
def test_bad_arguments_are_refused_by_name(kwargs, match):
    args = {"keys": np.zeros((2, 8), np.uint32), "pivots": np.zeros((2, 2), np.uint32), "values": None,
            "impl": "pallas"} | kwargs
    with pytest.raises(ValueError, match=match):
        K.sum_at_or_above(jnp.asarray(args["keys"]), jnp.asarray(args["pivots"]),
                          None if args["values"] is None else jnp.asarray(args["values"]), impl=args["impl"])


@pytest.mark.parametrize("impl", ["pallas", "mosaic"])
def test_the_threshold_search_through_the_kernel_cuts_where_the_sort_does(impl):
    """`_threshold_keep` with every pass through the interpreted kernel keeps what the sort keeps on rows clear of
    rounding (ties, both zeros, -inf entries; top-k alone, top-p alone, both)."""
    rng = np.random.default_rng(21)
    v = 700
    cases = [(k, p, scale) for k in (1, 7, 50, 0) for p in (0.3, 0.9, 1.0) for scale in (0.1, 3.0)]
    cases = cases if impl == "pallas" else cases[1::3]  # JAX's GPU interpreter runs each program's threads: slow
    top_k = jnp.asarray([[c[0]] for c in cases], jnp.int32)
    top_p = jnp.asarray([[c[1]] for c in cases], jnp.float32)
    z = np.round(rng.normal(size=(len(cases), v)) * np.array([c[2] for c in cases])[:, None] * 4) / 4
    z = z.astype(np.float32)
    z[::2, rng.permutation(v)[:v // 3]] = -np.inf
    z[1, :2] = [0.0, -0.0]
    search = jax.jit(lambda z, k, p: S._threshold_keep(z, k, p, 16, impl=impl, interpret=True))
    got = np.asarray(search(jnp.asarray(z), top_k, top_p))
    want = np.asarray(S._sorted_keep(jnp.asarray(z), top_k, top_p))
    rows = np.arange(len(cases))
    np.testing.assert_array_equal(got[rows], want[rows])


def test_the_filter_runs_the_kernel_only_where_compiled_for_a_gpu(monkeypatch):
    """With THRESHOLD_SUMS "pallas" the threshold filter lowers the kernel for CUDA and the reference for the CPU;
    with "xla" neither has it. An unknown value is refused with the choices."""
    monkeypatch.setattr(S, "FILTER_IMPL", "threshold")
    rp = S.row_params(S.Sampling(temperature=0.7, top_k=50, top_p=0.9), 2)
    logits = jax.ShapeDtypeStruct((2, 16, 4096), jnp.float32)

    def lowered(platform):  # a new function each time, so jit traces it under the current setting
        fn = jax.jit(lambda x, r: S.filtered_logprobs(x, r))
        return fn.trace(logits, rp).lower(lowering_platforms=(platform,)).as_text()

    monkeypatch.setattr(S, "THRESHOLD_SUMS", "pallas")
    assert lowered("cuda").count('name = "key_sums"') == 2 * S._search_passes(S.FILTER_WAYS)
    assert "xla.gpu.triton" not in lowered("cpu")
    monkeypatch.setattr(S, "THRESHOLD_SUMS", "mosaic")
    assert lowered("cuda").count("custom_call @mosaic_gpu") == 2 * S._search_passes(S.FILTER_WAYS)
    assert "mosaic_gpu" not in lowered("cpu")
    monkeypatch.setattr(S, "THRESHOLD_SUMS", "xla")
    assert "xla.gpu.triton" not in lowered("cuda") and "mosaic_gpu" not in lowered("cuda")
    monkeypatch.setattr(S, "THRESHOLD_SUMS", "cub")
    with pytest.raises(ValueError, match=r"THRESHOLD_SUMS='cub'.*\('pallas', 'mosaic', 'xla'\)"):
        lowered("cpu")
