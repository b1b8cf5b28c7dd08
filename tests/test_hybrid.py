"""Hybrid targets (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) against transformers, their rollback, and lossless decoding.

The oracle for logits is external: transformers builds a random model of each family from a config, saves it,
and we load that folder with `load_target`. Rollback has its own oracle, the original's `CKPT_GATE` as a test:
after every round of a speculative run, the state `commit` selects from the per-position states must equal,
bit for bit, a replay of the kept prefix from the pre-verify state.
"""
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
from dflash_jax.io.checkpoints import write_target
from conftest import (
    assert_long_prompts_decode_as_the_uncached_forward,
    extend_commit,
    inject_reference,
    max_rel_err,
    prefill_commit,
    tiny_drafter,
)

VOCAB = 97
LAYERS = ["linear_attention", "full_attention", "linear_attention"]
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=1024, linear_conv_kernel_dim=4, linear_key_head_dim=8,
              linear_value_head_dim=12, linear_num_key_heads=2, linear_num_value_heads=4, layer_types=LAYERS)
EXPERTS = dict(num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48)
CONFIGS = {
    "qwen3_5": (transformers.Qwen3_5TextConfig, dict(intermediate_size=96, tie_word_embeddings=True)),
    "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, dict(num_experts_per_tok=2, **EXPERTS)),
    "qwen3_next": (transformers.Qwen3NextConfig, dict(
        intermediate_size=96, num_experts_per_tok=3, norm_topk_prob=False, mlp_only_layers=[1],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}, **EXPERTS)),
}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [1, 2, 3], list(range(12, 90))]
MAX_NEW = 20
ROUNDS, ND = 8, 7  # the replay test's rounds and drafts per round
PLAIN_NEW = ROUNDS * (ND + 1) + 1


def _perturb_norms(model):
    """Make norm weights non-trivial (transformers starts centred norms at zero) so a missing one would show."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))


@functools.cache
def _saved(name: str, tmp_root: str):
    cls, extra = CONFIGS[name]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cls(**COMMON, **extra)).float().eval()
    _perturb_norms(model)
    path = f"{tmp_root}/{name}"
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    """(transformers model, our Target, folder) for one config, with the same random weights."""
    model, path = _saved(request.param, str(tmp_path_factory.getbasetemp()))
    return model, dflash_jax.load_target(path, dtype="float32"), path


@pytest.fixture(scope="module")
def plain(pair):
    """Plain greedy continuations of PROMPTS, PLAIN_NEW tokens each (one compile; shorter runs are prefixes)."""
    return dflash_jax.generate(pair[1], None, PROMPTS, max_new_tokens=PLAIN_NEW).tokens


def _tokens(b, t, seed=0):
    return np.random.RandomState(seed).randint(0, VOCAB, (b, t))



def test_logits_and_taps_match_transformers_across_several_delta_rule_chunks(pair):
    model, target, _ = pair
    tokens = _tokens(2, 150)  # the uncached forward runs the chunked delta rule in 64-position chunks
    with torch.no_grad():
        out = model(torch.tensor(tokens), output_hidden_states=True)
    err = max_rel_err(target.full_logits(tokens), out.logits.numpy())
    assert err <= 1e-4, f"max relative logit error {err:.2e} > 1e-4"
    _, taps = jax.jit(target.forward, static_argnums=1)(jnp.asarray(tokens, jnp.int32), (0, 1))
    h = target.config.hidden_size
    for i in range(2):
        np.testing.assert_allclose(np.asarray(taps[..., i * h:(i + 1) * h]), out.hidden_states[i + 1].numpy(),
                                   atol=2e-5, rtol=1e-4, err_msg=f"tap of layer {i} must be hidden_states[{i + 1}]")


@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_next"])
def test_moe_routing_is_not_trivial(name, tmp_path_factory):
    """The parity configs' routers send different tokens to different experts, so parity covers routing."""
    model, _ = _saved(name, str(tmp_path_factory.getbasetemp()))
    with torch.no_grad():
        logits = model(torch.tensor(_tokens(1, 40)), output_router_logits=True).router_logits[0]
    chosen = {tuple(sorted(r)) for r in torch.topk(logits, CONFIGS[name][1]["num_experts_per_tok"]).indices.tolist()}
    assert len(chosen) > 5, f"tokens should pick different experts; picked {chosen}"


