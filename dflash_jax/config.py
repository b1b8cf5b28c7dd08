"""Checkpoint census: Hugging Face `config.json` -> typed, frozen configs, and refusals.

Everything here runs once on the host, before tracing. The dataclasses are hashable so
they can be static arguments of jitted functions. The census also knows which tensors
(Hugging Face names and `[out, in]` shapes) a checkpoint of a given config must hold, so
a wrong pairing of config and weights is refused before anything is loaded.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Optional

import numpy as np

from dflash_jax import policy


class CheckpointError(ValueError):
    """A checkpoint we cannot run: the message names the problem and the valid choices."""


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


class _AttentionWidths:
    """Projection widths of a config with `num_heads`, `num_kv_heads` and `head_dim`."""

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclasses.dataclass(frozen=True)
class TargetConfig(_AttentionWidths):
    """A dense decoder target (Qwen3 or Llama). Field names follow DESIGN.md §3."""

    arch: str  # 'qwen3' | 'llama'
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 4096
    eos_token_ids: tuple = ()
    dtype: str = "float32"

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalises q and k per head before RoPE; Llama does not."""
        return self.arch == "qwen3"


@dataclasses.dataclass(frozen=True)
class DrafterConfig(_AttentionWidths):
    """A block-diffusion drafter (DESIGN.md §4-6) as the census decided it.

    `layer_window[i]` is the sliding window of draft layer i, or None for full attention.
    `causal[i]` says whether block rows of layer i attend causally inside the block.
    `reasons` records why the census decided what it did (shown by `dflash-jax inspect`).
    The family-specific sizes (`markov_rank`, `confidence_in_dim` for DSpark §5;
    `selector_*`, `conv_*` for DFlash2 §6) are None when the family has no such head.
    """

    family: str  # 'dflash' | 'dspark' | 'dflash2'
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple
    layer_window: tuple
    causal: tuple
    harvest: str = "dflash"  # 'dflash': rows 1..b-1 ; 'dspark': rows 0..b-1
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: Optional[float] = None
    vocab_size: Optional[int] = None
    attention_bias: bool = False
    reasons: tuple = ()
    warnings: tuple = ()
    num_target_layers: Optional[int] = None
    markov_rank: Optional[int] = None
    confidence_in_dim: Optional[int] = None
    selector_rank: Optional[int] = None
    selector_top_k: Optional[int] = None
    conv_kernel_size: Optional[int] = None
    conv_group_size: Optional[int] = None

    @property
    def first_row(self) -> int:
        """First block row used as a draft: 1 for mask-fill harvest, 0 for shifted."""
        return 0 if self.harvest == "dspark" else 1

    @property
    def n_drafts(self) -> int:
        return self.block_size - self.first_row

    @property
    def n_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def heads(self) -> tuple:
        """Extra heads beyond the DFlash backbone, e.g. ('markov', 'confidence')."""
        present = (
            ("markov", self.markov_rank),
            ("confidence", self.confidence_in_dim),
            ("conv", self.conv_kernel_size),
            ("selector", self.selector_rank),
        )
        return tuple(name for name, size in present if size is not None)


