"""DFlash2 drafters (docs/architecture.md, "DFlash2"): the original's selector tests as pytest, the refusals the
census adds for its codebooks, lossless greedy decoding, and a checkpoint in the published layout.

The forward against an independent numpy reference (convolutions, symmetric window, selector walk over the
reference logits) is in test_drafter_reference.py; the census and its other refusals in test_config.py; sampled
decoding against the target's distribution in test_sampling_e2e.py.
"""
import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

import dflash_jax
from dflash_jax import cli
from dflash_jax.config import CheckpointError, DrafterConfig, RopeConfig, TargetConfig, check_fits_target
from dflash_jax.drafters.dflash2 import DFlash2Drafter, selector_walk
from dflash_jax.io import checkpoints
from dflash_jax.io.checkpoints import drafter_census, make_drafter, write_drafter
from conftest import drafter_param_shapes, inject_reference, random_params

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [1, 2, 3], list(range(12, 40))]
MAX_NEW = 24
NO_ENV: dict = {}

# --- the original's dflash2_tests: V = 8 tokens, rank 2, K = 2 candidates per slot, 2 slots ------------------

V, R, K = 8, 2, 2
CAND = [[1, 2], [3, 4]]


def books() -> tuple:
    """pred[0] = e0, pred[1] = e1, pred[2] = e0; succ[1] = 2 e0, succ[2] = 5 e1, succ[3] = 3 e1, succ[4] = 10 e0."""
    pred, succ = np.zeros((V, R), np.float32), np.zeros((V, R), np.float32)
    pred[0, 0] = pred[1, 1] = pred[2, 0] = 1.0
    succ[1, 0], succ[2, 1], succ[3, 1], succ[4, 0] = 2.0, 5.0, 3.0, 10.0
    return jnp.asarray(pred), jnp.asarray(succ)


def walk(unary=(0.0,) * 4, hproj=(1.0,) * 4, temperature=0.0, uniforms=(0.0, 0.0)) -> tuple:
    """(path, q [nd, K]) of one row walking from anchor 0."""
    path, q = selector_walk(*books(), jnp.asarray(unary, jnp.float32).reshape(1, 2, K),
                            jnp.asarray(CAND, jnp.int32)[None], jnp.asarray(hproj, jnp.float32).reshape(1, 2, R),
                            jnp.zeros((1,), jnp.int32), jnp.asarray([temperature], jnp.float32),
                            jnp.asarray([uniforms], jnp.float32))
    return [int(t) for t in path[0]], np.asarray(q[0])


def test_selector_walk_is_a_chain_not_per_slot_argmax():
    assert walk()[0] == [1, 3], "slot p walks from slot p-1's chosen candidate (reference CandidateSelector.select)"


def test_selector_walk_unary_term_participates():
    assert walk(unary=(0.0, 10.0, 0.0, 0.0))[0] == [2, 4], "score = unary + bilinear; without unary tok 1 wins"


def test_selector_walk_hidden_gate_participates():
    path = walk(unary=(0.0, 1.0, 0.0, 0.0), hproj=(0.0, 1.0, 1.0, 1.0))[0]
    assert path == [2, 4], "the gate is pred[prev] * hidden_projection; ignoring hp leaves tok 1's margin standing"


def test_sampled_walk_at_tiny_temperature_equals_the_greedy_chain():
    path, q = walk(temperature=1e-6, uniforms=(0.5, 0.5))
    assert path == walk()[0]
    assert q.shape == (2, K)
    chosen = [q[p, CAND[p].index(tok)] for p, tok in enumerate(path)]
    assert min(chosen) > 0.999, f"the chosen candidates' probabilities must be ~1, got {chosen}"


@pytest.mark.parametrize("offset, want", [(-0.01, 1), (0.01, 2)])
def test_sampled_walk_records_the_distribution_it_samples(offset, want):
    q1 = float(np.exp(1.0) / (np.exp(1.0) + 1.0))  # scores (2, 0) at T = 2
    path, q = walk(temperature=2.0, uniforms=(q1 + offset, 0.0))
    assert path[0] == want, f"u = q1 {offset:+} must fall in candidate {want}'s bracket of the CDF"
    assert abs(q[0].sum() - 1.0) < 1e-5, f"slot 0's q must sum to 1, got {q[0].sum()}"
    assert abs(q[0, 0] - q1) < 1e-5, f"slot 0's q of tok 1 must be softmax(scores / T), got {q[0, 0]} want {q1}"


