"""Target census: a Hugging Face `config.json` of a supported target -> a frozen `TargetConfig` (dense
Qwen3 / Llama), `HybridConfig` (Qwen3.5, Qwen3.5-MoE, Qwen3-Next: Gated DeltaNet hybrids) or `Gemma4Config`."""
from __future__ import annotations

import dataclasses
import warnings
from typing import Mapping, Optional

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
from dflash_jax.config.rope import ROPE_TYPES, RopeConfig, rope_from_hf, rope_to_hf


@dataclasses.dataclass(frozen=True)
class TargetConfig(AttentionWidths):
    """A dense decoder target (Qwen3 or Llama). Field names follow docs/architecture.md."""

    arch: str  # 'qwen3' | 'llama' (dense); 'qwen3_5' | 'qwen3_5_moe' | 'qwen3_next' (HybridConfig); 'gemma4'
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
    return ", ".join(dense + list(HYBRID_ARCHITECTURES) + list(GEMMA4_ARCHITECTURES))


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
    one of the hybrids of `HYBRID_ARCHITECTURES` (`hybrid_config_from_hf`), or Gemma-4 (`gemma4_config_from_hf`)."""
    archs = string_list(d.get("architectures"), "architectures")
    if any(a in GEMMA4_ARCHITECTURES for a in archs) or not archs and d.get("model_type") in _GEMMA4_MODEL_TYPES:
        return gemma4_config_from_hf(d)
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
    if isinstance(cfg, Gemma4Config):
        return gemma4_to_hf_config(cfg)
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
    hybrids also the multi-token-prediction head (`mtp.*`) and the vision tower (`is_vision_tensor`); for
    Gemma-4 the vision and audio towers and a KV-shared layer's own K/V projections and norms."""
    if isinstance(cfg, HybridConfig) and (name.startswith("mtp.") or is_vision_tensor(name)):
        return True
    if isinstance(cfg, Gemma4Config) and (name.startswith(GEMMA4_TOWERS) or _is_unused_kv_tensor(name, cfg)):
        return True
    return name.endswith("rotary_emb.inv_freq") or (cfg.tie_word_embeddings and name == "lm_head.weight")


_QWEN_VISION = ("model.visual.", "visual.")


def _is_unused_kv_tensor(name: str, cfg) -> bool:
    """`layers.{i}.self_attn.{k,v}_{proj,norm}.*` of a KV-shared layer i (transformers drops them on loading)."""
    head, _, tail = name.partition(cfg.text_prefix + "layers.")
    index, _, rest = tail.partition(".")
    return (not head and index.isdigit() and int(index) >= cfg.first_shared_layer
            and rest.startswith(tuple(f"self_attn.{x}." for x in ("k_proj", "v_proj", "k_norm", "v_norm"))))


def is_vision_tensor(name: str) -> bool:
    """A tensor of a Qwen3.5 conditional-generation checkpoint's vision tower (skipped: we run the text model)."""
    return name.startswith(_QWEN_VISION)


def skipped_towers(cfg: TargetConfig) -> tuple:
    """(what, tensor prefixes) of the towers a conditional-generation checkpoint of `cfg`'s family holds beside its
    text model, which loading skips with a warning (prefixes empty for families without any)."""
    if isinstance(cfg, Gemma4Config):
        return "vision and audio towers", GEMMA4_TOWERS
    return "vision tower", _QWEN_VISION if isinstance(cfg, HybridConfig) else ()


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


def _known_arch(d: Mapping, by_architecture: Mapping, by_model_type: Mapping) -> tuple:
    """(the value of the first known `architectures` entry, else of `model_type`; the known entries), refusing a
    `model_type` that says otherwise."""
    archs = [a for a in string_list(d.get("architectures"), "architectures") if a in by_architecture]
    model_type = d.get("model_type")
    value = by_architecture[archs[0]] if archs else by_model_type[model_type]
    if model_type is not None and by_model_type.get(model_type) != value:
        raise CheckpointError(f"contradictory target config: architectures {archs!r} but model_type {model_type!r}")
    return value, archs


def _hybrid_arch(d: Mapping) -> tuple:
    """(arch, conditional) from `architectures` (else `model_type`), refusing a contradiction."""
    arch, archs = _known_arch(d, HYBRID_ARCHITECTURES, _HYBRID_MODEL_TYPES)
    conditional = archs[0] in _CONDITIONAL if archs else d.get("model_type") in ("qwen3_5", "qwen3_5_moe")
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


