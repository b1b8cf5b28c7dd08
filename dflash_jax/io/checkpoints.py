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

from dflash_jax import quant, sharding
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
from dflash_jax.config import policy
from dflash_jax.drafters import dflash, dflash2, dflash2_names, dflash_names, dspark, dspark_names
from dflash_jax.drafters.base import Drafter
from dflash_jax.io import names, publish
from dflash_jax.io.safetensors import (
    check_float_tensors,
    check_packed_tensors,
    config_file,
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
    `name_map(cfg)` (Hugging Face names), `init(cfg, seed)` (fresh float32 params) and `rules`, its table in
    `sharding.RULES`."""

    cls: type
    shapes: Callable
    name_map: Callable
    init: Callable
    rules: str

    def param_shapes(self, cfg) -> dict:
        """The params pytree of `cfg` with shape tuples as leaves."""
        return names.shape_tree(self.shapes(cfg))

    def formats(self, cfg, precision: str) -> dict:
        """`{path: format}` of the leaves `precision` quantises (`quant.plan`)."""
        return quant.plan(self.param_shapes(cfg), precision)

    def hf_shapes(self, cfg, stored: str = "bf16") -> dict:
        """Hugging Face name -> shape a checkpoint of `cfg` holds, saved at precision `stored`."""
        return names.hf_shapes(self.name_map(cfg), self.param_shapes(cfg), self.formats(cfg, stored))

    def check_dtypes(self, cfg, infos: Mapping, stored: str) -> None:
        """Refuse tensors stored in a dtype their place does not take: floats, or the packed dtypes of the
        leaves a checkpoint saved at `stored` holds quantised."""
        packed = names.packed_dtypes(self.name_map(cfg), self.formats(cfg, stored))
        check_float_tensors(infos, [n for n in self.hf_shapes(cfg, stored) if n not in packed])
        check_packed_tensors(infos, packed)

    def check(self, cfg, params) -> None:
        """Refuse `params` whose tree or shapes differ from the module's, naming the leaves."""
        what = f"{FAMILY_NAMES[cfg.family]} drafter" if isinstance(cfg, DrafterConfig) else "target"
        names.check_params(self.param_shapes(cfg), params, what)

    def make(self, cfg, params):
        """The interface object, after checking `params` against the module's shapes."""
        self.check(cfg, params)
        return self.cls(cfg, params)

    def sharding_rules(self, replicated: bool = False) -> list:
        """This family's `sharding.RULES` table (none: every leaf whole on every device, with `replicated`)."""
        return [] if replicated else sharding.RULES[self.rules]

    def read(self, cfg, infos: Mapping, dtype: str, check_finite: bool = True, precision: str = "bf16",
             stored: str = "bf16", mesh=None, replicated: bool = False, strict: bool = False):
        """The interface object over the checkpoint's tensors `infos`, read one at a time in `dtype`
        (each refused if it holds NaN or Inf, with `check_finite`), its weights at `precision`: read packed
        from a checkpoint saved quantised (`stored`, which must then be `precision`), else quantised here. With a
        `mesh` each leaf goes straight to its shards (`sharding.placer`; `replicated` and `strict` as there)."""
        place = sharding.placer(self.sharding_rules(replicated), mesh, strict)
        with tensor_reader(infos, dtype, check_finite) as get:
            return self.make(cfg, names.load_params(self.name_map(cfg), get, self.formats(cfg, precision),
                                                    stored != "bf16", dtype, place))

    def write(self, path, model, config: Mapping, dtype: str, shard_bytes: Optional[int]) -> None:
        """`config.json` and the tensors of `model` (a Target or Drafter of this family) under `path`."""
        self.check(model.config, model.params)
        path = os.fspath(path)
        write_config(path, config)
        write_tensors(path, names.hf_tensors(self.name_map(model.config), model.params, dtype), shard_bytes)


_DENSE = Family(dense.DenseTarget, dense.param_shapes, dense_names.name_map, dense.init_params, "dense")
_HYBRID = Family(hybrid.HybridTarget, hybrid.param_shapes, hybrid_names.name_map, hybrid.init_params, "hybrid")
_GEMMA4 = Family(gemma4.Gemma4Target, gemma4.param_shapes, gemma4_names.name_map, gemma4.init_params, "gemma4")
TARGET_FAMILIES = {"qwen3": _DENSE, "llama": _DENSE, "qwen3_5": _HYBRID, "qwen3_5_moe": _HYBRID, "qwen3_next": _HYBRID,
                   "gemma4": _GEMMA4}
"""Target families by `TargetConfig.arch`."""
DRAFTER_FAMILIES = {
    "dflash": Family(dflash.DFlashDrafter, dflash.param_shapes, dflash_names.name_map, dflash.init_params, "dflash"),
    "dspark": Family(dspark.DSparkDrafter, dspark.param_shapes, dspark_names.name_map, dspark.init_params, "dspark"),
    "dflash2": Family(dflash2.DFlash2Drafter, dflash2.param_shapes, dflash2_names.name_map, dflash2.init_params,
                      "dflash2"),
}
"""Drafter families, by `DrafterConfig.family`."""


def target_family(cfg: TargetConfig) -> Family:
    return TARGET_FAMILIES[cfg.arch]


def drafter_family(cfg: DrafterConfig) -> Family:
    return DRAFTER_FAMILIES[cfg.family]


def stored_precision(config: Mapping, where="config.json") -> str:
    """The precision a checkpoint was saved in (`dflash_jax.precision` of its config.json), bf16 when absent."""
    section = config.get("dflash_jax")
    value = section.get("precision", "bf16") if isinstance(section, dict) else "bf16"
    if value not in policy.PRECISIONS:
        raise CheckpointError(f"{where}: dflash_jax.precision is {value!r}; expected one of "
                              f"{', '.join(policy.PRECISIONS)} (the precision the checkpoint was saved in)")
    return value


def load_precision(path, config: Mapping, precision: Optional[str], env, target: bool) -> tuple:
    """`(precision to load at, precision saved in, who decided)`: keyword > environment > the saved one
    (`policy.precision`). A checkpoint saved quantised loads only at its own precision: packed weights are not
    requantised."""
    stored = stored_precision(config, config_file(path))
    value, source = policy.precision(precision, env, target=target, default=stored)
    if stored != "bf16" and value != stored:
        who = "the precision keyword" if source == "keyword" else source
        raise CheckpointError(f"{path} was saved quantised at {stored}; {who} asks for {value}, but a checkpoint "
                              "saved quantised loads only at its own precision (quantising packed weights again "
                              f"would round them twice). Load the float checkpoint to get {value}")
    return value, stored, source


def make_target(cfg: TargetConfig, params) -> Target:
    """The Target of `cfg`'s family over `params` (checked against the module's shapes)."""
    return target_family(cfg).make(cfg, params)


def shard(model, mesh, replicated: bool = False, strict: bool = False):
    """`model` (a built Target or Drafter) with its params placed on `mesh` by its family's `sharding.RULES`
    (every leaf whole on every device with `replicated`; `strict` as `sharding.spec_for`)."""
    family = drafter_family(model.config) if isinstance(model, Drafter) else target_family(model.config)
    return model.replace(params=sharding.shard_params(family.sharding_rules(replicated), model.params, mesh, strict))


def make_drafter(cfg: DrafterConfig, params) -> Drafter:
    """The Drafter of `cfg`'s family over `params` (checked against the module's shapes)."""
    return drafter_family(cfg).make(cfg, params)


# ---------------------------------------------------------------------------------------
# Target.


def target_tensor_shapes(cfg: TargetConfig, stored: str = "bf16") -> dict:
    """Hugging Face tensor name -> shape (`[out, in]`) that a checkpoint of `cfg` saved at `stored` must hold."""
    return target_family(cfg).hf_shapes(cfg, stored)


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
    stored = stored_precision(config, config_file(path))
    expected = target_tensor_shapes(cfg, stored)
    extra = check_tensor_shapes(expected, found, f"{path}")
    if extra:
        raise CheckpointError(
            f"{path}: unexpected tensor(s) {extra[:8]}: not part of a {cfg.arch} target with this config"
        )
    target_family(cfg).check_dtypes(cfg, infos, stored)
    return cfg, infos


def read_target(path, dtype=None, check_finite: bool = True, precision: Optional[str] = None, env=None, *,
                mesh=None, strict: bool = False) -> Target:
    """A supported target directory (`TARGET_FAMILIES`) as a Target.

    dtype None keeps the checkpoint's dtype (its config's, else the embedding's; float64 is read as
    float32); params are converted tensor by tensor and `config.dtype` records the dtype they hold.
    `check_finite` refuses a tensor holding NaN or Inf in that dtype. `precision` (`load_precision`:
    keyword > DFLASH_TARGET_PREC > as saved) quantises the weights as they are read. With a `mesh` each tensor is
    placed on its shards as it is read (`sharding.RULES`; `strict` refuses a dimension the mesh does not divide).
    """
    cfg, infos = inspect_target(path)
    precision, stored, _ = load_precision(path, read_config(path), precision, env, target=True)
    what, prefixes = skipped_towers(cfg)
    towers = sum(name.startswith(prefixes) for name in infos)
    if towers:
        warnings.warn(f"{path}: skipping the {what} ({towers} tensors under {', '.join(p + '*' for p in prefixes)}): "
                      "dflash-jax runs the text model", stacklevel=2)
    with naming_config(path):
        dtype = load_dtype(dtype, read_config(path), infos, cfg.text_prefix + "embed_tokens.weight")
    cfg = dataclasses.replace(cfg, dtype=dtype)
    return target_family(cfg).read(cfg, infos, dtype, check_finite, precision, stored, mesh, strict=strict)


def write_target(path, target: Target, dtype="bfloat16", shard_bytes: Optional[int] = None, *,
                 overwrite: bool = False) -> None:
    """Write a directory `transformers.AutoModelForCausalLM.from_pretrained` loads (and read_target).

    Published whole (`io/publish.py`): a non-empty `path` is refused unless `overwrite`, which
    replaces its whole contents; an interrupted write leaves the old folder as it was. A causal LM is
    what is written, so the text model of a multimodal checkpoint lands under `model.`. Quantised weights
    are written packed (`io/names.py`), and `dflash_jax.precision` in config.json records the precision
    (transformers cannot read such a checkpoint; `read_target` reads it back to the same params).
    """
    dtype = dtype_name(dtype)
    target = target.replace(config=dataclasses.replace(target.config, text_prefix="model."))
    config = target_to_hf_config(dataclasses.replace(target.config, dtype=dtype))
    precision = quant.precision_of(target.params)
    if precision != "bf16":
        config["dflash_jax"] = {"precision": precision}
    with publish.staged(path, overwrite) as folder:
        target_family(target.config).write(folder, target, config, dtype, shard_bytes)


# ---------------------------------------------------------------------------------------
# Drafter.

def drafter_tensor_shapes(cfg: DrafterConfig, stored: str = "bf16") -> dict:
    """Hugging Face tensor name -> shape that a drafter checkpoint of `cfg` saved at `stored` must hold (no
    `model.` prefix), from the family's name map."""
    return drafter_family(cfg).hf_shapes(cfg, stored)


def drafter_census(d: Mapping, tensor_shapes: Optional[Mapping] = None, target: Optional[TargetConfig] = None, *,
                   env: Optional[Mapping] = None, **overrides) -> DrafterConfig:
    """The config census (`config.drafters.drafter_census`), then every tensor checked against the family.

    Missing tensors and shape mismatches are refused; unknown tensors are a warning for DFlash
    (recorded in `warnings`) and refused for DSpark/DFlash2, as in the original.
    """
    cfg = config_drafter_census(d, tensor_shapes, target, env=env, **overrides)
    return cfg if tensor_shapes is None else _check_drafter_tensors(cfg, tensor_shapes, stored_precision(d))


def _check_drafter_tensors(cfg: DrafterConfig, tensor_shapes: Mapping, stored: str) -> DrafterConfig:
    """`cfg`, after checking every tensor against its family, saved at precision `stored` (see `drafter_census`)."""
    what = f"{FAMILY_NAMES[cfg.family]} drafter checkpoint"
    found = {n: tuple(int(s) for s in v) for n, v in tensor_shapes.items()}
    extra = check_tensor_shapes(drafter_tensor_shapes(cfg, stored), found, what)
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
    stored = stored_precision(config, config_file(path))
    cfg = _check_drafter_tensors(cfg, shapes, stored)
    drafter_family(cfg).check_dtypes(cfg, infos, stored)
    return cfg, infos


def read_drafter(path, target_cfg: Optional[TargetConfig] = None, dtype=None, env=None, check_finite: bool = True,
                 precision: Optional[str] = None, mesh=None, replicated: bool = False, strict: bool = False,
                 **overrides) -> Drafter:
    """A drafter directory as a Drafter of its family, checked against `target_cfg` when given; `mesh`,
    `replicated` and `strict` place it as they place a target (`Family.read`).

    Unknown tensors of a DFlash checkpoint are ignored with a warning (also in `config.warnings`). With a target, the
    drafter is computed in the target's dtype (it reads the target's hidden states and embeddings):
    `dtype=None` casts it to `target_cfg.dtype`, and another explicit dtype is refused naming both.
    Without one, `dtype=None` keeps the checkpoint's. `check_finite` refuses a tensor holding NaN or Inf.
    `precision` (`load_precision`: keyword > DFLASH_PREC > as saved) quantises the weights as they are read.
    """
    cfg, infos = inspect_drafter(path, target_cfg, env=env, **overrides)
    precision, stored, _ = load_precision(path, read_config(path), precision, env, target=False)
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
    return family.read(cfg, infos, dtype, check_finite, precision, stored, mesh, replicated, strict)


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
    transformers and the reference ignore; so is the precision of a quantised drafter, whose weights are
    written packed as `write_target` writes them. Published whole, like `write_target`.
    """
    with publish.staged(path, overwrite) as folder:
        fill_drafter_folder(folder, drafter, dtype, shard_bytes, trained_for=trained_for)


def fill_drafter_folder(folder, drafter: Drafter, dtype="bfloat16", shard_bytes: Optional[int] = None, *,
                        trained_for: Optional[Mapping] = None) -> None:
    """The files of `write_drafter` in `folder` as it is, unpublished: for a stage of `publish.staged`
    that holds more (a training run's periodic checkpoints beside its final drafter)."""
    dtype = dtype_name(dtype)
    config = {**drafter_to_hf_config(drafter.config), "torch_dtype": dtype}
    section = {"trained_for_target": dict(trained_for)} if trained_for is not None else {}
    precision = quant.precision_of(drafter.params)
    if precision != "bf16":
        section["precision"] = precision
    if section:
        config["dflash_jax"] = section
    drafter_family(drafter.config).write(folder, drafter, config, dtype, shard_bytes)
