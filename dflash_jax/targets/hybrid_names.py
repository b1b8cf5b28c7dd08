"""Hugging Face names of a hybrid target's parameters (`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`, their
conditional-generation forms, `Qwen3NextForCausalLM`)."""
from __future__ import annotations

from dflash_jax.config.targets import HybridConfig
from dflash_jax.io.names import Param


def _linear_attention(cfg: HybridConfig, a: str, layer: str) -> list:
    """One fused input projection: Qwen3.5's q|k|v, z, b, a tensors concatenated, or Qwen3-Next's qkvz and ba
    (each interleaved per key head; `gdn.split_projection` undoes that on activations)."""
    k, v, nv = cfg.key_dim, cfg.value_dim, cfg.linear_num_value_heads
    if cfg.arch == "qwen3_next":
        proj = Param((layer, "in_proj"), (a + "in_proj_qkvz.weight", a + "in_proj_ba.weight"), (2 * k + 2 * v, 2 * nv),
                     transpose=True)
    else:
        proj = Param((layer, "in_proj"), tuple(a + f"in_proj_{x}.weight" for x in ("qkv", "z", "b", "a")),
                     (2 * k + v, v, nv, nv), transpose=True)
    return [proj, Param((layer, "conv"), (a + "conv1d.weight",)), Param((layer, "dt_bias"), (a + "dt_bias",)),
            Param((layer, "A_log"), (a + "A_log",)), Param((layer, "norm"), (a + "norm.weight",)),
            Param((layer, "out_proj"), (a + "out_proj.weight",), transpose=True)]


def _attention(cfg: HybridConfig, a: str, layer: str) -> list:
    """q_proj holds each head's query and output gate side by side (`[heads, 2 * head_dim]`)."""
    kv = cfg.kv_width
    return [Param((layer, "wqkv"), tuple(a + f"{x}_proj.weight" for x in "qkv"), (2 * cfg.q_width, kv, kv),
                  transpose=True),
            Param((layer, "wo"), (a + "o_proj.weight",), transpose=True),
            Param((layer, "q_norm"), (a + "q_norm.weight",)), Param((layer, "k_norm"), (a + "k_norm.weight",))]


def _experts(cfg: HybridConfig, m: str, layer: str) -> list:
    i, s = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    if cfg.expert_layout == "fused":
        routed = [Param((layer, "w_gate_up"), (m + "experts.gate_up_proj",), transpose=True),
                  Param((layer, "w_down"), (m + "experts.down_proj",), transpose=True)]
    else:
        e = m + "experts.{e}."
        routed = [Param((layer, "w_gate_up"), (e + "gate_proj.weight", e + "up_proj.weight"), (i, i), transpose=True,
                        experts=cfg.num_experts),
                  Param((layer, "w_down"), (e + "down_proj.weight",), transpose=True, experts=cfg.num_experts)]
    return [Param((layer, "router"), (m + "gate.weight",), transpose=True), *routed,
            Param((layer, "shared_gate_up"), (m + "shared_expert.gate_proj.weight", m + "shared_expert.up_proj.weight"),
                  (s, s), transpose=True),
            Param((layer, "shared_down"), (m + "shared_expert.down_proj.weight",), transpose=True),
            Param((layer, "shared_gate"), (m + "shared_expert_gate.weight",), transpose=True)]


def name_map(cfg: HybridConfig) -> list:
    """One `Param` per leaf of `HybridLM`'s params, under the config's `text_prefix`."""
    t, f = cfg.text_prefix, cfg.intermediate_size
    names = [Param(("embed",), (t + "embed_tokens.weight",)), Param(("final_norm",), (t + "norm.weight",))]
    if not cfg.tie_word_embeddings:
        names.append(Param(("lm_head",), ("lm_head.weight",), transpose=True))
    for i, kind in enumerate(cfg.layer_types):
        p, layer = f"{t}layers.{i}.", f"layers_{i}"
        names += [Param((layer, "attn_norm"), (p + "input_layernorm.weight",)),
                  Param((layer, "mlp_norm"), (p + "post_attention_layernorm.weight",))]
        if kind == "linear_attention":
            names += _linear_attention(cfg, p + "linear_attn.", layer)
        else:
            names += _attention(cfg, p + "self_attn.", layer)
        if cfg.moe_layers[i]:
            names += _experts(cfg, p + "mlp.", layer)
        else:
            names += [Param((layer, "w_gate_up"), (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), (f, f),
                            transpose=True),
                      Param((layer, "w_down"), (p + "mlp.down_proj.weight",), transpose=True)]
    return names
