"""The bundled demo pair: a small trained Qwen3 target and its DFlash, DSpark and DFlash2 drafters.

Both were trained on the Python standard library (recipe: `bench/demo_pair/`, model card:
`dflash_jax/assets/demo/README.md`). They are the default models of `dflash-jax generate`.
"""
from __future__ import annotations

import dataclasses
import os

from dflash_jax.api import load_drafter, load_target
from dflash_jax.drafters.base import Drafter
from dflash_jax.targets.base import Target
from dflash_jax.text import Tokenizer, load_tokenizer

DEMO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "demo")


@dataclasses.dataclass
class Demo:
    tokenizer: Tokenizer
    target: Target
    drafter: Drafter


DEMO_DRAFTERS = {"dflash": "drafter", "dspark": "drafter_dspark", "dflash2": "drafter_dflash2"}
"""The bundled drafters by family, and their folders."""


def load_demo(dtype="float32", directory: str = DEMO_DIR, drafter: str = "dflash", *, precision=None,
              target_precision=None, **overrides) -> Demo:
    """The demo tokenizer, target and drafter (`drafter`: one of `DEMO_DRAFTERS`). Shipped in bf16, computed
    in float32 by default: the models are tiny, and float32 keeps plain and speculative greedy decoding
    token-identical (in bf16 a 16-row verify and a 1-row step may round a near-tie differently).
    `precision` and `target_precision` are the drafter's and the target's weight precisions (as for
    `load_drafter` and `load_target`). `overrides` go to the drafter census (e.g. `block_size=8`)."""
    if drafter not in DEMO_DRAFTERS:
        raise ValueError(f"demo drafter {drafter!r} is not bundled; choices: {', '.join(DEMO_DRAFTERS)}")
    target_dir, drafter_dir = os.path.join(directory, "target"), os.path.join(directory, DEMO_DRAFTERS[drafter])
    if not (os.path.isdir(target_dir) and os.path.isdir(drafter_dir)):
        raise ValueError(f"the demo pair is missing from {directory}: reinstall dflash-jax, or rebuild it with "
                         "the recipe in bench/demo_pair/README.md")
    target = load_target(target_dir, dtype, precision=target_precision)
    return Demo(load_tokenizer(target_dir), target,
                load_drafter(drafter_dir, target, dtype, precision=precision, **overrides))
