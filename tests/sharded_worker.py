"""Sharded runs for tests/test_sharding.py, in a process of its own: the virtual CPU device count (and, for
`distributed`, the process group) must be fixed before JAX starts, while the suite runs on one device.

    python tests/sharded_worker.py families DEVICES TP DP   # every family, sharded against unsharded
    python tests/sharded_worker.py distributed PROCESS_ID PORT  # one of two processes over localhost

Prints one JSON line: what the test asserts on.
"""
import json
import os
import sys
import tempfile

MODE = sys.argv[1]
LOCAL_DEVICES = int(sys.argv[2]) if MODE == "families" else 2
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={LOCAL_DEVICES}"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dflash_jax import sharding  # noqa: E402  (after the device count is set)

if MODE == "distributed":
    sharding.initialize_distributed(f"127.0.0.1:{sys.argv[3]}", 2, int(sys.argv[2]), initialization_timeout=30,
                                    heartbeat_timeout_seconds=10, shutdown_timeout_seconds=10)

import jax  # noqa: E402
from jax.sharding import PartitionSpec  # noqa: E402

import dflash_jax as dj  # noqa: E402
from conftest import tiny_drafter, tiny_gemma4, tiny_hybrid, tiny_target  # noqa: E402
from dflash_jax.io.checkpoints import target_family, write_drafter, write_target  # noqa: E402
from dflash_jax.targets import moe as moe_block  # noqa: E402
from pallas_kernels import block_attention  # noqa: E402

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]
N = 10
SAMPLED = dj.Sampling(temperature=0.8, seed=3)


def norm(spec) -> list:
    """A PartitionSpec as a list without trailing Nones (the same layout however it is written)."""
    out = [None if a is None else a for a in tuple(spec)]
    while out and out[-1] is None:
        out.pop()
    return out


