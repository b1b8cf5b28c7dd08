"""Safetensors <-> pytrees: round trips, transformers compatibility, and every loading refusal."""
import dataclasses
import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from conftest import drafter_param_shapes, target_param_shapes
from dflash_jax.config import CheckpointError, DrafterConfig, RopeConfig, TargetConfig
from dflash_jax.io import checkpoints, names
from dflash_jax.io.checkpoints import drafter_census, drafter_tensor_shapes, make_drafter, make_target
from dflash_jax.io.safetensors import INDEX_FILE, SINGLE_FILE, _open
from dflash_jax.targets.dense import DenseTarget

QWEN3 = TargetConfig("qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope=RopeConfig(1e6),
                     max_position_embeddings=256, eos_token_ids=(3,), dtype="float32")
LLAMA = TargetConfig("llama", vocab_size=80, hidden_size=24, intermediate_size=40, num_layers=3, num_heads=6,
                     num_kv_heads=3, head_dim=4, rms_norm_eps=1e-5,
                     rope=RopeConfig(5e5, "llama3", (("factor", 8.0), ("high_freq_factor", 4.0),
                                                     ("low_freq_factor", 1.0),
                                                     ("original_max_position_embeddings", 64))),
                     tie_word_embeddings=True, attention_bias=True, max_position_embeddings=512,
                     eos_token_ids=(1, 2), dtype="float32")
DRAFTER = DrafterConfig("dflash", hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=2,
                        head_dim=12, rms_norm_eps=1e-6, rope=RopeConfig(1e6, "yarn", (("factor", 4.0),)),
                        block_size=4, mask_token_id=60, target_layer_ids=(0, 1), layer_window=(None, 8, 8),
                        causal=(False, True, True), vocab_size=64, num_target_layers=2,
                        final_logit_softcapping=30.0, output_multiplier=0.5)
NO_ENV = {}


