"""Hugging Face names of a Gemma-4 target's parameters (`Gemma4ForCausalLM`, and the text model of
`Gemma4ForConditionalGeneration` under `model.language_model.`)."""
from __future__ import annotations

from dflash_jax.config.targets import Gemma4Config
from dflash_jax.io.names import Param


def _attention(cfg: Gemma4Config, i: int, a: str, layer: str) -> list:
    """q|k|v fused on our side; a KV-shared layer has only q, a k = v layer only q|k."""
    hd = cfg.layer_head_dim(i)
    q, kv = cfg.num_heads * hd, cfg.layer_kv_heads(i) * hd
    if cfg.kv_sources[i] != i:
        fused, widths, norms = ("q",), (q,), ("q",)
    elif cfg.layer_k_eq_v(i):
        fused, widths, norms = ("q", "k"), (q, kv), ("q", "k")
    else:
        fused, widths, norms = ("q", "k", "v"), (q, kv, kv), ("q", "k")
    return [Param((layer, "wqkv"), tuple(a + f"{x}_proj.weight" for x in fused), widths, transpose=True),
            Param((layer, "wo"), (a + "o_proj.weight",), transpose=True),
            *(Param((layer, f"{x}_norm"), (a + f"{x}_norm.weight",)) for x in norms)]


def _experts(p: str, layer: str) -> list:
    """The router (`router.proj`, `router.scale`, `router.per_expert_scale`) and the stacked experts."""
    return [Param((layer, "router"), (p + "router.proj.weight",), transpose=True),
            Param((layer, "router_scale"), (p + "router.scale",)),
            Param((layer, "expert_scale"), (p + "router.per_expert_scale",)),
            Param((layer, "experts_gate_up"), (p + "experts.gate_up_proj",), transpose=True),
            Param((layer, "experts_down"), (p + "experts.down_proj",), transpose=True),
            Param((layer, "experts_norm"), (p + "pre_feedforward_layernorm_2.weight",)),
            Param((layer, "post_mlp_norm_1"), (p + "post_feedforward_layernorm_1.weight",)),
            Param((layer, "post_experts_norm"), (p + "post_feedforward_layernorm_2.weight",))]


def name_map(cfg: Gemma4Config) -> list:
    """One `Param` per leaf of `Gemma4LM`'s params, under the config's `text_prefix`."""
    t = cfg.text_prefix
    names = [Param(("embed",), (t + "embed_tokens.weight",)), Param(("final_norm",), (t + "norm.weight",))]
    if not cfg.tie_word_embeddings:
        names.append(Param(("lm_head",), ("lm_head.weight",), transpose=True))
    if cfg.hidden_size_per_layer_input:
        names += [Param(("embed_per_layer",), (t + "embed_tokens_per_layer.weight",)),
                  Param(("ple_projection",), (t + "per_layer_model_projection.weight",), transpose=True),
                  Param(("ple_projection_norm",), (t + "per_layer_projection_norm.weight",))]
    for i in range(cfg.num_layers):
        p, layer = f"{t}layers.{i}.", f"layers_{i}"
        f = cfg.mlp_width(i)
        names += [Param((layer, "attn_norm"), (p + "input_layernorm.weight",)),
                  Param((layer, "post_attn_norm"), (p + "post_attention_layernorm.weight",)),
                  Param((layer, "mlp_norm"), (p + "pre_feedforward_layernorm.weight",)),
                  Param((layer, "post_mlp_norm"), (p + "post_feedforward_layernorm.weight",)),
                  Param((layer, "w_gate_up"), (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), (f, f),
                        transpose=True),
                  Param((layer, "w_down"), (p + "mlp.down_proj.weight",), transpose=True),
                  Param((layer, "layer_scalar"), (p + "layer_scalar",)),
                  *_attention(cfg, i, p + "self_attn.", layer)]
        if cfg.num_experts:
            names += _experts(p, layer)
        if cfg.hidden_size_per_layer_input:
            names += [Param((layer, "ple_gate"), (p + "per_layer_input_gate.weight",), transpose=True),
                      Param((layer, "ple_proj"), (p + "per_layer_projection.weight",), transpose=True),
                      Param((layer, "ple_norm"), (p + "post_per_layer_input_norm.weight",))]
    return names