def leaves(tree) -> dict:
    """keystr -> array of every leaf (a QWeight's values and scales as two)."""
    return {jax.tree_util.keystr(k): x for k, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def spec_mismatches(placed, expected_specs) -> list:
    """Leaves whose sharding is not what `expected_specs` (a pytree of PartitionSpecs over the same tree) says."""
    want = {jax.tree_util.keystr(k): norm(s) for k, s in jax.tree_util.tree_flatten_with_path(
        expected_specs, is_leaf=lambda s: isinstance(s, PartitionSpec))[0]}
    bad = []
    for name, x in leaves(placed).items():
        base = name.replace(".data", "").replace(".scales", "")
        if norm(x.sharding.spec) != want.get(base, want.get(name)):
            bad.append(f"{name}: {norm(x.sharding.spec)} != {want.get(base, want.get(name))}")
    return bad


def specs(tree) -> dict:
    return {k: norm(x.sharding.spec) for k, x in leaves(tree).items()}


def family_run(target, drafter, mesh, sampled: bool = False) -> dict:
    """Plain and speculative greedy decoding (with `sampled`, speculative sampling too), unsharded and sharded;
    the placements of every parameter and state leaf, fresh and after a sharded run."""
    rules = target_family(target.config).sharding_rules()
    ts, ds = dj.shard(target, mesh), dj.shard(drafter, mesh)
    session = dj.Session(ts, ds, PROMPTS, max_new_tokens=N)
    out = {"plain_greedy": [dj.generate(m, None, PROMPTS, max_new_tokens=N).tokens for m in (target, ts)],
           "spec_greedy": [dj.generate(target, drafter, PROMPTS, max_new_tokens=N).tokens, session.run().tokens]}
    if sampled:  # a speculative run samples the target's residuals and bonus tokens too
        out["spec_sampled"] = [dj.generate(target, drafter, PROMPTS, max_new_tokens=N, sampling=SAMPLED).tokens,
                               dj.generate(ts, ds, PROMPTS, max_new_tokens=N, sampling=SAMPLED).tokens]
    tstate = sharding.place_state(ts, ts.init_state(2, 32))
    dstate = sharding.place_state(ds, ds.init_state(2, 32))
    out["param_mismatches"] = spec_mismatches(ts.params, sharding.param_specs(rules, ts.params, mesh))
    out["drafter_mismatches"] = spec_mismatches(ds.params, sharding.param_specs(sharding.RULES["dflash"], ds.params,
                                                                                mesh))
    out["state_mismatches"] = (spec_mismatches(tstate, sharding.state_specs(tstate, mesh))
                               + spec_mismatches(dstate, sharding.state_specs(dstate, mesh)))
    out["params"], out["state"], out["drafter_state"] = specs(ts.params), specs(tstate), specs(dstate)
    out["state_after_run"] = specs(session.state.target_state)
    return out


def families(tp: int, dp: int) -> dict:
    mesh = sharding.make_mesh(tp=tp, dp=dp)
    dense = tiny_target(layers=2)
    report = {"dense": family_run(dense, tiny_drafter(dense, 4, windows=(None,), tap_ids=(0, 1)), mesh,
                                   sampled=tp * dp > 2)}
    if tp * dp == 2:
        return report
    moe = tiny_hybrid(experts=4)
    report["hybrid_moe"] = family_run(moe, tiny_drafter(moe, 4, windows=(None,), tap_ids=(0, 1)), mesh)
    gemma = tiny_gemma4()
    report["gemma4"] = family_run(gemma, tiny_drafter(gemma, 4, windows=(None,), tap_ids=(0, 2)), mesh)

    quantised = dj.quantize(dense, "q8_0")
    qs = dj.shard(quantised, mesh)
    report["quantised"] = {"tokens": [dj.generate(m, None, PROMPTS, max_new_tokens=N).tokens for m in (quantised, qs)],
                           "params": specs(qs.params)}

    with tempfile.TemporaryDirectory() as tmp:
        drafter = tiny_drafter(dense, 4, windows=(None,), tap_ids=(0, 1))
        write_target(os.path.join(tmp, "t"), dense, dtype="float32")
        write_drafter(os.path.join(tmp, "d"), drafter, dtype="float32")
        lt = dj.load_target(os.path.join(tmp, "t"), mesh=mesh)
        ld = dj.load_drafter(os.path.join(tmp, "d"), lt, mesh=mesh, replicated=True)
        lq = dj.load_target(os.path.join(tmp, "t"), mesh=mesh, precision="q8_0")
        report["loaded_q8_0"] = {"params": specs(lq.params), "shard_params": report["quantised"]["params"],
                                 "tokens": [report["quantised"]["tokens"][0],
                                            dj.generate(lq, None, PROMPTS, max_new_tokens=N).tokens]}
        qd = dj.load_drafter(os.path.join(tmp, "d"), lt, mesh=mesh, precision="q8_0")
        report["head_copy"] = {"spec": specs(qd.head), "target_head": specs(lt.params["lm_head"]),
                               "tokens": [report["dense"]["plain_greedy"][0],
                                          dj.generate(lt, qd, PROMPTS, max_new_tokens=N).tokens]}
        report["loaded"] = {"params": specs(lt.params), "shard_params": specs(dj.shard(dense, mesh).params),
                            "drafter": specs(ld.params),
                            "tokens": [report["dense"]["plain_greedy"][0],
                                       dj.generate(lt, None, PROMPTS, max_new_tokens=N).tokens]}

    from test_dflash2 import tiny_dflash2
    from test_dspark import tiny_dspark
    for name, d in (("dspark", tiny_dspark(dense, markov=True, confidence=True, verify_policy="confidence")),
                    ("dflash2", tiny_dflash2(dense))):
        placed = dj.shard(d, mesh)
        report[name] = {"params": specs(placed.params), "mismatches": spec_mismatches(
            placed.params, sharding.param_specs(sharding.RULES[name], placed.params, mesh))}

    odd = tiny_target(vocab=65, layers=2)
    report["odd_vocab"] = specs(dj.shard(odd, mesh).params)
    try:
        dj.shard(odd, mesh, strict=True)
        report["strict"] = None
    except ValueError as e:
        report["strict"] = str(e)
    report["pallas"] = {}
    for name, target in (("dense", dense), ("hybrid_moe", moe)):  # the attention kernel, and the delta rule's
        drafter = tiny_drafter(target, 4, windows=(None,), tap_ids=(0, 1))
        report["pallas"][name] = [dj.generate(target, drafter, PROMPTS, max_new_tokens=N).tokens,
                                  dj.generate(dj.shard(target, mesh), dj.shard(drafter, mesh), PROMPTS,
                                              max_new_tokens=N, impl="pallas").tokens]
    q, kc, vc, kb, vb = (jax.numpy.ones(s, jax.numpy.float32) for s in ((2, 3, 4, 8), (2, 5, 2, 8), (2, 5, 2, 8),
                                                                         (2, 3, 2, 8), (2, 3, 2, 8)))
    with jax.set_mesh(mesh):
        traced = jax.make_jaxpr(lambda *a: block_attention(*a, scale=0.5, impl="pallas"))(
            q, kc, vc, jax.numpy.array([5, 2]), kb, vb)
        report["moe_impl_on_a_gpu"] = moe_block.default_impl("gpu")
    report["pallas_per_device"] = "shard_map" in str(traced)
    wide = sharding.make_mesh(tp=4)
    report["tp4"] = {"state": specs(sharding.place_state(dj.shard(dense, wide), dense.init_state(2, 8)))}
    return report


def distributed() -> dict:
    mesh = sharding.make_mesh(tp=2, dp=2)
    target = dj.shard(tiny_target(layers=2), mesh)
    return {"processes": jax.process_count(), "devices": len(jax.devices()), "local": len(jax.local_devices()),
            "tokens": dj.generate(target, None, PROMPTS, max_new_tokens=N).tokens}


if __name__ == "__main__":
    result = families(int(sys.argv[3]), int(sys.argv[4])) if MODE == "families" else distributed()
    print(json.dumps(result), flush=True)
