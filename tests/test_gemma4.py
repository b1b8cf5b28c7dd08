"""Gemma-4 targets against transformers, their state across the sliding window, and lossless decoding over them.

The oracle for logits is external: transformers builds a random model shaped like each published kind (E2B:
per-layer embeddings and KV sharing; 31B: k = v and wide global heads on full layers; 26B-A4B: experts beside
the MLP), saves it, and we load that folder with `load_target`. Prompts are longer than the sliding window.
"""
import dataclasses
import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

import dflash_jax
from dflash_jax import cli
from dflash_jax.config import CheckpointError, target_config_from_hf
from dflash_jax.config import check_fits_target, policy
from dflash_jax.io.checkpoints import make_drafter, write_drafter, write_target
from dflash_jax.targets import moe
from dflash_jax.train import init_drafter
from conftest import (
    assert_long_prompts_decode_as_the_uncached_forward,
    extend_commit,
    inject_reference,
    max_rel_err,
    prefill_commit,
    tiny_drafter,
)

VOCAB = 97
WINDOW = 6
S, F = "sliding_attention", "full_attention"
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, global_head_dim=16, sliding_window=WINDOW, max_position_embeddings=1024)
CONFIGS = {
    "e2b": dict(num_hidden_layers=4, layer_types=[S, F, S, F], num_kv_shared_layers=2, hidden_size_per_layer_input=8,
                vocab_size_per_layer_input=VOCAB, use_double_wide_mlp=True, final_logit_softcapping=30.0),
    "31b": dict(num_hidden_layers=3, layer_types=[S, S, F], num_global_key_value_heads=1, attention_k_eq_v=True,
                hidden_size_per_layer_input=0, tie_word_embeddings=False, final_logit_softcapping=3.0),
    "26b_a4b": dict(num_hidden_layers=3, layer_types=[S, S, F], num_global_key_value_heads=1, attention_k_eq_v=True,
                    hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=8, top_k_experts=2,
                    moe_intermediate_size=16),
}


def _perturb(model):
    """Norms, router scales and layer scalars (a saved buffer) away from their initial ones, so that a missing one
    would show."""
    with torch.no_grad():
        for name, x in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name or name.endswith(("router.scale", "per_expert_scale", "layer_scalar")):
                x.add_(0.1 * torch.randn_like(x))


@functools.cache
def _saved(name: str, tmp_root: str):
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**COMMON, **CONFIGS[name])).float().eval()
    _perturb(model)
    path = f"{tmp_root}/{name}"
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    """(transformers model, our Target, folder) for one config, with the same random weights."""
    model, path = _saved(request.param, str(tmp_path_factory.getbasetemp()))
    return model, dflash_jax.load_target(path, dtype="float32"), path


def _tokens(b, t, seed=0):
    return np.random.RandomState(seed).randint(0, VOCAB, (b, t))



@functools.partial(jax.jit, static_argnums=2)
def _logits_and_taps(target, tokens, tap_ids):
    h, taps = target.forward(tokens, tap_ids)
    return target.logits(h), taps


def test_logits_and_taps_match_transformers_past_the_sliding_window(pair):
    model, target, _ = pair
    tokens = _tokens(2, 4 * WINDOW)
    with torch.no_grad():
        out = model(torch.tensor(tokens), output_hidden_states=True)
    tap_ids = (0, target.config.num_layers - 2)  # transformers' hidden_states[-1] is the final-normed output
    logits, taps = _logits_and_taps(target, jnp.asarray(tokens, jnp.int32), tap_ids)
    err = max_rel_err(logits, out.logits.numpy())
    print(f"max relative logit error {err:.2e}")
    assert err <= 1e-4, f"max relative logit error {err:.2e} > 1e-4"
    h = target.config.hidden_size
    for j, i in enumerate(tap_ids):
        np.testing.assert_allclose(np.asarray(taps[..., j * h:(j + 1) * h]), out.hidden_states[i + 1].numpy(),
                                   atol=2e-5, rtol=1e-4, err_msg=f"tap of layer {i} must be hidden_states[{i + 1}]")


