"""Drafter census (docs/architecture.md, "DFlash"): `config.json` -> a frozen `DrafterConfig`, and refusals.

The census decides the family, harvest, layer layout and head sizes from the config and
the checkpoint's tensor names; `io.checkpoints` checks the tensors' shapes against the
family's name map.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Mapping, Optional

from dflash_jax.config import policy
from dflash_jax.config.common import (
    AttentionWidths,
    CheckpointError,
    OverrideError,
    boolean,
    finite_number,
    flag,
    head_dim,
    kv_heads,
    positive_int,
    positive_number,
    require,
    string_list,
)
from dflash_jax.config.rope import RopeConfig, rope_from_hf, rope_to_hf
from dflash_jax.config.targets import TargetConfig


@dataclasses.dataclass(frozen=True)
class DrafterConfig(AttentionWidths):
    """A block-diffusion drafter (docs/architecture.md, "DFlash") as the census decided it.

    `layer_window[i]` is the sliding window of draft layer i, or None for full attention.
    `causal[i]` says whether block rows of layer i attend causally inside the block.
    `reasons` records why the census decided what it did (shown by `dflash-jax inspect`).
    The family-specific sizes (`markov_rank`, `confidence_in_dim` for DSpark; `selector_*`,
    `conv_*` for DFlash2) are None when the family has no such head. DSpark's settings:
    `verify_policy` with `verify_tau` and `adapt` (the ladder follows acceptance when on, else
    stays at the cap), and `markov` (the Markov head is used); None/False for other families.
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
    verify_policy: Optional[str] = None  # DSpark: 'ladder' | 'confidence' | 'confidence-slot'
    verify_tau: float = 0.5
    adapt: bool = False
    markov: bool = False
    verify_budget: Optional[int] = None  # DSpark: drafts examined per round across the batch

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



FAMILY_NAMES = {"dflash": "DFlash", "dspark": "DSpark", "dflash2": "DFlash2"}
HARVESTS = ("dflash", "dspark")
WRITABLE = (("dflash", "dflash"), ("dspark", "dspark"), ("dflash2", "dflash"))
"""(family, harvest) pairs `drafter_to_hf_config` writes: each family with the harvest it was trained with."""
LAYER_TYPES = ("full_attention", "sliding_attention")
MARKOV_TENSORS = ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight")
CONFIDENCE_TENSORS = ("confidence_head.proj.weight", "confidence_head.proj.bias")
SELECTOR_TENSORS = (
    "candidate_selector.predecessor_codebook",
    "candidate_selector.successor_codebook",
    "candidate_selector.hidden_projection.weight",
)
_DFLASH2_KEYS = ("selector_rank", "selector_top_k", "conv_kernel_size", "conv_group_size")
_NOT_OVERRIDABLE = ("family", "reasons", "warnings")
DSPARK_SETTINGS = ("verify_policy", "verify_tau", "adapt", "markov", "verify_budget")
_DSPARK_ENV = tuple(policy.env_name(n) for n in ("vt", "vt_tau", "adapt", "markov", "verify_budget"))
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
    archs = string_list(d.get("architectures"), "architectures")
    projector = nested.get("projector_type", d.get("projector_type"))
    trained = any("DSpark" in a for a in archs) or projector == "dspark"
    return trained, f"architectures {archs}, projector_type {projector!r}"


