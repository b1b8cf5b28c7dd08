"""The GPU benchmark harness, run in its tiny CPU mode: it must stay runnable and honest.

Speed is never asserted here. What is: every benchmark writes its JSON, speculative runs equal
plain decoding, nothing compiles after warm-up, and injected acceptance lands where it was set.
"""
import dataclasses
import functools
import json
import os
import subprocess
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import common  # noqa: E402


@pytest.fixture(scope="module")
def tiny_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    run = subprocess.run(["bash", os.path.join(ROOT, "bench", "run_all.sh"), "--tiny", str(out)],
                         capture_output=True, text=True, timeout=900)  # in the run's cache (conftest)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return out


def _load(folder, name):
    with open(folder / f"{name}_tiny.json") as f:
        return json.load(f)


def test_run_all_tiny_writes_every_figure_and_the_summary(tiny_results):
    for name in ("plain_decode", "spec_round", "acceptance", "call_cost", "call_dispatch", "prefill", "gemm_check",
                 "profile_round", "sweep", "summary"):
        assert (tiny_results / f"{name}_tiny.json").is_file(), f"{name}_tiny.json missing"
    summary = _load(tiny_results, "summary")
    for key in ("plain_roofline_ratio", "round_over_plain_step", "speedup_at_tau_6_5", "loop_overhead",
                "fixed_cost_per_call_s"):
        assert isinstance(summary[key], float), f"summary.{key} was not measured"
    assert all(summary["checks"]["no_recompile"].values()), summary["checks"]["no_recompile"]
    assert all(summary["checks"]["lossless"].values()), summary["checks"]["lossless"]
    assert summary["checks"]["drafter_dropped_with_inject"] is False, "injected runs must still pay for the drafter"
    import summary as summary_script

    assert set(summary_script.HELD_BACK) == {t[0] for t in summary_script.TARGETS}, "every target can say why"
    missed = [k for k, t in summary["targets"].items() if t["met"] is False]
    assert missed, "the tiny models on a CPU miss GPU targets: the sentences below are exercised"
    for key in missed:
        held = summary["targets"][key]["held_back_by"]
        assert held and held["what"] and held["from"], f"{key} is missed and the summary does not say what holds it"


def test_the_summary_rewrites_the_readme_table_between_its_markers_and_nothing_else(tiny_results, tmp_path):
    import summary

    readme = tmp_path / "README.md"
    before, after = "# Title\n\nintro\n\n", "\n\nthe rest\n"
    readme.write_text(before + summary.README_BEGIN + "\nlast run's table\n" + summary.README_END + after)
    args = ["--tiny", "--out", str(tiny_results), "--readme", str(readme)]
    s = summary.main(args)
    text = readme.read_text()
    assert text.startswith(before + summary.README_BEGIN + "\n") and text.endswith(summary.README_END + after)
    assert "last run's table" not in text
    rows = {key: next(line for line in text.splitlines() if f"(`{key}`)" in line) for key in s["targets"]}
    for key, t in s["targets"].items():
        assert rows[key].count(" | ") == 4, rows[key]
        if t["met"] is False:
            assert "✗" in rows[key] and t["held_back_by"]["what"] in rows[key], rows[key]
    summary.main(args)
    assert readme.read_text() == text, "a second run over the same results writes the same table"
    bare = tmp_path / "bare.md"
    bare.write_text("no markers\n")
    with pytest.raises(SystemExit, match="the summary table goes between one line"):
        summary.main(["--tiny", "--out", str(tiny_results), "--readme", str(bare)])
    assert bare.read_text() == "no markers\n"


