"""Tiny random models shared by the tests (float32, CPU)."""
import os
import shutil
import tempfile

# The suite is compile-bound on tiny shapes, where LLVM's optimisation buys nothing: with XLA's CPU backend at
# optimisation level 0 CI ran the suite in 1,115 s against 1,782 s (2026-12-04). JAX's switch for that (level 0 and
# no expensive LLVM passes) is read at each compile, so the modules whose programs run long take full optimisation
# back (`optimised_compiles`). It allows no fast math, but it lowers some CPU products to other kernels that sum in
# another order (a one-row product differs from a two-row one in the last bit), so the tests compare like with like
# or within float32 rounding. Set before JAX starts; the commands the tests run inherit it.
os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from dflash_jax import compilation  # noqa: E402
from dflash_jax.config import DrafterConfig, Gemma4Config, HybridConfig, RopeConfig, TargetConfig  # noqa: E402
from dflash_jax.drafters.base import Drafter  # noqa: E402
from dflash_jax.io.checkpoints import drafter_family, make_drafter, make_target, target_family  # noqa: E402
from dflash_jax.targets.base import Target  # noqa: E402

os.environ["DFLASH_COMPILE_CACHE"] = "0"  # commands run by the tests keep out of the user's cache folder


_CACHE_OWNED = pytest.StashKey[str]()


def pytest_configure(config):
    """One persistent compilation cache for the whole run, in a fresh temporary folder that the xdist workers and
    the commands the tests start share (JAX's own variables, which they inherit, name it and cache every
    program): the suite is compile-bound, and many tests build the same programs (on 2 cores test_dspark's
    greedy tests took 393 s with it against 585 s without). The process that makes the folder removes it."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        config.stash[_CACHE_OWNED] = tempfile.mkdtemp(prefix="dflash_jax_test_cache_")
        os.environ.update(JAX_COMPILATION_CACHE_DIR=config.stash[_CACHE_OWNED],
                          JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                          JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
    compilation.enable_persistent_cache(os.environ["JAX_COMPILATION_CACHE_DIR"])


@pytest.fixture(scope="module")
def optimised_compiles():
    """XLA's own CPU optimisation for a module whose programs run long rather than compile long (2-core CPU,
    2026-12-07): `test_long_run.py` alone took 93 s at level 0 and 25 s without the switch; `test_sampling_e2e.py`
    (batches of 16,384 rows, 2 workers) 283 s at level 0 and 217 s at level 3. Level 1 for the whole suite made it
    slower (2,189 s against 1,705). Programs this worker compiled before are reused as they are."""
    before = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", False)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


def pytest_unconfigure(config):
    if _CACHE_OWNED in config.stash:
        shutil.rmtree(config.stash[_CACHE_OWNED], ignore_errors=True)


def target_param_shapes(cfg: TargetConfig) -> dict:
    """The target family's params pytree with shape tuples as leaves (from its module)."""
    return target_family(cfg).param_shapes(cfg)


def drafter_param_shapes(cfg: DrafterConfig) -> dict:
    """The drafter family's params pytree with shape tuples as leaves (from its module)."""
    return drafter_family(cfg).param_shapes(cfg)


def random_params(shapes, seed: int, scale: float = 0.2):
    """Normal weights for a shape pytree: norm weights near 1, biases small, matrices `scale`."""
    rng = np.random.RandomState(seed)

    def leaf(path, shape):
        w = rng.randn(*shape).astype(np.float32)
        if "norm" in jax.tree_util.keystr(path):
            return jnp.asarray(1.0 + 0.1 * w)
        return jnp.asarray((0.1 if len(shape) == 1 else scale) * w)

    return jax.tree_util.tree_map_with_path(leaf, shapes, is_leaf=lambda x: isinstance(x, tuple))


def tiny_target(seed: int = 0, vocab: int = 64, layers: int = 3, hidden: int = 32, head_dim: int = 8) -> Target:
    cfg = TargetConfig(arch="qwen3", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=head_dim, rms_norm_eps=1e-6,
                       rope=RopeConfig(10000.0), max_position_embeddings=1024)
    return make_target(cfg, random_params(target_param_shapes(cfg), seed))


def tiny_hybrid(seed: int = 0, vocab: int = 64, hidden: int = 32, experts: int = 0, head_dim: int = 8) -> Target:
    """A Qwen3.5-style hybrid: a Gated DeltaNet layer, then a gated attention layer; with `experts`, the first
    layer's MLP is a mixture of that many experts (top 2) and a shared expert."""
    moe = dict(moe_layers=(True, False), num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=16,
               shared_expert_intermediate_size=16) if experts else dict(moe_layers=(False, False))
    cfg = HybridConfig(arch="qwen3_5", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=head_dim, rms_norm_eps=1e-6, rope=RopeConfig(10000.0),
                       max_position_embeddings=1024, layer_types=("linear_attention", "full_attention"),
                       rotary_dim=4, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                       linear_value_head_dim=8, **moe)
    centred = ("attn_norm", "mlp_norm", "q_norm", "k_norm", "final_norm")  # scaled by 1 + w: keep 1 + w near 1
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x - 1.0 if getattr(path[-1], "key", None) in centred else x,
        random_params(target_param_shapes(cfg), seed))
    return make_target(cfg, params)