def test_the_parity_configs_take_every_path():
    """The window is shorter than the prompts, layers share K/V, experts are routed apart: parity covers them."""
    e2b = target_config_from_hf(transformers.Gemma4TextConfig(**COMMON, **CONFIGS["e2b"]).to_dict())
    assert e2b.kv_sources == (0, 1, 0, 1) and e2b.mlp_width(2) == 2 * e2b.mlp_width(1)
    big = target_config_from_hf(transformers.Gemma4TextConfig(**COMMON, **CONFIGS["31b"]).to_dict())
    assert (big.global_head_dim, big.num_global_kv_heads, big.head_dim, big.num_kv_heads) == (16, 1, 8, 2)
    assert big.full_rope.rope_type == "proportional" and big.attention_k_eq_v


def test_moe_routing_is_not_trivial(tmp_path_factory):
    model, _ = _saved("26b_a4b", str(tmp_path_factory.getbasetemp()))
    with torch.no_grad():
        out = model(torch.tensor(_tokens(1, 40)), output_router_logits=True)
    chosen = {tuple(sorted(r)) for r in torch.topk(out.router_logits[0], 2).indices.tolist()}
    assert len(chosen) > 5, f"tokens should pick different experts; picked {chosen}"


def test_written_target_reads_back_identically(pair, tmp_path):
    _, target, _ = pair
    write_target(tmp_path / "out", target, dtype="float32")
    again = dflash_jax.load_target(tmp_path / "out")
    assert again.config == target.config
    for a, b in zip(jax.tree.leaves(target.params), jax.tree.leaves(again.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    reread = transformers.Gemma4ForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = _tokens(2, 4 * WINDOW, seed=6)
    with torch.no_grad():
        ref = reread(torch.tensor(tokens)).logits.numpy()
    assert max_rel_err(target.full_logits(tokens), ref) <= 1e-4, "transformers must read what we write"


def test_conditional_generation_checkpoint_runs_its_text_model_and_skips_the_towers(tmp_path, capsys):
    text = dict(COMMON, **CONFIGS["e2b"])
    vision = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=8, patch_size=4, position_embedding_size=16, pooling_kernel_size=1)
    torch.manual_seed(1)
    model = transformers.Gemma4ForConditionalGeneration(
        transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None)).float().eval()
    _perturb(model)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Gemma4ForConditionalGeneration"]
    with pytest.warns(UserWarning, match=r"skipping the vision and audio towers \(\d+ tensors"):
        target = dflash_jax.load_target(tmp_path)
    assert target.config.text_prefix == "model.language_model."
    assert cli.main(["inspect", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "layer types: 2 sliding (window 6), 2 full" in printed
    assert re.search(r"text model under: model\.language_model\. \(vision and audio towers skipped: \d+ tensors\)",
                     printed)
    tokens = _tokens(2, 3 * WINDOW, seed=5)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(tokens)).logits.numpy()
    err = max_rel_err(target.full_logits(tokens), ref)
    assert err <= 1e-4, f"max relative logit error {err:.2e} > 1e-4"


def test_inspect_describes_every_feature(tmp_path_factory, capsys):
    for name, lines in {
        "e2b": ["layer types: 2 sliding (window 6), 2 full; the last 2 share K/V of layers [0, 1]",
                "heads: 4 query; sliding 2 kv x 8, full 2 kv x 16",
                "rope: sliding default (theta 10000), full proportional (theta 1e+06, partial_rotary_factor=0.25)",
                "per-layer embeddings: 8 wide, 97 rows", "mlp: 48 wide (96 on KV-shared layers), gelu_pytorch_tanh",
                "experts: none", "final logit softcap: 30"],
        "31b": ["heads: 4 query; sliding 2 kv x 8, full 1 kv x 16 (keys are values)", "per-layer embeddings: none"],
        "26b_a4b": ["experts: 8 beside the MLP (top 2, 16 wide)", "final logit softcap: none"],
    }.items():
        _, path = _saved(name, str(tmp_path_factory.getbasetemp()))
        assert cli.main(["inspect", path]) == 0
        printed = capsys.readouterr().out
        for line in lines:
            assert line in printed, f"{name}: {line!r} not in\n{printed}"


def _hf(**changes):
    d = transformers.Gemma4TextConfig(**COMMON, **CONFIGS["e2b"]).to_dict()
    d["architectures"] = ["Gemma4ForCausalLM"]
    d.update(changes)
    return d


@pytest.mark.parametrize("changes, match", [
    (dict(use_bidirectional_attention="all"), r"use_bidirectional_attention 'all'; only causal attention \(null\)"),
    (dict(hidden_activation="silu"), "hidden_activation 'silu': supported: gelu_pytorch_tanh"),
    (dict(attention_bias=True), "attention_bias: true; only bias-free attention"),
    (dict(layer_types=[S, "chunked_attention", S, F]),
     r"layer_types has \['chunked_attention'\]; supported layer types: sliding_attention, full_attention"),
    (dict(layer_types=[S, F]), "layer_types has 2 entries but num_hidden_layers is 4"),
    (dict(num_kv_shared_layers=4), r"num_kv_shared_layers 4: expected an integer in 0..3"),
    (dict(layer_types=[F, F, S, F]), r"shared \['sliding_attention'\] layers have no earlier layer of their type"),
    (dict(per_layer_config={"1": {"sliding_window": 3}}),
     r"per_layer_config\['1'\] .*supported per-layer overrides: head_dim, num_key_value_heads"),
    (dict(per_layer_config={"1": {"head_dim": 16}, "3": {"head_dim": 32}}),
     r"gives full_attention layers different head_dim / num_key_value_heads \[\(16, 2\), \(32, 2\)\]"),
    (dict(per_layer_config={"7": {"head_dim": 16}}), r"per_layer_config key '7': expected a layer index in 0..3"),
    (dict(per_layer_config={"1": {"num_key_value_heads": 3}, "3": {"num_key_value_heads": 3}}),
     r"num_attention_heads 4 is not a multiple of the full_attention layers' num_key_value_heads 3"),
    (dict(per_layer_config={"1": {"head_dim": 15}, "3": {"head_dim": 15}}), "full_attention head_dim 15: rope needs"),
    (dict(enable_moe_block=True, num_experts=4), "enable_moe_block: true config.json has no 'top_k_experts'"),
    (dict(enable_moe_block=True, num_experts=4, top_k_experts=5, moe_intermediate_size=8),
     "top_k_experts 5 exceeds num_experts 4"),
    (dict(vocab_size_per_layer_input=50), "vocab_size_per_layer_input 50 is below vocab_size 97"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
     "expected one object per layer type, with an entry for 'sliding_attention'"),
    (dict(rope_parameters={S: {"rope_type": "dynamic", "rope_theta": 1e4}, F: {"rope_type": "default"}}),
     "rope type 'dynamic' of sliding_attention layers is not supported; supported rope types: default, llama3, yarn, "
     "proportional"),
    (dict(rope_parameters={S: {"rope_type": "default", "rope_theta": 1e4},
                           F: {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 1.5}}),
     r"partial_rotary_factor 1.5: expected a fraction in \(0, 1\]"),
    (dict(rope_parameters={S: {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
                           F: {"rope_type": "proportional", "rope_theta": 1e6}}),
     r"partial_rotary_factor 0.5: only full rotary \(1.0\) is supported"),
    (dict(rope_parameters={S: {"rope_type": "default", "rope_theta": 1e4},
                           F: {"rope_type": "proportional", "rope_theta": 1e6, "beta_fast": 2}}),
     r"proportional rope of full_attention layers has \['beta_fast'\]; supported: rope_type, rope_theta"),
    (dict(final_logit_softcapping=-1.0), r"final_logit_softcapping -1.0: expected a finite number > 0"),
    (dict(model_type="gemma4"), "contradictory target config"),
])
def test_unsupported_gemma4_configs_are_refused_by_name(changes, match):
    with pytest.raises(CheckpointError, match=match):
        target_config_from_hf(_hf(**changes))


def test_gemma4_census_reads_transformers_defaults():
    """No layer types: five sliding layers to one full; no heads per layer: `global_head_dim` 512 on full layers;
    no rope: theta 1e4 on sliding layers, proportional rope (a quarter, theta 1e6) on full ones. A published
    config's `global_head_dim` and `num_global_key_value_heads` (with k = v) read as transformers reads them."""
    cfg = target_config_from_hf({"architectures": ["Gemma4ForCausalLM"], "num_hidden_layers": 12, "hidden_size": 64})
    assert cfg.layer_types == ((S,) * 5 + (F,)) * 2 and cfg.global_head_dim == 512 and cfg.head_dim == 256
    assert cfg.hidden_size_per_layer_input == 256 and cfg.tie_word_embeddings and cfg.eos_token_ids == (1,)
    assert cfg.rope.theta == 1e4 and cfg.full_rope.params == (("partial_rotary_factor", 0.25),)
    published = dict(COMMON, architectures=["Gemma4ForCausalLM"], num_hidden_layers=3, layer_types=[S, S, F],
                     attention_k_eq_v=True, global_head_dim=32, num_global_key_value_heads=1)
    cfg = target_config_from_hf(published)
    assert (cfg.global_head_dim, cfg.num_global_kv_heads) == (32, 1)
    hf = transformers.Gemma4TextConfig(**{k: v for k, v in published.items() if k != "architectures"})
    assert (hf.per_layer_config[2].head_dim, hf.per_layer_config[2].num_key_value_heads) == (32, 1)
    cfg = target_config_from_hf(dict(published, attention_k_eq_v=False))
    assert cfg.num_global_kv_heads == 2, "num_global_key_value_heads applies only with attention_k_eq_v"


def test_a_last_sliding_layer_runs_full_attention_as_in_transformers():
    with pytest.warns(UserWarning, match="the last layer runs full attention"):
        cfg = target_config_from_hf(_hf(layer_types=[S, F, S, S], num_kv_shared_layers=0))
    assert cfg.layer_types[-1] == F


def test_hostile_tensors_are_refused_by_name(tmp_path_factory):
    _, path = _saved("26b_a4b", str(tmp_path_factory.getbasetemp()))
    tensors = load_file(f"{path}/model.safetensors")
    config = open(f"{path}/config.json").read()
    cases = {
        "missing": ({k: v for k, v in tensors.items() if k != "model.layers.1.router.per_expert_scale"},
                    r"missing tensor\(s\): model\.layers\.1\.router\.per_expert_scale \(expected \[8\]\)"),
        "wide_global": (tensors | {"model.layers.2.self_attn.k_proj.weight": np.zeros((32, 32), np.float32)},
                        r"model\.layers\.2\.self_attn\.k_proj\.weight has shape \[32, 32\], expected \[16, 32\]"),
        "v_on_k_eq_v": (tensors | {"model.layers.2.self_attn.v_proj.weight": np.zeros((16, 32), np.float32)},
                        r"unexpected tensor\(s\) \['model\.layers\.2\.self_attn\.v_proj\.weight'\]"),
        "nan": (tensors | {"model.layers.0.layer_scalar": np.array([np.nan], np.float32)},
                r"model\.layers\.0\.layer_scalar.*(NaN|non-finite)"),
    }
    for name, (kept, match) in cases.items():
        out = tmp_path_factory.mktemp(name)
        save_file(kept, str(out / "model.safetensors"))
        (out / "config.json").write_text(config)
        with pytest.raises(CheckpointError, match=match):
            dflash_jax.load_target(out)


def test_kv_shared_layers_own_kv_tensors_are_skipped_as_transformers_skips_them(tmp_path_factory):
    """A checkpoint that still stores K/V projections for its KV-shared layers loads to the same target."""
    _, path = _saved("e2b", str(tmp_path_factory.getbasetemp()))
    tensors = load_file(f"{path}/model.safetensors")
    extra = {f"model.layers.{i}.self_attn.{n}": np.ones(s, np.float32) for i in (2, 3)
             for n, s in (("k_proj.weight", (16, 32)), ("v_proj.weight", (16, 32)), ("k_norm.weight", (8,)))}
    out = tmp_path_factory.mktemp("shared_kv")
    save_file(tensors | extra, str(out / "model.safetensors"))
    (out / "config.json").write_text(open(f"{path}/config.json").read())
    tokens = _tokens(1, 12)
    np.testing.assert_array_equal(np.asarray(dflash_jax.load_target(out).full_logits(tokens)),
                                  np.asarray(dflash_jax.load_target(path).full_logits(tokens)))


def _verifies_match_the_forward(target, state, tokens, full, lengths, kepts, width: int = 3) -> np.ndarray:
    """A ragged prefill of `lengths` (a 24-wide chunk), then verify blocks of `width` at each row's position of
    which `kepts[r]` are kept: every logit of the prefill and of the blocks equals the uncached forward's `full`.
    Returns the positions reached."""
    tol = 1e-4 * np.abs(full).max()
    lengths = np.asarray(lengths)
    logits, state = prefill_commit(target, state, jnp.asarray(tokens[:, :24], jnp.int32),
                                   jnp.asarray(lengths, jnp.int32))
    for i, n in enumerate(lengths):
        np.testing.assert_allclose(np.asarray(logits[i, :n]), full[i, :n], atol=tol, rtol=0)
    pos = lengths.copy()
    for r, kept in enumerate(kepts):
        block = np.stack([tokens[i, p:p + width] for i, p in enumerate(pos)])
        logits, state = extend_commit(target, state, jnp.asarray(block, jnp.int32), jnp.asarray(pos, jnp.int32),
                                       jnp.asarray(kept, jnp.int32))
        for i, p in enumerate(pos):
            np.testing.assert_allclose(np.asarray(logits[i]), full[i, p:p + width], atol=tol, rtol=0,
                                       err_msg=f"round {r} row {i} at {p}")
        pos += kept
        np.testing.assert_array_equal(np.asarray(state.seq_len), pos)
    return pos


def test_prefill_then_partly_kept_blocks_equal_the_uncached_forward(pair):
    """A ragged prefill (one row past the window, one inside it), then verify blocks of which only a prefix is
    kept (the rest rolled back by `commit`), the short row running past its window: every kept position's logits
    equal the uncached forward's."""
    _, target, _ = pair
    tokens = _tokens(2, 4 * WINDOW, seed=2)
    full = np.asarray(_logits_and_taps(target, jnp.asarray(tokens, jnp.int32), (0, target.config.num_layers - 2))[0])
    state = target.init_state(2, 32)
    pos = _verifies_match_the_forward(target, state, tokens, full, [2 * WINDOW + 1, WINDOW - 2],
                                      [[0, 3], [1, 0], [3, 2], [2, 3], [0, 1], [1, 3]])
    assert pos[1] > 2 * WINDOW, "the short row must run past its window during the verifies"


def test_kv_shared_layers_keep_no_cache_and_full_layers_their_wide_heads(pair):
    _, target, _ = pair
    c = target.config
    state = target.init_state(2, 40)
    assert len(state.k) == len(state.v) == c.first_shared_layer
    for i, (k, v) in enumerate(zip(state.k, state.v)):
        assert k.shape == v.shape == (2, 40, c.layer_kv_heads(i), c.layer_head_dim(i))
    assert len({id(x) for x in jax.tree.leaves(state)}) == len(jax.tree.leaves(state)), "distinct buffers"


def test_prompts_longer_than_a_prefill_chunk_decode_as_the_uncached_forward(tmp_path_factory):
    """Two 512-token prefill chunks, each far past the window (`conftest`'s check of long ragged prompts)."""
    _, path = _saved("e2b", str(tmp_path_factory.getbasetemp()))
    target = dflash_jax.load_target(path, dtype="float32")
    assert_long_prompts_decode_as_the_uncached_forward(target, tiny_drafter(target, 4, tap_ids=(0, 2)))


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [1, 2, 3], list(range(12, 40))]  # ragged, two of them longer than the window
MAX_NEW = 16


@pytest.fixture(scope="module")
def e2b(tmp_path_factory):
    """(transformers model, our Target, a random z-lab DFlash drafter written and read back, plain greedy tokens of
    PROMPTS): the E2B-like target, whose state has sliding, full and KV-shared layers."""
    model, path = _saved("e2b", str(tmp_path_factory.getbasetemp()))
    target = dflash_jax.load_target(path, dtype="float32")
    cfg, params = init_drafter(target.config, num_layers=2, block_size=8, mask_token_id=VOCAB - 1,
                               target_layer_ids=(0, 3), seed=3)
    folder = tmp_path_factory.mktemp("drafter")
    write_drafter(folder / "d", make_drafter(cfg, params), dtype="float32")
    drafter = dflash_jax.load_drafter(folder / "d", target)
    return model, target, drafter, dflash_jax.generate(target, None, PROMPTS, max_new_tokens=MAX_NEW).tokens


def test_greedy_generate_equals_transformers_generate(e2b):
    """Plain decoding (a cached prefill, then one-token extends past the window) against transformers' own."""
    model, _, _, plain = e2b
    prompt = PROMPTS[2]
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(prompt):].tolist()
    assert plain[2] == ref