def test_a_missed_static_peer_target_says_how_close_to_the_roofline_ours_would_have_to_run():
    import summary

    plain = {"peers": [{"cache_implementation": "dynamic", "tokens_per_s": 30.0},
                       {"cache_implementation": "static", "tokens_per_s": 100.0}],
             "roofline_tokens_per_s": 200.0, "roofline_ratio": 0.86}
    held = summary.held_back("speedup_over_static_peer", {"plain_decode": plain})
    assert held["peer_roofline_ratio"] == 0.5
    assert held["roofline_ratio_needed"] == pytest.approx(0.925), "1.85x a peer at half the roofline"
    assert "0.93 of the roofline" in held["what"] and "0.86" in held["what"], held["what"]
    assert held["from"] == ["plain_decode.json"]
    plain["peers"] = plain["peers"][:1]
    assert summary.held_back("speedup_over_static_peer", {"plain_decode": plain}) is None, "no static peer, no claim"


def test_a_missed_loop_overhead_or_batch_64_speedup_names_the_figures_behind_it():
    import summary

    head = {"batch": 1, "prompt": 512, "round_s": 6e-3, "sum_of_phases_s": 5e-3}
    phases = {"draft_s": 1e-3, "verify_s": 3.5e-3, "commit_ingest_s": 0.5e-3}
    spec = {"headline": head, "cells": [{"batch": 8, "prompt": 512, "phases": {}},
                                        {"batch": 1, "prompt": 512, "phases": phases}]}
    held = summary.held_back("loop_overhead", {"spec_round": spec})
    assert "6.00 ms against 5.00 ms" in held["what"] and "verify 3.50" in held["what"], held["what"]
    assert held["phases_s"] == phases and held["from"] == ["spec_round.json"]
    row = {"batch": 64, "prompt": 512, "round_s": 0.02, "round_over_plain_step": 4.0, "plain_step_s": 0.005,
           "tau_measured": 6.0}
    held = summary.held_back("speedup_at_tau_6_5_batch_64", {"sweep": {"table": [row]}})
    assert held["round_needed"] == 3.0, "2x at 6 tokens a round needs a round of 3 plain steps"
    assert "4.00 plain steps" in held["what"] and "3.00 plain steps" in held["what"], held["what"]
    row["batch"] = 16
    assert summary.held_back("speedup_at_tau_6_5_batch_64", {"sweep": {"table": [row]}}) is None, "no cell, no claim"


def test_program_flops_counts_what_the_compiled_program_keeps():
    """`drafter_dropped_with_inject` compares compiled programs' FLOPs: a product whose result is unused is gone."""
    import jax
    import spec_round

    a = jnp.ones((64, 64), jnp.float32)
    used = spec_round.program_flops(jax.jit(lambda x, y: x @ y), a, a)
    dead = spec_round.program_flops(jax.jit(lambda x, y: (x @ y, x + 1.0)[1]), a, a)
    assert used >= 2 * 64 ** 3 * 0.9 and dead < 0.5 * used


def test_injected_acceptance_lands_where_it_was_set(tiny_results):
    cells = _load(tiny_results, "acceptance")["cells"]
    runs = [r for c in cells for r in c["runs"] if r["tau"] <= 6.5]
    assert runs, "no acceptance runs at tau <= 6.5"
    for r in runs:
        # the last round is cut at the token limit, so the measured value sits a little under tau
        assert 0.9 * r["tau"] <= r["tau_measured"] <= r["tau"] + 0.05, (r["tau"], r["tau_measured"])
        assert r["lossless"], f"tau {r['tau']}: speculative tokens differ from plain"


def test_planted_random_target_has_a_wide_argmax_margin_and_agrees_in_bf16():
    """bf16 rounding differs between a 16-row verify and a 1-row step; the planted map's
    margin must make their argmaxes agree anyway, or acceptance could not be controlled.
    (Plain random weights: the top-1 lead is as little as 0.02 logit standard deviations.)"""
    cfg = dataclasses.replace(common.TINY, dtype="bfloat16")
    target = common.random_target(cfg, jnp.bfloat16)
    logits = np.asarray(target.full_logits([list(range(5, 69))]), np.float32)[0]
    top = np.sort(logits, axis=-1)
    lead = (top[:, -1] - top[:, -2]) / logits.std(axis=-1)
    assert lead.min() > 1.0, f"top-1 leads by only {lead.min():.3f} standard deviations somewhere"
    drafter = common.random_drafter(common.drafter_config(cfg, 16, 2), jnp.bfloat16)
    prompts = [list(range(5, 40)), list(range(50, 70))]
    plain = dflash_jax.generate(target, None, prompts, max_new_tokens=48)
    spec = dflash_jax.generate(target, drafter, prompts, max_new_tokens=48)
    assert spec.tokens == plain.tokens
    assert len(set(plain.tokens[0])) > 10, "the planted map should walk a long cycle, not repeat one token"


