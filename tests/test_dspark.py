"""DSpark drafters (docs/architecture.md, "DSpark"): the original's harvest and verify-window tests as
pytest, the census of its settings, and lossless greedy decoding with and without each head under
every verify-window policy and cap."""
import dataclasses
import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax
from dflash_jax import sampling as smp
from dflash_jax.config import CheckpointError, DrafterConfig, RopeConfig, drafter_census, policy
from dflash_jax.decoding import speculative as spec
from dflash_jax.drafters import dspark
from dflash_jax.io.checkpoints import make_drafter
from conftest import drafter_param_shapes, inject_reference, random_params

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
B = 7
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [1, 2, 3], list(range(12, 40))]
MAX_NEW = 24
NO_ENV: dict = {}


def logit(p: float) -> float:
    return float(np.log(p / (1 - p)))


def harvest_cfg(harvest: str, block_size: int = B) -> DrafterConfig:
    return DrafterConfig(family="dspark", hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope=RopeConfig(1e4), block_size=block_size,
                         mask_token_id=63, target_layer_ids=(0,), layer_window=(None,), causal=(False,),
                         harvest=harvest, vocab_size=64)


def trained_offset_of_row(cfg: DrafterConfig, row: int) -> int:
    """The offset after the anchor that block row `row` predicts under the config's harvest."""
    return row + 1 - cfg.first_row


# --- the original's dspark_harvest_tests -------------------------------------------------------


def test_dspark_strategy_requires_shifted_harvest():
    cfg = harvest_cfg("dspark")
    assert cfg.first_row == 0, "DSpark supervises every row with shifted labels: the anchor row is draft 1"
    assert cfg.n_drafts == B, "DSpark harvests block_size drafts per round"
    for row in range(B):
        assert trained_offset_of_row(cfg, row) == row + 1, "row k predicts anchor + k + 1"


def test_dflash_strategy_keeps_mask_fill_harvest():
    cfg = harvest_cfg("dflash")
    assert cfg.first_row == 1 and cfg.n_drafts == B - 1
    for row in range(1, B):
        assert trained_offset_of_row(cfg, row) == row


def test_every_candidate_verifies_the_position_its_row_was_trained_for():
    for harvest in ("dflash", "dspark"):
        cfg = harvest_cfg(harvest)
        for i in range(1, cfg.n_drafts + 1):
            row = cfg.first_row + i - 1
            assert trained_offset_of_row(cfg, row) == i, f"{harvest}: candidate {i} rides row {row}"


def _dspark_config(**edits) -> dict:
    d = json.loads((FIXTURES / "qwen3-8b-dspark-config.json").read_text())
    d.update(edits)
    return d


def _dflash_config() -> dict:
    d = json.loads((FIXTURES / "qwen3-8b-dflash-template-config.json").read_text())
    d["dflash_config"] = {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}
    return d


def test_harvest_setting_parses_and_refuses():
    assert drafter_census(_dflash_config(), env={"DFLASH_HARVEST": "dspark"}).harvest == "dspark"
    assert drafter_census(_dflash_config(), env={"DFLASH_HARVEST": "dflash"}).harvest == "dflash"
    assert drafter_census(_dflash_config(), harvest="dspark", env=NO_ENV).harvest == "dspark"
    for env, kw in (({"DFLASH_HARVEST": "shifted"}, {}), (NO_ENV, {"harvest": "mask-fill"})):
        with pytest.raises(ValueError, match="unknown harvest; choices: dflash, dspark"):
            drafter_census(_dflash_config(), env=env, **kw)


def test_default_harvest_is_keyed_by_the_checkpoints_strategy():
    assert drafter_census(_dspark_config(), env=NO_ENV).harvest == "dspark"
    assert drafter_census(_dflash_config(), env=NO_ENV).harvest == "dflash"
    assert drafter_census(_dflash_config(), env={"DFLASH_HARVEST": ""}).harvest == "dflash", "empty is unset"
    assert drafter_census(_dspark_config(), env={"DFLASH_HARVEST": "dflash"}).harvest == "dflash"
    assert drafter_census(_dflash_config(), env={"DFLASH_HARVEST": "dspark"}).harvest == "dspark"


