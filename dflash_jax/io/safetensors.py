"""Safetensors checkpoint folders: `config.json`, single or sharded weights, reading and writing.

Reading goes tensor by tensor from memory-mapped files, after the headers alone have been
checked; a shard index may only name files inside the checkpoint's own folder. Weights must be
stored as floats: F32, BF16 and F16 are read, F64 is cast (with a warning), and every tensor is
checked for NaN and Inf in the dtype it is loaded in, unless the caller turns that off.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import warnings
from typing import Iterable, Mapping, Optional

import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from dflash_jax.config import CheckpointError, dtype_name
from dflash_jax.config.common import OverrideError, stored_dtype

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
"""The safetensors dtypes a weight may be stored in; F64 is cast to the load dtype."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lives and what its header says, without reading its data."""

    file: str
    shape: tuple
    dtype: str  # safetensors name, e.g. 'BF16'


def config_file(path) -> str:
    return os.path.join(os.fspath(path), "config.json")


def _read_json(file: str, what: str):
    try:
        with open(file, encoding="utf-8") as fh:
            return json.load(fh)
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{file}: not UTF-8 text ({e.reason} at byte {e.start}); expected {what}") from e
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: not valid JSON ({e}); expected {what}") from e


def read_config(path) -> dict:
    """`config.json` of a checkpoint directory, refused with the path when absent, not UTF-8 JSON, or not
    a JSON object."""
    file = config_file(path)
    if not os.path.isfile(file):
        raise CheckpointError(f"{path}: no config.json (expected a Hugging Face checkpoint directory)")
    config = _read_json(file, "a JSON object of config fields")
    if not isinstance(config, dict):
        raise CheckpointError(f"{file}: holds a JSON {type(config).__name__}, {config!r:.40}; "
                              "expected a JSON object of config fields")
    return config


@contextlib.contextmanager
def naming_config(path):
    """Census refusals raised inside, with `path`'s config.json named: the file whose fields they are about
    (a refused keyword override is the caller's, and passes unchanged)."""
    try:
        yield
    except OverrideError:
        raise
    except CheckpointError as e:
        raise CheckpointError(f"{e} (in {config_file(path)})") from e


def _open(file: str):
    try:
        return safe_open(file, framework="numpy")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file}: unreadable safetensors header ({e})") from e


def tensor_index(path) -> dict:
    """name -> TensorInfo for `model.safetensors` or the shards of `model.safetensors.index.json`."""
    path = os.fspath(path)
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        weight_map = _weight_map(index)
        files = sorted(set(weight_map.values()))
        escaping = [f for f in files if os.path.basename(f) != f or f in ("", ".", "..")]
        if escaping:
            raise CheckpointError(f"{index} names shard(s) {escaping[:4]} outside the checkpoint folder; "
                                  "shards must be plain file names in the same folder")
    elif os.path.isfile(os.path.join(path, SINGLE_FILE)):
        weight_map, files = None, [SINGLE_FILE]
    else:
        raise CheckpointError(f"{path}: no {SINGLE_FILE} and no {INDEX_FILE}")
    infos = {}
    for name in files:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"{index} lists shard {name}, which is not in {path}")
        with _open(file) as fh:
            for key in fh.keys():
                sl = fh.get_slice(key)
                infos[key] = TensorInfo(file, tuple(sl.get_shape()), sl.get_dtype())
    if weight_map is not None:
        absent = sorted(n for n, f in weight_map.items()
                        if n not in infos or os.path.basename(infos[n].file) != os.path.basename(f))
        if absent:
            raise CheckpointError(f"{index} lists tensors that are not in their shard: {absent[:8]}")
    return infos


def _weight_map(index: str) -> dict:
    """The index's `weight_map`: tensor name -> shard file name, refused unless an object of strings."""
    doc = _read_json(index, "a safetensors index")
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: weight_map is {weight_map!r:.40}; expected an object mapping "
                              "tensor names to shard file names")
    bad = [f"{n}: {f!r}" for n, f in weight_map.items() if not isinstance(f, str)]
    if bad:
        raise CheckpointError(f"{index}: weight_map values must be shard file names (strings); got {bad[:4]}")
    return weight_map


def check_float_tensors(infos: Mapping, names: Iterable[str]) -> None:
    """Refuse weights among `names` not stored as F32, BF16, F16 or F64, naming each tensor, its file and dtype:
    an integer or bool tensor where a float weight belongs is a broken checkpoint, and float8 checkpoints
    are quantized with scales held in other tensors, which a plain cast would drop."""
    bad = sorted(n for n in names if n in infos and infos[n].dtype not in ST_DTYPES)
    if not bad:
        return
    listed = "; ".join(f"{n} is {infos[n].dtype} in {infos[n].file}" for n in bad[:8])
    more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
    quantized = any(infos[n].dtype.startswith("F8") for n in bad)
    raise CheckpointError(
        f"{len(bad)} weight tensor(s) not stored as floats: {listed}{more}; supported: "
        f"{', '.join(ST_DTYPES)} (F64 is cast)"
        + ("; float8 checkpoints are quantized (their scales live in other tensors, which dflash-jax does not "
           "apply): use the checkpoint's bf16 or f32 release" if quantized else ""))


