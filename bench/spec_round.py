"""One speculative round split into its phases, next to the fused loop and a plain decode step.

Each phase is its own jitted step on the same state (mid-way through a run, so the context
matches the fused loop's average):

  draft          `Loop.propose`: drafter block forward, LM head on the harvested rows, argmax;
                 `draft_injected` is the same with the injected proposals, as the loop runs it
  verify         `Target.extend` of `[anchor, drafts]` at `seq_len` + `Target.logits` + greedy accept
  commit_ingest  append of the kept tokens + `Target.commit` + `Drafter.ingest`/`commit` of the
                 block's taps (the round's tail, `Loop.advance`)
  plain_step     `PlainLoop.step` jitted alone

`*_s` is the median over `--phase-reps` of `--calls` back-to-back calls blocked once at the
end (host dispatch overlaps the device: device time per call); `*_blocked_s` is the median of
single calls each blocked (adds the host round trip).

The fused loop is `speculative.run` (what `Session.burst` runs) over `--new` tokens; its round
time is the run's wall time over its rounds, the plain step the plain loop's (`PlainLoop.run`)
wall time over its steps. The headline round runs on the random drafter's own proposals
(`real_drafter`: about one token per round, but a round does the same work at any acceptance
and the drafter surely runs); `fused` also times it with injected proposals at the fixed
acceptances `--taus` (one-hot first wrong slot for an integer tau: every round alike).

  round_over_plain_step = fused round / plain loop step
  loop_overhead         = fused round / (draft + verify + commit_ingest) - 1

    python bench/spec_round.py                  # H200: batch 1, prompt 512, block 16
    python bench/spec_round.py --tiny           # CPU smoke test
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import acceptance as acc
import common
from dflash_jax import sampling as smp
from dflash_jax.decoding import speculative as spec
from dflash_jax.decoding.plain import PlainLoop
from dflash_jax.drafters.base import Proposal


@functools.partial(jax.jit, static_argnums=0)
def draft_step(loop: spec.Loop, target, drafter, s: spec.SpecState):
    return loop.propose(target, drafter, s).drafts


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def verify_step(loop: spec.Loop, target, drafter, tstate, s: spec.SpecState, drafts):
    """Target forward of `[anchor, drafts]` at `seq_len` (K/V written), head, greedy accept."""
    prop = Proposal(drafts, smp.OneHotQ(), jnp.full(drafts.shape[:1], loop.verify_cap, jnp.int32))
    return loop.verify(target, drafter, s.replace(target_state=tstate), prop)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def commit_step(loop: spec.Loop, target, drafter, s: spec.SpecState, pending, drafts, m, nxt, taps, n_finite,
                stop_tokens):
    """The tail of `Loop.round`: append, commit the kept positions of both models, ingest the block's taps."""
    prop = Proposal(drafts, smp.OneHotQ(), jnp.full(drafts.shape[:1], loop.verify_cap, jnp.int32))
    return loop.advance(target, drafter, s, prop, s.target_state, pending, m, nxt, taps, n_finite, stop_tokens)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def plain_step(loop: PlainLoop, target, s, stop_tokens):
    return loop.step(target, s, stop_tokens)


def time_chain(step, carry, calls: int, reps: int, counter: acc.CompileCounter):
    """`carry = step(carry)`: one warm-up call (compiles), then `reps` x `calls` back-to-back
    calls blocked at the end, then `calls` single blocked calls. Returns
    `(median s per call, median blocked s per call, carry, compiles after the warm-up)`."""
    carry = jax.block_until_ready(step(carry))
    mark = counter.mark()
    chained = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            carry = step(carry)
        carry = jax.block_until_ready(carry)
        chained.append((time.perf_counter() - t0) / calls)
    blocked = []
    for _ in range(calls):
        t0 = time.perf_counter()
        carry = jax.block_until_ready(step(carry))
        blocked.append(time.perf_counter() - t0)
    return statistics.median(chained), statistics.median(blocked), carry, counter.since(mark)["count"]


def program_flops(fn, *args) -> float:
    """XLA's count of floating-point operations in the compiled program of the jitted `fn` on `args`, after its
    dead-code elimination (cost analysis: a list of one dict on older JAX, a dict on newer)."""
    cost = fn.lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("flops", 0.0))


