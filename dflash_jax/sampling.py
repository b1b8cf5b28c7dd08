"""Sampling: filters, counter-based random streams, and lossless rejection sampling.

One set of filters (temperature, top-k, top-p, min-p, in that order) serves plain
decoding, the drafter's proposals and the target's verification, so p and q are always
filtered the same way (docs/architecture.md, "Sampling"). Greedy is temperature 0: its filtered distribution
is one-hot at the argmax, so greedy rows go through the same code as sampled ones and a
batch may mix both. Everything here is pure jnp over per-row parameter arrays and jits
with those parameters traced; nothing is jitted at module level, callers jit the round.

Rejection sampling (Leviathan et al. 2023; Chen et al. 2023): draft x at slot i is
accepted with probability min(1, p_i(x) / q_i(x)), slots in order; on the first
rejection the token is drawn from normalize(max(p_i - q_i, 0)); when every examined
draft is accepted the bonus token is drawn from p at the next slot. The committed tokens
are then distributed exactly as the target alone would produce them.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Sequence, Union

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pallas_kernels import key_sums

STREAM_DRAFT = 0
"""`rng_key` stream for the drafter's proposal draws (proposal='sample', selector walk)."""
STREAM_TARGET = 1
"""`rng_key` stream for target-side draws: acceptance uniforms, residual, bonus, plain decoding."""