# ---------------------------------------------------------------------------------------
# Shared pieces: rope, dtype, small readers.

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
DTYPES = ("float32", "bfloat16", "float16")
_DEFAULT_ROPE_THETA = 10000.0  # transformers' default for Llama and Qwen3


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
        scaling = dict(d.get("rope_scaling") or {})
        theta = d.get("rope_theta", _DEFAULT_ROPE_THETA)
    rope_type = scaling.get("rope_type", scaling.get("type")) or "default"
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(
            f"rope type {rope_type!r} is not supported; supported rope types: {', '.join(ROPE_TYPES)}"
        )
    partial = scaling.get("partial_rotary_factor", d.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise CheckpointError(f"partial_rotary_factor {partial!r}: only full rotary (1.0) is supported")
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise CheckpointError(f"rope_theta {theta!r}: expected a positive number")
    if rope_type in ("llama3", "yarn") and scaling.get("original_max_position_embeddings") is None:
        scaling["original_max_position_embeddings"] = d.get("max_position_embeddings")  # as transformers does
    params = tuple(sorted((k, scaling[k]) for k in ROPE_PARAM_NAMES if scaling.get(k) is not None))
    missing = [k for k in _ROPE_REQUIRED[rope_type] if k not in dict(params)]
    if missing:
        raise CheckpointError(f"rope type {rope_type!r} needs {', '.join(missing)} in its scaling parameters")
    return RopeConfig(theta=float(theta), rope_type=rope_type, params=params if rope_type != "default" else ())


def rope_to_hf(rope: RopeConfig) -> dict:
    """The transformers-4 form (`rope_theta`, `rope_scaling`) that every transformers version reads."""
    scaling = None if rope.rope_type == "default" else {"rope_type": rope.rope_type, **dict(rope.params)}
    return {"rope_theta": rope.theta, "rope_scaling": scaling}


def dtype_name(dtype) -> str:
    """Normalise 'bfloat16' / 'bf16' / jnp.bfloat16 / np.float32 ... to one of DTYPES."""
    aliases = {"bf16": "bfloat16", "fp16": "float16", "f16": "float16", "half": "float16",
               "fp32": "float32", "f32": "float32", "float": "float32"}
    if isinstance(dtype, str):
        name = aliases.get(dtype.lower(), dtype.lower())
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = repr(dtype)
    if name not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not supported; choices: {', '.join(DTYPES)}")
    return name


def _require(d: Mapping, key: str, what: str):
    if d.get(key) is None:
        raise CheckpointError(f"{what} config.json has no {key!r}")
    return d[key]


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CheckpointError(f"{name} {value!r}: expected a positive integer")
    return value


def _head_dim(d: Mapping, hidden: int, heads: int) -> int:
    """`head_dim` when given; otherwise hidden_size // num_attention_heads (transformers' rule)."""
    if d.get("head_dim") is not None:
        return _positive_int(d["head_dim"], "head_dim")
    if hidden % heads:
        raise CheckpointError(
            f"no head_dim and hidden_size {hidden} is not divisible by num_attention_heads {heads}"
        )
    return hidden // heads


def _kv_heads(d: Mapping, heads: int) -> int:
    kv = _positive_int(d.get("num_key_value_heads") or heads, "num_key_value_heads")
    if heads % kv:
        raise CheckpointError(
            f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv} (GQA groups)"
        )
    return kv


# ---------------------------------------------------------------------------------------
# Target census.

TARGET_ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}
_ARCH_OF_MODEL_TYPE = {arch: name for name, arch in TARGET_ARCHITECTURES.items()}


def _supported_targets() -> str:
    return ", ".join(f"{name} (model_type {arch!r})" for name, arch in TARGET_ARCHITECTURES.items())


def _target_arch(d: Mapping) -> str:
    archs = d.get("architectures") or []
    model_type = d.get("model_type")
    known = [TARGET_ARCHITECTURES[a] for a in archs if a in TARGET_ARCHITECTURES]
    if archs and not known or not archs and model_type not in _ARCH_OF_MODEL_TYPE:
        raise CheckpointError(
            f"unsupported target: architectures {archs!r}, model_type {model_type!r}; "
            f"supported: {_supported_targets()}"
        )
    arch = known[0] if known else model_type
    if model_type is not None and model_type != arch:
        raise CheckpointError(
            f"contradictory target config: architectures {archs!r} but model_type {model_type!r}; "
            f"supported: {_supported_targets()}"
        )
    return arch


