"""The public face: load checkpoints, generate (plain or speculative), propose one block."""
from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import hub, sharding
from dflash_jax import sampling as smp
from dflash_jax.config import check_fits_target, policy
from dflash_jax.decoding import speculative as spec
from dflash_jax.decoding.common import (Result, check_capacity, check_dtypes, check_memory, pack_prompts,
                                       stop_array)
from dflash_jax.decoding.plain import plain_generate
from dflash_jax.decoding.session import Session
from dflash_jax.drafters.base import Drafter
from dflash_jax.io import checkpoints
from dflash_jax.targets.base import Target


_FOLDERS: dict = {}
"""id(target) -> the folder `load_target` read it from, while that target lives: its tokenizer's folder."""


def source_folder(target: Target) -> Optional[str]:
    """The folder `load_target` read `target` from (a hub id's snapshot folder), or None for a target made
    otherwise (a copy made by `replace` or a tree map included)."""
    return _FOLDERS.get(id(target))


def load_target(path, dtype=None, *, check_finite: bool = True, revision: Optional[str] = None,
                precision: Optional[str] = None, mesh=None, strict: bool = False) -> Target:
    """A Hugging Face Qwen3/Llama folder or repo id ("Qwen/Qwen3-8B", at `revision`, through the local
    Hugging Face cache: see `hub.resolve`) as a `Target`; `dtype=None` keeps the checkpoint's.

    `check_finite=False` skips refusing weights that hold NaN or Inf (one pass over each tensor).
    `precision` quantises the weights as they load (`config.policy.PRECISIONS`; keyword > DFLASH_TARGET_PREC >
    as saved, bf16 for a float checkpoint). A quantised target changes the output: it is its own oracle.

    `mesh` (`sharding.make_mesh(tp=..., dp=...)`) places every tensor on its shards as it loads (`sharding.RULES`:
    attention by heads, MLP by its inner dimension, the LM head by vocabulary); a dimension the mesh does not
    divide is replicated, or refused with `strict=True`."""
    folder = hub.resolve(path, revision=revision, what="target")
    target = checkpoints.read_target(folder, dtype, check_finite, precision, mesh=mesh, strict=strict)
    _FOLDERS[id(target)] = folder
    weakref.finalize(target, _FOLDERS.pop, id(target), None)
    return target


def load_drafter(path, target: Target | None = None, dtype=None, *, check_finite: bool = True,
                 revision: Optional[str] = None, precision: Optional[str] = None, mesh=None, replicated: bool = False,
                 strict: bool = False, proposal_head: Optional[bool] = None, **overrides) -> Drafter:
    """A drafter folder or repo id (z-lab `DFlashDraftModel`, `DSparkDraftModel`; ids as for
    `load_target`) as a `Drafter`, checked against `target` when given.

    With a target the drafter computes in the target's dtype: `dtype=None` casts it, another dtype is
    refused naming both. `check_finite` as for `load_target`. `precision` quantises the weights as they load
    (keyword > DFLASH_PREC > as saved); the target still decides every token, so the output does not change.
    A quantised drafter loaded with its target proposes through a copy of the target's LM head in its own
    format (`Drafter.with_head`; `proposal_head=False` or DFLASH_PROPOSAL_HEAD=0 reads the target's).
    `overrides` set census fields by name (e.g. `block_size=8`, `harvest="dflash"`). `mesh` and `strict` as for
    `load_target`; `replicated=True` keeps every leaf whole on every device (a small drafter then runs without
    collectives)."""
    folder = hub.resolve(path, revision=revision, what="drafter")
    drafter = checkpoints.read_drafter(folder, target.config if target is not None else None, dtype,
                                       check_finite=check_finite, precision=precision, mesh=mesh,
                                       replicated=replicated, strict=strict, **overrides)
    return drafter if target is None else drafter.with_head(target, proposal_head)


def shard(model, mesh, *, replicated: bool = False, strict: bool = False):
    """An already built Target or Drafter (a random model, `make_target`) with its params placed on `mesh` as
    `load_target(..., mesh=)` places them; decoding then places its caches to match."""
    return checkpoints.shard(model, mesh, replicated, strict)