def test_sampled_walk_chains_the_drawn_candidate():
    path, _ = walk(temperature=2.0, uniforms=(0.99, 0.01))
    assert path[0] == 2, "u = 0.99 draws the less likely candidate"
    assert path[1] == 4, "slot 1 walks from pred[2] (the drawn token), which scores tok 4 at 10; chaining from the " \
                         "anchor or the argmax picks tok 3"


def test_greedy_rows_of_a_sampled_batch_take_the_argmax_with_one_hot_q():
    path, q = walk(temperature=0.0, uniforms=(0.99, 0.99))
    assert path == [1, 3]
    np.testing.assert_array_equal(q, [[1.0, 0.0], [1.0, 0.0]])


# --- refusals of the codebooks (the census's others are in test_config.py) ----------------------------------


def fixture_census(header_edit=None, **config_edit):
    d = json.loads((FIXTURES / "dflash2-config.json").read_text())
    d.update(config_edit)
    header = {k: v["shape"] for k, v in json.loads((FIXTURES / "dflash2-safetensors-header.json").read_text()).items()
              if k != "__metadata__"}
    if header_edit:
        header_edit(header)
    return drafter_census(d, header, env=NO_ENV)


@pytest.mark.parametrize("name, shape, expected", [
    ("candidate_selector.predecessor_codebook", [202047, 256], r"\[202048, 256\]"),
    ("candidate_selector.successor_codebook", [202048, 128], r"\[202048, 256\]"),
    ("candidate_selector.hidden_projection.weight", [256, 4096], r"\[256, 6656\]"),
    ("layers.0.attention_conv.base_kernel", [2, 3, 6656], r"\[2, 2, 6656\]"),
])
def test_a_codebook_or_convolution_of_the_wrong_shape_is_refused_naming_it(name, shape, expected):
    with pytest.raises(CheckpointError, match=rf"{name} has shape \[{shape[0]}, {shape[1]}.*expected {expected}"):
        fixture_census(lambda h: h.__setitem__(name, shape))


def test_codebooks_of_another_vocabulary_than_the_config_or_target_are_refused():
    with pytest.raises(CheckpointError, match=r"predecessor_codebook has shape \[202048, 256\], expected \[202050"):
        fixture_census(vocab_size=202050)
    cfg = fixture_census()
    target = TargetConfig("qwen3", vocab_size=151936, hidden_size=6656, intermediate_size=64, num_layers=52,
                          num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope=RopeConfig(1e4))
    with pytest.raises(CheckpointError, match="drafter vocab_size 202048 != target vocab_size 151936"):
        check_fits_target(cfg, target)


def test_more_candidates_than_the_vocabulary_are_refused():
    d = json.loads((FIXTURES / "dflash2-config.json").read_text())
    d["dflash_config"]["selector_top_k"] = 202049
    with pytest.raises(CheckpointError, match=r"selector_top_k 202049 exceeds the vocabulary \(202048\)"):
        dflash_jax.config.drafter_census(d, env=NO_ENV)
    with pytest.raises(CheckpointError, match=r"selector_top_k 300000 exceeds.*keyword override selector_top_k"):
        dflash_jax.config.drafter_census(json.loads((FIXTURES / "dflash2-config.json").read_text()), env=NO_ENV,
                                         selector_top_k=300000)


def test_a_selector_needs_a_vocabulary():
    d = json.loads((FIXTURES / "dflash2-config.json").read_text())
    del d["vocab_size"]
    with pytest.raises(CheckpointError, match=r"DFlash2 heads \('conv', 'selector'\) need vocab_size"):
        dflash_jax.config.drafter_census(d, env=NO_ENV)


# --- decoding ---------------------------------------------------------------------------------------------


def tiny_dflash2(target, block_size: int = 8, window: int = 8, seed: int = 1, top_k: int = 4) -> DFlash2Drafter:
    tc = target.config
    cfg = DrafterConfig(family="dflash2", hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
                        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6,
                        rope=RopeConfig(1e4), block_size=block_size, mask_token_id=tc.vocab_size - 1,
                        target_layer_ids=(0, 2), layer_window=(window, window), causal=(False, False),
                        vocab_size=tc.vocab_size, selector_rank=4, selector_top_k=top_k, conv_kernel_size=2,
                        conv_group_size=8)
    return make_drafter(cfg, random_params(drafter_param_shapes(cfg), seed))


@pytest.fixture(scope="module")
def plain(target):
    return dflash_jax.generate(target, None, PROMPTS, max_new_tokens=MAX_NEW).tokens