def test_dflash2_round_compares_both_families_over_one_target_losslessly(tmp_path):
    import dflash2_round

    payload = dflash2_round.main(["--tiny", "--out", str(tmp_path), "--reps", "1", "--new", "16", "--calls", "2",
                                  "--phase-reps", "1"])
    assert (tmp_path / "dflash2_round_tiny.json").exists()
    assert set(payload["cells"]) == {"dflash", "dflash2"}
    (c,) = payload["comparison"]
    assert c["lossless"], "both drafters' speculative runs must equal plain decoding"
    assert all(cell["no_recompile"] for cells in payload["cells"].values() for cell in cells)
    assert c["dflash2_over_dflash"]["draft"] > 0 and set(c["speedup_at_tau"]) == {"dflash", "dflash2"}
    assert payload["drafter_bytes_dflash2"] > payload["drafter_bytes_dflash"], "DFlash2 adds convolutions and codebooks"


def test_hybrid_bench_measures_both_rollbacks_losslessly(tmp_path):
    import hybrid

    payload = hybrid.main(["--tiny", "--out", str(tmp_path), "--reps", "1", "--new", "16", "--calls", "2",
                           "--phase-reps", "1"])
    assert (tmp_path / "hybrid_tiny.json").exists()
    (model,) = payload["models"].values()
    assert model["round"]["real_drafter"]["lossless"] and all(c["lossless"] for c in model["round"]["fused"]), \
        "speculative decoding of the hybrid must equal its plain decoding"
    assert model["round"]["no_recompile"]
    assert {"per_position_s", "keep_all_s", "replay_s"} <= set(model["rollback"])
    assert model["plain"]["bytes"]["routed_experts_skipped"] > 0, "the roofline counts only the routed experts used"
    assert 0 < model["headline"]["roofline_ratio"] and model["headline"]["round_over_plain_step"] > 0


def test_decode_kernels_times_each_switch_alone_and_restores_the_defaults(tmp_path):
    import decode_kernels

    before = [(m, a, getattr(m, a)) for m, a, _ in decode_kernels.SWITCHES.values()]
    payload = decode_kernels.main(["--tiny", "--out", str(tmp_path), "--prompt", "16", "--new", "6", "--passes", "1"])
    assert (tmp_path / "decode_kernels_tiny.json").exists()
    (model,) = payload["models"].values()
    assert set(model["cells"]) == {"off", "all", *decode_kernels.SWITCHES}, "the tiny hybrid has MoE layers"
    assert model["cells"]["all"]["on"] == ["route", "delta_step"], "one routing kernel at a time"
    assert all(c["same_tokens_as_off"] and c["step_s"] > 0 for c in model["cells"].values())
    assert [(m, a, getattr(m, a)) for m, a, _ in decode_kernels.SWITCHES.values()] == before
    dense = decode_kernels.hybrid.MODELS["qwen3.5-9b"]
    assert list(decode_kernels.settings(dense)) == ["off", "delta_step"], "the MoE switches need MoE layers"


def test_call_cost_fits_a_line_through_the_bursts_and_refuses_one_size():
    import call_cost

    bursts = [{"rounds": r, "seconds": 0.013 + 0.006 * r} for r in (2, 32, 2, 32, 5)]
    fixed, per_round = call_cost.fit(bursts)
    assert abs(fixed - 0.013) < 1e-9 and abs(per_round - 0.006) < 1e-9
    with pytest.raises(ValueError, match="sizes"):
        call_cost.fit([{"rounds": 4, "seconds": 0.1}, {"rounds": 4, "seconds": 0.2}])


