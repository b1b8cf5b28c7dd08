"""Hugging Face names of the DSpark drafter's parameters: the DFlash backbone's, plus its heads."""
from __future__ import annotations

from dflash_jax.config import DrafterConfig
from dflash_jax.drafters import dflash_names
from dflash_jax.io.names import Param


def name_map(cfg: DrafterConfig) -> list:
    """The backbone's map plus `markov_head.markov_w{1,2}.weight [V, r]` (w2 stored `[r, V]`) and
    `confidence_head.proj.{weight [1, in], bias [1]}` (weight stored `[in, 1]`), where present."""
    names = dflash_names.name_map(cfg)
    if cfg.markov_rank is not None:
        names += [Param(("markov_w1",), ("markov_head.markov_w1.weight",)),
                  Param(("markov_w2",), ("markov_head.markov_w2.weight",), transpose=True)]
    if cfg.confidence_in_dim is not None:
        names += [Param(("confidence_w",), ("confidence_head.proj.weight",), transpose=True),
                  Param(("confidence_b",), ("confidence_head.proj.bias",))]
    return names