def test_a_zlab_dflash_drafter_fits_gemma4_and_is_refused_on_another_width(e2b, tmp_path):
    """`init_drafter` sizes a drafter from the Gemma-4 config (its hidden size, sliding heads and rope); the census
    refuses one trained for another hidden size, naming both."""
    _, target, drafter, _ = e2b
    c = drafter.config
    assert (c.hidden_size, c.num_heads, c.head_dim, c.vocab_size) == (32, 4, 8, VOCAB)
    assert c.target_layer_ids == (0, 3) and check_fits_target(c, target.config) == ()
    with pytest.raises(CheckpointError, match="drafter hidden_size 32 != target hidden_size 64"):
        check_fits_target(c, dataclasses.replace(target.config, hidden_size=64))


def test_greedy_speculative_equals_plain_at_batch_one_and_three(e2b):
    """The random z-lab drafter (accepts almost nothing) at batch 3 with ragged prompts, and injected proposals
    (every acceptance length 0..nd) at batch 1 and 3: verifies cross the window and are rolled back by `commit`."""
    _, target, drafter, plain = e2b
    nd = drafter.config.n_drafts
    assert dflash_jax.generate(target, drafter, PROMPTS, max_new_tokens=MAX_NEW).tokens == plain
    hist = np.zeros(nd + 1, int)
    for prompts, ref in ((PROMPTS[2:], plain[2:]), (PROMPTS, plain)):
        out = dflash_jax.Session(target, drafter, prompts, max_new_tokens=MAX_NEW,
                                 inject=inject_reference(ref, MAX_NEW, nd, [1] * (nd + 1))).run()
        assert out.tokens == ref, "output must not depend on what was proposed"
        hist += np.asarray(out.stats.accept_hist)
    assert all(hist > 0), f"every length 0..{nd}: {hist}"


