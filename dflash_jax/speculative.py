"""The speculative round and its on-device loop (DESIGN.md §8).

One round, for every row at once: draft a block with the drafter, verify `[anchor, drafts]`
with the target at `seq_len`, accept the longest agreeing prefix (greedy) or rejection-sample
(T > 0), commit the kept tokens (truncated at a stop token or the row's limit), roll the
target cache back by moving `seq_len`, ingest the kept tokens' taps into the draft cache.
The bonus token becomes the next anchor. `Loop.run` is a `lax.while_loop` of rounds.

What a drafter family changes is a parameter of the round, not a constant: the harvest and
number of drafts come from the drafter's config, the proposal is `Loop.proposal`, the verify
window is the per-row `vt` in the state.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import chex
import jax
import jax.numpy as jnp
from flax import struct

from dflash_jax import sampling as smp
from dflash_jax.cache import KVCache
from dflash_jax.decode import commit, prefill
from dflash_jax.nn import dense
from dflash_jax.nn import drafter as dr
from dflash_jax.nn.dense import Target
from dflash_jax.nn.drafter import Drafter


@struct.dataclass
class SpecStats:
    """Per-row counters. rounds: rounds run; drafted: drafts examined (sum of vt-1);
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

    reference: int32[B, L] the greedy continuation the drafts are copied from (L >= limit + nd).
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
    anchor: int32[B] last generated token, not yet in the target cache (it sits at cache.seq_len).
    done: bool[B] row finished (stop token or max_new_tokens).
    limit: int32[B] the row pauses when n_out reaches it (a burst's end or max_new_tokens).
    max_new: int32[B] the row finishes when n_out reaches it.
    cache: target KV cache; cache.seq_len[b] tokens are committed.
    dcache: draft context cache; dcache.seq_len == cache.seq_len (taps of committed tokens).
    vt: int32[B] verify width: at most vt-1 drafts are examined next round.
    counter: int32[B] rounds run by the row: the counter of its random stream.
    rp: per-row sampling parameters.
    stats: per-row counters.
    inject: injected proposals, or None.
    """

    out: jax.Array
    n_out: jax.Array
    anchor: jax.Array
    done: jax.Array
    limit: jax.Array
    max_new: jax.Array
    cache: KVCache
    dcache: KVCache
    vt: jax.Array
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
    verify_width: the cap vt on the anchor plus drafts examined per round (at most nd + 1);
    it never changes the output, only how many drafts may be accepted.
    """

    max_new_tokens: int
    chunk: int
    all_greedy: bool
    proposal: str = "argmax"
    impl: str = "xla"
    verify_width: Optional[int] = None

    def start(self, target: Target, drafter: Drafter, tokens, lengths, cache, dcache, rp, stop_tokens,
              inject=None) -> SpecState:
        """Chunked prefill whose taps fill the draft cache, then the first token from the target."""
        tap_ids = drafter.config.target_layer_ids

        def ingest(dcache, taps, start):
            return dr.ingest(drafter.params, drafter.config, dcache, taps, start)

        h_last, cache, dcache = prefill(target, cache, tokens, lengths, self.chunk, tap_ids, ingest, dcache, self.impl)
        dcache = dcache.replace(seq_len=cache.seq_len)
        b = tokens.shape[0]
        nd = drafter.config.n_drafts
        logits = dense.lm_logits(target.params, target.config, h_last)
        keys = smp.rng_key(rp.seed, jnp.zeros((b,), jnp.int32), smp.STREAM_TARGET)
        first = (jnp.argmax(logits, -1).astype(jnp.int32) if self.all_greedy
                 else smp.sample(smp.filtered_logprobs(logits, rp), keys))
        zeros = jnp.zeros((b,), jnp.int32)
        max_new = jnp.full((b,), self.max_new_tokens, jnp.int32)
        out = jnp.zeros((b, self.max_new_tokens + nd + 1), jnp.int32)
        out, n_out, _, stopped = commit(out, zeros, first[:, None], zeros + 1, jnp.zeros((b,), bool), stop_tokens,
                                        max_new)
        done = stopped | (n_out >= max_new)
        stats = SpecStats(zeros, zeros, zeros, zeros, jnp.zeros((b, nd + 1), jnp.int32))
        return SpecState(out=out, n_out=n_out, anchor=first, done=done, limit=max_new, max_new=max_new, cache=cache,
                         dcache=dcache, vt=zeros + (self.verify_width or nd + 1), counter=zeros + 1, rp=rp,
                         stats=stats, inject=inject)

    def propose(self, target: Target, drafter: Drafter, s: SpecState):
        """Draft one block: `(drafts int32[B, nd], q)` with q the proposal distribution."""
        dc = drafter.config
        x = dr.block_input(target.params, dc, s.anchor)
        h = dr.draft_hidden(drafter.params, dc, s.dcache, x, self.impl)
        logits = dr.draft_logits(target.params, target.config, dc, h)
        if self.proposal == "sample" and not self.all_greedy:
            logp = smp.filtered_logprobs(logits, s.rp)
            keys = smp.rng_key(s.rp.seed, s.counter, smp.STREAM_DRAFT)
            drafts = jax.vmap(lambda k, lp: jax.random.categorical(k, lp, axis=-1))(keys, logp).astype(jnp.int32)
            q = smp.DenseQ(jnp.exp(logp))
        else:
            drafts, q = jnp.argmax(logits, -1).astype(jnp.int32), smp.OneHotQ()
        if s.inject is not None:
            drafts = self._inject(s, drafts, target.config.vocab_size)
        return drafts, q

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

    def accept(self, s: SpecState, tlogits: jax.Array, drafts: jax.Array, q):
        """`(m, next)`: accepted drafts and the correction/bonus token."""
        if self.all_greedy:
            return smp.greedy_accept(jnp.argmax(tlogits, -1).astype(jnp.int32), drafts, s.vt)
        keys = smp.rng_key(s.rp.seed, s.counter, smp.STREAM_TARGET)
        return smp.speculative_accept(smp.filtered_logprobs(tlogits, s.rp), drafts, q, s.vt, keys)

    def verify(self, target: Target, drafter: Drafter, s: SpecState, drafts: jax.Array, q):
        """The target on `[anchor, drafts]` at `seq_len` (K/V written), then accept:
        `(cache, m, next, taps)`; `cache.seq_len` is not moved yet."""
        block = jnp.concatenate([s.anchor[:, None], drafts], axis=1)
        h, taps, cache = dense.extend(target.params, target.config, s.cache, block, s.cache.seq_len,
                                      drafter.config.target_layer_ids, self.impl)
        m, nxt = self.accept(s, dense.lm_logits(target.params, target.config, h), drafts, q)
        return cache, m, nxt, taps

    @staticmethod
    def advance(drafter: Drafter, s: SpecState, cache: KVCache, drafts, m, nxt, taps, stop_tokens) -> SpecState:
        """Commit `anchor + m drafts` and the next token (cut at a stop token or the row's limit),
        roll back by moving `seq_len`, ingest the kept tokens' taps, count."""
        dc = drafter.config
        nd = dc.n_drafts
        active = ~s.done
        start = s.cache.seq_len
        slots = jnp.arange(nd + 1)[None, :]
        emitted = jnp.where(slots == m[:, None], nxt[:, None], jnp.pad(drafts, ((0, 0), (0, 1))))
        out, n_out, kept, stopped = commit(s.out, s.n_out, emitted, m + 1, s.done, stop_tokens, s.limit)
        done = s.done | stopped | (n_out >= s.max_new)
        anchor = jnp.where(kept > 0, jnp.take_along_axis(emitted, jnp.maximum(kept - 1, 0)[:, None], 1)[:, 0], s.anchor)
        seq_len = start + kept
        dcache = dr.ingest(drafter.params, dc, s.dcache, taps, start).replace(seq_len=seq_len)

        a = active.astype(jnp.int32)
        st = s.stats
        stats = SpecStats(rounds=st.rounds + a, drafted=st.drafted + a * (s.vt - 1), accepted=st.accepted + a * m,
                          committed=st.committed + kept,
                          accept_hist=st.accept_hist + a[:, None] * (slots == m[:, None]))
        return s.replace(out=out, n_out=n_out, anchor=anchor, done=done, cache=cache.replace(seq_len=seq_len),
                         dcache=dcache, counter=s.counter + a, stats=stats)

    def round(self, target: Target, drafter: Drafter, s: SpecState, stop_tokens) -> SpecState:
        """Draft -> verify -> accept -> commit -> roll back -> ingest."""
        drafts, q = self.propose(target, drafter, s)
        cache, m, nxt, taps = self.verify(target, drafter, s, drafts, q)
        return self.advance(drafter, s, cache, drafts, m, nxt, taps, stop_tokens)

    def run(self, target: Target, drafter: Drafter, s: SpecState, stop_tokens) -> SpecState:
        """Rounds until every row is done or has reached its limit."""

        def cond(s):
            return jnp.any(~s.done & (s.n_out < s.limit))

        def body(s):
            paused = s.done | (s.n_out >= s.limit)
            r = self.round(target, drafter, s.replace(done=paused), stop_tokens)
            return r.replace(done=s.done | (r.done & ~paused))

        return jax.lax.while_loop(cond, body, s)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(5, 6))
