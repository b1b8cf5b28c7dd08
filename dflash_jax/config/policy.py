"""Host-side policy (docs/architecture.md, "Policy"): explicit keyword > `DFLASH_*` environment variable > census.

This is the only module that reads the environment. Unknown values are refused with a
message naming the setting, the value and the choices; an empty variable counts as unset.
"""
from __future__ import annotations

import os
from typing import Mapping, Optional, Sequence

import jax.numpy as jnp

ENV_PREFIX = "DFLASH_"


def env_name(name: str) -> str:
    """The environment variable of a setting: 'harvest' -> 'DFLASH_HARVEST'."""
    return ENV_PREFIX + name.upper().replace("-", "_")


def resolution(
    name: str,
    kwarg: Optional[str],
    census_default: str,
    choices: Sequence[str],
    env: Optional[Mapping[str, str]] = os.environ,
    env_key: Optional[str] = None,
) -> tuple[str, str]:
    """(value, source) where source says who decided: 'keyword', 'DFLASH_<NAME>' or 'census'.

    `env_key` names the variable when it differs from the keyword (`verify_policy` -> DFLASH_VT)."""
    env = os.environ if env is None else env
    var = env_name(env_key or name)
    if kwarg is not None:
        value, source = kwarg, "keyword"
    elif env.get(var):
        value, source = env[var], var
    else:
        value, source = census_default, "census"
    if value not in choices:
        shown = f"{name}={value!r} (keyword)" if source == "keyword" else f"{source}={value!r}"
        raise ValueError(f"{shown}: unknown {name}; choices: {', '.join(choices)}")
    return value, source


def resolve_choice(
    name: str,
    kwarg: Optional[str],
    census_default: str,
    choices: Sequence[str],
    env: Optional[Mapping[str, str]] = os.environ,
) -> str:
    """The value of a setting with choices, resolved keyword > environment > census."""
    return resolution(name, kwarg, census_default, choices, env)[0]


VERIFY_CAP_BY_BATCH = ((64, 6),)
"""The default verify cap from a batch size up, `(batch, cap)` by rising batch: a batch takes the cap of the last
entry it reaches; below the first, every draft (nd + 1).
On the H200 (Qwen3-8B shape, z-lab drafter shape, prompt 512, injected geometric acceptance 6.5) a batch of
64 x 16 verify rows is compute-bound: caps 6, 8 and 16 gave rounds of 18.0, 20.4 and 32.2 ms and speedups of
1.26x, 1.20x and 0.83x over plain decoding (bench/results/verify_cap.json). At batch 16 an 8-row block cut the
round only from 11.9 to 10.8 ms (verify_width.json), too little to pay for the drafts it stops examining."""


def verify_cap(kwarg: Optional[int], n_drafts: int, batch: int = 1,
               env: Optional[Mapping[str, str]] = os.environ) -> int:
    """Largest verify width vt (anchor + drafts checked): keyword > DFLASH_VERIFY_T > the measured default for
    the batch size (`VERIFY_CAP_BY_BATCH`, at most n_drafts + 1). It never changes the output.

    Valid caps are 2..n_drafts+1 (at least one draft checked, at most all of them).
    """
    env = os.environ if env is None else env
    if kwarg is not None:
        raw, source = kwarg, "verify_t (keyword)"
    else:
        raw, source = env.get(env_name("verify_t")), env_name("verify_t")
    if raw is None or raw == "":
        return min([n_drafts + 1] + [cap for at, cap in VERIFY_CAP_BY_BATCH if batch >= at][-1:])
    if isinstance(raw, str):
        cap = int(raw) if raw.strip().isdigit() else None
    else:
        cap = raw if isinstance(raw, int) and not isinstance(raw, bool) else None
    if cap is None or not 2 <= cap <= n_drafts + 1:
        raise ValueError(f"{source}={raw!r}: verify cap must be an integer in 2..{n_drafts + 1} (n_drafts + 1)")
    return cap


def _integer_setting(name: str, kwarg, env: Optional[Mapping[str, str]] = os.environ) -> tuple:
    """`(raw, source, value)` of a non-negative integer setting, keyword > DFLASH_<NAME>: raw None when unset, value
    None when raw is not such an integer (a bool, a float, a string of other than digits)."""
    env = os.environ if env is None else env
    raw, source = (kwarg, f"{name} (keyword)") if kwarg is not None else (env.get(env_name(name)) or None,
                                                                         env_name(name))
    value = raw if isinstance(raw, int) and not isinstance(raw, bool) else (
        int(raw) if isinstance(raw, str) and raw.strip().isdigit() else None)
    return raw, source, value