def measure_phases(cell: acc.Cell, reference: np.ndarray, tau: float, calls: int, reps: int,
                   counter: acc.CompileCounter) -> dict:
    """Each phase timed alone on the state half-way through a run at acceptance `tau`.

    draft and verify leave the state as it was (verify rewrites the same cache rows); the
    commit runs on rows marked done, so nothing is kept and every call sees the same state while
    doing the same work (commit and ingest do not depend on the data). The draft is timed
    without injection (the drafter's real work) and with it, as the loop compiles it:
    `drafter_dropped_with_inject` says XLA removed the drafter there as dead code (the injected
    drafts do not depend on the drafter's), so the injected loop does not pay for drafting. It is read
    from the two compiled programs' FLOP counts (`program_flops`), not from their times, which a busy
    host can halve.
    """
    loop, target, drafter, stops = cell.loop, cell.target, cell.drafter, cell.stop_tokens
    cell.run_spec(cell.injected(reference, acc.first_wrong_probs(tau, cell.nd)), limit=cell.new // 2)
    s = cell.state
    position = float(np.mean(jax.device_get(s.target_state.seq_len)))
    res, recompiles = {}, 0

    plain_s = s.replace(inject=None)
    res["draft_s"], res["draft_blocked_s"], drafts, n = time_chain(
        lambda _: draft_step(loop, target, drafter, plain_s), None, calls, reps, counter)
    recompiles += n
    res["draft_injected_s"], _, _, n = time_chain(
        lambda _: draft_step(loop, target, drafter, s), None, calls, reps, counter)
    recompiles += n
    res["draft_flops"], res["draft_injected_flops"] = (program_flops(draft_step, loop, target, drafter, state)
                                                       for state in (plain_s, s))
    res["drafter_dropped_with_inject"] = res["draft_injected_flops"] < 0.5 * res["draft_flops"]
    rest = s.replace(target_state=None)
    res["verify_s"], res["verify_blocked_s"], (tstate, pending, m, nxt, taps, n_finite), n = time_chain(
        lambda c: verify_step(loop, target, drafter, c[0], rest, drafts), (s.target_state,), calls, reps, counter)
    recompiles += n
    frozen = s.replace(target_state=tstate, done=jnp.asarray(np.ones(cell.batch, bool)))
    res["commit_ingest_s"], res["commit_ingest_blocked_s"], frozen, n = time_chain(
        lambda f: commit_step(loop, target, drafter, f, pending, drafts, m, nxt, taps, n_finite, stops), frozen, calls,
        reps, counter)
    recompiles += n
    cell.state = frozen
    ploop = PlainLoop(cell.new, loop.chunk, True, False, loop.impl)
    ps = cell.plain_state(seq_len=np.asarray(jax.device_get(frozen.target_state.seq_len)),
                          token=np.asarray(jax.device_get(frozen.anchor)))
    res["plain_step_jitted_s"], res["plain_step_jitted_blocked_s"], ps, n = time_chain(
        lambda p: plain_step(ploop, target, p, stops), ps, calls, reps, counter)
    recompiles += n
    cell.state = cell.state.replace(target_state=ps.state)
    res["sum_of_phases_s"] = res["draft_s"] + res["verify_s"] + res["commit_ingest_s"]
    return res | {"position": position, "calls": calls, "reps": reps, "recompiles_after_warmup": recompiles}


def measure_real_drafter(cell: acc.Cell, reps: int, expected) -> dict:
    """The fused loop on the random drafter's own proposals: it accepts almost nothing (about
    one token per round), but a round does the same work at any acceptance, and nothing lets
    XLA drop the drafter. Its round time is the headline's."""
    runs = [cell.run_spec(None) for _ in range(reps)]
    wall = statistics.median(r.wall_s for r in runs)
    st = runs[-1].stats
    committed, rounds, iterations = int(st.committed.sum()), int(st.rounds.sum()), int(st.rounds.max())
    return {"round_s": wall / iterations, "wall_s": wall, "runs_s": [r.wall_s for r in runs], "rounds": rounds,
            "loop_iterations": iterations, "tau_measured": committed / rounds,
            "lossless": bool(np.array_equal(runs[-1].tokens, expected))}


def measure_cell(target, drafter, batch: int, prompt: int, args, counter: acc.CompileCounter) -> dict:
    window = args.window if prompt > args.window else None
    d = acc.windowed(drafter, window)
    t0 = time.perf_counter()
    cell = acc.open_cell(target, d, batch, prompt, args.new, args.impl, args.context, args.seed)
    plain_tokens, warm = acc.warm_up(cell, counter, args.taus[0])
    mark = counter.mark()
    cell.run_spec(None)
    warm_real = counter.since(mark)
    mark = counter.mark()
    plain = acc.measure_plain(cell, args.reps, plain_tokens)
    real = measure_real_drafter(cell, args.reps, plain_tokens)
    fused, references = [], []
    for tau in args.taus:
        rec, ref = acc.measure_tau(cell, tau, "two_point", args.reps, args.max_passes, plain_tokens, plain_tokens)
        fused.append(acc.with_plain(rec, plain, None))
        references.append(ref)
    after_runs = counter.since(mark)
    phases = measure_phases(cell, references[0], args.taus[0], args.calls, args.phase_reps, counter)
    round_s = real["round_s"]
    rec = {"status": "ok", "batch": batch, "prompt": prompt, "window": window, "context": args.context,
           "capacity": cell.capacity, "new_tokens": args.new, "prefill_s": cell.prefill_s, "plain": plain,
           "real_drafter": real, "fused": fused, "phases": phases,
           "round_s": round_s, "round_s_injected": fused[0]["round_s"], "plain_step_s": plain["step_s"],
           "round_over_plain_step": round_s / plain["step_s"],
           "round_over_plain_step_jitted": round_s / phases["plain_step_jitted_s"],
           "loop_overhead": round_s / phases["sum_of_phases_s"] - 1,
           "phase_share": {k: phases[f"{k}_s"] / phases["sum_of_phases_s"]
                           for k in ("draft", "verify", "commit_ingest")},
           "compiles": {"warmup": warm, "warmup_real_drafter": warm_real, "after_warmup_runs": after_runs,
                        "after_warmup_phases": phases["recompiles_after_warmup"]},
           "cell_s": time.perf_counter() - t0}
    rec["no_recompile"] = after_runs["count"] == 0 and phases["recompiles_after_warmup"] == 0
    p = phases
    print(f"b={batch} p={prompt}: draft {p['draft_s'] * 1e3:.3f} ms, verify {p['verify_s'] * 1e3:.3f} ms, "
          f"commit/ingest {p['commit_ingest_s'] * 1e3:.3f} ms (sum {p['sum_of_phases_s'] * 1e3:.3f}); fused round "
          f"{round_s * 1e3:.3f} ms (injected {rec['round_s_injected'] * 1e3:.3f}); plain step "
          f"{plain['step_s'] * 1e3:.3f} ms (jitted alone {p['plain_step_jitted_s'] * 1e3:.3f}); round/plain "
          f"{rec['round_over_plain_step']:.3f}; loop overhead {rec['loop_overhead']:+.3f}; "
          f"recompiled: {not rec['no_recompile']}")
    if p["drafter_dropped_with_inject"]:
        print(f"WARNING: with injected proposals the draft takes {p['draft_injected_s'] * 1e3:.3f} ms against "
              f"{p['draft_s'] * 1e3:.3f} ms: XLA drops the drafter as dead code, so injected runs do not pay for it")
    del cell
    return rec


def parse_args(argv, description: str, tau: float):
    """The options of `measure_cell` runs (batch 1, prompt 512 and acceptance `tau` by default)."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    acc.base_args(ap, [1], [512], [tau], 256)
    ap.add_argument("--calls", type=int, default=None, help="back-to-back calls per phase sample (default 20; tiny 5)")
    ap.add_argument("--phase-reps", type=int, default=5, help="phase samples (median)")
    ap.add_argument("--context", default="prefill", choices=acc.CONTEXTS, help="how the prompt's caches are made")
    args = acc.finish_args(ap.parse_args(argv), [1], [512], [tau], 256, [1], [32])
    args.calls = args.calls or (5 if args.tiny else 20)
    return args


def main(argv=None):
    args = parse_args(argv, __doc__, 6.0)
    counter = acc.CompileCounter()
    target, drafter = acc.models(args.tiny)
    payload = common.environment(**vars(args)) | acc.describe(target, drafter, args.tiny)
    cells = [measure_cell(target, drafter, b, p, args, counter) for b, p in acc.grid_cells(args.batches, args.prompts)]
    head = acc.headline(cells, 1, 512)
    payload |= {"cells": cells, "no_recompile": all(c["no_recompile"] for c in cells),
                "headline": {k: head[k] for k in ("batch", "prompt", "round_s", "round_s_injected", "plain_step_s",
                                                  "round_over_plain_step", "loop_overhead")}
                | {"sum_of_phases_s": head["phases"]["sum_of_phases_s"],
                   "drafter_dropped_with_inject": head["phases"]["drafter_dropped_with_inject"]}}
    common.write_json(f"spec_round{'_tiny' if args.tiny else ''}.json", payload, args.out)
    if not payload["no_recompile"]:
        print("WARNING: compiled after the warm-up (see cells[].compiles)")
    return payload


if __name__ == "__main__":
    main()
