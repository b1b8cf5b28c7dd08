"""Acceptance-controlled speculative decoding: tokens/s and speedup over plain decoding at a
chosen mean acceptance length tau, with the real drafter run every round.

A random drafter accepts almost nothing, so its proposals are replaced (`speculative.Injected`,
after the drafter has run) by the target's own greedy continuation with the first wrong slot
k drawn per row and round, k in 0..nd (k = nd: every draft right), from a distribution with
E[k] + 1 = tau (`first_wrong_probs`). The plain greedy continuation comes from
`dflash_jax.generate(target, None, ...)` on the same prompts, which is also what the
speculative tokens must equal (lossless). The drafter's cost is paid only if XLA keeps it in
the compiled loop although the injected drafts do not use its output: `spec_round.py` checks
(`drafter_dropped_with_inject`).

    python bench/acceptance.py                  # H200: batch 1, prompt 512, tau 2 4 6.5 10
    python bench/acceptance.py --dist geometric # i.i.d. per-slot acceptance instead of two-point
    python bench/acceptance.py --tiny           # CPU smoke test

Per tau: tokens/s, speedup over plain (measured in the same process on the same prompts and
cache), the measured acceptance length, round time, and the ceiling tau_measured x plain step
/ round, the round taken from a run at a fixed acceptance (`--fixed-tau`) in the same cell.

This module also holds what `spec_round.py` and `sweep.py` share: `Cell` (one batch x prompt
setting whose caches are reused by every run), `measure_plain`, `measure_tau`,
`measure_grid`, and `CompileCounter`.
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import functools
import gc
import statistics
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

import common
import dflash_jax
from dflash_jax import sampling as smp
from dflash_jax.config import policy
from dflash_jax.decoding import speculative as spec
from dflash_jax.decoding.common import check_capacity, pack_prompts, stop_array
from dflash_jax.decoding import plain
from dflash_jax.decoding.plain import PlainLoop, PlainState
from dflash_jax.drafters.base import Drafter
from dflash_jax.targets.base import Target

DISTRIBUTIONS = ("two_point", "geometric")
CONTEXTS = ("prefill", "synthetic")


def first_wrong_probs(tau: float, nd: int, dist: str = "two_point") -> np.ndarray:
    """P(first wrong slot = k) for k in 0..nd (k = nd: all nd drafts right), with E[k] + 1 = tau.

    two_point: k is one of the two integers around tau - 1 (one-hot for an integer tau). The
      least spread: a 256-token run (about 40 rounds at tau 6.5) measures tau within ~0.1.
    geometric: each draft is right with the same probability a, found by bisection on
      E = (1 - a^(nd+1)) / (1 - a) (the textbook i.i.d. model); a real drafter's spread, but
      a short run's measured tau wanders by ~0.6 at tau 6.5.
    """
    if dist not in DISTRIBUTIONS:
        raise ValueError(f"unknown first-wrong distribution {dist!r}; choices: {', '.join(DISTRIBUTIONS)}")
    if not 1.0 <= tau <= nd + 1:
        raise ValueError(f"tau={tau} is outside [1, {nd + 1}]: a round commits 1 to nd + 1 = {nd + 1} tokens")
    p = np.zeros(nd + 1)
    if dist == "two_point":
        t = tau - 1.0
        lo = int(np.floor(t))
        p[lo] += 1.0 - (t - lo)
        p[min(lo + 1, nd)] += t - lo
        return p

    def mean(a):
        q = np.append(a ** np.arange(nd) * (1 - a), a ** nd)
        return q, float((q * np.arange(1, nd + 2)).sum())

    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean(mid)[1] < tau else (lo, mid)
    return mean((lo + hi) / 2)[0]


class CompileCounter:
    """XLA compilations seen through `jax.monitoring` (every jit cache miss that reaches the
    backend, persistent-cache hits included), by function name."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.events: list = []
        jax.monitoring.register_event_duration_secs_listener(self._record)

    def _record(self, event, duration, **kwargs):
        if event == self.EVENT:
            self.events.append((str(kwargs.get("fun_name", "?")), float(duration)))

    def mark(self) -> int:
        return len(self.events)

    def since(self, mark: int) -> dict:
        ev = self.events[mark:]
        return {"count": len(ev), "seconds": round(sum(d for _, d in ev), 3),
                "functions": dict(collections.Counter(n for n, _ in ev))}