def test_strategy_census_reads_the_checkpoint_not_the_env():
    base = {k: v for k, v in _dflash_config().items() if k != "architectures"}
    nested = dict(base, architectures=["Qwen3DFlashModel"],
                  dflash_config=dict(base["dflash_config"], projector_type="dspark"))
    assert drafter_census(dict(base, architectures=["Qwen3DSparkModel"]), env=NO_ENV).harvest == "dspark"
    assert drafter_census(nested, env=NO_ENV).harvest == "dspark", "projector_type nested in dflash_config"
    assert drafter_census(dict(base, projector_type="dspark"), env=NO_ENV).harvest == "dspark"
    assert drafter_census(dict(base, architectures=["Qwen3DFlashModel"]), env=NO_ENV).harvest == "dflash"


def test_dspark_trained_rows_through_mask_fill_harvest_accept_nothing():
    """Rows trained for offset k + 1, read at offset k, match no verified position."""
    base = 1000
    target_argmax = jnp.asarray([[base + j for j in range(1, B + 2)]], jnp.int32)  # argmax after anchor, ...
    for harvest, expected in (("dspark", B), ("dflash", 0)):
        cfg = harvest_cfg(harvest)
        drafts = jnp.asarray([[base + trained_offset_of_row(harvest_cfg("dspark"), cfg.first_row + i)
                               for i in range(cfg.n_drafts)]], jnp.int32)
        vt = jnp.asarray([cfg.n_drafts + 1])
        m, _ = smp.greedy_accept(target_argmax[:, :cfg.n_drafts + 1], drafts, vt)
        assert int(m[0]) == expected, f"{harvest} harvest of a DSpark-trained drafter accepts {int(m[0])}"


# --- the original's dspark_vt_tests ------------------------------------------------------------


def _width(ps, tau, cap, running):
    raw = jnp.asarray([[logit(p) for p in ps]], jnp.float32).reshape(1, len(ps))
    return int(dspark.confidence_width(raw, tau, cap, running)[0])


def test_confidence_vt_is_cumprod_survival_not_per_slot_threshold():
    ps = [0.9, 0.8, 0.9, 0.9, 0.9, 0.9, 0.9]
    assert _width(ps, 0.5, 8, True) == 6, "keeps 5 drafts + anchor"
    assert _width(ps, 0.7, 8, True) == 3, "tau 0.7 keeps 2 drafts"
    assert _width(ps, 0.05, 8, True) == 8, "tau -> 0 is the full block"


def test_slot_arm_truncates_at_first_low_confidence_slot():
    ps = [0.9, 0.8, 0.9, 0.9, 0.9, 0.9, 0.9]
    assert _width(ps, 0.5, 8, False) == 8
    assert _width(ps, 0.5, 8, True) == 6
    tail = [0.9, 0.9, 0.3, 0.9, 0.9, 0.9, 0.9]
    assert _width(tail, 0.5, 8, False) == 3, "2 drafts + anchor"
    assert _width(tail, 0.95, 8, False) == 2, "floor at tau 0.95"


def test_confidence_vt_floor_and_cap():
    cold = [0.1, 0.1, 0.1]
    assert _width(cold, 0.5, 8, True) == 2 and _width(cold, 0.5, 8, False) == 2, "floor = anchor + 1 draft"
    hot = [0.99] * 7
    assert _width(hot, 0.5, 5, True) == 5 and _width(hot, 0.5, 5, False) == 5, "the cap binds"
    assert _width(hot, 0.5, 8, True) == 8, "full block when confident"
    assert _width([], 0.5, 8, True) == 2 and _width([], 0.5, 8, False) == 2


def test_ladder_clamps_to_the_cap_and_never_panics_below_three():
    """The original clamps m + 2 to [3, cap], which panics for cap < 3; ours clamps to [min(3, cap), cap]."""
    m_plus_2 = jnp.asarray([2, 3, 5, 17])
    assert dspark.ladder_width(m_plus_2, 8).tolist() == [3, 3, 5, 8]
    assert dspark.ladder_width(m_plus_2, 2).tolist() == [2, 2, 2, 2]