# ---------------------------------------------------------------------------------------
# Gemma-4: sliding and full attention layers with per-type heads and rope, KV sharing, per-layer
# embeddings, a dense MLP with an optional mixture of experts beside it.

GEMMA4_ARCHITECTURES = {"Gemma4ForCausalLM": False, "Gemma4ForConditionalGeneration": True}
"""Gemma-4 architectures, each with whether its text model sits under `text_config` (conditional generation)."""
_GEMMA4_MODEL_TYPES = {"gemma4_text": False, "gemma4": True}
GEMMA4_LAYER_TYPES = ("sliding_attention", "full_attention")
GEMMA4_ACTIVATIONS = ("gelu_pytorch_tanh",)
GEMMA4_TOWERS = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")
"""Tensor prefixes of a conditional-generation checkpoint's vision and audio towers (skipped: we run the text model)."""
_GEMMA4_ROPE_DEFAULTS = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 1_000_000.0}}
_PROPORTIONAL_KEYS = ("rope_type", "rope_theta", "partial_rotary_factor", "factor")
_PER_LAYER_KEYS = ("head_dim", "num_key_value_heads")


@dataclasses.dataclass(frozen=True)
class Gemma4Config(TargetConfig):
    """A Gemma-4 text decoder (docs/architecture.md, "Gemma-4 targets"). `layer_types[i]` is 'sliding_attention'
    (a window of `sliding_window` positions; `head_dim`, `num_kv_heads`, `rope`) or 'full_attention'
    (`global_head_dim`, `num_global_kv_heads`, `full_rope`; keys are values when `attention_k_eq_v`). The last
    `num_kv_shared_layers` layers keep no K/V of their own: each reads the last earlier layer of its type.
    A rope of type 'proportional' rotates the first `partial_rotary_factor` of each head's frequency pairs
    (its `params`). `hidden_size_per_layer_input` > 0 adds per-layer embeddings; `num_experts` > 0 runs a
    mixture of experts beside every layer's MLP."""

    layer_types: tuple = ()
    sliding_window: int = 512
    global_head_dim: int = 512
    num_global_kv_heads: int = 0
    full_rope: RopeConfig = RopeConfig(1_000_000.0)
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 0
    use_double_wide_mlp: bool = False
    num_experts: int = 0
    top_k_experts: int = 0
    moe_intermediate_size: int = 0
    final_logit_softcapping: Optional[float] = None

    @property
    def first_shared_layer(self) -> int:
        """Layers from this one on reuse an earlier layer's K/V."""
        return self.num_layers - self.num_kv_shared_layers

    @property
    def kv_sources(self) -> tuple:
        """Per layer, the layer whose K/V it attends over: itself, or (a shared layer) the last layer of its type
        before `first_shared_layer`, as transformers' `kv_sharing_modes` pairs them."""
        first = self.first_shared_layer
        own = {kind: i for i, kind in enumerate(self.layer_types[:first])}
        return tuple(i if i < first else own[kind] for i, kind in enumerate(self.layer_types))

    def is_full(self, i: int) -> bool:
        return self.layer_types[i] == "full_attention"

    def layer_head_dim(self, i: int) -> int:
        return self.global_head_dim if self.is_full(i) else self.head_dim

    def layer_kv_heads(self, i: int) -> int:
        return self.num_global_kv_heads if self.is_full(i) else self.num_kv_heads

    def layer_k_eq_v(self, i: int) -> bool:
        """Whether layer i's values are its keys before norm and rope (`attention_k_eq_v`, full layers only)."""
        return self.attention_k_eq_v and self.is_full(i)

    def mlp_width(self, i: int) -> int:
        """The dense MLP's width: doubled on KV-shared layers under `use_double_wide_mlp`."""
        return self.intermediate_size * (2 if self.use_double_wide_mlp and i >= self.first_shared_layer else 1)


def _gemma4_arch(d: Mapping) -> bool:
    """Whether `d` is a conditional-generation config (else a causal LM's), refusing a contradiction."""
    return _known_arch(d, GEMMA4_ARCHITECTURES, _GEMMA4_MODEL_TYPES)[0]