PROPOSALS = ("argmax", "sample")
_INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class Sampling:
    """User-facing sampling settings for one sequence; validated on construction.

    temperature: 0 is greedy (argmax); > 0 divides the logits.
    top_k: keep the k most likely tokens; 0 (or >= vocab size) is off.
    top_p: nucleus; keep the most likely tokens until their mass reaches top_p; 1 is off.
    min_p: keep tokens with p >= min_p * p_max; 0 is off.
    seed: seeds the counter-based random stream (see `rng_key`).
    repetition_penalty, frequency_penalty, presence_penalty: Hugging Face / OpenAI
      penalties (see `apply_penalties`); plain decoding only (`check_speculative`).
    proposal: how drafters propose at T > 0: 'argmax' (one-hot q, the default; coherent
      blocks, usually more accepted) or 'sample': DFlash draws each slot independently from
      its filtered distribution (dense q), DSpark samples its Markov chain (dense q), and
      DFlash2 samples its selector's walk over each slot's top-K candidates (sparse q).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    proposal: str = "argmax"

    def __post_init__(self):
        _check_real(self, "temperature", lambda v: v >= 0, ">= 0 (0 means greedy)")
        _check_int(self, "top_k", lambda v: v >= 0, ">= 0 (0 means off)")
        _check_real(self, "top_p", lambda v: 0 < v <= 1, "in (0, 1] (1 means off)")
        _check_real(self, "min_p", lambda v: 0 <= v < 1, "in [0, 1) (0 means off)")
        _check_int(self, "seed", lambda v: 0 <= v < 2**32, "in [0, 2**32)")
        _check_real(self, "repetition_penalty", lambda v: v > 0, "> 0 (1 means off)")
        _check_real(self, "frequency_penalty", lambda v: True, "a finite number (0 means off)")
        _check_real(self, "presence_penalty", lambda v: True, "a finite number (0 means off)")
        if self.proposal not in PROPOSALS:
            raise ValueError(
                f"Sampling.proposal={self.proposal!r} is not a known proposal; "
                f"valid choices: {', '.join(map(repr, PROPOSALS))}."
            )

    @property
    def greedy(self) -> bool:
        """Temperature 0: the filtered distribution is one-hot at the argmax."""
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        """Whether any repetition/frequency/presence penalty is not neutral."""
        return bool(_active_penalties(self))


def _check_real(s: Sampling, name: str, ok, expected: str) -> None:
    value = getattr(s, name)
    number = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
    if not number:
        raise ValueError(f"Sampling.{name}={value!r} is not a number: expected a real number {expected}.")
    try:
        x = float(value)
    except OverflowError:
        x = math.inf
    if not math.isfinite(x):
        raise ValueError(f"Sampling.{name}={value!r:.40} is not finite: expected {expected}.")
    if not ok(x):
        raise ValueError(f"Sampling.{name}={value!r} is invalid: expected {expected}.")
    object.__setattr__(s, name, x)


def _check_int(s: Sampling, name: str, ok, expected: str) -> None:
    value = getattr(s, name)
    if not (isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_)) and ok(value)):
        raise ValueError(f"Sampling.{name}={value!r} is invalid: expected an integer {expected}.")
    object.__setattr__(s, name, int(value))


def _active_penalties(s: Sampling) -> list[str]:
    neutral = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
    return [f"{n}={getattr(s, n)!r}" for n, v in neutral.items() if getattr(s, n) != v]


def _as_rows(s: Union[Sampling, Sequence[Sampling], None]) -> list[Sampling]:
    if s is None or isinstance(s, Sampling):
        return [Sampling() if s is None else s]
    if isinstance(s, (str, bytes)) or not isinstance(s, Sequence):
        raise ValueError(f"sampling={s!r:.60} is invalid: expected a Sampling, a list with one per row, "
                         "or None (greedy).")
    rows = list(s)
    for i, r in enumerate(rows):
        if not isinstance(r, Sampling):
            raise ValueError(f"row {i} is a {type(r).__name__}, expected a Sampling.")
    return rows


def per_row(s: Union[Sampling, Sequence[Sampling], None], batch: int) -> list[Sampling]:
    """One Sampling per row: `s` for every row (None is the default, greedy `Sampling()`), or a
    list that must have length `batch`."""
    if not (isinstance(batch, int) and batch >= 1):
        raise ValueError(f"batch={batch!r} is invalid: expected an integer >= 1.")
    rows = _as_rows(s)
    if s is None or isinstance(s, Sampling):
        return rows * batch
    if len(rows) != batch:
        raise ValueError(
            f"got {len(rows)} Sampling rows for a batch of {batch}; pass one Sampling "
            f"for all rows or exactly {batch}."
        )
    return rows


def check_speculative(s: Union[Sampling, Sequence[Sampling], None]) -> None:
    """Refuse penalties for speculative decoding (as the original does), greedy or sampled.

    A penalty depends on every token generated before a position, so each position of a
    verify block would need its own counts (anchor + the drafts before it); neither the
    original nor this library computes them, and applying one count vector to the whole
    block would silently change the output.
    """
    for i, row in enumerate(_as_rows(s)):
        active = _active_penalties(row)
        if active:
            raise ValueError(
                f"speculative decoding does not support penalties, but row {i} sets "
                f"{', '.join(active)}; use plain decoding, or the neutral values "
                "repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0."
            )


@struct.dataclass
class RowParams:
    """Per-row sampling parameters as device arrays (a pytree; all fields shape [B])."""

    temperature: jax.Array  # f32[B]; 0 = greedy
    top_k: jax.Array  # i32[B]; 0 or >= V = off
    top_p: jax.Array  # f32[B]; 1 = off
    min_p: jax.Array  # f32[B]; 0 = off
    seed: jax.Array  # u32[B]
    repetition_penalty: jax.Array  # f32[B]; 1 = off
    frequency_penalty: jax.Array  # f32[B]; 0 = off
    presence_penalty: jax.Array  # f32[B]; 0 = off


def row_params(s: Union[Sampling, Sequence[Sampling], None], batch: int) -> RowParams:
    """One Sampling for every row (None: greedy), or one per row (the list must have length `batch`)."""
    rows = per_row(s, batch)

    def col(name, dtype, fn=lambda v: v):
        return jnp.asarray([fn(getattr(r, name)) for r in rows], dtype)

    return RowParams(
        temperature=col("temperature", jnp.float32),
        top_k=col("top_k", jnp.int32, lambda k: min(k, _INT32_MAX)),
        top_p=col("top_p", jnp.float32),
        min_p=col("min_p", jnp.float32),
        seed=col("seed", jnp.uint32),
        repetition_penalty=col("repetition_penalty", jnp.float32),
        frequency_penalty=col("frequency_penalty", jnp.float32),
        presence_penalty=col("presence_penalty", jnp.float32),
    )


def _per_row(param: jax.Array, like: jax.Array) -> jax.Array:
    """[B] (or [B, S]) parameters -> broadcastable against `like` [B, ..., V]."""
    param = jnp.asarray(param)
    return param.reshape(param.shape + (1,) * (like.ndim - param.ndim))


FILTER_IMPLS = ("sort", "candidates", "threshold", "groups")
FILTER_IMPL = "groups"
"""How top-k/top-p find their cut: one sort of the vocabulary (`_sorted_keep`, the rule), the candidate search
(`_candidate_keep`, which falls back to the sort), a search over the logits' order keys (`_threshold_keep`: no sort
or top-k; each pass's sums by `THRESHOLD_SUMS`), or the group search (`_group_keep`: a sort of about 256 candidates
from the groups whose maximum reaches the k-th largest group maximum; the threshold search where a row does not fit).
The group search is the default (the sort for a row of at most `TOP_CANDIDATES` tokens): on an H100
(bench/results/filter_groups_h100/, 2026-12-06; T 0.7, top-k 50, top-p 0.9) a sampled `Session.burst` round over a
greedy one was 1.011 with it against 1.037 with the threshold search at batch 1 and 1.038 against 1.181 at batch 8
(`proposal="sample"`: 1.027 against 1.074, 1.111 against 1.368); the filter alone took 0.27 against 0.50 ms at 16
rows and 0.72 against 1.98 at 128 (the sort 1.05 and 2.25). Where no row fits (top-p alone over a flat distribution)
it costs its cuts on top of the threshold search's: 0.65 against 0.58 ms at 16 rows. Where supports differed, only at
a token whose mass-above lay within 1e-7 of top_p: summation order, not a different rule. On a 2-core CPU (16 rows of
151,936 tokens) it took 15 ms, the threshold search 258 and the sort 759."""
FILTER_GROUP = 1024
"""Vocabulary positions per group of the candidate search (`_candidate_cuts`)."""
FILTER_PER_GROUP = 16
"""Candidates taken from each group: small enough for XLA's GPU top-k kernel, which serves k <= 16."""