def test_vt_policy_defaults_follow_the_confidence_head():
    assert policy.verify_policy(None, None, None, True, NO_ENV)[:3] == ("confidence-slot", 0.5, True)
    assert policy.verify_policy(None, "0.35", None, True, NO_ENV)[:2] == ("confidence-slot", 0.35)
    assert policy.verify_policy(None, None, None, False, NO_ENV)[:3] == ("ladder", 0.5, True)
    assert policy.verify_policy(None, None, False, True, NO_ENV)[:3] == ("ladder", 0.5, False)
    assert policy.verify_policy("ladder", None, None, True, NO_ENV)[0] == "ladder"
    assert policy.verify_policy("confidence", "0.35", None, True, NO_ENV)[:2] == ("confidence", 0.35)
    env = {"DFLASH_VT": "confidence-slot", "DFLASH_VT_TAU": "0.6", "DFLASH_ADAPT": "1"}
    assert policy.verify_policy(None, None, None, True, env)[:2] == ("confidence-slot", 0.6)
    assert policy.verify_policy(None, None, None, True, {"DFLASH_VT": "ladder", "DFLASH_ADAPT": "0"})[:3] == \
        ("ladder", 0.5, False), "ladder + adapt off is the fixed window"


@pytest.mark.parametrize("kw, env, match", [
    (dict(kwarg="confidence-slot", adapt=False), NO_ENV, "contradictory"),
    (dict(kwarg="confidence"), {"DFLASH_ADAPT": "0"}, "DFLASH_ADAPT=0 is contradictory"),
    (dict(kwarg="static"), NO_ENV, r"verify_policy='static' \(keyword\): unknown verify_policy; choices: ladder"),
    (dict(), {"DFLASH_VT": "static"}, "DFLASH_VT='static'"),
    (dict(tau="nan-ish"), NO_ENV, r"tau must be a number in \(0, 1\)"),
    (dict(kwarg="confidence", has_head=False), NO_ENV, "needs a confidence head"),
    (dict(), {"DFLASH_ADAPT": "maybe"}, "DFLASH_ADAPT='maybe': unknown adapt; choices: 0, 1"),
])
def test_vt_policy_refuses_unknown_and_contradictory_settings(kw, env, match):
    has_head = kw.pop("has_head", True)
    with pytest.raises(ValueError, match=match):
        policy.verify_policy(kw.get("kwarg"), kw.get("tau"), kw.get("adapt"), has_head, env)


@pytest.mark.parametrize("bad", ["0", "1", "1.5", "-0.1", "nan"])
def test_tau_outside_the_open_unit_interval_is_refused(bad):
    with pytest.raises(ValueError, match=r"DFLASH_VT_TAU='.*': the confidence threshold tau"):
        policy.verify_policy("confidence", None, None, True, {"DFLASH_VT_TAU": bad})


def _confidence(cfg, w, b, hidden, emb):
    params = dict(dspark.init_params(cfg), confidence_w=jnp.asarray(w)[:, None], confidence_b=jnp.asarray([b]))
    return float(dspark.DSparkModule(cfg).apply({"params": params}, jnp.asarray([hidden]),
                                                None if emb is None else jnp.asarray([emb]),
                                                method=dspark.DSparkModule.confidence)[0])


def test_raw_score_matches_the_parity_gate_dot():
    cfg = dataclasses.replace(harvest_cfg("dspark", block_size=2), hidden_size=3, intermediate_size=4, num_heads=1,
                              num_kv_heads=1, head_dim=4)
    with_markov = dataclasses.replace(cfg, markov_rank=2, confidence_in_dim=5)
    got = _confidence(with_markov, [0.5, -1.0, 2.0, 0.25, -0.5], 0.125, [1.0, 2.0, 3.0], [4.0, 8.0])
    assert got == pytest.approx(0.125 + 0.5 * 1.0 - 1.0 * 2.0 + 2.0 * 3.0 + 0.25 * 4.0 - 0.5 * 8.0)
    got = _confidence(dataclasses.replace(cfg, confidence_in_dim=3), [0.5, -1.0, 2.0], -0.25, [1.0, 2.0, 3.0], None)
    assert got == pytest.approx(-0.25 + 0.5 * 1.0 - 1.0 * 2.0 + 2.0 * 3.0)