def verify_budget(kwarg, env: Optional[Mapping[str, str]] = os.environ) -> Optional[int]:
    """DSpark's batch verify budget, drafts examined per round across the batch: keyword >
    DFLASH_VERIFY_BUDGET > None (every row sized alone)."""
    raw, source, value = _integer_setting("verify_budget", kwarg, env)
    if raw is None:
        return None
    if value is None or value < 1:
        raise ValueError(f"{source}={raw!r}: the verify budget must be a positive integer (drafts a round)")
    return value


DEFAULT_VERIFY_BUCKETS = (4, 8)
BUCKETS_FROM_BATCH = 16


def verify_buckets(kwarg, n_drafts: int, batch: int = 1, varies_width: bool = False,
                   env: Optional[Mapping[str, str]] = os.environ) -> tuple:
    """Static verify widths below the full block: keyword (a sequence of ints; () for none) >
    DFLASH_VERIFY_BUCKETS ("4,8"; "none") > default. Each must be in 2..n_drafts (n_drafts + 1, the
    full block, is always there).

    The default follows the H200 measurement (bench/results/verify_width.json): buckets (4, 8) cut a
    round by 16% (batch 16) to 57% (batch 64) when rows ask for 4 rows, cost 1-5% at batch 1 and up to
    12% when every row wants the full block. So they are on for drafters whose widths vary
    (`Drafter.varies_width`) at batch >= 16, and off otherwise."""
    env = os.environ if env is None else env
    raw, source = (kwarg, "verify_buckets (keyword)") if kwarg is not None else (
        env.get(env_name("verify_buckets")) or None, env_name("verify_buckets"))
    if raw is None:
        wanted = varies_width and batch >= BUCKETS_FROM_BATCH
        return tuple(w for w in DEFAULT_VERIFY_BUCKETS if w <= n_drafts) if wanted else ()
    if isinstance(raw, str) and raw.strip().lower() == "none":
        return ()
    parts = raw.split(",") if isinstance(raw, str) else list(raw)
    try:
        widths = tuple(sorted({int(p) for p in parts if not isinstance(p, bool) and str(p).strip()}))
    except (TypeError, ValueError):
        widths = None
    if widths is None or len(widths) != len([p for p in parts if str(p).strip()]) or \
            any(not 2 <= w <= n_drafts for w in widths):
        raise ValueError(f"{source}={raw!r}: verify buckets must be distinct integers in 2..{n_drafts} "
                         f"(n_drafts; the full block {n_drafts + 1} is always a bucket)")
    return widths


def clamp_vt(m_plus_2, cap: int):
    """Ladder window after a round that accepted m: clamp m + 2 to [min(3, cap), cap].

    The original clamps to [3, cap] and panics when cap < 3 (docs/architecture.md, "Known defects of the
    original, fixed here"); works on Python
    ints and on integer arrays (inside jit).
    """
    if cap < 1:
        raise ValueError(f"verify cap {cap!r}: expected >= 1")
    low = min(3, cap)
    if isinstance(m_plus_2, int):
        return max(low, min(cap, m_plus_2))
    return jnp.clip(m_plus_2, low, cap)


SLIDING_CACHES = ("full", "ring")
RING_SLACK = 32
"""Slots a ring holds beyond the window: a block of up to RING_SLACK + 1 positions (a verify) may be written and
partly rolled back without overwriting a position a later query can see."""


def sliding_cache(kwarg: Optional[str] = None, env: Optional[Mapping[str, str]] = os.environ) -> str:
    """How a Gemma-4 target's sliding-window layers keep their K/V: keyword > DFLASH_SLIDING_CACHE > 'full'.

    'full': a cache of the whole capacity, attended through a windowed mask. 'ring': `sliding_window + RING_SLACK`
    slots (when fewer than the capacity), each position at its index modulo that; less memory, and a gather
    of the ring into position order before each attention. Both give the same tokens."""
    return resolve_choice("sliding_cache", kwarg, "full", SLIDING_CACHES, env)


PREFILL_CHUNK = 512
"""Prompt positions per prefill `extend` (bounded memory: one chunk's activations at a time)."""
MIN_PREFILL_CHUNK = 64
"""The smallest prefill chunk: the hybrid targets' chunked delta rule takes 64 positions at a time."""


