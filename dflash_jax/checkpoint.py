"""Hugging Face safetensors <-> parameter pytrees: names, layouts, precision.

The only place where weight layouts change: Hugging Face stores linear weights `[out, in]`,
our pytrees store them `[in, out]` (the forward does `x @ W`) with q|k|v (target), k|v
(drafter) and gate|up fused along the out axis. Loading goes tensor by tensor (memory-mapped
safetensors, one host copy at a time), after the census has checked every name and shape
from the headers alone.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import warnings
from typing import Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from dflash_jax.config import (
    FAMILY_NAMES,
    CheckpointError,
    DrafterConfig,
    TargetConfig,
    check_tensor_shapes,
    drafter_census,
    drafter_to_hf_config,
    dtype_name,
    is_ignorable_target_tensor,
    target_config_from_hf,
    target_tensor_shapes,
    target_to_hf_config,
)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SUPPORTED_DRAFTER_FAMILIES = ("dflash",)
_ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lives and what its header says, without reading its data."""

    file: str
    shape: tuple
    dtype: str  # safetensors name, e.g. 'BF16'


# ---------------------------------------------------------------------------------------
# Reading directories.


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
def _tensor_reader(infos: Mapping, dtype: str):
    """`get(name) -> np.ndarray` in `dtype`, reading one tensor at a time from open shards."""
    np_dtype = jnp.dtype(dtype)
    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(_open(f)) for f in sorted({i.file for i in infos.values()})}

        def get(name):
            return handles[infos[name].file].get_tensor(name).astype(np_dtype, copy=False)

        yield get


def _load_dtype(requested, config: Mapping, infos: Mapping, probe: str) -> str:
    """Requested dtype; else the config's (`dtype`/`torch_dtype`); else the dtype `probe` is stored in."""
    if requested is not None:
        return dtype_name(requested)
    stored = config.get("dtype") or config.get("torch_dtype")
    if stored is None and probe in infos:
        stored = _ST_DTYPES.get(infos[probe].dtype, infos[probe].dtype)
    return dtype_name(stored or "float32")


def _device(tree):
    return jax.tree.map(jnp.asarray, tree)


# ---------------------------------------------------------------------------------------
# Target.