# --- the census of DSpark's settings -----------------------------------------------------------


def test_census_resolves_the_real_dspark_config():
    cfg = drafter_census(_dspark_config(), env=NO_ENV)
    assert (cfg.family, cfg.harvest, cfg.n_drafts) == ("dspark", "dspark", cfg.block_size)
    assert (cfg.markov_rank, cfg.confidence_in_dim) == (256, 4096 + 256)
    assert (cfg.verify_policy, cfg.verify_tau, cfg.adapt, cfg.markov) == ("confidence-slot", 0.5, True, True)
    assert any("verify policy confidence-slot" in r for r in cfg.reasons)
    off = drafter_census(_dspark_config(), markov=False, verify_policy="ladder", env=NO_ENV)
    assert (off.markov, off.verify_policy) == (False, "ladder")
    assert drafter_census(_dspark_config(), env={"DFLASH_MARKOV": "0"}).markov is False


def test_dspark_settings_on_a_dflash_drafter_are_refused():
    with pytest.raises(CheckpointError, match="DSpark settings"):
        drafter_census(_dflash_config(), verify_policy="ladder", env=NO_ENV)
    with pytest.raises(CheckpointError, match="DFLASH_VT set for a DFlash drafter"):
        drafter_census(_dflash_config(), env={"DFLASH_VT": "confidence"})


def test_markov_on_without_the_markov_head_is_refused():
    d = _dspark_config()
    d["dflash_config"] = {k: v for k, v in d["dflash_config"].items() if "markov" not in k and "confidence" not in k}
    assert drafter_census(d, env=NO_ENV).markov is False
    with pytest.raises(CheckpointError, match="no markov_head tensors"):
        drafter_census(d, markov=True, env=NO_ENV)


# --- lossless greedy decoding ------------------------------------------------------------------


def tiny_dspark(target, *, markov: bool, confidence: bool, verify_policy: str, adapt: bool = True,
                tau: float = 0.5, block_size: int = 6) -> dspark.DSparkDrafter:
    tc = target.config
    rank = 8 if markov else None
    cfg = DrafterConfig(family="dspark", hidden_size=tc.hidden_size, intermediate_size=2 * tc.hidden_size,
                        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6,
                        rope=RopeConfig(1e4), block_size=block_size, mask_token_id=tc.vocab_size - 1,
                        target_layer_ids=(0, 2), layer_window=(None, None), causal=(False, False), harvest="dspark",
                        vocab_size=tc.vocab_size, markov_rank=rank,
                        confidence_in_dim=(tc.hidden_size + (rank or 0)) if confidence else None,
                        verify_policy=verify_policy, verify_tau=tau, adapt=adapt, markov=markov)
    return make_drafter(cfg, random_params(drafter_param_shapes(cfg), 1, scale=0.4))


@pytest.fixture(scope="module")
def plain(target):
    return dflash_jax.generate(target, None, PROMPTS, max_new_tokens=MAX_NEW).tokens


HEADS = [(False, False), (True, False), (False, True), (True, True)]
POLICIES = [("ladder", True), ("ladder", False), ("confidence", True), ("confidence-slot", True)]
CASES = [(m, c, p, a) for m, c in HEADS for p, a in POLICIES if p == "ladder" or c]  # confidence needs the head