def prefill_chunk(kwarg: Optional[int] = None, env: Optional[Mapping[str, str]] = os.environ) -> int:
    """Prompt positions per prefill chunk: keyword > DFLASH_PREFILL_CHUNK > PREFILL_CHUNK. A power of two, at
    least MIN_PREFILL_CHUNK. Tokens do not depend on it; wider chunks make the prefill's products wider."""
    raw, source, value = _integer_setting("prefill_chunk", kwarg, env)
    if raw is None:
        return PREFILL_CHUNK
    if value is None or value < MIN_PREFILL_CHUNK or value & (value - 1):
        raise ValueError(f"{source}={raw!r}: the prefill chunk must be a power of two >= {MIN_PREFILL_CHUNK} "
                         f"(64, 128, ..., 512, 1024, ...)")
    return value


ATTENTION_IMPLS = ("xla", "pallas", "cudnn")


def attention_impl(kwarg: Optional[str] = None, env: Optional[Mapping[str, str]] = os.environ,
                   backend: Optional[str] = None, sharded: bool = False) -> str:
    """Attention implementation: keyword > DFLASH_ATTENTION > 'pallas' on GPU (faster at every
    benchmarked shape, bench/results/kernel_check.json), 'xla' elsewhere and for models `sharded` over
    several devices (there the kernels run per device under `shard_map`, not yet measured on GPUs). 'cudnn' is
    cuDNN's fused attention where it serves (`block_attention`), the Pallas kernel elsewhere; the prefill takes it
    by itself (`prefill_attention`)."""
    import jax

    default = "pallas" if (backend or jax.default_backend()) == "gpu" and not sharded else "xla"
    return resolve_choice("attention", kwarg, default, ATTENTION_IMPLS, env)


PREFILL_ATTENTION = {"pallas": "cudnn"}
"""The attention impl of a prefill of several chunks for each decoding impl (one not listed keeps its own). On the
H200 cuDNN's fused attention took a 32,000-token prefill from 1.816 s to 1.465 s at chunk 512, and to 1.344 s at
chunk 4096 (bench/results/prefill.json); a one-chunk 512-token prompt took 0.062 s with it against 0.049 s with
the kernel (prefill_512.json), so a prompt of one chunk keeps the kernel, as a verify of 16 rows does."""


def prefill_attention(impl: str, chunks: int) -> str:
    """The attention impl of a prefill of `chunks` chunks when decoding uses `impl` (`PREFILL_ATTENTION`)."""
    return PREFILL_ATTENTION.get(impl, impl) if chunks > 1 else impl


PRECISIONS = ("bf16", "int8", "q8_0", "q4_0", "mixed")
"""Weight precisions (docs/architecture.md, "Weight precision"): bf16 quantises nothing (the weights keep the load
dtype); int8 is int8 with one scale per output channel; q8_0 and q4_0 are the original's block formats; mixed is
the original's split (the MLP at q8_0, the rest kept)."""
PRECISION_ALIASES = {"int4": "q4_0"}
"""Other names of a precision: int4 (the original's `q4`, DESIGN's `int4`) is q4_0, the one 4-bit format."""


def precision(kwarg: Optional[str], env: Optional[Mapping[str, str]] = os.environ, target: bool = False,
              default: str = "bf16") -> tuple:
    """A model's weight precision and who decided it, `(value, source)`: keyword > DFLASH_PREC (drafters; the
    original's variable) or DFLASH_TARGET_PREC (targets: a quantised target changes the output) > `default`
    (bf16, or the precision a quantised checkpoint was saved in). Aliases resolve to their precision."""
    name, key = ("target_precision", "target_prec") if target else ("precision", "prec")
    value, source = resolution(name, kwarg, default, PRECISIONS + tuple(PRECISION_ALIASES), env, env_key=key)
    return PRECISION_ALIASES.get(value, value), source


VERIFY_POLICIES = ("ladder", "confidence", "confidence-slot")
SWITCHES = ("0", "1")


def switch(name: str, kwarg: Optional[bool], default: bool, env: Optional[Mapping[str, str]] = os.environ):
    """An on/off setting: keyword (bool) > `DFLASH_<NAME>=0|1` > default. Returns `(value, source)`."""
    if kwarg is not None and not isinstance(kwarg, bool):
        raise ValueError(f"{name}={kwarg!r} (keyword): expected True or False")
    value, source = resolution(name, None if kwarg is None else str(int(kwarg)), str(int(default)), SWITCHES, env)
    return value == "1", source


def verify_tau(kwarg, env: Optional[Mapping[str, str]] = os.environ) -> Optional[float]:
    """The confidence threshold tau in (0, 1): keyword > DFLASH_VT_TAU > None (unset)."""
    env = os.environ if env is None else env
    raw, source = (kwarg, "verify_tau (keyword)") if kwarg is not None else (env.get(env_name("vt_tau")) or None,
                                                                            env_name("vt_tau"))
    if raw is None:
        return None
    try:
        tau = float(raw)
    except (TypeError, ValueError):
        tau = float("nan")
    if isinstance(raw, bool) or not 0.0 < tau < 1.0:
        raise ValueError(f"{source}={raw!r}: the confidence threshold tau must be a number in (0, 1)")
    return tau


