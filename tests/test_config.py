"""Census of target and drafter configs (docs/architecture.md, "DFlash" and "Policy") and the host-side policy."""
import copy
import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.config import (
    CheckpointError,
    RopeConfig,
    TargetConfig,
    default_target_layer_ids,
    policy,
    rope_from_hf,
    target_config_from_hf,
)
from dflash_jax.io.checkpoints import drafter_census, drafter_tensor_shapes

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
NO_ENV = {}
PUBLISHED_DFLASH = {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}


def fixture(name):
    return json.loads((FIXTURES / name).read_text())


def dflash_config():
    """The Qwen3-8B DFlash template with the published dflash_config added."""
    d = fixture("qwen3-8b-dflash-template-config.json")
    d["dflash_config"] = dict(PUBLISHED_DFLASH)
    return d


def dflash2_header():
    return {k: v["shape"] for k, v in fixture("dflash2-safetensors-header.json").items() if k != "__metadata__"}


def qwen3_hf(**extra):
    d = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 128, "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "rope_scaling": None,
         "max_position_embeddings": 512, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
         "eos_token_id": 7}
    d.update(extra)
    return d


def llama_hf(**extra):
    d = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 96, "hidden_size": 48,
         "intermediate_size": 80, "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 2,
         "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 256,
         "tie_word_embeddings": True, "attention_bias": True, "mlp_bias": False, "eos_token_id": [1, 2]}
    d.update(extra)
    return d


LLAMA3_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


# --- target census -----------------------------------------------------------------------


def test_qwen3_target_census_reads_sizes_gqa_and_checkpoint_dtype():
    cfg = target_config_from_hf(qwen3_hf())
    assert (cfg.arch, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == ("qwen3", 2, 4, 2, 16)
    assert cfg.qk_norm and cfg.q_width == 64 and cfg.kv_width == 32, "Qwen3: q/k norm, head_dim given (not H/heads)"
    assert cfg.rope == RopeConfig(theta=1e6), "rope_scaling null means default rope"
    assert cfg.dtype == "bfloat16" and cfg.eos_token_ids == (7,), "torch_dtype and an int eos_token_id"


def test_llama_target_census_derives_head_dim_and_reads_tied_bias_and_eos_list():
    cfg = target_config_from_hf(llama_hf())
    assert cfg.head_dim == 8, "no head_dim: hidden_size // num_attention_heads"
    assert target_config_from_hf(llama_hf(head_dim=None)).head_dim == 8, "head_dim null is derived too"
    assert cfg.tie_word_embeddings and cfg.attention_bias and not cfg.qk_norm
    assert cfg.eos_token_ids == (1, 2) and cfg.dtype == "float32", "eos list kept; no dtype key means float32"


def test_llama3_rope_reads_the_same_in_transformers_4_and_5_forms():
    t4 = llama_hf(rope_scaling={"rope_type": "llama3", **LLAMA3_SCALING})
    t4_legacy = llama_hf(rope_scaling={"type": "llama3", **LLAMA3_SCALING})
    t5 = llama_hf(rope_theta=None, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3_SCALING})
    ropes = [target_config_from_hf(d).rope for d in (t4, t4_legacy, t5)]
    assert ropes[0] == ropes[1] == ropes[2], f"one rope whatever the form: {ropes}"
    assert ropes[0].rope_type == "llama3" and ropes[0].theta == 500000.0
    assert ropes[0].params == tuple(sorted(LLAMA3_SCALING.items())), "params: sorted (name, value) pairs"


def test_yarn_rope_keeps_every_scaling_parameter_present():
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
               "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 1.2, "mscale": 1.0,
               "mscale_all_dim": 0.5, "truncate": False}
    t5 = target_config_from_hf(qwen3_hf(rope_parameters={"rope_theta": 1e6, **scaling}))
    t4 = target_config_from_hf(qwen3_hf(rope_scaling=scaling))
    assert t5.rope == t4.rope and t5.rope.rope_type == "yarn"
    assert dict(t5.rope.params) == {k: v for k, v in scaling.items() if k != "rope_type"}
    assert t5.rope.get("truncate") is False, "truncate=false is a parameter, not an absent one"


