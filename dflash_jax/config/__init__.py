"""Host-only configuration: checkpoint census (`config.json` -> frozen configs), refusals, policy.

Nothing here traces or touches a device; every decision is made once, before `jit`.
"""
from dflash_jax.config.common import DTYPES, CheckpointError, check_tensor_shapes, dtype_name
from dflash_jax.config.drafters import (
    FAMILY_NAMES,
    HARVESTS,
    OVERRIDABLE,
    DrafterConfig,
    check_fits_target,
    default_target_layer_ids,
    drafter_census,
    drafter_to_hf_config,
)
from dflash_jax.config.rope import RopeConfig, rope_from_hf, rope_to_hf
from dflash_jax.config.targets import (
    GEMMA4_ARCHITECTURES,
    HYBRID_ARCHITECTURES,
    TARGET_ARCHITECTURES,
    Gemma4Config,
    HybridConfig,
    TargetConfig,
    is_ignorable_target_tensor,
    is_vision_tensor,
    skipped_towers,
    target_config_from_hf,
    target_to_hf_config,
)

__all__ = [
    "DTYPES", "FAMILY_NAMES", "GEMMA4_ARCHITECTURES", "HARVESTS", "HYBRID_ARCHITECTURES", "OVERRIDABLE",
    "TARGET_ARCHITECTURES",
    "CheckpointError", "DrafterConfig", "Gemma4Config", "HybridConfig", "is_vision_tensor",
    "RopeConfig", "TargetConfig", "check_fits_target", "check_tensor_shapes", "default_target_layer_ids",
    "drafter_census", "drafter_to_hf_config", "dtype_name", "is_ignorable_target_tensor", "rope_from_hf",
    "rope_to_hf", "skipped_towers", "target_config_from_hf", "target_to_hf_config",
]