def test_a_ring_cache_decodes_as_the_uncached_forward_through_many_wraps(tmp_path_factory, monkeypatch):
    """Sliding layers in a ring of window + 4 slots: a prefill wider than the ring (only the last kept positions
    are written), then partly kept verifies as above, each row wrapping around the ring several times."""
    monkeypatch.setattr(policy, "RING_SLACK", 4)
    _, path = _saved("e2b", str(tmp_path_factory.getbasetemp()))
    target = dflash_jax.load_target(path, dtype="float32").replace(sliding_cache="ring")
    state = target.init_state(2, 64)
    c = target.config
    assert [k.shape[1] for k in state.k] == [64 if c.is_full(i) else WINDOW + 4 for i in range(len(state.k))]
    tokens = _tokens(2, 64, seed=7)
    full = np.asarray(target.full_logits(tokens))
    pos = _verifies_match_the_forward(target, state, tokens, full, [3 * WINDOW + 1, WINDOW - 2],
                                      [[(r * 2) % 4, (r + 1) % 4] for r in range(14)])
    assert pos.min() > 2 * (WINDOW + 4), f"each row must wrap the ring at least twice; reached {pos}"


def test_ring_and_full_caches_give_identical_tokens(e2b, monkeypatch):
    """Speculative decoding over a ring (every acceptance length 0..nd, so partial accepts roll back over slots
    of positions that wrapped past the window) gives the tokens of plain decoding over full caches."""
    monkeypatch.setattr(policy, "RING_SLACK", 8)
    _, target, drafter, plain = e2b
    ring = target.replace(sliding_cache="ring")
    nd = drafter.config.n_drafts
    out = dflash_jax.Session(ring, drafter, PROMPTS, max_new_tokens=MAX_NEW,
                             inject=inject_reference(plain, MAX_NEW, nd, [1] * (nd + 1))).run()
    assert out.tokens == plain
    assert all(np.asarray(out.stats.accept_hist) > 0), out.stats.accept_hist