def test_transformers_5_default_rope_parameters_and_dtype_key():
    cfg = target_config_from_hf(qwen3_hf(rope_theta=None, torch_dtype=None, dtype="float16",
                                         rope_parameters={"rope_type": "default", "rope_theta": 5e5}))
    assert cfg.rope == RopeConfig(theta=5e5) and cfg.dtype == "float16"


@pytest.mark.parametrize("scaling", [{"rope_type": "linear", "factor": 2.0}, {"type": "dynamic", "factor": 2.0}])
def test_unknown_rope_type_is_refused_naming_the_supported_ones(scaling):
    with pytest.raises(CheckpointError, match=r"rope type '(linear|dynamic)'.*default, llama3, yarn"):
        target_config_from_hf(llama_hf(rope_scaling=scaling))


def test_llama3_rope_without_its_parameters_is_refused():
    with pytest.raises(CheckpointError, match="llama3.*needs.*low_freq_factor"):
        rope_from_hf({"rope_theta": 1e4, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})


def test_unsupported_architecture_is_refused_listing_the_supported_ones():
    d = qwen3_hf(architectures=["MistralForCausalLM"], model_type="mistral")
    with pytest.raises(CheckpointError, match=r"unsupported target.*MistralForCausalLM.*Qwen3ForCausalLM.*LlamaForCausalLM"):
        target_config_from_hf(d)
    with pytest.raises(CheckpointError, match="unsupported target.*'gemma'.*supported"):
        target_config_from_hf(qwen3_hf(architectures=None, model_type="gemma"))
    assert target_config_from_hf(qwen3_hf(architectures=None)).arch == "qwen3", "model_type alone is enough"


def test_contradictory_architecture_and_model_type_is_refused():
    with pytest.raises(CheckpointError, match="contradictory.*model_type 'llama'"):
        target_config_from_hf(qwen3_hf(model_type="llama"))


def test_llama_mlp_bias_and_qwen3_sliding_window_are_refused():
    with pytest.raises(CheckpointError, match="mlp_bias: true"):
        target_config_from_hf(llama_hf(mlp_bias=True))
    with pytest.raises(CheckpointError, match="use_sliding_window: true"):
        target_config_from_hf(qwen3_hf(use_sliding_window=True))


def test_bad_sizes_are_refused_with_the_numbers():
    with pytest.raises(CheckpointError, match="num_attention_heads 4 is not a multiple of num_key_value_heads 3"):
        target_config_from_hf(qwen3_hf(num_key_value_heads=3))
    with pytest.raises(CheckpointError, match="has no 'hidden_size'"):
        target_config_from_hf({k: v for k, v in qwen3_hf().items() if k != "hidden_size"})
    with pytest.raises(CheckpointError, match="dtype 'float8_e4m3fn' is not supported; choices"):
        target_config_from_hf(qwen3_hf(torch_dtype="float8_e4m3fn"))


# --- drafter census: the real fixtures ---------------------------------------------------


def test_published_dflash_config_census():
    cfg = drafter_census(dflash_config(), env=NO_ENV)
    assert (cfg.family, cfg.harvest, cfg.block_size, cfg.n_drafts) == ("dflash", "dflash", 16, 15)
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33) and cfg.mask_token_id == 151669
    assert cfg.layer_window == (None,) * 5 and cfg.causal == (False,) * 5, "full layers, no is_causal: bidirectional"
    assert cfg.vocab_size == 151936 and cfg.num_target_layers == 36 and cfg.heads == ()
    assert cfg.reasons[0].startswith("family dflash: architectures ['DFlashDraftModel']"), cfg.reasons


def test_template_without_mask_token_id_is_refused():
    with pytest.raises(CheckpointError, match="no mask_token_id.*no default"):
        drafter_census(fixture("qwen3-8b-dflash-template-config.json"), env=NO_ENV)


def test_missing_target_layer_ids_take_the_first_reference_default():
    d = fixture("qwen3-8b-dflash-template-config.json")
    d["dflash_config"] = {"mask_token_id": 151669}
    cfg = drafter_census(d, env=NO_ENV)
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33), "N=36, n=5 -> round(1 + i*(N-4)/(n-1))"
    assert any("derived from num_target_layers 36" in r for r in cfg.reasons), cfg.reasons


