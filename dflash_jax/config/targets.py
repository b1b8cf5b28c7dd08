"""Target census: a Hugging Face `config.json` of a supported target -> a frozen `TargetConfig` (dense
Qwen3 / Llama) or `HybridConfig` (Qwen3.5, Qwen3.5-MoE, Qwen3-Next: Gated DeltaNet hybrids)."""
from __future__ import annotations

import dataclasses
from typing import Mapping

from dflash_jax.config.common import (
    AttentionWidths,
    CheckpointError,
    boolean,
    flag,
    head_dim,
    kv_heads,
    positive_int,
    positive_number,
    require,
    stored_dtype,
    string_list,
    token_ids,
)
from dflash_jax.config.rope import RopeConfig, rope_from_hf, rope_to_hf


@dataclasses.dataclass(frozen=True)
class TargetConfig(AttentionWidths):
    """A dense decoder target (Qwen3 or Llama). Field names follow docs/architecture.md."""

    arch: str  # 'qwen3' | 'llama' (dense); 'qwen3_5' | 'qwen3_5_moe' | 'qwen3_next' (HybridConfig)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 4096
    eos_token_ids: tuple = ()
    dtype: str = "float32"
    text_prefix: str = "model."  # where the decoder's tensors live ("model.language_model." in a multimodal file)

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalises q and k per head before RoPE; Llama does not."""
        return self.arch == "qwen3"



TARGET_ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}
_ARCH_OF_MODEL_TYPE = {arch: name for name, arch in TARGET_ARCHITECTURES.items()}


def _supported_targets() -> str:
    dense = [f"{name} (model_type {arch!r})" for name, arch in TARGET_ARCHITECTURES.items()]
    return ", ".join(dense + list(HYBRID_ARCHITECTURES))


def _target_arch(d: Mapping) -> str:
    archs = string_list(d.get("architectures"), "architectures")
    model_type = d.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise CheckpointError(f"model_type {model_type!r}: expected a string; supported: {_supported_targets()}")
    known = [TARGET_ARCHITECTURES[a] for a in archs if a in TARGET_ARCHITECTURES]
    if archs and not known or not archs and model_type not in _ARCH_OF_MODEL_TYPE:
        raise CheckpointError(
            f"unsupported target: architectures {archs!r}, model_type {model_type!r}; "
            f"supported: {_supported_targets()}"
        )
    arch = known[0] if known else model_type
    if model_type is not None and model_type != arch:
        raise CheckpointError(
            f"contradictory target config: architectures {archs!r} but model_type {model_type!r}; "
            f"supported: {_supported_targets()}"
        )
    return arch


def target_config_from_hf(d: Mapping) -> TargetConfig:
    """Census of a target's `config.json` (transformers 4 or 5 form): Qwen3ForCausalLM / LlamaForCausalLM, or
    one of the hybrids of `HYBRID_ARCHITECTURES` (`hybrid_config_from_hf`)."""
    archs = string_list(d.get("architectures"), "architectures")
    if any(a in HYBRID_ARCHITECTURES for a in archs) or not archs and d.get("model_type") in _HYBRID_MODEL_TYPES:
        return hybrid_config_from_hf(d)
    arch = _target_arch(d)
    if d.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act {d['hidden_act']!r}: only 'silu' (SwiGLU) is supported")
    if arch == "llama" and flag(d, "mlp_bias"):
        raise CheckpointError("Llama config has mlp_bias: true; only bias-free MLPs (mlp_bias: false) are supported")
    if arch == "qwen3":
        layer_types = string_list(d.get("layer_types"), "layer_types")
        if flag(d, "use_sliding_window") or any(t != "full_attention" for t in layer_types):
            raise CheckpointError(
                "Qwen3 config has use_sliding_window: true (or sliding layer_types); "
                "only full-attention Qwen3 targets are supported"
            )
    what = f"{arch} target"
    hidden = positive_int(require(d, "hidden_size", what), "hidden_size")
    heads = positive_int(require(d, "num_attention_heads", what), "num_attention_heads")
    positions = d.get("max_position_embeddings")
    positions = 4096 if positions is None else positive_int(positions, "max_position_embeddings")
    return TargetConfig(
        arch=arch,
        vocab_size=positive_int(require(d, "vocab_size", what), "vocab_size"),
        hidden_size=hidden,
        intermediate_size=positive_int(require(d, "intermediate_size", what), "intermediate_size"),
        num_layers=positive_int(require(d, "num_hidden_layers", what), "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv_heads(d, heads),
        head_dim=head_dim(d, hidden, heads),
        rms_norm_eps=positive_number(d.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
        rope=rope_from_hf(d),
        tie_word_embeddings=flag(d, "tie_word_embeddings"),
        attention_bias=flag(d, "attention_bias"),
        max_position_embeddings=positions,
        eos_token_ids=token_ids(d.get("eos_token_id"), "eos_token_id"),
        dtype=stored_dtype(d),
    )


def _shared_hf(cfg: TargetConfig, architecture: str, model_type: str) -> dict:
    """The `config.json` fields every target family writes."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "torch_dtype": cfg.dtype,
    }


