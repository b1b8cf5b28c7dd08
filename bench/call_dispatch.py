"""What the fixed cost of a `Session.burst` call is made of (issue 16, item 4): calls of the session's compiled
loop that run 0 to 8 rounds, each split into its dispatch (until `speculative.run_burst` returns), the device work
left after it, and the fetch of its report; beside them the same split for programs that take the same trees and
do no work, which bound what the dispatch of those trees costs.

    python bench/call_dispatch.py            # H200
    python bench/call_dispatch.py --tiny     # CPU smoke test

Rows (median of `--calls` calls each, after warm-up):
- `run_burst_<n>`: the session's own program with its limit `n` tokens past those made (0: no round runs), and the
  rounds each call ran (a random drafter's rounds make about one token each).
- `passthrough_state`: a jitted `(state, report(state))` of the same donated state, with the models as unused
  arguments; `..._without_models` leaves them out.
- `identity_state_leaves`: one jitted program returning its donated argument, the state's leaves as a flat list.
Leaf counts of the models and the state go beside them: JAX's dispatch and PJRT's buffers cost per leaf. On a
GPU a call's dispatch returns when its loop ends (XLA checks the loop's condition on the host each round), so a
call's rounds show in `dispatch_s`. `fit` is the line through the calls that ran rounds: seconds a round, and
seconds a call costs beyond its rounds (`call_cost.py`'s fixed cost, from calls of the loop alone).
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

import acceptance as acc
import common
from dflash_jax import sharding
from dflash_jax.decoding import speculative as spec
from dflash_jax.decoding.session import Session


def split_times(call, calls: int, fetch: bool = True, after=None) -> dict:
    """Median dispatch, device-wait and fetch seconds of `call()`, which returns the report of the state it keeps
    (each call donates the state the last one left); `after(report)`, untimed, sees each fetched report."""
    parts = {"dispatch_s": [], "device_s": [], "fetch_s": []}
    for _ in range(calls + 2):
        t0 = time.perf_counter()
        packed = call()
        t1 = time.perf_counter()
        jax.block_until_ready(packed)
        t2 = time.perf_counter()
        host = np.asarray(sharding.fetch(packed)) if fetch else None
        t3 = time.perf_counter()
        for times, dt in zip(parts.values(), (t1 - t0, t2 - t1, t3 - t2)):
            times.append(dt)
        if after:
            after(host)
    out = {k: statistics.median(v[2:]) for k, v in parts.items()}
    out["total_s"] = sum(out.values())
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny random models on the CPU: tests the script")
    ap.add_argument("--calls", type=int, default=30, help="timed calls per row (median)")
    ap.add_argument("--rounds", type=int, nargs="+", default=[1, 2, 4, 8], help="tokens a row of `run_burst_<n>` asks")
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = ap.parse_args(argv)
    target, drafter = acc.models(args.tiny)
    prompt = 32 if args.tiny else 512
    budget = (args.calls + 2) * sum(args.rounds) + 16
    session = Session(target, drafter, acc.make_prompts(1, prompt, target.config.vocab_size, 0),
                      max_new_tokens=budget)
    session.burst(4)
    box = {"state": session.state, "n_out": session._n_out, "rounds": []}
    loop, stop, width = session.loop, session.stop_tokens, session.state.out.shape[1]

    def burst_of(n):
        def call():
            box["state"], packed = spec.run_burst(loop, target, drafter, box["state"], stop,
                                                  (box["n_out"] + n).astype(np.int32))
            return packed
        return call

    def seen(host):
        _, box["n_out"], _, _, counts = spec.read_report(host, width)
        box["rounds"].append(int(counts.rounds[0]))

    passthrough = jax.jit(lambda t, d, s: (s, spec.report(s)), donate_argnums=2)
    passthrough_alone = jax.jit(lambda s: (s, spec.report(s)), donate_argnums=0)
    identity = jax.jit(lambda leaves: leaves, donate_argnums=0)

    def with_models():
        box["state"], packed = passthrough(target, drafter, box["state"])
        return packed

    def alone():
        box["state"], packed = passthrough_alone(box["state"])
        return packed

    def leaves_only():
        leaves, tree = jax.tree.flatten(box["state"])
        box["state"] = jax.tree.unflatten(tree, identity(leaves))
        return box["state"].n_out

    rows, box["rounds"] = {}, [int(session._counts.rounds[0])]
    for n in [0, *args.rounds]:
        box["rounds"] = box["rounds"][-1:]  # the count before this row's calls
        rows[f"run_burst_{n}"] = split_times(burst_of(n), args.calls, after=seen)
        rows[f"run_burst_{n}"]["rounds_per_call"] = float(np.median(np.diff(box["rounds"])))
    rows |= {"passthrough_state": split_times(with_models, args.calls),
             "passthrough_state_without_models": split_times(alone, args.calls),
             "identity_state_leaves": split_times(leaves_only, args.calls, fetch=False)}
    for name, r in rows.items():
        print(f"{name:34s} " + "  ".join(f"{k} {v * 1e3:.3f} ms" if k.endswith("_s") else f"{k} {v}"
                                          for k, v in r.items()), flush=True)
    calls = [r for n, r in rows.items() if n.startswith("run_burst_") and r["rounds_per_call"] > 0]
    fit = None
    if len({r["rounds_per_call"] for r in calls}) > 1:
        per_round, beyond = np.polyfit([r["rounds_per_call"] for r in calls], [r["total_s"] for r in calls], 1)
        fit = {"round_s": float(per_round), "beyond_rounds_s": float(beyond)}
        print(f"calls of rounds: {per_round * 1e3:.3f} ms a round, {beyond * 1e3:.3f} ms beyond them")
    leaves = {"target_params": len(jax.tree.leaves(target)), "drafter_params": len(jax.tree.leaves(drafter)),
              "state": len(jax.tree.leaves(box["state"])),
              "state_target_cache": len(jax.tree.leaves(box["state"].target_state)),
              "state_drafter_cache": len(jax.tree.leaves(box["state"].drafter_state))}
    print(f"leaves: {leaves}")
    payload = common.environment(**vars(args)) | acc.describe(target, drafter, args.tiny) | {
        "prompt": prompt, "rows": rows, "fit": fit, "leaves": leaves}
    common.write_json(f"call_dispatch{'_tiny' if args.tiny else ''}.json", payload, args.out)
    return payload


if __name__ == "__main__":
    main()
