"""The speculative round and its on-device loop (docs/architecture.md, "The round").

One round, for every row at once, through the Target and Drafter interfaces only:
`drafter.propose` -> `target.extend` of `[anchor, drafts]` at `seq_len` -> accept the longest
agreeing prefix (greedy) or rejection-sample (T > 0), capped by the proposal's verify width ->
append the kept tokens (cut at a stop token, at `max_new_tokens`, or before a verify row whose
logits are not finite) -> `target.commit` (the only rollback) -> `drafter.ingest` of the block's
taps and `drafter.commit` of the kept ones. The bonus token becomes the next anchor. `Loop.run`
is a `lax.while_loop` of rounds; every round runs every row that is not done, so a run split into
bursts runs exactly the rounds of one uninterrupted run.

Nothing here knows a family: harvest, heads and verify width are the drafter's; the state
of each model is opaque to the loop but for its `seq_len`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dflash_jax import sampling as smp
from dflash_jax.config import policy
from dflash_jax.decoding.common import append_tokens, choose, finite_rows, open_output, prefill
from dflash_jax.drafters.base import Drafter, Proposal, ProposeSettings
from dflash_jax.targets.base import Target


@struct.dataclass
class SpecStats:
    """Per-row counters. rounds: rounds run; drafted: drafts examined (sum of verify_width - 1);
    accepted: drafts accepted; committed: tokens committed by rounds; accept_hist:
    int32[B, nd + 1], how many rounds accepted exactly m drafts."""

    rounds: jax.Array
    drafted: jax.Array
    accepted: jax.Array
    committed: jax.Array
    accept_hist: jax.Array


STREAM_INJECT = 2
"""`rng_key` stream for drawing the first wrong slot of injected proposals (apart from
`sampling.STREAM_DRAFT` and `sampling.STREAM_TARGET`)."""


@struct.dataclass
class Injected:
    """Proposals injected in place of the drafter's (tests and acceptance-controlled benchmarks).

    reference: int32[B, L] the greedy continuation the drafts are copied from (L >= max_new_tokens + nd).
    first_wrong: float32[nd + 1] probabilities of the first wrong slot k (k = nd: none wrong);
      a wrong slot holds `(reference + 1) % V`. The drafter still runs, so its cost is paid.
    """

    reference: jax.Array
    first_wrong: jax.Array


@struct.dataclass
class SpecState:
    """Carry of speculative decoding.

    out: int32[B, N + nd + 1] generated tokens (the first n_out[b] are real).
    n_out: int32[B] tokens generated so far per row.
    anchor: int32[B] last generated token, not yet in the target state (it sits at its seq_len).
    done: bool[B] row finished (stop token, max_new_tokens, or target logits that are not finite).
    nonfinite: int32[B] index of the generated token whose target logits were not finite (-1: none).
    limit: int32[B] `run` returns once every row not done has n_out >= limit (a burst's end). Rounds
      are not cut there: a row may run past it, its extra tokens wait in `out` for the next burst.
    max_new: int32[B] the row finishes when n_out reaches it.
    target_state: the target's state; its seq_len[b] positions are committed.
    drafter_state: the drafter's state; its seq_len equals the target's (taps of committed tokens).
    counter: int32[B] rounds run by the row: the counter of its random stream.
    rp: per-row sampling parameters.
    stats: per-row counters.
    inject: injected proposals, or None.
    """

    out: jax.Array
    n_out: jax.Array
    anchor: jax.Array
    done: jax.Array
    nonfinite: jax.Array
    limit: jax.Array
    max_new: jax.Array
    target_state: object
    drafter_state: object
    counter: jax.Array
    rp: smp.RowParams
    stats: SpecStats
    inject: Optional[Injected] = None


@dataclasses.dataclass(frozen=True)
class Loop:
    """Static settings of speculative decoding; hashable, one compiled program per setting.

    max_new_tokens: output buffer length. chunk: prefill chunk. all_greedy: every row has
    temperature 0 (accept by argmax comparison, no distributions materialised).
    proposal: 'argmax' (one-hot q) or 'sample' (each slot drawn from the filtered draft
    distribution, dense q). impl: attention implementation ('xla' | 'pallas').
    verify_cap: the largest verify width (anchor plus drafts examined per round, 2..nd + 1);
    it never changes the output, only how many drafts may be accepted, and the verify block is cut to it
    (a cap of 8 verifies 8 rows a round, not nd + 1: at a large batch the verify is compute-bound).
    verify_buckets: static block widths below the cap. Each round verifies the smallest bucket
    that holds every active row's verify width (`lax.switch`), the widest block (nd + 1, or the cap)
    when none does; () always verifies that block. The output is the same either way; the cost is not.
    """

    max_new_tokens: int
    chunk: int
    all_greedy: bool
    proposal: str
    impl: str
    verify_cap: int
    verify_buckets: tuple = ()

    @property
    def settings(self) -> ProposeSettings:
        return ProposeSettings(self.all_greedy, self.proposal, self.impl, self.verify_cap)

    def start(self, target: Target, drafter: Drafter, tokens, lengths, tstate, dstate, rp, stop_tokens,
              inject=None) -> SpecState:
        """Chunked prefill whose taps fill the drafter's context, then the first token from the target."""
        h_last, tstate, dstate = prefill(target, tstate, tokens, lengths, self.chunk, drafter, dstate, self.impl)
        keys = smp.rng_key(rp.seed, jnp.zeros(tokens.shape[:1], jnp.int32), smp.STREAM_TARGET)
        logits = target.logits(h_last)
        first = choose(logits, rp, keys, self.all_greedy)
        return self.begin(drafter, first, tstate, dstate, rp, stop_tokens, inject, finite_rows(logits))

    def begin(self, drafter: Drafter, first: jax.Array, tstate, dstate, rp, stop_tokens, inject=None,
              finite=None) -> SpecState:
        """The carry after the prompt: both states hold it, `first` is the token chosen after it
        (from logits that were `finite` per row; None: all were)."""
        b, nd = first.shape[0], drafter.n_drafts
        out, n_out, done, max_new = open_output(first, self.max_new_tokens, nd + 1, stop_tokens, finite)
        zeros = jnp.zeros((b,), jnp.int32)
        nonfinite = zeros - 1 if finite is None else jnp.where(finite, jnp.int32(-1), jnp.int32(0))
        stats = SpecStats(zeros, zeros, zeros, zeros, jnp.zeros((b, nd + 1), jnp.int32))
        return SpecState(out=out, n_out=n_out, anchor=first, done=done, nonfinite=nonfinite, limit=max_new,
                         max_new=max_new, target_state=tstate, drafter_state=dstate, counter=zeros + 1, rp=rp,
                         stats=stats, inject=inject)

    def propose(self, target: Target, drafter: Drafter, s: SpecState) -> Proposal:
        """The drafter's proposal for this round (with injected drafts in their place when given)."""
        prop = drafter.propose(s.drafter_state, target, s.anchor, s.rp, s.counter, self.settings)
        if s.inject is not None:
            prop = prop.replace(drafts=self._inject(s, prop.drafts, target.config.vocab_size))
        return prop

    @staticmethod
    def _inject(s: SpecState, drafts: jax.Array, vocab: int) -> jax.Array:
        """Reference tokens with the first wrong slot drawn from `first_wrong`. The wrong token is
        the drafter's own where it differs from the reference, so the drafter's output is used and
        XLA cannot drop the drafter as dead code (benchmarks must pay for it)."""
        b, nd = drafts.shape
        idx = s.n_out[:, None] + jnp.arange(nd)[None, :]
        ref = jnp.take_along_axis(s.inject.reference, idx, axis=1)
        keys = smp.rng_key(s.rp.seed, s.counter, STREAM_INJECT)
        # categorical, not random.choice: choice's searchsorted is a loop, a nested while on the
        # GPU that synchronised with the host every round (0.2-0.3 ms a round on the H200)
        log_p = jnp.log(s.inject.first_wrong)
        wrong = jax.vmap(lambda k: jax.random.categorical(k, log_p))(keys)
        bad = jnp.where(drafts != ref, drafts, (ref + 1) % vocab)
        return jnp.where(jnp.arange(nd)[None, :] == wrong[:, None], bad, ref).astype(jnp.int32)

    def accept(self, s: SpecState, tlogits: jax.Array, prop: Proposal):
        """`(m, next)`: accepted drafts (at most verify_width - 1) and the correction/bonus token."""
        if self.all_greedy:
            return smp.greedy_accept(jnp.argmax(tlogits, -1).astype(jnp.int32), prop.drafts, prop.verify_width)
        keys = smp.rng_key(s.rp.seed, s.counter, smp.STREAM_TARGET)
        return smp.speculative_accept(smp.filtered_logprobs(tlogits, s.rp), prop.drafts, prop.q,
                                      prop.verify_width, keys)

    def verify(self, target: Target, drafter: Drafter, s: SpecState, prop: Proposal):
        """The target on `[anchor, drafts]` at `seq_len`, then accept: `(tstate, pending, m, next, taps,
        n_finite)`, n_finite[b] the leading block rows whose logits are finite; nothing is committed yet."""
        block = jnp.concatenate([s.anchor[:, None], prop.drafts], axis=1)
        h, taps, tstate, pending = target.extend(s.target_state, block, s.target_state.seq_len, drafter.tap_ids,
                                                 self.impl)
        tlogits = target.logits(h)
        m, nxt = self.accept(s, tlogits, prop)
        n_finite = jnp.sum(jnp.cumprod(finite_rows(tlogits), axis=1, dtype=jnp.int32), axis=1)
        return tstate, pending, m, nxt, taps, n_finite

    @staticmethod
    def advance(target: Target, drafter: Drafter, s: SpecState, prop: Proposal, tstate, pending, m, nxt, taps,
                n_finite, stop_tokens) -> SpecState:
        """Append `m drafts` and the next token (cut at a stop token or max_new_tokens), commit the kept
        positions in both models, count. A row whose block row j <= m has logits that are not finite
        keeps only the j tokens before it, is done, and records where in `nonfinite`."""
        nd = drafter.n_drafts
        active = ~s.done
        slots = jnp.arange(nd + 1)[None, :]
        width = prop.drafts.shape[1] + 1
        m = jnp.minimum(m, n_finite)
        emitted = jnp.where(jnp.arange(width)[None, :] == m[:, None], nxt[:, None],
                            jnp.pad(prop.drafts, ((0, 0), (0, 1))))
        out, n_out, kept, stopped = append_tokens(s.out, s.n_out, emitted, jnp.minimum(m + 1, n_finite), s.done,
                                                  stop_tokens, s.max_new)
        bad = active & (n_finite <= m) & ~stopped & (n_out < s.max_new)
        done = s.done | stopped | (n_out >= s.max_new) | bad
        anchor = jnp.where(kept > 0, jnp.take_along_axis(emitted, jnp.maximum(kept - 1, 0)[:, None], 1)[:, 0], s.anchor)
        tstate = target.commit(tstate, pending, kept)
        dstate, dpending = drafter.ingest(s.drafter_state, taps, s.target_state.seq_len, prop)
        dstate = drafter.commit(dstate, dpending, kept)

        a = active.astype(jnp.int32)
        st = s.stats
        stats = SpecStats(rounds=st.rounds + a, drafted=st.drafted + a * (prop.verify_width - 1),
                          accepted=st.accepted + a * m, committed=st.committed + kept,
                          accept_hist=st.accept_hist + a[:, None] * (slots == m[:, None]))
        return s.replace(out=out, n_out=n_out, anchor=anchor, done=done, nonfinite=jnp.where(bad, n_out, s.nonfinite),
                         target_state=tstate, drafter_state=dstate, counter=s.counter + a, stats=stats)

    def round(self, target: Target, drafter: Drafter, s: SpecState, stop_tokens) -> SpecState:
        """Propose -> verify -> accept -> append -> commit (roll back) -> ingest."""
        prop = self.propose(target, drafter, s)

        def finish(width: int) -> SpecState:
            p = narrow(prop, width)
            tstate, pending, m, nxt, taps, n_finite = self.verify(target, drafter, s, p)
            return self.advance(target, drafter, s, p, tstate, pending, m, nxt, taps, n_finite, stop_tokens)

        top = min(self.verify_cap, prop.drafts.shape[1] + 1)  # no row may use more: a narrower block is verified
        widths = (*sorted(w for w in set(self.verify_buckets) if w < top), top)
        if len(widths) == 1:
            return finish(widths[0])
        need = jnp.max(jnp.where(s.done, 2, prop.verify_width))
        return jax.lax.switch(jnp.sum(jnp.asarray(widths) < need), [functools.partial(finish, w) for w in widths])

    def run(self, target: Target, drafter: Drafter, s: SpecState, stop_tokens) -> SpecState:
        """Rounds of every row not done, until every such row has reached its limit. A row past its
        limit keeps running while others catch up, so the rounds and their random draws never depend
        on where a session's bursts end (its extra tokens wait in `out`)."""

        def cond(s):
            return jnp.any(~s.done & (s.n_out < s.limit))

        return jax.lax.while_loop(cond, lambda s: self.round(target, drafter, s, stop_tokens), s)


def narrow(prop: Proposal, width: int) -> Proposal:
    """The proposal cut to a block of `width` rows (the anchor and its first width - 1 drafts)."""
    if width == prop.drafts.shape[1] + 1:
        return prop
    cut = functools.partial(jax.tree.map, lambda a: a[:, :width - 1])
    return prop.replace(drafts=prop.drafts[:, :width - 1], q=cut(prop.q), verify_width=jnp.minimum(
        prop.verify_width, width), logits=None if prop.logits is None else cut(prop.logits))


REPORT_COUNTERS = 7
"""Columns of `report` between `out` and `accept_hist`: n_out, done, nonfinite, rounds, drafted, accepted,
committed."""


def report(s: SpecState) -> jax.Array:
    """What a session reads after a call, as one int32 array `[B, out width + 7 + nd + 1]`: the host fetches it in
    one transfer instead of nine."""
    st = s.stats
    counters = (s.n_out, s.done, s.nonfinite, st.rounds, st.drafted, st.accepted, st.committed)
    return jnp.concatenate([s.out, jnp.stack([c.astype(jnp.int32) for c in counters], 1), st.accept_hist], 1
                           ).astype(jnp.int32)


def read_report(packed: np.ndarray, out_width: int) -> tuple:
    """`(out, n_out, done, nonfinite, SpecStats)` as host arrays from a fetched `report`."""
    n_out, done, nonfinite, rounds, drafted, accepted, committed = (
        packed[:, out_width + i] for i in range(REPORT_COUNTERS))
    return (packed[:, :out_width], n_out, done.astype(bool), nonfinite,
            SpecStats(rounds, drafted, accepted, committed, packed[:, out_width + REPORT_COUNTERS:]))


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(5, 6))
def start(loop: Loop, target, drafter, tokens, lengths, tstate, dstate, rp, stop_tokens, inject):
    """Prefill and first token, and the state's `report`; the empty states are donated (no second copy of them)."""
    state = loop.start(target, drafter, tokens, lengths, tstate, dstate, rp, stop_tokens, inject)
    return state, report(state)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def run(loop: Loop, target, drafter, state: SpecState, stop_tokens):
    return loop.run(target, drafter, state, stop_tokens)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3,
                   compiler_options=policy.loop_compiler_options())
def run_burst(loop: Loop, target, drafter, state: SpecState, stop_tokens, limit):
    """`run` to a new `limit` and the resulting state's `report`: a session's burst is this one dispatch (the limit
    travels with it) and one transfer back."""
    state = loop.run(target, drafter, state.replace(limit=limit), stop_tokens)
    return state, report(state)