def test_call_cost_measures_each_sampling_against_greedy(tmp_path):
    import call_cost

    from dflash_jax import sampling as smp

    default = smp.FILTER_IMPL
    other = next(impl for impl in smp.FILTER_IMPLS if impl != default)
    payload = call_cost.main(["--tiny", "--samplings", "sampled", "--filters", other, default, "--bursts", "4",
                              "--out", str(tmp_path)])
    assert (tmp_path / "call_cost_tiny.json").is_file()
    cells = {(c["batch"], c["sampling"], c["filter"]): c for c in payload["cells"]}
    assert payload["default_filter"] == default
    assert set(cells) == {(1, "greedy", default), (1, "sampled", other), (1, "sampled", default)}, (
        "greedy always runs, once: it is each ratio's baseline")
    assert cells[(1, "greedy", default)]["round_over_greedy"] == 1.0
    assert all(c["round_over_greedy"] > 0 for c in payload["cells"])
    assert all(c["compiles_in_warmup"] > 0 for c in payload["cells"]), "each cell traces its own loop"
    import summary
    assert summary._ratio(payload, 1, "sampled") == cells[(1, "sampled", default)]["round_over_greedy"], (
        "summary.json reads the cell of the package's filter")
    assert payload["fixed_cost_per_call_s"] == cells[(1, "greedy", default)]["fixed_cost_per_call_s"]
    assert payload["no_recompile"], "every burst of a cell runs the loop compiled by its warm-up"
    assert all(b["rounds"] >= 1 and b["tokens"] <= b["size"] for c in payload["cells"] for b in c["bursts"])


def test_call_dispatch_splits_calls_of_known_rounds_and_counts_the_leaves(tmp_path):
    import call_dispatch

    payload = call_dispatch.main(["--tiny", "--calls", "3", "--rounds", "1", "3", "--out", str(tmp_path)])
    assert (tmp_path / "call_dispatch_tiny.json").is_file()
    rows = payload["rows"]
    assert rows["run_burst_0"]["rounds_per_call"] == 0, "a limit at the tokens made runs no round"
    assert rows["run_burst_1"]["rounds_per_call"] == 1, "a round makes at least one token"
    assert 1 <= rows["run_burst_3"]["rounds_per_call"] <= 3
    if rows["run_burst_3"]["rounds_per_call"] > 1:  # the tiny drafter's drafts are rarely accepted
        assert payload["fit"]["round_s"] > 0
    else:
        assert payload["fit"] is None, "one round count gives no line"
    assert {"passthrough_state", "passthrough_state_without_models", "identity_state_leaves"} <= set(rows)
    assert all(r["total_s"] > 0 for r in rows.values())
    leaves = payload["leaves"]
    assert leaves["state"] >= leaves["state_target_cache"] + leaves["state_drafter_cache"] > 0


def test_verify_cap_cuts_acceptance_to_the_cap_losslessly_at_every_cap(tmp_path):
    import verify_cap

    payload = verify_cap.main(["--tiny", "--batches", "2", "--caps", "2", "4", "99", "--reps", "1",
                               "--out", str(tmp_path)])
    assert (tmp_path / "verify_cap_tiny.json").is_file()
    nd = payload["drafter"]["n_drafts"]
    assert payload["caps"] == [2, 4, nd + 1], "caps past the block are the full block"
    assert payload["lossless"] and payload["no_recompile"]
    (cell,) = payload["cells"]
    for run in cell["runs"]:
        hist = run["accept_hist"]
        assert sum(hist[run["verify_cap"]:]) == 0, f"cap {run['verify_cap']} accepted more drafts: {hist}"
    taus = [r["tau_measured"] for r in cell["runs"]]
    assert taus == sorted(taus) and taus[0] < taus[-1], f"a lower cap must accept less: {taus}"
    assert cell["best_cap"] in payload["caps"] and cell["full_block_speedup"] == cell["runs"][-1]["speedup"]


