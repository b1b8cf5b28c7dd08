"""Targets against Hugging Face `transformers` (CPU torch), loaded from `save_pretrained` dirs.

The oracle is external: transformers builds a random model from a config, saves it, and we
load that directory with `load_target`; logits, taps, cached forwards and greedy decoding
must agree.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import dflash_jax
from dflash_jax.cache import init_kv
from dflash_jax.decoding import plain

VOCAB = 97
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)

CONFIGS = {
    "qwen3_gqa_untied": (transformers.Qwen3Config, dict(head_dim=24, tie_word_embeddings=False, rope_theta=10000.0,
                                                         attention_bias=True)),
    "qwen3_tied": (transformers.Qwen3Config, dict(head_dim=16, tie_word_embeddings=True, rope_theta=1e6)),
    "llama_llama3_rope": (transformers.LlamaConfig, dict(tie_word_embeddings=False, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32})),
    "qwen3_yarn": (transformers.Qwen3Config, dict(head_dim=16, tie_word_embeddings=False, rope_theta=10000.0,
                                                  rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                                "original_max_position_embeddings": 64})),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    """(transformers model, our Target) for one config, with the same random weights."""
    cls, extra = CONFIGS[request.param]
    torch.manual_seed(0)
    config = cls(**COMMON, **extra)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # make the norms non-trivial so a missing norm weight would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return model, dflash_jax.load_target(path, dtype="float32")


def _tokens(b, t, seed=0):
    return np.random.RandomState(seed).randint(0, VOCAB, (b, t))


def test_logits_match_transformers(pair):
    model, target = pair
    tokens = _tokens(2, 40)
    with torch.no_grad():
        ref = model(torch.tensor(tokens)).logits.numpy()
    ours = np.asarray(target.full_logits(tokens))
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    assert err <= 1e-4, f"max relative logit error {err:.2e} > 1e-4"


def test_taps_are_hidden_states_of_layer_id_plus_one(pair):
    model, target = pair
    tokens = _tokens(2, 17, seed=1)
    with torch.no_grad():
        hs = model(torch.tensor(tokens), output_hidden_states=True).hidden_states
    _, taps = target.forward(jnp.asarray(tokens, jnp.int32), tap_ids=(0, 2))
    h = target.config.hidden_size
    np.testing.assert_allclose(np.asarray(taps[..., :h]), hs[1].numpy(), atol=2e-5, rtol=1e-4,
                               err_msg="tap of layer 0 must be hidden_states[1]")
    # hidden_states[3] of transformers is after the final norm; layer 2's raw output is what we tap
    with torch.no_grad():
        raw = {}
        handle = model.model.layers[2].register_forward_hook(lambda m, i, o: raw.setdefault("x", o))
        model(torch.tensor(tokens))
        handle.remove()
    out = raw["x"][0] if isinstance(raw["x"], tuple) else raw["x"]
    np.testing.assert_allclose(np.asarray(taps[..., h:]), out.numpy(), atol=2e-5, rtol=1e-4,
                               err_msg="tap of layer 2 must be the output of decoder layer 2")


@jax.jit
def _extend_commit(target, cache, block, start, kept):
    """One `extend` (taps of layer 1) and its `commit`, compiled once per block width instead of op by op."""
    h, taps, cache, pending = target.extend(cache, block, start, (1,))
    return target.logits(h), taps, target.commit(cache, pending, kept)


def test_prefill_then_verify_blocks_equal_uncached_forward(pair):
    _, target = pair
    cfg = target.config
    tokens = _tokens(2, 48, seed=2)
    full_h, full_taps = jax.jit(target.forward, static_argnums=1)(jnp.asarray(tokens, jnp.int32), (1,))
    full_logits, full_taps = np.asarray(target.logits(full_h)), np.asarray(full_taps)
    cache = init_kv(2, 64, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, np.float32)
    # ragged prefill: row 1 is a shorter prompt (right-padded); it continues from its own length
    lengths = np.array([10, 6])
    logits, taps, cache = _extend_commit(target, cache, jnp.asarray(tokens[:, :10], jnp.int32), jnp.zeros(2, jnp.int32),
                                         jnp.asarray(lengths, jnp.int32))
    for i in range(2):
        n = lengths[i]
        np.testing.assert_allclose(np.asarray(logits[i, :n]), full_logits[i, :n], atol=1e-4 * np.abs(full_logits).max())
    np.testing.assert_array_equal(np.asarray(cache.seq_len), lengths)
    pos = lengths.copy()
    for width in range(1, 9):
        block = np.stack([tokens[i, pos[i]:pos[i] + width] for i in range(2)])
        logits, taps, cache = _extend_commit(target, cache, jnp.asarray(block, jnp.int32), jnp.asarray(pos, jnp.int32),
                                             jnp.full(2, width, jnp.int32))
        for i in range(2):
            ref = full_logits[i, pos[i]:pos[i] + width]
            np.testing.assert_allclose(np.asarray(logits[i]), ref, atol=1e-4 * np.abs(ref).max(), rtol=0,
                                       err_msg=f"verify width {width} row {i} differs from the uncached forward")
            np.testing.assert_allclose(np.asarray(taps[i]), full_taps[i, pos[i]:pos[i] + width], atol=1e-4, rtol=1e-4)
        pos += width


def test_greedy_generate_equals_transformers_generate(pair):
    model, target = pair
    prompts = [[5, 6, 7, 8, 9], [1, 2, 3], list(range(10, 31))]
    out = dflash_jax.generate(target, None, prompts, max_new_tokens=12)
    for prompt, ours in zip(prompts, out.tokens):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, len(prompt):].tolist()
        assert ours == ref, f"prompt of length {len(prompt)}: ours {ours} != transformers {ref}"


def test_second_call_with_same_shapes_does_not_recompile(pair):
    _, target = pair
    dflash_jax.generate(target, None, [[1, 2, 3]], max_new_tokens=4)
    sizes = plain.start._cache_size(), plain.run._cache_size()
    dflash_jax.generate(target, None, [[4, 5]], max_new_tokens=4)
    assert (plain.start._cache_size(), plain.run._cache_size()) == sizes, \
        "same static shapes must reuse the compiled program"


def test_stop_token_ends_row_and_is_kept(pair):
    _, target = pair
    full = dflash_jax.generate(target, None, [[3, 1, 4, 1, 5]], max_new_tokens=10).tokens[0]
    stop = full[4]
    cut = dflash_jax.generate(target, None, [[3, 1, 4, 1, 5]], max_new_tokens=10, stop_tokens=[stop]).tokens[0]
    assert cut == full[: full.index(stop) + 1], "output must end right after the first stop token"


def test_sampling_is_reproducible_and_changes_with_seed(pair):
    _, target = pair
    prompts = [[1, 2, 3], [1, 2, 3], [4, 5, 6, 7]]

    def run(seed):
        s = dflash_jax.Sampling(temperature=1.0, top_k=50, top_p=0.95, seed=seed)
        return dflash_jax.generate(target, None, prompts, max_new_tokens=16, sampling=s).tokens

    a, b, c = run(0), run(0), run(1)
    assert a == b, "same seed must give the same tokens"
    assert a != c, "a different seed must give different tokens"
    assert a[0] != a[1], "rows with the same prompt and seed must be independent streams"


@pytest.mark.parametrize("prompts, max_new, match", [
    ([[1, 2, VOCAB]], 4, "outside the vocabulary"),
    ([[1, 2, -1]], 4, "outside the vocabulary"),
    ([[]], 4, "empty"),
    ([[1.5, 2.0]], 4, "non-integer"),
    ([list(range(1, 50))], 250, "exceeds the model's max_position_embeddings"),
    ([[1, 2]], 0, "max_new_tokens must be a positive integer"),
    ("hello", 4, "list of token-id lists"),
])
def test_bad_input_is_refused(pair, prompts, max_new, match):
    _, target = pair
    with pytest.raises(ValueError, match=match):
        dflash_jax.generate(target, None, prompts, max_new_tokens=max_new)


def test_logits_refuses_out_of_range_ids(pair):
    _, target = pair
    with pytest.raises(ValueError, match="out of range"):
        target.full_logits([[0, VOCAB]])