def target_param_shapes(cfg: TargetConfig) -> dict:
    """The target pytree layout (COMMON.md) with shapes as leaves."""
    h, f, qkv = cfg.hidden_size, cfg.intermediate_size, cfg.q_width + 2 * cfg.kv_width
    layer = {"attn_norm": (h,), "wqkv": (h, qkv), "wo": (cfg.q_width, h),
             "mlp_norm": (h,), "w_gate_up": (h, 2 * f), "w_down": (f, h)}
    if cfg.attention_bias:
        layer.update(bqkv=(qkv,), bo=(h,))
    if cfg.qk_norm:
        layer.update(q_norm=(cfg.head_dim,), k_norm=(cfg.head_dim,))
    shapes = {"embed": (cfg.vocab_size, h), "layers": [dict(layer) for _ in range(cfg.num_layers)],
              "final_norm": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (h, cfg.vocab_size)
    return shapes


def inspect_target(path) -> tuple:
    """(TargetConfig, name -> TensorInfo) after checking every tensor name and shape; reads no weights."""
    cfg = target_config_from_hf(read_config(path))
    infos = tensor_index(path)
    found = {n: i.shape for n, i in infos.items() if not is_ignorable_target_tensor(n, cfg)}
    extra = check_tensor_shapes(target_tensor_shapes(cfg), found, f"{path}")
    if extra:
        raise CheckpointError(
            f"{path}: unexpected tensor(s) {extra[:8]}: not part of a {cfg.arch} target with this config"
        )
    return cfg, infos


def read_target(path, dtype=None) -> tuple:
    """(TargetConfig, params) from a Qwen3ForCausalLM / LlamaForCausalLM directory.

    dtype None keeps the checkpoint's dtype (its config's, else the embedding's); params are
    converted tensor by tensor and `cfg.dtype` records the dtype they hold.
    """
    cfg, infos = inspect_target(path)
    dtype = _load_dtype(dtype, read_config(path), infos, "model.embed_tokens.weight")
    with _tensor_reader(infos, dtype) as get:
        layers = [_device(_target_layer(cfg, get, f"model.layers.{i}.")) for i in range(cfg.num_layers)]
        params = {"embed": get("model.embed_tokens.weight"), "layers": layers, "final_norm": get("model.norm.weight")}
        if not cfg.tie_word_embeddings:
            params["lm_head"] = get("lm_head.weight").T
        params = _device(params)
    return dataclasses.replace(cfg, dtype=dtype), params


def _target_layer(cfg: TargetConfig, get, p: str) -> dict:
    a = p + "self_attn."
    layer = {
        "attn_norm": get(p + "input_layernorm.weight"),
        "wqkv": np.concatenate([get(a + f"{x}_proj.weight").T for x in "qkv"], axis=1),
        "wo": get(a + "o_proj.weight").T,
        "mlp_norm": get(p + "post_attention_layernorm.weight"),
        "w_gate_up": np.concatenate([get(p + "mlp.gate_proj.weight").T, get(p + "mlp.up_proj.weight").T], axis=1),
        "w_down": get(p + "mlp.down_proj.weight").T,
    }
    if cfg.attention_bias:
        layer["bqkv"] = np.concatenate([get(a + f"{x}_proj.bias") for x in "qkv"])
        layer["bo"] = get(a + "o_proj.bias")
    if cfg.qk_norm:
        layer["q_norm"] = get(a + "q_norm.weight")
        layer["k_norm"] = get(a + "k_norm.weight")
    return layer


def _check_params(expected, params, what: str) -> None:
    """Refuse a params pytree whose structure or leaf shapes differ from the config's layout."""
    exp_paths = dict(jax.tree_util.tree_flatten_with_path(expected, is_leaf=lambda x: isinstance(x, tuple))[0])
    got_paths = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    name = jax.tree_util.keystr
    if set(exp_paths) != set(got_paths):
        missing = sorted(name(k) for k in set(exp_paths) - set(got_paths))
        extra = sorted(name(k) for k in set(got_paths) - set(exp_paths))
        raise ValueError(f"{what} params do not match the config: missing {missing}, unexpected {extra}")
    wrong = [f"{name(k)} {tuple(np.shape(got_paths[k]))} (expected {s})"
             for k, s in exp_paths.items() if tuple(np.shape(got_paths[k])) != s]
    if wrong:
        raise ValueError(f"{what} params have wrong shapes: {wrong}")


def _host_converter(dtype):
    """`host(x, transpose=False)`: a contiguous numpy copy of x (optionally x.T) in `dtype`."""
    np_dtype = jnp.dtype(dtype_name(dtype))

    def host(x, transpose=False):
        x = np.asarray(x)
        return np.ascontiguousarray((x.T if transpose else x).astype(np_dtype))

    return host


def target_hf_tensors(cfg: TargetConfig, params, dtype="float32") -> dict:
    """Hugging Face name -> numpy array (`[out, in]`) for a target pytree, in `dtype`."""
    _check_params(target_param_shapes(cfg), params, "target")
    host = _host_converter(dtype)
    q, kv, f = cfg.q_width, cfg.kv_width, cfg.intermediate_size
    out = {"model.embed_tokens.weight": host(params["embed"]), "model.norm.weight": host(params["final_norm"])}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = host(params["lm_head"], True)
    for i, layer in enumerate(params["layers"]):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        wqkv, gu = np.asarray(layer["wqkv"]), np.asarray(layer["w_gate_up"])
        out.update({
            p + "input_layernorm.weight": host(layer["attn_norm"]),
            a + "q_proj.weight": host(wqkv[:, :q], True),
            a + "k_proj.weight": host(wqkv[:, q:q + kv], True),
            a + "v_proj.weight": host(wqkv[:, q + kv:], True),
            a + "o_proj.weight": host(layer["wo"], True),
            p + "post_attention_layernorm.weight": host(layer["mlp_norm"]),
            p + "mlp.gate_proj.weight": host(gu[:, :f], True),
            p + "mlp.up_proj.weight": host(gu[:, f:], True),
            p + "mlp.down_proj.weight": host(layer["w_down"], True),
        })
        if cfg.attention_bias:
            bqkv = np.asarray(layer["bqkv"])
            out.update({a + "q_proj.bias": host(bqkv[:q]), a + "k_proj.bias": host(bqkv[q:q + kv]),
                        a + "v_proj.bias": host(bqkv[q + kv:]), a + "o_proj.bias": host(layer["bo"])})
        if cfg.qk_norm:
            out[a + "q_norm.weight"] = host(layer["q_norm"])
            out[a + "k_norm.weight"] = host(layer["k_norm"])
    return out


def _write_tensors(path: str, tensors: Mapping, shard_bytes: Optional[int]) -> None:
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


def _write_config(path: str, config: Mapping) -> None:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2)


def write_target(path, cfg: TargetConfig, params, dtype="bfloat16", shard_bytes: Optional[int] = None) -> None:
    """Write a directory `transformers.AutoModelForCausalLM.from_pretrained` loads (and read_target)."""
    dtype = dtype_name(dtype)
    tensors = target_hf_tensors(cfg, params, dtype)
    path = os.fspath(path)
    _write_config(path, target_to_hf_config(dataclasses.replace(cfg, dtype=dtype)))
    _write_tensors(path, tensors, shard_bytes)


# ---------------------------------------------------------------------------------------
# Drafter.