def test_prefill_counts_the_weights_and_the_causal_attention(tmp_path):
    import prefill

    payload = prefill.main(["--tiny", "--prompt", "64", "--reps", "1", "--gemm", "64", "--out", str(tmp_path)])
    c = common.TINY
    per_layer = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim * (
        c.hidden_size) + 3 * c.hidden_size * c.intermediate_size
    weights = 2 * 64 * per_layer * c.num_layers + 2 * c.vocab_size * c.hidden_size
    assert payload["weight_flops"] == weights
    assert payload["flops"] == weights + 2 * 64 ** 2 * c.num_heads * c.head_dim * c.num_layers
    assert payload["prefill_s"] > 0 and payload["share_of_stated_peak"] > 0
    assert (tmp_path / "prefill_tiny.json").is_file()


def test_step_verify_compares_the_three_paths_layer_by_layer(tmp_path):
    import step_verify

    assert step_verify.main(["--tiny", "--prompt", "24", "--width", "4", "--variants", "pallas/grouped", "xla/gather",
                             "--out", str(tmp_path)]) == 0
    with open(tmp_path / "step_verify_tiny.json") as f:
        (model,) = json.load(f)["models"].values()
    assert set(model["cells"]) == {"pallas/grouped", "xla/gather"}
    for cell in model["cells"].values():
        assert set(cell) == {"verify_vs_steps", "verify_vs_forward", "steps_vs_forward"}
        for pair in cell.values():
            assert len(pair["layer_rel"]) == len(model["layer_types"]) and pair["ok"] and pair["finite"]
            assert all(pair["argmax_agree"]) and pair["logit_rel"] < 1e-4, "float32 paths agree to rounding"


def test_step_verify_reshapes_the_model_and_refuses_a_bad_field():
    import argparse

    import hybrid
    import step_verify

    ap = argparse.ArgumentParser()
    cfg = step_verify.reshaped(hybrid.TINY["tiny-hybrid"], argparse.Namespace(set=["num_experts=4"], layers=2,
                                                                             dense_mlp=None), ap)
    assert cfg.num_experts == 4 and cfg.num_layers == 2 and len(cfg.layer_types) == len(cfg.moe_layers) == 2
    dense = step_verify.reshaped(cfg, argparse.Namespace(set=[], layers=None, dense_mlp=48), ap)
    assert not any(dense.moe_layers) and dense.intermediate_size == 48 and dense.num_layers == 2
    for bad in ("rope=3", "num_experts=four", "no_such_field=1"):
        with pytest.raises(SystemExit):
            step_verify.main(["--tiny", "--set", bad])


def test_step_verify_fails_on_paths_that_disagree():
    import step_verify

    a = (np.ones((4, 2, 8), np.float32), np.eye(4, 16, dtype=np.float32))
    b = (a[0].copy(), a[1].copy())
    b[0][:, 1] += 0.5  # the second layer's outputs part
    result = step_verify.compare(a, b, 0.05)
    assert result["first_layer_off"] == 1 and not result["ok"] and all(result["argmax_agree"])


def test_moe_bench_checks_every_impl_against_the_gather_and_sweeps_the_kernel(tmp_path):
    import moe as moe_bench
    from dflash_jax.targets import moe

    assert moe_bench.main(["--quick", "--sweep", "--out", str(tmp_path / "moe_quick.json")]) == 0
    with open(tmp_path / "moe_quick.json") as f:
        payload = json.load(f)
    assert {c["impl"] for c in payload["checks"]} == set(moe.MOE_IMPLS) - {"gather"}
    assert all(c["ok"] for c in payload["checks"])
    assert all(cell[f"{impl}_ms"] > 0 for cell in payload["cells"] for impl in moe.MOE_IMPLS)
    assert {(row["T"], row["product"]) for row in payload["sweep"]} == {(1, "gate_up"), (1, "down"), (16, "gate_up"),
                                                                       (16, "down")}