def tiny_gemma4(seed: int = 0, vocab: int = 64, hidden: int = 32, window: int = 4) -> Target:
    """A Gemma-4 E2B-style target: sliding, full (wider heads, proportional rope), then a sliding and a full layer
    that share the K/V of the first two; per-layer embeddings, an untied head and a logit soft-cap. The norms after
    attention, MLP and per-layer input weigh 0.3, so each layer adds less to the residual stream than the embedding
    holds (as a trained model's do)."""
    sliding, full = "sliding_attention", "full_attention"
    cfg = Gemma4Config(arch="gemma4", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=4,
                       num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope=RopeConfig(10000.0),
                       max_position_embeddings=1024, layer_types=(sliding, full, sliding, full), sliding_window=window,
                       global_head_dim=16, num_global_kv_heads=1,
                       full_rope=RopeConfig(1e6, "proportional", (("partial_rotary_factor", 0.25),)),
                       num_kv_shared_layers=2, hidden_size_per_layer_input=4, vocab_size_per_layer_input=vocab,
                       final_logit_softcapping=30.0)
    def leaf(path, x):
        name = getattr(path[-1], "key", "")
        return x + 1.0 if name == "layer_scalar" else 0.3 * x if name.startswith("post_") or name == "ple_norm" else x

    params = jax.tree_util.tree_map_with_path(leaf, random_params(target_param_shapes(cfg), seed))
    return make_target(cfg, params)


def tiny_drafter(target: Target, block_size: int, seed: int = 1, windows=(None, None), causal=(False, False),
                 tap_ids=(0, 2)) -> Drafter:
    tc = target.config
    cfg = DrafterConfig(family="dflash", hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
                        num_layers=len(windows), num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6,
                        rope=RopeConfig(10000.0), block_size=block_size, mask_token_id=tc.vocab_size - 1,
                        target_layer_ids=tuple(tap_ids), layer_window=tuple(windows), causal=tuple(causal),
                        vocab_size=tc.vocab_size)
    return make_drafter(cfg, random_params(drafter_param_shapes(cfg), seed))


def max_rel_err(ours, ref) -> float:
    """Largest absolute difference over the reference's largest magnitude."""
    return float(np.abs(np.asarray(ours) - ref).max() / np.abs(ref).max())


@jax.jit
def extend_commit(target: Target, state, block, start, kept):
    """A verify-shaped `extend` of `block` at `start` and the `commit` of `kept`: (logits, state)."""
    h, _, state, pending = target.extend(state, block, start)
    return target.logits(h), target.commit(state, pending, kept)


@jax.jit
def prefill_commit(target: Target, state, block, kept):
    """A prefill-shaped `extend` from position 0 that promises `valid=kept`, and its `commit`: (logits, state)."""
    h, _, state, pending = target.extend(state, block, jnp.zeros_like(kept), valid=kept)
    return target.logits(h), target.commit(state, pending, kept)


def assert_long_prompts_decode_as_the_uncached_forward(target: Target, drafter: Drafter) -> None:
    """A 700-token prompt (two 512-token prefill chunks, the second partly padding) beside a 5-token one that the
    second chunk leaves alone: greedy tokens equal the argmax of one uncached forward, with and without `drafter`,
    and at narrower prefill chunks, and through `impl="cudnn"`.
    Teacher forcing: each token is the argmax of the forward over everything before it, which by induction is the
    greedy continuation (one forward, not one compile per length)."""
    import dflash_jax

    rng = np.random.RandomState(3)
    vocab = target.config.vocab_size
    prompts = [rng.randint(0, vocab, 700).tolist(), rng.randint(0, vocab, 5).tolist()]
    plain = dflash_jax.generate(target, None, prompts, max_new_tokens=4).tokens
    seqs = np.zeros((2, 704), np.int32)
    for i, (prompt, got) in enumerate(zip(prompts, plain)):
        seqs[i, :len(prompt) + 4] = prompt + got
    choice = np.asarray(target.full_logits(seqs)).argmax(-1)
    for i, (prompt, got) in enumerate(zip(prompts, plain)):
        want = choice[i, len(prompt) - 1:len(prompt) + 3].tolist()
        assert got == want, f"prompt of {len(prompt)} tokens: {got} != the uncached forward's argmax {want}"
    assert dflash_jax.generate(target, drafter, prompts, max_new_tokens=4).tokens == plain
    for chunk in (64, 256):  # tokens do not depend on the prefill chunk (`policy.prefill_chunk`)
        got = dflash_jax.generate(target, None, prompts, max_new_tokens=4, prefill_chunk=chunk).tokens
        assert got == plain, f"prefill chunk {chunk}: {got} != {plain} at the default chunk"
    assert dflash_jax.generate(target, drafter, prompts, max_new_tokens=4, prefill_chunk=128).tokens == plain
    # impl="cudnn" (here XLA's form of the fused attention, merged with the context's by log-sum-exp)
    got = dflash_jax.generate(target, None, prompts, max_new_tokens=4, impl="cudnn", prefill_chunk=256).tokens
    assert got == plain, f"impl='cudnn': {got} != {plain}"