def drafter_param_shapes(cfg: DrafterConfig) -> dict:
    """The DFlash drafter pytree layout (COMMON.md) with shapes as leaves."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    layer = {"attn_norm": (h,), "wq": (h, cfg.q_width), "wkv": (h, 2 * cfg.kv_width),
             "q_norm": (cfg.head_dim,), "k_norm": (cfg.head_dim,), "wo": (cfg.q_width, h),
             "mlp_norm": (h,), "w_gate_up": (h, 2 * f), "w_down": (f, h)}
    return {"fc": (cfg.n_taps * h, h), "hidden_norm": (h,), "norm": (h,),
            "layers": [dict(layer) for _ in range(cfg.num_layers)]}


def unsupported_family_message(cfg: DrafterConfig) -> str:
    """The refusal for a drafter family the census recognises but dflash-jax cannot run yet."""
    supported = ", ".join(f"{FAMILY_NAMES[f]} (DFlashDraftModel)" for f in SUPPORTED_DRAFTER_FAMILIES)
    return (f"{FAMILY_NAMES[cfg.family]} drafter detected ({'; '.join(cfg.reasons)}): not yet implemented "
            f"in dflash-jax; supported: {supported}")


def inspect_drafter(path, target_cfg: Optional[TargetConfig] = None, env=None, **overrides) -> tuple:
    """(DrafterConfig, name -> TensorInfo): the census with the checkpoint's tensor shapes; reads no weights."""
    infos = tensor_index(path)
    shapes = {n: i.shape for n, i in infos.items()}
    return drafter_census(read_config(path), shapes, target_cfg, env=env, **overrides), infos


def read_drafter(path, target_cfg: Optional[TargetConfig] = None, dtype=None, env=None, **overrides) -> tuple:
    """(DrafterConfig, params) from a z-lab DFlashDraftModel directory (DESIGN.md §4).

    Families the census recognises but we cannot run (DSpark, DFlash2) are refused; unknown
    tensors of a DFlash checkpoint are ignored with a warning (also in `cfg.warnings`).
    """
    cfg, infos = inspect_drafter(path, target_cfg, env=env, **overrides)
    if cfg.family not in SUPPORTED_DRAFTER_FAMILIES:
        raise CheckpointError(unsupported_family_message(cfg))
    for message in cfg.warnings:
        warnings.warn(f"{path}: {message}", stacklevel=2)
    dtype = _load_dtype(dtype, read_config(path), infos, "fc.weight")
    with _tensor_reader(infos, dtype) as get:
        layers = [_device(_drafter_layer(get, f"layers.{i}.")) for i in range(cfg.num_layers)]
        params = _device({"fc": get("fc.weight").T, "hidden_norm": get("hidden_norm.weight"),
                          "norm": get("norm.weight")})
    return cfg, {**params, "layers": layers}


def _drafter_layer(get, p: str) -> dict:
    a = p + "self_attn."
    return {
        "attn_norm": get(p + "input_layernorm.weight"),
        "wq": get(a + "q_proj.weight").T,
        "wkv": np.concatenate([get(a + "k_proj.weight").T, get(a + "v_proj.weight").T], axis=1),
        "q_norm": get(a + "q_norm.weight"),
        "k_norm": get(a + "k_norm.weight"),
        "wo": get(a + "o_proj.weight").T,
        "mlp_norm": get(p + "post_attention_layernorm.weight"),
        "w_gate_up": np.concatenate([get(p + "mlp.gate_proj.weight").T, get(p + "mlp.up_proj.weight").T], axis=1),
        "w_down": get(p + "mlp.down_proj.weight").T,
    }


def drafter_hf_tensors(cfg: DrafterConfig, params, dtype="float32") -> dict:
    """z-lab DFlashDraftModel name -> numpy array (`[out, in]`) for a drafter pytree, in `dtype`."""
    _check_params(drafter_param_shapes(cfg), params, "drafter")
    host = _host_converter(dtype)
    kv, f = cfg.kv_width, cfg.intermediate_size
    out = {"fc.weight": host(params["fc"], True), "hidden_norm.weight": host(params["hidden_norm"]),
           "norm.weight": host(params["norm"])}
    for i, layer in enumerate(params["layers"]):
        p, a = f"layers.{i}.", f"layers.{i}.self_attn."
        wkv, gu = np.asarray(layer["wkv"]), np.asarray(layer["w_gate_up"])
        out.update({
            p + "input_layernorm.weight": host(layer["attn_norm"]),
            a + "q_proj.weight": host(layer["wq"], True),
            a + "k_proj.weight": host(wkv[:, :kv], True),
            a + "v_proj.weight": host(wkv[:, kv:], True),
            a + "o_proj.weight": host(layer["wo"], True),
            a + "q_norm.weight": host(layer["q_norm"]),
            a + "k_norm.weight": host(layer["k_norm"]),
            p + "post_attention_layernorm.weight": host(layer["mlp_norm"]),
            p + "mlp.gate_proj.weight": host(gu[:, :f], True),
            p + "mlp.up_proj.weight": host(gu[:, f:], True),
            p + "mlp.down_proj.weight": host(layer["w_down"], True),
        })
    return out


def write_drafter(path, cfg: DrafterConfig, params, dtype="bfloat16", shard_bytes: Optional[int] = None) -> None:
    """Write a z-lab DFlashDraftModel directory that `read_drafter` reads back to `cfg` and `params`."""
    dtype = dtype_name(dtype)
    config = {**drafter_to_hf_config(cfg), "torch_dtype": dtype}
    tensors = drafter_hf_tensors(cfg, params, dtype)
    path = os.fspath(path)
    _write_config(path, config)
    _write_tensors(path, tensors, shard_bytes)