def test_gemma4_tiny_measures_plain_and_round_phases_losslessly_over_a_ring(tmp_path):
    """The ring (`--sliding-caches ring`), the cache that differs from every other family's; 'full' runs the same
    code over the default cache."""
    import gemma4

    payload = gemma4.main(["--tiny", "--out", str(tmp_path), "--reps", "1", "--new", "16", "--calls", "2",
                           "--phase-reps", "1", "--sliding-caches", "ring"])
    assert (tmp_path / "gemma4_tiny.json").exists()
    (cell,) = payload["cells"]
    assert cell["sliding_cache"] == "ring" and cell["headline"]["lossless"] and cell["headline"]["no_recompile"]
    assert cell["plain"]["bytes"]["kv"] > 0 and cell["plain"]["roofline_ratio"] > 0
    assert all(cell["round"]["phases"][f"{k}_s"] > 0 for k in ("draft", "verify", "commit_ingest"))
    assert cell["prompt"] > payload["config"]["sliding_window"] + payload["ring_slack"], "the ring must wrap"


@pytest.mark.parametrize("static_cache", [False, True])
def test_the_transformers_peer_is_warmed_up_with_exactly_the_call_it_is_timed_on(static_cache):
    """A static cache is sized by the call: a warm-up of other shapes makes `generate` re-make it and recompile
    inside the timed runs (the old 4-token warm-up measured 2.5 tok/s where the peer runs at 127.7)."""
    import torch

    calls = []
    model = types.SimpleNamespace(device=torch.device("cpu"), config=types.SimpleNamespace(
        vocab_size=50, _attn_implementation="sdpa"), generation_config=types.SimpleNamespace(cache_implementation=None))
    model.generate = lambda ids, **kw: calls.append((tuple(ids.shape), ids.clone(), kw,
                                                     model.generation_config.cache_implementation))
    got = common.hf_generate_tokens_per_s(model, 12, 7, static_cache=static_cache, warmups=2, reps=3)
    assert len(calls) == 5, "two warm-ups and three timed calls"
    first = calls[0]
    for shape, ids, kw, cache in calls:
        assert shape == (1, 12) and torch.equal(ids, first[1]), "every call generates from the same prompt"
        assert kw == first[2] and kw["max_new_tokens"] == kw["min_new_tokens"] == 7, "the warm-up must be timed shapes"
        assert cache == ("static" if static_cache else None), "every call uses the cache that is timed"
    assert model.generation_config.cache_implementation is None, "the model's cache setting is restored"
    assert got["cache_implementation"] == ("static" if static_cache else "dynamic") and got["warmups"] == 2
    assert got["compiles_in_timed_runs"] == 0, "nothing compiled between the warm-ups and the end of the timed runs"


def test_sampling_filter_bench_times_every_impl_with_identical_supports(tmp_path):
    import sampling_filter

    payload = sampling_filter.main(["--tiny", "--reps", "1", "--batches", "1", "--out", str(tmp_path)])
    assert (tmp_path / "sampling_filter_tiny.json").is_file()
    assert {c["setting"] for c in payload["cells"]} == set(sampling_filter.SETTINGS)
    for c in payload["cells"]:
        assert c["same_support"], f"{c['setting']}: the candidate search and the sort keep different tokens"
        assert c["candidates_us"] > 0 and c["sort_us"] > 0
        for impl in ("threshold", "threshold_xla", "groups"):
            assert c[f"same_support_{impl}"], f"{c['setting']}: {impl} and the sort keep different tokens"
            assert c[f"{impl}_us"] > 0
        for ways in sampling_filter.THRESHOLD_WAYS if c["setting"] == sampling_filter.PARTS_SETTING else ():
            for impl in ("threshold", "threshold_xla"):
                assert c[f"part_{impl}_{ways}w_us"] > 0, f"{impl} at {ways} ways was not timed"
        for group, groups, _ in sampling_filter.GROUP_SETTINGS if c["setting"] == sampling_filter.PARTS_SETTING else ():
            assert c[f"part_groups_{group}x{groups}_us"] > 0, f"the group search at {group} x {groups} was not timed"