def test_default_target_layer_ids_rule():
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(36, 1) == (18,) and default_target_layer_ids(27, 1) == (13,), "n=1: [N // 2]"
    assert default_target_layer_ids(10, 5) == (1, 2, 4, 6, 7), "Python round: 2.5 -> 2, 5.5 -> 6 (as the reference)"


def test_missing_target_layer_ids_use_the_target_when_num_target_layers_is_absent():
    d = dflash_config()
    del d["dflash_config"]["target_layer_ids"], d["num_target_layers"]
    with pytest.raises(CheckpointError, match="no target_layer_ids and no num_target_layers"):
        drafter_census(d, env=NO_ENV)
    target = TargetConfig("qwen3", 151936, 4096, 12288, 28, 32, 8, 128, 1e-6, RopeConfig(1e6))
    assert drafter_census(d, target=target, env=NO_ENV).target_layer_ids == (1, 7, 13, 19, 25)


def test_dspark_config_census_is_family_dspark_with_shifted_harvest():
    cfg = drafter_census(fixture("qwen3-8b-dspark-config.json"), env=NO_ENV)
    assert (cfg.family, cfg.harvest, cfg.first_row, cfg.n_drafts) == ("dspark", "dspark", 0, 16), \
        "projector_type dspark inside dflash_config: rows 0..b-1 are b drafts (§5)"
    assert cfg.heads == ("markov", "confidence") and cfg.markov_rank == 256
    assert cfg.confidence_in_dim == 4096 + 256, "confidence_head_with_markov: in_dim H + r"


def test_dflash2_config_and_real_header_census():
    cfg = drafter_census(fixture("dflash2-config.json"), dflash2_header(), env=NO_ENV)
    assert (cfg.family, cfg.harvest, cfg.n_drafts) == ("dflash2", "dflash", 15), "DFlash2 is mask-fill"
    assert cfg.q_width == 4096 != cfg.hidden_size == 6656, "attention width differs from hidden"
    assert cfg.layer_window == (2048,) * 5 and cfg.causal == (False,) * 5
    assert (cfg.selector_rank, cfg.selector_top_k, cfg.conv_kernel_size, cfg.conv_group_size) == (256, 16, 2, 16)
    assert (cfg.output_multiplier, cfg.final_logit_softcapping) == (0.19611613513818404, 20.0), "nested keys read"
    assert cfg.heads == ("conv", "selector") and cfg.warnings == ()
    assert set(drafter_tensor_shapes(cfg)) == set(dflash2_header()), "every real tensor name is expected, no more"


# --- DFlash2 refusals (§6), each on a minimally edited copy ------------------------------


def _dflash2_edit(edit):
    d = fixture("dflash2-config.json")
    edit(d)
    return d


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("is_causal"), "is_causal explicitly false.*got None"),
    (lambda d: d.update(is_causal=True), "is_causal explicitly false.*got True"),
    (lambda d: d["layer_types"].__setitem__(2, "full_attention"), "every layer to be sliding_attention"),
    (lambda d: d["dflash_config"].update(block_size=4096), "block_size 4096 exceeds the sliding window 2048"),
    (lambda d: d.update(rope_parameters={"rope_type": "yarn", "rope_theta": 5e5, "factor": 2.0}),
     "default rope; got rope type 'yarn'"),
    (lambda d: d.pop("dflash_config"), "no dflash_config object"),
    (lambda d: d["dflash_config"].pop("selector_rank"), "no 'selector_rank'"),
    (lambda d: d["dflash_config"].update(conv_group_size=10), "conv_group_size 10 does not divide hidden_size 6656"),
])
def test_dflash2_config_refusals(edit, message):
    with pytest.raises(CheckpointError, match=message):
        drafter_census(_dflash2_edit(edit), dflash2_header(), env=NO_ENV)


def test_dflash2_with_markov_or_confidence_tensors_is_refused():
    for extra in ({"markov_head.markov_w1.weight": [202048, 256], "markov_head.markov_w2.weight": [202048, 256]},
                  {"confidence_head.proj.weight": [1, 6656], "confidence_head.proj.bias": [1]}):
        with pytest.raises(CheckpointError, match="markov/confidence heads"):
            drafter_census(fixture("dflash2-config.json"), {**dflash2_header(), **extra}, env=NO_ENV)


