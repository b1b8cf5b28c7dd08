"""What plain and speculative decoding share: prompt packing, capacity, chunked prefill, token
choice, appending emitted tokens to the output, and the results users read.

Host-side checks run once before tracing; everything per token runs in one jitted
`lax.while_loop` with per-row progress as data. Only the Target and Drafter interfaces are
used here (docs/architecture.md).
"""
from __future__ import annotations

import dataclasses
import numbers
import os
from collections.abc import Iterable
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import quant
from dflash_jax import sampling as smp
from dflash_jax import sharding
from dflash_jax.config import policy
from dflash_jax.cache import write_rows
from dflash_jax.drafters.base import Drafter
from dflash_jax.targets.base import Target


@dataclasses.dataclass(frozen=True)
class Prompts:
    """Right-padded prompts: `tokens [B, T_pad]` (T_pad a multiple of `chunk`) and `lengths [B]`."""

    tokens: np.ndarray
    lengths: np.ndarray
    chunk: int

    @property
    def batch(self) -> int:
        return self.tokens.shape[0]


def is_integer(value) -> bool:
    """A Python or numpy integer; bools are not (True is not a count or a token id)."""
    return _integral(type(value))


def _integral(kind: type) -> bool:
    return issubclass(kind, numbers.Integral) and not issubclass(kind, (bool, np.bool_))


def integer(name: str, value, low: int, valid: str) -> int:
    """`value` as a Python int when it is an integer >= `low`, else ValueError naming `name`, the
    value and `valid` (what would be accepted)."""
    if not is_integer(value) or value < low:
        raise ValueError(f"{name} must be {valid}; got {value!r}")
    return int(value)


def integers(name: str, values, low: int, high: int, what: str, valid: str) -> np.ndarray:
    """A flat list or 1-D array of integers in [low, high) as int32, else ValueError naming `name`,
    the offending value and `valid`. Python and numpy integers of any width are accepted and compared
    exactly (2**70 and uint64 ids are out of range, not overflows); bools and floats are refused."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ValueError(f"{name}={values!r:.40} is not a list of {what}s; expected integers in {valid}")
    items = None
    if isinstance(values, (np.ndarray, jax.Array)):
        arr = np.asarray(values)
        if arr.ndim != 1:
            raise ValueError(f"{name} must be a flat list of {what}s; got shape {arr.shape}")
        if arr.dtype.kind not in "iuO":
            raise ValueError(f"{name} holds non-integer {what}s (dtype {arr.dtype}); expected integers in {valid}")
        items = arr.tolist() if arr.dtype.kind == "O" else None
    else:
        items = list(values)
    if items is not None:
        odd = {kind for kind in set(map(type, items)) if not _integral(kind)}
        if odd:
            v = next(v for v in items if type(v) in odd)
            raise ValueError(f"{name} holds {v!r:.40} ({type(v).__name__}), a non-integer {what}; expected "
                             f"integers in {valid}")
        arr = np.asarray(items)
    if arr.dtype.kind in "iu":
        bad = arr[(arr < low) | (arr >= high)]
    else:  # integers no numpy dtype holds (past 64 bits, or uint64 beside negatives): compared in Python
        bad = [v for v in items if not low <= v < high]
    if len(bad):
        raise ValueError(f"{name} has {what} {int(bad[0])} outside {valid}")
    return np.asarray(arr if arr.dtype.kind in "iu" else items, np.int32)


def pack_prompts(prompts, vocab_size: int, chunk: Optional[int] = None, lengths=None) -> Prompts:
    """Validate ragged prompts (list of token-id lists, or a 2-D int array) and pad them.

    A 2-D array is read as all real tokens unless `lengths` gives each row's valid length (its
    tokens past that are padding, ignored). The padded length is rounded up to a power of two (at
    least 16), or to a multiple of `chunk` past it, so nearby prompt lengths share one compiled program.
    `chunk`, the prompt positions per prefill `extend`, is `policy.prefill_chunk`'s keyword.
    """
    chunk = policy.prefill_chunk(chunk)
    if lengths is not None:
        rows = _cut_rows(prompts, lengths)
    elif isinstance(prompts, (np.ndarray, jax.Array)):
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
    vocab = f"the vocabulary [0, {vocab_size})"
    for i, row in enumerate(rows):
        if isinstance(row, (str, bytes)):
            raise ValueError(f"prompt {i} is text; encode it to token ids first (e.g. with the model's tokenizer)")
        if not isinstance(row, Iterable):
            raise ValueError(f"prompt {i} must be a flat list of token ids; got {row!r:.40} (a prompt is a list of "
                             f"ids; wrap a single prompt as [ids])")
        a = integers(f"prompt {i}", row, 0, vocab_size, "token id", vocab)
        if a.size == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
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


def _cut_rows(prompts, lengths) -> list:
    """The rows of a 2-D prompt array cut to their `lengths` (validated: one per row, 1..width)."""
    try:
        arr = np.asarray(prompts)
    except (TypeError, ValueError):
        arr = None
    if arr is None or arr.ndim != 2:
        raise ValueError("lengths= gives the valid length of each row of a 2-D prompt array [batch, time]; "
                         f"prompts is not one (shape {getattr(arr, 'shape', 'ragged')}). Ragged lists carry their "
                         "own lengths: pass them without lengths=")
    batch, width = arr.shape
    n = integers("lengths", lengths, 1, width + 1, "row length", f"1..{width} (the prompt array's width)")
    if n.shape != (batch,):
        raise ValueError(f"lengths has {n.size} entries for {batch} prompt rows; give one length per row")
    return [row[:k] for row, k in zip(arr, n)]


def check_dtypes(target: Target, drafter: Drafter) -> None:
    """Refuse a drafter whose weights are not in its target's dtype, the dtype of `target.embed` (it computes
    on the target's embeddings and hidden states, so both share one), naming both and the fix."""
    leaves = jax.tree.leaves(drafter.params, is_leaf=quant.is_quantized)  # a quantised weight: the dtype it computes in
    held = sorted({str(leaf.dtype) for leaf in leaves if jnp.issubdtype(leaf.dtype, jnp.floating)})
    computes = str(jax.eval_shape(target.embed, jax.ShapeDtypeStruct((1, 1), jnp.int32)).dtype)
    if held != [computes]:
        raise ValueError(f"the drafter's weights are {', '.join(held)} and the target computes in "
                         f"{computes}: a drafter computes in its target's dtype. Load it with its target, "
                         "load_drafter(path, target), which casts it")


