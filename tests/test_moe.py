"""The sparse MoE block: routing and both expert impls against a per-token numpy loop, against each other
and against transformers' `Qwen3NextSparseMoeBlock` (copied weights); bf16, jit and refusals."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.targets import moe
from dflash_jax.targets.moe import MOE_IMPLS, experts, moe_block, route


jit_block = jax.jit(moe_block, static_argnames=("top_k", "norm_topk_prob", "impl"))  # one compile, not one per op


def random_params(seed: int, h: int, e: int, i: int, shared: int, router_scale: float = 1.0) -> dict:
    """Float32 weights in our `[in, out]` layout; a larger `router_scale` gives peakier routing."""
    rng = np.random.default_rng(seed)
    shapes = {"router": (h, e), "w_gate_up": (e, h, 2 * i), "w_down": (e, i, h), "shared_gate_up": (h, 2 * shared),
              "shared_down": (shared, h), "shared_gate": (h, 1)}
    params = {k: rng.standard_normal(s).astype(np.float32) / np.sqrt(s[-2]) for k, s in shapes.items()}
    params["router"] *= router_scale
    return {k: jnp.asarray(v) for k, v in params.items()}


def oracle(x, params, top_k, norm_topk_prob):
    """Float64, one token and one chosen expert at a time, straight from the formula."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    silu = lambda a: a / (1 + np.exp(-a))
    out = np.zeros_like(np.asarray(x, np.float64))
    for t, xt in enumerate(np.asarray(x, np.float64)):
        logits = xt @ p["router"]
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        chosen = np.argsort(-probs, kind="stable")[:top_k]
        w = probs[chosen] / (probs[chosen].sum() if norm_topk_prob else 1.0)
        for weight, e in zip(w, chosen):
            gate, up = np.split(xt @ p["w_gate_up"][e], 2)
            out[t] += weight * ((silu(gate) * up) @ p["w_down"][e])
        gate, up = np.split(xt @ p["shared_gate_up"], 2)
        out[t] += (1 / (1 + np.exp(-(xt @ p["shared_gate"])))) * ((silu(gate) * up) @ p["shared_down"])
    return out


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


# (T, H, E, I, shared, top_k, norm_topk_prob)
CASES = [
    pytest.param(12, 16, 8, 12, 10, 2, True, id="k2-norm"),
    pytest.param(12, 16, 8, 12, 10, 2, False, id="k2-raw"),
    pytest.param(9, 16, 6, 8, 8, 1, True, id="k1"),
    pytest.param(7, 16, 5, 8, 6, 5, False, id="kE-raw"),
    pytest.param(7, 16, 5, 8, 6, 5, True, id="kE-norm"),
    pytest.param(2, 16, 16, 8, 8, 3, True, id="most-experts-unused"),
    pytest.param(1, 16, 8, 12, 10, 3, True, id="one-token-decode"),
]


@pytest.mark.parametrize("impl", MOE_IMPLS)
@pytest.mark.parametrize("t, h, e, i, shared, top_k, norm", CASES)
def test_moe_block_matches_per_token_loop(impl, t, h, e, i, shared, top_k, norm):
    params = random_params(t * 100 + e, h, e, i, shared, router_scale=3.0)
    x = jnp.asarray(np.random.default_rng(t).standard_normal((1, t, h)), jnp.float32)
    out = jit_block(x, params, top_k=top_k, norm_topk_prob=norm, impl=impl)
    assert out.shape == x.shape and out.dtype == jnp.float32
    err = rel_err(out[0], oracle(x[0], params, top_k, norm))
    assert err <= 1e-5, f"{impl}: max rel err {err:.2e} against the per-token loop"


def test_routing_is_non_trivial_in_the_cases():
    """The oracle cases exercise what the sort and the gather must get right: tokens of one batch pick
    different experts, and a sorted group may be empty."""
    params = random_params(12 * 100 + 8, 16, 8, 12, 10, router_scale=3.0)
    x = jnp.asarray(np.random.default_rng(12).standard_normal((12, 16)), jnp.float32)
    _, idx = route(x, params["router"], 2, True)
    assert len({tuple(sorted(r)) for r in np.asarray(idx).tolist()}) >= 4, idx
    params = random_params(2 * 100 + 16, 16, 16, 8, 8, router_scale=3.0)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 16)), jnp.float32)
    _, idx = route(x, params["router"], 3, True)
    assert len(set(np.asarray(idx).ravel().tolist())) <= 6 < 16, idx