def target_config_from_hf(d: Mapping) -> TargetConfig:
    """Census of a Qwen3ForCausalLM / LlamaForCausalLM `config.json` (transformers 4 or 5 form)."""
    arch = _target_arch(d)
    if d.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act {d['hidden_act']!r}: only 'silu' (SwiGLU) is supported")
    if arch == "llama" and d.get("mlp_bias"):
        raise CheckpointError("Llama config has mlp_bias: true; only bias-free MLPs (mlp_bias: false) are supported")
    if arch == "qwen3":
        layer_types = d.get("layer_types") or []
        if d.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
            raise CheckpointError(
                "Qwen3 config has use_sliding_window: true (or sliding layer_types); "
                "only full-attention Qwen3 targets are supported"
            )
    what = f"{arch} target"
    hidden = _positive_int(_require(d, "hidden_size", what), "hidden_size")
    heads = _positive_int(_require(d, "num_attention_heads", what), "num_attention_heads")
    eos = d.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    dtype = d.get("dtype") or d.get("torch_dtype") or "float32"
    return TargetConfig(
        arch=arch,
        vocab_size=_positive_int(_require(d, "vocab_size", what), "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_positive_int(_require(d, "intermediate_size", what), "intermediate_size"),
        num_layers=_positive_int(_require(d, "num_hidden_layers", what), "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=_kv_heads(d, heads),
        head_dim=_head_dim(d, hidden, heads),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope=rope_from_hf(d),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=bool(d.get("attention_bias", False)),
        max_position_embeddings=int(d.get("max_position_embeddings") or 4096),
        eos_token_ids=tuple(int(t) for t in eos_ids),
        dtype=dtype_name(dtype),
    )


def target_to_hf_config(cfg: TargetConfig) -> dict:
    """A `config.json` dict that transformers (4 and 5) and `target_config_from_hf` both read."""
    name = _ARCH_OF_MODEL_TYPE[cfg.arch]
    out = {
        "architectures": [name],
        "model_type": cfg.arch,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        **rope_to_hf(cfg.rope),
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "torch_dtype": cfg.dtype,
    }
    if cfg.arch == "llama":
        out["mlp_bias"] = False
    else:
        out["use_sliding_window"] = False
    if cfg.eos_token_ids:
        ids = list(cfg.eos_token_ids)
        out["eos_token_id"] = ids[0] if len(ids) == 1 else ids
    return out


def target_tensor_shapes(cfg: TargetConfig) -> dict:
    """Hugging Face tensor name -> shape (`[out, in]`) that a checkpoint of `cfg` must hold."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (cfg.q_width, h),
            p + "self_attn.k_proj.weight": (cfg.kv_width, h),
            p + "self_attn.v_proj.weight": (cfg.kv_width, h),
            p + "self_attn.o_proj.weight": (h, cfg.q_width),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (f, h),
            p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
        })
        if cfg.attention_bias:
            shapes.update({
                p + "self_attn.q_proj.bias": (cfg.q_width,),
                p + "self_attn.k_proj.bias": (cfg.kv_width,),
                p + "self_attn.v_proj.bias": (cfg.kv_width,),
                p + "self_attn.o_proj.bias": (h,),
            })
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (cfg.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (cfg.head_dim,)
    return shapes


def is_ignorable_target_tensor(name: str, cfg: TargetConfig) -> bool:
    """Tensors transformers itself ignores: rotary `inv_freq` buffers and a tied model's lm_head."""
    return name.endswith("rotary_emb.inv_freq") or (cfg.tie_word_embeddings and name == "lm_head.weight")


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


# ---------------------------------------------------------------------------------------
# Drafter census.

FAMILY_NAMES = {"dflash": "DFlash", "dspark": "DSpark", "dflash2": "DFlash2"}
HARVESTS = ("dflash", "dspark")
LAYER_TYPES = ("full_attention", "sliding_attention")
_MARKOV = ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight")
_CONFIDENCE = ("confidence_head.proj.weight", "confidence_head.proj.bias")
_SELECTOR = (
    "candidate_selector.predecessor_codebook",
    "candidate_selector.successor_codebook",
    "candidate_selector.hidden_projection.weight",
)
_DFLASH2_KEYS = ("selector_rank", "selector_top_k", "conv_kernel_size", "conv_group_size")
_NOT_OVERRIDABLE = ("family", "reasons", "warnings")
OVERRIDABLE = tuple(f.name for f in dataclasses.fields(DrafterConfig) if f.name not in _NOT_OVERRIDABLE)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple:
    """The first DFlash reference's rule: [N // 2] for one draft layer, else evenly from 1 to N - 3.

    Python's round (half to even), as in the reference: N=36, n=5 -> (1, 9, 17, 25, 33).
    """
    n, layers = num_draft_layers, num_target_layers
    if n == 1:
        return (layers // 2,)
    return tuple(int(round(1 + i * (layers - 4) / (n - 1))) for i in range(n))


def _dspark_trained(d: Mapping, nested: Mapping) -> tuple:
    """(is DSpark-trained, evidence): `architectures` contains DSpark or `projector_type` is 'dspark' (§5)."""
    archs = list(d.get("architectures") or [])
    projector = nested.get("projector_type", d.get("projector_type"))
    trained = any("DSpark" in a for a in archs) or projector == "dspark"
    return trained, f"architectures {archs}, projector_type {projector!r}"


def _drafter_family(d: Mapping, nested: Mapping, names) -> tuple:
    """(family, reason): DFlash2 by architecture; DSpark by architecture, projector or heads."""
    archs = list(d.get("architectures") or [])
    spark_trained, evidence = _dspark_trained(d, nested)
    if names is None:
        seen = "tensors not inspected"
    else:
        heads = [n for n in (*_MARKOV, *_CONFIDENCE) if n in names]
        seen = f"tensors {heads}" if heads else "no markov/confidence/selector tensors"
    if "DFlash2DraftModel" in archs:
        return "dflash2", f"family dflash2: architectures {archs}"
    spark_heads = names is not None and any(n in names for n in (*_MARKOV, *_CONFIDENCE))
    if spark_trained or spark_heads:
        return "dspark", f"family dspark: {evidence}, {seen}"
    return "dflash", f"family dflash: architectures {archs}, {seen}"


def _census_harvest(d: Mapping, nested: Mapping, family: str) -> tuple:
    """(harvest, reason) from the checkpoint alone (§5): shifted iff DSpark-trained; DFlash2 mask-fill."""
    if family == "dflash2":
        return "dflash", "DFlash2 is mask-fill (rows 1..b-1)"
    spark_trained, evidence = _dspark_trained(d, nested)
    if spark_trained:
        return "dspark", f"trained with shifted labels ({evidence})"
    return "dflash", "no DSpark architecture or projector_type: mask-fill (rows 1..b-1)"


def _layer_layout(pick, num_layers: int, family: str) -> tuple:
    """(layer_window, causal, reason) from layer_types, sliding_window and is_causal (§4)."""
    types = list(pick("layer_types") or ["full_attention"] * num_layers)
    if len(types) != num_layers:
        raise CheckpointError(f"layer_types has {len(types)} entries for num_hidden_layers {num_layers}")
    bad = [t for t in types if t not in LAYER_TYPES]
    if bad:
        raise CheckpointError(f"layer_types {bad!r} not supported; choices: {', '.join(LAYER_TYPES)}")
    window = pick("sliding_window")
    sliding = [t == "sliding_attention" for t in types]
    if any(sliding) and window is None:
        raise CheckpointError("layer_types has sliding_attention layers but sliding_window is not set")
    if any(sliding):
        _positive_int(window, "sliding_window")
    is_causal = pick("is_causal")
    if is_causal is not None and not isinstance(is_causal, bool):
        raise CheckpointError(f"is_causal {is_causal!r}: expected true or false")
    if family == "dflash2" and is_causal is not False:
        raise CheckpointError(
            f"DFlash2 requires is_causal explicitly false (non-causal symmetric sliding window); got {is_causal!r}"
        )
    layer_window = tuple(window if s else None for s in sliding)
    if is_causal is None:
        return layer_window, tuple(sliding), "is_causal absent: full layers bidirectional, sliding layers causal"
    return layer_window, (is_causal,) * num_layers, f"is_causal {is_causal} for every layer (config)"


def _target_layer_ids(pick, num_layers: int, num_target_layers, target) -> tuple:
    ids = pick("target_layer_ids")
    if ids is not None and not isinstance(ids, (list, tuple)):
        raise CheckpointError(f"target_layer_ids {ids!r}: expected a list of target layer indices")
    if ids is not None:
        return tuple(ids), f"target_layer_ids {list(ids)} from the config"
    n_target = num_target_layers if num_target_layers is not None else target and target.num_layers
    if not n_target:
        raise CheckpointError(
            "config has no target_layer_ids and no num_target_layers to derive them from; "
            "add dflash_config.target_layer_ids or pass a target config"
        )
    ids = default_target_layer_ids(n_target, num_layers)
    return ids, (
        f"target_layer_ids {list(ids)} derived from num_target_layers {n_target} and "
        f"{num_layers} draft layers (first reference's default rule)"
    )


def _family_sizes(pick, family: str, hidden: int, shapes) -> tuple:
    """(sizes, reasons) for DSpark heads (config or tensors) and DFlash2 selector/conv (config)."""
    sizes = {}
    if family == "dflash2":
        heads = sorted(n for n in shapes or () if n in (*_MARKOV, *_CONFIDENCE))
        if heads:
            raise CheckpointError(
                f"DFlash2 checkpoint carries markov/confidence heads {heads}: no such DFlash2 variant exists"
            )
        for key in _DFLASH2_KEYS:
            if pick(key, dflash2=True) is None:
                raise CheckpointError(f"DFlash2 dflash_config has no {key!r}; it is required to run the family")
            sizes[key] = _positive_int(pick(key, dflash2=True), key)
        if hidden % sizes["conv_group_size"]:
            raise CheckpointError(
                f"DFlash2 conv_group_size {sizes['conv_group_size']} does not divide hidden_size {hidden}"
            )
        return sizes, ()
    if family != "dspark":
        return sizes, ()
    names = shapes or {}
    rank = pick("markov_rank")
    if rank is None and _MARKOV[0] in names:
        rank = int(names[_MARKOV[0]][-1])
    if rank is not None or any(n in names for n in _MARKOV):
        sizes["markov_rank"] = _positive_int(rank, "markov_rank")
    conf_in = None
    if _CONFIDENCE[0] in names:
        conf_in = int(names[_CONFIDENCE[0]][-1])
        valid = (hidden, hidden + sizes["markov_rank"]) if "markov_rank" in sizes else (hidden,)
        if conf_in not in valid:
            raise CheckpointError(
                f"confidence_head.proj.weight in_dim {conf_in} matches neither hidden {hidden} nor hidden+markov_rank"
            )
    elif pick("enable_confidence_head") or any(n in names for n in _CONFIDENCE):
        with_markov = pick("confidence_head_with_markov") and "markov_rank" in sizes
        conf_in = hidden + sizes["markov_rank"] if with_markov else hidden
    if conf_in is not None:
        sizes["confidence_in_dim"] = conf_in
    return sizes, (f"DSpark heads: markov_rank {sizes.get('markov_rank')}, confidence in_dim {conf_in}",)


def drafter_tensor_shapes(cfg: DrafterConfig) -> dict:
    """Hugging Face tensor name -> shape that a drafter checkpoint of `cfg` must hold (no `model.` prefix)."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    shapes = {"fc.weight": (h, cfg.n_taps * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (cfg.q_width, h),
            p + "self_attn.k_proj.weight": (cfg.kv_width, h),
            p + "self_attn.v_proj.weight": (cfg.kv_width, h),
            p + "self_attn.o_proj.weight": (h, cfg.q_width),
            p + "self_attn.q_norm.weight": (cfg.head_dim,),
            p + "self_attn.k_norm.weight": (cfg.head_dim,),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (f, h),
            p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
        })
        if cfg.family == "dflash2":
            k, groups = cfg.conv_kernel_size, h // cfg.conv_group_size
            for conv in ("attention_conv", "mlp_conv"):
                shapes[p + conv + ".base_kernel"] = (2, k, h)
                shapes[p + conv + ".kernel_projection.weight"] = (2 * k * groups, h)
    vocab = cfg.vocab_size
    if cfg.family == "dflash2":
        shapes.update({
            _SELECTOR[0]: (vocab, cfg.selector_rank),
            _SELECTOR[1]: (vocab, cfg.selector_rank),
            _SELECTOR[2]: (cfg.selector_rank, h),
        })
    if cfg.markov_rank is not None:
        shapes.update({_MARKOV[0]: (vocab, cfg.markov_rank), _MARKOV[1]: (vocab, cfg.markov_rank)})
    if cfg.confidence_in_dim is not None:
        shapes.update({_CONFIDENCE[0]: (1, cfg.confidence_in_dim), _CONFIDENCE[1]: (1,)})
    return shapes


def _validate_drafter(cfg: DrafterConfig) -> None:
    """Structural checks on the final config (after overrides) and the DFlash2 refusals of §6."""
    for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
        _positive_int(getattr(cfg, name), name)
    if cfg.num_heads % cfg.num_kv_heads:
        raise CheckpointError(f"num_heads {cfg.num_heads} is not a multiple of num_kv_heads {cfg.num_kv_heads}")
    if isinstance(cfg.block_size, bool) or not isinstance(cfg.block_size, int) or cfg.block_size < 2:
        raise CheckpointError(f"block_size {cfg.block_size!r}: expected an integer >= 2 (anchor + at least one draft)")
    if cfg.harvest not in HARVESTS:
        raise CheckpointError(f"harvest {cfg.harvest!r} is unknown; choices: {', '.join(HARVESTS)}")
    if len(cfg.layer_window) != cfg.num_layers or len(cfg.causal) != cfg.num_layers:
        raise CheckpointError(
            f"layer_window ({len(cfg.layer_window)}) and causal ({len(cfg.causal)}) need one entry per "
            f"draft layer ({cfg.num_layers})"
        )
    if any(w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1) for w in cfg.layer_window):
        raise CheckpointError(f"layer_window {cfg.layer_window!r}: entries must be None or positive integers")
    ids = cfg.target_layer_ids
    if not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise CheckpointError(f"target_layer_ids {list(ids)!r}: expected a non-empty list of layer indices >= 0")
    if cfg.num_target_layers is not None and max(ids) >= cfg.num_target_layers:
        raise CheckpointError(
            f"target_layer_ids {list(ids)} reach beyond num_target_layers {cfg.num_target_layers}"
        )
    if isinstance(cfg.mask_token_id, bool) or not isinstance(cfg.mask_token_id, int) or cfg.mask_token_id < 0:
        raise CheckpointError(f"mask_token_id {cfg.mask_token_id!r}: expected a token id >= 0")
    if cfg.vocab_size is not None and cfg.mask_token_id >= cfg.vocab_size:
        raise CheckpointError(f"mask_token_id {cfg.mask_token_id} is outside the vocabulary ({cfg.vocab_size})")
    if not all(math.isfinite(v) for v in (cfg.input_embedding_scale, cfg.output_multiplier)):
        raise CheckpointError("input_embedding_scale and output_multiplier must be finite numbers")
    cap = cfg.final_logit_softcapping
    if cap is not None and not (isinstance(cap, (int, float)) and cap > 0):
        raise CheckpointError(f"final_logit_softcapping {cap!r}: expected a positive number or null")
    if cfg.attention_bias:
        raise CheckpointError("drafter attention_bias: true is not supported (DFlash drafters are bias-free)")
    if cfg.heads and cfg.vocab_size is None:
        raise CheckpointError(f"{FAMILY_NAMES[cfg.family]} heads {cfg.heads} need vocab_size (config or target)")
    if cfg.family != "dflash2":
        return
    if any(w is None for w in cfg.layer_window):
        raise CheckpointError(
            f"DFlash2 requires every layer to be sliding_attention; got windows {list(cfg.layer_window)}"
        )
    if any(cfg.causal):
        raise CheckpointError(f"DFlash2 requires non-causal layers (is_causal false); got causal {list(cfg.causal)}")
    if cfg.block_size > min(cfg.layer_window):
        raise CheckpointError(
            f"DFlash2 block_size {cfg.block_size} exceeds the sliding window {min(cfg.layer_window)}"
        )
    if cfg.rope.rope_type != "default":
        raise CheckpointError(f"DFlash2 requires the default rope; got rope type {cfg.rope.rope_type!r}")
    if cfg.markov_rank is not None or cfg.confidence_in_dim is not None:
        raise CheckpointError("DFlash2 checkpoint carries markov/confidence heads: no such DFlash2 variant exists")


def _check_against_target(cfg: DrafterConfig, target: TargetConfig) -> tuple:
    """Refuse a drafter that cannot sit on `target`; return warnings for soft mismatches."""
    if cfg.hidden_size != target.hidden_size:
        raise CheckpointError(
            f"drafter hidden_size {cfg.hidden_size} != target hidden_size {target.hidden_size}: "
            "the drafter was trained for another target"
        )
    if cfg.vocab_size != target.vocab_size:
        raise CheckpointError(f"drafter vocab_size {cfg.vocab_size} != target vocab_size {target.vocab_size}")
    bad = [i for i in cfg.target_layer_ids if i >= target.num_layers]
    if bad:
        raise CheckpointError(
            f"target_layer_ids {bad} are outside the target's layers 0..{target.num_layers - 1}"
        )
    if cfg.num_target_layers is not None and cfg.num_target_layers != target.num_layers:
        return (f"drafter num_target_layers {cfg.num_target_layers} != target layers {target.num_layers}",)
    return ()


def drafter_census(
    d: Mapping,
    tensor_shapes: Optional[Mapping] = None,
    target: Optional[TargetConfig] = None,
    *,
    env: Optional[Mapping] = None,
    **overrides,
) -> DrafterConfig:
    """Census of a z-lab DFlashDraftModel-style `config.json` (DESIGN.md §4-§7).

    Keys may sit at top level or in `dflash_config` (nested wins). `tensor_shapes` (name ->
    shape) detects heads and is checked against the config: missing tensors and shape
    mismatches are refused; unknown tensors are a warning for DFlash (recorded in
    `warnings`) and refused for DSpark/DFlash2, as in the original. `overrides` replace any
    field in OVERRIDABLE; `harvest` resolves keyword > DFLASH_HARVEST (from `env`, default
    the process environment) > census. The result is checked against `target` when given.
    """
    unknown = sorted(set(overrides) - set(OVERRIDABLE))
    if unknown:
        raise CheckpointError(f"unknown drafter override(s) {unknown}; valid: {', '.join(OVERRIDABLE)}")
    overrides = {k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()}
    nested = d.get("dflash_config") or {}
    if not isinstance(nested, Mapping):
        raise CheckpointError(f"dflash_config {nested!r}: expected an object")
    shapes = None if tensor_shapes is None else {n: tuple(int(s) for s in v) for n, v in tensor_shapes.items()}
    family, family_reason = _drafter_family(d, nested, shapes)
    if family == "dflash2" and not nested:
        raise CheckpointError("DFlash2DraftModel config.json has no dflash_config object; it is required")

    def pick(key, default=None, dflash2=False):
        if key in nested:
            return nested[key]
        return default if dflash2 else d.get(key, default)

    what = f"{FAMILY_NAMES[family]} drafter"
    hidden = _positive_int(_require(d, "hidden_size", what), "hidden_size")
    heads = _positive_int(_require(d, "num_attention_heads", what), "num_attention_heads")
    num_layers = _positive_int(_require(d, "num_hidden_layers", what), "num_hidden_layers")
    if pick("mask_token_id") is None:
        raise CheckpointError(
            "drafter config has no mask_token_id (top level or dflash_config); it has no default: "
            "add the mask token the drafter was trained with"
        )
    if pick("block_size") is None:
        raise CheckpointError("drafter config has no block_size (top level or dflash_config)")
    num_target_layers = pick("num_target_layers")
    if num_target_layers is not None:
        _positive_int(num_target_layers, "num_target_layers")
    layer_window, causal, causal_reason = _layer_layout(pick, num_layers, family)
    ids, ids_reason = _target_layer_ids(pick, num_layers, num_target_layers, target)
    sizes, size_reasons = _family_sizes(pick, family, hidden, shapes)
    harvest_default, harvest_reason = _census_harvest(d, nested, family)
    harvest, source = policy.resolution("harvest", overrides.pop("harvest", None), harvest_default, HARVESTS, env)
    if family == "dflash2" and harvest != "dflash":
        raise CheckpointError(
            f"harvest {harvest!r} ({source}) with a DFlash2 checkpoint: DFlash2 is mask-fill (b-1 drafts, "
            "the anchor row is not a draft); the shifted harvest would verify every slot one position "
            "early. Choices for DFlash2: dflash"
        )
    vocab = d.get("vocab_size") if d.get("vocab_size") is not None else target and target.vocab_size
    softcap = pick("final_logit_softcapping")
    fields = dict(
        family=family,
        hidden_size=hidden,
        intermediate_size=_positive_int(_require(d, "intermediate_size", what), "intermediate_size"),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=_kv_heads(d, heads),
        head_dim=_head_dim(d, hidden, heads),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope=rope_from_hf(d),
        block_size=pick("block_size"),
        mask_token_id=pick("mask_token_id"),
        target_layer_ids=ids,
        layer_window=layer_window,
        causal=causal,
        harvest=harvest,
        input_embedding_scale=float(pick("input_embedding_scale", 1.0)),
        output_multiplier=float(pick("output_multiplier", 1.0)),
        final_logit_softcapping=None if softcap is None else float(softcap),
        vocab_size=vocab or None,
        attention_bias=bool(d.get("attention_bias", False)),
        num_target_layers=num_target_layers,
        **sizes,
    )
    fields.update(overrides)
    cfg = DrafterConfig(**fields)
    _validate_drafter(cfg)
    harvest_why = (f"harvest {harvest}: {harvest_reason}" if source == "census" else
                   f"harvest {harvest} from {source} (census default {harvest_default}: {harvest_reason})")
    reasons = [family_reason, harvest_why, ids_reason, causal_reason,
               *size_reasons, *(f"override {k}={v!r} (keyword)" for k, v in sorted(overrides.items()))]
    warnings = []
    if shapes is not None:
        expected = drafter_tensor_shapes(cfg)
        extra = check_tensor_shapes(expected, shapes, f"{what} checkpoint")
        if extra and family != "dflash":
            raise CheckpointError(f"{what} checkpoint has unrecognized tensors {extra}; refusing (census is strict)")
        if extra:
            warnings.append(f"unknown tensors ignored: {extra}")
    if target is not None:
        warnings.extend(_check_against_target(cfg, target))
    return dataclasses.replace(cfg, reasons=tuple(reasons), warnings=tuple(warnings))


def drafter_to_hf_config(cfg: DrafterConfig) -> dict:
    """A z-lab DFlashDraftModel `config.json` that `drafter_census` reads back to `cfg`.

    Only DFlash (mask-fill) drafters have this encoding; per-layer causality must follow the
    default rule or be uniform, and all sliding layers must share one window.
    """
    if cfg.family != "dflash" or cfg.harvest != "dflash":
        raise ValueError(
            f"only DFlash drafters with the mask-fill harvest can be written as DFlashDraftModel; "
            f"got family {cfg.family!r}, harvest {cfg.harvest!r}"
        )
    windows = sorted({w for w in cfg.layer_window if w is not None})
    if len(windows) > 1:
        raise ValueError(f"sliding layers use different windows {windows}; the config format holds one")
    sliding = tuple(w is not None for w in cfg.layer_window)
    out = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "attention_bias": False,
        **rope_to_hf(cfg.rope),
        "block_size": cfg.block_size,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "sliding_window": windows[0] if windows else None,
    }
    if cfg.vocab_size is not None:
        out["vocab_size"] = cfg.vocab_size
    if cfg.num_target_layers is not None:
        out["num_target_layers"] = cfg.num_target_layers
    if cfg.causal != sliding:
        if len(set(cfg.causal)) > 1:
            raise ValueError(f"causal {cfg.causal} is neither uniform nor the default rule; not expressible")
        out["is_causal"] = cfg.causal[0]
    nested = {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids),
              "block_size": cfg.block_size}
    for key, default in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0), ("final_logit_softcapping", None)):
        if getattr(cfg, key) != default:
            nested[key] = getattr(cfg, key)
    out["dflash_config"] = nested
    return out