def test_gemv_sweep_times_every_form_against_the_reference(tmp_path):
    import gemv_sweep

    payload = gemv_sweep.main(["--tiny", "--reps", "1", "--out", str(tmp_path)])
    assert (tmp_path / "gemv_sweep_tiny.json").is_file()
    for wname, (k, n) in gemv_sweep.TINY_SHAPES.items():
        cells = payload["weights"][wname]["cells"]
        forms = {c["form"] for c in cells}
        assert not payload["weights"][wname]["failed"]
        assert {"bf16", "auto", "default", "dot16"} <= forms and any(f.startswith("T") for f in forms)
        gemvs = [f for f in forms if f.startswith("gemv_")]
        assert any("_unroll" not in f for f in gemvs) and any(f.endswith("_evict") for f in gemvs), \
            "the second pass (looped and evicting variants of the best) did not run"
        for c in cells:
            assert c["wall_us"] > 0 and c["TBps"] > 0
            assert c["rel_err"] < 2e-2, f"{wname} {c['form']} disagrees with the reference"


def test_gemv_sweep_of_a_q8_0_block_times_the_product_kernels_settings_against_the_reference(tmp_path):
    """`--rows 16` sweeps the product kernel (a drafter's block); at tiny K every K split is large, which must not
    leave the sweep with no setting to time."""
    import gemv_sweep

    payload = gemv_sweep.main(["--tiny", "--rows", "16", "--fmt", "q8_0", "--reps", "1", "--out", str(tmp_path)])
    assert (tmp_path / "gemv_sweep_q8_0_16_tiny.json").is_file()
    for wname in gemv_sweep.TINY_SHAPES:
        cells = payload["weights"][wname]["cells"]
        forms = {c["form"] for c in cells}
        assert not payload["weights"][wname]["failed"]
        dots = [f for f in forms if f.startswith("dot_")]
        assert {"bf16", "auto", "default"} <= forms and "dot16" not in forms
        assert any("_unroll" in f for f in dots) and any("_unroll" not in f for f in dots)
        assert any(f.endswith("_evict") for f in dots), "the second pass (evicting variants of the best) did not run"
        for c in cells:
            assert c["rel_err"] < 2e-2, f"{wname} {c['form']} disagrees with the reference"


def test_gemv_sweep_splits_a_trace_into_runs_at_idle_gaps():
    import gemv_sweep

    gap = gemv_sweep.GAP_US
    events = [{"ts": 0.0, "dur": 5.0}, {"ts": 6.0, "dur": 4.0}, {"ts": 12.0 + gap, "dur": 3.0},
              {"ts": 14.0 + gap, "dur": 2.0}, {"ts": 20.0 + 3 * gap, "dur": 1.0}]
    assert gemv_sweep.clusters(events[::-1]) == [(10.0, 9.0), (4.0, 5.0), (1.0, 1.0)]


def test_sharded_bench_tiny_runs_losslessly_on_two_virtual_devices(tmp_path):
    """`bench/sharded.py --tiny` in a process of its own (its 2 virtual CPU devices exist before JAX starts)."""
    run = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "sharded.py"), "--tiny", "--out", str(tmp_path),
                          "--reps", "1", "--new", "16", "--calls", "2", "--phase-reps", "1"],
                         capture_output=True, text=True, timeout=300, cwd=os.path.join(ROOT, "bench"),
                         env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with open(tmp_path / "sharded_tiny.json") as f:
        payload = json.load(f)
    assert payload["devices"] == 2 and {(c["tp"], c["drafter"]) for c in payload["cells"]} == {
        (1, "sharded"), (2, "sharded"), (2, "replicated")}
    for c in payload["cells"]:
        assert c["lossless"], f"tp={c['tp']}: speculative tokens differ from plain on the mesh"
        assert c["runs_recompiled"] == 0, f"tp={c['tp']}: the fused loop compiled after its warm-up"
        assert c["roofline_ratio"] > 0 and c["speedup_at_tau"] > 0
    assert payload["tp_speedup"] > 0 and payload["replicated_drafter_round_over_sharded"] > 0