@pytest.mark.parametrize("block_size", [4, 8])
def test_greedy_speculative_equals_plain_greedy(target, plain, block_size):
    out = dflash_jax.generate(target, tiny_dflash2(target, block_size), PROMPTS, max_new_tokens=MAX_NEW)
    assert out.tokens == plain
    assert out.stats.rounds > 0


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_greedy_speculative_equals_plain_with_injected_proposals_at_every_acceptance(target, plain, impl):
    """Injected drafts reach every acceptance length; the context passes the drafter's window of 8."""
    drafter = tiny_dflash2(target)
    out = dflash_jax.Session(target, drafter, PROMPTS, max_new_tokens=MAX_NEW, impl=impl,
                             inject=inject_reference(plain, MAX_NEW, drafter.n_drafts)).run()
    assert out.tokens == plain
    hist = np.asarray(out.stats.accept_hist)
    assert hist[0] > 0 and hist[2:].sum() > 0 and out.stats.acceptance_length > 2.0, hist


def test_propose_keeps_the_argmax_without_codebooks_and_walks_with_them(target):
    drafter = tiny_dflash2(target, top_k=6)
    flat = drafter.replace(params=dict(drafter.params, selector_pred=0 * drafter.params["selector_pred"]))
    out = dflash_jax.propose(target, flat, PROMPTS)
    np.testing.assert_array_equal(out.tokens, np.argmax(np.asarray(out.logits), -1),
                                  err_msg="with a zero bilinear term the walk takes each slot's best logit")
    strong = drafter.replace(params=dict(drafter.params, selector_pred=30 * drafter.params["selector_pred"]))
    walked = dflash_jax.propose(target, strong, PROMPTS)
    assert not np.array_equal(walked.tokens, np.argmax(np.asarray(walked.logits), -1)), \
        "a strong bilinear term must move some drafts off the per-slot argmax"
    top = np.argsort(-np.asarray(walked.logits), axis=-1)[..., :6]
    assert all(t in top[b, k] for b in range(len(PROMPTS)) for k, t in enumerate(np.asarray(walked.tokens)[b])), \
        "every draft is one of its slot's top-K candidates"


# --- a checkpoint in the published layout -------------------------------------------------------------------


def test_random_checkpoint_with_the_real_tensor_names_round_trips_through_load_and_inspect(tmp_path, target,
                                                                                           capsys):
    real = set(json.loads((FIXTURES / "dflash2-safetensors-header.json").read_text())) - {"__metadata__"}
    tc = target.config
    cfg = dataclasses.replace(tiny_dflash2(target).config, num_layers=5, layer_window=(8,) * 5,
                              causal=(False,) * 5, target_layer_ids=(0, 1, 2, 0, 2))
    drafter = make_drafter(cfg, random_params(drafter_param_shapes(cfg), 3))
    write_drafter(tmp_path / "d2", drafter, dtype="float32")
    with safe_open(str(tmp_path / "d2" / "model.safetensors"), "np") as f:
        assert set(f.keys()) == real, "the written checkpoint holds exactly the published tensor names"
    config = json.loads((tmp_path / "d2" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["is_causal"] is False
    assert {"selector_rank", "selector_top_k", "conv_kernel_size", "conv_group_size"} <= set(config["dflash_config"])
    loaded = dflash_jax.load_drafter(tmp_path / "d2", target)
    assert isinstance(loaded, DFlash2Drafter) and loaded.config.family == "dflash2"
    flat = jax.tree_util.tree_flatten_with_path(drafter.params)[0]
    assert [p for p, _ in flat] == [p for p, _ in jax.tree_util.tree_flatten_with_path(loaded.params)[0]]
    for (path, want), got in zip(flat, jax.tree.leaves(loaded.params)):
        np.testing.assert_array_equal(got, want, err_msg=jax.tree_util.keystr(path))
    assert dflash_jax.generate(target, loaded, PROMPTS[:1], max_new_tokens=8).tokens == \
        dflash_jax.generate(target, None, PROMPTS[:1], max_new_tokens=8).tokens
    assert cli.main(["inspect", str(tmp_path / "d2")]) == 0
    out = capsys.readouterr().out
    assert "family: dflash2" in out and "harvest: dflash (draft rows 1..7)" in out
    assert f"selector: top 4 candidates, rank 4; dynamic conv: kernel 2, group size 8 ({tc.hidden_size // 8} " \
           "groups)" in out
