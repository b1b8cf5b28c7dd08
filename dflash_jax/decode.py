"""What plain and speculative decoding share: prompt packing, capacity, chunked prefill,
token choice, commit of emitted tokens, and the plain autoregressive loop.

Host-side checks run once before tracing; everything per token runs in one jitted
`lax.while_loop` with per-row progress as data.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dflash_jax import policy
from dflash_jax import sampling as smp
from dflash_jax.cache import KVCache, write_rows
from dflash_jax.nn import dense
from dflash_jax.nn.dense import Target

PREFILL_CHUNK = 512


@dataclasses.dataclass(frozen=True)
class Prompts:
    """Right-padded prompts: `tokens [B, T_pad]` (T_pad a multiple of `chunk`) and `lengths [B]`."""

    tokens: np.ndarray
    lengths: np.ndarray
    chunk: int

    @property
    def batch(self) -> int:
        return self.tokens.shape[0]


def pack_prompts(prompts, vocab_size: int, chunk: int = PREFILL_CHUNK) -> Prompts:
    """Validate ragged prompts (list of token-id lists, or a 2-D int array) and pad them.

    The padded length is rounded up to a power of two (at least 16), or to a multiple of
    `chunk` past it, so nearby prompt lengths share one compiled program.
    """
    if isinstance(prompts, (np.ndarray, jax.Array)):
        arr = np.asarray(prompts)
        if arr.ndim != 2:
            raise ValueError(f"prompts array must be 2-D [batch, time]; got shape {arr.shape}")
        rows = list(arr)
    elif isinstance(prompts, Sequence) and not isinstance(prompts, (str, bytes)):
        rows = list(prompts)
    else:
        raise ValueError(f"prompts must be a list of token-id lists or a 2-D int array; got {type(prompts).__name__}")
    if not rows:
        raise ValueError("prompts is empty: give at least one prompt")
    out = []
    for i, row in enumerate(rows):
        if isinstance(row, (str, bytes)):
            raise ValueError(f"prompt {i} is text; encode it to token ids first (e.g. with the model's tokenizer)")
        a = np.asarray(row)
        if a.ndim != 1:
            raise ValueError(f"prompt {i} must be a flat list of token ids; got shape {a.shape}")
        if a.size == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        integral = a.dtype == object and all(isinstance(t, (int, np.integer)) for t in a)
        if not (np.issubdtype(a.dtype, np.integer) or integral):
            raise ValueError(f"prompt {i} holds non-integer token ids (dtype {a.dtype})")
        a = a.astype(np.int64)
        if a.min() < 0 or a.max() >= vocab_size:
            bad = int(a[(a < 0) | (a >= vocab_size)][0])
            raise ValueError(f"prompt {i} has token id {bad} outside the vocabulary [0, {vocab_size})")
        out.append(a)
    lengths = np.array([len(a) for a in out], np.int32)
    longest = int(lengths.max())
    padded = max(16, 1 << (longest - 1).bit_length())
    if padded > chunk:
        padded = -(-longest // chunk) * chunk
    tokens = np.zeros((len(out), padded), np.int32)
    for i, a in enumerate(out):
        tokens[i, : len(a)] = a
    return Prompts(tokens, lengths, min(chunk, padded))


def check_capacity(prompts: Prompts, max_new_tokens: int, limit: int, slack: int, capacity: Optional[int]) -> int:
    """Cache capacity for this run, or ValueError naming the numbers.

    `limit` is the model's position limit; `slack` the extra rows a verify block may write.
    """
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer; got {max_new_tokens!r}")
    need = int(prompts.lengths.max()) + int(max_new_tokens)
    if need > limit:
        raise ValueError(f"prompt ({int(prompts.lengths.max())} tokens) + max_new_tokens ({max_new_tokens}) = {need} "
                         f"exceeds the model's max_position_embeddings ({limit})")
    rows = max(need + slack, prompts.tokens.shape[1])
    if capacity is not None:
        if capacity < rows:
            raise ValueError(f"capacity {capacity} is too small: prompt ({int(prompts.lengths.max())} tokens) + "
                             f"max_new_tokens ({max_new_tokens}) + verify slack ({slack}) needs {rows}")
        return int(capacity)
    return -(-rows // 128) * 128


def prefill(target: Target, cache: KVCache, tokens: jax.Array, lengths: jax.Array, chunk: int,
            tap_ids: tuple = (), on_chunk: Optional[Callable] = None, extra=None, impl: str = "xla"):
    """Chunked prefill of right-padded prompts. Returns `(h_last [B, H], cache, extra)`.

    Each chunk is one `extend`; `on_chunk(extra, taps, start)` sees its taps (the drafter
    fills its context cache there). Rows past a prompt's length write K/V beyond `seq_len`,
    which stay masked and are overwritten later.
    """
    b, t = tokens.shape
    n = t // chunk
    last = lengths - 1

    def body(carry, xs):
        cache, h_last, extra = carry
        i, chunk_tokens = xs
        # opaque to XLA: with one chunk, a constant start makes the masked context scores
        # constant and XLA spends seconds constant-folding them
        start = jax.lax.optimization_barrier(jnp.full((b,), i * chunk, jnp.int32))
        h, taps, cache = dense.extend(target.params, target.config, cache, chunk_tokens, start, tap_ids, impl)
        inside = (last >= i * chunk) & (last < (i + 1) * chunk)
        row = jnp.take_along_axis(h, jnp.clip(last - i * chunk, 0, chunk - 1)[:, None, None], axis=1)[:, 0]
        h_last = jnp.where(inside[:, None], row, h_last)
        if on_chunk is not None:
            extra = on_chunk(extra, taps, start)
        return (cache, h_last, extra), None

    h0 = jnp.zeros((b, target.config.hidden_size), target.params["embed"].dtype)
    xs = (jnp.arange(n, dtype=jnp.int32), tokens.reshape(b, n, chunk).transpose(1, 0, 2))
    (cache, h_last, extra), _ = jax.lax.scan(body, (cache, h0, extra), xs)
    return h_last, cache.replace(seq_len=lengths.astype(jnp.int32)), extra


def choose(logits: jax.Array, rp: smp.RowParams, keys, all_greedy: bool) -> jax.Array:
    """One token per row from `logits [B, V]`: argmax when every row is greedy, else sampled
    from the filtered distribution (temperature-0 rows come out as argmax there too)."""
    if all_greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return smp.sample(smp.filtered_logprobs(logits, rp), keys)


def commit(out: jax.Array, n_out: jax.Array, emitted: jax.Array, n_emit: jax.Array, done: jax.Array,
           stop_tokens: jax.Array, limit: jax.Array):
    """Append up to `n_emit[b]` of `emitted [B, E]` to `out` at `n_out`, truncating after the
    first stop token and at `limit[b]` tokens. Returns `(out, n_out, kept, stopped)`: stopped
    says a stop token was kept. Finished rows (`done`) keep their tokens (kept = 0). `out`
    needs E columns of room past the largest limit."""
    e = emitted.shape[1]
    idx = jnp.arange(e, dtype=jnp.int32)[None, :]
    is_stop = jnp.isin(emitted, stop_tokens) & (idx < n_emit[:, None])
    first_stop = jnp.min(jnp.where(is_stop, idx, e), axis=1)
    kept = jnp.minimum(jnp.minimum(n_emit, first_stop + 1), limit - n_out)
    kept = jnp.where(done, 0, jnp.maximum(kept, 0))
    out = write_rows(out, emitted, n_out)  # rows past n_out are scratch; `out` has room for E more
    return out, n_out + kept, kept, first_stop < kept


@struct.dataclass
class PlainState:
    """Carry of plain decoding.

    out: int32[B, N + 1] generated tokens (the first n_out[b] are real).
    n_out: int32[B] tokens generated per row.
    token: int32[B] the last generated token, not yet in the cache (it sits at cache.seq_len).
    done: bool[B] row finished (stop token or its token limit).
    limit: int32[B] row stops when n_out reaches it (max_new_tokens).
    cache: the target's KV cache.
    rp: per-row sampling parameters.
    counts: int32[B, V] token counts for penalties (zeros [B, 1] when none are used).
    """

    out: jax.Array
    n_out: jax.Array
    token: jax.Array
    done: jax.Array
    limit: jax.Array
    cache: KVCache
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

    def start(self, target: Target, tokens, lengths, cache, rp, stop_tokens) -> PlainState:
        h_last, cache, _ = prefill(target, cache, tokens, lengths, self.chunk, impl=self.impl)
        b = tokens.shape[0]
        v = target.config.vocab_size
        counts = jnp.zeros((b, v if self.penalties else 1), jnp.int32)
        if self.penalties:
            valid = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
            counts = counts.at[jnp.arange(b)[:, None], tokens].add(valid.astype(jnp.int32))
        logits = dense.lm_logits(target.params, target.config, h_last)
        first = self._pick(logits, rp, counts, jnp.zeros((b,), jnp.int32))
        out = jnp.zeros((b, self.max_new_tokens + 1), jnp.int32)
        limit = jnp.full((b,), self.max_new_tokens, jnp.int32)
        out, n_out, _, stopped = commit(out, jnp.zeros((b,), jnp.int32), first[:, None], jnp.ones((b,), jnp.int32),
                                        jnp.zeros((b,), bool), stop_tokens, limit)
        done = stopped | (n_out >= limit)
        counts = self._count(counts, first, done)
        return PlainState(out, n_out, first, done, limit, cache, rp, counts)

    def _pick(self, logits, rp, counts, counter):
        if self.penalties:
            logits = smp.apply_penalties(logits, counts, rp)
        return choose(logits, rp, smp.rng_key(rp.seed, counter, smp.STREAM_TARGET), self.all_greedy)

    def _count(self, counts, token, done):
        if not self.penalties:
            return counts
        return counts.at[jnp.arange(token.shape[0]), token].add((~done).astype(jnp.int32))

    def step(self, target: Target, s: PlainState, stop_tokens) -> PlainState:
        """Feed the last token, choose the next, commit it."""
        h, _, cache = dense.extend(target.params, target.config, s.cache, s.token[:, None], s.cache.seq_len,
                                   impl=self.impl)
        cache = cache.replace(seq_len=s.cache.seq_len + (~s.done).astype(jnp.int32))
        logits = dense.lm_logits(target.params, target.config, h[:, 0])
        nxt = self._pick(logits, s.rp, s.counts, s.n_out)
        out, n_out, kept, stopped = commit(s.out, s.n_out, nxt[:, None], jnp.ones_like(s.n_out), s.done,
                                           stop_tokens, s.limit)
        done = s.done | stopped | (n_out >= s.limit)
        return s.replace(out=out, n_out=n_out, token=jnp.where(kept > 0, nxt, s.token), done=done, cache=cache,
                         counts=self._count(s.counts, nxt, s.done))

    def run(self, target: Target, s: PlainState, stop_tokens) -> PlainState:
        return jax.lax.while_loop(lambda s: ~jnp.all(s.done), lambda s: self.step(target, s, stop_tokens), s)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=4)
def _plain(loop: PlainLoop, target: Target, tokens, lengths, cache, rp, stop_tokens):
    """Prefill and decode to the end; the empty cache is donated."""
    return loop.run(target, loop.start(target, tokens, lengths, cache, rp, stop_tokens), stop_tokens)


def stop_array(stop_tokens, vocab_size: int) -> jax.Array:
    """Stop tokens as a non-empty int32 array (-1 pads an empty set: it matches no token)."""
    ids = [int(t) for t in stop_tokens]
    for t in ids:
        if not 0 <= t < vocab_size:
            raise ValueError(f"stop token {t} is outside the vocabulary [0, {vocab_size})")
    return jnp.asarray(ids or [-1], jnp.int32)


@dataclasses.dataclass
class Result:
    """Output of `generate`: per row the generated ids (truncated after the first stop token)
    and statistics (rounds, drafted, accepted, acceptance length, per-slot counts, wall time)."""

    tokens: list
    stats: dict


def to_lists(out: np.ndarray, n_out: np.ndarray) -> list:
    return [out[i, : int(n_out[i])].tolist() for i in range(out.shape[0])]


def plain_generate(target: Target, prompts, *, max_new_tokens: int, stop_tokens=(), sampling=None,
                   capacity: Optional[int] = None, impl: Optional[str] = None) -> Result:
    """Autoregressive decoding as one jitted `lax.while_loop`."""
    sampling = smp.Sampling() if sampling is None else sampling
    impl = policy.attention_impl(impl)
    p = pack_prompts(prompts, target.config.vocab_size)
    cap = check_capacity(p, max_new_tokens, target.config.max_position_embeddings, 1, capacity)
    rp = smp.row_params(sampling, p.batch)
    samplings = sampling if isinstance(sampling, Sequence) else [sampling]
    loop = PlainLoop(int(max_new_tokens), p.chunk, all(s.greedy for s in samplings),
                     any(s.has_penalties for s in samplings), impl)
    stops = stop_array(stop_tokens, target.config.vocab_size)
    t0 = time.perf_counter()
    s = _plain(loop, target, jnp.asarray(p.tokens), jnp.asarray(p.lengths), target.init_cache(p.batch, cap), rp, stops)
    out, n_out = jax.device_get((s.out, s.n_out))
    wall = time.perf_counter() - t0
    steps = int(n_out.max())
    return Result(to_lists(out, n_out), {"generated": int(n_out.sum()), "steps": steps, "wall_time_s": wall,
                                         "tokens_per_s": float(n_out.sum()) / wall})