def models(tiny: bool, block_size: int = 16, layers: int = 5):
    """Random target and drafter: Qwen3-8B + the z-lab drafter shape (bf16), or tiny (float32,
    so the lossless checks are exact on CPU)."""
    if tiny:
        return (common.random_target(common.TINY, jnp.float32),
                common.random_drafter(common.drafter_config(common.TINY, block_size, 2), jnp.float32))
    return (common.random_target(common.QWEN3_8B),
            common.random_drafter(common.drafter_config(common.QWEN3_8B, block_size, layers)))


def windowed(drafter: Drafter, window: Optional[int]) -> Drafter:
    """The same drafter weights with every layer on a causal sliding window (None: unchanged)."""
    if window is None:
        return drafter
    n = drafter.config.num_layers
    return drafter.replace(config=dataclasses.replace(drafter.config, layer_window=(window,) * n, causal=(True,) * n))


def make_prompts(batch: int, prompt: int, vocab: int, seed: int) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, vocab - 2, (batch, prompt)).astype(np.int32)


def device_free_bytes() -> Optional[int]:
    stats = jax.devices()[0].memory_stats()
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))


def memory_needed(target: Target, drafter: Drafter, batch: int, capacity: int, context: str,
                  chunk: int = 512) -> int:
    """Rough bytes a cell adds next to the weights: target + draft caches, verify/draft logits
    and attention scores; a prefill (Session) also holds a second copy of both caches (the start
    program does not donate them) and the chunk's attention scores."""
    tc, dc = target.config, drafter.config
    w = dc.block_size
    item = jax.tree.leaves(target.params)[0].dtype.itemsize
    caches = common.kv_bytes(tc, capacity, batch, item) + common.kv_bytes(dc, capacity, batch, item)
    logits = 2 * batch * 2 * w * tc.vocab_size * 4
    scores = 2 * batch * tc.num_heads * w * capacity * 4
    need = caches + logits + scores
    if context == "prefill":
        need += caches + batch * tc.num_heads * chunk * capacity * 4
    return int(need)


@functools.partial(jax.jit, static_argnums=0)
def _begin_spec(loop: spec.Loop, drafter: Drafter, first, rp, stop_tokens, inject):
    """`Loop.begin` without the model states (a jit would copy them; its outputs are fresh buffers)."""
    return loop.begin(drafter, first, None, None, rp, stop_tokens, inject)


def initial_spec_state(loop: spec.Loop, drafter: Drafter, first: np.ndarray, lengths: np.ndarray, sampling: list,
                       tstate, dstate, inject: spec.Injected, limit: Optional[int] = None) -> spec.SpecState:
    """What `Loop.start` leaves after the prompt (`Loop.begin`: first token `first [B]`, `lengths [B]`
    context tokens), over the given model states. Every leaf but the states' K/V is a fresh buffer:
    runs donate their state."""
    s = _begin_spec(loop, drafter, jnp.asarray(np.asarray(first, np.int32)), smp.row_params(sampling, len(first)),
                    jnp.asarray([-1], jnp.int32), inject)
    return s.replace(target_state=tstate.replace(seq_len=jnp.asarray(np.asarray(lengths, np.int32))),
                     drafter_state=dstate.replace(seq_len=jnp.asarray(np.asarray(lengths, np.int32))),
                     limit=s.limit if limit is None else jnp.minimum(s.limit, limit))


