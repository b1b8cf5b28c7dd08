"""Hugging Face names of the dense target's parameters (`Qwen3ForCausalLM`, `LlamaForCausalLM`)."""
from __future__ import annotations

from dflash_jax.config import TargetConfig
from dflash_jax.io.names import Param


def name_map(cfg: TargetConfig) -> list:
    """One `Param` per leaf of `DenseLM`'s params: q|k|v and gate|up fused, linear weights transposed."""
    q, kv, f = cfg.q_width, cfg.kv_width, cfg.intermediate_size
    t = cfg.text_prefix
    names = [Param(("embed",), (t + "embed_tokens.weight",)), Param(("final_norm",), (t + "norm.weight",))]
    if not cfg.tie_word_embeddings:
        names.append(Param(("lm_head",), ("lm_head.weight",), transpose=True))
    for i in range(cfg.num_layers):
        p, a, layer = f"{t}layers.{i}.", f"{t}layers.{i}.self_attn.", f"layers_{i}"
        names += [
            Param((layer, "attn_norm"), (p + "input_layernorm.weight",)),
            Param((layer, "wqkv"), tuple(a + f"{x}_proj.weight" for x in "qkv"), (q, kv, kv), transpose=True),
            Param((layer, "wo"), (a + "o_proj.weight",), transpose=True),
            Param((layer, "mlp_norm"), (p + "post_attention_layernorm.weight",)),
            Param((layer, "w_gate_up"), (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), (f, f),
                  transpose=True),
            Param((layer, "w_down"), (p + "mlp.down_proj.weight",), transpose=True),
        ]
        if cfg.attention_bias:
            names += [Param((layer, "bqkv"), tuple(a + f"{x}_proj.bias" for x in "qkv"), (q, kv, kv)),
                      Param((layer, "bo"), (a + "o_proj.bias",))]
        if cfg.qk_norm:
            names += [Param((layer, "q_norm"), (a + "q_norm.weight",)),
                      Param((layer, "k_norm"), (a + "k_norm.weight",))]
    return names