def test_dflash2_tensor_shape_mismatch_and_missing_tensor_name_the_tensor():
    header = dflash2_header()
    header["layers.3.mlp_conv.kernel_projection.weight"] = [1024, 6656]
    with pytest.raises(CheckpointError, match=r"layers.3.mlp_conv.kernel_projection.weight has shape \[1024, 6656\], "
                                              r"expected \[1664, 6656\]"):
        drafter_census(fixture("dflash2-config.json"), header, env=NO_ENV)
    header = dflash2_header()
    del header["candidate_selector.successor_codebook"]
    with pytest.raises(CheckpointError, match=r"missing tensor.*successor_codebook \(expected \[202048, 256\]\)"):
        drafter_census(fixture("dflash2-config.json"), header, env=NO_ENV)


def test_dflash2_harvest_dspark_is_refused_from_keyword_or_environment():
    d = fixture("dflash2-config.json")
    with pytest.raises(CheckpointError, match="harvest 'dspark' \\(DFLASH_HARVEST\\) with a DFlash2 checkpoint"):
        drafter_census(d, dflash2_header(), env={"DFLASH_HARVEST": "dspark"})
    with pytest.raises(CheckpointError, match="harvest 'dspark' \\(keyword\\) with a DFlash2"):
        drafter_census(d, dflash2_header(), env=NO_ENV, harvest="dspark")
    assert drafter_census(d, dflash2_header(), env={"DFLASH_HARVEST": "dflash"}).harvest == "dflash"


# --- unknown tensors: warning for DFlash, error for DSpark/DFlash2 ------------------------


def test_unknown_tensor_is_a_warning_for_dflash_and_an_error_for_dspark_and_dflash2():
    d = dflash_config()
    shapes = drafter_tensor_shapes(drafter_census(d, env=NO_ENV))
    cfg = drafter_census(d, {**shapes, "extra.weight": [3]}, env=NO_ENV)
    assert cfg.warnings == ("unknown tensors ignored: ['extra.weight']",), "DFlash ignores unknown tensors loudly"
    spark = fixture("qwen3-8b-dspark-config.json")
    spark_shapes = drafter_tensor_shapes(drafter_census(spark, env=NO_ENV))
    assert drafter_census(spark, spark_shapes, env=NO_ENV).family == "dspark"
    with pytest.raises(CheckpointError, match=r"DSpark drafter checkpoint has unrecognized tensors \['extra.weight'\]"):
        drafter_census(spark, {**spark_shapes, "extra.weight": [3]}, env=NO_ENV)
    with pytest.raises(CheckpointError, match=r"DFlash2 drafter checkpoint has unrecognized tensors \['extra.weight'\]"):
        drafter_census(fixture("dflash2-config.json"), {**dflash2_header(), "extra.weight": [3]}, env=NO_ENV)


def test_markov_tensors_make_a_dflash_architecture_a_dspark_family():
    d = dflash_config()
    shapes = drafter_tensor_shapes(drafter_census(d, env=NO_ENV))
    shapes.update({"markov_head.markov_w1.weight": [151936, 64], "markov_head.markov_w2.weight": [151936, 64]})
    cfg = drafter_census(d, shapes, env=NO_ENV)
    assert cfg.family == "dspark" and cfg.markov_rank == 64, "heads decide the family"
    assert cfg.harvest == "dflash", "harvest follows §5 (architecture/projector), not the heads"


def test_dspark_confidence_in_dim_must_be_hidden_or_hidden_plus_rank():
    spark = fixture("qwen3-8b-dspark-config.json")
    shapes = drafter_tensor_shapes(drafter_census(spark, env=NO_ENV))
    shapes["confidence_head.proj.weight"] = [1, 4100]
    with pytest.raises(CheckpointError, match="in_dim 4100 matches neither hidden 4096 nor hidden\\+markov_rank"):
        drafter_census(spark, shapes, env=NO_ENV)


# --- layer layout ------------------------------------------------------------------------


