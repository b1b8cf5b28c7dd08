"""dflash-jax: lossless block-diffusion speculative decoding (DFlash) in JAX.

    target = dflash_jax.load_target("Qwen3-8B")
    drafter = dflash_jax.load_drafter("Qwen3-8B-DFlash", target)
    out = dflash_jax.generate(target, drafter, [prompt_ids], max_new_tokens=256)
"""
from dflash_jax.api import Proposal, load_drafter, load_target, propose
from dflash_jax.config import CheckpointError, DrafterConfig, TargetConfig
from dflash_jax.decode import Result
from dflash_jax.demo import Demo, load_demo
from dflash_jax.generate import generate
from dflash_jax.nn.dense import Target
from dflash_jax.nn.drafter import Drafter
from dflash_jax.sampling import Sampling
from dflash_jax.session import Burst, Session
from dflash_jax.speculative import Injected

__version__ = "0.1.0"

__all__ = [
    "Burst", "CheckpointError", "Demo", "Drafter", "DrafterConfig", "Injected", "Proposal", "Result", "Sampling",
    "Session", "Target", "TargetConfig", "generate", "load_demo", "load_drafter", "load_target", "propose",
]
