"""Hugging Face names of the DFlash drafter's parameters (z-lab `DFlashDraftModel`, no `model.` prefix)."""
from __future__ import annotations

from dflash_jax.config import DrafterConfig
from dflash_jax.io.names import Param


def name_map(cfg: DrafterConfig) -> list:
    """One `Param` per leaf of `DFlashModule`'s params: k|v and gate|up fused, linear weights transposed."""
    kv, f = cfg.kv_width, cfg.intermediate_size
    names = [Param(("fc",), ("fc.weight",), transpose=True), Param(("hidden_norm",), ("hidden_norm.weight",)),
             Param(("norm",), ("norm.weight",))]
    for i in range(cfg.num_layers):
        p, a, layer = f"layers.{i}.", f"layers.{i}.self_attn.", f"layers_{i}"
        names += [
            Param((layer, "attn_norm"), (p + "input_layernorm.weight",)),
            Param((layer, "wq"), (a + "q_proj.weight",), transpose=True),
            Param((layer, "wkv"), (a + "k_proj.weight", a + "v_proj.weight"), (kv, kv), transpose=True),
            Param((layer, "q_norm"), (a + "q_norm.weight",)),
            Param((layer, "k_norm"), (a + "k_norm.weight",)),
            Param((layer, "wo"), (a + "o_proj.weight",), transpose=True),
            Param((layer, "mlp_norm"), (p + "post_attention_layernorm.weight",)),
            Param((layer, "w_gate_up"), (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), (f, f),
                  transpose=True),
            Param((layer, "w_down"), (p + "mlp.down_proj.weight",), transpose=True),
        ]
    return names
