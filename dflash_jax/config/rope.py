"""Rotary embedding settings from either transformers config form (`rope_theta` + `rope_scaling`, or
`rope_parameters`)."""
from __future__ import annotations

import dataclasses
from typing import Mapping

from dflash_jax.config.common import CheckpointError, boolean, finite_number, positive_int, positive_number


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: `rope_type` in {'default', 'llama3', 'yarn'} and its parameters.

    `params` holds the scaling parameters as a sorted tuple of (name, value) pairs so the
    config stays hashable (e.g. ('factor', 8.0), ('original_max_position_embeddings', 8192)).
    """

    theta: float
    rope_type: str = "default"
    params: tuple = ()

    def get(self, name: str, default=None):
        return dict(self.params).get(name, default)



ROPE_TYPES = ("default", "llama3", "yarn")
ROPE_PARAM_NAMES = (
    "factor",
    "original_max_position_embeddings",
    "low_freq_factor",
    "high_freq_factor",
    "beta_fast",
    "beta_slow",
    "attention_factor",
    "mscale",
    "mscale_all_dim",
    "truncate",
)
_ROPE_REQUIRED = {
    "default": (),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor",),
}
_DEFAULT_ROPE_THETA = 10000.0  # transformers' default for Llama and Qwen3


def _check_param(name: str, value) -> None:
    """Refuse a scaling parameter not of its kind: a positive integer, a flag, a finite number (the
    mscales), or else a finite number > 0 (the factors and betas divide or take logarithms)."""
    if name == "original_max_position_embeddings":
        positive_int(value, name)
    elif name == "truncate":
        boolean(value, name)
    elif name in ("mscale", "mscale_all_dim"):
        finite_number(value, name)
    else:
        positive_number(value, name)


def rope_from_hf(d: Mapping) -> RopeConfig:
    """Rope from either transformers form: 4 (`rope_theta` + `rope_scaling`) or 5 (`rope_parameters`).

    The scaling dict may name its type `rope_type` or (older) `type`; no scaling means
    'default'. Unknown types, missing required parameters and partial rotary are refused.
    """
    rp = d.get("rope_parameters")
    if rp:
        if not isinstance(rp, Mapping) or any(isinstance(v, Mapping) for v in rp.values()):
            raise CheckpointError(
                f"rope_parameters {rp!r}: expected one flat dict (per-layer-type rope is not "
                "supported for these models)"
            )
        scaling = dict(rp)
        theta = rp.get("rope_theta", d.get("rope_theta", _DEFAULT_ROPE_THETA))
    else:
        scaling = d.get("rope_scaling") or {}
        if not isinstance(scaling, Mapping):
            raise CheckpointError(f"rope_scaling {scaling!r}: expected an object of scaling parameters or null")
        scaling = dict(scaling)
        theta = d.get("rope_theta", _DEFAULT_ROPE_THETA)
    rope_type = scaling.get("rope_type", scaling.get("type")) or "default"
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(
            f"rope type {rope_type!r} is not supported; supported rope types: {', '.join(ROPE_TYPES)}"
        )
    partial = scaling.get("partial_rotary_factor", d.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise CheckpointError(f"partial_rotary_factor {partial!r}: only full rotary (1.0) is supported")
    positive_number(theta, "rope_theta")
    if rope_type in ("llama3", "yarn") and scaling.get("original_max_position_embeddings") is None:
        scaling["original_max_position_embeddings"] = d.get("max_position_embeddings")  # as transformers does
        if scaling["original_max_position_embeddings"] is not None:
            positive_int(scaling["original_max_position_embeddings"], "max_position_embeddings")
    params = tuple(sorted((k, scaling[k]) for k in ROPE_PARAM_NAMES if scaling.get(k) is not None))
    for name, value in params:
        _check_param(name, value)
    missing = [k for k in _ROPE_REQUIRED[rope_type] if k not in dict(params)]
    if missing:
        raise CheckpointError(f"rope type {rope_type!r} needs {', '.join(missing)} in its scaling parameters")
    return RopeConfig(theta=float(theta), rope_type=rope_type, params=params if rope_type != "default" else ())


def rope_to_hf(rope: RopeConfig) -> dict:
    """The transformers-4 form (`rope_theta`, `rope_scaling`) that every transformers version reads."""
    scaling = None if rope.rope_type == "default" else {"rope_type": rope.rope_type, **dict(rope.params)}
    return {"rope_theta": rope.theta, "rope_scaling": scaling}