def _gemma4_refusals(t: Mapping) -> None:
    """Refuse by name what a Gemma-4 text config may turn on that we do not implement."""
    bidirectional = t.get("use_bidirectional_attention")
    if bidirectional is not None:
        raise CheckpointError(f"gemma4 config has use_bidirectional_attention {bidirectional!r}; only causal "
                              "attention (null) is supported")
    act = t.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in GEMMA4_ACTIVATIONS:
        raise CheckpointError(f"hidden_activation {act!r}: supported: {', '.join(GEMMA4_ACTIVATIONS)}")
    if flag(t, "attention_bias"):
        raise CheckpointError("gemma4 config has attention_bias: true; only bias-free attention is supported")


def _gemma4_layer_types(t: Mapping, n: int) -> tuple:
    """`layer_types` (default: every sixth layer full), the last one full attention as transformers forces it."""
    given = string_list(t.get("layer_types"), "layer_types")
    if not given:
        given = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]
    bad = sorted({x for x in given if x not in GEMMA4_LAYER_TYPES})
    if bad:
        raise CheckpointError(f"layer_types has {bad}; supported layer types: {', '.join(GEMMA4_LAYER_TYPES)}")
    if len(given) != n:
        raise CheckpointError(f"layer_types has {len(given)} entries but num_hidden_layers is {n}")
    if given[-1] != "full_attention":
        warnings.warn(f"gemma4 layer_types ends with {given[-1]!r}: the last layer runs full attention, as "
                      "transformers forces it", stacklevel=3)
    return tuple(given[:-1]) + ("full_attention",)


def _gemma4_rope(t: Mapping, kind: str) -> RopeConfig:
    """The rope of layers of type `kind` from `rope_parameters` (one object per layer type; transformers'
    defaults when absent): 'proportional', or a rope `rope_from_hf` reads."""
    rp = t.get("rope_parameters")
    if rp is None:
        rp = _GEMMA4_ROPE_DEFAULTS
    if not isinstance(rp, Mapping) or not isinstance(rp.get(kind), Mapping):
        raise CheckpointError(f"rope_parameters {rp!r}: expected one object per layer type, with an entry for "
                              f"{kind!r}")
    params = rp[kind]
    rope_type = params.get("rope_type", "default")
    if rope_type != "proportional":
        if rope_type not in ROPE_TYPES:
            raise CheckpointError(f"rope type {rope_type!r} of {kind} layers is not supported; supported rope types: "
                                  f"{', '.join(ROPE_TYPES + ('proportional',))}")
        return rope_from_hf({"rope_parameters": dict(params),
                             "max_position_embeddings": t.get("max_position_embeddings", 131_072)})
    unknown = sorted(set(params) - set(_PROPORTIONAL_KEYS))
    if unknown:
        raise CheckpointError(f"proportional rope of {kind} layers has {unknown}; supported: "
                              f"{', '.join(_PROPORTIONAL_KEYS)}")
    theta = positive_number(require(params, "rope_theta", f"{kind} rope_parameters in the"), "rope_theta")
    fraction = positive_number(params.get("partial_rotary_factor", 1.0), "partial_rotary_factor")
    if fraction > 1:
        raise CheckpointError(f"partial_rotary_factor {fraction}: expected a fraction in (0, 1]")
    factor = positive_number(params.get("factor", 1.0), "factor")
    scaled = (("factor", factor),) if factor != 1 else ()  # written back only when set: transformers warns on it
    return RopeConfig(theta, "proportional", scaled + (("partial_rotary_factor", fraction),))


