"""The DSpark drafter: the DFlash backbone plus a Markov head, a confidence head and verify-window
policies (docs/architecture.md, "DSpark").

- **Harvest.** DSpark checkpoints are trained with shifted labels: rows 0..b-1 are b drafts, row k
  verified at offset k + 1 (the census's `harvest`; `dflash` reads rows 1..b-1 instead).
- **Markov head** (`markov_w1 [V, r]`, an embedding, and `markov_w2 [r, V]`). The drafts are a
  chain: slot k's logits get `W1[prev_k] @ W2`, `prev_0` the anchor and `prev_{k+1}` the token
  chosen at slot k (argmax, or a draw from the corrected filtered distribution, which is then q).
  A `lax.scan` over the slots inside the round.
- **Confidence head** (`confidence_w [in, 1]`, `confidence_b [1]`): `raw_k = h_k . w[:H] +
  W1[prev_k] . w[H:] + b`; the `W1` part only when `in == H + r`.
- **Verify width per row**, from the census's `verify_policy`:
  - `ladder`: `clamp(m + 2, min(3, cap), cap)` after a round that accepted m (the cap when
    `adapt` is off, and before the first round);
  - `confidence`: keep slots while the running product of `sigmoid(raw)` stays >= tau;
  - `confidence-slot`: keep slots while each `sigmoid(raw)` >= tau.

  Both confidence policies give `clamp(1 + kept, 2, cap)`. With `verify_budget`, a batch's
  rows share one budget of drafts, spent on the highest running products (`budget_width`).
  Output never depends on the width: it only caps how many drafts are examined.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import struct

from dflash_jax import sampling as smp
from dflash_jax.cache import KVCache, init_kv
from dflash_jax.drafters import dflash
from dflash_jax.drafters.base import Proposal, ProposeSettings
from dflash_jax.drafters.dflash import DFlashDrafter, DFlashModule
from dflash_jax.targets.base import Target
from dflash_jax.targets.layers import INIT_STD, matmul

_normal, _zeros = nn.initializers.normal(INIT_STD), nn.initializers.zeros


class DSparkModule(DFlashModule):
    """The DFlash backbone plus `markov_w1`, `markov_w2`, `confidence_w`, `confidence_b` where present."""

    def setup(self):
        super().setup()
        c = self.cfg
        if c.markov_rank is not None:
            self.markov_w1 = self.param("markov_w1", _normal, (c.vocab_size, c.markov_rank))
            self.markov_w2 = self.param("markov_w2", _normal, (c.markov_rank, c.vocab_size))
        if c.confidence_in_dim is not None:
            self.confidence_w = self.param("confidence_w", _normal, (c.confidence_in_dim, 1))
            self.confidence_b = self.param("confidence_b", _zeros, (1,))

    def markov_embed(self, prev: jax.Array) -> jax.Array:
        """`W1[prev]`: `int[...] -> [..., r]`."""
        return jnp.take(self.markov_w1, prev, axis=0)

    def markov_bias(self, emb: jax.Array) -> jax.Array:
        """`W1[prev] @ W2`: `[..., r] -> float32[..., V]`."""
        return matmul(emb, self.markov_w2, preferred_element_type=jnp.float32)

    def confidence(self, rows: jax.Array, emb: Optional[jax.Array]) -> jax.Array:
        """`raw [..., nd]` from harvested rows `[..., nd, H]` and, for the Markov form, `W1[prev]`."""
        h = self.cfg.hidden_size
        w = self.confidence_w[:, 0].astype(jnp.float32)
        raw = matmul(rows.astype(jnp.float32), w[:h]) + self.confidence_b[0].astype(jnp.float32)
        if self.cfg.confidence_in_dim > h:
            raw = raw + matmul(emb.astype(jnp.float32), w[h:])
        return raw


init_params = functools.partial(dflash.init_params, module_cls=DSparkModule)
"""Float32 params: the backbone's, plus the heads the config has."""
param_shapes = functools.partial(dflash.param_shapes, module_cls=DSparkModule)


@struct.dataclass
class DSparkState:
    """kv: the draft context cache. ladder: int32[B] `m + 2` of the row's last round (the ladder's
    input; `n_drafts + 1` before the first round, so the ladder starts at the cap)."""

    kv: KVCache
    ladder: jax.Array

    @property
    def seq_len(self) -> jax.Array:
        return self.kv.seq_len


@struct.dataclass
class DSparkPending:
    """start: int32[B] where the last `ingest` wrote. verified: whether it was a verified block."""

    start: jax.Array
    verified: bool = struct.field(pytree_node=False)


def confidence_width(raw: jax.Array, tau: float, cap: int, running: bool) -> jax.Array:
    """Verify width from confidence logits `raw [B, nd]`: `clamp(1 + kept, 2, max(cap, 2))`, where kept
    counts leading slots whose sigmoid (`running`: the running product of sigmoids) is >= tau."""
    p = jax.nn.sigmoid(raw.astype(jnp.float32))
    if running:
        p = jnp.cumprod(p, axis=-1)
    kept = jnp.sum(jnp.cumprod((p >= tau).astype(jnp.int32), axis=-1), axis=-1)
    return jnp.clip(1 + kept, 2, max(cap, 2)).astype(jnp.int32)