@pytest.mark.parametrize("markov, confidence, verify_policy, adapt", CASES)
def test_greedy_dspark_equals_plain_under_every_head_and_policy(target, plain, markov, confidence, verify_policy,
                                                                adapt):
    """Every head and policy at the full verify width; the capped width and the buckets, which meet the heads
    only through the policy, under every policy with the Markov head (each run compiles a loop of its own)."""
    drafter = tiny_dspark(target, markov=markov, confidence=confidence, verify_policy=verify_policy, adapt=adapt,
                          tau=0.3)
    nd = drafter.n_drafts
    widths = ((3, None), (nd + 1, None), (nd + 1, (3, 5))) if markov else ((nd + 1, None),)
    for verify_t, buckets in widths:
        out = dflash_jax.Session(target, drafter, PROMPTS, max_new_tokens=MAX_NEW, verify_t=verify_t,
                                 verify_buckets=buckets, inject=inject_reference(plain, MAX_NEW, nd)).run()
        assert out.tokens == plain, f"verify_t {verify_t}, buckets {buckets}: output differs from plain greedy"
        assert sum(out.stats.accept_hist[verify_t:]) == 0, "no round accepts more than the cap allows"
    if markov:
        assert dflash_jax.generate(target, drafter, PROMPTS[1:2], max_new_tokens=MAX_NEW).tokens == plain[1:2]
    assert dflash_jax.generate(target, drafter, PROMPTS, max_new_tokens=MAX_NEW).tokens == plain


def test_policies_change_the_verify_width_but_not_the_output(target, plain):
    """With injected drafts the widths must differ between policies (else the test proves nothing)."""
    drafted = {}
    for verify_policy, adapt in POLICIES:
        drafter = tiny_dspark(target, markov=True, confidence=True, verify_policy=verify_policy, adapt=adapt,
                              tau=0.45)
        out = dflash_jax.Session(target, drafter, PROMPTS, max_new_tokens=MAX_NEW,
                                 inject=inject_reference(plain, MAX_NEW, drafter.n_drafts)).run()
        assert out.tokens == plain
        drafted[(verify_policy, adapt)] = out.stats.drafted / out.stats.rounds
    assert len(set(drafted.values())) > 2, f"drafts examined per round should depend on the policy: {drafted}"


def test_the_markov_chain_feeds_each_chosen_token_to_the_next_slot(target):
    """Greedy drafts equal a step-by-step reference: argmax(logits_k + W1[prev_k] @ W2), prev_0 = anchor."""
    drafter = tiny_dspark(target, markov=True, confidence=False, verify_policy="ladder")
    p = drafter.params
    w1, w2 = p["markov_w1"] * 40.0, p["markov_w2"] * 40.0  # a head strong enough to change the argmax
    drafter = drafter.replace(params=dict(p, markov_w1=w1, markov_w2=w2))
    out = dflash_jax.propose(target, drafter, PROMPTS)
    no_markov = dflash_jax.propose(target, drafter.replace(config=dataclasses.replace(drafter.config, markov=False)),
                                   PROMPTS)
    base = np.asarray(no_markov.logits)
    for b in range(len(PROMPTS)):
        prev = int(out.anchor[b])
        for k in range(drafter.n_drafts):
            want = int(np.argmax(base[b, k] + np.asarray(w1[prev] @ w2)))
            assert int(out.tokens[b, k]) == want, f"row {b} slot {k}"
            prev = want
    assert not np.array_equal(out.tokens, no_markov.tokens), "the Markov head must change some drafts"


def test_bucketed_verify_switches_between_static_blocks_and_keeps_the_output(target, plain):
    drafter = tiny_dspark(target, markov=True, confidence=True, verify_policy="confidence-slot", tau=0.45)
    session = dflash_jax.Session(target, drafter, PROMPTS, max_new_tokens=MAX_NEW, verify_buckets=(3, 5),
                                 inject=inject_reference(plain, MAX_NEW, drafter.n_drafts))
    hlo = spec.run.lower(session.loop, target, drafter, session.state, session.stop_tokens).as_text()
    assert "stablehlo.case" in hlo, "the round must switch between the bucketed verify blocks"
    full = dflash_jax.Session(target, drafter, PROMPTS, max_new_tokens=MAX_NEW,
                              inject=inject_reference(plain, MAX_NEW, drafter.n_drafts))
    bucketed, whole = session.run(), full.run()
    assert bucketed.tokens == whole.tokens == plain
    counts = ("rounds", "drafted", "accepted", "committed", "accept_hist", "per_row")
    assert [getattr(bucketed.stats, k) for k in counts] == [getattr(whole.stats, k) for k in counts], \
        "buckets change the cost only"