def test_a_ring_refuses_a_block_that_could_overwrite_what_later_queries_see(tmp_path_factory, monkeypatch):
    monkeypatch.setattr(policy, "RING_SLACK", 4)
    _, path = _saved("e2b", str(tmp_path_factory.getbasetemp()))
    target = dflash_jax.load_target(path, dtype="float32").replace(sliding_cache="ring")
    state = target.init_state(1, 64)
    with pytest.raises(ValueError, match=r"a block of 6 positions over a ring of 10 slots \(window 6\) could "
                                         r"overwrite .* at most 5 positions, or sliding_cache='full'"):
        target.extend(state, jnp.zeros((1, 6), jnp.int32), jnp.zeros((1,), jnp.int32))
    with pytest.raises(ValueError, match=r"sliding_cache='circular' \(keyword\): unknown sliding_cache; choices: "
                                         "full, ring"):
        target.replace(sliding_cache="circular").init_state(1, 64)


def test_the_sliding_cache_resolves_keyword_then_environment_then_full(tmp_path_factory, monkeypatch):
    target = dflash_jax.load_target(_saved("31b", str(tmp_path_factory.getbasetemp()))[1])
    assert {k.shape[1] for k in target.init_state(1, 100).k} == {100}
    monkeypatch.setenv("DFLASH_SLIDING_CACHE", "ring")
    assert [k.shape[1] for k in target.init_state(1, 100).k] == [WINDOW + policy.RING_SLACK] * 2 + [100]
    assert {k.shape[1] for k in target.replace(sliding_cache="full").init_state(1, 100).k} == {100}
    monkeypatch.setenv("DFLASH_SLIDING_CACHE", "rings")
    with pytest.raises(ValueError, match=r"DFLASH_SLIDING_CACHE='rings': unknown sliding_cache; choices: full, ring"):
        target.init_state(1, 100)