@pytest.fixture(autouse=True, scope="module")
def free_compiled_programs():
    """Drop compiled programs after each test module. XLA's CPU backend maps each program's code in
    its own memory regions, and the suite compiles thousands of programs in one process: without
    this it passes Linux's default 65,530 mappings per process and segfaults inside a compile."""
    yield
    jax.clear_caches()


@pytest.fixture(scope="session")
def target():
    return tiny_target()


def reference_filter(logits, s, slack: float = 0.0) -> np.ndarray:
    """The filtered next-token distribution of `Sampling` s over `logits [..., V]`, in float64 numpy (no library
    code): temperature, then top-k (ties at the k-th value kept), top-p (a token stays while the mass strictly
    more likely than it is < top_p), min-p (p >= min_p * max), each renormalised. `slack` widens every cut, for
    support checks that must not trip on float32 rounding at a cut."""
    z = np.asarray(logits, np.float64) / s.temperature
    if 0 < s.top_k < z.shape[-1]:
        kth = np.sort(z, axis=-1)[..., -s.top_k, None]
        z = np.where(z >= kth - slack, z, -np.inf)
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    if s.top_p < 1:
        before = np.einsum("...j,...ij->...i", p, (p[..., None, :] > p[..., :, None]).astype(np.float64))
        p = np.where(before < s.top_p + slack, p, 0.0)
        p /= p.sum(axis=-1, keepdims=True)
    if s.min_p > 0:
        p = np.where(p >= s.min_p * p.max(axis=-1, keepdims=True) - slack, p, 0.0)
        p /= p.sum(axis=-1, keepdims=True)
    return p


def inject_reference(plain_tokens, max_new: int, nd: int, first_wrong=None):
    """Proposals copied from a plain continuation, for driving the loop to every acceptance length:
    `first_wrong[k]` = P(the first wrong slot is k), k = nd meaning none (default: uniform over 0..nd)."""
    from dflash_jax.decoding.speculative import Injected

    ref = np.zeros((len(plain_tokens), max_new + nd + 2), np.int32)
    for i, row in enumerate(plain_tokens):
        ref[i, : len(row)] = row
    probs = np.ones(nd + 1, np.float32) if first_wrong is None else np.asarray(first_wrong, np.float32)
    return Injected(jnp.asarray(ref), jnp.asarray(probs / probs.sum()))


def inverted_accept_length(p_draft, q_draft, u, n_valid):
    """A wrong accept rule for "teeth" tests: accepts exactly when the Leviathan rule rejects."""
    slot = jnp.arange(p_draft.shape[-1])
    accepted = ~(u * q_draft < p_draft) & (slot < n_valid[:, None])
    return jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=-1), axis=-1)


def residual_without_q(p_logprobs, q, draft):
    """A wrong residual for "teeth" tests: draws from p after a rejection, ignoring q."""
    return p_logprobs


def biased_target(base: Target, params: dict, bias_dim_size: float, bias_slope: float, context_scale: float) -> Target:
    """`base`'s family over `params`, with a token bias its drafters share: hidden dim 0 of every
    embedding is raised by `bias_dim_size`, LM head row 0 gives token t the logit -bias_slope * t
    along it, and rows 1.. (the context-dependent part of the logits) are scaled by `context_scale`."""
    norm = params["final_norm"][0] + (1.0 if isinstance(base.config, HybridConfig) else 0.0)  # hybrids: 1 + w
    bias_row = -bias_slope * np.arange(base.config.vocab_size) / (np.sqrt(base.config.hidden_size) * norm)
    return make_target(base.config, dict(params, embed=params["embed"].at[:, 0].add(bias_dim_size),
                                         lm_head=(context_scale * params["lm_head"]).at[0].set(bias_row)))


def damped_layers(drafter: Drafter, damp: float) -> dict:
    """The drafter's layer params with their output projections (wo, w_down) scaled by `damp`."""
    return {name: dict(lp, wo=damp * lp["wo"], w_down=damp * lp["w_down"])
            for name, lp in drafter.params.items() if name.startswith("layers_")}