def budget_width(raw: jax.Array, budget: int, cap: int) -> jax.Array:
    """Verify widths that spend `budget` drafts across the batch on the slots with the highest running
    product of `sigmoid(raw [B, nd])`, DSpark's batch scheduler. The product falls along a row, so
    each row's share is a prefix; widths are `clamp(1 + share, 2, cap)` (so a row checks at least one
    draft, and the batch may check a little more than the budget)."""
    survival = jnp.cumprod(jax.nn.sigmoid(raw.astype(jnp.float32)), axis=-1)
    flat = survival.reshape(-1)
    threshold = jax.lax.top_k(flat, min(budget, flat.shape[0]))[0][-1]
    kept = jnp.sum(jnp.cumprod((survival >= threshold).astype(jnp.int32), axis=-1), axis=-1)
    return jnp.clip(1 + kept, 2, max(cap, 2)).astype(jnp.int32)


def ladder_width(ladder: jax.Array, cap: int) -> jax.Array:
    """`clamp(m + 2, min(3, cap), cap)`: the original clamps to [3, cap] and panics when cap < 3."""
    return jnp.clip(ladder, min(3, cap), cap).astype(jnp.int32)


class DSparkDrafter(DFlashDrafter):
    """A DSpark drafter: `DSparkModule` applied purely; its state adds the ladder to the context cache."""

    module_cls = DSparkModule

    @property
    def varies_width(self) -> bool:
        """Every policy but the ladder pinned at the cap sizes widths per round and row."""
        return self.config.verify_policy != "ladder" or self.config.adapt

    def init_state(self, batch: int, capacity: int) -> DSparkState:
        c = self.config
        kv = init_kv(batch, capacity, c.num_layers, c.num_kv_heads, c.head_dim, self.params["fc"].dtype)
        return DSparkState(kv, jnp.full((batch,), self.n_drafts + 1, jnp.int32))

    def ingest(self, state: DSparkState, taps: jax.Array, start: jax.Array, proposal: Optional[Proposal] = None):
        kv, _ = super().ingest(state.kv, taps, start)
        return state.replace(kv=kv), DSparkPending(start, proposal is not None)

    def commit(self, state: DSparkState, pending: DSparkPending, kept: jax.Array) -> DSparkState:
        """Keep `kept` positions; after a verified round (kept = m + 1) the ladder's input becomes m + 2."""
        kv = super().commit(state.kv, pending.start, kept)
        ladder = jnp.where(kept > 0, kept + 1, state.ladder) if pending.verified else state.ladder
        return DSparkState(kv, ladder.astype(jnp.int32))

    def draft_hidden(self, state: DSparkState, x: jax.Array, impl: str = "xla") -> jax.Array:
        return super().draft_hidden(state.kv, x, impl)

    def teacher_forced(self, logits: jax.Array, rows: jax.Array, prev: jax.Array) -> tuple:
        """Training: `(logits with the Markov bias, confidence raw or None)` for harvested `logits [..., nd, V]`
        and rows `[..., nd, H]` when slot k's predecessor is the given `prev [..., nd]` (the text's token)."""
        c = self.config
        emb = self._apply(DSparkModule.markov_embed, prev) if c.markov_rank is not None else None
        if c.markov:
            logits = logits + self._apply(DSparkModule.markov_bias, emb)
        raw = self._apply(DSparkModule.confidence, rows, emb) if c.confidence_in_dim is not None else None
        return logits, raw

    def propose(self, state: DSparkState, target: Target, anchor: jax.Array, rp: smp.RowParams, counter: jax.Array,
                settings: ProposeSettings) -> Proposal:
        c = self.config
        h = self.draft_hidden(state, self.block_input(target, anchor), settings.impl)
        rows = h[:, c.first_row:]
        logits = self.harvest_logits(target, h)
        sample = settings.proposal == "sample" and not settings.greedy
        keys = smp.rng_key(rp.seed, counter, smp.STREAM_DRAFT)
        heads = c.markov_rank is not None

        def slot(prev, xs):
            k, lk = xs
            emb = self._apply(DSparkModule.markov_embed, prev) if heads else None
            if c.markov:
                lk = lk + self._apply(DSparkModule.markov_bias, emb)
            if sample:
                logp = smp.filtered_logprobs(lk, rp)
                tok = smp.sample(logp, jax.vmap(lambda key: jax.random.fold_in(key, k))(keys))
                q = jnp.exp(logp)
            else:
                tok, q = jnp.argmax(lk, -1).astype(jnp.int32), None
            return tok, (tok, emb, q, lk)

        nd = logits.shape[1]
        _, (drafts, emb, q, chained) = jax.lax.scan(slot, anchor.astype(jnp.int32),
                                                    (jnp.arange(nd), jnp.moveaxis(logits, 1, 0)))
        drafts, chained = jnp.moveaxis(drafts, 0, 1), jnp.moveaxis(chained, 0, 1)
        qdist = smp.DenseQ(jnp.moveaxis(q, 0, 1)) if sample else smp.OneHotQ()
        cap = settings.verify_cap
        if c.verify_policy == "ladder":
            width = ladder_width(state.ladder, cap) if c.adapt else jnp.full(anchor.shape, cap, jnp.int32)
        else:
            raw = self._apply(DSparkModule.confidence, rows, None if emb is None else jnp.moveaxis(emb, 0, 1))
            width = (budget_width(raw, c.verify_budget, cap) if c.verify_budget is not None else
                     confidence_width(raw, c.verify_tau, cap, c.verify_policy == "confidence"))
        return Proposal(drafts=drafts, q=qdist, verify_width=width, logits=chained)
