"""Plain autoregressive decoding: one jitted `lax.while_loop` of target steps, through the Target
interface only. It is the oracle speculative decoding must equal, token for token, when greedy.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from flax import struct

from dflash_jax import sampling as smp
from dflash_jax import sharding
from dflash_jax.config import policy
from dflash_jax.decoding.common import (
    Result,
    append_tokens,
    check_capacity,
    check_finite,
    check_memory,
    choose,
    finite_rows,
    make_stats,
    open_output,
    pack_prompts,
    prefill,
    stop_array,
    to_lists,
)
from dflash_jax.targets.base import Target


@struct.dataclass
class PlainState:
    """Carry of plain decoding.

    out: int32[B, N + 1] generated tokens (the first n_out[b] are real).
    n_out: int32[B] tokens generated per row.
    token: int32[B] the last generated token, not yet in the target state (it sits at seq_len).
    done: bool[B] row finished (stop token, its token limit, or logits that are not finite).
    nonfinite: int32[B] index of the generated token whose target logits were not finite (-1: none).
    limit: int32[B] row stops when n_out reaches it (max_new_tokens).
    state: the target's decoding state.
    rp: per-row sampling parameters.
    counts: int32[B, V] token counts for penalties (zeros [B, 1] when none are used).
    """

    out: jax.Array
    n_out: jax.Array
    token: jax.Array
    done: jax.Array
    nonfinite: jax.Array
    limit: jax.Array
    state: object
    rp: smp.RowParams
    counts: jax.Array


@dataclasses.dataclass(frozen=True)
class PlainLoop:
    """Static settings of plain decoding; hashable, so one compiled program per setting."""

    max_new_tokens: int
    chunk: int
    all_greedy: bool
    penalties: bool
    impl: str = "xla"

    def start(self, target: Target, tokens, lengths, state, rp, stop_tokens) -> PlainState:
        """Chunked prefill, then the first token from the target."""
        h_last, state, _ = prefill(target, state, tokens, lengths, self.chunk, impl=self.impl)
        b = tokens.shape[0]
        counts = jnp.zeros((b, target.config.vocab_size if self.penalties else 1), jnp.int32)
        if self.penalties:
            valid = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
            counts = counts.at[jnp.arange(b)[:, None], tokens].add(valid.astype(jnp.int32))
        logits = target.logits(h_last)
        first = self._pick(logits, rp, counts, jnp.zeros((b,), jnp.int32))
        return self.begin(first, state, rp, stop_tokens, counts, finite_rows(logits))

    def begin(self, first: jax.Array, state, rp, stop_tokens, counts, finite=None) -> PlainState:
        """The carry after the prompt: `state` holds it, `first` is the token chosen after it
        (from logits that were `finite` per row; None: all were)."""
        out, n_out, done, limit = open_output(first, self.max_new_tokens, 1, stop_tokens, finite)
        ok = jnp.ones(first.shape, bool) if finite is None else finite
        nonfinite = jnp.where(ok, jnp.int32(-1), jnp.int32(0))
        return PlainState(out, n_out, first, done, nonfinite, limit, state, rp, self._count(counts, first, done))

    def _pick(self, logits, rp, counts, counter):
        if self.penalties:
            logits = smp.apply_penalties(logits, counts, rp)
        return choose(logits, rp, smp.rng_key(rp.seed, counter, smp.STREAM_TARGET), self.all_greedy)

    def _count(self, counts, token, done):
        if not self.penalties:
            return counts
        return counts.at[jnp.arange(token.shape[0]), token].add((~done).astype(jnp.int32))

    def step(self, target: Target, s: PlainState, stop_tokens) -> PlainState:
        """Feed the last token, commit it (unless the row is done), choose the next, append it. A row
        whose logits are not finite appends nothing, is done, and records where in `nonfinite`."""
        h, _, state, pending = target.extend(s.state, s.token[:, None], s.state.seq_len, impl=self.impl)
        state = target.commit(state, pending, (~s.done).astype(jnp.int32))
        logits = target.logits(h[:, 0])
        bad = ~s.done & ~finite_rows(logits)
        nxt = self._pick(logits, s.rp, s.counts, s.n_out)
        out, n_out, kept, stopped = append_tokens(s.out, s.n_out, nxt[:, None], jnp.ones_like(s.n_out),
                                                  s.done | bad, stop_tokens, s.limit)
        done = s.done | bad | stopped | (n_out >= s.limit)
        return s.replace(out=out, n_out=n_out, token=jnp.where(kept > 0, nxt, s.token), done=done,
                         nonfinite=jnp.where(bad, s.n_out, s.nonfinite), state=state,
                         counts=self._count(s.counts, nxt, s.done | bad))

    def run(self, target: Target, s: PlainState, stop_tokens) -> PlainState:
        return jax.lax.while_loop(lambda s: ~jnp.all(s.done), lambda s: self.step(target, s, stop_tokens), s)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=4)
def start(loop: PlainLoop, target: Target, tokens, lengths, state, rp, stop_tokens) -> PlainState:
    """Prefill and first token; the empty state is donated."""
    return loop.start(target, tokens, lengths, state, rp, stop_tokens)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def run(loop: PlainLoop, target: Target, s: PlainState, stop_tokens) -> PlainState:
    """Decode every row to the end."""
    return loop.run(target, s, stop_tokens)


def plain_generate(target: Target, prompts, *, max_new_tokens: int, stop_tokens=(),
                   sampling: smp.Sampling | Sequence[smp.Sampling] | None = smp.Sampling(),
                   capacity: Optional[int] = None, impl: Optional[str] = None, lengths=None,
                   prefill_chunk: Optional[int] = None) -> Result:
    """Autoregressive decoding as one jitted `lax.while_loop` after a jitted prefill."""
    mesh = sharding.models_mesh(target)
    impl = policy.attention_impl(impl, sharded=mesh is not None)
    p = pack_prompts(prompts, target.config.vocab_size, prefill_chunk, lengths)
    cap = check_capacity(p, max_new_tokens, target.config.max_position_embeddings, 1, capacity)
    samplings = smp.per_row(sampling, p.batch)
    stops = stop_array(stop_tokens, target.config.vocab_size)
    check_memory(target, None, p.batch, cap)
    rp = smp.row_params(samplings, p.batch)
    loop = PlainLoop(int(max_new_tokens), p.chunk, all(s.greedy for s in samplings),
                     any(s.has_penalties for s in samplings), impl)
    t0 = time.perf_counter()
    with sharding.mesh_context(mesh):
        s = jax.block_until_ready(start(loop, target, jnp.asarray(p.tokens), jnp.asarray(p.lengths),
                                        sharding.place_state(target, target.init_state(p.batch, cap)), rp, stops))
        t1 = time.perf_counter()
        s = run(loop, target, s, stops)
    out, n_out, nonfinite = sharding.fetch((s.out, s.n_out, s.nonfinite))
    t2 = time.perf_counter()
    check_finite(nonfinite, p.lengths)
    steps = jnp.maximum(jnp.asarray(n_out) - 1, 0)
    stats = make_stats(n_out, steps, jnp.zeros_like(steps), steps, jnp.zeros_like(steps), steps[:, None], nonfinite,
                       t1 - t0, t2 - t1)
    return Result(to_lists(out, n_out), stats)
