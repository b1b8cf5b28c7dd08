"""dflash-jax: lossless block-diffusion speculative decoding in JAX.

    target = dflash_jax.load_target("Qwen/Qwen3-8B")                  # a folder or a Hugging Face repo id
    drafter = dflash_jax.load_drafter("z-lab/Qwen3-8B-DFlash-b16", target)
    out = dflash_jax.generate_text(target, drafter, "Write a haiku.", chat=True, max_new_tokens=256)
    out.texts[0], out.stats.acceptance_length
"""
from dflash_jax.api import Proposal, generate, load_drafter, load_target, propose, shard
from dflash_jax.config import CheckpointError, DrafterConfig, TargetConfig
from dflash_jax.decoding.common import Result, Stats
from dflash_jax.decoding.session import Burst, Session
from dflash_jax.decoding.speculative import Injected
from dflash_jax.demo import Demo, load_demo
from dflash_jax.drafters.base import Drafter
from dflash_jax.hub import HubError
from dflash_jax.quant import quantize
from dflash_jax.sampling import Sampling
from dflash_jax.targets.base import Target
from dflash_jax.text import StreamChunk, TextResult, Tokenizer, generate_text, load_tokenizer, stream

__version__ = "0.1.0"

__all__ = [
    "Burst", "CheckpointError", "Demo", "Drafter", "DrafterConfig", "HubError", "Injected", "Proposal", "Result",
    "Sampling", "Session", "Stats", "StreamChunk", "Target", "TargetConfig", "TextResult", "Tokenizer", "generate",
    "generate_text", "load_demo", "load_drafter", "load_target", "load_tokenizer", "propose", "quantize", "shard",
    "stream",
]