def check_capacity(prompts: Prompts, max_new_tokens: int, limit: int, slack: int, capacity: Optional[int]) -> int:
    """Cache capacity for this run, or ValueError naming the numbers.

    `limit` is the model's position limit; `slack` the extra rows a verify block may write.
    """
    max_new_tokens = integer("max_new_tokens", max_new_tokens, 1, "a positive integer")
    need = int(prompts.lengths.max()) + max_new_tokens
    if need > limit:
        raise ValueError(f"prompt ({int(prompts.lengths.max())} tokens) + max_new_tokens ({max_new_tokens}) = {need} "
                         f"exceeds the model's max_position_embeddings ({limit})")
    rows = max(need + slack, prompts.tokens.shape[1])
    if capacity is not None:
        capacity = integer("capacity", capacity, 1, "a positive integer (cache positions per row) or None")
        if capacity < rows:
            raise ValueError(f"capacity {capacity} is too small: prompt ({int(prompts.lengths.max())} tokens) + "
                             f"max_new_tokens ({max_new_tokens}) + verify slack ({slack}) needs {rows}")
        return capacity
    return -(-rows // 128) * 128


def _shape_key(model) -> Optional[tuple]:
    """What a model's state shapes depend on: its family, config and weight dtypes (not the weights)."""
    if model is None:
        return None
    return type(model), model.config, tuple(x.dtype.name for x in jax.tree.leaves(model.params))


_STATE_BYTES: dict = {}


def cache_bytes(target: Target, drafter: Optional[Drafter], batch: int, capacity: int) -> int:
    """Bytes of the empty decoding states (target, and drafter when given) for `batch` rows of
    `capacity` positions on one device (a state placed on a mesh holds a share of each split leaf, as
    `sharding.place_state` splits it), from their abstract shapes: nothing is allocated. Memoised by
    shape key (never holding the models), as tracing `init_state` costs about 2 ms on every `generate` call."""
    models = (target,) if drafter is None else (target, drafter)
    meshes = tuple(sharding.mesh_of(m.params) for m in models)
    key = (_shape_key(target), _shape_key(drafter), int(batch), int(capacity),
           tuple(None if m is None else tuple(m.shape.items()) for m in meshes))
    if key not in _STATE_BYTES:
        if len(_STATE_BYTES) >= 256:
            _STATE_BYTES.clear()
        _STATE_BYTES[key] = sum(sharding.device_bytes(jax.eval_shape(lambda m=m: m.init_state(batch, capacity)), mesh)
                                for m, mesh in zip(models, meshes))
    return _STATE_BYTES[key]


def free_memory(device=None) -> tuple[Optional[int], str]:
    """`(bytes free, where)` for arrays on `device` (default: this process's first device): its allocator's
    `bytes_limit - bytes_in_use`, or for the CPU, which reports no memory stats, the host's
    available memory (MemAvailable, within a cgroup v2 limit). None when nothing says."""
    device = device or jax.local_devices()[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)), f"{device}"
    return _host_available(), "host memory"