def test_causality_default_rule_and_explicit_is_causal():
    d = dflash_config()
    d.update(layer_types=["sliding_attention", "full_attention"] * 2 + ["sliding_attention"], sliding_window=64)
    cfg = drafter_census(d, env=NO_ENV)
    assert cfg.layer_window == (64, None, 64, None, 64)
    assert cfg.causal == (True, False, True, False, True), "absent is_causal: sliding causal, full bidirectional"
    d["dflash_config"]["is_causal"] = False
    d["is_causal"] = True
    assert drafter_census(d, env=NO_ENV).causal == (False,) * 5, "is_causal applies to every layer; nested wins"


def test_layer_layout_refusals():
    d = dflash_config()
    d["layer_types"][1] = "sliding_attention"
    with pytest.raises(CheckpointError, match="sliding_attention layers but sliding_window is not set"):
        drafter_census(d, env=NO_ENV)
    d["layer_types"][1] = "chunked_attention"
    with pytest.raises(CheckpointError, match="'chunked_attention'.*choices: full_attention, sliding_attention"):
        drafter_census(d, env=NO_ENV)
    d["layer_types"] = d["layer_types"][:3]
    with pytest.raises(CheckpointError, match="layer_types has 3 entries for num_hidden_layers 5"):
        drafter_census(d, env=NO_ENV)


def test_nested_dflash_config_wins_over_top_level():
    d = dflash_config()
    d["dflash_config"].update(block_size=8, input_embedding_scale=2.0, final_logit_softcapping=30)
    cfg = drafter_census(d, env=NO_ENV)
    assert (cfg.block_size, cfg.input_embedding_scale, cfg.final_logit_softcapping) == (8, 2.0, 30.0)


