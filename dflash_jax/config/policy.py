"""Host-side policy (docs/architecture.md, "Policy"): explicit keyword > `DFLASH_*` environment variable > census.

This is the only module that reads the environment. Unknown values are refused with a
message naming the setting, the value and the choices; an empty variable counts as unset.
"""
from __future__ import annotations

import os
from typing import Mapping, Optional, Sequence

import jax.numpy as jnp

ENV_PREFIX = "DFLASH_"


def env_name(name: str) -> str:
    """The environment variable of a setting: 'harvest' -> 'DFLASH_HARVEST'."""
    return ENV_PREFIX + name.upper().replace("-", "_")


def resolution(
    name: str,
    kwarg: Optional[str],
    census_default: str,
    choices: Sequence[str],
    env: Optional[Mapping[str, str]] = os.environ,
) -> tuple[str, str]:
    """(value, source) where source says who decided: 'keyword', 'DFLASH_<NAME>' or 'census'."""
    env = os.environ if env is None else env
    if kwarg is not None:
        value, source = kwarg, "keyword"
    elif env.get(env_name(name)):
        value, source = env[env_name(name)], env_name(name)
    else:
        value, source = census_default, "census"
    if value not in choices:
        shown = f"{name}={value!r} (keyword)" if source == "keyword" else f"{source}={value!r}"
        raise ValueError(f"{shown}: unknown {name}; choices: {', '.join(choices)}")
    return value, source


def resolve_choice(
    name: str,
    kwarg: Optional[str],
    census_default: str,
    choices: Sequence[str],
    env: Optional[Mapping[str, str]] = os.environ,
) -> str:
    """The value of a setting with choices, resolved keyword > environment > census."""
    return resolution(name, kwarg, census_default, choices, env)[0]


def verify_cap(kwarg: Optional[int], n_drafts: int, env: Optional[Mapping[str, str]] = os.environ) -> int:
    """Largest verify width vt (anchor + drafts checked): keyword > DFLASH_VERIFY_T > n_drafts + 1.

    Valid caps are 2..n_drafts+1 (at least one draft checked, at most all of them).
    """
    env = os.environ if env is None else env
    if kwarg is not None:
        raw, source = kwarg, "verify_t (keyword)"
    else:
        raw, source = env.get(env_name("verify_t")), env_name("verify_t")
    if raw is None or raw == "":
        return n_drafts + 1
    if isinstance(raw, str):
        cap = int(raw) if raw.strip().isdigit() else None
    else:
        cap = raw if isinstance(raw, int) and not isinstance(raw, bool) else None
    if cap is None or not 2 <= cap <= n_drafts + 1:
        raise ValueError(f"{source}={raw!r}: verify cap must be an integer in 2..{n_drafts + 1} (n_drafts + 1)")
    return cap


def clamp_vt(m_plus_2, cap: int):
    """Ladder window after a round that accepted m: clamp m + 2 to [min(3, cap), cap].

    The original clamps to [3, cap] and panics when cap < 3 (docs/architecture.md, "Known defects of the original, fixed here"); works on Python
    ints and on integer arrays (inside jit).
    """
    if cap < 1:
        raise ValueError(f"verify cap {cap!r}: expected >= 1")
    low = min(3, cap)
    if isinstance(m_plus_2, int):
        return max(low, min(cap, m_plus_2))
    return jnp.clip(m_plus_2, low, cap)


ATTENTION_IMPLS = ("xla", "pallas")


def attention_impl(kwarg: Optional[str] = None, env: Optional[Mapping[str, str]] = os.environ,
                   backend: Optional[str] = None) -> str:
    """Attention implementation: keyword > DFLASH_ATTENTION > 'pallas' on GPU (faster at every
    benchmarked shape, bench/results/kernel_check.json), 'xla' elsewhere."""
    import jax

    default = "pallas" if (backend or jax.default_backend()) == "gpu" else "xla"
    return resolve_choice("attention", kwarg, default, ATTENTION_IMPLS, env)