@pytest.mark.parametrize("buckets, env", [((1, 4), NO_ENV), ((4, 4.5), NO_ENV), ((6,), NO_ENV),
                                          (None, {"DFLASH_VERIFY_BUCKETS": "4,x"})])
def test_verify_buckets_outside_the_block_are_refused(buckets, env):
    with pytest.raises(ValueError, match=r"verify buckets must be distinct integers in 2\.\.5"):
        policy.verify_buckets(buckets, 5, env=env)
    assert policy.verify_buckets((4, 2), 5, env=NO_ENV) == (2, 4)
    assert policy.verify_buckets(None, 5, env={"DFLASH_VERIFY_BUCKETS": "3,4"}) == (3, 4)


def test_buckets_default_on_only_where_they_measured_faster():
    """On for drafters whose widths vary, from batch 16; off at batch 1 and for fixed widths."""
    assert policy.verify_buckets(None, 16, 16, True, NO_ENV) == (4, 8)
    assert policy.verify_buckets(None, 16, 1, True, NO_ENV) == ()
    assert policy.verify_buckets(None, 16, 64, False, NO_ENV) == ()
    assert policy.verify_buckets(None, 5, 64, True, NO_ENV) == (4,), "buckets past the block are dropped"
    assert policy.verify_buckets(None, 16, 64, True, {"DFLASH_VERIFY_BUCKETS": "none"}) == ()
    assert policy.verify_buckets((), 16, 64, True, NO_ENV) == ()


def test_batch_budget_spends_drafts_on_the_highest_running_products():
    ps = [[0.99, 0.99, 0.99, 0.5], [0.9, 0.2, 0.9, 0.9], [0.6, 0.6, 0.6, 0.6]]
    raw = jnp.asarray([[logit(p) for p in row] for row in ps], jnp.float32)
    # running products: row 0 .99 .98 .97 .49; row 1 .9 .18 .16 .15; row 2 .6 .36 .22 .13
    assert dspark.budget_width(raw, 5, 5).tolist() == [4, 2, 2], "the 5 best: row 0's first 3, rows 1 and 2's first"
    assert dspark.budget_width(raw, 6, 5).tolist() == [5, 2, 2], "the sixth best is row 0's fourth (.49 > .36)"
    assert dspark.budget_width(raw, 7, 5).tolist() == [5, 2, 3], "the seventh is row 2's second"
    assert dspark.budget_width(raw, 1, 5).tolist() == [2, 2, 2], "every row checks at least one draft"
    assert dspark.budget_width(raw, 12, 4).tolist() == [4, 4, 4], "the cap still binds"


def test_batch_budget_keeps_the_output_and_is_refused_with_the_ladder(target, plain):
    drafter = tiny_dspark(target, markov=True, confidence=True, verify_policy="confidence-slot")
    drafter = drafter.replace(config=dataclasses.replace(drafter.config, verify_budget=6))
    out = dflash_jax.Session(target, drafter, PROMPTS, max_new_tokens=MAX_NEW,
                             inject=inject_reference(plain, MAX_NEW, drafter.n_drafts)).run()
    assert out.tokens == plain
    assert out.stats.drafted <= out.stats.rounds + 6 * max(out.stats.per_row["rounds"]), "about 6 drafts a round"
    with pytest.raises(CheckpointError, match="verify_budget 8 spends drafts by confidence; the verify policy is"):
        drafter_census(_dspark_config(), verify_policy="ladder", verify_budget=8, env=NO_ENV)
    with pytest.raises(CheckpointError, match="DFLASH_VERIFY_BUDGET='-3': the verify budget must be a positive"):
        drafter_census(_dspark_config(), env={"DFLASH_VERIFY_BUDGET": "-3"})
    assert drafter_census(_dspark_config(), verify_budget=8, env=NO_ENV).verify_budget == 8
