"""`generate`: plain decoding when `drafter` is None, else a speculative session run to the end."""
from __future__ import annotations

from typing import Optional, Sequence

from dflash_jax import sampling as smp
from dflash_jax.decode import Result, plain_generate
from dflash_jax.nn.dense import Target
from dflash_jax.nn.drafter import Drafter
from dflash_jax.session import Session


def generate(target: Target, drafter: Optional[Drafter], prompts, *, max_new_tokens: int, stop_tokens=(),
             sampling: smp.Sampling | Sequence[smp.Sampling] = smp.Sampling(), capacity: Optional[int] = None,
             impl: Optional[str] = None, verify_t: Optional[int] = None) -> Result:
    """Generate up to `max_new_tokens` per prompt, exactly as the target alone would.

    prompts: a list of token-id lists (ragged) or a 2-D int array. stop_tokens: ids that end
    a row (kept in its output). sampling: one `Sampling` for all rows or one per row
    (temperature 0 is greedy). verify_t caps the drafts examined per round (speculative only).
    Returns `Result(tokens, stats)`; one compiled program is reused for calls with the same
    static shapes.
    """
    if drafter is None:
        return plain_generate(target, prompts, max_new_tokens=max_new_tokens, stop_tokens=stop_tokens,
                              sampling=sampling, capacity=capacity, impl=impl)
    return Session(target, drafter, prompts, max_new_tokens=max_new_tokens, stop_tokens=stop_tokens,
                   sampling=sampling, capacity=capacity, impl=impl, verify_t=verify_t).run()