def _drafter_family(d: Mapping, nested: Mapping, names) -> tuple:
    """(family, reason): DFlash2 by architecture; DSpark by architecture, projector or heads."""
    archs = string_list(d.get("architectures"), "architectures")
    spark_trained, evidence = _dspark_trained(d, nested)
    if names is None:
        seen = "tensors not inspected"
    else:
        heads = [n for n in (*MARKOV_TENSORS, *CONFIDENCE_TENSORS) if n in names]
        seen = f"tensors {heads}" if heads else "no markov/confidence/selector tensors"
    if "DFlash2DraftModel" in archs:
        return "dflash2", f"family dflash2: architectures {archs}"
    spark_heads = names is not None and any(n in names for n in (*MARKOV_TENSORS, *CONFIDENCE_TENSORS))
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
    types = string_list(pick("layer_types"), "layer_types") or ["full_attention"] * num_layers
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
        positive_int(window, "sliding_window")
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
        heads = sorted(n for n in shapes or () if n in (*MARKOV_TENSORS, *CONFIDENCE_TENSORS))
        if heads:
            raise CheckpointError(
                f"DFlash2 checkpoint carries markov/confidence heads {heads}: no such DFlash2 variant exists"
            )
        for key in _DFLASH2_KEYS:
            if pick(key, dflash2=True) is None:
                raise CheckpointError(f"DFlash2 dflash_config has no {key!r}; it is required to run the family")
            sizes[key] = positive_int(pick(key, dflash2=True), key)
        if hidden % sizes["conv_group_size"]:
            raise CheckpointError(
                f"DFlash2 conv_group_size {sizes['conv_group_size']} does not divide hidden_size {hidden}"
            )
        return sizes, ()
    if family != "dspark":
        return sizes, ()
    names = shapes or {}
    rank = pick("markov_rank")
    if rank is None and MARKOV_TENSORS[0] in names:
        rank = int(names[MARKOV_TENSORS[0]][-1])
    if rank is not None or any(n in names for n in MARKOV_TENSORS):
        sizes["markov_rank"] = positive_int(rank, "markov_rank")
    conf_in = None
    if CONFIDENCE_TENSORS[0] in names:
        conf_in = int(names[CONFIDENCE_TENSORS[0]][-1])
        valid = (hidden, hidden + sizes["markov_rank"]) if "markov_rank" in sizes else (hidden,)
        if conf_in not in valid:
            raise CheckpointError(
                f"confidence_head.proj.weight in_dim {conf_in} matches neither hidden {hidden} nor hidden+markov_rank"
            )
    elif boolean(pick("enable_confidence_head"), "enable_confidence_head") or any(
            n in names for n in CONFIDENCE_TENSORS):
        with_markov = boolean(pick("confidence_head_with_markov"), "confidence_head_with_markov") and \
            "markov_rank" in sizes
        conf_in = hidden + sizes["markov_rank"] if with_markov else hidden
    if conf_in is not None:
        sizes["confidence_in_dim"] = conf_in
    return sizes, (f"DSpark heads: markov_rank {sizes.get('markov_rank')}, confidence in_dim {conf_in}",)


def _validate_drafter(cfg: DrafterConfig) -> None:
    """Structural checks on the final config (after overrides) and the DFlash2 refusals of §6."""
    for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
        positive_int(getattr(cfg, name), name)
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
    if cfg.selector_top_k > cfg.vocab_size:
        raise CheckpointError(f"selector_top_k {cfg.selector_top_k} exceeds the vocabulary ({cfg.vocab_size}): the "
                              "selector ranks that many candidates per slot")