def test_yarn_rope_drafter():
    d = dflash_config()
    d["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}
    assert drafter_census(d, env=NO_ENV).rope.get("factor") == 4.0


# --- harvest policy and overrides ---------------------------------------------------------


def test_harvest_resolution_keyword_beats_environment_beats_census():
    d = dflash_config()
    assert drafter_census(d, env={"DFLASH_HARVEST": ""}).harvest == "dflash", "empty variable counts as unset"
    cfg = drafter_census(d, env={"DFLASH_HARVEST": "dspark"})
    assert cfg.harvest == "dspark" and cfg.n_drafts == 16
    assert any("from DFLASH_HARVEST" in r for r in cfg.reasons), cfg.reasons
    assert drafter_census(d, env={"DFLASH_HARVEST": "dspark"}, harvest="dflash").harvest == "dflash"


def test_unknown_harvest_is_refused_naming_setting_value_and_choices():
    with pytest.raises(ValueError, match="DFLASH_HARVEST='shifted': unknown harvest; choices: dflash, dspark"):
        drafter_census(dflash_config(), env={"DFLASH_HARVEST": "shifted"})
    with pytest.raises(ValueError, match=r"harvest='mask-fill' \(keyword\): unknown harvest; choices: dflash, dspark"):
        drafter_census(dflash_config(), env=NO_ENV, harvest="mask-fill")


def test_harvest_reads_the_process_environment_by_default(monkeypatch):
    monkeypatch.setenv("DFLASH_HARVEST", "dspark")
    assert drafter_census(dflash_config()).harvest == "dspark"


def test_overrides_are_validated_and_unknown_keys_refused():
    cfg = drafter_census(dflash_config(), env=NO_ENV, block_size=8)
    assert cfg.block_size == 8 and cfg.n_drafts == 7
    assert "override block_size=8 (keyword)" in cfg.reasons
    with pytest.raises(CheckpointError, match="block_size 1: expected an integer >= 2"):
        drafter_census(dflash_config(), env=NO_ENV, block_size=1)
    with pytest.raises(CheckpointError, match=r"unknown drafter override\(s\) \['blocksize'\]; valid: .*block_size"):
        drafter_census(dflash_config(), env=NO_ENV, blocksize=8)
    with pytest.raises(CheckpointError, match="unknown drafter override.*'family'"):
        drafter_census(dflash_config(), env=NO_ENV, family="dspark")


# --- checks against the target -------------------------------------------------------------


def _qwen3_8b(**changes):
    base = TargetConfig("qwen3", 151936, 4096, 12288, 36, 32, 8, 128, 1e-6, RopeConfig(1e6))
    return dataclasses.replace(base, **changes)


def test_drafter_checked_against_its_target():
    assert drafter_census(dflash_config(), target=_qwen3_8b(), env=NO_ENV).warnings == ()
    with pytest.raises(CheckpointError, match="drafter hidden_size 4096 != target hidden_size 5120"):
        drafter_census(dflash_config(), target=_qwen3_8b(hidden_size=5120), env=NO_ENV)
    with pytest.raises(CheckpointError, match="drafter vocab_size 151936 != target vocab_size 151000"):
        drafter_census(dflash_config(), target=_qwen3_8b(vocab_size=151000), env=NO_ENV)
    d = dflash_config()
    del d["num_target_layers"]
    with pytest.raises(CheckpointError, match=r"target_layer_ids \[1, 9, 17, 25, 33\] name layers \[33\] "
                                              r"outside the target's layers 0..27"):
        drafter_census(d, target=_qwen3_8b(num_layers=28), env=NO_ENV)


def test_mask_token_id_must_be_inside_the_vocabulary():
    d = dflash_config()
    del d["vocab_size"]
    cfg = drafter_census(d, target=_qwen3_8b(), env=NO_ENV)
    assert cfg.vocab_size == 151936, "vocab_size comes from the target when the config lacks it"
    with pytest.raises(CheckpointError, match="mask_token_id 151669 is outside the vocabulary \\(151000\\)"):
        drafter_census(d, target=_qwen3_8b(vocab_size=151000), env=NO_ENV)
    d = dflash_config()
    d["vocab_size"] = 1000
    with pytest.raises(CheckpointError, match="mask_token_id 151669 is outside the vocabulary \\(1000\\)"):
        drafter_census(d, env=NO_ENV)


def test_num_target_layers_mismatch_is_a_warning():
    d = dflash_config()
    d["num_target_layers"] = 40
    cfg = drafter_census(d, target=_qwen3_8b(), env=NO_ENV)
    assert cfg.warnings == ("drafter num_target_layers 40 != target layers 36",)


def test_census_does_not_mutate_its_input():
    d = fixture("dflash2-config.json")
    before = copy.deepcopy(d)
    drafter_census(d, dflash2_header(), env=NO_ENV, block_size=8)
    assert d == before


# --- policy --------------------------------------------------------------------------------


def test_resolve_choice_order_and_refusal():
    choices = ("ladder", "confidence")
    assert policy.resolve_choice("vt", None, "ladder", choices, env={}) == "ladder"
    assert policy.resolve_choice("vt", None, "ladder", choices, env={"DFLASH_VT": "confidence"}) == "confidence"
    assert policy.resolve_choice("vt", "ladder", "confidence", choices, env={"DFLASH_VT": "confidence"}) == "ladder"
    with pytest.raises(ValueError, match="DFLASH_VT='fixed': unknown vt; choices: ladder, confidence"):
        policy.resolve_choice("vt", None, "ladder", choices, env={"DFLASH_VT": "fixed"})


def test_decode_loops_run_as_one_graph_unless_switched_off():
    options = policy.loop_compiler_options(env={})
    commands = options["xla_gpu_enable_command_buffer"].split(",")
    assert {"WHILE", "CONDITIONAL", "FUSION", "CUBLAS"} <= set(commands), "XLA's defaults plus the loop itself"
    assert policy.loop_compiler_options(env={"DFLASH_LOOP_GRAPH": "0"}) == {}, "0 leaves XLA's defaults"
    assert policy.loop_compiler_options(env={"DFLASH_LOOP_GRAPH": "1"}) == options
    with pytest.raises(ValueError, match="DFLASH_LOOP_GRAPH='yes': unknown loop_graph; choices: 0, 1"):
        policy.loop_compiler_options(env={"DFLASH_LOOP_GRAPH": "yes"})
    # XLA refuses a command it does not know when a program compiles: every name is one of this JAX's
    assert float(jax.jit(lambda x: x + 1, compiler_options=options)(1.0)) == 2.0
    with pytest.raises(Exception, match="not a valid enum value"):
        jax.jit(lambda x: x + 2, compiler_options={"xla_gpu_enable_command_buffer": "FUSION,LOOPS"})(1.0)


def test_clamp_vt_fixes_the_original_panic_below_three():
    assert [policy.clamp_vt(m + 2, 8) for m in range(8)] == [3, 3, 4, 5, 6, 7, 8, 8], "clamp(m+2, 3, cap)"
    assert policy.clamp_vt(2, 2) == 2 and policy.clamp_vt(9, 2) == 2, "cap 2 < 3: [min(3, cap), cap], no panic"
    out = policy.clamp_vt(jnp.array([0, 2, 5, 9]), 6)
    np.testing.assert_array_equal(out, [3, 3, 5, 6], err_msg="works on arrays inside jit")


def test_verify_cap_resolution_and_refusals():
    assert policy.verify_cap(None, 15, env={}) == 16, "default: every draft (nd + 1)"
    assert [policy.verify_cap(None, 15, b, env={}) for b in (1, 16, 63, 64, 256)] == [16, 16, 16, 6, 6], \
        "the measured default: a cap of 6 from batch 64"
    assert policy.verify_cap(None, 3, 64, env={}) == 4, "never past the block"
    assert policy.verify_cap(None, 15, 64, env={"DFLASH_VERIFY_T": "16"}) == 16, "a setting beats the default"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(policy, "VERIFY_CAP_BY_BATCH", ((32, 4), (64, 8)))
        assert [policy.verify_cap(None, 15, b, env={}) for b in (31, 32, 64)] == [16, 4, 8], \
            "a batch takes the cap of the last entry it reaches"
    assert policy.verify_cap(None, 15, env={"DFLASH_VERIFY_T": "8"}) == 8
    assert policy.verify_cap(4, 15, env={"DFLASH_VERIFY_T": "8"}) == 4, "keyword beats environment"
    for bad in ("1", "17", "eight"):
        with pytest.raises(ValueError, match=f"DFLASH_VERIFY_T='{bad}': verify cap must be an integer in 2..16"):
            policy.verify_cap(None, 15, env={"DFLASH_VERIFY_T": bad})


def test_prefill_chunk_resolution_and_refusals():
    assert policy.prefill_chunk(None, env={}) == policy.PREFILL_CHUNK == 512
    assert policy.prefill_chunk(None, env={"DFLASH_PREFILL_CHUNK": "2048"}) == 2048
    assert policy.prefill_chunk(64, env={"DFLASH_PREFILL_CHUNK": "2048"}) == 64, "keyword beats environment"
    for bad in ("32", "768", "big", "-512"):
        with pytest.raises(ValueError, match=f"DFLASH_PREFILL_CHUNK='{bad}': the prefill chunk must be a power of two"):
            policy.prefill_chunk(None, env={"DFLASH_PREFILL_CHUNK": bad})
    for bad in (0, 100, True, 512.0):
        with pytest.raises(ValueError, match=r"prefill_chunk \(keyword\)=.*power of two >= 64"):
            policy.prefill_chunk(bad, env={})


def test_a_prefill_of_several_chunks_takes_cudnn_where_decoding_takes_the_pallas_kernel():
    assert [policy.prefill_attention(impl, 2) for impl in policy.ATTENTION_IMPLS] == ["xla", "cudnn", "cudnn"]
    assert [policy.prefill_attention(impl, 1) for impl in policy.ATTENTION_IMPLS] == ["xla", "pallas", "cudnn"]


def test_attention_impl_defaults_to_pallas_on_gpu_only_and_honours_overrides():
    from dflash_jax.config import policy

    assert policy.attention_impl(env={}, backend="gpu") == "pallas"
    assert policy.attention_impl(env={}, backend="cpu") == "xla"
    assert policy.attention_impl(env={"DFLASH_ATTENTION": "xla"}, backend="gpu") == "xla"
    assert policy.attention_impl("pallas", env={"DFLASH_ATTENTION": "xla"}, backend="cpu") == "pallas"
    with pytest.raises(ValueError, match=r"DFLASH_ATTENTION='triton'.*choices: xla, pallas"):
        policy.attention_impl(env={"DFLASH_ATTENTION": "triton"}, backend="gpu")