def start(loop: Loop, target, drafter, tokens, lengths, cache, dcache, rp, stop_tokens, inject):
    """Prefill and first token; the empty caches are donated (no second copy of them)."""
    return loop.start(target, drafter, tokens, lengths, cache, dcache, rp, stop_tokens, inject)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def run(loop: Loop, target, drafter, state: SpecState, stop_tokens):
    return loop.run(target, drafter, state, stop_tokens)


def check_drafter(target: Target, drafter: Drafter) -> None:
    """Refuse a drafter that does not fit the target (names both numbers)."""
    tc, dc = target.config, drafter.config
    if dc.hidden_size != tc.hidden_size:
        raise ValueError(f"drafter hidden_size {dc.hidden_size} != target hidden_size {tc.hidden_size}")
    bad = [i for i in dc.target_layer_ids if not 0 <= i < tc.num_layers]
    if bad:
        raise ValueError(f"drafter target_layer_ids {list(dc.target_layer_ids)} name layers {bad} outside the "
                         f"target's {tc.num_layers} layers")
    if not 0 <= dc.mask_token_id < tc.vocab_size:
        raise ValueError(f"drafter mask_token_id {dc.mask_token_id} is outside the target vocabulary "
                         f"[0, {tc.vocab_size})")
    chex.assert_equal(drafter.params["fc"].shape[0], dc.n_taps * tc.hidden_size)