@functools.partial(jax.jit, static_argnums=0)
def _begin_plain(loop: PlainLoop, first, rp, stop_tokens, counts):
    """`PlainLoop.begin` without the target state."""
    return loop.begin(first, None, rp, stop_tokens, counts)


def initial_plain_state(loop: PlainLoop, first: np.ndarray, seq_len: np.ndarray, sampling: list,
                        tstate) -> PlainState:
    """What `PlainLoop.start` leaves after the prompt (`PlainLoop.begin`: last token `first`, at `seq_len`)."""
    b = len(first)
    s = _begin_plain(loop, jnp.asarray(np.asarray(first, np.int32)), smp.row_params(sampling, b),
                     jnp.asarray([-1], jnp.int32), jnp.zeros((b, 1), jnp.int32))
    return s.replace(state=tstate.replace(seq_len=jnp.asarray(np.asarray(seq_len, np.int32))))


def injected(reference: np.ndarray, probs: np.ndarray, new: int, nd: int) -> spec.Injected:
    """Proposals copied from `reference [B, <=N]` with the first wrong slot drawn from `probs`."""
    ref = np.zeros((reference.shape[0], new + nd + 2), np.int32)
    ref[:, : reference.shape[1]] = reference
    return spec.Injected(jnp.asarray(ref), jnp.asarray(np.asarray(probs, np.float32) / np.sum(probs)))


@dataclasses.dataclass
class SpecRun:
    """One speculative run from the prompt."""

    tokens: np.ndarray  # int32[B, N] generated tokens
    wall_s: float
    stats: spec.SpecStats  # host copy of the run's per-row counters


@dataclasses.dataclass
class Cell:
    """One batch x prompt setting: the caches after the prompt, reused by every run.

    Every run starts from the state right after the prompt, rebuilt on the host
    (`initial_spec_state`, `initial_plain_state`) over the same caches; rolling back K/V is
    moving `seq_len`, as in the library. The caches travel with `state`, which each run
    donates and replaces, so a cell holds one copy of them. A hybrid target's recurrent state
    (`conv`, `ssm`) cannot be rolled back by `seq_len`: `recurrent` keeps its value after the
    prompt, and every run starts from a copy of it.
    """

    target: Target
    drafter: Drafter
    loop: spec.Loop
    stop_tokens: jax.Array
    sampling: list  # one Sampling per row: distinct seeds, so rows draw their own first-wrong slots
    first: np.ndarray  # int32[B] the token chosen at prefill
    lengths: np.ndarray  # int32[B] context tokens per row
    state: spec.SpecState
    context: str
    prefill_s: float
    recurrent: Optional[dict] = None

    def __post_init__(self):
        ts = self.state.target_state
        if self.recurrent is None and hasattr(ts, "ssm"):
            self.recurrent = {"conv": jax.tree.map(jnp.copy, ts.conv), "ssm": jax.tree.map(jnp.copy, ts.ssm)}

    def _after_prompt(self, target_state):
        """`target_state` with its recurrent state back at the prompt's end (fresh buffers: runs donate them)."""
        if self.recurrent is None:
            return target_state
        return target_state.replace(**jax.tree.map(jnp.copy, self.recurrent))

    @property
    def batch(self) -> int:
        return len(self.first)

    @property
    def new(self) -> int:
        return self.loop.max_new_tokens

    @property
    def nd(self) -> int:
        return self.drafter.config.n_drafts

    @property
    def capacity(self) -> int:
        return self.state.target_state.capacity

    def injected(self, reference: np.ndarray, probs: np.ndarray) -> spec.Injected:
        return injected(reference, probs, self.new, self.nd)

    def spec_state(self, inject: spec.Injected, limit: Optional[int] = None) -> spec.SpecState:
        return initial_spec_state(self.loop, self.drafter, self.first, self.lengths, self.sampling,
                                  self._after_prompt(self.state.target_state), self.state.drafter_state, inject, limit)

    def plain_state(self, seq_len: Optional[np.ndarray] = None, token: Optional[np.ndarray] = None) -> PlainState:
        """The plain state after the prompt over the cell's target state (or at `seq_len`, after `token`)."""
        return initial_plain_state(self.plain_loop(), self.first if token is None else token,
                                   self.lengths if seq_len is None else seq_len, self.sampling,
                                   self.state.target_state if seq_len is not None else
                                   self._after_prompt(self.state.target_state))

    def plain_loop(self) -> PlainLoop:
        return PlainLoop(self.new, self.loop.chunk, True, False, self.loop.impl)

    def run_plain(self) -> tuple[np.ndarray, float, int]:
        """Plain greedy decoding of N tokens: `(tokens [B, N], wall seconds, decode steps)`."""
        s = self.plain_state()
        t0 = time.perf_counter()
        s = jax.block_until_ready(plain.run(self.plain_loop(), self.target, s, self.stop_tokens))
        wall = time.perf_counter() - t0
        self.state = self.state.replace(target_state=s.state)
        out, n_out = jax.device_get((s.out, s.n_out))
        return out[:, : self.new], wall, int(n_out.max()) - 1

    def run_spec(self, inject: spec.Injected, limit: Optional[int] = None) -> SpecRun:
        """Speculative decoding of N tokens (or up to `limit`) with injected proposals."""
        s = self.spec_state(inject, limit)
        t0 = time.perf_counter()
        s = jax.block_until_ready(spec.run(self.loop, self.target, self.drafter, s, self.stop_tokens))
        wall = time.perf_counter() - t0
        self.state = s
        out, stats = jax.device_get((s.out, s.stats))
        return SpecRun(out[:, : self.new], wall, stats)


