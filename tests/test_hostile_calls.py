"""Careless and hostile calls to `generate`, `Session` and `propose` (issue 20, items 6-8).

Each bad argument is refused with a ValueError naming the argument, the value and what is valid;
numpy scalars are accepted wherever a Python number is. A 2-D prompt array is all real tokens
unless `lengths=` says otherwise. Caches that cannot fit the free memory are refused before
anything is allocated (under an address-space limit, so a regression fails instead of swapping
or getting the test process killed).
"""
import contextlib
import re
import resource

import jax
import numpy as np
import pytest

import dflash_jax
from dflash_jax import Sampling
from dflash_jax import sampling as smp
from dflash_jax.decoding import common
from conftest import tiny_drafter

PROMPTS = [[3, 4, 5, 6], [7, 8, 9, 10]]
RAGGED = [[3, 4, 5, 6, 7], [9, 10]]
MAX_NEW = 6
VOCAB = 64
BIG = 2**70


@pytest.fixture(scope="module")
def drafter(target):
    return tiny_drafter(target, 4)


@pytest.fixture(scope="module")
def plain(target):
    return dflash_jax.generate(target, None, PROMPTS, max_new_tokens=MAX_NEW).tokens


def run(target, drafter, prompts=PROMPTS, **kw):
    kw.setdefault("max_new_tokens", MAX_NEW)
    return dflash_jax.generate(target, drafter, prompts, **kw).tokens


def pick(drafter, which):
    return None if which == "plain" else drafter