def _gemma4_heads(t: Mapping, types: tuple, heads: int) -> dict:
    """Sliding and full layers' head_dim and KV heads: `per_layer_config` overrides (as transformers 5 writes
    them), else `global_head_dim` and, with `attention_k_eq_v`, `num_global_key_value_heads` on full layers."""
    n = len(types)
    hd, kv = positive_int(t.get("head_dim", 256), "head_dim"), kv_heads(t, heads)
    per_layer = t.get("per_layer_config")
    if per_layer is None:
        full = {"head_dim": t.get("global_head_dim", 512)}
        if boolean(t.get("attention_k_eq_v"), "attention_k_eq_v") and t.get("num_global_key_value_heads"):
            full["num_key_value_heads"] = t["num_global_key_value_heads"]
        per_layer = {i: full for i, kind in enumerate(types) if kind == "full_attention"}
    if not isinstance(per_layer, Mapping):
        raise CheckpointError(f"per_layer_config {per_layer!r}: expected an object of layer index -> overrides")
    layers = [{"head_dim": hd, "num_key_value_heads": kv} for _ in range(n)]
    for key, overrides in per_layer.items():
        index = int(key) if isinstance(key, str) and key.isdigit() else key
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < n:
            raise CheckpointError(f"per_layer_config key {key!r}: expected a layer index in 0..{n - 1}")
        if not isinstance(overrides, Mapping) or set(overrides) - set(_PER_LAYER_KEYS):
            raise CheckpointError(f"per_layer_config[{key!r}] {overrides!r}: supported per-layer overrides: "
                                  f"{', '.join(_PER_LAYER_KEYS)}")
        layers[index].update(overrides)
    out = {}
    for kind, (hd_name, kv_name) in {"sliding_attention": ("head_dim", "num_kv_heads"),
                                     "full_attention": ("global_head_dim", "num_global_kv_heads")}.items():
        found = {(x["head_dim"], x["num_key_value_heads"]) for x, k in zip(layers, types) if k == kind}
        if len(found) > 1:
            raise CheckpointError(f"per_layer_config gives {kind} layers different head_dim / num_key_value_heads "
                                  f"{sorted(found)}; supported: one of each per layer type")
        size, groups = found.pop() if found else (hd, kv)
        size, groups = positive_int(size, f"{kind} head_dim"), positive_int(groups, f"{kind} num_key_value_heads")
        if size % 2:
            raise CheckpointError(f"{kind} head_dim {size}: rope needs an even head_dim")
        if heads % groups:
            raise CheckpointError(f"num_attention_heads {heads} is not a multiple of the {kind} layers' "
                                  f"num_key_value_heads {groups} (GQA groups)")
        out.update({hd_name: size, kv_name: groups})
    return out


def _gemma4_sharing(t: Mapping, types: tuple) -> int:
    """`num_kv_shared_layers`, refused unless earlier layers of every shared layer's type keep K/V to share."""
    n = len(types)
    shared = t.get("num_kv_shared_layers", 0)
    if isinstance(shared, bool) or not isinstance(shared, int) or not 0 <= shared < n:
        raise CheckpointError(f"num_kv_shared_layers {shared!r}: expected an integer in 0..{n - 1} (fewer than "
                              "num_hidden_layers: some layer must compute the K/V the others share)")
    orphans = sorted(set(types[n - shared:]) - set(types[:n - shared])) if shared else []
    if orphans:
        raise CheckpointError(f"num_kv_shared_layers {shared}: shared {orphans} layers have no earlier layer of "
                              "their type to take K/V from")
    return shared


def _gemma4_moe(t: Mapping) -> dict:
    """The mixture of experts beside each MLP (`enable_moe_block`): `num_experts`, `top_k_experts` and
    `moe_intermediate_size` are then required (transformers has no defaults for them)."""
    if not boolean(t.get("enable_moe_block"), "enable_moe_block"):
        return {}
    what = "gemma4 config with enable_moe_block: true"
    experts = positive_int(require(t, "num_experts", what), "num_experts")
    top_k = positive_int(require(t, "top_k_experts", what), "top_k_experts")
    if top_k > experts:
        raise CheckpointError(f"top_k_experts {top_k} exceeds num_experts {experts}")
    return {"num_experts": experts, "top_k_experts": top_k,
            "moe_intermediate_size": positive_int(require(t, "moe_intermediate_size", what), "moe_intermediate_size")}


def _gemma4_per_layer_input(t: Mapping, vocab: int) -> dict:
    """Per-layer embeddings (transformers' defaults: 256 wide, a 262144-token table); 0 or null turns them off."""
    width = t.get("hidden_size_per_layer_input", 256)
    if not width:
        return {}
    table = positive_int(t.get("vocab_size_per_layer_input", 262_144), "vocab_size_per_layer_input")
    if table < vocab:
        raise CheckpointError(f"vocab_size_per_layer_input {table} is below vocab_size {vocab}: tokens past it would "
                              "have no per-layer embedding; supported: vocab_size_per_layer_input >= vocab_size")
    return {"hidden_size_per_layer_input": positive_int(width, "hidden_size_per_layer_input"),
            "vocab_size_per_layer_input": table}