def test_gemma4_experts_take_a_tanh_gelu_gate_in_both_impls_and_refuse_another():
    """The routed experts' GeGLU (`moe.experts(activation="gelu_tanh")`): the GPU's `ragged_dot` form equals the
    gather the CPU runs (parity covers the gather), and an unknown activation is refused naming the choices."""
    rng = np.random.default_rng(0)
    x, w_gate_up, w_down = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((5, 8), (4, 8, 12), (4, 6, 8)))
    idx = jnp.asarray(rng.integers(0, 4, (5, 2)), jnp.int32)
    weights = jnp.asarray(rng.random((5, 2)), jnp.float32)
    gather = moe.experts(x, weights, idx, w_gate_up, w_down, impl="gather", activation="gelu_tanh")
    np.testing.assert_allclose(np.asarray(moe.experts(x, weights, idx, w_gate_up, w_down, impl="ragged",
                                                      activation="gelu_tanh")), np.asarray(gather), rtol=1e-5)
    assert not np.allclose(np.asarray(gather), np.asarray(moe.experts(x, weights, idx, w_gate_up, w_down, "gather")))
    with pytest.raises(ValueError, match=r"activation='relu' is not supported; choose one of \('silu', 'gelu_tanh'\)"):
        moe.experts(x, weights, idx, w_gate_up, w_down, impl="gather", activation="relu")