def verify_policy(kwarg: Optional[str], tau, adapt: Optional[bool], has_confidence_head: bool,
                  env: Optional[Mapping[str, str]] = os.environ) -> tuple:
    """DSpark's verify-window policy as the original resolves it: `(policy, tau, adapt, reason)`.

    Keyword `verify_policy` > DFLASH_VT; `verify_tau` > DFLASH_VT_TAU; `adapt` > DFLASH_ADAPT.
    Unset, a checkpoint with a confidence head gets `confidence-slot` at tau 0.5 and one without
    gets `ladder`; adapt off pins the ladder at the cap. A confidence policy with adapt off is
    contradictory, and one without the head has nothing to read: both are refused.
    """
    adapt_on, adapt_source = switch("adapt", adapt, True, env)
    value, source = resolution("verify_policy", kwarg, "ladder", VERIFY_POLICIES, env, env_key="vt")
    tau_value = verify_tau(tau, env)
    if source == "census":
        if not adapt_on or not has_confidence_head:
            why = "adapt off" if not adapt_on else "no confidence head"
            return "ladder", 0.5, adapt_on, f"verify policy ladder ({why}), adapt {int(adapt_on)} from {adapt_source}"
        value = "confidence-slot"
    if value == "ladder":
        return "ladder", 0.5, adapt_on, f"verify policy ladder from {source}, adapt {int(adapt_on)} from {adapt_source}"
    if not adapt_on:
        shown = "adapt=False (keyword)" if adapt_source == "keyword" else f"{adapt_source}=0"
        raise ValueError(f"verify policy {value!r} ({source}) with {shown} is contradictory: a pinned fixed "
                         "window against a per-round confidence window; unset one")
    if not has_confidence_head:
        raise ValueError(f"verify policy {value!r} ({source}) needs a confidence head "
                         "(confidence_head.proj.*), which this checkpoint does not have; choices: ladder")
    tau_value = 0.5 if tau_value is None else tau_value
    return value, tau_value, True, f"verify policy {value} at tau {tau_value:g} from {source}"


def compile_cache_dir(flag: Optional[bool] = None, env: Optional[Mapping[str, str]] = os.environ) -> Optional[str]:
    """The folder of JAX's persistent compilation cache for the `dflash-jax` command, or None when it is off:
    keyword (`--no-compile-cache` passes False) > DFLASH_COMPILE_CACHE=0|1 > on. The folder is
    JAX_COMPILATION_CACHE_DIR when set, else `dflash-jax/jax` in the user's cache folder ($XDG_CACHE_HOME, or
    ~/.cache)."""
    env = os.environ if env is None else env
    if not switch("compile_cache", flag, True, env)[0]:
        return None
    if env.get("JAX_COMPILATION_CACHE_DIR"):
        return env["JAX_COMPILATION_CACHE_DIR"]
    user_cache = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(user_cache, "dflash-jax", "jax")


LOOP_GRAPH_COMMANDS = ("FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "CUDNN", "DYNAMIC_SLICE_FUSION", "WHILE",
                       "CONDITIONAL")
"""What XLA:GPU may record into CUDA graphs (its command buffers) in `speculative.run_burst`, `Session.burst`'s loop:
XLA's defaults plus `WHILE` and `CONDITIONAL`, so the whole loop runs as one graph on the device instead of the host
reading the condition back each round. On an H200 (JAX 0.11.2, Qwen3-8B-shaped pair, batch 1, greedy,
`bench/results/loop_graph_h200/`) a burst's fixed cost fell from 4.81 to 3.31 ms, rounds unchanged (5.62 against
5.66 ms). Long runs lost: `speculative.run` over 255 rounds took 5.87 against 5.67 ms a round, and plain decoding
167 against 173 tokens/s on an H100, so `generate`'s loops keep XLA's defaults."""


def loop_compiler_options(env: Optional[Mapping[str, str]] = os.environ) -> dict:
    """The XLA options of `speculative.run_burst`: `LOOP_GRAPH_COMMANDS` unless DFLASH_LOOP_GRAPH=0, which leaves
    XLA's defaults (each round's body a graph of its own). Read when `dflash_jax.decoding` is imported."""
    on, _ = switch("loop_graph", None, True, env)
    return {"xla_gpu_enable_command_buffer": ",".join(LOOP_GRAPH_COMMANDS)} if on else {}
