"""Hugging Face names of the DFlash2 drafter's parameters: the DFlash backbone's, plus its convolutions
and candidate selector (the codebooks are stored without `.weight`, as the published checkpoints do)."""
from __future__ import annotations

from dflash_jax.config import DrafterConfig
from dflash_jax.drafters import dflash_names
from dflash_jax.io.names import Param


def name_map(cfg: DrafterConfig) -> list:
    """The backbone's map plus, per layer, `{attention,mlp}_conv.base_kernel [2, k, H]` and
    `.kernel_projection.weight [2*k*G, H]` (stored transposed), and `candidate_selector.{predecessor,
    successor}_codebook [V, r]` and `.hidden_projection.weight [r, H]` (stored transposed)."""
    names = dflash_names.name_map(cfg)
    for i in range(cfg.num_layers):
        layer = f"layers_{i}"
        for ours, hf in (("attn_conv", "attention_conv"), ("mlp_conv", "mlp_conv")):
            prefix = f"layers.{i}.{hf}."
            names += [Param((layer, f"{ours}_base"), (prefix + "base_kernel",)),
                      Param((layer, f"{ours}_proj"), (prefix + "kernel_projection.weight",), transpose=True)]
    return names + [
        Param(("selector_pred",), ("candidate_selector.predecessor_codebook",)),
        Param(("selector_succ",), ("candidate_selector.successor_codebook",)),
        Param(("selector_hidden",), ("candidate_selector.hidden_projection.weight",), transpose=True),
    ]