def _host_available() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, OSError, ValueError):
            return None
    try:
        with open("/sys/fs/cgroup/memory.max") as lim, open("/sys/fs/cgroup/memory.current") as cur:
            limit, used = lim.read().strip(), cur.read().strip()
        if limit != "max":
            free = min(free, int(limit) - int(used))
    except (OSError, ValueError):
        pass
    return free


def check_memory(target: Target, drafter: Optional[Drafter], batch: int, capacity: int) -> None:
    """Refuse, before allocating, caches that do not fit the free memory, naming both byte counts. The
    target's `pending` for one block (the verify block, or one token without a drafter) counts too."""
    caches = cache_bytes(target, drafter, batch, capacity)
    pending = target.pending_bytes(batch, 1 if drafter is None else drafter.n_drafts + 1)
    need = caches + pending
    free, where = free_memory()
    if free is not None and need > free:
        also = f", with {pending:,} bytes of per-position states for one block," if pending > 1 << 20 else ""
        raise ValueError(f"the caches for {batch} row(s) x capacity {capacity}{also} need {need:,} bytes "
                         f"({need / 2**30:.2f} GiB), but {where} has {free:,} bytes free ({free / 2**30:.2f} GiB); "
                         f"lower capacity, max_new_tokens or the batch")


def prefill(target: Target, state, tokens: jax.Array, lengths: jax.Array, chunk: int,
            drafter: Optional[Drafter] = None, dstate=None, impl: str = "xla"):
    """Chunked prefill of right-padded prompts through the interfaces: `(h_last [B, H], state, dstate)`.

    Each chunk is one `extend` at every row's `seq_len`, then `commit` of the row's prompt
    tokens in it (0 for a row whose prompt ended earlier: its padding is rolled back). With a
    drafter, the chunk's taps are ingested and committed the same way. The chunks' attention is
    `policy.prefill_attention(impl, chunks)`.
    """
    b, t = tokens.shape
    tap_ids = drafter.tap_ids if drafter is not None else ()
    attention = policy.prefill_attention(impl, t // chunk)

    def body(carry, chunk_tokens):
        state, dstate, h_last = carry
        # opaque to XLA: with one chunk a start known to be zero makes the masked context
        # scores constant, and XLA spends seconds constant-folding them
        start = jax.lax.optimization_barrier(state.seq_len)
        kept = jnp.clip(lengths - start, 0, chunk).astype(jnp.int32)
        h, taps, state, pending = target.extend(state, chunk_tokens, start, tap_ids, attention, valid=kept)
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
    """Stop tokens (a list of ids, one id, or None for none) as a non-empty int32 array (-1 pads
    an empty set: it matches no token)."""
    if stop_tokens is None:
        stop_tokens = ()
    elif is_integer(stop_tokens):
        stop_tokens = (stop_tokens,)
    ids = integers("stop_tokens", stop_tokens, 0, vocab_size, "token id", f"the vocabulary [0, {vocab_size})")
    return jnp.asarray(ids if ids.size else [-1], jnp.int32)


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
    rounds, accepted, committed, drafted, hist, nonfinite, n_out = (np.asarray(x) for x in sharding.fetch(
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
