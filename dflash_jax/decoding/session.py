"""Streaming speculative sessions: the device state lives between calls.

`Session.burst(n)` runs rounds until every row has up to n more tokens (or is done) and
returns them; `generate` is a session run to the end. Rounds are never cut at a burst's end:
a round's tokens past it wait in the output for the next burst, and every round runs every row
that is not done, as one uninterrupted run does. With the random stream's counter in the state,
bursts give exactly the tokens of one uninterrupted run, sampled or greedy.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Optional, Sequence

import jax.numpy as jnp
import numpy as np

from dflash_jax import sampling as smp
from dflash_jax import sharding
from dflash_jax.config import check_fits_target, policy
from dflash_jax.decoding import speculative as spec
from dflash_jax.decoding.common import (
    Result,
    Stats,
    check_capacity,
    check_dtypes,
    check_finite,
    check_memory,
    integer,
    integers,
    make_stats,
    pack_prompts,
    stop_array,
    to_lists,
)
from dflash_jax.drafters.base import Drafter
from dflash_jax.targets.base import Target


@dataclasses.dataclass
class Burst:
    """What one burst produced: per row the new tokens, and the burst's counts. `start[b]` is where
    row b's new tokens begin in the row's output (the tokens earlier bursts returned)."""

    tokens: list
    rounds: int
    drafted: int
    accepted: int
    wall_time_s: float
    start: list


class Session:
    """Speculative decoding of a batch of prompts, resumable burst by burst.

    Args mirror `generate`. `capacity` (cache rows) defaults to what the prompts and
    `max_new_tokens` need; a prompt that does not fit is refused naming both numbers, and so are
    caches that do not fit the free memory (before they are allocated).
    `inject` replaces the drafter's proposals (see `speculative.Injected`; tests, benchmarks).
    `verify_t` caps the anchor plus drafts examined per round, and the verify block (keyword >
    DFLASH_VERIFY_T > `policy.VERIFY_CAP_BY_BATCH`'s measured default: nd + 1 below batch 64, 6 from it).
    `verify_buckets` are static block widths a round may verify instead of the full block
    (keyword > DFLASH_VERIFY_BUCKETS > `policy.verify_buckets`'s measured default; see `speculative.Loop`).
    Threads may share a session: its calls take turns. Target logits that are not finite raise
    FloatingPointError naming the row and position (at the prefill, here).
    """

    def __init__(self, target: Target, drafter: Drafter, prompts, *, max_new_tokens: int, stop_tokens=(),
                 sampling: smp.Sampling | Sequence[smp.Sampling] | None = smp.Sampling(),
                 capacity: Optional[int] = None, impl: Optional[str] = None, inject: Optional[spec.Injected] = None,
                 verify_t: Optional[int] = None, verify_buckets=None, lengths=None,
                 prefill_chunk: Optional[int] = None):
        check_fits_target(drafter.config, target.config)
        check_dtypes(target, drafter)
        self._mesh = sharding.models_mesh(target, drafter)
        impl = policy.attention_impl(impl, sharded=self._mesh is not None)
        p = pack_prompts(prompts, target.config.vocab_size, prefill_chunk, lengths)
        rows = smp.per_row(sampling, p.batch)
        smp.check_speculative(rows)
        nd = drafter.n_drafts
        cap = check_capacity(p, max_new_tokens, target.config.max_position_embeddings, nd + 1, capacity)
        all_greedy = all(s.greedy for s in rows)
        if len({r.proposal for r in rows}) > 1:
            raise ValueError(f"Sampling.proposal must be the same for every row of a batch; got "
                             f"{sorted({r.proposal for r in rows})}")
        if inject is not None and not all_greedy:
            raise ValueError("injected proposals copy the greedy continuation: use temperature 0 with inject=")
        if verify_t is not None:
            verify_t = integer("verify_t", verify_t, 2, f"an integer in 2..{nd + 1} (n_drafts + 1) or None")
        if verify_buckets is not None and not isinstance(verify_buckets, str):
            verify_buckets = integers("verify_buckets", verify_buckets, 2, nd + 1, "width", f"2..{nd}").tolist()
        self.loop = spec.Loop(int(max_new_tokens), p.chunk, all_greedy, rows[0].proposal, impl,
                              policy.verify_cap(verify_t, nd, p.batch),
                              policy.verify_buckets(verify_buckets, nd, p.batch, drafter.varies_width))
        self.target, self.drafter = target, drafter
        self.stop_tokens = stop_array(stop_tokens, target.config.vocab_size)
        check_memory(target, drafter, p.batch, cap)
        t0 = time.perf_counter()
        with sharding.mesh_context(self._mesh):
            self.state, packed = spec.start(self.loop, target, drafter, jnp.asarray(p.tokens), jnp.asarray(p.lengths),
                                            sharding.place_state(target, target.init_state(p.batch, cap)),
                                            sharding.place_state(drafter, drafter.init_state(p.batch, cap)),
                                            smp.row_params(rows, p.batch), self.stop_tokens, inject)
        self._lengths = p.lengths
        self._lock = threading.Lock()
        self._read(packed)
        self._n_seen = np.zeros(p.batch, np.int64)
        self.prefill_time_s = time.perf_counter() - t0
        self.decode_time_s = 0.0
        check_finite(self._nonfinite, self._lengths)

    def _read(self, packed):
        """Host copies of what the bursts read (the output, its lengths, done and the counters), from the state's
        `speculative.report`."""
        self._out, self._n_out, self._done, self._nonfinite, self._counts = spec.read_report(
            np.asarray(sharding.fetch(packed)), self.state.out.shape[1])

    @property
    def finished(self) -> bool:
        """Every row is done and every token it generated was returned."""
        with self._lock:
            return bool(self._done.all() and (self._n_seen == self._n_out).all())

    @property
    def position(self) -> np.ndarray:
        """Tokens held per row (prompt + generated tokens committed to the cache, including those a
        round made past the last burst)."""
        with self._lock:
            return np.asarray(sharding.fetch(self.state.target_state.seq_len))

    @property
    def stats(self) -> Stats:
        """Counts so far; `decode_time_s` sums the bursts, `prefill_time_s` is the constructor's."""
        with self._lock:
            return self._stats()

    def _stats(self) -> Stats:
        st = self._counts
        return make_stats(self._n_out, st.rounds, st.accepted, st.committed, st.drafted, st.accept_hist,
                          self._nonfinite, self.prefill_time_s, self.decode_time_s)

    def burst(self, n: int) -> Burst:
        """Return up to `n` more tokens per row (the first burst's include the token chosen at
        prefill), with this burst's counts. A size past the tokens the session has left is clamped
        to them. Raises FloatingPointError naming the row and position where the target's logits
        were not finite (and again on every later call)."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"burst size must be a positive integer; got {n!r}")
        with self._lock:
            return self._burst(int(n))

    def _burst(self, n: int) -> Burst:
        n = min(n, self.loop.max_new_tokens - int(self._n_seen.min()))
        want = np.minimum(self._n_seen + n, self.loop.max_new_tokens)
        before = self._counts
        t0 = time.perf_counter()
        with sharding.mesh_context(self._mesh):
            self.state, packed = spec.run_burst(self.loop, self.target, self.drafter, self.state, self.stop_tokens,
                                                want.astype(np.int32))
        self._read(packed)
        dt = time.perf_counter() - t0
        self.decode_time_s += dt
        check_finite(self._nonfinite, self._lengths)
        start = self._n_seen
        self._n_seen = np.minimum(self._n_out, want)
        after = self._counts
        return Burst([self._out[i, start[i]: self._n_seen[i]].tolist() for i in range(len(start))],
                     int((after.rounds - before.rounds).sum()), int((after.drafted - before.drafted).sum()),
                     int((after.accepted - before.accepted).sum()), dt, start.tolist())

    def run(self) -> Result:
        """Run to the end; the tokens of every row from the start."""
        with self._lock:
            self._burst(self.loop.max_new_tokens)
            return Result(to_lists(self._out, self._n_out), self._stats())
