"""Target census: a Hugging Face `config.json` of a supported target -> a frozen `TargetConfig`."""
from __future__ import annotations

import dataclasses
from typing import Mapping

from dflash_jax.config.common import (
    AttentionWidths,
    CheckpointError,
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

    arch: str  # 'qwen3' | 'llama'
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

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalises q and k per head before RoPE; Llama does not."""
        return self.arch == "qwen3"



TARGET_ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}
_ARCH_OF_MODEL_TYPE = {arch: name for name, arch in TARGET_ARCHITECTURES.items()}


def _supported_targets() -> str:
    return ", ".join(f"{name} (model_type {arch!r})" for name, arch in TARGET_ARCHITECTURES.items())


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
    """Census of a Qwen3ForCausalLM / LlamaForCausalLM `config.json` (transformers 4 or 5 form)."""
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


def target_to_hf_config(cfg: TargetConfig) -> dict:
    """A `config.json` dict that transformers (4 and 5) and `target_config_from_hf` both read."""
    name = _ARCH_OF_MODEL_TYPE[cfg.arch]
    out = {
        "architectures": [name],
        "model_type": cfg.arch,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        **rope_to_hf(cfg.rope),
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "torch_dtype": cfg.dtype,
    }
    if cfg.arch == "llama":
        out["mlp_bias"] = False
    else:
        out["use_sliding_window"] = False
    if cfg.eos_token_ids:
        ids = list(cfg.eos_token_ids)
        out["eos_token_id"] = ids[0] if len(ids) == 1 else ids
    return out


def is_ignorable_target_tensor(name: str, cfg: TargetConfig) -> bool:
    """Tensors transformers itself ignores: rotary `inv_freq` buffers and a tied model's lm_head."""
    return name.endswith("rotary_emb.inv_freq") or (cfg.tie_word_embeddings and name == "lm_head.weight")