def test_impls_agree_on_a_batch_with_repeated_experts():
    """Many tokens per expert (T*k = 96 rows over 6 experts), batch 3: both impls give the same output."""
    params = random_params(5, 16, 6, 8, 8)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((3, 16, 16)), jnp.float32)
    outs = [jit_block(x, params, top_k=2, norm_topk_prob=True, impl=impl) for impl in MOE_IMPLS]
    assert rel_err(outs[0], outs[1]) <= 1e-6
    assert rel_err(outs[0].reshape(-1, 16), oracle(x.reshape(-1, 16), params, 2, True)) <= 1e-5


def test_route_weights_and_ids():
    params = random_params(3, 16, 8, 4, 4, router_scale=3.0)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((10, 16)), jnp.float32)
    probs = jax.nn.softmax(x @ params["router"], axis=-1)
    for norm in (True, False):
        w, idx = route(x, params["router"], 3, norm)
        assert w.shape == idx.shape == (10, 3) and w.dtype == jnp.float32 and idx.dtype == jnp.int32
        picked = np.take_along_axis(np.asarray(probs), np.asarray(idx), axis=1)
        np.testing.assert_array_equal(np.asarray(idx), np.argsort(-np.asarray(probs), axis=1)[:, :3])
        expected = picked / picked.sum(1, keepdims=True) if norm else picked
        np.testing.assert_allclose(np.asarray(w), expected, rtol=1e-6)
    w, _ = route(x.astype(jnp.bfloat16), params["router"].astype(jnp.bfloat16), np.int64(3), True)
    assert w.dtype == jnp.bfloat16 and w.shape == (10, 3), "a numpy int top_k (from a config) is an int"


@pytest.mark.parametrize("norm", [True, False])
def test_moe_block_matches_transformers(norm):
    """External oracle: `Qwen3NextSparseMoeBlock` (float32, CPU torch) with our weights copied in."""
    torch = pytest.importorskip("torch")
    modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    from transformers import Qwen3NextConfig

    h, e, i, shared, top_k = 16, 8, 12, 10, 3
    cfg = Qwen3NextConfig(hidden_size=h, num_experts=e, num_experts_per_tok=top_k, moe_intermediate_size=i,
                          shared_expert_intermediate_size=shared, norm_topk_prob=norm, hidden_act="silu",
                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, vocab_size=32)
    hf = modeling.Qwen3NextSparseMoeBlock(cfg).float().eval()
    params = random_params(11, h, e, i, shared, router_scale=3.0)
    p = {k: torch.from_numpy(np.asarray(v).copy()) for k, v in params.items()}
    with torch.no_grad():
        hf.gate.weight.copy_(p["router"].T)
        hf.experts.gate_up_proj.copy_(p["w_gate_up"].transpose(1, 2))
        hf.experts.down_proj.copy_(p["w_down"].transpose(1, 2))
        hf.shared_expert.gate_proj.weight.copy_(p["shared_gate_up"][:, :shared].T)
        hf.shared_expert.up_proj.weight.copy_(p["shared_gate_up"][:, shared:].T)
        hf.shared_expert.down_proj.weight.copy_(p["shared_down"].T)
        hf.shared_expert_gate.weight.copy_(p["shared_gate"].T)
        x = np.random.default_rng(11).standard_normal((2, 5, h)).astype(np.float32)
        ref = hf(torch.from_numpy(x)).numpy()
    for impl in MOE_IMPLS:
        out = jit_block(jnp.asarray(x), params, top_k=top_k, norm_topk_prob=norm, impl=impl)
        assert rel_err(out, ref) <= 1e-5, f"{impl}: max rel err {rel_err(out, ref):.2e} against transformers"


@pytest.mark.parametrize("impl", MOE_IMPLS)
def test_bf16_runs_and_matches_float32_loosely(impl):
    params = random_params(7, 32, 8, 16, 16)
    x = jnp.asarray(np.random.default_rng(7).standard_normal((2, 4, 32)), jnp.float32)
    ref = jit_block(x, params, top_k=2, norm_topk_prob=True, impl=impl)
    bf = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    out = jit_block(x.astype(jnp.bfloat16), bf, top_k=2, norm_topk_prob=True, impl=impl)
    assert out.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(out)))
    _, idx32 = route(x.reshape(-1, 32), params["router"], 2, True)
    _, idx16 = route(x.reshape(-1, 32).astype(jnp.bfloat16), bf["router"], 2, True)
    same = np.all(np.sort(np.asarray(idx32), 1) == np.sort(np.asarray(idx16), 1), axis=1)
    assert same.sum() >= 6, "bf16 rounding should flip the routing of few tokens at most"
    err = rel_err(out.reshape(-1, 32)[same], ref.reshape(-1, 32)[same])
    assert err <= 3e-2, f"{impl}: bf16 max rel err {err:.2e} against float32 on identically routed tokens"


