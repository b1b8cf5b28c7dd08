"""Safetensors checkpoint folders: `config.json`, single or sharded weights, reading and writing.

Reading goes tensor by tensor from memory-mapped files, after the headers alone have been
checked; a shard index may only name files inside the checkpoint's own folder.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from typing import Mapping, Optional

import jax.numpy as jnp
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from dflash_jax.config import CheckpointError, dtype_name

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lives and what its header says, without reading its data."""

    file: str
    shape: tuple
    dtype: str  # safetensors name, e.g. 'BF16'


def read_config(path) -> dict:
    """`config.json` of a checkpoint directory, refused with the path when absent or not JSON."""
    file = os.path.join(os.fspath(path), "config.json")
    if not os.path.isfile(file):
        raise CheckpointError(f"{path}: no config.json (expected a Hugging Face checkpoint directory)")
    try:
        with open(file) as fh:
            return json.load(fh)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from e


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
        try:
            with open(index) as fh:
                weight_map = json.load(fh)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index with a weight_map ({e!r})") from e
        files = sorted(set(weight_map.values()))
        escaping = [f for f in files if not isinstance(f, str) or os.path.basename(f) != f or f in ("", ".", "..")]
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


@contextlib.contextmanager
def tensor_reader(infos: Mapping, dtype: str):
    """`get(name) -> np.ndarray` in `dtype`, reading one tensor at a time from open shards."""
    np_dtype = jnp.dtype(dtype)
    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(_open(f)) for f in sorted({i.file for i in infos.values()})}

        def get(name):
            return handles[infos[name].file].get_tensor(name).astype(np_dtype, copy=False)

        yield get


def load_dtype(requested, config: Mapping, infos: Mapping, probe: str) -> str:
    """Requested dtype; else the config's (`dtype`/`torch_dtype`); else the dtype `probe` is stored in."""
    if requested is not None:
        return dtype_name(requested)
    stored = config.get("dtype") or config.get("torch_dtype")
    if stored is None and probe in infos:
        stored = ST_DTYPES.get(infos[probe].dtype, infos[probe].dtype)
    return dtype_name(stored or "float32")


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
