"""The Drafter interface: what the speculative round may ask of a drafter (docs/architecture.md).

A drafter family is a frozen config (static) plus a parameter pytree, applied purely through
its Flax module. It reads the target only through the Target interface (`embed`, `logits`)
and the taps the target's `extend` returns. Its state is a pytree with `seq_len: int32[B]`
(context positions held per row); the rest belongs to the family.

The family owns its harvest (which block rows are drafts), its heads, and the verify width
it wants each round (`Proposal.verify_width`): the round checks at most `verify_width - 1`
drafts of each row, and never looks at the family's state.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, Optional

import jax
import numpy as np
from flax import struct

from dflash_jax import quant
from dflash_jax import sampling as smp
from dflash_jax.config import policy
from dflash_jax.targets.base import ClassKeyedNode, Target
from pallas_kernels import quant_matmul as qmm


@struct.dataclass
class Proposal:
    """One round's proposal.

    drafts: int32[B, nd] proposed tokens, slot k verified at offset k + 1 after the anchor.
    q: the proposal distribution (`sampling.OneHotQ`, `DenseQ` or `SparseQ`) for rejection sampling.
    verify_width: int32[B] anchor plus drafts the target checks this round (2..nd + 1).
    logits: float32[B, nd, V] the harvested rows' logits where the family has them (inspection).
    """

    drafts: jax.Array
    q: Any
    verify_width: jax.Array
    logits: Optional[jax.Array] = None


@dataclasses.dataclass(frozen=True)
class ProposeSettings:
    """Static settings of a round's proposal.

    greedy: every row has temperature 0. proposal: 'argmax' (one-hot q) or 'sample' (slots
    drawn from the filtered draft distribution). impl: attention implementation ('xla' |
    'pallas'). verify_cap: the largest verify width (anchor + drafts) a round may use.
    """

    greedy: bool
    proposal: str
    impl: str
    verify_cap: int


class Drafter(ClassKeyedNode, abc.ABC):
    """A drafter: `config` (static, a census `DrafterConfig`), `params` (a plain pytree) and `head`: None, or the
    copy of the target's LM head that `with_head` made in the drafter's precision, read in place of the target's."""

    config: Any = struct.field(pytree_node=False)
    params: dict
    head: Optional[quant.QWeight] = None

    def with_head(self, target: Target, enabled: Optional[bool] = None, env=None, xp=np) -> "Drafter":
        """This drafter proposing through its own copy of `target`'s LM head, in the format its precision gives
        the LM head group (`quant.role_format`: int8, q8_0 or q4_0; bf16 and mixed keep it float, and so make
        none): the head is read for every draft row each round, so it weighs as much as the drafter's layers.
        The target still decides every token, so the output does not change; acceptance may. Made when
        `enabled` (keyword > DFLASH_PROPOSAL_HEAD > on) and the target's head is float; the copy is encoded on
        the host as `quant.quantize` encodes (`xp=jax.numpy`: on the device, as `quant.quantize_array` says),
        and placed on the devices the target's head is on."""
        on, _ = policy.switch("proposal_head", enabled, True, env)
        fmt = quant.role_format(quant.precision_of(self.params), "lm head")
        w = target.head_weight()
        if not on or fmt is None or quant.is_quantized(w):
            return self.replace(head=None)
        head = quant.quantize_array(w, fmt, path="proposal head", xp=xp)
        if len(w.sharding.device_set) > 1:
            head = jax.device_put(head, w.sharding)
        return self.replace(head=head)

    def reads_head_copy(self, rows: int) -> bool:
        """Whether `rows` draft rows go through the drafter's copy of the head: it has one, and the quantised
        kernels take that many rows (`quant_matmul.kernel_takes`: up to 64, batch 4 at block 16); past them the
        product would expand the whole copy first, so wider batches read the target's head."""
        return self.head is not None and qmm.kernel_takes(rows, *self.head.shape)

    @property
    def n_drafts(self) -> int:
        """Drafts per round, nd (the family's harvest decides it)."""
        return self.config.n_drafts

    @property
    def varies_width(self) -> bool:
        """Whether the family's verify widths vary by round and row (then bucketed verifies can pay)."""
        return False

    @property
    def tap_ids(self) -> tuple:
        """The target layers whose outputs the drafter reads (`Target.extend`'s `tap_ids`)."""
        return tuple(self.config.target_layer_ids)

    @abc.abstractmethod
    def init_state(self, batch: int, capacity: int) -> Any:
        """An empty drafter state (`seq_len` 0), every leaf a distinct buffer: the loops donate it."""

    @abc.abstractmethod
    def ingest(self, state, taps: jax.Array, start: jax.Array, proposal: Optional[Proposal] = None):
        """Context from the target: taps `[B, W, n_taps*H]` of positions `start[b] + i`.

        `proposal` is the one whose block the target just verified (None for prompt context), for
        families whose state follows their own rounds. Returns `(state, pending)`; `state.seq_len`
        is not moved until `commit`."""

    @abc.abstractmethod
    def propose(self, state, target: Target, anchor: jax.Array, rp: smp.RowParams, counter: jax.Array,
                settings: ProposeSettings) -> Proposal:
        """Draft one block after `anchor int32[B]` (the token at `state.seq_len`).

        `rp` are the rows' sampling parameters and `counter` their random-stream counters."""

    @abc.abstractmethod
    def commit(self, state, pending, kept: jax.Array):
        """Keep the first `kept[b]` positions of the last `ingest` (0 keeps none): the only rollback."""