def _dspark_settings(family: str, sizes: Mapping, given: Mapping, env: Optional[Mapping]) -> tuple:
    """(DSpark setting fields, reasons): the verify-window policy and the Markov switch (docs/architecture.md,
    "Policy"). Other families refuse them rather than ignore them."""
    env = os.environ if env is None else env
    if family != "dspark":
        set_env = [k for k in _DSPARK_ENV if env.get(k)]
        if given or set_env:
            raise CheckpointError(
                f"{', '.join([*given, *set_env])} set for a {FAMILY_NAMES[family]} drafter: the verify-window "
                "policies and the Markov switch are DSpark settings; this family verifies a fixed window "
                "(verify_t / DFLASH_VERIFY_T caps it)")
        return {}, ()
    try:
        vt, tau, adapt, why = policy.verify_policy(given.get("verify_policy"), given.get("verify_tau"),
                                                   given.get("adapt"), "confidence_in_dim" in sizes, env)
        markov, source = policy.switch("markov", given.get("markov"), "markov_rank" in sizes, env)
    except ValueError as e:
        raise CheckpointError(str(e)) from e
    if markov and "markov_rank" not in sizes:
        raise CheckpointError(f"markov on ({source}) but the checkpoint has no markov_head tensors; "
                              "choices: markov=False / DFLASH_MARKOV=0")
    try:
        budget = policy.verify_budget(given.get("verify_budget"), env)
    except ValueError as e:
        raise CheckpointError(str(e)) from e
    reasons = [why, f"markov head {'on' if markov else 'off'} ({source})"]
    if budget is not None:
        if vt == "ladder":
            raise CheckpointError(f"verify_budget {budget} spends drafts by confidence; the verify policy is "
                                  "ladder. Choices: a confidence policy (needs the confidence head), or no budget")
        reasons.append(f"batch verify budget {budget} drafts a round, spent on the highest running products")
    return ({"verify_policy": vt, "verify_tau": tau, "adapt": adapt, "markov": markov, "verify_budget": budget},
            tuple(reasons))