def cell_shape(target: Target, drafter: Drafter, batch: int, prompt: int, new: int, impl: str):
    """`(loop, capacity)` exactly as a `Session` on `batch` prompts of `prompt` tokens makes them."""
    p = pack_prompts(np.zeros((1, prompt), np.int32), target.config.vocab_size)
    cap = check_capacity(p, new, target.config.max_position_embeddings, drafter.config.n_drafts + 1, None)
    return spec.Loop(new, p.chunk, True, "argmax", impl, policy.verify_cap(None, drafter.n_drafts, batch)), cap


def open_cell(target: Target, drafter: Drafter, batch: int, prompt: int, new: int, impl: str, context: str,
              seed: int = 0) -> Cell:
    """Random prompts, and their caches: by a real prefill (`Session`), or `synthetic`: zero
    caches with `seq_len = prompt` (decode cost depends on the context length, not its values;
    it saves the prefill's compile and run, and its second copy of the caches)."""
    if context not in CONTEXTS:
        raise ValueError(f"unknown context {context!r}; choices: {', '.join(CONTEXTS)}")
    vocab = target.config.vocab_size
    nd = drafter.config.n_drafts
    sampling = [dflash_jax.Sampling(seed=i) for i in range(batch)]
    inject = injected(np.zeros((batch, 0), np.int32), np.ones(nd + 1), new, nd)
    if context == "prefill":
        sess = dflash_jax.Session(target, drafter, make_prompts(batch, prompt, vocab, seed), max_new_tokens=new,
                                  sampling=sampling, impl=impl, inject=inject)
        s = sess.state
        return Cell(target, drafter, sess.loop, sess.stop_tokens, sampling, np.asarray(s.anchor),
                    np.asarray(s.target_state.seq_len), s, context, sess.prefill_time_s)
    loop, cap = cell_shape(target, drafter, batch, prompt, new, impl)
    first = np.random.RandomState(seed + 1).randint(0, vocab - 2, batch).astype(np.int32)
    lengths = np.full(batch, prompt, np.int32)
    state = initial_spec_state(loop, drafter, first, lengths, sampling, target.init_state(batch, cap),
                               drafter.init_state(batch, cap), inject)
    return Cell(target, drafter, loop, stop_array((), vocab), sampling, first, lengths, state, context, 0.0)