def test_stacked_leaves_times_each_layout_and_xla_variant_of_one_model_and_they_agree(tmp_path):
    import stacked_leaves

    payload = stacked_leaves.main(["--tiny", "--reps", "1", "--calls", "3", "--out", str(tmp_path)])
    assert (tmp_path / "stacked_leaves_tiny.json").is_file()
    forms = payload["forms"]
    assert set(forms) == set(stacked_leaves.VARIANTS)
    assert payload["same_state"], {f: r["x_sum"] for f, r in forms.items()}
    assert forms["per_layer"]["state_rel_diff"] == 0
    assert all(r["state_rel_diff"] < 1e-3 for r in forms.values()), {f: r["state_rel_diff"] for f, r in forms.items()}
    layers = stacked_leaves.TINY["layers"]
    assert forms["per_layer"]["leaves"] == 8 * layers + 2 * layers + 1, "eight weights and K and V a layer, and x"
    assert forms["stacked"]["leaves"] == 8 + 2 + 1
    assert forms["kv_stacked"]["leaves"] == 8 * layers + 2 + 1
    assert forms["per_layer"]["step_over_per_layer"] == 1.0
    assert all(r["step_s"] > 0 and r["noop_call_s"] > 0 for r in forms.values())


def test_graph_capture_names_each_lowering_s_custom_call_and_times_every_chain(tmp_path):
    import graph_capture

    payload = graph_capture.main(["--tiny", "--decode", "--reps", "1", "--out", str(tmp_path)])
    assert (tmp_path / "graph_capture_tiny.json").is_file()
    known = {"triton": {"__gpu$xla.gpu.triton", "triton_kernel_call_ffi"}, "triton_xla": {"__gpu$xla.gpu.triton"},
             "mosaic": {"mosaic_gpu_v2"}}
    assert set(payload["custom_call_targets"]) == set(known)
    for lowering, targets in payload["custom_call_targets"].items():
        assert len(targets) == 1 and targets[0] in known[lowering], f"{lowering} lowered to {targets}"
    assert any("call_target_name" in line for line in payload["triton_lowering_choice"])
    assert set(payload["chains"]) == {"pallas_triton", "pallas_triton_xla", "pallas_mosaic", "xla"}
    assert all(chain["us_per_kernel"] > 0 for chain in payload["chains"].values()), payload["chains"]
    cells = {(c["precision"], c["lowering"]): c for c in payload["decode"]}
    assert set(cells) == {(p, lowering) for p in ("bf16", "int8") for lowering in ("triton", "triton_xla")}
    assert all(c["same_tokens"] and "error" not in c for c in cells.values()), payload["decode"]


def test_graph_capture_forces_our_own_kernels_to_xla_s_triton_call_and_back():
    import graph_capture
    from pallas_kernels import quant_matmul, windowed_attention

    q = jnp.zeros((1, 4, 4, 16), jnp.float32)
    kv = jnp.zeros((1, 64, 2, 16), jnp.float32)
    attend = functools.partial(windowed_attention.block_attention, scale=0.25, impl="pallas", interpret=False)
    data, scales = jnp.zeros((64, 32), jnp.int8), jnp.ones((1, 32), jnp.float32)
    gemv = functools.partial(quant_matmul.quant_matmul, fmt="int8", impl="pallas", interpret=False)
    cases = ((attend, q, kv, kv, jnp.full((1,), 8, jnp.int32), q[:, :, :2], q[:, :, :2]),
             (gemv, jnp.zeros((1, 64), jnp.float32), data, scales))
    try:
        graph_capture.kernels_lowered("triton_xla")
        assert all(m._triton_compiler_params is graph_capture.forced_xla_triton for m in graph_capture.KERNEL_MODULES)
        for fn, *args in cases:
            assert graph_capture.lowered_targets(fn, *args) == ["__gpu$xla.gpu.triton"], fn
    finally:
        graph_capture.kernels_lowered("triton")
    assert all(m._triton_compiler_params is windowed_attention._triton_compiler_params
               for m in graph_capture.KERNEL_MODULES)