def target_to_hf_config(cfg: TargetConfig) -> dict:
    """A `config.json` dict that transformers (4 and 5) and `target_config_from_hf` both read."""
    if isinstance(cfg, HybridConfig):
        return hybrid_to_hf_config(cfg)
    out = _shared_hf(cfg, _ARCH_OF_MODEL_TYPE[cfg.arch], cfg.arch)
    out.update(intermediate_size=cfg.intermediate_size, **rope_to_hf(cfg.rope))
    if cfg.arch == "llama":
        out["mlp_bias"] = False
    else:
        out["use_sliding_window"] = False
    if cfg.eos_token_ids:
        ids = list(cfg.eos_token_ids)
        out["eos_token_id"] = ids[0] if len(ids) == 1 else ids
    return out


def is_ignorable_target_tensor(name: str, cfg: TargetConfig) -> bool:
    """Tensors transformers itself ignores: rotary `inv_freq` buffers and a tied model's lm_head; for the
    hybrids also the multi-token-prediction head (`mtp.*`) and the vision tower (`is_vision_tensor`)."""
    if isinstance(cfg, HybridConfig) and (name.startswith("mtp.") or is_vision_tensor(name)):
        return True
    return name.endswith("rotary_emb.inv_freq") or (cfg.tie_word_embeddings and name == "lm_head.weight")


def is_vision_tensor(name: str) -> bool:
    """A tensor of a Qwen3.5 conditional-generation checkpoint's vision tower (skipped: we run the text model)."""
    return name.startswith(("model.visual.", "visual."))


# ---------------------------------------------------------------------------------------
# Hybrids: Gated DeltaNet linear attention interleaved with gated full attention.

HYBRID_ARCHITECTURES = {
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "Qwen3NextForCausalLM": "qwen3_next",
}
_HYBRID_MODEL_TYPES = {"qwen3_5_text": "qwen3_5", "qwen3_5": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe",
                       "qwen3_5_moe": "qwen3_5_moe", "qwen3_next": "qwen3_next"}
_CONDITIONAL = {"Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"}
LAYER_TYPES = ("linear_attention", "full_attention")
EXPERT_LAYOUTS = ("per_expert", "fused")


@dataclasses.dataclass(frozen=True)
class HybridConfig(TargetConfig):
    """A Gated DeltaNet hybrid (docs/architecture.md, "Hybrid targets"). `layer_types[i]` is
    'linear_attention' (Gated DeltaNet: conv and recurrent state) or 'full_attention' (gated, KV cache);
    `moe_layers[i]` marks a mixture-of-experts MLP. `rotary_dim` leading channels of each head are rotated.

    `text_prefix` is 'model.language_model.' in a conditional-generation checkpoint; `expert_layout` is how
    experts are stored: one tensor per expert ('per_expert', transformers' `save_pretrained`) or stacked
    ('fused', the published Qwen3.5 MoE files).
    """

    layer_types: tuple = ()
    rotary_dim: int = 0
    linear_conv_kernel: int = 4
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    moe_layers: tuple = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    expert_layout: str = "per_expert"

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: q | k | v of the linear-attention layers."""
        return 2 * self.key_dim + self.value_dim

    @property
    def linear_layers(self) -> tuple:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def attention_layers(self) -> tuple:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")


def _hybrid_arch(d: Mapping) -> tuple:
    """(arch, conditional) from `architectures` (else `model_type`), refusing a contradiction."""
    archs = [a for a in string_list(d.get("architectures"), "architectures") if a in HYBRID_ARCHITECTURES]
    model_type = d.get("model_type")
    arch = HYBRID_ARCHITECTURES[archs[0]] if archs else _HYBRID_MODEL_TYPES[model_type]
    if model_type is not None and _HYBRID_MODEL_TYPES.get(model_type) != arch:
        raise CheckpointError(f"contradictory target config: architectures {archs!r} but model_type {model_type!r}")
    conditional = archs[0] in _CONDITIONAL if archs else model_type in ("qwen3_5", "qwen3_5_moe")
    return arch, conditional


def _refuse_unsupported(t: Mapping, arch: str) -> None:
    """Refuse by name what a hybrid config may say that we do not implement."""
    if t.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act {t['hidden_act']!r}: only 'silu' (SwiGLU) is supported")
    if flag(t, "attention_bias"):
        raise CheckpointError(f"{arch} config has attention_bias: true; only bias-free attention is supported")
    if not boolean(t.get("attn_output_gate", True), "attn_output_gate"):
        raise CheckpointError(f"{arch} config has attn_output_gate: false; only gated attention is supported")
    if flag(t, "use_sliding_window"):
        raise CheckpointError(f"{arch} config has use_sliding_window: true; only full attention layers are supported")


def _layer_types(t: Mapping, n: int) -> tuple:
    """`layer_types`, or transformers' default: every `full_attention_interval`-th layer full attention."""
    given = string_list(t.get("layer_types"), "layer_types")
    if not given:
        interval = positive_int(t.get("full_attention_interval", 4), "full_attention_interval")
        return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n))
    bad = sorted({x for x in given if x not in LAYER_TYPES})
    if bad:
        raise CheckpointError(f"layer_types has {bad}; supported layer types: {', '.join(LAYER_TYPES)}")
    if len(given) != n:
        raise CheckpointError(f"layer_types has {len(given)} entries but num_hidden_layers is {n}")
    return tuple(given)


