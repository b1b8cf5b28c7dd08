"""What plain and speculative decoding share: prompt packing, capacity, chunked prefill, token
choice, appending emitted tokens to the output, and the results users read.

Host-side checks run once before tracing; everything per token runs in one jitted
`lax.while_loop` with per-row progress as data. Only the Target and Drafter interfaces are
used here (docs/architecture.md).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import sampling as smp
from dflash_jax.cache import write_rows
from dflash_jax.drafters.base import Drafter
from dflash_jax.targets.base import Target

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


def prefill(target: Target, state, tokens: jax.Array, lengths: jax.Array, chunk: int,
            drafter: Optional[Drafter] = None, dstate=None, impl: str = "xla"):
    """Chunked prefill of right-padded prompts through the interfaces: `(h_last [B, H], state, dstate)`.

    Each chunk is one `extend` at every row's `seq_len`, then `commit` of the row's prompt
    tokens in it (0 for a row whose prompt ended earlier: its padding is rolled back). With a
    drafter, the chunk's taps are ingested and committed the same way.
    """
    b, t = tokens.shape
    tap_ids = drafter.tap_ids if drafter is not None else ()

    def body(carry, chunk_tokens):
        state, dstate, h_last = carry
        # opaque to XLA: with one chunk a start known to be zero makes the masked context
        # scores constant, and XLA spends seconds constant-folding them
        start = jax.lax.optimization_barrier(state.seq_len)
        kept = jnp.clip(lengths - start, 0, chunk).astype(jnp.int32)
        h, taps, state, pending = target.extend(state, chunk_tokens, start, tap_ids, impl)
        state = target.commit(state, pending, kept)
        last = (kept > 0) & (start + kept == lengths)
        row = jnp.take_along_axis(h, jnp.maximum(kept - 1, 0)[:, None, None], axis=1)[:, 0]
        h_last = jnp.where(last[:, None], row, h_last)
        if drafter is not None:
            dstate, dpending = drafter.ingest(dstate, taps, start)
            dstate = drafter.commit(dstate, dpending, kept)
        return (state, dstate, h_last), None

    h0 = jnp.zeros((b, target.config.hidden_size), jax.eval_shape(target.embed, tokens[:, :1]).dtype)
    xs = tokens.reshape(b, t // chunk, chunk).transpose(1, 0, 2)
    (state, dstate, h_last), _ = jax.lax.scan(body, (state, dstate, h0), xs)
    return h_last, state, dstate


def choose(logits: jax.Array, rp: smp.RowParams, keys, all_greedy: bool) -> jax.Array:
    """One token per row from `logits [B, V]`: argmax when every row is greedy, else sampled
    from the filtered distribution (temperature-0 rows come out as argmax there too)."""
    if all_greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return smp.sample(smp.filtered_logprobs(logits, rp), keys)


def append_tokens(out: jax.Array, n_out: jax.Array, emitted: jax.Array, n_emit: jax.Array, done: jax.Array,
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


def open_output(first: jax.Array, max_new_tokens: int, room: int, stop_tokens: jax.Array,
                finite: Optional[jax.Array] = None):
    """The output once the token chosen at prefill, `first int32[B]`, is appended:
    `(out int32[B, max_new_tokens + room], n_out, done, limit)`; `room` columns past the limit
    take a round's overhang. A row whose prefill logits were not `finite` keeps nothing and is done."""
    b = first.shape[0]
    bad = jnp.zeros((b,), bool) if finite is None else ~finite
    limit = jnp.full((b,), max_new_tokens, jnp.int32)
    out = jnp.zeros((b, max_new_tokens + room), jnp.int32)
    out, n_out, _, stopped = append_tokens(out, jnp.zeros((b,), jnp.int32), first[:, None], jnp.ones((b,), jnp.int32),
                                           bad, stop_tokens, limit)
    return out, n_out, stopped | (n_out >= limit) | bad, limit


def finite_rows(logits: jax.Array) -> jax.Array:
    """bool[...]: the logits `[..., V]` of a row are all finite. One reduction over logits the loop
    already holds, read beside the argmax or softmax that uses them; its result stays on the device."""
    return jnp.isfinite(logits).all(axis=-1)