@contextlib.contextmanager
def address_space_limit(extra=2 * 2**30):
    """Cap this process's address space at its current size plus `extra`: a large allocation
    fails (XLA raises RESOURCE_EXHAUSTED) instead of exhausting a machine the tests share."""
    with open("/proc/self/status") as f:
        vm = int(f.read().split("VmSize:")[1].split()[0]) * 1024
    old = resource.getrlimit(resource.RLIMIT_AS)
    soft = vm + extra if old[1] == resource.RLIM_INFINITY else min(vm + extra, old[1])
    resource.setrlimit(resource.RLIMIT_AS, (soft, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, old)


def kv_bytes_per_position(*models) -> int:
    """K and V of every attention layer, one row and one position, from the configs alone."""
    return sum(2 * m.config.num_layers * m.config.num_kv_heads * m.config.head_dim * 4 for m in models)


# --- item 6: ids, stop tokens, sampling, capacity, max_new_tokens ----------------------------


@pytest.mark.parametrize("which", ["plain", "spec"])
@pytest.mark.parametrize("prompts, value", [
    ([[1, 2], [3, BIG]], BIG),
    (np.array([[1, 2], [3, 2**64 - 1]], np.uint64), 2**64 - 1),
    ([[1, 2], [3, np.uint64(2**63)]], 2**63),
])
def test_ids_too_wide_for_int64_are_refused_with_their_true_value(target, drafter, which, prompts, value):
    with pytest.raises(ValueError, match=rf"prompt 1 has token id {value} outside the vocabulary \[0, 64\)"):
        run(target, pick(drafter, which), prompts)


@pytest.mark.parametrize("which", ["plain", "spec"])
def test_numpy_integer_ids_of_any_width_are_ids(target, drafter, plain, which):
    rows = [[np.uint64(t) for t in PROMPTS[0]], list(np.array(PROMPTS[1], np.uint8))]
    assert run(target, pick(drafter, which), rows) == plain
    assert run(target, pick(drafter, which), np.array(PROMPTS, np.uint16)) == plain


@pytest.mark.parametrize("which", ["plain", "spec"])
@pytest.mark.parametrize("prompts, match", [
    ([[3, True, 5]], r"prompt 0 holds True \(bool\), a non-integer token id; expected integers in the vocabulary"),
    ([[3, 4.0]], r"prompt 0 holds 4\.0 \(float\), a non-integer token id"),
    ([[3, None]], r"prompt 0 holds None \(NoneType\), a non-integer token id"),
    ([3, 4], r"prompt 0 must be a flat list of token ids; got 3 .*wrap a single prompt as \[ids\]"),
])
def test_ids_that_are_not_integers_are_refused(target, drafter, which, prompts, match):
    with pytest.raises(ValueError, match=match):
        run(target, pick(drafter, which), prompts)


@pytest.mark.parametrize("which", ["plain", "spec"])
def test_stop_tokens_may_be_one_id_or_none(target, drafter, plain, which):
    stop = plain[0][1]
    cut = [row[: row.index(stop) + 1] if stop in row else row for row in plain]
    assert cut != plain
    d = pick(drafter, which)
    for stops in (stop, np.int64(stop), [np.int32(stop)], np.array([stop], np.uint32)):
        assert run(target, d, stop_tokens=stops) == cut, f"stop_tokens={stops!r}"
    assert run(target, d, stop_tokens=None) == plain


@pytest.mark.parametrize("which", ["plain", "spec"])
@pytest.mark.parametrize("stops, match", [
    ([1.7], r"stop_tokens holds 1\.7 \(float\), a non-integer token id; expected integers in the vocabulary "
            r"\[0, 64\)"),
    ([np.float32(2.0)], r"stop_tokens holds np\.float32\(2\.0\) \(float32\), a non-integer token id"),
    ([True], r"stop_tokens holds True \(bool\)"),
    (1.7, r"stop_tokens=1\.7 is not a list of token ids; expected integers in the vocabulary \[0, 64\)"),
    ("abc", r"stop_tokens='abc' is not a list of token ids"),
    ([BIG], rf"stop_tokens has token id {BIG} outside the vocabulary \[0, 64\)"),
    (np.array([2**64 - 1], np.uint64), r"stop_tokens has token id 18446744073709551615 outside"),
    ([[1, 2]], r"stop_tokens holds \[1, 2\] \(list\)"),
])
def test_stop_tokens_that_are_not_ids_are_refused(target, drafter, which, stops, match):
    with pytest.raises(ValueError, match=match):
        run(target, pick(drafter, which), stop_tokens=stops)


def test_sampling_none_is_the_default_greedy_sampling_everywhere(target, drafter, plain):
    assert run(target, None, sampling=None) == plain
    assert run(target, drafter, sampling=None) == plain
    assert dflash_jax.Session(target, drafter, PROMPTS, max_new_tokens=MAX_NEW, sampling=None).run().tokens == plain
    with pytest.raises(ValueError, match=r"sampling=0\.7 is invalid: expected a Sampling, a list with one per row, "
                                         r"or None"):
        run(target, drafter, sampling=0.7)


def test_sampling_takes_numpy_scalars_as_their_values():
    s_np = Sampling(temperature=np.float32(0.7), top_k=np.int64(8), top_p=np.float64(0.9), min_p=np.float32(0.05),
                    seed=np.uint32(3), repetition_penalty=np.int8(1))
    s_py = Sampling(temperature=float(np.float32(0.7)), top_k=8, top_p=0.9, min_p=float(np.float32(0.05)), seed=3)
    assert s_np == s_py and type(s_np.temperature) is float and type(s_np.seed) is int
    got, want = (jax.tree.leaves(smp.row_params(s, 2)) for s in (s_np, s_py))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kwargs, match", [
    ({"temperature": "0.7"}, r"Sampling\.temperature='0\.7' is not a number: expected a real number >= 0"),
    ({"temperature": np.bool_(True)}, r"Sampling\.temperature=np\.True_ is not a number"),
    ({"top_p": 10**400}, r"Sampling\.top_p=1000.* is not finite: expected in \(0, 1\]"),
    ({"temperature": np.float32(-0.5)}, r"temperature=np\.float32\(-0\.5\) is invalid: expected >= 0"),
    ({"top_k": np.float32(3)}, r"Sampling\.top_k=np\.float32\(3\.0\) is invalid: expected an integer >= 0"),
    ({"seed": np.int64(-1)}, r"Sampling\.seed=np\.int64\(-1\) is invalid: expected an integer in \[0, 2\*\*32\)"),
])
def test_sampling_refusals_say_what_is_wrong(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Sampling(**kwargs)


@pytest.mark.parametrize("which", ["plain", "spec"])
@pytest.mark.parametrize("value", ["big", 33.5, True, 0, -5, np.float64(128.0), [128]])
def test_capacity_must_be_a_positive_integer(target, drafter, which, value):
    with pytest.raises(ValueError, match=rf"capacity must be a positive integer \(cache positions per row\) or None; "
                                         rf"got {re.escape(repr(value))}"):
        run(target, pick(drafter, which), capacity=value)


@pytest.mark.parametrize("which", ["plain", "spec"])
@pytest.mark.parametrize("value", [True, 2.0, np.float32(3), "4", 0])
def test_max_new_tokens_must_be_a_positive_integer(target, drafter, which, value):
    with pytest.raises(ValueError, match=rf"max_new_tokens must be a positive integer; got {re.escape(repr(value))}"):
        run(target, pick(drafter, which), max_new_tokens=value)


def test_numpy_integer_counts_are_accepted(target, drafter, plain):
    assert run(target, None, max_new_tokens=np.int64(MAX_NEW), capacity=np.int32(128)) == plain
    nd = drafter.n_drafts
    assert run(target, drafter, max_new_tokens=np.uint16(MAX_NEW), capacity=np.int64(128),
               verify_t=np.int64(nd + 1)) == plain
    with pytest.raises(ValueError, match=r"verify_t must be an integer in 2\.\.4 \(n_drafts \+ 1\) or None; got True"):
        run(target, drafter, verify_t=True)
    with pytest.raises(ValueError, match=r"verify_buckets holds 2\.5 \(float\), a non-integer width; expected "
                                         r"integers in 2\.\.3"):
        run(target, drafter, verify_buckets=(2.5,))


# --- item 7: a 2-D prompt array and lengths= -------------------------------------------------


@pytest.mark.parametrize("pad", [-1, 0, VOCAB])
def test_padded_array_with_lengths_reads_like_the_ragged_lists(target, drafter, pad):
    ref = run(target, None, RAGGED)
    arr = np.full((2, 5), pad, np.int64)
    arr[0], arr[1, :2] = RAGGED[0], RAGGED[1]
    for lengths in ([5, 2], np.array([5, 2], np.uint8), jax.numpy.asarray([5, 2])):
        assert run(target, None, arr, lengths=lengths) == ref
        assert run(target, drafter, jax.numpy.asarray(arr), lengths=lengths) == ref
    session = dflash_jax.Session(target, drafter, arr.tolist(), max_new_tokens=MAX_NEW, lengths=[5, 2])
    assert session.run().tokens == ref
    np.testing.assert_array_equal(dflash_jax.propose(target, drafter, arr, lengths=[5, 2]).tokens,
                                  dflash_jax.propose(target, drafter, RAGGED).tokens)


def test_an_array_without_lengths_is_all_real_tokens(target):
    arr = np.array([RAGGED[0], RAGGED[1] + [0, 0, 0]])
    full = run(target, None, arr)
    assert full == run(target, None, arr.tolist())
    assert full[1] != run(target, None, RAGGED)[1], "the zeros were read as prompt tokens, so the row differs"


@pytest.mark.parametrize("call", ["plain", "spec", "propose"])
@pytest.mark.parametrize("prompts, lengths, match", [
    (np.ones((2, 5), np.int32), [5], r"lengths has 1 entries for 2 prompt rows; give one length per row"),
    (np.ones((2, 5), np.int32), [5, 0], r"lengths has row length 0 outside 1\.\.5 \(the prompt array's width\)"),
    (np.ones((2, 5), np.int32), [5, 6], r"lengths has row length 6 outside 1\.\.5"),
    (np.ones((2, 5), np.int32), [5, 2.0], r"lengths holds 2\.0 \(float\), a non-integer row length"),
    (np.ones((2, 5), np.int32), [5, True], r"lengths holds True \(bool\)"),
    (np.ones((2, 5), np.int32), np.array([5.0, 2.0]), r"lengths holds non-integer row lengths \(dtype float64\)"),
    (np.ones((2, 5), np.int32), np.array([[5, 2]]), r"lengths must be a flat list of row lengths; got shape \(1, 2\)"),
    (np.ones((2, 5), np.int32), 5, r"lengths=5 is not a list of row lengths"),
    (RAGGED, [5, 2], r"lengths= gives the valid length of each row of a 2-D prompt array .*Ragged lists carry"),
    (np.ones(5, np.int32), [5], r"lengths= gives the valid length of each row of a 2-D prompt array"),
    (np.array([[1, VOCAB, 0], [2, 3, 4]]), [2, 3], r"prompt 0 has token id 64 outside the vocabulary"),
])
def test_lengths_are_validated(target, drafter, call, prompts, lengths, match):
    with pytest.raises(ValueError, match=match):
        if call == "propose":
            dflash_jax.propose(target, drafter, prompts, lengths=lengths)
        else:
            run(target, pick(drafter, call), prompts, lengths=lengths)


# --- item 8: caches that cannot fit the free memory ------------------------------------------


def test_cache_bytes_are_the_states_bytes_without_allocating_them(target, drafter):
    states = (target.init_state(2, 64), drafter.init_state(2, 64))
    real = sum(x.nbytes for x in jax.tree.leaves(states))
    assert common.cache_bytes(target, drafter, 2, 64) == real
    assert common.cache_bytes(target, None, 2, 64) == sum(x.nbytes for x in jax.tree.leaves(states[0]))
    assert common.cache_bytes(target, drafter, 3, 10**7) == 3 * 10**7 * kv_bytes_per_position(target, drafter) + 24


def test_free_memory_reads_the_allocator_on_an_accelerator_and_the_host_on_cpu():
    class Accelerator:
        def memory_stats(self):
            return {"bytes_limit": 80 * 2**30, "bytes_in_use": 5 * 2**30}

        def __str__(self):
            return "cuda:0"

    assert common.free_memory(Accelerator()) == (75 * 2**30, "cuda:0")
    assert "bytes_limit" not in (jax.devices()[0].memory_stats() or {}), "the tests run on the CPU"
    free, where = common.free_memory()
    assert where == "host memory"
    with open("/proc/meminfo") as f:
        total = int(re.search(r"MemTotal:\s+(\d+)", f.read()).group(1)) * 1024
    assert 0 < free <= total


@pytest.mark.parametrize("which", ["plain", "spec"])
def test_capacity_beyond_the_free_memory_is_refused_with_both_numbers(target, drafter, which, monkeypatch):
    monkeypatch.setattr(common, "free_memory", lambda device=None: (10**9, "cuda:0"))
    d = pick(drafter, which)
    models = (target,) if d is None else (target, d)
    need = 2 * 10**7 * kv_bytes_per_position(*models) + 8 * len(models)
    with address_space_limit(), pytest.raises(ValueError) as err:
        run(target, d, capacity=10**7)
    assert f"need {need:,} bytes" in str(err.value) and "cuda:0 has 1,000,000,000 bytes free" in str(err.value)
    assert "lower capacity, max_new_tokens or the batch" in str(err.value)

    monkeypatch.setattr(common, "free_memory", lambda device=None: (1000, "host memory"))
    with address_space_limit(), pytest.raises(ValueError, match=r"need [\d,]+ bytes .*host memory has 1,000 bytes"):
        run(target, d)
    if d is not None:
        with pytest.raises(ValueError, match=r"host memory has 1,000 bytes free"):
            dflash_jax.propose(target, d, PROMPTS)


def test_capacity_beyond_the_hosts_memory_is_refused_without_allocating(target, drafter):
    """capacity=10**7 on the tiny pair, with enough rows to need twice the host's available memory."""
    with open("/proc/meminfo") as f:
        available = int(re.search(r"MemAvailable:\s+(\d+)", f.read()).group(1)) * 1024
    per_row = 10**7 * kv_bytes_per_position(target, drafter)
    rows = 2 * available // per_row + 1
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with address_space_limit(), pytest.raises(ValueError) as err:
        dflash_jax.Session(target, drafter, [[1, 2]] * rows, max_new_tokens=4, capacity=10**7)
    got = re.search(r"need ([\d,]+) bytes .* host memory has ([\d,]+) bytes free", str(err.value))
    assert got, str(err.value)
    need, free = (int(g.replace(",", "")) for g in got.groups())
    assert need == rows * per_row + 8 * rows and free < need
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 2**20, "nothing large was allocated (KiB)"