_EXPONENT_BITS = {np.dtype(jnp.bfloat16): 0x7F80, np.dtype(np.float16): 0x7C00}


def _count_non_finite(x: np.ndarray) -> int:
    """NaN and Inf values in `x`, in one pass. A 16-bit float is non-finite when its exponent bits are all
    set; testing them is twice as fast as `np.isfinite` on bfloat16 or float16."""
    exponent = _EXPONENT_BITS.get(x.dtype)
    if exponent is None:
        return x.size - np.count_nonzero(np.isfinite(x))
    return np.count_nonzero((x.view(np.uint16) & exponent) == exponent)


PACKED_ST_DTYPES = {"int8": "I8", "uint8": "U8", "float16": "F16", "float32": "F32"}
"""Safetensors dtypes of the packed values and scales of a checkpoint saved quantised (`io/names.py`)."""


def check_packed_tensors(infos: Mapping, expected: Mapping) -> None:
    """Refuse packed tensors (name -> numpy dtype name they must hold) stored in another dtype, naming each."""
    bad = sorted(n for n, d in expected.items() if n in infos and infos[n].dtype != PACKED_ST_DTYPES[d])
    if bad:
        listed = "; ".join(f"{n} is {infos[n].dtype} in {infos[n].file}, expected {PACKED_ST_DTYPES[expected[n]]}"
                           for n in bad[:8])
        raise CheckpointError(f"{len(bad)} quantised tensor(s) stored in the wrong dtype for their format: {listed}")


@contextlib.contextmanager
def tensor_reader(infos: Mapping, dtype: str, check_finite: bool = True):
    """`get(name, raw=False) -> np.ndarray` in `dtype` (`raw`: as stored, for packed quantised tensors),
    reading one tensor at a time from open shards.

    With `check_finite`, a float tensor holding NaN or Inf once in `dtype` (F32 values beyond float16's range
    become Inf) is refused, naming the file, the tensor and the count. F64 tensors are cast to `dtype`,
    with one warning for all of them when reading ends."""
    np_dtype = jnp.dtype(dtype)
    cast = []
    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(_open(f)) for f in sorted({i.file for i in infos.values()})}

        def get(name, raw: bool = False):
            info = infos[name]
            with np.errstate(over="ignore" if check_finite else "warn"):  # an overflow is refused below
                x = handles[info.file].get_tensor(name)
                x = x if raw else x.astype(np_dtype, copy=False)
            if info.dtype == "F64":
                cast.append(name)
            if check_finite and info.dtype in ST_DTYPES:
                bad = _count_non_finite(x)
                if bad:
                    stored = "" if str(x.dtype) == ST_DTYPES.get(info.dtype) else f" (stored as {info.dtype})"
                    raise CheckpointError(
                        f"{info.file}: tensor {name} has {bad} non-finite value(s) (NaN or Inf) of {x.size} in "
                        f"{x.dtype}{stored}; such weights make every row emit garbage. Pass check_finite=False "
                        "to load it anyway")
            return x

        yield get
    if cast:
        files = sorted({infos[n].file for n in cast})
        warnings.warn(f"{len(cast)} float64 tensor(s) ({', '.join(cast[:4])}{', ...' if len(cast) > 4 else ''}) "
                      f"of {', '.join(files)} cast to {dtype}", stacklevel=3)


def load_dtype(requested, config: Mapping, infos: Mapping, probe: str) -> str:
    """Requested dtype; else the config's (`dtype`/`torch_dtype`); else the dtype `probe` is stored in.
    A stored float64 is computed in float32."""
    if requested is not None:
        return dtype_name(requested)
    if not (config.get("dtype") or config.get("torch_dtype")) and probe in infos:
        return stored_dtype({"dtype": ST_DTYPES.get(infos[probe].dtype, infos[probe].dtype)})
    return stored_dtype(config)


def write_tensors(path: str, tensors: Mapping, shard_bytes: Optional[int]) -> None:
    """`model.safetensors`, or shards of at most about `shard_bytes` plus the index."""
    if shard_bytes is None:
        save_file(dict(tensors), os.path.join(path, SINGLE_FILE), metadata={"format": "pt"})
        return
    shards, size = [[]], 0
    for name, arr in tensors.items():
        if shards[-1] and size + arr.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += arr.nbytes
    weight_map = {}
    for k, names in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in names})
    total = sum(a.nbytes for a in tensors.values())
    with open(os.path.join(path, INDEX_FILE), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)


def write_config(path: str, config: Mapping) -> None:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2)