@pytest.mark.parametrize("impl", MOE_IMPLS)
def test_jit_gives_the_eager_output(impl):
    params = random_params(9, 16, 8, 8, 8)
    x = jnp.asarray(np.random.default_rng(9).standard_normal((3, 4, 16)), jnp.float32)
    fn = jax.jit(functools.partial(moe_block, top_k=2, norm_topk_prob=False, impl=impl))
    eager = moe_block(x, params, top_k=2, norm_topk_prob=False, impl=impl)
    np.testing.assert_allclose(np.asarray(fn(x, params)), np.asarray(eager), rtol=1e-6, atol=1e-7)


def test_experts_alone_weights_each_chosen_expert():
    """`experts` with hand-picked routing: one token to expert 2 with weight 1 equals that expert's SwiGLU;
    zero weights give zero."""
    params = random_params(4, 8, 4, 6, 4)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 8)), jnp.float32)
    idx = jnp.asarray([[2, 0], [1, 3]], jnp.int32)
    weights = jnp.asarray([[1.0, 0.0], [0.0, 0.0]], jnp.float32)
    gate, up = jnp.split(x[0] @ params["w_gate_up"][2], 2)
    expected = (jax.nn.silu(gate) * up) @ params["w_down"][2]
    for impl in MOE_IMPLS:
        out = experts(x, weights, idx, params["w_gate_up"], params["w_down"], impl)
        np.testing.assert_allclose(np.asarray(out[0]), np.asarray(expected), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(out[1]), 0.0)


def test_default_impl():
    assert moe.default_impl("cpu") == moe.default_impl("cpu", tokens=48) == "gather"
    assert moe.default_impl("gpu") == moe.default_impl("gpu", tokens=moe.GROUPED_MAX_TOKENS) == "grouped"
    assert moe.default_impl("gpu", tokens=moe.GROUPED_MAX_TOKENS + 1) == "ragged"
    assert moe.default_impl() in MOE_IMPLS


def test_bad_arguments_are_refused():
    params = random_params(1, 16, 8, 8, 8)
    x = jnp.zeros((1, 3, 16), jnp.float32)

    def call(impl="gather", top_k=2, norm=True, **changed):
        return moe_block(x, {**params, **changed}, top_k=top_k, norm_topk_prob=norm, impl=impl)

    with pytest.raises(ValueError, match=r"impl='dense' is not supported; choose one of \('grouped', 'ragged', 'gather'\)"):
        call(impl="dense")
    with pytest.raises(ValueError, match=r"top_k=9 must be an int in \[1, 8\]"):
        call(impl="ragged", top_k=9)
    with pytest.raises(ValueError, match=r"top_k=0 must be an int in \[1, 8\]"):
        call(top_k=0)
    with pytest.raises(ValueError, match=r"top_k=2.0 must be an int in \[1, 8\]"):
        call(top_k=2.0)
    with pytest.raises(ValueError, match="norm_topk_prob=1 must be True or False"):
        call(norm=1)
    with pytest.raises(ValueError, match=r"params lack \['shared_gate'\]"):
        moe_block(x, {k: v for k, v in params.items() if k != "shared_gate"}, top_k=2, norm_topk_prob=True,
                  impl="gather")
    with pytest.raises(ValueError, match=r"moe_block takes x \[B, W, H\]; got shape \(3, 16\)"):
        moe_block(x[0], params, top_k=2, norm_topk_prob=True, impl="gather")
    with pytest.raises(ValueError, match=r"router \(16, 6\) and w_gate_up \(8, 16, 16\) must agree on the number"):
        call(router=params["router"][:, :6])
    with pytest.raises(ValueError, match="do not fit x"):
        call(impl="ragged", w_down=params["w_down"][:, :4])
    with pytest.raises(ValueError, match="shared expert shapes"):
        call(shared_gate=params["shared_gate"][:8])
    tokens = x[0]
    w, idx = route(tokens, params["router"], 2, True)
    with pytest.raises(ValueError, match="idx has dtype float32; expected integer expert ids in"):
        experts(tokens, w, idx.astype(jnp.float32), params["w_gate_up"], params["w_down"], "ragged")
    with pytest.raises(ValueError, match=r"weights \(3, 1\) and idx \(3, 2\) must both be \[T, k\]"):
        experts(tokens, w[:, :1], idx, params["w_gate_up"], params["w_down"], "gather")
    with pytest.raises(ValueError, match="x has dtype int32; expected a floating dtype"):
        route(tokens.astype(jnp.int32), params["router"], 2, True)