def precompile(target: Target, cells: list, new: int, impl: str, threads: int) -> float:
    """Compile the plain and speculative loops of `cells` ((batch, prompt, drafter) triples) up
    front, `threads` XLA compilations at a time; tracing stays on this thread. The calls then
    find the programs compiled. Returns the seconds it took."""
    t0 = time.perf_counter()
    lowered = []
    for batch, prompt, drafter in cells:
        loop, cap = cell_shape(target, drafter, batch, prompt, new, impl)
        nd, vocab = drafter.config.n_drafts, target.config.vocab_size
        first, lengths = np.zeros(batch, np.int32), np.full(batch, prompt, np.int32)
        sampling = [dflash_jax.Sampling(seed=i) for i in range(batch)]
        s, ps = jax.eval_shape(lambda: (
            initial_spec_state(loop, drafter, first, lengths, sampling, target.init_state(batch, cap),
                               drafter.init_state(batch, cap), injected(first[:, None], np.ones(nd + 1), new, nd)),
            initial_plain_state(PlainLoop(new, loop.chunk, True, False, impl), first, lengths, sampling,
                                target.init_state(batch, cap))))
        stops = stop_array((), vocab)
        lowered += [spec.run.lower(loop, target, drafter, s, stops),
                    plain.run.lower(PlainLoop(new, loop.chunk, True, False, impl), target, ps, stops)]
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda low: low.compile(), lowered))
    return time.perf_counter() - t0


def _first_mismatch(a: np.ndarray, b: np.ndarray) -> Optional[list]:
    """[row, index] of the first differing token, or None when equal."""
    diff = np.argwhere(a != b)
    return None if diff.size == 0 else [int(diff[0, 0]), int(diff[0, 1])]


def warm_up(cell: Cell, counter: CompileCounter, tau: float, reference: Optional[np.ndarray] = None):
    """First plain and speculative runs (they compile). Returns the plain tokens and the compiles."""
    mark = counter.mark()
    plain_tokens, _, _ = cell.run_plain()
    ref = plain_tokens if reference is None else reference
    cell.run_spec(cell.injected(ref, first_wrong_probs(tau, cell.nd)))
    return plain_tokens, counter.since(mark)


def measure_plain(cell: Cell, reps: int, expected: np.ndarray) -> dict:
    """Plain decoding from the prompt, `reps` timed runs of the compiled loop."""
    walls, same = [], True
    for _ in range(reps):
        tokens, wall, steps = cell.run_plain()
        walls.append(wall)
        same &= bool(np.array_equal(tokens, expected))
    step = statistics.median(walls) / steps
    return {"step_s": step, "tokens_per_s": cell.batch / step, "steps": steps, "runs_s": walls, "deterministic": same}