def _sorted_keep(z: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Support of top-k then top-p from one descending sort of the whole vocabulary per row: the rule, and the
    path taken when a row's cut lies beyond the candidates of `_candidate_cuts`.

    Both filters cut at a value threshold, so ties at the cut are all kept: top-k keeps
    every token >= the k-th largest logit (as Hugging Face does); top-p keeps a token
    when the mass of tokens strictly more likely than it is < top_p (the smallest
    tie-closed set whose mass reaches top_p; always at least the most likely token;
    Hugging Face agrees except that it splits ties by sort order).
    """
    return z >= _sorted_cut(jnp.sort(z, axis=-1, descending=True), top_k, top_p, z.shape[-1])


def _sorted_cut(s: jax.Array, top_k: jax.Array, top_p: jax.Array, v: int,
                total: jax.Array | None = None) -> jax.Array:
    """`[..., 1]`: the value `_sorted_keep` cuts a row of `v` tokens at, from `s`, descending values of the row
    (-inf padded) that hold at least every token at or above top-k's cut when top-k is on, else the whole row, or
    its head when `total` gives the whole row's sum of `exp(z - max)` (top-p's mass is normalised over it)."""
    k_on = (top_k > 0) & (top_k < v)
    thr_k = jnp.take_along_axis(s, jnp.broadcast_to(jnp.clip(top_k, 1, s.shape[-1]) - 1, s.shape[:-1] + (1,)),
                                axis=-1)
    thr_k = jnp.where(k_on, thr_k, -jnp.inf)
    s = jnp.where(s >= thr_k, s, -jnp.inf)
    if total is None:
        probs = jax.nn.softmax(s, axis=-1)
    else:
        weights = jnp.exp(s - s[..., :1])
        probs = weights / jnp.where(k_on, jnp.sum(weights, axis=-1, keepdims=True), total)
    mass_before = jnp.concatenate(
        [jnp.zeros_like(probs[..., :1]), jnp.cumsum(probs, axis=-1)[..., :-1]], axis=-1
    )
    n_keep = jnp.sum(mass_before < top_p, axis=-1, keepdims=True)
    thr_p = jnp.take_along_axis(s, jnp.maximum(n_keep, 1) - 1, axis=-1)
    thr_p = jnp.where(top_p < 1, thr_p, -jnp.inf)
    return jnp.maximum(thr_k, thr_p)


def _candidate_cuts(z: jax.Array, top_k: jax.Array, top_p: jax.Array, group: int = FILTER_GROUP,
                    per_group: int = FILTER_PER_GROUP) -> tuple[jax.Array, jax.Array]:
    """`(exact, keep)`: `_sorted_keep`'s support without sorting the vocabulary, and per row whether it is exact.

    The vocabulary is cut into groups of `group` positions and the `per_group` largest of each are sorted
    (about 2,400 candidates for 151,936 tokens). Every logit above `bound`, the largest of the groups' last
    candidates, is a candidate, so the sorted candidates above it are the head of the full sort, value for
    value. A cut is exact there when the k-th largest lies in that head and the head's mass reaches top_p
    (top-p's mass is normalised over the whole vocabulary, as after the sort). A row whose cut lies beyond
    it (a large top-k, or top-p over a flat distribution) is not exact.
    """
    v = z.shape[-1]
    if per_group >= group or per_group >= v:  # no group to search: the sort is the cut, exact for every row
        return jnp.ones(z.shape[:-1] + (1,), jnp.bool_), _sorted_keep(z, top_k, top_p)
    n_groups = -(-v // group)
    padded = jnp.pad(z, [(0, 0)] * (z.ndim - 1) + [(0, n_groups * group - v)], constant_values=-jnp.inf)
    tops = jax.lax.top_k(padded.reshape(z.shape[:-1] + (n_groups, group)), per_group)[0]
    bound = jnp.max(tops[..., -1], axis=-1, keepdims=True)
    c = jnp.sort(tops.reshape(z.shape[:-1] + (n_groups * per_group,)), axis=-1, descending=True)
    n_exact = jnp.sum(c > bound, axis=-1, keepdims=True)
    k_on = (top_k > 0) & (top_k < v)
    thr_k = jnp.take_along_axis(c, jnp.clip(top_k, 1, c.shape[-1]) - 1, axis=-1)
    thr_k = jnp.where(k_on, thr_k, -jnp.inf)
    top = c[..., :1]
    total = jnp.sum(jnp.where(z >= thr_k, jnp.exp(z - top), 0.0), axis=-1, keepdims=True)
    head = jnp.arange(c.shape[-1]) < n_exact
    probs = jnp.where(head & (c >= thr_k), jnp.exp(c - top), 0.0) / total
    mass = jnp.cumsum(probs, axis=-1)
    mass_before = jnp.concatenate([jnp.zeros_like(mass[..., :1]), mass[..., :-1]], axis=-1)
    n_keep = jnp.sum(head & (mass_before < top_p), axis=-1, keepdims=True)
    thr_p = jnp.take_along_axis(c, jnp.maximum(n_keep, 1) - 1, axis=-1)
    thr_p = jnp.where(top_p < 1, thr_p, -jnp.inf)
    head_mass = jnp.take_along_axis(mass, jnp.maximum(n_exact, 1) - 1, axis=-1)
    exact = (~k_on | (top_k <= n_exact)) & ((top_p >= 1) | ((n_exact > 0) & (head_mass >= top_p)))
    return exact, z >= jnp.maximum(thr_k, thr_p)


def _candidate_keep(z: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Support of top-k then top-p: `_candidate_cuts` where every row's cut lies among the candidates, else
    `_sorted_keep` (the same support either way)."""
    exact, keep = _candidate_cuts(z, top_k, top_p)
    return jax.lax.cond(jnp.all(exact), lambda: keep, lambda: _sorted_keep(z, top_k, top_p))


TOP_GROUP = 128
"""Vocabulary positions per group of the group search (`_group_cuts`); fewer in a vocabulary of fewer than
`TOP_GROUPS` such groups."""
TOP_GROUPS = 64
"""Groups the group search gathers: the largest top-k it serves (larger ones take the threshold search), and the
head it keeps for top-p alone."""
TOP_CANDIDATES = 256
"""Candidates the group search sorts per row: tokens at or above the n-th largest group maximum."""


def _group_cuts(z: jax.Array, top_k: jax.Array, top_p: jax.Array, group: int = TOP_GROUP, groups: int = TOP_GROUPS,
                width: int = TOP_CANDIDATES) -> tuple[jax.Array, jax.Array]:
    """`(fits, keep)`: `_sorted_keep`'s support from a sort of at most `width` candidates per row, and per row
    whether that is exact. No pass over the vocabulary but its group maxima's, one sum and the final cut.

    The vocabulary is cut into groups of `group` positions. The n largest group maxima are n tokens, so the n-th
    largest logit is at or above `bound`, the n-th largest group maximum (n = top_k, or `groups` for a row without
    top-k), and every token at or above it lies in a group whose maximum is: with no more than `groups` such
    groups, the `groups` groups of largest maximum hold them all. Those tokens are gathered, the ones at or above
    `bound` compacted into `width` slots and sorted: the head of the full sort down past the n-th largest. With
    top-k (k <= `groups`) that holds everything top-p needs after it (its mass is normalised over what top-k
    keeps); without, top-p's cut lies in the head when the head's mass over the whole row reaches top_p, as it
    does for a peaked distribution. A row fits when its counts fit and its cut lies in the head, or when it cuts
    nothing. A vocabulary of fewer than `groups` groups takes smaller ones, so that top-k up to `groups` still
    fits: the demo's 4,096 tokens make 64 groups of 64, not 32 of 128."""
    v = z.shape[-1]
    lead = z.shape[:-1]
    group = min(group, -(-v // groups))
    n_groups = -(-v // group)
    groups = min(groups, n_groups)
    k_on, p_on = (top_k > 0) & (top_k < v), top_p < 1
    blocks = jnp.pad(z, [(0, 0)] * len(lead) + [(0, n_groups * group - v)], constant_values=-jnp.inf)
    blocks = blocks.reshape(lead + (n_groups, group))
    group_max = jnp.max(blocks, axis=-1)
    top_max, top_groups = jax.lax.top_k(group_max, groups)
    nth = jnp.broadcast_to(jnp.where(k_on, jnp.clip(top_k, 1, groups), groups) - 1, lead + (1,))
    bound = jnp.take_along_axis(top_max, nth, axis=-1)
    gathered = jnp.take_along_axis(blocks, top_groups[..., None], axis=-2).reshape(lead + (groups * group,))
    above = gathered >= bound
    slot = jnp.where(above, jnp.cumsum(above, axis=-1, dtype=jnp.int32) - 1, width)
    rows = math.prod(lead)
    compact = jnp.full((rows, width + 1), -jnp.inf, z.dtype).at[
        jnp.arange(rows)[:, None], jnp.minimum(slot, width).reshape(rows, -1)].set(gathered.reshape(rows, -1))
    s = jnp.sort(compact[:, :width].reshape(lead + (width,)), axis=-1, descending=True)
    top = top_max[..., :1]
    total = jnp.sum(jnp.exp(z - top), axis=-1, keepdims=True)
    head_mass = jnp.sum(jnp.exp(s - top), axis=-1, keepdims=True) / total
    counted = ((jnp.sum(group_max >= bound, axis=-1, keepdims=True) <= groups)
               & (jnp.sum(above, axis=-1, keepdims=True) <= width))
    fits = (counted & ((k_on & (top_k <= groups)) | (~k_on & (head_mass >= top_p)))) | (~k_on & ~p_on)
    return fits, z >= _sorted_cut(s, top_k, top_p, v, total)


def _group_keep(z: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Support of top-k then top-p: `_group_cuts` where every row fits, else the threshold search (the same
    support either way, up to the rounding of top-p's mass: each sums it in its own order)."""
    fits, keep = _group_cuts(z, top_k, top_p)
    return jax.lax.cond(jnp.all(fits), lambda: keep, lambda: _threshold_search()(z, top_k, top_p))


def _group_keep_or_sort(z: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """`_group_keep`, or the sort for a row no longer than its `TOP_CANDIDATES`, which the group search would sort
    whole anyway after its cuts. So a small vocabulary compiles only the sort: at a sampled test's 16 tokens one
    filter compiled in 0.4 s with it against 2.1 with the group search (2-core CPU), and a speculative loop holds
    several. Its tests call `_group_keep` itself."""
    if z.shape[-1] <= TOP_CANDIDATES:
        return _sorted_keep(z, top_k, top_p)
    return _group_keep(z, top_k, top_p)


FILTER_WAYS = 8
"""Parts a pass of the threshold search cuts each row's range of keys into: its `FILTER_WAYS - 1` pivots are
counted in one pass over the row, so `_search_passes` passes close any range of 32-bit keys (11 at 8 ways). The
H200 times every pivot like a pass of its own, so more ways save only the passes' launches: 8 measured best of
2, 4, 8 and 16 at 16 and 32 rows (`bench/sampling_filter.py`)."""
_KEY_RANGE = 2**32
"""How many uint32 order keys there are: the widest range `_largest_key` may have to close."""


def _order_key(z: jax.Array) -> jax.Array:
    """float32 -> uint32 in the same order (negatives' bits flipped, the sign bit set on the rest). -0.0 gets a key
    just below 0.0's, so compare floats, not keys, wherever the two zeros must stay together."""
    u = jax.lax.bitcast_convert_type(z, jnp.uint32)
    return jnp.where(u >> 31 == 1, ~u, u | jnp.uint32(0x80000000))


def _from_order_key(key: jax.Array) -> jax.Array:
    """The inverse of `_order_key`."""
    u = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
    return jax.lax.bitcast_convert_type(u, jnp.float32)


def _search_passes(ways: int) -> int:
    """Passes of `_largest_key` at `ways` parts a pass: each leaves at most ceil(n / ways) of a range of n keys."""
    passes, n = 0, _KEY_RANGE
    while n > 1:
        passes, n = passes + 1, -(-n // ways)
    return passes


def _largest_key(holds, lo: jax.Array, hi: jax.Array, ways: int) -> jax.Array:
    """Per row, the largest key t in [lo, hi] where `holds(t)`, for a `holds` true up to some key and false above
    it and true at lo. Each pass puts `ways - 1` pivots lo + s, lo + 2s, ... (s = ceil((hi - lo + 1) / ways)) in the
    range, asks `holds` of all of them at once ([..., pivots] keys -> bools), and keeps the part from the last pivot
    that holds to below the first that does not. The passes are unrolled and their bookkeeping is elementwise (the
    kept part is lo + n s for n pivots holding, no gather), so each pass is one reduction over the row that XLA
    fuses with the arithmetic around it, and no loop for it to synchronise on."""
    offsets = jnp.arange(1, ways, dtype=jnp.uint32)
    for _ in range(_search_passes(ways)):
        width = hi - lo  # hi - lo + 1 keys; the step is ceil of that over ways, without overflowing uint32
        step = width // ways + 1
        inside = offsets * step <= width  # the pivots that lie in [lo, hi]: a prefix, as is where holds is true
        n = jnp.sum(inside & holds(lo + jnp.minimum(offsets * step, width)), axis=-1, keepdims=True, dtype=jnp.uint32)
        n_inside = jnp.sum(inside, axis=-1, keepdims=True, dtype=jnp.uint32)
        hi = jnp.where(n < n_inside, lo + (n + 1) * step - 1, hi)
        lo = lo + n * step
    return lo


THRESHOLD_SUMS = "pallas"
"""How a pass of the threshold search sums each row at or above its pivots (`pallas_kernels.key_sums`): "pallas"
runs the kernel (Triton lowering), which reads a row once for all of a pass's pivots, where the program is
compiled for a GPU, and the jnp reference elsewhere (off a GPU Pallas only interprets); "mosaic" the same kernel in
the Mosaic GPU lowering, on CUDA; "xla" runs the reference everywhere, which XLA reduces once per pivot."""
THRESHOLD_SUMS_CHOICES = ("pallas", "mosaic", "xla")


def _threshold_keep_where_compiled(z: jax.Array, top_k: jax.Array, top_p: jax.Array,
                                   ways: int = FILTER_WAYS) -> jax.Array:
    """`_threshold_keep` with the Triton kernel's sums in a program compiled for CUDA or ROCm, the reference's
    elsewhere."""
    kernel = functools.partial(_threshold_keep, ways=ways, impl="pallas", interpret=False)
    return jax.lax.platform_dependent(z, top_k, top_p, cuda=kernel, rocm=kernel,
                                      default=functools.partial(_threshold_keep, ways=ways, impl="xla"))


def _threshold_search():
    """The threshold search with the sums `THRESHOLD_SUMS` names, a new function each call (see
    `_top_k_top_p_keep`)."""
    if THRESHOLD_SUMS not in THRESHOLD_SUMS_CHOICES:
        raise ValueError(f"THRESHOLD_SUMS={THRESHOLD_SUMS!r} is not known; valid choices: {THRESHOLD_SUMS_CHOICES}.")
    if THRESHOLD_SUMS == "pallas":
        return functools.partial(_threshold_keep_where_compiled)
    # "xla"; or "mosaic", whose sums pick the kernel on CUDA and the reference elsewhere themselves
    return functools.partial(_threshold_keep, impl=THRESHOLD_SUMS)


def _threshold_keep(z: jax.Array, top_k: jax.Array, top_p: jax.Array, ways: int = FILTER_WAYS, impl: str = "xla",
                    interpret: bool | None = None) -> jax.Array:
    """`_sorted_keep`'s support without a sort or top-k: both cuts searched over the order keys of `_order_key`
    by `_largest_key`, each pass one call of `key_sums.row_sums`'s count or mass over the row's keys (`impl`,
    `interpret`: the sums' kernel or reference).

    top-k's cut is the largest key t with count(key >= t) >= k, the k-th largest logit. top-p's is the largest key
    t whose mass (over the tokens top-k keeps, normalised over them) of key >= t is >= top_p: the least likely
    token whose mass strictly above is < top_p, so it keeps what the sort keeps. The sort adds that mass as a cumsum of
    sorted probabilities, this as one sum, so the two can round apart for a token whose mass strictly above lies
    within about 1e-6 of top_p; elsewhere the supports are identical.
    """
    v = z.shape[-1]
    m = jnp.max(z, axis=-1, keepdims=True)
    keys, weights = _order_key(z), jnp.exp(z - m)  # once, outside both searches
    count, mass = key_sums.row_sums(keys, weights, pivots=ways - 1, impl=impl, interpret=interpret)
    lo = jnp.broadcast_to(_order_key(jnp.float32(-jnp.inf)), m.shape)  # every key is >= it: both searches hold
    hi = _order_key(m)  # no cut lies above the row's max, so the max is always kept

    def count_holds(t):
        return count(t) >= top_k

    thr_k = jnp.where((top_k > 0) & (top_k < v), _from_order_key(_largest_key(count_holds, lo, hi, ways)), -jnp.inf)
    total = jnp.sum(jnp.where(z >= thr_k, weights, 0.0), axis=-1, keepdims=True)

    def mass_holds(t):  # no top-k mask needed: at or below top-k's cut the mass is >= total, so it holds there
        return mass(t) / total >= top_p

    thr_p = jnp.where(top_p < 1, _from_order_key(_largest_key(mass_holds, lo, hi, ways)), -jnp.inf)
    return z >= jnp.maximum(thr_k, thr_p)


def _top_k_top_p_keep():
    """The function behind top-k then top-p that `FILTER_IMPL` names (with "groups", the sort for a row of at most
    `TOP_CANDIDATES` tokens). `filtered_logprobs` hands it to `lax.cond` itself, not a wrapper reading FILTER_IMPL:
    cond caches a branch's trace by function, so a wrapper kept the first impl it traced for every later FILTER_IMPL
    (and comparisons of impls compared the sort with itself). The threshold search comes bound to the sums
    `THRESHOLD_SUMS` names, a new function each time for the same reason."""
    keeps = {"sort": _sorted_keep, "candidates": _candidate_keep, "threshold": _threshold_keep,
             "groups": _group_keep_or_sort}
    if FILTER_IMPL not in keeps:
        raise ValueError(f"FILTER_IMPL={FILTER_IMPL!r} is not a known impl; valid choices: {FILTER_IMPLS}.")
    if FILTER_IMPL == "threshold":
        return _threshold_search()
    if FILTER_IMPL == "groups":  # its fallback is the threshold search: a new function for the same reason
        return functools.partial(_group_keep_or_sort)
    return keeps[FILTER_IMPL]


def _keep_all(z: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """No row uses top-k or top-p: every token stays (the branch that skips the search)."""
    return jnp.ones(z.shape, jnp.bool_)


def filtered_logprobs(logits: jax.Array, rp: RowParams) -> jax.Array:
    """log of the filtered, renormalised distribution; -inf outside its support.

    logits: f32[B, V] or f32[B, S, V]; parameters are per row ([B], or [B, S]).
    Order: temperature, top-k, top-p, min-p, each on the previous one's renormalised
    result. Temperature-0 rows are one-hot at the argmax of the raw logits (the first
    index on ties); the division is guarded so they never produce NaN. The argmax
    survives every filter, so greedy is the T -> 0 limit of the same filter, not a
    different rule. The search behind top-k/top-p (`_top_k_top_p_keep`) is skipped when no row uses either.
    """
    x = jnp.asarray(logits, jnp.float32)
    v = x.shape[-1]
    t = _per_row(rp.temperature, x)
    top_k, top_p = _per_row(rp.top_k, x), _per_row(rp.top_p, x)
    greedy = t == 0
    z = x / jnp.where(greedy, 1.0, t)
    # a greedy row's support is its argmax whatever it cuts: it cuts nothing, so a search need not serve its cut
    top_k, top_p = jnp.where(greedy, 0, top_k), jnp.where(greedy, 1.0, top_p)
    needs_sort = jnp.any(((top_k > 0) & (top_k < v)) | (top_p < 1))
    keep = jax.lax.cond(needs_sort, _top_k_top_p_keep(), _keep_all, z, top_k, top_p)
    z = jnp.where(keep, z, -jnp.inf)
    relative = jnp.exp(z - jnp.max(z, axis=-1, keepdims=True))
    z = jnp.where(relative >= _per_row(rp.min_p, x), z, -jnp.inf)
    sampled = jax.nn.log_softmax(z, axis=-1)
    one_hot = jnp.where(
        jnp.arange(v) == jnp.argmax(x, axis=-1)[..., None], 0.0, -jnp.inf
    ).astype(jnp.float32)
    return jnp.where(greedy, one_hot, sampled)


def apply_penalties(logits: jax.Array, counts: jax.Array, rp: RowParams) -> jax.Array:
    """Hugging Face repetition penalty, then OpenAI frequency and presence penalties.

    logits f32[B, V]; counts i32[B, V] = occurrences of each token in the history the
    penalties apply to (Hugging Face counts the prompt too). On seen tokens the
    repetition penalty divides positive logits and multiplies negative ones; then
    `logits - frequency * count - presence * (count > 0)`. Neutral values are an exact
    identity. Apply before `filtered_logprobs` (penalties act on raw logits).
    """
    chex.assert_rank(logits, 2)
    chex.assert_equal_shape([logits, counts])
    x = jnp.asarray(logits, jnp.float32)
    seen = counts > 0
    rep = rp.repetition_penalty[:, None]
    x = jnp.where(seen, jnp.where(x < 0, x * rep, x / rep), x)
    return (
        x
        - rp.frequency_penalty[:, None] * counts.astype(jnp.float32)
        - rp.presence_penalty[:, None] * seen.astype(jnp.float32)
    )


def rng_key(seed: jax.Array, counter: jax.Array, stream: int) -> jax.Array:
    """Counter-based keys, one per row: a pure function of (seed, row, counter, stream).

    key[b] = fold_in(fold_in(fold_in(key(seed[b]), b), counter[b]), stream)

    seed u32[B] (from `row_params`); counter [B] or a scalar, advanced by the caller
    once per use (per round / per decode step) and carried in its state, so a resumed
    session continues the same stream; stream names the consumer (`STREAM_DRAFT`,
    `STREAM_TARGET`) so two draws in one round never share a key. Folding in the row
    index b makes rows with the same seed independent. Returns typed keys [B].
    """
    seed = jnp.asarray(seed, jnp.uint32)
    chex.assert_rank(seed, 1)
    counter = jnp.broadcast_to(jnp.asarray(counter, jnp.uint32), seed.shape)
    rows = jnp.arange(seed.shape[0], dtype=jnp.uint32)

    def one(s, row, c):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(s), row), c)
        return jax.random.fold_in(key, stream)

    return jax.vmap(one)(seed, rows, counter)


def sample(logprobs: jax.Array, keys: jax.Array) -> jax.Array:
    """One token per row from log-probabilities f32[B, V] (-inf never drawn) -> i32[B]."""
    chex.assert_rank(logprobs, 2)
    chex.assert_shape(keys, (logprobs.shape[0],))
    return jax.vmap(jax.random.categorical)(keys, logprobs).astype(jnp.int32)


def accept_length(
    p_draft: jax.Array, q_draft: jax.Array, u: jax.Array, n_valid: jax.Array
) -> jax.Array:
    """Leviathan accept walk: leading slots i < n_valid with u_i * q_i < p_i.

    p_draft, q_draft: f32[B, nd] probabilities of each draft under p and q; u: uniforms
    in [0, 1), f32[B, nd]; n_valid: i32[B] slots that may be examined. `u * q < p` is
    `u < p / q` without the division: q = 0 with p > 0 accepts, p = 0 always rejects.
    Returns m i32[B], the number accepted before the first rejection.
    """
    chex.assert_rank(p_draft, 2)
    chex.assert_equal_shape([p_draft, q_draft, u])
    slot = jnp.arange(p_draft.shape[-1])
    accepted = (u * q_draft < p_draft) & (slot < n_valid[:, None])
    return jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


@struct.dataclass
class DenseQ:
    """Proposal distribution over the whole vocabulary: probs f32[B, nd, V] (filtered q)."""

    probs: jax.Array


@struct.dataclass
class OneHotQ:
    """Deterministic (argmax) proposals: q is one-hot at each draft, so q(draft) = 1."""


@struct.dataclass
class SparseQ:
    """Proposal supported on a candidate list: ids i32[B, nd, K], probs f32[B, nd, K].

    Mass outside `ids` is zero (the DFlash2 selector samples among its top-K candidates).
    """

    ids: jax.Array
    probs: jax.Array


QDist = Union[DenseQ, OneHotQ, SparseQ]


def _q_of(q: QDist, tokens: jax.Array) -> jax.Array:
    """q(tokens) for tokens i32[B, nd] -> f32[B, nd]."""
    if isinstance(q, DenseQ):
        return jnp.take_along_axis(q.probs, tokens[..., None], axis=-1)[..., 0]
    if isinstance(q, SparseQ):
        return jnp.sum(jnp.where(q.ids == tokens[..., None], q.probs, 0.0), axis=-1)
    return jnp.ones(tokens.shape, jnp.float32)


def _q_at_slot(q: QDist, slot: jax.Array) -> QDist:
    """The proposal of one slot per row: fields [B, nd, ...] -> [B, ...]."""
    rows = jnp.arange(slot.shape[0])
    return jax.tree_util.tree_map(lambda a: a[rows, slot], q)


def _dense_q(q: QDist, draft: jax.Array, vocab: int) -> jax.Array:
    """q of one slot per row as f32[B, V] probabilities."""
    if isinstance(q, DenseQ):
        return q.probs.astype(jnp.float32)
    if isinstance(q, SparseQ):
        rows = jnp.arange(draft.shape[0])[:, None]
        return jnp.zeros((draft.shape[0], vocab), jnp.float32).at[rows, q.ids].add(q.probs)
    return jax.nn.one_hot(draft, vocab, dtype=jnp.float32)


def residual_logprobs(p_logprobs: jax.Array, q: QDist, draft: jax.Array) -> jax.Array:
    """log normalize(max(p - q, 0)): where to draw after rejecting `draft`.

    p_logprobs f32[B, V]; q is the proposal of this slot (DenseQ probs [B, V], OneHotQ,
    or SparseQ ids/probs [B, K]); draft i32[B] (used by OneHotQ). When p - q has no
    positive mass (p == q) the result falls back to p. That is exact: a rejection
    happens with probability sum_x max(q(x) - p(x), 0) = TV(p, q) = 0, so the residual
    is then never used in exact arithmetic, and p is the right answer to float noise.
    """
    chex.assert_rank(p_logprobs, 2)
    chex.assert_shape(draft, (p_logprobs.shape[0],))
    p = jnp.exp(p_logprobs.astype(jnp.float32))
    r = jnp.maximum(p - _dense_q(q, draft, p.shape[-1]), 0.0)
    total = jnp.sum(r, axis=-1, keepdims=True)
    residual = jnp.where(r > 0, jnp.log(jnp.where(r > 0, r, 1.0)) - jnp.log(total), -jnp.inf)
    return jnp.where(total > 0, residual, p_logprobs.astype(jnp.float32))


def speculative_accept(
    p_logprobs: jax.Array,
    drafts: jax.Array,
    q: QDist,
    vt: jax.Array,
    keys: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Lossless rejection sampling of one verify block -> (m i32[B], next_token i32[B]).

    p_logprobs f32[B, nd+1, V]: filtered target log-probs; row i scores draft i, row nd
    is the bonus after all nd drafts. drafts i32[B, nd]; q: DenseQ | OneHotQ | SparseQ
    (filtered like p); vt i32[B] verify width: at most vt-1 drafts are examined; keys:
    typed keys [B] (`rng_key(..., STREAM_TARGET)`). Rows accept m drafts; next_token is
    the residual draw at row m after a rejection, or the bonus from p row m = vt-1 when
    all examined drafts were accepted. For temperature-0 rows p is one-hot, so m is the
    number of leading drafts equal to the argmax and next_token the argmax at row m,
    whatever q is: the same answer as `greedy_accept`.
    """
    chex.assert_rank(drafts, 2)
    b, nd = drafts.shape
    if nd < 1:
        raise ValueError(f"speculative_accept needs at least one draft slot, got drafts {drafts.shape}.")
    chex.assert_shape(p_logprobs, (b, nd + 1, None))
    chex.assert_shape([vt, keys], (b,))
    n_valid = jnp.clip(vt - 1, 0, nd).astype(jnp.int32)
    p_draft = jnp.exp(jnp.take_along_axis(p_logprobs[:, :nd], drafts[..., None], axis=-1)[..., 0])
    u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 0), (nd,)))(keys)
    m = accept_length(p_draft, _q_of(q, drafts), u, n_valid)

    rows = jnp.arange(b)
    p_m = p_logprobs[rows, m].astype(jnp.float32)
    slot = jnp.minimum(m, nd - 1)
    residual = residual_logprobs(p_m, _q_at_slot(q, slot), drafts[rows, slot])
    logprobs = jnp.where((m < n_valid)[:, None], residual, p_m)
    next_token = sample(logprobs, jax.vmap(lambda k: jax.random.fold_in(k, 1))(keys))
    return m, next_token


def greedy_accept(
    target_argmax: jax.Array, drafts: jax.Array, vt: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The all-greedy fast path -> (m i32[B], next_token i32[B]).

    m = sum(cumprod(draft == argmax)) over the first vt-1 slots; next_token = argmax at
    row m (the correction after a mismatch, or the bonus). Equal to `speculative_accept`
    on temperature-0 rows, without materialising p.
    """
    chex.assert_rank(drafts, 2)
    b, nd = drafts.shape
    chex.assert_shape(target_argmax, (b, nd + 1))
    chex.assert_shape(vt, (b,))
    valid = jnp.arange(nd) < jnp.clip(vt - 1, 0, nd)[:, None]
    match = (drafts == target_argmax[:, :nd]) & valid
    m = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)
    return m, jnp.take_along_axis(target_argmax, m[:, None], axis=-1)[:, 0].astype(jnp.int32)