def check_finite(nonfinite_at, lengths) -> None:
    """FloatingPointError naming every row whose target logits were not finite. `nonfinite_at[b]`
    is the index of the generated token those logits would have chosen (-1: none); `lengths[b]` the
    row's prompt tokens, so the logits came from sequence position `lengths[b] + nonfinite_at[b] - 1`."""
    bad = [(b, int(i)) for b, i in enumerate(np.asarray(nonfinite_at)) if i >= 0]
    if bad:
        rows = "; ".join(f"row {b} at generated token {i} (logits at sequence position {int(lengths[b]) + i - 1})"
                         for b, i in bad)
        raise FloatingPointError(f"the target's logits are not finite (NaN or Inf): {rows}. The checkpoint's "
                                 "weights or config values (e.g. rms_norm_eps, rope_theta) are not finite, or the "
                                 "computation overflowed its dtype")


def stop_array(stop_tokens, vocab_size: int) -> jax.Array:
    """Stop tokens as a non-empty int32 array (-1 pads an empty set: it matches no token)."""
    ids = [int(t) for t in stop_tokens]
    for t in ids:
        if not 0 <= t < vocab_size:
            raise ValueError(f"stop token {t} is outside the vocabulary [0, {vocab_size})")
    return jnp.asarray(ids or [-1], jnp.int32)


@dataclasses.dataclass(frozen=True)
class Stats:
    """What a generation did. Plain and speculative runs fill the same fields with the same meaning.

    generated: tokens generated, all rows (the first of each row comes from prefill). A session's
      count may include tokens its last round made past the last burst, held for the next one.
    rounds: target forward passes after prefill, summed over rows (a plain step is a round
      that commits one token). committed: tokens those rounds committed.
    acceptance_length: committed / rounds, tokens per round (1.0 for plain decoding).
    drafted / accepted: drafts examined (sum of verify_width - 1) and accepted (0 for plain).
    accept_hist: rounds that accepted exactly m drafts, m = 0..nd ([rounds] for plain).
    slot_accepted: per draft slot k, rounds whose slot k was accepted (empty for plain).
    per_row: the rounds, accepted and committed counts of each row, and `nonfinite_at`: per row
      None, or the index of the generated token whose target logits were not finite (the row
      stopped there; `generate` raises instead of returning).
    prefill_time_s: prompt processing and the first token. decode_time_s: everything after.
    wall_time_s: both, measured the same way for plain and speculative decoding.
    tokens_per_s: generated / wall_time_s.
    """

    generated: int
    rounds: int
    committed: int
    acceptance_length: float
    drafted: int
    accepted: int
    accept_hist: list
    slot_accepted: list
    per_row: dict
    prefill_time_s: float
    decode_time_s: float

    @property
    def wall_time_s(self) -> float:
        return self.prefill_time_s + self.decode_time_s

    @property
    def tokens_per_s(self) -> float:
        return self.generated / max(self.wall_time_s, 1e-9)

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "wall_time_s": self.wall_time_s, "tokens_per_s": self.tokens_per_s}


def make_stats(n_out, rounds, accepted, committed, drafted, accept_hist, nonfinite, prefill_s: float,
               decode_s: float) -> Stats:
    """`Stats` from per-row device counters (`accept_hist` int[B, nd + 1], `nonfinite` int[B], -1: none)."""
    rounds, accepted, committed, drafted, hist, nonfinite, n_out = (np.asarray(x) for x in jax.device_get(
        (rounds, accepted, committed, drafted, accept_hist, nonfinite, n_out)))
    total_hist = hist.sum(axis=0)
    return Stats(
        generated=int(n_out.sum()), rounds=int(rounds.sum()), committed=int(committed.sum()),
        acceptance_length=float(committed.sum()) / max(int(rounds.sum()), 1), drafted=int(drafted.sum()),
        accepted=int(accepted.sum()), accept_hist=total_hist.tolist(),
        slot_accepted=np.cumsum(total_hist[::-1])[::-1][1:].tolist(),
        per_row={"rounds": rounds.tolist(), "accepted": accepted.tolist(), "committed": committed.tolist(),
                 "nonfinite_at": [None if i < 0 else int(i) for i in nonfinite]},
        prefill_time_s=float(prefill_s), decode_time_s=float(decode_s))


@dataclasses.dataclass
class Result:
    """Output of `generate`: per row the generated ids (truncated after the first stop token) and `Stats`."""

    tokens: list
    stats: Stats


def to_lists(out: np.ndarray, n_out: np.ndarray) -> list:
    return [out[i, : int(n_out[i])].tolist() for i in range(out.shape[0])]