def test_prefill_then_partly_kept_blocks_equal_the_uncached_forward(pair):
    """A ragged prefill wider than a delta-rule chunk, then verify blocks of widths 1, 3 and 8 of which only a prefix is
    kept (the rest rolled back by `commit`): every kept position's logits equal the uncached forward's."""
    _, target, _ = pair
    tokens = _tokens(2, 200, seed=2)
    full = np.asarray(target.full_logits(tokens))
    tol = 1e-4 * np.abs(full).max()
    lengths = np.array([70, 9])
    state = target.init_state(2, 256)
    logits, state = prefill_commit(target, state, jnp.asarray(tokens[:, :128], jnp.int32),
                                   jnp.asarray(lengths, jnp.int32))
    for i, n in enumerate(lengths):
        np.testing.assert_allclose(np.asarray(logits[i, :n]), full[i, :n], atol=tol, rtol=0)
    pos = lengths.copy()
    for width in (1, 3, 8):
        block = np.stack([tokens[i, p:p + width] for i, p in enumerate(pos)])
        kept = np.array([width, max(width // 2, 1) if width % 3 else 0])
        logits, state = extend_commit(target, state, jnp.asarray(block, jnp.int32), jnp.asarray(pos, jnp.int32),
                                       jnp.asarray(kept, jnp.int32))
        for i, p in enumerate(pos):
            np.testing.assert_allclose(np.asarray(logits[i]), full[i, p:p + width], atol=tol, rtol=0,
                                       err_msg=f"width {width} row {i}")
        pos += kept
        np.testing.assert_array_equal(np.asarray(state.seq_len), pos)


def test_prompts_longer_than_a_prefill_chunk_decode_as_the_uncached_forward(tmp_path_factory):
    """Two 512-token prefill chunks carry the recurrent state across (`conftest`'s check of long ragged prompts)."""
    _, path = _saved("qwen3_next", str(tmp_path_factory.getbasetemp()))
    target = dflash_jax.load_target(path, dtype="float32")
    assert_long_prompts_decode_as_the_uncached_forward(target, tiny_drafter(target, 4, tap_ids=(0, 2)))


@functools.partial(jax.jit, static_argnames="impl")
def _round(target, state, block, start, impl="xla"):
    """A verify: greedy acceptance of `block[:, 1:]` against the target's argmax, and the state `commit` keeps."""
    h, _, verified, pending = target.extend(state, block, start, impl=impl)
    choice = jnp.argmax(target.logits(h), axis=-1)
    kept = 1 + jnp.sum(jnp.cumprod((block[:, 1:] == choice[:, :-1]).astype(jnp.int32), axis=-1), axis=-1)
    return kept, choice, target.commit(verified, pending, kept)


@functools.partial(jax.jit, static_argnames="impl")
def _replay(target, state, block, start, kept, impl="xla"):
    """The oracle: from the pre-verify state, run the block again keeping only its first `kept` positions."""
    _, _, state, pending = target.extend(state, block, start, impl=impl, valid=kept)
    return target.commit(state, pending, kept)


def _assert_same_state(a, b):
    """Bit-identical recurrent states and seq_len, and K/V at every committed position (rows past `seq_len` hold
    the rolled-back tail of a block, masked and overwritten later)."""
    np.testing.assert_array_equal(np.asarray(a.seq_len), np.asarray(b.seq_len))
    for name in ("conv", "ssm"):
        for i, (x, y) in enumerate(zip(getattr(a, name), getattr(b, name))):
            assert np.array_equal(np.asarray(x), np.asarray(y)), f"{name} state of linear layer {i} differs"
    held = np.arange(a.k[0].shape[1])[None, :] < np.asarray(a.seq_len)[:, None]
    for name in ("k", "v"):
        for i, (x, y) in enumerate(zip(getattr(a, name), getattr(b, name))):
            assert np.array_equal(np.asarray(x)[held], np.asarray(y)[held]), f"{name} of attention layer {i} differs"


def _assert_replay_oracle_holds(target, plain, impl):
    """The original's CKPT_GATE as a test: a speculative run at batch 3 with ragged prompts and proposals copied
    from the greedy continuation with a wrong token at a chosen slot (every acceptance length 0..nd occurs); after
    every round the committed state equals the replayed one bit for bit."""
    nd, rounds = ND, ROUNDS
    seqs = [p + t for p, t in zip(PROMPTS, plain)]
    state = target.init_state(3, 192)
    lengths = np.array([len(p) - 1 for p in PROMPTS])  # prefill all but the last prompt token (the first anchor)
    width = 128
    block = np.zeros((3, width), np.int32)
    for i, p in enumerate(PROMPTS):
        block[i, :lengths[i]] = p[:-1]
    _, state = prefill_commit(target, state, jnp.asarray(block), jnp.asarray(lengths, jnp.int32))
    pos, seen = lengths.copy(), set()
    for r in range(rounds):
        block = np.zeros((3, nd + 1), np.int32)
        for i, s in enumerate(seqs):
            block[i] = s[pos[i]:pos[i] + nd + 1]
            wrong = (r + 3 * i) % (nd + 1) + 1  # the first wrong draft; nd + 1: none
            if wrong <= nd:
                block[i, wrong] = (block[i, wrong] + 1) % VOCAB
        start = jnp.asarray(pos, jnp.int32)
        kept, _, committed = _round(target, state, jnp.asarray(block), start, impl)
        replayed = _replay(target, state, jnp.asarray(block), start, kept, impl)
        _assert_same_state(committed, replayed)
        seen.update((np.asarray(kept) - 1).tolist())
        state, pos = committed, pos + np.asarray(kept)
    assert seen == set(range(nd + 1)), f"acceptance lengths seen {sorted(seen)}, want 0..{nd}"


def test_replay_oracle_gives_bit_identical_states_after_every_round(pair, plain):
    _assert_replay_oracle_holds(pair[1], plain, "xla")


def test_replay_oracle_holds_with_the_kernels(tmp_path_factory):
    """The same with the Pallas kernels (interpreted here: the delta rule's, attention's and, on a GPU, the grouped
    experts'), on the MoE hybrid."""
    _, path = _saved("qwen3_5_moe", str(tmp_path_factory.getbasetemp()))
    target = dflash_jax.load_target(path, dtype="float32")
    plain = dflash_jax.generate(target, None, PROMPTS, max_new_tokens=PLAIN_NEW).tokens
    _assert_replay_oracle_holds(target, plain, "pallas")


def test_greedy_speculative_equals_plain_at_batch_one_and_three(pair, plain):
    """A random DFlash drafter (accepts almost nothing) and injected proposals (every acceptance length 0..nd),
    at batch 3 with ragged prompts and batch 1."""
    _, target, _ = pair
    plain = [row[:MAX_NEW] for row in plain]
    drafter = tiny_drafter(target, 8, tap_ids=(0, 2))
    nd = drafter.config.n_drafts
    assert dflash_jax.generate(target, drafter, PROMPTS, max_new_tokens=MAX_NEW).tokens == plain
    assert dflash_jax.generate(target, drafter, PROMPTS[2:], max_new_tokens=MAX_NEW).tokens == plain[2:]
    for prompts, ref in ((PROMPTS[2:], plain[2:]), (PROMPTS * 2, plain * 2)):
        out = dflash_jax.Session(target, drafter, prompts, max_new_tokens=MAX_NEW,
                                 inject=inject_reference(ref, MAX_NEW, nd, [1] * (nd + 1))).run()
        assert out.tokens == ref, "output must not depend on what was proposed"
    assert all(h > 0 for h in out.stats.accept_hist), f"every length 0..{nd}: {out.stats.accept_hist}"


def test_greedy_generate_equals_transformers_generate(pair, plain):
    model, _, _ = pair
    prompt, ours = PROMPTS[0], plain[0][:10]
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == ref


def test_written_target_reads_back_identically(pair, tmp_path):
    _, target, _ = pair
    write_target(tmp_path / "out", target, dtype="float32")
    again = dflash_jax.load_target(tmp_path / "out")
    assert again.config == target.config
    for a, b in zip(jax.tree.leaves(target.params), jax.tree.leaves(again.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _stacked(tensors: dict) -> dict:
    """A per-expert checkpoint's tensors with every layer's experts stacked as the published files store them."""
    fused, e = {}, EXPERTS["num_experts"]
    for name, x in tensors.items():
        if ".mlp.experts." not in name:
            fused[name] = x
        elif name.endswith(".0.gate_proj.weight"):
            prefix = name[:-len("0.gate_proj.weight")]
            fused[prefix + "gate_up_proj"] = np.stack([np.concatenate(
                [tensors[f"{prefix}{i}.gate_proj.weight"], tensors[f"{prefix}{i}.up_proj.weight"]]) for i in range(e)])
            fused[prefix + "down_proj"] = np.stack([tensors[f"{prefix}{i}.down_proj.weight"] for i in range(e)])
    return fused


def test_fused_expert_checkpoint_loads_like_the_per_expert_one(tmp_path_factory):
    """Published Qwen3.5-MoE files stack experts (`mlp.experts.gate_up_proj [E, 2I, H]`); transformers' own
    save writes one tensor per expert. Both load to the same target."""
    path, out = _saved("qwen3_5_moe", str(tmp_path_factory.getbasetemp()))[1], tmp_path_factory.mktemp("fused")
    save_file(_stacked(load_file(f"{path}/model.safetensors")), str(out / "model.safetensors"))
    (out / "config.json").write_text(open(f"{path}/config.json").read())
    a, b = dflash_jax.load_target(path), dflash_jax.load_target(out)
    assert b.config.expert_layout == "fused"
    tokens = _tokens(1, 12)
    np.testing.assert_array_equal(np.asarray(a.full_logits(tokens)), np.asarray(b.full_logits(tokens)))


def test_conditional_generation_checkpoint_runs_its_text_model_and_skips_the_vision_tower(tmp_path, capsys):
    text = dict(COMMON, intermediate_size=96)
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=1, temporal_patch_size=1, num_position_embeddings=16)
    torch.manual_seed(1)
    model = transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=text, vision_config=vision)).float().eval()
    _perturb_norms(model)
    model.save_pretrained(tmp_path)
    names = json.loads((tmp_path / "config.json").read_text())["architectures"]
    assert names == ["Qwen3_5ForConditionalGeneration"]
    with pytest.warns(UserWarning, match=r"skipping the vision tower \(\d+ tensors"):
        target = dflash_jax.load_target(tmp_path)
    assert cli.main(["inspect", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "layer types: 2 Gated DeltaNet, 1 gated attention (rotary on 4 of 16 channels)" in printed
    assert re.search(r"text model under: model\.language_model\. \(vision tower skipped: \d+ tensors\)", printed)
    assert target.config.text_prefix == "model.language_model."
    tokens = _tokens(2, 30, seed=5)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(tokens)).logits.numpy()
    err = max_rel_err(target.full_logits(tokens), ref)
    assert err <= 1e-4, f"max relative logit error {err:.2e} > 1e-4"
    write_target(tmp_path / "causal", target, dtype="float32")  # written back as the causal LM it runs
    again = dflash_jax.load_target(tmp_path / "causal")
    assert again.config.text_prefix == "model." and again.config.arch == "qwen3_5"
    np.testing.assert_array_equal(np.asarray(again.full_logits(tokens)), np.asarray(target.full_logits(tokens)))


def _hf(**changes):
    d = dict(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", intermediate_size=96, **COMMON,
             **EXPERTS, num_experts_per_tok=2)
    d.update(changes)
    return {k: v for k, v in d.items() if v is not None}


@pytest.mark.parametrize("changes, match", [
    (dict(layer_types=["linear_attention", "sliding_attention", "full_attention"]),
     r"layer_types has \['sliding_attention'\]; supported layer types: linear_attention, full_attention"),
    (dict(layer_types=["full_attention"] * 2), "layer_types has 2 entries but num_hidden_layers is 3"),
    (dict(attention_bias=True), "attention_bias: true; only bias-free"),
    (dict(attn_output_gate=False), "attn_output_gate: false; only gated attention"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok 9 exceeds num_experts 8"),
    (dict(linear_num_value_heads=3), "linear_num_value_heads 3 is not a multiple of linear_num_key_heads 2"),
    (dict(partial_rotary_factor=0.1), "odd rotary width"),
    (dict(partial_rotary_factor=1.5), r"partial_rotary_factor 1.5: expected a fraction"),
    (dict(mlp_only_layers="all"), "mlp_only_layers 'all'"),
    (dict(model_type="qwen3_5_text"), "contradictory target config"),
    (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4}), "rope type 'dynamic' is not supported"),
])
def test_unsupported_hybrid_configs_are_refused_by_name(changes, match):
    with pytest.raises(CheckpointError, match=match):
        target_config_from_hf(_hf(**changes))


def test_hybrid_census_reads_transformers_defaults():
    cfg = target_config_from_hf(_hf(layer_types=None, full_attention_interval=2, mlp_only_layers=[0]))
    assert cfg.layer_types == ("linear_attention", "full_attention", "linear_attention")
    assert cfg.moe_layers == (False, True, True) and cfg.rotary_dim == 4
    conditional = target_config_from_hf({"architectures": ["Qwen3_5MoeForConditionalGeneration"],
                                         "model_type": "qwen3_5_moe", "tie_word_embeddings": False,
                                         "text_config": dict(COMMON, **EXPERTS, model_type="qwen3_5_moe_text",
                                                             norm_topk_prob=False)})
    assert conditional.arch == "qwen3_5_moe" and conditional.text_prefix == "model.language_model."
    assert conditional.norm_topk_prob, "Qwen3.5-MoE always renormalises its top-k weights"


def test_the_memory_check_counts_one_blocks_per_position_states(monkeypatch):
    """`pending_bytes` is what `extend` really returns (beyond `start`), and generation whose caches fit but
    whose verify block's per-position states do not is refused before allocating, naming them."""
    from dflash_jax.decoding import common
    from conftest import tiny_hybrid

    target = tiny_hybrid()
    for batch, width in ((3, 8), (1, 1)):
        pending = jax.eval_shape(lambda: target.extend(target.init_state(batch, width),
                                                       jnp.zeros((batch, width), jnp.int32),
                                                       jnp.zeros((batch,), jnp.int32))[3])
        real = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(pending)) - 4 * batch
        assert target.pending_bytes(batch, width) == real
    drafter = tiny_drafter(target, 16, tap_ids=(0, 1))
    batch, capacity = 128, 64
    caches = common.cache_bytes(target, drafter, batch, capacity)
    assert target.pending_bytes(batch, 16) > 1 << 20
    monkeypatch.setattr(common, "free_memory", lambda device=None: (caches + 1000, "cuda:0"))
    with pytest.raises(ValueError, match=r"with [\d,]+ bytes of per-position states for one block, need"):
        dflash_jax.generate(target, drafter, [[1, 2, 3]] * batch, max_new_tokens=8, capacity=capacity)


def test_hostile_expert_tensors_are_refused_by_name(tmp_path_factory):
    _, path = _saved("qwen3_5_moe", str(tmp_path_factory.getbasetemp()))
    tensors = load_file(f"{path}/model.safetensors")
    config = open(f"{path}/config.json").read()
    missing = "model.layers.0.mlp.experts.3.up_proj.weight"
    wrong = "model.layers.2.mlp.experts.gate_up_proj"
    cases = {"missing": ({k: v for k, v in tensors.items() if k != missing},
                         rf"missing tensor\(s\): {re.escape(missing)} \(expected \[32, 64\]\)"),
             "stacked": (_stacked(tensors) | {wrong: np.zeros((7, 64, 64), np.float32)},
                         rf"{re.escape(wrong)} has shape \[7, 64, 64\], expected \[8, 64, 64\]"),
             "mixed": ({k: v for k, v in _stacked(tensors).items() if ".layers.0.mlp.experts." not in k}
                       | {k: v for k, v in tensors.items() if ".layers.0.mlp.experts." in k},
                       r"missing tensor\(s\): model\.layers\.0\.mlp\.experts\.gate_up_proj")}
    for name, (kept, match) in cases.items():
        out = tmp_path_factory.mktemp(name)
        save_file(kept, str(out / "model.safetensors"))
        (out / "config.json").write_text(config)
        with pytest.raises(CheckpointError, match=match):
            dflash_jax.load_target(out)
