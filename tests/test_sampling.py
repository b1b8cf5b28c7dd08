"""Sampling core: filters, random streams, the Leviathan accept rule, residuals, composition.

Composition tests run one verify round for 200k independent rows at once (rows are
independent streams of `rng_key`), so each total-variation estimate costs one jit call.
"""
import numpy as np
import pytest
import jax
import jax.numpy as jnp

from dflash_jax import sampling as S
from dflash_jax.sampling import (
    DenseQ,
    OneHotQ,
    Sampling,
    SparseQ,
    accept_length,
    apply_penalties,
    check_speculative,
    filtered_logprobs,
    greedy_accept,
    residual_logprobs,
    rng_key,
    row_params,
    sample,
    speculative_accept,
)
from conftest import inverted_accept_length, residual_without_q

P = np.array([0.30, 0.22, 0.15, 0.12, 0.09, 0.06, 0.04, 0.02], np.float32)
Q_ROWS = P[::-1].copy()
Q_SPARSE = np.array([0.0, 0.7, 0.0, 0.3, 0.0, 0.0, 0.0, 0.0], np.float32)
V = P.size
N_DRAWS = 200_000
TV_BOUND = 0.01
TEETH_BOUND = 0.05


def tv(a, b):
    return 0.5 * float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).sum())


def histogram(tokens, vocab=V):
    tokens = np.asarray(tokens)
    return np.bincount(tokens, minlength=vocab) / max(tokens.size, 1)


def rows(x, n):
    x = jnp.asarray(x)
    return jnp.broadcast_to(x, (n,) + x.shape)


# --- the accept rule -------------------------------------------------------------------


@pytest.mark.parametrize(
    "p, q, u, want",
    [
        ([0.5, 0.5], [0.5, 0.5], [0.9, 0.9], 2),
        ([0.5, 0.5], [0.5, 0.5], [1.0, 0.0], 0),
        ([0.25], [0.5], [0.5], 0),
        ([1e-6], [0.0], [0.999], 1),
        ([0.9, 0.0, 0.9], [0.1, 0.9, 0.1], [0.5, 0.5, 0.5], 1),
    ],
)
def test_accept_length_is_the_leviathan_rule(p, q, u, want):
    m = accept_length(
        jnp.asarray([p], jnp.float32),
        jnp.asarray([q], jnp.float32),
        jnp.asarray([u], jnp.float32),
        jnp.asarray([len(p)]),
    )
    assert int(m[0]) == want, f"u*q < p walk over p={p} q={q} u={u} must accept {want}, got {int(m[0])}"


def test_accept_length_examines_only_n_valid_slots():
    ones = jnp.full((4, 3), 0.5, jnp.float32)
    m = accept_length(ones, ones, jnp.zeros((4, 3)), jnp.asarray([0, 1, 2, 3]))
    np.testing.assert_array_equal(m, [0, 1, 2, 3], err_msg="always-accepting slots: m must equal n_valid")


# --- residual --------------------------------------------------------------------------


def _np_residual(p, q):
    r = np.maximum(np.asarray(p, np.float64) - np.asarray(q, np.float64), 0.0)
    return r / r.sum()


def test_residual_dense_is_normalized_positive_part_of_p_minus_q():
    out = np.exp(residual_logprobs(jnp.log(P)[None], DenseQ(jnp.asarray(Q_ROWS)[None]), jnp.zeros(1, jnp.int32)))
    np.testing.assert_allclose(out[0], _np_residual(P, Q_ROWS), atol=1e-6,
                               err_msg="dense residual must be normalize(max(p - q, 0))")


def test_residual_sparse_equals_dense_residual_of_the_scattered_q():
    q = SparseQ(ids=jnp.asarray([[1, 3]]), probs=jnp.asarray([[0.7, 0.3]], jnp.float32))
    out = np.exp(residual_logprobs(jnp.log(P)[None], q, jnp.zeros(1, jnp.int32)))
    np.testing.assert_allclose(out[0], _np_residual(P, Q_SPARSE), atol=1e-6,
                               err_msg="sparse q must subtract its probabilities at its candidate ids only")


def test_residual_onehot_removes_the_draft_and_renormalises():
    draft = 2
    out = np.exp(residual_logprobs(jnp.log(P)[None], OneHotQ(), jnp.asarray([draft])))
    want = P.astype(np.float64).copy()
    want[draft] = 0.0
    np.testing.assert_allclose(out[0], want / want.sum(), atol=1e-6,
                               err_msg="one-hot q: the residual is p without the rejected draft")


def test_residual_falls_back_to_p_when_p_equals_q():
    out = residual_logprobs(jnp.log(P)[None], DenseQ(jnp.asarray(P)[None]), jnp.zeros(1, jnp.int32))
    assert not np.isnan(np.asarray(out)).any(), "p == q leaves no residual mass; must not divide 0 by 0"
    np.testing.assert_allclose(np.exp(out[0]), P, atol=1e-6, err_msg="p == q: residual falls back to p")


# --- filters ---------------------------------------------------------------------------


def _np_filtered(x, t, k, top_p, min_p):
    """Reference written from the definitions, float64, independent of the sort trick."""
    x = np.asarray(x, np.float64)
    n = x.size
    if t == 0:
        out = np.full(n, -np.inf)
        out[int(np.argmax(x))] = 0.0
        return out
    z = x / t
    if 0 < k < n:
        z = np.where(z >= np.sort(z)[::-1][k - 1], z, -np.inf)
    if top_p < 1:
        p = np.exp(z - z.max())
        p /= p.sum()
        more_likely_mass = np.array([p[p > p[i]].sum() for i in range(n)])
        z = np.where(more_likely_mass < top_p, z, -np.inf)
    if min_p > 0:
        p = np.exp(z - z.max())
        z = np.where(p >= min_p, z, -np.inf)
    return z - (z.max() + np.log(np.exp(z - z.max()).sum()))