def generate(target: Target, drafter: Optional[Drafter], prompts, *, max_new_tokens: int, stop_tokens=(),
             sampling: smp.Sampling | Sequence[smp.Sampling] | None = smp.Sampling(),
             capacity: Optional[int] = None, impl: Optional[str] = None, verify_t: Optional[int] = None,
             verify_buckets=None, lengths=None, prefill_chunk: Optional[int] = None) -> Result:
    """Generate up to `max_new_tokens` per prompt, exactly as the target alone would.

    prompts: a list of token-id lists (ragged), or a 2-D int array whose every token is real
    unless `lengths` gives each row's valid length (the rest of the row is padding, ignored).
    stop_tokens: ids that end a row (kept in its output); one id or None (no stop token) also do.
    sampling: one `Sampling` for all rows or one per row (temperature 0 is greedy; None is the
    default `Sampling()`). capacity: cache positions per row (default: what the run needs);
    caches that do not fit the free memory are refused before allocation. verify_t caps the drafts
    examined per round (default: all of them below batch 64, 5 from it, a cap of 6: `policy.VERIFY_CAP_BY_BATCH`),
    and verify_buckets lists smaller static blocks a round may verify instead of the full one
    (speculative only). prefill_chunk: prompt positions per prefill step (keyword >
    DFLASH_PREFILL_CHUNK > `policy.prefill_chunk`'s default); tokens do not depend on it. Integers and numbers may be Python or numpy scalars.
    Plain decoding when `drafter` is None. Returns `Result(tokens, stats)`; one compiled
    program is reused for calls with the same static shapes.
    """
    if drafter is None:
        if verify_t is not None or verify_buckets is not None:
            raise ValueError("verify_t and verify_buckets shape a round's verify; plain decoding (drafter=None) "
                             "has none")
        return plain_generate(target, prompts, max_new_tokens=max_new_tokens, stop_tokens=stop_tokens,
                              sampling=sampling, capacity=capacity, impl=impl, lengths=lengths,
                              prefill_chunk=prefill_chunk)
    return Session(target, drafter, prompts, max_new_tokens=max_new_tokens, stop_tokens=stop_tokens,
                   sampling=sampling, capacity=capacity, impl=impl, verify_t=verify_t,
                   verify_buckets=verify_buckets, lengths=lengths, prefill_chunk=prefill_chunk).run()


@dataclasses.dataclass
class Proposal:
    """One drafting step after prefill: `tokens int32[B, nd]` and `logits float32[B, nd, V]`;
    `anchor int32[B]` is the target's first token, the block's first row."""

    tokens: np.ndarray
    logits: np.ndarray
    anchor: np.ndarray


@functools.partial(jax.jit, static_argnums=0)
def _propose(loop: spec.Loop, target, drafter, tokens, lengths, tstate, dstate, rp, stops):
    s = loop.start(target, drafter, tokens, lengths, tstate, dstate, rp, stops)
    prop = loop.propose(target, drafter, s)
    return prop.drafts, prop.logits, s.anchor


def propose(target: Target, drafter: Drafter, prompts, impl: Optional[str] = None, lengths=None) -> Proposal:
    """Prefill `prompts` (as `generate` reads them, `lengths` included), take the target's next
    token as anchor, and draft one block (greedy)."""
    check_fits_target(drafter.config, target.config)
    check_dtypes(target, drafter)
    mesh = sharding.models_mesh(target, drafter)
    impl = policy.attention_impl(impl, sharded=mesh is not None)
    p = pack_prompts(prompts, target.config.vocab_size, lengths=lengths)
    cap = check_capacity(p, 1, target.config.max_position_embeddings, drafter.n_drafts + 1, None)
    check_memory(target, drafter, p.batch, cap)
    loop = spec.Loop(1, p.chunk, True, "argmax", impl, drafter.n_drafts + 1)
    with sharding.mesh_context(mesh):
        out = _propose(loop, target, drafter, jnp.asarray(p.tokens), jnp.asarray(p.lengths),
                       sharding.place_state(target, target.init_state(p.batch, cap)),
                       sharding.place_state(drafter, drafter.init_state(p.batch, cap)),
                       smp.row_params(smp.Sampling(), p.batch), stop_array((), target.config.vocab_size))
    tokens, logits, anchor = sharding.fetch(out)
    return Proposal(np.asarray(tokens), np.asarray(logits, np.float32), np.asarray(anchor))
