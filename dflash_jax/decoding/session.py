"""Streaming speculative sessions: the device state lives between calls.

`Session.burst(n)` runs rounds until every row has up to n more tokens (or is done) and
returns them; `generate` is a session run to the end. The random stream's counter lives in
the state, so bursts give exactly the tokens of one uninterrupted run.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import sampling as smp
from dflash_jax.config import check_fits_target, policy
from dflash_jax.decoding import speculative as spec
from dflash_jax.decoding.common import (
    Result,
    Stats,
    check_capacity,
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
    """What one burst produced: per row the new tokens, and the burst's counts."""

    tokens: list
    rounds: int
    drafted: int
    accepted: int
    wall_time_s: float


class Session:
    """Speculative decoding of a batch of prompts, resumable burst by burst.

    Args mirror `generate`. `capacity` (cache rows) defaults to what the prompts and
    `max_new_tokens` need; a prompt that does not fit is refused naming both numbers, and so are
    caches that do not fit the free memory (before they are allocated).
    `inject` replaces the drafter's proposals (see `speculative.Injected`; tests, benchmarks).
    `verify_t` caps the anchor plus drafts examined per round (keyword > DFLASH_VERIFY_T > nd + 1).
    `verify_buckets` are static block widths a round may verify instead of the full block
    (keyword > DFLASH_VERIFY_BUCKETS > `policy.verify_buckets`'s measured default; see `speculative.Loop`).
    """

    def __init__(self, target: Target, drafter: Drafter, prompts, *, max_new_tokens: int, stop_tokens=(),
                 sampling: smp.Sampling | Sequence[smp.Sampling] | None = smp.Sampling(),
                 capacity: Optional[int] = None, impl: Optional[str] = None, inject: Optional[spec.Injected] = None,
                 verify_t: Optional[int] = None, verify_buckets=None, lengths=None):
        check_fits_target(drafter.config, target.config)
        impl = policy.attention_impl(impl)
        p = pack_prompts(prompts, target.config.vocab_size, lengths=lengths)
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
                              policy.verify_cap(verify_t, nd),
                              policy.verify_buckets(verify_buckets, nd, p.batch, drafter.varies_width))
        self.target, self.drafter = target, drafter
        self.stop_tokens = stop_array(stop_tokens, target.config.vocab_size)
        check_memory(target, drafter, p.batch, cap)
        t0 = time.perf_counter()
        self.state = spec.start(self.loop, target, drafter, jnp.asarray(p.tokens), jnp.asarray(p.lengths),
                                target.init_state(p.batch, cap), drafter.init_state(p.batch, cap),
                                smp.row_params(rows, p.batch), self.stop_tokens, inject)
        jax.block_until_ready(self.state)
        self._n_seen = np.zeros(p.batch, np.int64)
        self.prefill_time_s = time.perf_counter() - t0
        self.decode_time_s = 0.0

    @property
    def finished(self) -> bool:
        return bool(jnp.all(self.state.done))

    @property
    def position(self) -> np.ndarray:
        """Tokens held per row (prompt + generated tokens committed to the cache)."""
        return np.asarray(jax.device_get(self.state.target_state.seq_len))

    @property
    def stats(self) -> Stats:
        """Counts so far; `decode_time_s` sums the bursts, `prefill_time_s` is the constructor's."""
        st = self.state.stats
        return make_stats(self.state.n_out, st.rounds, st.accepted, st.committed, st.drafted, st.accept_hist,
                          self.prefill_time_s, self.decode_time_s)

    def burst(self, n: int) -> Burst:
        """Return up to `n` more tokens per row (the first burst's include the token chosen at
        prefill), with this burst's counts."""
        if not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"burst size must be a positive integer; got {n!r}")
        before = jax.device_get(self.state.stats)
        s = self.state
        s = s.replace(limit=jnp.minimum(s.max_new, jnp.asarray(self._n_seen + int(n), jnp.int32)))
        t0 = time.perf_counter()
        self.state = spec.run(self.loop, self.target, self.drafter, s, self.stop_tokens)
        out, n_out, after = jax.device_get((self.state.out, self.state.n_out, self.state.stats))
        dt = time.perf_counter() - t0
        self.decode_time_s += dt
        tokens = [out[i, int(self._n_seen[i]): int(n_out[i])].tolist() for i in range(out.shape[0])]
        self._n_seen = np.asarray(n_out).copy()
        return Burst(tokens, int((after.rounds - before.rounds).sum()), int((after.drafted - before.drafted).sum()),
                     int((after.accepted - before.accepted).sum()), dt)

    def run(self) -> Result:
        """Run to the end; the tokens of every row from the start."""
        self.burst(int(self.loop.max_new_tokens))
        out, n_out = jax.device_get((self.state.out, self.state.n_out))
        return Result(to_lists(out, n_out), self.stats)