def measure_tau(cell: Cell, tau: float, dist: str, reps: int, max_passes: int, reference: np.ndarray,
                expected: np.ndarray) -> tuple[dict, np.ndarray]:
    """Speculative decoding at mean acceptance length `tau`; returns the record and the reference used.

    The injected continuation must be the one this loop itself produces: in bf16 the verify
    block and the plain step may round a near-tie differently, and a reference that parts from
    the loop's own tokens turns every later proposal wrong. So the loop's output becomes the
    reference until they agree (a fixed point, usually at once), and only runs on an agreeing
    reference are timed. `expected` (the plain tokens) is what lossless compares against.
    """
    probs = first_wrong_probs(tau, cell.nd, dist)
    passes = 0
    while True:
        run = cell.run_spec(cell.injected(reference, probs))
        passes += 1
        consistent = bool(np.array_equal(run.tokens, reference))
        if consistent or passes >= max_passes:
            break
        reference = run.tokens
    runs = [run] if consistent else []
    while len(runs) < reps:
        runs.append(cell.run_spec(cell.injected(reference, probs)))
    wall = statistics.median(r.wall_s for r in runs)
    st = runs[-1].stats
    committed, rounds, iterations = int(st.committed.sum()), int(st.rounds.sum()), int(st.rounds.max())
    record = {
        "tau": tau, "distribution": dist, "first_wrong": probs.tolist(),
        "tau_measured": committed / max(rounds, 1), "committed": committed, "rounds": rounds,
        "loop_iterations": iterations, "wall_s": wall, "runs_s": [r.wall_s for r in runs],
        "round_s": wall / max(iterations, 1), "tokens_per_s": committed / wall,
        "accept_hist": np.asarray(st.accept_hist).sum(axis=0).tolist(),
        "reference_passes": passes, "reference_consistent": consistent,
        "lossless": bool(np.array_equal(runs[-1].tokens, expected)),
        "first_mismatch": _first_mismatch(runs[-1].tokens, expected),
    }
    return record, reference


def with_plain(record: dict, plain: dict, fixed_round_s: Optional[float]) -> dict:
    """Add the ratios to plain: speedup, round / plain step, and the ceiling."""
    step = plain["step_s"]
    round_s = fixed_round_s or record["round_s"]
    return record | {"speedup": record["tokens_per_s"] / plain["tokens_per_s"],
                     "round_over_plain_step": record["round_s"] / step,
                     "ceiling": record["tau_measured"] * step / round_s,
                     "ceiling_at_nominal_tau": record["tau"] * step / round_s}


def measure_cell(cell: Cell, counter: CompileCounter, taus: list, dist: str, fixed_tau: float, reps: int,
                 max_passes: int, expected: Optional[np.ndarray] = None) -> dict:
    """Plain, a run at `fixed_tau` (its round time is the ceiling's), then one run per tau."""
    plain_tokens, warm = warm_up(cell, counter, fixed_tau, expected)
    expected = plain_tokens if expected is None else expected
    mark = counter.mark()
    plain = measure_plain(cell, reps, plain_tokens)
    fixed, reference = measure_tau(cell, fixed_tau, "two_point", reps, max_passes, expected, expected)
    fixed = with_plain(fixed, plain, None)
    runs = []
    for tau in taus:
        rec, _ = measure_tau(cell, tau, dist, reps, max_passes, reference, expected)
        runs.append(with_plain(rec, plain, fixed["round_s"]))
        print(f"  b={cell.batch} p={cell.lengths.max()} tau {tau}: measured {rec['tau_measured']:.2f}, "
              f"{rec['tokens_per_s']:.1f} tok/s, speedup {runs[-1]['speedup']:.2f}x "
              f"(ceiling {runs[-1]['ceiling']:.2f}x), lossless {rec['lossless']}")
    after = counter.since(mark)
    return {"plain": plain, "plain_loop_equals_expected": bool(np.array_equal(plain_tokens, expected)),
            "fixed": fixed, "runs": runs, "compiles": {"warmup": warm, "after_warmup": after},
            "no_recompile": after["count"] == 0}


def grid_cells(batches: list, prompts: list) -> list:
    """(batch, prompt) in the order run: batches outer, prompts inner (the largest last)."""
    return [(b, p) for b in sorted(batches) for p in sorted(prompts)]