def random_params(shapes, seed=0):
    """Random float32 leaves for a tree whose leaves are shapes (tuples)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s), jnp.float32), shapes,
                        is_leaf=lambda x: isinstance(x, tuple))


def assert_trees_equal(a, b, why):
    assert jax.tree.structure(a) == jax.tree.structure(b), why
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype, why
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=why)


def target_hf_tensors(cfg, params):
    """Hugging Face name -> float32 array (`[out, in]`) for a target pytree, as write_target stores them."""
    return names.hf_tensors(checkpoints.target_family(cfg).name_map(cfg), params, "float32")


def rewrite_tensors(path, edit):
    """Apply `edit(dict)` to the tensors of a single-file checkpoint and save them back."""
    file = os.path.join(path, SINGLE_FILE)
    with _open(file) as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def edit_config(path, edit):
    file = os.path.join(path, "config.json")
    with open(file) as fh:
        d = json.load(fh)
    edit(d)
    with open(file, "w") as fh:
        json.dump(d, fh)


# --- target round trips ------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [QWEN3, LLAMA], ids=["qwen3-untied", "llama-tied-bias-llama3rope"])
def test_write_target_then_read_target_is_exact_in_float32(tmp_path, cfg):
    params = random_params(target_param_shapes(cfg))
    checkpoints.write_target(tmp_path, make_target(cfg, params), dtype="float32")
    target = checkpoints.read_target(tmp_path)
    assert target.config == cfg, "config survives the transformers-4 form"
    assert_trees_equal(params, target.params, "layouts convert [in,out] <-> [out,in] and fuse/split exactly")


def test_sharded_checkpoint_reads_like_a_single_file(tmp_path):
    params = random_params(target_param_shapes(QWEN3))
    checkpoints.write_target(tmp_path, make_target(QWEN3, params), dtype="float32", shard_bytes=20_000)
    assert not (tmp_path / SINGLE_FILE).exists()
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 2, "several shards written"
    assert_trees_equal(params, checkpoints.read_target(tmp_path).params, "sharded load is the same pytree")


def test_bfloat16_checkpoint_keeps_its_dtype_or_converts_on_request(tmp_path):
    params = random_params(target_param_shapes(QWEN3))
    checkpoints.write_target(tmp_path, make_target(QWEN3, params))
    kept = checkpoints.read_target(tmp_path)
    assert kept.config.dtype == "bfloat16"
    assert {x.dtype for x in jax.tree.leaves(kept.params)} == {jnp.dtype(jnp.bfloat16)}
    as32 = checkpoints.read_target(tmp_path, dtype=jnp.float32)
    assert as32.config.dtype == "float32"
    rounded = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), params)
    assert_trees_equal(rounded, as32.params, "bf16 storage rounds once; f32 read is exact on that")


def test_write_target_refuses_params_that_do_not_match_the_config(tmp_path):
    params = random_params(target_param_shapes(QWEN3))
    params["layers_1"]["wo"] = jnp.zeros((64, 31))
    with pytest.raises(ValueError, match=r"\['layers_1'\]\['wo'\]: \(64, 31\) \(expected \(64, 32\)\)"):
        checkpoints.write_target(tmp_path, DenseTarget(QWEN3, params))


# --- transformers loads what we write ----------------------------------------------------


@pytest.mark.parametrize("cfg", [QWEN3, LLAMA], ids=["qwen3", "llama"])
def test_transformers_loads_write_target_output_with_our_tensors(tmp_path, cfg):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    params = random_params(target_param_shapes(cfg), seed=1)
    checkpoints.write_target(tmp_path, make_target(cfg, params), dtype="float32")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(model).__name__ == {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[cfg.arch]
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    ours = target_hf_tensors(cfg, params)
    if cfg.tie_word_embeddings:
        np.testing.assert_array_equal(state.pop("lm_head.weight"), ours["model.embed_tokens.weight"],
                                      err_msg="tied lm_head is the embedding")
    assert set(state) == set(ours), f"names differ: {set(state) ^ set(ours)}"
    for name, value in ours.items():
        np.testing.assert_array_equal(state[name], value, err_msg=name)
    rope = model.config.rope_parameters if hasattr(model.config, "rope_parameters") else model.config.rope_scaling
    assert (rope or {}).get("rope_type", "default") == cfg.rope.rope_type, "rope scaling understood by transformers"


def test_our_fused_layout_computes_what_transformers_projections_compute(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = dataclasses.replace(QWEN3, attention_bias=True)
    params = random_params(target_param_shapes(cfg), seed=2)
    checkpoints.write_target(tmp_path, make_target(cfg, params), dtype="float32")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    layer, ours = model.model.layers[1], params["layers_1"]
    x = np.random.default_rng(3).standard_normal((5, cfg.hidden_size)).astype(np.float32)
    q, kv = cfg.q_width, cfg.kv_width

    def theirs(module, inputs):
        with torch.no_grad():
            return module(torch.from_numpy(np.ascontiguousarray(inputs))).numpy()

    qkv = x @ np.asarray(ours["wqkv"]) + np.asarray(ours["bqkv"])
    attn = layer.self_attn
    for got, module, name in ((qkv[:, :q], attn.q_proj, "q"), (qkv[:, q:q + kv], attn.k_proj, "k"),
                              (qkv[:, q + kv:], attn.v_proj, "v")):
        np.testing.assert_allclose(got, theirs(module, x), rtol=1e-5, atol=1e-5, err_msg=f"wqkv is q|k|v: {name}")
    h = np.random.default_rng(4).standard_normal((5, q)).astype(np.float32)
    np.testing.assert_allclose(h @ np.asarray(ours["wo"]) + np.asarray(ours["bo"]), theirs(attn.o_proj, h),
                               rtol=1e-5, atol=1e-5, err_msg="wo is o_proj^T")
    gate_up = x @ np.asarray(ours["w_gate_up"])
    f = cfg.intermediate_size
    np.testing.assert_allclose(gate_up[:, :f], theirs(layer.mlp.gate_proj, x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gate_up[:, f:], theirs(layer.mlp.up_proj, x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(x @ np.asarray(params["lm_head"]), theirs(model.lm_head, x), rtol=1e-5, atol=1e-5,
                               err_msg="lm_head is stored [H, V]")


def test_read_target_reads_what_transformers_save_pretrained_writes(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=72, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, rope_theta=1e4)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(tmp_path)
    target = checkpoints.read_target(tmp_path, dtype="float32")
    cfg = target.config
    assert (cfg.arch, cfg.head_dim, cfg.rope.rope_type, cfg.rope.get("factor")) == ("llama", 8, "yarn", 4.0)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    ours = target_hf_tensors(cfg, target.params)
    for name, value in ours.items():
        np.testing.assert_array_equal(value, state[name], err_msg=name)


def test_sharded_index_naming_an_absent_shard_is_refused(tmp_path):
    checkpoints.write_target(tmp_path, make_target(QWEN3, random_params(target_param_shapes(QWEN3))),
                            dtype="float32", shard_bytes=20_000)
    shard = sorted(set(json.loads((tmp_path / INDEX_FILE).read_text())["weight_map"].values()))[1]
    (tmp_path / shard).unlink()
    with pytest.raises(CheckpointError, match=f"lists shard {shard}, which is not in"):
        checkpoints.read_target(tmp_path)


@pytest.mark.parametrize("escape", ["../outside.safetensors", "/etc/passwd", "sub/model.safetensors", ".."])
def test_sharded_index_naming_a_shard_outside_the_folder_is_refused(tmp_path, escape):
    """A checkpoint is untrusted: its index may name only plain files in its own folder."""
    folder = tmp_path / "ckpt"
    checkpoints.write_target(folder, make_target(QWEN3, random_params(target_param_shapes(QWEN3))),
                            dtype="float32", shard_bytes=20_000)
    index = json.loads((folder / INDEX_FILE).read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = escape
    (folder / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        checkpoints.read_target(folder)


# --- target refusals ---------------------------------------------------------------------


@pytest.fixture
def qwen3_dir(tmp_path):
    checkpoints.write_target(tmp_path, make_target(QWEN3, random_params(target_param_shapes(QWEN3))), dtype="float32")
    return tmp_path


def test_missing_tensor_is_refused_naming_it_and_its_shape(qwen3_dir):
    rewrite_tensors(qwen3_dir, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor.*model.layers.1.self_attn.k_norm.weight \(expected \[16\]\)"):
        checkpoints.read_target(qwen3_dir)


def test_unexpected_tensor_is_refused(qwen3_dir):
    rewrite_tensors(qwen3_dir, lambda t: t.update({"model.layers.2.mlp.gate_proj.weight": np.zeros((48, 32), np.float32)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor.*model.layers.2.mlp.gate_proj.weight.*qwen3 target"):
        checkpoints.read_target(qwen3_dir)


def test_shape_mismatch_is_refused_with_found_and_expected(qwen3_dir):
    rewrite_tensors(qwen3_dir, lambda t: t.update({"model.layers.0.mlp.down_proj.weight": np.zeros((32, 40), np.float32)}))
    with pytest.raises(CheckpointError, match=r"model.layers.0.mlp.down_proj.weight has shape \[32, 40\], expected \[32, 48\]"):
        checkpoints.read_target(qwen3_dir)


def test_corrupted_safetensors_header_is_refused_naming_the_file(qwen3_dir):
    file = qwen3_dir / SINGLE_FILE
    data = bytearray(file.read_bytes())
    data[8:12] = b"}{]["
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model.safetensors: unreadable safetensors header"):
        checkpoints.read_target(qwen3_dir)


def test_directory_without_weights_or_config_is_refused(tmp_path, qwen3_dir):
    (qwen3_dir / SINGLE_FILE).unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors and no model.safetensors.index.json"):
        checkpoints.read_target(qwen3_dir)
    with pytest.raises(CheckpointError, match="no config.json"):
        checkpoints.read_target(tmp_path / "nowhere")


def test_unsupported_architecture_directory_is_refused(qwen3_dir):
    edit_config(qwen3_dir, lambda d: d.update(architectures=["Gemma3ForCausalLM"], model_type="gemma3"))
    with pytest.raises(CheckpointError, match="unsupported target.*supported: Qwen3ForCausalLM"):
        checkpoints.read_target(qwen3_dir)


def test_rotary_inv_freq_buffers_and_tied_lm_head_are_ignored_like_transformers(tmp_path):
    cfg = dataclasses.replace(QWEN3, tie_word_embeddings=True)
    params = random_params(target_param_shapes(cfg))
    checkpoints.write_target(tmp_path, make_target(cfg, params), dtype="float32")
    rewrite_tensors(tmp_path, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32),
                                                  "lm_head.weight": np.ones((64, 32), np.float32)}))
    assert_trees_equal(params, checkpoints.read_target(tmp_path).params,
                       "ignorable tensors do not change the params")


# --- drafter -----------------------------------------------------------------------------


def test_write_drafter_then_read_drafter_is_exact_in_float32(tmp_path):
    params = random_params(drafter_param_shapes(DRAFTER))
    checkpoints.write_drafter(tmp_path, make_drafter(DRAFTER, params), dtype="float32")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["dflash_config"]["target_layer_ids"] == [0, 1]
    drafter = checkpoints.read_drafter(tmp_path, env=NO_ENV)
    assert dataclasses.replace(drafter.config, reasons=()) == DRAFTER, "every census field reads back"
    assert_trees_equal(params, drafter.params, "drafter layouts convert exactly")


def test_drafter_round_trip_with_uniform_is_causal_and_target_check(tmp_path):
    cfg = dataclasses.replace(DRAFTER, causal=(True,) * 3, vocab_size=None, layer_window=(None,) * 3)
    params = random_params(drafter_param_shapes(cfg))
    checkpoints.write_drafter(tmp_path, make_drafter(cfg, params), dtype="float32")
    assert json.loads((tmp_path / "config.json").read_text())["is_causal"] is True
    back = checkpoints.read_drafter(tmp_path, target_cfg=QWEN3, env=NO_ENV).config
    assert dataclasses.replace(back, reasons=()) == dataclasses.replace(cfg, vocab_size=64), "vocab from the target"


def test_read_drafter_converts_dtype(tmp_path):
    checkpoints.write_drafter(tmp_path, make_drafter(DRAFTER, random_params(drafter_param_shapes(DRAFTER))))
    kept = checkpoints.read_drafter(tmp_path, env=NO_ENV).params
    as32 = checkpoints.read_drafter(tmp_path, dtype="float32", env=NO_ENV).params
    assert {x.dtype for x in jax.tree.leaves(kept)} == {jnp.dtype(jnp.bfloat16)}, "dtype None keeps bf16"
    assert {x.dtype for x in jax.tree.leaves(as32)} == {jnp.dtype(jnp.float32)}


@pytest.fixture
def drafter_dir(tmp_path):
    checkpoints.write_drafter(tmp_path, make_drafter(DRAFTER, random_params(drafter_param_shapes(DRAFTER))), "float32")
    return tmp_path


def test_unknown_drafter_tensor_warns_and_is_recorded(drafter_dir):
    rewrite_tensors(drafter_dir, lambda t: t.update({"layers.0.self_attn.rotary.extra": np.ones(3, np.float32)}))
    with pytest.warns(UserWarning, match=r"unknown tensors ignored: \['layers.0.self_attn.rotary.extra'\]"):
        cfg = checkpoints.read_drafter(drafter_dir, env=NO_ENV).config
    assert cfg.warnings == ("unknown tensors ignored: ['layers.0.self_attn.rotary.extra']",)


def test_drafter_missing_tensor_and_shape_mismatch_are_refused(drafter_dir):
    rewrite_tensors(drafter_dir, lambda t: t.update({"fc.weight": np.zeros((32, 96), np.float32)}))
    with pytest.raises(CheckpointError, match=r"fc.weight has shape \[32, 96\], expected \[32, 64\]"):
        checkpoints.read_drafter(drafter_dir, env=NO_ENV)
    rewrite_tensors(drafter_dir, lambda t: t.pop("hidden_norm.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor.*hidden_norm.weight \(expected \[32\]\)"):
        checkpoints.read_drafter(drafter_dir, env=NO_ENV)


def test_drafter_against_a_mismatched_target_is_refused(drafter_dir):
    with pytest.raises(CheckpointError, match="drafter hidden_size 32 != target hidden_size 24"):
        checkpoints.read_drafter(drafter_dir, target_cfg=LLAMA, env=NO_ENV)


def test_dspark_strategy_directory_loads_as_a_dspark_drafter_with_the_shifted_harvest(drafter_dir):
    edit_config(drafter_dir, lambda d: d.update(architectures=["DSparkDraftModel"]))
    drafter = checkpoints.read_drafter(drafter_dir, env=NO_ENV)
    cfg = drafter.config
    assert type(drafter).__name__ == "DSparkDrafter"
    assert (cfg.family, cfg.harvest, cfg.n_drafts, cfg.heads) == ("dspark", "dspark", cfg.block_size, ())
    assert (cfg.verify_policy, cfg.markov) == ("ladder", False), "no heads: the ladder, and no Markov chain"


def test_dflash2_drafter_directory_with_hand_written_config_loads_as_its_family(tmp_path):
    config = {"architectures": ["DFlash2DraftModel"], "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
              "vocab_size": 64, "is_causal": False, "layer_types": ["sliding_attention"], "sliding_window": 8,
              "dflash_config": {"block_size": 4, "mask_token_id": 60, "target_layer_ids": [0], "selector_rank": 4,
                                "selector_top_k": 3, "conv_kernel_size": 2, "conv_group_size": 8}}
    tmp_path.joinpath("config.json").write_text(json.dumps(config))
    cfg = drafter_census(config, env=NO_ENV)
    save_file({n: np.zeros(shape, np.float32) for n, shape in drafter_tensor_shapes(cfg).items()},
              str(tmp_path / SINGLE_FILE), metadata={"format": "pt"})
    drafter = checkpoints.read_drafter(tmp_path, env=NO_ENV)
    assert type(drafter).__name__ == "DFlash2Drafter"
    assert (drafter.config.family, drafter.config.n_drafts, drafter.config.heads) == ("dflash2", 3, ("conv", "selector"))


def test_read_drafter_applies_overrides_and_the_harvest_environment(drafter_dir):
    cfg = checkpoints.read_drafter(drafter_dir, block_size=6, env={"DFLASH_HARVEST": "dspark"}).config
    assert (cfg.block_size, cfg.harvest, cfg.n_drafts) == (6, "dspark", 6)


def test_read_drafter_maps_z_lab_names_to_the_fused_layout(tmp_path):
    rng = np.random.default_rng(5)
    hf = {n: rng.standard_normal(s).astype(np.float32)
          for n, s in drafter_tensor_shapes(DRAFTER).items()}
    checkpoints.write_drafter(tmp_path, make_drafter(DRAFTER, random_params(drafter_param_shapes(DRAFTER))), "float32")
    save_file(hf, str(tmp_path / SINGLE_FILE), metadata={"format": "pt"})
    params = checkpoints.read_drafter(tmp_path, env=NO_ENV).params
    layer = params["layers_2"]
    np.testing.assert_array_equal(params["fc"], hf["fc.weight"].T, err_msg="fc stored [n_taps*H, H]")
    np.testing.assert_array_equal(layer["wq"], hf["layers.2.self_attn.q_proj.weight"].T)
    np.testing.assert_array_equal(layer["wkv"], np.concatenate([hf["layers.2.self_attn.k_proj.weight"].T,
                                                               hf["layers.2.self_attn.v_proj.weight"].T], axis=1),
                                  err_msg="wkv is k|v along the out axis")
    np.testing.assert_array_equal(layer["w_gate_up"], np.concatenate([hf["layers.2.mlp.gate_proj.weight"].T,
                                                                     hf["layers.2.mlp.up_proj.weight"].T], axis=1))
    np.testing.assert_array_equal(layer["w_down"], hf["layers.2.mlp.down_proj.weight"].T)
    np.testing.assert_array_equal(layer["k_norm"], hf["layers.2.self_attn.k_norm.weight"])


def test_write_drafter_refuses_what_the_format_cannot_hold(tmp_path):
    params = random_params(drafter_param_shapes(DRAFTER))

    def drafter(**changes):
        return make_drafter(dataclasses.replace(DRAFTER, **changes), params)

    with pytest.raises(ValueError, match="harvest 'dspark'"):
        checkpoints.write_drafter(tmp_path, drafter(harvest="dspark"))
    with pytest.raises(ValueError, match="different windows \\[8, 16\\]"):
        checkpoints.write_drafter(tmp_path, drafter(layer_window=(None, 8, 16)))
    with pytest.raises(ValueError, match="neither uniform nor the default rule"):
        checkpoints.write_drafter(tmp_path, drafter(causal=(True, False, True)))


def test_written_drafter_config_is_what_the_census_reads(drafter_dir):
    d = json.loads((drafter_dir / "config.json").read_text())
    cfg = drafter_census(d, env=NO_ENV)
    assert dataclasses.replace(cfg, reasons=()) == DRAFTER
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checkpoints.read_drafter(drafter_dir, env=NO_ENV)
