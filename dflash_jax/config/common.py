"""Host-side pieces every census shares: the refusal type, dtype names, small readers, shape checks.

Everything under `config/` runs once on the host, before tracing; its dataclasses are
frozen and hashable so they can be static arguments of jitted functions.
"""
from __future__ import annotations

import math
from typing import Mapping

import numpy as np


class CheckpointError(ValueError):
    """A checkpoint we cannot run: the message names the problem and the valid choices."""


class OverrideError(CheckpointError):
    """A refused keyword override of a checkpoint field: about the caller's value, not the file's."""



class AttentionWidths:
    """Projection widths of a config with `num_heads`, `num_kv_heads` and `head_dim`."""

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim



DTYPES = ("float32", "bfloat16", "float16")


def dtype_name(dtype) -> str:
    """Normalise 'bfloat16' / 'bf16' / jnp.bfloat16 / np.float32 ... to one of DTYPES."""
    aliases = {"bf16": "bfloat16", "fp16": "float16", "f16": "float16", "half": "float16",
               "fp32": "float32", "f32": "float32", "float": "float32"}
    if isinstance(dtype, str):
        name = aliases.get(dtype.lower(), dtype.lower())
    else:
        try:
            name = np.dtype(dtype).name
        except (TypeError, ValueError):
            name = repr(dtype)
    if name not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not supported; choices: {', '.join(DTYPES)}")
    return name


def stored_dtype(d: Mapping) -> str:
    """The dtype a config records (`dtype`, or transformers 4's `torch_dtype`; float32 when neither).
    float64 is computed in float32: the tensors are cast on loading, with a warning."""
    dtype = d.get("dtype") or d.get("torch_dtype") or "float32"
    return "float32" if dtype == "float64" else dtype_name(dtype)


def require(d: Mapping, key: str, what: str):
    if d.get(key) is None:
        raise CheckpointError(f"{what} config.json has no {key!r}")
    return d[key]


def positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CheckpointError(f"{name} {value!r}: expected a positive integer")
    return value


def finite_number(value, name: str) -> float:
    """`value` as a float; refused unless a JSON number that is finite (JSON readers accept NaN and Infinity)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CheckpointError(f"{name} {value!r}: expected a finite number")
    return float(value)


def positive_number(value, name: str) -> float:
    if finite_number(value, name) <= 0:
        raise CheckpointError(f"{name} {value!r}: expected a finite number > 0")
    return float(value)


def boolean(value, name: str, default: bool = False) -> bool:
    """A true/false value; null is `default`, and a string such as "false" is refused, not read as true."""
    if value is None:
        return default
    if not isinstance(value, bool):
        raise CheckpointError(f"{name} {value!r}: expected true or false")
    return value


def flag(d: Mapping, key: str, default: bool = False) -> bool:
    """The true/false field `key` of `d` (see `boolean`)."""
    return boolean(d.get(key), key, default)


def token_ids(value, name: str) -> tuple:
    """A token id or a list of them (as `eos_token_id` holds), each an integer >= 0; null is none."""
    ids = () if value is None else tuple(value) if isinstance(value, (list, tuple)) else (value,)
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
        raise CheckpointError(f"{name} {value!r}: expected a token id >= 0 or a list of them")
    return ids


def string_list(value, name: str) -> list:
    """A list of strings (as `architectures` and `layer_types` hold); null is empty."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise CheckpointError(f"{name} {value!r}: expected a list of strings")
    return list(value)


def head_dim(d: Mapping, hidden: int, heads: int) -> int:
    """`head_dim` when given; otherwise hidden_size // num_attention_heads (transformers' rule)."""
    if d.get("head_dim") is not None:
        return positive_int(d["head_dim"], "head_dim")
    if hidden % heads:
        raise CheckpointError(
            f"no head_dim and hidden_size {hidden} is not divisible by num_attention_heads {heads}"
        )
    return hidden // heads


def kv_heads(d: Mapping, heads: int) -> int:
    given = d.get("num_key_value_heads")
    kv = positive_int(heads if given is None else given, "num_key_value_heads")
    if heads % kv:
        raise CheckpointError(
            f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv} (GQA groups)"
        )
    return kv


def _fmt_shape(shape) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def check_tensor_shapes(expected: Mapping, found: Mapping, where: str) -> list:
    """Refuse missing tensors and shape mismatches; return the names `found` has beyond `expected`."""
    missing = [n for n in expected if n not in found]
    if missing:
        listed = "; ".join(f"{n} (expected {_fmt_shape(expected[n])})" for n in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise CheckpointError(f"{where}: {len(missing)} missing tensor(s): {listed}{more}")
    wrong = [n for n in expected if tuple(found[n]) != tuple(expected[n])]
    if wrong:
        listed = "; ".join(
            f"{n} has shape {_fmt_shape(found[n])}, expected {_fmt_shape(expected[n])}" for n in wrong[:8]
        )
        raise CheckpointError(f"{where}: shape mismatch: {listed}")
    return sorted(n for n in found if n not in expected)