def measure_grid(target: Target, drafter: Drafter, args, counter: CompileCounter, context: str,
                 check_generate: bool, on_cell: Callable[[list], None]) -> list:
    """Every batch x prompt cell: a record each, status ok, or skipped with the reason (would
    not fit, ran out of memory, or would end past `args.budget_s`)."""
    t_start = time.perf_counter()
    plan = []
    for batch, prompt in grid_cells(args.batches, args.prompts):
        window = args.window if prompt > args.window else None
        d = windowed(drafter, window)
        cap = cell_shape(target, d, batch, prompt, args.new, args.impl)[1]
        need = memory_needed(target, d, batch, cap, context)
        free = args.memory_gb * 2 ** 30 if args.memory_gb else device_free_bytes()
        rec = {"batch": batch, "prompt": prompt, "window": window, "context": context, "capacity": cap,
               "new_tokens": args.new, "memory_needed_bytes": need, "memory_free_bytes": free}
        if free is not None and need > free:
            rec |= {"status": "skipped", "reason": f"needs ~{_gib(need)} next to the weights; {_gib(free)} free"}
        plan.append((rec, d))
    precompile_s = None
    if args.compile_threads > 1:
        todo = [(r["batch"], r["prompt"], d) for r, d in plan if "status" not in r]
        precompile_s = precompile(target, todo, args.new, args.impl, args.compile_threads)
        print(f"precompiled {2 * len(todo)} programs in {precompile_s:.1f} s ({args.compile_threads} threads)")
    records, last = [], 0.0
    for rec, d in plan:
        print(f"cell batch {rec['batch']} prompt {rec['prompt']} (drafter window {rec['window']}, capacity "
              f"{rec['capacity']}, ~{_gib(rec['memory_needed_bytes'])})")
        elapsed = time.perf_counter() - t_start
        if "status" not in rec and args.budget_s and elapsed + last > args.budget_s:
            rec |= {"status": "skipped", "reason": f"time budget: {elapsed:.0f} s spent, the last cell took "
                                                   f"{last:.0f} s, budget {args.budget_s:.0f} s"}
        if "status" in rec:
            print(f"  skipped: {rec['reason']}")
        else:
            t0 = time.perf_counter()
            rec |= _measure_one(target, d, rec["batch"], rec["prompt"], args, counter, context, check_generate)
            last = time.perf_counter() - t0
        records.append(rec | {"precompile_s": precompile_s})
        on_cell(records)
        gc.collect()
    return records


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB"


def _measure_one(target, drafter, batch, prompt, args, counter, context, check_generate) -> dict:
    cell = None
    try:
        expected, gen = None, {}
        if check_generate:
            prompts = make_prompts(batch, prompt, target.config.vocab_size, args.seed)
            res = dflash_jax.generate(target, None, prompts, max_new_tokens=args.new, impl=args.impl)
            expected = np.asarray(res.tokens, np.int32)
            gen = {"generate_tokens_per_s_with_prefill": res.stats.tokens_per_s}
        t0 = time.perf_counter()
        cell = open_cell(target, drafter, batch, prompt, args.new, args.impl, context, args.seed)
        out = measure_cell(cell, counter, args.taus, args.dist, args.fixed_tau, args.reps, args.max_passes, expected)
        return {"status": "ok", "prefill_s": cell.prefill_s, "cell_s": time.perf_counter() - t0} | gen | out
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        print(f"  out of memory: {str(e).splitlines()[0][:300]}")
        return {"status": "skipped", "reason": "out of memory: " + str(e).splitlines()[0][:300]}
    finally:
        del cell


