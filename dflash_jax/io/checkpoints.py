"""Each family's checkpoints: which module and name map a config selects, the tensor census,
loading into a Target or Drafter, and writing back what transformers (or the reference) reads.

A family is registered once below with its interface class, its module's shapes, its Hugging
Face name map and its initialiser; everything else is derived from those.
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Callable, Mapping, Optional

from dflash_jax.config import (
    FAMILY_NAMES,
    CheckpointError,
    DrafterConfig,
    HybridConfig,
    TargetConfig,
    check_tensor_shapes,
    drafter_to_hf_config,
    dtype_name,
    is_ignorable_target_tensor,
    skipped_towers,
    target_config_from_hf,
    target_to_hf_config,
)
from dflash_jax.config import drafter_census as config_drafter_census
from dflash_jax.drafters import dflash, dflash2, dflash2_names, dflash_names, dspark, dspark_names
from dflash_jax.drafters.base import Drafter
from dflash_jax.io import names, publish
from dflash_jax.io.safetensors import (
    check_float_tensors,
    load_dtype,
    naming_config,
    read_config,
    tensor_index,
    tensor_reader,
    write_config,
    write_tensors,
)
from dflash_jax.targets import dense, dense_names, gemma4, gemma4_names, hybrid, hybrid_names
from dflash_jax.targets.base import Target


@dataclasses.dataclass(frozen=True)
class Family:
    """One family: its interface class, `shapes(cfg)` (the module's params as ShapeDtypeStructs),
    `name_map(cfg)` (Hugging Face names) and `init(cfg, seed)` (fresh float32 params)."""

    cls: type
    shapes: Callable
    name_map: Callable
    init: Callable

    def param_shapes(self, cfg) -> dict:
        """The params pytree of `cfg` with shape tuples as leaves."""
        return names.shape_tree(self.shapes(cfg))

    def hf_shapes(self, cfg) -> dict:
        """Hugging Face name -> shape a checkpoint of `cfg` holds."""
        return names.hf_shapes(self.name_map(cfg), self.param_shapes(cfg))

    def check(self, cfg, params) -> None:
        """Refuse `params` whose tree or shapes differ from the module's, naming the leaves."""
        what = f"{FAMILY_NAMES[cfg.family]} drafter" if isinstance(cfg, DrafterConfig) else "target"
        names.check_params(self.param_shapes(cfg), params, what)

    def make(self, cfg, params):
        """The interface object, after checking `params` against the module's shapes."""
        self.check(cfg, params)
        return self.cls(cfg, params)

    def read(self, cfg, infos: Mapping, dtype: str, check_finite: bool = True):
        """The interface object over the checkpoint's tensors `infos`, read one at a time in `dtype`
        (each refused if it holds NaN or Inf, with `check_finite`)."""
        with tensor_reader(infos, dtype, check_finite) as get:
            return self.make(cfg, names.load_params(self.name_map(cfg), get))

    def write(self, path, model, config: Mapping, dtype: str, shard_bytes: Optional[int]) -> None:
        """`config.json` and the tensors of `model` (a Target or Drafter of this family) under `path`."""
        self.check(model.config, model.params)
        path = os.fspath(path)
        write_config(path, config)
        write_tensors(path, names.hf_tensors(self.name_map(model.config), model.params, dtype), shard_bytes)


_DENSE = Family(dense.DenseTarget, dense.param_shapes, dense_names.name_map, dense.init_params)
_HYBRID = Family(hybrid.HybridTarget, hybrid.param_shapes, hybrid_names.name_map, hybrid.init_params)
_GEMMA4 = Family(gemma4.Gemma4Target, gemma4.param_shapes, gemma4_names.name_map, gemma4.init_params)
TARGET_FAMILIES = {"qwen3": _DENSE, "llama": _DENSE, "qwen3_5": _HYBRID, "qwen3_5_moe": _HYBRID, "qwen3_next": _HYBRID,
                   "gemma4": _GEMMA4}
"""Target families by `TargetConfig.arch`."""
DRAFTER_FAMILIES = {
    "dflash": Family(dflash.DFlashDrafter, dflash.param_shapes, dflash_names.name_map, dflash.init_params),
    "dspark": Family(dspark.DSparkDrafter, dspark.param_shapes, dspark_names.name_map, dspark.init_params),
    "dflash2": Family(dflash2.DFlash2Drafter, dflash2.param_shapes, dflash2_names.name_map, dflash2.init_params),
}
"""Drafter families, by `DrafterConfig.family`."""


def target_family(cfg: TargetConfig) -> Family:
    return TARGET_FAMILIES[cfg.arch]


def drafter_family(cfg: DrafterConfig) -> Family:
    return DRAFTER_FAMILIES[cfg.family]


def make_target(cfg: TargetConfig, params) -> Target:
    """The Target of `cfg`'s family over `params` (checked against the module's shapes)."""
    return target_family(cfg).make(cfg, params)


def make_drafter(cfg: DrafterConfig, params) -> Drafter:
    """The Drafter of `cfg`'s family over `params` (checked against the module's shapes)."""
    return drafter_family(cfg).make(cfg, params)


# ---------------------------------------------------------------------------------------
# Target.


def target_tensor_shapes(cfg: TargetConfig) -> dict:
    """Hugging Face tensor name -> shape (`[out, in]`) that a checkpoint of `cfg` must hold."""
    return target_family(cfg).hf_shapes(cfg)


def inspect_target(path) -> tuple:
    """(TargetConfig, name -> TensorInfo) after checking the config, every tensor's name and shape, and that
    the weights are stored as floats; reads no weights."""
    config = read_config(path)
    with naming_config(path):
        cfg = target_config_from_hf(config)
    infos = tensor_index(path)
    if isinstance(cfg, HybridConfig) and any(n.endswith("mlp.experts.gate_up_proj") for n in infos):
        cfg = dataclasses.replace(cfg, expert_layout="fused")
    found = {n: i.shape for n, i in infos.items() if not is_ignorable_target_tensor(n, cfg)}
    expected = target_tensor_shapes(cfg)
    extra = check_tensor_shapes(expected, found, f"{path}")
    if extra:
        raise CheckpointError(
            f"{path}: unexpected tensor(s) {extra[:8]}: not part of a {cfg.arch} target with this config"
        )
    check_float_tensors(infos, expected)
    return cfg, infos


def read_target(path, dtype=None, check_finite: bool = True) -> Target:
    """A Qwen3ForCausalLM / LlamaForCausalLM directory as a Target.

    dtype None keeps the checkpoint's dtype (its config's, else the embedding's; float64 is read as
    float32); params are converted tensor by tensor and `config.dtype` records the dtype they hold.
    `check_finite` refuses a tensor holding NaN or Inf in that dtype.
    """
    cfg, infos = inspect_target(path)
    what, prefixes = skipped_towers(cfg)
    towers = sum(name.startswith(prefixes) for name in infos)
    if towers:
        warnings.warn(f"{path}: skipping the {what} ({towers} tensors under {', '.join(p + '*' for p in prefixes)}): "
                      "dflash-jax runs the text model", stacklevel=2)
    with naming_config(path):
        dtype = load_dtype(dtype, read_config(path), infos, cfg.text_prefix + "embed_tokens.weight")
    cfg = dataclasses.replace(cfg, dtype=dtype)
    return target_family(cfg).read(cfg, infos, dtype, check_finite)


def write_target(path, target: Target, dtype="bfloat16", shard_bytes: Optional[int] = None, *,
                 overwrite: bool = False) -> None:
    """Write a directory `transformers.AutoModelForCausalLM.from_pretrained` loads (and read_target).

    Published whole (`io/publish.py`): a non-empty `path` is refused unless `overwrite`, which
    replaces its whole contents; an interrupted write leaves the old folder as it was. A causal LM is
    what is written, so the text model of a multimodal checkpoint lands under `model.`.
    """
    dtype = dtype_name(dtype)
    target = target.replace(config=dataclasses.replace(target.config, text_prefix="model."))
    config = target_to_hf_config(dataclasses.replace(target.config, dtype=dtype))
    with publish.staged(path, overwrite) as folder:
        target_family(target.config).write(folder, target, config, dtype, shard_bytes)


# ---------------------------------------------------------------------------------------
# Drafter.

def drafter_tensor_shapes(cfg: DrafterConfig) -> dict:
    """Hugging Face tensor name -> shape that a drafter checkpoint of `cfg` must hold (no `model.` prefix),
    from the family's name map."""
    return drafter_family(cfg).hf_shapes(cfg)


def drafter_census(d: Mapping, tensor_shapes: Optional[Mapping] = None, target: Optional[TargetConfig] = None, *,
                   env: Optional[Mapping] = None, **overrides) -> DrafterConfig:
    """The config census (`config.drafters.drafter_census`), then every tensor checked against the family.

    Missing tensors and shape mismatches are refused; unknown tensors are a warning for DFlash
    (recorded in `warnings`) and refused for DSpark/DFlash2, as in the original.
    """
    cfg = config_drafter_census(d, tensor_shapes, target, env=env, **overrides)
    return cfg if tensor_shapes is None else _check_drafter_tensors(cfg, tensor_shapes)


def _check_drafter_tensors(cfg: DrafterConfig, tensor_shapes: Mapping) -> DrafterConfig:
    """`cfg`, after checking every tensor against its family (see `drafter_census`)."""
    what = f"{FAMILY_NAMES[cfg.family]} drafter checkpoint"
    found = {n: tuple(int(s) for s in v) for n, v in tensor_shapes.items()}
    extra = check_tensor_shapes(drafter_tensor_shapes(cfg), found, what)
    if extra and cfg.family != "dflash":
        raise CheckpointError(f"{what} has unrecognized tensors {extra}; refusing (census is strict)")
    if extra:
        return dataclasses.replace(cfg, warnings=(*cfg.warnings, f"unknown tensors ignored: {extra}"))
    return cfg


def inspect_drafter(path, target_cfg: Optional[TargetConfig] = None, env=None, **overrides) -> tuple:
    """(DrafterConfig, name -> TensorInfo): the census with the checkpoint's tensor shapes, and the weights
    checked to be stored as floats; reads no weights."""
    config = read_config(path)
    infos = tensor_index(path)
    shapes = {n: i.shape for n, i in infos.items()}
    with naming_config(path):
        cfg = config_drafter_census(config, shapes, target_cfg, env=env, **overrides)
    cfg = _check_drafter_tensors(cfg, shapes)
    check_float_tensors(infos, drafter_tensor_shapes(cfg))
    return cfg, infos


def read_drafter(path, target_cfg: Optional[TargetConfig] = None, dtype=None, env=None, check_finite: bool = True,
                 **overrides) -> Drafter:
    """A drafter directory as a Drafter of its family, checked against `target_cfg` when given.

    Unknown tensors of a DFlash checkpoint are ignored with a warning (also in `config.warnings`). With a target, the
    drafter is computed in the target's dtype (it reads the target's hidden states and embeddings):
    `dtype=None` casts it to `target_cfg.dtype`, and another explicit dtype is refused naming both.
    Without one, `dtype=None` keeps the checkpoint's. `check_finite` refuses a tensor holding NaN or Inf.
    """
    cfg, infos = inspect_drafter(path, target_cfg, env=env, **overrides)
    family = drafter_family(cfg)
    for message in cfg.warnings:
        warnings.warn(f"{path}: {message}", stacklevel=2)
    if target_cfg is not None:
        if dtype is not None and dtype_name(dtype) != target_cfg.dtype:
            raise CheckpointError(
                f"{path}: drafter dtype {dtype_name(dtype)} differs from the target's {target_cfg.dtype}; the "
                "drafter computes on the target's hidden states, so both share one dtype. Choices: dtype=None "
                f"(the target's, {target_cfg.dtype}), or load the target in {dtype_name(dtype)}")
        dtype = target_cfg.dtype
    with naming_config(path):
        dtype = load_dtype(dtype, read_config(path), infos, "fc.weight")
    return family.read(cfg, infos, dtype, check_finite)


TRAINED_FOR_FIELDS = ("name", "architecture", "hidden_size", "num_hidden_layers", "vocab_size")
"""What a drafter's `config.json` records of the target it was trained for, under
`dflash_jax.trained_for_target`: the target folder's own name (never its path, which would leak
the training machine's layout) and the shape fields of the target's `config.json`."""


def trained_for_record(target_cfg: TargetConfig, name: Optional[str] = None) -> dict:
    """The `trained_for_target` record of a target: `name` (a folder name, when known) and its shape."""
    if name is not None and (not isinstance(name, str) or not name or os.sep in name):
        raise ValueError(f"target name {name!r}: expected a folder name, not a path")
    hf = target_to_hf_config(target_cfg)
    record = {"name": name, "architecture": hf["architectures"][0],
              **{k: hf[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")}}
    return {k: v for k, v in record.items() if v is not None}


def write_drafter(path, drafter: Drafter, dtype="bfloat16", shard_bytes: Optional[int] = None, *,
                  trained_for: Optional[Mapping] = None, overwrite: bool = False) -> None:
    """Write a z-lab DFlashDraftModel directory that `read_drafter` reads back to the same config and params.

    `trained_for` (a `trained_for_record`) is kept in `config.json` under `dflash_jax`, a section
    transformers and the reference ignore. Published whole, like `write_target`.
    """
    with publish.staged(path, overwrite) as folder:
        fill_drafter_folder(folder, drafter, dtype, shard_bytes, trained_for=trained_for)


def fill_drafter_folder(folder, drafter: Drafter, dtype="bfloat16", shard_bytes: Optional[int] = None, *,
                        trained_for: Optional[Mapping] = None) -> None:
    """The files of `write_drafter` in `folder` as it is, unpublished: for a stage of `publish.staged`
    that holds more (a training run's periodic checkpoints beside its final drafter)."""
    dtype = dtype_name(dtype)
    config = {**drafter_to_hf_config(drafter.config), "torch_dtype": dtype}
    if trained_for is not None:
        config["dflash_jax"] = {"trained_for_target": dict(trained_for)}
    drafter_family(drafter.config).write(folder, drafter, config, dtype, shard_bytes)