def _random_params(rng, b, vocab):
    return [
        Sampling(
            temperature=float(rng.choice([0.0, 0.5, 1.0, 2.0])),
            top_k=int(rng.choice([0, 1, 3, vocab // 2, vocab, vocab + 5])),
            top_p=float(rng.choice([1.0, 0.9, 0.5, 0.1])),
            min_p=float(rng.choice([0.0, 0.05, 0.3])),
        )
        for _ in range(b)
    ]


def _assert_matches_reference(out, logits, settings):
    out = np.asarray(out)
    assert not np.isnan(out).any(), "filtered log-probs must never be NaN (greedy rows included)"
    for idx in np.ndindex(out.shape[:-1]):
        s = settings[idx[0]]
        want = _np_filtered(logits[idx], s.temperature, s.top_k, s.top_p, s.min_p)
        np.testing.assert_array_equal(np.isfinite(out[idx]), np.isfinite(want),
                                      err_msg=f"support differs at {idx} for {s}")
        np.testing.assert_allclose(np.exp(out[idx]), np.exp(want), atol=1e-5,
                                   err_msg=f"probabilities differ at {idx} for {s}")


def _filter_with(monkeypatch, impl):
    """`filtered_logprobs` jitted afresh with `FILTER_IMPL` set to `impl` (a new function, so jit traces it now)."""
    monkeypatch.setattr(S, "FILTER_IMPL", impl)
    return jax.jit(lambda logits, rp: filtered_logprobs(logits, rp))


@pytest.mark.parametrize("impl", S.FILTER_IMPLS)
def test_filters_match_numpy_reference_on_a_mixed_batch(monkeypatch, impl):
    rng = np.random.default_rng(0)
    b, vocab = 64, 50
    settings = _random_params(rng, b, vocab)
    assert any(s.greedy for s in settings) and any(not s.greedy for s in settings)
    logits = (3.0 * rng.standard_normal((b, vocab))).astype(np.float32)
    out = _filter_with(monkeypatch, impl)(jnp.asarray(logits), row_params(settings, b))
    _assert_matches_reference(out, logits, settings)


@pytest.mark.parametrize("impl", S.FILTER_IMPLS)
def test_filters_apply_per_row_parameters_to_every_slot_of_a_block(monkeypatch, impl):
    rng = np.random.default_rng(1)
    b, slots, vocab = 12, 3, 40
    settings = _random_params(rng, b, vocab)
    logits = (3.0 * rng.standard_normal((b, slots, vocab))).astype(np.float32)
    out = _filter_with(monkeypatch, impl)(jnp.asarray(logits), row_params(settings, b))
    _assert_matches_reference(out, logits, settings)


@pytest.mark.parametrize("impl", S.FILTER_IMPLS)
def test_filters_match_reference_on_edge_rows(monkeypatch, impl):
    """Each cut alone and both, top_k >= V, top_p = 1, over rows with -inf entries, very flat and very peaked."""
    rng = np.random.default_rng(10)
    vocab = 60
    cuts = [(k, p) for k in (0, 1, 7, vocab - 1, vocab, vocab + 3) for p in (1.0, 0.95, 0.6, 0.2)]
    settings = [Sampling(temperature=1.0, top_k=k, top_p=p) for k, p in cuts for _ in range(3)]
    scales = np.tile([1e-3, 2.0, 40.0], len(cuts))
    logits = (scales[:, None] * rng.standard_normal((len(settings), vocab))).astype(np.float32)
    logits[::2, rng.permutation(vocab)[:vocab // 3]] = -np.inf  # every other row: a third of the vocabulary masked
    out = _filter_with(monkeypatch, impl)(jnp.asarray(logits), row_params(settings, len(settings)))
    _assert_matches_reference(out, logits, settings)


def test_filters_without_top_k_or_top_p_match_reference():
    rng = np.random.default_rng(2)
    b, vocab = 16, 30
    settings = [Sampling(temperature=float(t), min_p=float(mp))
                for t, mp in zip(rng.choice([0.0, 0.7, 1.5], b), rng.choice([0.0, 0.2], b))]
    logits = (2.0 * rng.standard_normal((b, vocab))).astype(np.float32)
    out = jax.jit(filtered_logprobs)(jnp.asarray(logits), row_params(settings, b))
    _assert_matches_reference(out, logits, settings)


@pytest.mark.parametrize("impl", S.FILTER_IMPLS)
def test_filter_ties_are_kept_at_the_cut_and_greedy_takes_the_first_max(monkeypatch, impl):
    monkeypatch.setattr(S, "FILTER_IMPL", impl)
    logits = jnp.asarray([[3.0, 3.0, 3.0, 1.0, 0.0], [2.0, 2.0, 0.0, 0.0, 0.0], [1.0, 5.0, 5.0, 0.0, 0.0]])
    rp = row_params([Sampling(temperature=1.0, top_k=2), Sampling(temperature=1.0, top_p=0.3), Sampling()], 3)
    support = np.isfinite(np.asarray(filtered_logprobs(logits, rp)))
    np.testing.assert_array_equal(support[0], [1, 1, 1, 0, 0], err_msg="top-k keeps every tie of the k-th logit")
    np.testing.assert_array_equal(support[1], [1, 1, 0, 0, 0], err_msg="top-p keeps ties of the last kept token")
    np.testing.assert_array_equal(support[2], [0, 1, 0, 0, 0], err_msg="greedy is the first index among ties")


@pytest.mark.parametrize("impl", S.FILTER_IMPLS)
def test_filter_cuts_are_exact_to_the_last_float(monkeypatch, impl):
    """Logits one float apart are cut between them at every position, 0.0 and -0.0 stay together, and a token
    whose mass strictly above is exactly top_p goes."""
    monkeypatch.setattr(S, "FILTER_IMPL", impl)
    adjacent = [np.float32(1.0)]
    for _ in range(7):
        adjacent.append(np.nextafter(adjacent[-1], np.float32(0)))  # 8 near-equal tokens: mass above token i is i/8
    half = np.float32(np.log(0.5))
    assert float(jnp.exp(jnp.float32(half))) == 0.5, "the dyadic row needs exp(log 0.5) == 0.5 exactly"
    cuts = [Sampling(temperature=1.0, top_k=k) for k in range(1, 8)]
    cuts += [Sampling(temperature=1.0, top_p=p) for p in (0.05, 0.2, 0.3, 0.45, 0.55, 0.7, 0.8)]
    settings = cuts + [Sampling(temperature=1.0, top_k=2), Sampling(temperature=1.0, top_p=0.5)]
    logits = jnp.asarray([adjacent] * len(cuts) + [[1.0, 0.0, -0.0, -1.0] + [-np.inf] * 4,
                                                   [0.0, half, half] + [-np.inf] * 5], jnp.float32)
    support = np.isfinite(np.asarray(filtered_logprobs(logits, row_params(settings, len(settings))))).astype(int)
    np.testing.assert_array_equal(support[:len(cuts)], np.arange(8) < np.tile(np.arange(1, 8), 2)[:, None],
                                  err_msg="the n-th of 8 adjacent floats is cut one float below it")
    np.testing.assert_array_equal(support[-2], [1, 1, 1, 0, 0, 0, 0, 0], err_msg="-0.0 ties 0.0 at the cut")
    np.testing.assert_array_equal(support[-1], [1, 0, 0, 0, 0, 0, 0, 0], err_msg="mass above == top_p is not < top_p")


@pytest.mark.parametrize("impl", S.FILTER_IMPLS)
def test_filters_match_hugging_face_warpers(monkeypatch, impl):
    monkeypatch.setattr(S, "FILTER_IMPL", impl)
    torch = pytest.importorskip("torch")
    lp = pytest.importorskip("transformers.generation.logits_process")
    rng = np.random.default_rng(3)
    vocab = 64
    for s in _random_params(rng, 24, vocab):
        if s.greedy:
            continue
        x = (3.0 * rng.standard_normal((1, vocab))).astype(np.float32)
        warpers = [lp.TemperatureLogitsWarper(s.temperature)]
        if s.top_k > 0:
            warpers.append(lp.TopKLogitsWarper(s.top_k))
        if s.top_p < 1:
            warpers.append(lp.TopPLogitsWarper(s.top_p))
        if s.min_p > 0:
            warpers.append(lp.MinPLogitsWarper(s.min_p))
        scores = torch.from_numpy(x.copy())
        for warper in warpers:
            scores = warper(None, scores)
        want = torch.log_softmax(scores, -1).numpy()[0]
        got = np.asarray(filtered_logprobs(jnp.asarray(x), row_params(s, 1)))[0]
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want), err_msg=f"support vs HF for {s}")
        np.testing.assert_allclose(np.exp(got), np.exp(want), atol=1e-5, err_msg=f"probs vs HF for {s}")


def _cut_params(rng, b):
    top_k = jnp.asarray(rng.choice([0, 1, 2, 5, 20, 400], size=(b, 1)), jnp.int32)
    return top_k, jnp.asarray(rng.choice([1.0, 0.3, 0.9, 0.99], size=(b, 1)), jnp.float32)


def test_the_candidate_search_gives_the_sorted_support_exactly_and_knows_when_it_cannot():
    """Small groups make both outcomes common: where `exact` holds the candidates' cut is the full sort's, and the
    filter's support (candidates, or the sort where any row is not exact) always equals the sort's."""
    rng = np.random.default_rng(0)
    outcomes = set()
    cuts = jax.jit(S._candidate_cuts, static_argnums=(3, 4))
    for trial in range(48):
        v, (group, per_group) = (37, 250)[trial % 2], ((4, 1), (8, 2), (16, 3))[trial % 3]
        z = rng.normal(size=(3, v)) * rng.choice([0.1, 1.0, 5.0])
        z = jnp.asarray(np.round(z) if trial % 4 < 2 else z, jnp.float32)  # half the batches full of ties
        top_k, top_p = _cut_params(rng, 3)
        want = np.asarray(jax.jit(S._sorted_keep)(z, top_k, top_p))
        exact, keep = (np.asarray(a) for a in cuts(z, top_k, top_p, group, per_group))
        outcomes |= set(exact[:, 0].tolist())
        np.testing.assert_array_equal(keep[exact[:, 0]], want[exact[:, 0]], err_msg=f"trial {trial}: an exact cut "
                                      "differs from the sorted rule")
        np.testing.assert_array_equal(np.asarray(jax.jit(S._candidate_keep)(z, top_k, top_p)), want)
    assert outcomes == {True, False}, "the cases must exercise both the candidates and the fallback"
    z = jnp.asarray(rng.normal(size=(3, 10)), jnp.float32)  # fewer tokens than a group's candidates: the sort, once
    top_k, top_p = _cut_params(rng, 3)
    exact, keep = S._candidate_cuts(z, top_k, top_p)
    assert bool(jnp.all(exact)), "the sort's cut is exact: the fallback must not sort a second time"
    np.testing.assert_array_equal(np.asarray(keep), np.asarray(S._sorted_keep(z, top_k, top_p)))


def test_common_settings_over_a_real_vocabulary_need_no_sort_and_a_flat_top_p_falls_back():
    v = 151936
    z = jnp.asarray(np.random.default_rng(1).normal(size=(2, v)) * 3, jnp.float32)
    for top_k, top_p, sorted_needed in ((50, 0.9, False), (1000, 1.0, False), (0, 0.5, False), (0, 0.9, True)):
        k, p = jnp.full((2, 1), top_k, jnp.int32), jnp.full((2, 1), top_p, jnp.float32)
        exact, keep = S._candidate_cuts(z, k, p)
        assert bool(jnp.all(exact)) is not sorted_needed, f"top_k {top_k}, top_p {top_p}: exact = {exact}"
        np.testing.assert_array_equal(np.asarray(S._candidate_keep(z, k, p)), np.asarray(S._sorted_keep(z, k, p)))


def test_the_group_search_gives_the_sorted_support_exactly_and_knows_when_it_cannot():
    """Small groups make both outcomes common: where a row fits, the cut from its sorted candidates is the full
    sort's; the filter's support (groups, or the threshold search where any row does not fit) is the sort's."""
    rng = np.random.default_rng(4)
    outcomes = set()
    cuts = jax.jit(S._group_cuts, static_argnums=(3, 4, 5))
    for trial in range(48):
        v, (group, groups, width) = (37, 250)[trial % 2], ((4, 2, 4), (4, 8, 16), (8, 6, 32))[trial % 3]
        z = rng.normal(size=(4, v)) * rng.choice([0.1, 1.0, 5.0])
        z = jnp.asarray(np.round(z) if trial % 4 < 2 else z, jnp.float32)  # half the batches full of ties
        top_k = jnp.asarray(rng.choice([0, 1, 2, 3, 5, 7, 400], size=(4, 1)), jnp.int32)
        top_p = jnp.asarray(rng.choice([1.0, 0.1, 0.3, 0.9, 0.99], size=(4, 1)), jnp.float32)
        want = np.asarray(jax.jit(S._sorted_keep)(z, top_k, top_p))
        fits, keep = (np.asarray(a) for a in cuts(z, top_k, top_p, group, groups, width))
        k_on = (np.asarray(top_k)[:, 0] > 0) & (np.asarray(top_k)[:, 0] < v)
        outcomes |= set(zip(fits[:, 0].tolist(), np.where(k_on, "top-k", "top-p alone or none").tolist()))
        np.testing.assert_array_equal(keep[fits[:, 0]], want[fits[:, 0]], err_msg=f"trial {trial}: a fitting row's "
                                      "cut differs from the sorted rule")
        np.testing.assert_array_equal(np.asarray(jax.jit(S._group_keep)(z, top_k, top_p)), want)
        blocks = cuts(z.reshape(2, 2, v), top_k.reshape(2, 2, 1), top_p.reshape(2, 2, 1), group, groups, width)
        np.testing.assert_array_equal(np.asarray(blocks[1]).reshape(4, v), keep, err_msg="rows of a verify block "
                                      "[B, S, V] are cut as the same rows [B * S, V]")
    assert outcomes == {(fit, kind) for fit in (True, False) for kind in ("top-k", "top-p alone or none")}, \
        "the cases must exercise both the groups and the fallback, with top-k and without"


def test_common_settings_over_a_real_vocabulary_fit_the_groups_and_a_flat_top_p_does_not():
    """Top-k up to `TOP_GROUPS` fits; top-p alone fits where the distribution is peaked enough for its cut to lie
    in the head (logits of scale 6), not over flatter logits (scale 3, where it keeps 13,201 tokens)."""
    v = 151936
    rng = np.random.default_rng(1)
    cases = ((3, 50, 0.9, True), (3, 20, 0.95, True), (3, S.TOP_GROUPS, 1.0, True), (3, 0, 1.0, True),
             (3, S.TOP_GROUPS + 1, 0.9, False), (3, 0, 0.9, False), (6, 0, 0.9, True), (6, 0, 0.5, True))
    for scale, top_k, top_p, fit in cases:
        z = jnp.asarray(rng.normal(size=(2, v)) * scale, jnp.float32)
        k, p = jnp.full((2, 1), top_k, jnp.int32), jnp.full((2, 1), top_p, jnp.float32)
        fits, keep = S._group_cuts(z, k, p)
        assert bool(jnp.all(fits)) is fit, f"scale {scale}, top_k {top_k}, top_p {top_p}: fits = {fits}"
        want = np.asarray(S._sorted_keep(z, k, p))
        if fit:
            np.testing.assert_array_equal(np.asarray(keep), want)
        np.testing.assert_array_equal(np.asarray(S._group_keep(z, k, p)), want)


def test_a_vocabulary_of_few_groups_takes_smaller_ones_and_still_fits_top_k():
    """The demo's 4,096 tokens are 32 groups of `TOP_GROUP`, fewer than top-k 50 needs: its groups shrink so that
    top-k up to `TOP_GROUPS` fits, instead of always paying for the cuts and then the threshold search."""
    v = 4096
    assert -(-v // S.TOP_GROUP) < 50 <= S.TOP_GROUPS, "the case must have too few groups of the default size"
    z = jnp.asarray(np.random.default_rng(5).normal(size=(3, v)) * 3, jnp.float32)
    for top_k, top_p in ((50, 0.9), (20, 1.0), (1, 0.5)):
        k, p = jnp.full((3, 1), top_k, jnp.int32), jnp.full((3, 1), top_p, jnp.float32)
        fits, keep = S._group_cuts(z, k, p)
        assert bool(jnp.all(fits)), f"top_k {top_k}, top_p {top_p}: fits = {fits}"
        np.testing.assert_array_equal(np.asarray(keep), np.asarray(S._sorted_keep(z, k, p)))


def test_the_filter_gives_the_same_distribution_with_either_impl(monkeypatch):
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.normal(size=(4, 3, 300)) * 2, jnp.float32)
    rp = row_params([Sampling(temperature=0.7, top_k=20, top_p=0.9), Sampling(temperature=1.0, top_p=0.5),
                     Sampling(temperature=0.0), Sampling(temperature=1.3, top_k=5, min_p=0.1)], 4)
    got = {impl: np.asarray(_filter_with(monkeypatch, impl)(logits, rp)) for impl in S.FILTER_IMPLS}
    for impl in S.FILTER_IMPLS:
        np.testing.assert_array_equal(np.isfinite(got[impl]), np.isfinite(got["sort"]), err_msg=impl)
        np.testing.assert_allclose(np.exp(got[impl]), np.exp(got["sort"]), atol=1e-7, err_msg=impl)


@pytest.mark.parametrize("impl, present, absent", [("sort", "sort", "top_k"), ("candidates", "top_k", ""),
                                                   ("threshold", "bitcast_convert_type", "sort"),
                                                   ("groups", "top_k", "")])
def test_filter_impl_picks_the_search_that_is_traced(monkeypatch, impl, present, absent):
    """Each impl traces its own search (lax.cond caches a branch by function, which once made every impl the first
    one traced), and the threshold search (its order keys are bitcasts) uses neither a sort nor a top-k, nor a loop."""
    monkeypatch.setattr(S, "FILTER_IMPL", impl)
    rp = row_params(Sampling(temperature=1.0, top_k=5, top_p=0.9), 2)
    jaxpr = str(jax.make_jaxpr(lambda x, rp: filtered_logprobs(x, rp))(jnp.zeros((2, 300)), rp))
    assert f" {present}[" in jaxpr, f"FILTER_IMPL={impl!r} must trace {present}"
    assert not absent or f" {absent}[" not in jaxpr, f"FILTER_IMPL={impl!r} must not trace {absent}"
    if impl == "threshold":
        assert " top_k[" not in jaxpr, "the threshold search must not use lax.top_k"
        assert " scan[" not in jaxpr and " while[" not in jaxpr, "the threshold search's passes must be unrolled"
    monkeypatch.setattr(S, "FILTER_IMPL", "heap")
    with pytest.raises(ValueError, match="FILTER_IMPL='heap'"):
        jax.make_jaxpr(lambda x, rp: filtered_logprobs(x, rp))(jnp.zeros((2, 300)), rp)


def test_the_group_search_is_lowered_for_a_real_vocabulary_and_the_sort_for_a_small_one(monkeypatch):
    """FILTER_IMPL "groups" lowers its cuts (a top-k of the group maxima) and their fallback, the threshold search
    (bitcast order keys), on every platform; a row of at most TOP_CANDIDATES tokens only the sort, which compiles
    fastest and which the group search would do whole anyway."""
    monkeypatch.setattr(S, "FILTER_IMPL", "groups")
    monkeypatch.setattr(S, "THRESHOLD_SUMS", "xla")
    rp = row_params(Sampling(temperature=0.7, top_k=50, top_p=0.9), 2)

    def lowered(platform, v):
        fn = jax.jit(lambda x, r: filtered_logprobs(x, r))
        return fn.trace(jax.ShapeDtypeStruct((2, 4, v), jnp.float32), rp).lower(
            lowering_platforms=(platform,)).as_text()

    for platform in ("cuda", "cpu"):
        big, small = lowered(platform, 4096), lowered(platform, S.TOP_CANDIDATES)
        assert "chlo.top_k" in big and "bitcast_convert" in big, f"{platform}: the group cuts and their fallback"
        assert "chlo.top_k" not in small and "bitcast_convert" not in small, f"{platform}: neither search"
        assert "stablehlo.sort" in small, f"{platform}: a small vocabulary takes the sort"
        assert f"tensor<2x4x{S.TOP_CANDIDATES}xf32>" in small.split("stablehlo.sort", 1)[1][:2000], (
            f"{platform}: a small vocabulary's rows are sorted whole")


def _mass_above_distance(z, top_k, top_p):
    """Per row, in float64: the least distance from top_p of any token's mass strictly above it (over the
    top-k-filtered distribution), where float rounding may split the impls; inf where top-p is off."""
    z = np.asarray(z, np.float64)
    v = z.shape[-1]
    k, p = np.asarray(top_k)[:, 0], np.asarray(top_p, np.float64)[:, 0]
    s = -np.sort(-z, axis=-1)
    thr = np.where((k > 0) & (k < v), s[np.arange(len(s)), np.clip(k, 1, v) - 1], -np.inf)
    e = np.exp(np.where(s >= thr[:, None], s, -np.inf) - s[:, :1])
    mass_before = (np.cumsum(e, axis=-1) - e) / e.sum(-1, keepdims=True)
    first_of_ties = np.concatenate([np.ones_like(s[:, :1], bool), s[:, 1:] != s[:, :-1]], axis=-1)
    distance = np.where(first_of_ties, np.abs(mass_before - p[:, None]), np.inf).min(-1)
    return np.where(p < 1, distance, np.inf)


def _mass_above(x, top_k, token):
    """In float64: the mass strictly above `token` over the top-k-filtered distribution of one row `x`."""
    x = np.asarray(x, np.float64)
    if 0 < top_k < x.size:
        x = np.where(x >= np.sort(x)[::-1][top_k - 1], x, -np.inf)
    p = np.exp(x - x.max())
    return p[x > x[token]].sum() / p.sum()


def test_the_key_search_finds_the_largest_key_that_holds_in_any_range_at_any_ways():
    """`_largest_key` closes any range of uint32 keys, the whole 2**32 included, in its passes, whatever the number
    of parts a pass: the answer at either end of the range, next to an end, and anywhere between."""
    rng = np.random.default_rng(12)
    top = 2**32 - 1
    los = np.array([0, 0, 0, 0, 5, 7, 1000, top, 123] + [0] * 8, np.uint64)
    his = np.array([top, top, top, top, 5, 9, 2000, top, top] + [top] * 8, np.uint64)
    answers = np.array([0, top, 1, top - 1, 5, 8, 1999, top, 2**31] + list(rng.integers(0, 2**32, 8)), np.uint64)
    lo, hi = (jnp.asarray(a[:, None].astype(np.uint32)) for a in (los, his))
    answer = jnp.asarray(answers[:, None].astype(np.uint32))
    for ways in (2, 3, 16, 255):
        got = jax.jit(lambda lo, hi: S._largest_key(lambda t: t <= answer, lo, hi, ways))(lo, hi)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(answer), err_msg=f"{ways} ways")


@pytest.mark.parametrize("ways", [2, 3, 16])
def test_the_threshold_search_gives_the_sorted_support_at_every_width(ways):
    """Every shape of the search `bench/sampling_filter.py` measures cuts where the sort does, on rows clear of
    rounding (ties, both zeros and -inf entries among them)."""
    rng = np.random.default_rng(13)
    v = 300
    cases = [(k, p, scale) for k in (1, 7, v - 1, 0) for p in (0.3, 0.9, 1.0) for scale in (0.1, 3.0)]
    top_k = np.array([[c[0]] for c in cases], np.int32)
    top_p = np.array([[c[1]] for c in cases], np.float32)
    z = np.round(rng.normal(size=(len(cases), v)) * np.array([c[2] for c in cases])[:, None] * 4) / 4
    z = z.astype(np.float32)
    z[::2, rng.permutation(v)[:v // 3]] = -np.inf
    search = jax.jit(lambda z, k, p: S._threshold_keep(z, k, p, ways))
    got = np.asarray(search(jnp.asarray(z), jnp.asarray(top_k), jnp.asarray(top_p)))
    want = np.asarray(S._sorted_keep(jnp.asarray(z), jnp.asarray(top_k), jnp.asarray(top_p)))
    clear = _mass_above_distance(z, top_k, top_p) > 1e-5
    assert clear.sum() >= 0.9 * len(cases), f"only {clear.sum()} of {len(cases)} rows are clear of rounding"
    np.testing.assert_array_equal(got[clear], want[clear])


def test_the_threshold_search_gives_the_sorted_support_exactly():
    """Equal to the sort on every row whose cut is not within rounding of top_p (logit scales 0.1 to 10, ties in
    rounded rows, which hold both -0.0 and 0.0, -inf entries), and on a real vocabulary's rows, where the two may
    split only a token whose mass strictly above lies within rounding of top_p."""
    rng = np.random.default_rng(11)
    v = 2000
    cuts = [(k, p) for k in (1, 2, 50, v - 1, 0) for p in (0.1, 0.5, 0.9, 0.999, 1.0)]
    cases = [(k, p, scale, rounded) for k, p in cuts for scale in (0.1, 1.0, 10.0) for rounded in (False, True)]
    top_k = np.array([[c[0]] for c in cases], np.int32)
    top_p = np.array([[c[1]] for c in cases], np.float32)
    z = rng.normal(size=(len(cases), v)) * np.array([c[2] for c in cases])[:, None]
    z = np.where(np.array([c[3] for c in cases])[:, None], np.round(z), z).astype(np.float32)
    z[::3, rng.permutation(v)[:v // 4]] = -np.inf
    assert (np.signbit(z) & (z == 0)).any() and ((z == 0) & ~np.signbit(z)).any(), "both zeros must occur"
    z_real = (rng.normal(size=(4, 151936)) * 3).astype(np.float32)
    real = (z_real, np.array([[50], [0], [50], [1000]], np.int32), np.array([[0.9], [0.9], [1.0], [0.5]], np.float32))
    checked = 0
    for x, k, p in ((z, top_k, top_p), real):
        got = np.asarray(jax.jit(S._threshold_keep)(jnp.asarray(x), jnp.asarray(k), jnp.asarray(p)))
        want = np.asarray(jax.jit(S._sorted_keep)(jnp.asarray(x), jnp.asarray(k), jnp.asarray(p)))
        clear = _mass_above_distance(x, k, p) > 1e-5
        np.testing.assert_array_equal(got[clear], want[clear], err_msg="a cut clear of rounding differs")
        for row, token in np.argwhere(got != want):
            distance = abs(_mass_above(x[row], k[row, 0], token) - p[row, 0])
            assert distance < 1e-6, f"row {row} token {token}: supports differ {distance:.1e} from the cut"
        checked += clear.sum()
    assert checked >= 0.9 * (len(cases) + 4), f"only {checked} of {len(cases) + 4} rows were clear of rounding"


def test_temperature_zero_rows_are_one_hot_and_never_nan():
    logits = jnp.asarray([[1e30, -1e30, 0.0], [0.0, 0.0, 0.0]], jnp.float32)
    out = np.asarray(filtered_logprobs(logits, row_params(Sampling(top_p=0.5, min_p=0.5, top_k=1), 2)))
    assert not np.isnan(out).any(), "greedy rows divide by a guarded temperature, never 0"
    np.testing.assert_array_equal(out, [[0.0, -np.inf, -np.inf], [0.0, -np.inf, -np.inf]])


# --- penalties -------------------------------------------------------------------------


def test_penalties_follow_hugging_face_and_openai_semantics():
    rng = np.random.default_rng(4)
    logits = (2.0 * rng.standard_normal((3, 10))).astype(np.float32)
    counts = rng.integers(0, 3, (3, 10)).astype(np.int32)
    settings = [Sampling(repetition_penalty=1.3), Sampling(frequency_penalty=0.5),
                Sampling(repetition_penalty=0.8, presence_penalty=0.7, frequency_penalty=-0.2)]
    out = np.asarray(apply_penalties(jnp.asarray(logits), jnp.asarray(counts), row_params(settings, 3)))
    for i, s in enumerate(settings):
        x = logits[i].astype(np.float64)
        seen = counts[i] > 0
        x = np.where(seen, np.where(x < 0, x * s.repetition_penalty, x / s.repetition_penalty), x)
        x = x - s.frequency_penalty * counts[i] - s.presence_penalty * seen
        np.testing.assert_allclose(out[i], x, rtol=1e-6, atol=1e-6, err_msg=f"penalties for {s}")


def test_repetition_penalty_matches_hugging_face_processor():
    torch = pytest.importorskip("torch")
    lp = pytest.importorskip("transformers.generation.logits_process")
    rng = np.random.default_rng(5)
    logits = (2.0 * rng.standard_normal((1, 12))).astype(np.float32)
    history = np.array([[1, 4, 4, 7, 11]])
    counts = np.bincount(history[0], minlength=12)[None].astype(np.int32)
    want = lp.RepetitionPenaltyLogitsProcessor(1.5)(torch.from_numpy(history), torch.from_numpy(logits.copy()))
    got = apply_penalties(jnp.asarray(logits), jnp.asarray(counts), row_params(Sampling(repetition_penalty=1.5), 1))
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-6)


def test_neutral_penalties_are_an_exact_identity():
    logits = jnp.asarray([[1.5, -2.0, -jnp.inf, 0.0, -0.0]], jnp.float32)
    counts = jnp.asarray([[3, 1, 2, 0, 5]], jnp.int32)
    out = apply_penalties(logits, counts, row_params(Sampling(), 1))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(logits), err_msg="neutral penalties must not move logits")


# --- random streams --------------------------------------------------------------------


def _draws(seed, counter, stream, b=256, vocab=1000):
    keys = rng_key(jnp.full(b, seed, jnp.uint32), jnp.full(b, counter), stream)
    return np.asarray(sample(jnp.zeros((b, vocab)), keys))


def test_same_seed_and_counter_give_the_same_draws():
    np.testing.assert_array_equal(_draws(7, 3, S.STREAM_TARGET), _draws(7, 3, S.STREAM_TARGET))
    keys_eager = rng_key(jnp.asarray([1, 2], jnp.uint32), 5, S.STREAM_DRAFT)
    keys_jit = jax.jit(rng_key, static_argnums=2)(jnp.asarray([1, 2], jnp.uint32), jnp.asarray([5, 5]), S.STREAM_DRAFT)
    np.testing.assert_array_equal(jax.random.key_data(keys_eager), jax.random.key_data(keys_jit),
                                  err_msg="a scalar counter and jit must give the same keys (resumable stream)")


@pytest.mark.parametrize("other", [(8, 3, S.STREAM_TARGET), (7, 4, S.STREAM_TARGET), (7, 3, S.STREAM_DRAFT)])
def test_seed_counter_and_stream_each_change_the_draws(other):
    same = np.mean(_draws(7, 3, S.STREAM_TARGET) == _draws(*other))
    assert same < 0.05, f"changing (seed, counter, stream) to {other} must give fresh draws ({same:.0%} equal)"


def test_rows_with_the_same_seed_draw_independently():
    d = _draws(7, 3, S.STREAM_TARGET)
    assert np.unique(d).size > 200, "rows sharing a seed must not share a stream (row index is folded in)"


def test_sample_draws_from_the_given_distribution():
    keys = rng_key(jnp.zeros(N_DRAWS, jnp.uint32), 0, S.STREAM_TARGET)
    d = tv(histogram(sample(rows(jnp.log(P), N_DRAWS), keys)), P)
    assert d < TV_BOUND, f"sample() frequencies must match p (TV {d:.4f})"


# --- one speculative round: composition --------------------------------------------------


def _q_and_drafts(kind, q, n, nd):
    """Draw n rows of nd independent proposals (q: [V] for every slot or [nd, V]) -> (q pytree, drafts)."""
    keys = rng_key(jnp.zeros(n, jnp.uint32), 0, S.STREAM_DRAFT)
    slot_keys = jax.vmap(lambda k: jax.random.split(k, nd))(keys)
    if kind == "dense":
        probs = rows(jnp.broadcast_to(jnp.asarray(q), (nd, V)), n)
        drafts = jax.vmap(lambda ks: jax.vmap(jax.random.categorical)(ks, jnp.log(probs[0])))(slot_keys)
        return DenseQ(probs), drafts.astype(jnp.int32)
    if kind == "sparse":
        ids = np.flatnonzero(q)
        ids_b = rows(jnp.broadcast_to(jnp.asarray(ids, jnp.int32), (nd, ids.size)), n)
        probs_b = rows(jnp.broadcast_to(jnp.asarray(q[ids]), (nd, ids.size)), n)
        pick = jax.vmap(lambda ks: jax.vmap(jax.random.categorical)(ks, jnp.log(probs_b[0])))(slot_keys)
        return SparseQ(ids_b, probs_b), jnp.take(jnp.asarray(ids, jnp.int32), pick)
    return OneHotQ(), jnp.full((n, nd), q, jnp.int32)


def _committed_first_token(kind, q, n=N_DRAWS):
    """One round with one draft (vt = 2) per row: the token committed at the first position."""
    q_tree, drafts = _q_and_drafts(kind, q, n, 1)
    p_logprobs = rows(jnp.log(jnp.stack([P, P])), n)
    keys = rng_key(jnp.zeros(n, jnp.uint32), 0, S.STREAM_TARGET)

    def one_round(*args):  # a fresh function, so jit traces whatever rule is patched in now
        return S.speculative_accept(*args)

    m, next_token = jax.jit(one_round)(p_logprobs, drafts, q_tree, jnp.full(n, 2), keys)
    return np.asarray(jnp.where(m >= 1, drafts[:, 0], next_token))


@pytest.mark.parametrize("kind, q", [("dense", Q_ROWS), ("dense", P), ("sparse", Q_SPARSE),
                                     ("onehot", 0), ("onehot", 7)])
def test_sampled_round_composition_matches_the_target(kind, q):
    d = tv(histogram(_committed_first_token(kind, q)), P)
    assert d < TV_BOUND, f"composition[{kind} q={q}]: committed-token distribution must equal p (TV {d:.4f})"


def test_every_slot_and_the_bonus_commit_from_their_own_target_row():
    nd, n = 3, N_DRAWS
    p_rows = np.stack([P, Q_ROWS, np.roll(P, 3), np.roll(P, 5)])
    q_slots = 0.5 * p_rows[:nd] + 0.5 * np.roll(p_rows[:nd], 1, axis=1)  # q != p, most rounds reach the bonus
    q_tree, drafts = _q_and_drafts("dense", q_slots, n, nd)
    keys = rng_key(jnp.zeros(n, jnp.uint32), 0, S.STREAM_TARGET)
    m, next_token = jax.jit(speculative_accept)(rows(jnp.log(p_rows), n), drafts, q_tree, jnp.full(n, nd + 1), keys)
    m, next_token, drafts = np.asarray(m), np.asarray(next_token), np.asarray(drafts)
    for slot in range(nd + 1):
        reached = m >= slot
        committed = np.where(m[reached] > slot, drafts[reached, min(slot, nd - 1)], next_token[reached])
        d = tv(histogram(committed), p_rows[slot])
        assert reached.sum() > 100_000, f"too few rounds reached slot {slot} to measure"
        assert d < TV_BOUND, f"slot {slot}: committed token must follow p row {slot} (TV {d:.4f})"


def test_composition_teeth_inverted_accept_fails(monkeypatch):
    monkeypatch.setattr(S, "accept_length", inverted_accept_length)
    d = tv(histogram(_committed_first_token("dense", Q_ROWS)), P)
    assert d > TEETH_BOUND, f"an inverted accept rule must fail the composition bound (TV {d:.4f})"


@pytest.mark.parametrize("kind, q", [("sparse", Q_SPARSE), ("dense", Q_ROWS)])
def test_composition_teethresidual_without_q_fails(monkeypatch, kind, q):
    monkeypatch.setattr(S, "residual_logprobs", residual_without_q)
    d = tv(histogram(_committed_first_token(kind, q)), P)
    assert d > TEETH_BOUND, f"a residual that skips q must fail the composition bound (TV {d:.4f})"


# --- verify window and greedy ------------------------------------------------------------


def test_verify_window_caps_the_examined_drafts_and_takes_the_bonus_from_row_vt_minus_1():
    nd = 3
    p_tokens = np.array([4, 5, 6, 7])
    p_logprobs = jnp.log(jax.nn.one_hot(p_tokens, 10))
    b = nd + 1
    drafts = jnp.asarray(np.tile(p_tokens[:nd], (b, 1)), jnp.int32)
    vt = jnp.arange(1, b + 1)
    m, next_token = speculative_accept(rows(p_logprobs, b), drafts, OneHotQ(), vt,
                                       rng_key(jnp.zeros(b, jnp.uint32), 0, S.STREAM_TARGET))
    np.testing.assert_array_equal(m, vt - 1, err_msg="every examined draft agrees, so m = vt - 1")
    np.testing.assert_array_equal(next_token, p_tokens[np.asarray(vt) - 1], err_msg="bonus comes from p row vt-1")


def _greedy_case(seed, b=48, nd=4, vocab=20):
    rng = np.random.default_rng(seed)
    logits = (2.0 * rng.standard_normal((b, nd + 1, vocab))).astype(np.float32)
    argmax = logits.argmax(-1)
    drafts = argmax[:, :nd].copy()
    wrong_at = rng.integers(0, nd + 1, b)
    for i, w in enumerate(wrong_at):
        if w < nd:
            drafts[i, w] = (drafts[i, w] + 1 + rng.integers(0, vocab - 1)) % vocab
    vt = rng.integers(1, nd + 2, b)
    return logits, argmax, drafts.astype(np.int32), vt.astype(np.int32)


@pytest.mark.parametrize("kind", ["onehot", "dense", "sparse"])
def test_speculative_accept_at_temperature_zero_equals_greedy_accept(kind):
    logits, argmax, drafts, vt = _greedy_case(6)
    b, nd = drafts.shape
    rng = np.random.default_rng(7)
    if kind == "onehot":
        q = OneHotQ()
    elif kind == "dense":
        q = DenseQ(jax.nn.softmax(jnp.asarray(rng.standard_normal((b, nd, logits.shape[-1])), jnp.float32)))
    else:
        ids = np.concatenate([drafts[..., None], rng.integers(0, logits.shape[-1], (b, nd, 2))], -1)
        q = SparseQ(jnp.asarray(ids, jnp.int32), jnp.full((b, nd, 3), 1 / 3, jnp.float32))
    p = filtered_logprobs(jnp.asarray(logits), row_params(Sampling(), b))
    keys = rng_key(jnp.arange(b, dtype=jnp.uint32), 0, S.STREAM_TARGET)
    got = jax.jit(speculative_accept)(p, jnp.asarray(drafts), q, jnp.asarray(vt), keys)
    want = greedy_accept(jnp.asarray(argmax), jnp.asarray(drafts), jnp.asarray(vt))
    np.testing.assert_array_equal(got[0], want[0], err_msg=f"T=0 with {kind} q: m must be the leading argmax matches")
    np.testing.assert_array_equal(got[1], want[1], err_msg=f"T=0 with {kind} q: next token must be the argmax at m")
    assert set(np.asarray(want[0]).tolist()) == set(range(nd + 1)), "the case must cover every acceptance length"


def test_greedy_accept_is_leading_matches_capped_at_vt_minus_1():
    _, argmax, drafts, vt = _greedy_case(8)
    m, next_token = greedy_accept(jnp.asarray(argmax), jnp.asarray(drafts), jnp.asarray(vt))
    for i in range(drafts.shape[0]):
        want = 0
        while want < vt[i] - 1 and drafts[i, want] == argmax[i, want]:
            want += 1
        assert int(m[i]) == want and int(next_token[i]) == argmax[i, want], f"row {i}"


def test_greedy_rows_stay_exact_in_a_batch_with_sampled_rows():
    logits, argmax, drafts, vt = _greedy_case(9)
    b, nd = drafts.shape
    settings = [Sampling(temperature=1.0 if i % 2 else 0.0, top_p=0.9) for i in range(b)]
    p = filtered_logprobs(jnp.asarray(logits), row_params(settings, b))
    q = DenseQ(jnp.exp(p[:, :nd]))
    keys = rng_key(jnp.zeros(b, jnp.uint32), 1, S.STREAM_TARGET)
    m, next_token = jax.jit(speculative_accept)(p, jnp.asarray(drafts), q, jnp.asarray(vt), keys)
    gm, gnext = greedy_accept(jnp.asarray(argmax), jnp.asarray(drafts), jnp.asarray(vt))
    greedy = np.array([s.greedy for s in settings])
    np.testing.assert_array_equal(np.asarray(m)[greedy], np.asarray(gm)[greedy])
    np.testing.assert_array_equal(np.asarray(next_token)[greedy], np.asarray(gnext)[greedy])


# --- refusals and parameters ----------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": -0.5}, r"temperature=-0\.5"),
        ({"temperature": float("nan")}, r"temperature=nan"),
        ({"top_p": 0.0}, r"top_p=0\.0.*\(0, 1\]"),
        ({"top_p": 1.5}, r"top_p=1\.5"),
        ({"top_k": -1}, r"top_k=-1"),
        ({"top_k": 2.5}, r"top_k=2\.5.*integer"),
        ({"min_p": 1.0}, r"min_p=1\.0.*\[0, 1\)"),
        ({"min_p": -0.1}, r"min_p=-0\.1"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty=0\.0"),
        ({"seed": -1}, r"seed=-1"),
        ({"proposal": "beam"}, r"proposal='beam'.*'argmax', 'sample'"),
    ],
)
def test_invalid_sampling_is_refused_naming_the_parameter(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Sampling(**kwargs)


@pytest.mark.parametrize("penalty", ["repetition_penalty=1.1", "frequency_penalty=0.5", "presence_penalty=-0.3"])
def test_speculative_decoding_refuses_penalties(penalty):
    name, value = penalty.split("=")
    s = Sampling(temperature=0.7, **{name: float(value)})
    assert s.has_penalties
    with pytest.raises(ValueError, match=rf"row 1 sets {name}={value}"):
        check_speculative([Sampling(), s])
    check_speculative([Sampling(), Sampling(temperature=0.7, top_p=0.9)])


def test_row_params_broadcasts_one_sampling_and_checks_list_length():
    rp = row_params(Sampling(temperature=0.5, top_k=2**40, seed=2**32 - 1), 3)
    assert rp.temperature.shape == (3,) and rp.temperature.dtype == jnp.float32
    assert rp.top_k.dtype == jnp.int32 and int(rp.top_k[0]) == 2**31 - 1, "huge top_k saturates (still 'off')"
    assert rp.seed.dtype == jnp.uint32 and int(rp.seed[2]) == 2**32 - 1
    with pytest.raises(ValueError, match="got 2 Sampling rows for a batch of 3"):
        row_params([Sampling(), Sampling()], 3)