def base_args(ap: argparse.ArgumentParser, batches, prompts, taus, new: int) -> argparse.ArgumentParser:
    """Options every speculative benchmark takes (defaults for the H200; `--tiny` shrinks them)."""
    ap.add_argument("--tiny", action="store_true", help="tiny random model on CPU (smoke test)")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help=f"batch sizes (default {batches})")
    ap.add_argument("--prompts", type=int, nargs="+", default=None, help=f"prompt lengths (default {prompts})")
    ap.add_argument("--taus", type=float, nargs="+", default=None, help=f"acceptance lengths (default {taus})")
    ap.add_argument("--new", type=int, default=None, help=f"new tokens per row (default {new}; tiny 32)")
    ap.add_argument("--window", type=int, default=None,
                    help="drafter sliding window for prompts longer than it (default 2048; tiny 64)")
    ap.add_argument("--reps", type=int, default=2, help="timed runs per measurement (median)")
    ap.add_argument("--max-passes", type=int, default=4, help="reference fixed-point passes per tau")
    ap.add_argument("--impl", default=None, choices=list(policy.ATTENTION_IMPLS),
                    help="attention implementation (default: the library's, pallas on GPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    return ap


def grid_args(ap: argparse.ArgumentParser, batches, prompts, taus, new: int) -> argparse.ArgumentParser:
    """`base_args` and the options of the acceptance-controlled grid (acceptance, sweep)."""
    base_args(ap, batches, prompts, taus, new)
    ap.add_argument("--fixed-tau", type=float, default=6.0, help="acceptance of the run whose round time "
                                                                 "the ceiling uses (one-hot for an integer)")
    ap.add_argument("--dist", default="two_point", choices=DISTRIBUTIONS, help="first-wrong slot distribution")
    ap.add_argument("--memory-gb", type=float, default=None, help="memory a cell may use (default: device free)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="skip the cells that would end past this many seconds from the start")
    ap.add_argument("--compile-threads", type=int, default=1,
                    help="> 1: compile every cell's two loops up front, this many at a time")
    return ap


def finish_args(args, batches, prompts, taus, new: int, tiny_batches, tiny_prompts):
    args.batches = args.batches or (tiny_batches if args.tiny else batches)
    args.prompts = args.prompts or (tiny_prompts if args.tiny else prompts)
    args.taus = args.taus or taus
    args.new = args.new or (32 if args.tiny else new)
    args.window = args.window or (64 if args.tiny else 2048)
    args.impl = policy.attention_impl(args.impl)
    return args


def describe(target: Target, drafter: Drafter, tiny: bool) -> dict:
    dc = drafter.config
    return {"model": "tiny, random float32" if tiny else "Qwen3-8B shape, random bf16",
            "drafter": {"layers": dc.num_layers, "block_size": dc.block_size, "n_drafts": dc.n_drafts,
                        "taps": list(dc.target_layer_ids)},
            "weight_bytes": common.target_step_bytes(target), "drafter_bytes": common.nbytes(drafter.params)}


def headline(records: list, batch: int, prompt: int) -> Optional[dict]:
    """The record of (batch, prompt) if measured, else the first measured one."""
    ok = [r for r in records if r.get("status") == "ok"]
    exact = [r for r in ok if r["batch"] == batch and r["prompt"] == prompt]
    return (exact or ok or [None])[0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    grid_args(ap, [1], [512], [2, 4, 6.5, 10], 256)
    args = finish_args(ap.parse_args(argv), [1], [512], [2.0, 4.0, 6.5, 10.0], 256, [1, 2], [32])
    counter = CompileCounter()
    target, drafter = models(args.tiny)
    payload = common.environment(**vars(args)) | describe(target, drafter, args.tiny)
    name = f"acceptance{'_tiny' if args.tiny else ''}.json"

    def write(records):
        payload["cells"] = records
        payload["no_recompile"] = all(r.get("no_recompile", True) for r in records)
        head = headline(records, 1, 512)
        if head is not None:
            run = min(head["runs"], key=lambda r: abs(r["tau"] - 6.5)) if head["runs"] else None
            payload["headline"] = {"batch": head["batch"], "prompt": head["prompt"],
                                   "tau": run and run["tau"], "tau_measured": run and run["tau_measured"],
                                   "speedup_at_tau_6_5": run and run["speedup"], "ceiling": run and run["ceiling"],
                                   "lossless": all(r["lossless"] for r in head["runs"])}
        common.write_json(name, payload, args.out)

    measure_grid(target, drafter, args, counter, "prefill", True, write)
    if not payload["no_recompile"]:
        print("WARNING: compiled during the timed runs (see compiles.after_warmup)")
    return payload


if __name__ == "__main__":
    main()
