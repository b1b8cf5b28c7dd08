"""Loading checkpoints into models, and a one-step `propose` for inspecting a drafter."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import checkpoint, policy
from dflash_jax import sampling as smp
from dflash_jax import speculative as spec
from dflash_jax.decode import pack_prompts, stop_array, check_capacity
from dflash_jax.nn import drafter as dr
from dflash_jax.nn.dense import Target
from dflash_jax.nn.drafter import Drafter


def load_target(path, dtype=None) -> Target:
    """A Hugging Face Qwen3/Llama directory as a `Target`; `dtype=None` keeps the checkpoint's."""
    cfg, params = checkpoint.read_target(path, dtype)
    return Target(cfg, params)


def load_drafter(path, target: Target | None = None, dtype=None, **overrides) -> Drafter:
    """A z-lab `DFlashDraftModel` directory as a `Drafter`, checked against `target` when given.

    `overrides` set census fields by name (e.g. `block_size=8`, `harvest="dflash"`)."""
    cfg, params = checkpoint.read_drafter(path, target.config if target is not None else None, dtype, **overrides)
    return Drafter(cfg, params)


@dataclasses.dataclass
class Proposal:
    """One drafting step after prefill: `tokens int32[B, nd]` and `logits float32[B, nd, V]`;
    `anchor int32[B]` is the target's first token, the block's row 0."""

    tokens: np.ndarray
    logits: np.ndarray
    anchor: np.ndarray


@functools.partial(jax.jit, static_argnums=0)
def _propose(loop: spec.Loop, target, drafter, tokens, lengths, cache, dcache, rp, stops):
    s = loop.start(target, drafter, tokens, lengths, cache, dcache, rp, stops)
    dc = drafter.config
    h = dr.draft_hidden(drafter.params, dc, s.dcache, dr.block_input(target.params, dc, s.anchor), loop.impl)
    logits = dr.draft_logits(target.params, target.config, dc, h)
    return jnp.argmax(logits, -1).astype(jnp.int32), logits, s.anchor


def propose(target: Target, drafter: Drafter, prompts, impl: str | None = None) -> Proposal:
    """Prefill `prompts`, take the target's next token as anchor, and draft one block (greedy)."""
    spec.check_drafter(target, drafter)
    impl = policy.attention_impl(impl)
    p = pack_prompts(prompts, target.config.vocab_size)
    cap = check_capacity(p, 1, target.config.max_position_embeddings, drafter.config.block_size, None)
    loop = spec.Loop(1, p.chunk, True, "argmax", impl)
    out = _propose(loop, target, drafter, jnp.asarray(p.tokens), jnp.asarray(p.lengths),
                   target.init_cache(p.batch, cap), drafter.init_cache(p.batch, cap),
                   smp.row_params(smp.Sampling(), p.batch), stop_array((), target.config.vocab_size))
    tokens, logits, anchor = jax.device_get(out)
    return Proposal(np.asarray(tokens), np.asarray(logits, np.float32), np.asarray(anchor))