def check_fits_target(cfg: DrafterConfig, target) -> tuple:
    """Refuse a drafter that cannot sit on `target` (any family's config with `hidden_size`,
    `vocab_size` and `num_layers`); return warnings for soft mismatches. The one check used by
    the census, the decoding entry points and training."""
    if cfg.hidden_size != target.hidden_size:
        raise CheckpointError(
            f"drafter hidden_size {cfg.hidden_size} != target hidden_size {target.hidden_size}: "
            "the drafter was trained for another target"
        )
    if cfg.vocab_size is not None and cfg.vocab_size != target.vocab_size:
        raise CheckpointError(f"drafter vocab_size {cfg.vocab_size} != target vocab_size {target.vocab_size}")
    bad = [i for i in cfg.target_layer_ids if i >= target.num_layers]
    if bad:
        raise CheckpointError(
            f"drafter target_layer_ids {list(cfg.target_layer_ids)} name layers {bad} outside the target's "
            f"layers 0..{target.num_layers - 1}"
        )
    if cfg.mask_token_id >= target.vocab_size:
        raise CheckpointError(
            f"drafter mask_token_id {cfg.mask_token_id} is outside the target vocabulary [0, {target.vocab_size})"
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
    """Census of a z-lab DFlashDraftModel-style `config.json` (docs/architecture.md, "DFlash" and "Policy").

    Keys may sit at top level or in `dflash_config` (nested wins). `tensor_shapes` (name ->
    shape) detects heads and their sizes; `io.checkpoints.drafter_census` also checks every
    tensor against the family's name map. `overrides` replace any
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
    hidden = positive_int(require(d, "hidden_size", what), "hidden_size")
    heads = positive_int(require(d, "num_attention_heads", what), "num_attention_heads")
    num_layers = positive_int(require(d, "num_hidden_layers", what), "num_hidden_layers")
    if pick("mask_token_id") is None:
        raise CheckpointError(
            "drafter config has no mask_token_id (top level or dflash_config); it has no default: "
            "add the mask token the drafter was trained with"
        )
    if pick("block_size") is None:
        raise CheckpointError("drafter config has no block_size (top level or dflash_config)")
    num_target_layers = pick("num_target_layers")
    if num_target_layers is not None:
        positive_int(num_target_layers, "num_target_layers")
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
    dspark, dspark_reasons = _dspark_settings(family, sizes, {k: overrides.pop(k) for k in DSPARK_SETTINGS
                                                               if k in overrides}, env)
    vocab = positive_int(d["vocab_size"], "vocab_size") if d.get("vocab_size") is not None else \
        target and target.vocab_size
    softcap = pick("final_logit_softcapping")
    scale, multiplier = (1.0 if pick(k) is None else finite_number(pick(k), k)
                         for k in ("input_embedding_scale", "output_multiplier"))
    fields = dict(
        family=family,
        hidden_size=hidden,
        intermediate_size=positive_int(require(d, "intermediate_size", what), "intermediate_size"),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads(d, heads),
        head_dim=head_dim(d, hidden, heads),
        rms_norm_eps=positive_number(d.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
        rope=rope_from_hf(d),
        block_size=pick("block_size"),
        mask_token_id=pick("mask_token_id"),
        target_layer_ids=ids,
        layer_window=layer_window,
        causal=causal,
        harvest=harvest,
        input_embedding_scale=scale,
        output_multiplier=multiplier,
        final_logit_softcapping=None if softcap is None else positive_number(softcap, "final_logit_softcapping"),
        vocab_size=vocab or None,
        attention_bias=flag(d, "attention_bias"),
        num_target_layers=num_target_layers,
        **sizes,
        **dspark,
    )
    fields.update(overrides)
    cfg = DrafterConfig(**fields)
    try:
        _validate_drafter(cfg)
    except CheckpointError as e:
        overridden = [k for k in overrides if str(e).startswith(f"{k} ")]
        if overridden:
            raise OverrideError(f"{e} (keyword override {overridden[0]})") from None
        raise
    harvest_why = (f"harvest {harvest}: {harvest_reason}" if source == "census" else
                   f"harvest {harvest} from {source} (census default {harvest_default}: {harvest_reason})")
    reasons = [family_reason, harvest_why, ids_reason, causal_reason,
               *size_reasons, *dspark_reasons, *(f"override {k}={v!r} (keyword)" for k, v in sorted(overrides.items()))]
    warnings = list(check_fits_target(cfg, target)) if target is not None else []
    return dataclasses.replace(cfg, reasons=tuple(reasons), warnings=tuple(warnings))


def drafter_to_hf_config(cfg: DrafterConfig) -> dict:
    """A `config.json` that `drafter_census` reads back to `cfg`: z-lab `DFlashDraftModel` for DFlash
    (mask-fill harvest), `DSparkDraftModel` with `projector_type` "dspark" and its heads for DSpark
    (shifted harvest), `DFlash2DraftModel` with its selector and convolution sizes in `dflash_config`
    (and the rope as `rope_parameters`, as the published DFlash2 config has it). Per-layer causality
    must follow the default rule or be uniform, and all sliding layers must share one window. DSpark's
    runtime settings (verify policy, Markov switch) are not part of a checkpoint.
    """
    if (cfg.family, cfg.harvest) not in WRITABLE:
        raise ValueError(
            f"only DFlash and DFlash2 drafters with the mask-fill harvest and DSpark drafters with the shifted "
            f"harvest can be written; got family {cfg.family!r}, harvest {cfg.harvest!r}"
        )
    windows = sorted({w for w in cfg.layer_window if w is not None})
    if len(windows) > 1:
        raise ValueError(f"sliding layers use different windows {windows}; the config format holds one")
    sliding = tuple(w is not None for w in cfg.layer_window)
    out = {
        "architectures": [f"{FAMILY_NAMES[cfg.family]}DraftModel"],
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
        **(rope_to_hf(cfg.rope) if cfg.family != "dflash2" else
           {"rope_parameters": {"rope_theta": cfg.rope.theta, "rope_type": cfg.rope.rope_type}}),
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
    if cfg.family == "dspark":
        nested["projector_type"] = "dspark"
        if cfg.markov_rank is not None:
            nested["markov_rank"] = cfg.markov_rank
        nested["enable_confidence_head"] = cfg.confidence_in_dim is not None
        with_markov = cfg.confidence_in_dim is not None and cfg.confidence_in_dim > cfg.hidden_size
        nested["confidence_head_with_markov"] = with_markov
    if cfg.family == "dflash2":
        nested.update({key: getattr(cfg, key) for key in _DFLASH2_KEYS})
    out["dflash_config"] = nested
    return out