def gemma4_config_from_hf(d: Mapping) -> Gemma4Config:
    """Census of a Gemma4ForCausalLM (`gemma4_text`) or Gemma4ForConditionalGeneration `config.json` (whose text
    model under `text_config` is read, the vision and audio towers skipped). Defaults are transformers'."""
    conditional = _gemma4_arch(d)
    t = d.get("text_config", {}) if conditional else d
    if not isinstance(t, Mapping):
        raise CheckpointError(f"gemma4 conditional-generation config has text_config {t!r}: expected an object")
    _gemma4_refusals(t)
    n = positive_int(t.get("num_hidden_layers", 30), "num_hidden_layers")
    types = _gemma4_layer_types(t, n)
    heads = positive_int(t.get("num_attention_heads", 8), "num_attention_heads")
    vocab = positive_int(t.get("vocab_size", 262_144), "vocab_size")
    softcap = t.get("final_logit_softcapping")
    tie = d.get("tie_word_embeddings", t.get("tie_word_embeddings", True)) if conditional else \
        t.get("tie_word_embeddings", True)
    return Gemma4Config(
        arch="gemma4",
        vocab_size=vocab,
        hidden_size=positive_int(t.get("hidden_size", 2304), "hidden_size"),
        intermediate_size=positive_int(t.get("intermediate_size", 9216), "intermediate_size"),
        num_layers=n,
        num_heads=heads,
        rms_norm_eps=positive_number(t.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
        rope=_gemma4_rope(t, "sliding_attention") if "sliding_attention" in types else RopeConfig(10_000.0),
        full_rope=_gemma4_rope(t, "full_attention"),
        tie_word_embeddings=boolean(tie, "tie_word_embeddings", True),
        max_position_embeddings=positive_int(t.get("max_position_embeddings", 131_072), "max_position_embeddings"),
        eos_token_ids=token_ids(t.get("eos_token_id", 1), "eos_token_id"),
        dtype=stored_dtype(d if conditional and (d.get("dtype") or d.get("torch_dtype")) else t),
        text_prefix="model.language_model." if conditional else "model.",
        layer_types=types,
        sliding_window=positive_int(t.get("sliding_window", 512), "sliding_window"),
        attention_k_eq_v=boolean(t.get("attention_k_eq_v"), "attention_k_eq_v"),
        num_kv_shared_layers=_gemma4_sharing(t, types),
        use_double_wide_mlp=boolean(t.get("use_double_wide_mlp"), "use_double_wide_mlp"),
        final_logit_softcapping=None if softcap is None else positive_number(softcap, "final_logit_softcapping"),
        **_gemma4_heads(t, types, heads),
        **_gemma4_moe(t),
        **_gemma4_per_layer_input(t, vocab),
    )


def gemma4_to_hf_config(cfg: Gemma4Config) -> dict:
    """The Gemma4ForCausalLM `config.json` of `cfg` (tensors under `model.`), in transformers 5's form: full
    layers' heads as `per_layer_config` overrides."""
    out = _shared_hf(cfg, "Gemma4ForCausalLM", "gemma4_text")
    del out["hidden_act"]
    full = {"head_dim": cfg.global_head_dim, "num_key_value_heads": cfg.num_global_kv_heads}
    digits = len(str(cfg.num_layers - 1))
    rope = {"sliding_attention": cfg.rope, "full_attention": cfg.full_rope}
    out.update({
        "hidden_activation": "gelu_pytorch_tanh",
        "intermediate_size": cfg.intermediate_size,
        "layer_types": list(cfg.layer_types),
        "sliding_window": cfg.sliding_window,
        "rope_parameters": {kind: {"rope_type": r.rope_type, "rope_theta": r.theta, **dict(r.params)}
                            for kind, r in rope.items() if kind in cfg.layer_types},
        "per_layer_config": {str(i).zfill(digits): full for i in range(cfg.num_layers) if cfg.is_full(i)},
        "attention_k_eq_v": cfg.attention_k_eq_v,
        "num_kv_shared_layers": cfg.num_kv_shared_layers,
        "hidden_size_per_layer_input": cfg.hidden_size_per_layer_input,
        "vocab_size_per_layer_input": cfg.vocab_size_per_layer_input or cfg.vocab_size,
        "use_double_wide_mlp": cfg.use_double_wide_mlp,
        "enable_moe_block": bool(cfg.num_experts),
        "final_logit_softcapping": cfg.final_logit_softcapping,
        "use_bidirectional_attention": None,
    })
    ids = list(cfg.eos_token_ids)
    out["eos_token_id"] = None if not ids else ids[0] if len(ids) == 1 else ids
    if cfg.num_experts:
        out.update(num_experts=cfg.num_experts, top_k_experts=cfg.top_k_experts,
                   moe_intermediate_size=cfg.moe_intermediate_size)
    return out