def _moe_fields(t: Mapping, arch: str, n: int) -> dict:
    """The experts of a Qwen3.5-MoE (every layer) or Qwen3-Next (`decoder_sparse_step`, `mlp_only_layers`)."""
    experts = 0 if arch == "qwen3_5" else int(t.get("num_experts", 512 if arch == "qwen3_next" else 256))
    if not experts:
        return {"moe_layers": (False,) * n}
    experts = positive_int(experts, "num_experts")
    top_k = positive_int(t.get("num_experts_per_tok", 10 if arch == "qwen3_next" else 8), "num_experts_per_tok")
    if top_k > experts:
        raise CheckpointError(f"num_experts_per_tok {top_k} exceeds num_experts {experts}")
    if arch == "qwen3_next":
        step = positive_int(t.get("decoder_sparse_step", 1), "decoder_sparse_step")
        dense = t.get("mlp_only_layers") or []
        if not isinstance(dense, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in dense):
            raise CheckpointError(f"mlp_only_layers {dense!r}: expected a list of layer indices")
        moe = tuple(i not in dense and (i + 1) % step == 0 for i in range(n))
    else:
        moe = (True,) * n
    return {
        "moe_layers": moe,
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": positive_int(t.get("moe_intermediate_size", 512), "moe_intermediate_size"),
        "shared_expert_intermediate_size": positive_int(t.get("shared_expert_intermediate_size", 512),
                                                        "shared_expert_intermediate_size"),
        # Qwen3.5-MoE's router always renormalises its top-k weights (transformers ignores the field there)
        "norm_topk_prob": arch == "qwen3_5_moe" or boolean(t.get("norm_topk_prob", True), "norm_topk_prob"),
    }


def _partial_rotary(t: Mapping) -> tuple:
    """(the config without the rotary-fraction keys, partial_rotary_factor). Qwen3.5's multimodal rope
    (`mrope_section`) rotates text positions, equal on all three axes, exactly as a 1-D rope does."""
    rp = t.get("rope_parameters")
    rope_keys = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")
    factor = (rp.get("partial_rotary_factor") if isinstance(rp, Mapping) else None) or t.get("partial_rotary_factor")
    stripped = {k: v for k, v in t.items() if k not in rope_keys}
    if isinstance(rp, Mapping):
        stripped["rope_parameters"] = {k: v for k, v in rp.items() if k not in rope_keys}
    factor = 0.25 if factor is None else positive_number(factor, "partial_rotary_factor")
    if factor > 1:
        raise CheckpointError(f"partial_rotary_factor {factor}: expected a fraction in (0, 1]")
    return stripped, factor


