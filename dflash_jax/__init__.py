"""dflash-jax: lossless block-diffusion speculative decoding in JAX.

    target = dflash_jax.load_target("Qwen3-8B")
    drafter = dflash_jax.load_drafter("Qwen3-8B-DFlash", target)
    out = dflash_jax.generate(target, drafter, [prompt_ids], max_new_tokens=256)
    out.stats.acceptance_length
"""
from dflash_jax.api import Proposal, generate, load_drafter, load_target, propose
from dflash_jax.config import CheckpointError, DrafterConfig, TargetConfig
from dflash_jax.decoding.common import Result, Stats
from dflash_jax.decoding.session import Burst, Session
from dflash_jax.decoding.speculative import Injected
from dflash_jax.demo import Demo, load_demo
from dflash_jax.drafters.base import Drafter
from dflash_jax.sampling import Sampling
from dflash_jax.targets.base import Target

__version__ = "0.1.0"

__all__ = [
    "Burst", "CheckpointError", "Demo", "Drafter", "DrafterConfig", "Injected", "Proposal", "Result", "Sampling",
    "Session", "Stats", "Target", "TargetConfig", "generate", "load_demo", "load_drafter", "load_target", "propose",
]