def hybrid_config_from_hf(d: Mapping) -> HybridConfig:
    """Census of a Qwen3.5 / Qwen3.5-MoE (causal LM or conditional generation, whose text model is read and
    vision tower skipped) or Qwen3-Next `config.json`. Defaults are transformers' for a missing field."""
    arch, conditional = _hybrid_arch(d)
    t = d
    if conditional:
        t = d.get("text_config")
        if not isinstance(t, Mapping):
            raise CheckpointError(f"{arch} conditional-generation config has no text_config object")
    _refuse_unsupported(t, arch)
    stripped, factor = _partial_rotary(t)
    what = f"{arch} target"
    hidden = positive_int(require(t, "hidden_size", what), "hidden_size")
    heads = positive_int(t.get("num_attention_heads", 16), "num_attention_heads")
    hd = positive_int(t.get("head_dim", 256), "head_dim")
    rotary = int(hd * factor)
    if rotary % 2:
        raise CheckpointError(f"partial_rotary_factor {factor} of head_dim {hd} gives an odd rotary width {rotary}")
    n = positive_int(require(t, "num_hidden_layers", what), "num_hidden_layers")
    nk = positive_int(t.get("linear_num_key_heads", 16), "linear_num_key_heads")
    nv = positive_int(t.get("linear_num_value_heads", 32), "linear_num_value_heads")
    if nv % nk:
        raise CheckpointError(f"linear_num_value_heads {nv} is not a multiple of linear_num_key_heads {nk}")
    tie = d.get("tie_word_embeddings", t.get("tie_word_embeddings"))
    eos = t.get("eos_token_id", d.get("eos_token_id"))
    return HybridConfig(
        arch=arch,
        vocab_size=positive_int(require(t, "vocab_size", what), "vocab_size"),
        hidden_size=hidden,
        intermediate_size=0 if arch == "qwen3_5_moe" else positive_int(require(t, "intermediate_size", what),
                                                                       "intermediate_size"),
        num_layers=n,
        num_heads=heads,
        num_kv_heads=kv_heads(t, heads),
        head_dim=hd,
        rms_norm_eps=positive_number(t.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
        rope=rope_from_hf(stripped),
        tie_word_embeddings=boolean(tie, "tie_word_embeddings"),
        max_position_embeddings=positive_int(t.get("max_position_embeddings", 32768), "max_position_embeddings"),
        eos_token_ids=token_ids(eos, "eos_token_id"),
        dtype=stored_dtype(d if conditional and (d.get("dtype") or d.get("torch_dtype")) else t),
        layer_types=_layer_types(t, n),
        rotary_dim=rotary,
        linear_conv_kernel=positive_int(t.get("linear_conv_kernel_dim", 4), "linear_conv_kernel_dim"),
        linear_num_key_heads=nk,
        linear_num_value_heads=nv,
        linear_key_head_dim=positive_int(t.get("linear_key_head_dim", 128), "linear_key_head_dim"),
        linear_value_head_dim=positive_int(t.get("linear_value_head_dim", 128), "linear_value_head_dim"),
        text_prefix="model.language_model." if conditional else "model.",
        **_moe_fields(t, arch, n),
    )


_HYBRID_CAUSAL = {"qwen3_5": ("Qwen3_5ForCausalLM", "qwen3_5_text"),
                  "qwen3_5_moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
                  "qwen3_next": ("Qwen3NextForCausalLM", "qwen3_next")}


def hybrid_to_hf_config(cfg: HybridConfig) -> dict:
    """The causal-LM `config.json` of a hybrid (what `write_target` writes, with tensors under `model.`)."""
    out = _shared_hf(cfg, *_HYBRID_CAUSAL[cfg.arch])
    scaling = rope_to_hf(cfg.rope)["rope_scaling"] or {}
    out.update({
        "rope_parameters": {"rope_type": cfg.rope.rope_type, "rope_theta": cfg.rope.theta,
                            "partial_rotary_factor": cfg.rotary_dim / cfg.head_dim, **scaling},
        "layer_types": list(cfg.layer_types),
        "linear_conv_kernel_dim": cfg.linear_conv_kernel,
        "linear_num_key_heads": cfg.linear_num_key_heads,
        "linear_num_value_heads": cfg.linear_num_value_heads,
        "linear_key_head_dim": cfg.linear_key_head_dim,
        "linear_value_head_dim": cfg.linear_value_head_dim,
    })
    if cfg.arch != "qwen3_5_moe":
        out["intermediate_size"] = cfg.intermediate_size
    if cfg.num_experts:
        out.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                   moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
                   shared_expert_intermediate_size=cfg.shared_expert_intermediate_size)
    if cfg.arch == "qwen3_next":
        out.update(decoder_sparse_step=1, mlp_only_layers=[i for i, moe in enumerate(cfg.moe_layers) if not moe])
    if cfg.eos_token_ids:
        ids = list(cfg.eos_token_ids)
        out["eos_token_id"] = ids[0] if len(ids) == 1 else ids
    return out
