"""Drafter training (dflash_jax.train): the objective, its agreement with inference, the loop, export, CLI.

The reference for the training forward is the inference path itself: per block, `ingest`
the taps of positions < anchor into a draft cache, run `draft_hidden` on `[anchor, mask,
...]` and read rows 1..b-1 through `harvest_logits`. Everything that asserts exactness runs
in float32.
"""
from __future__ import annotations

import argparse
import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import dflash_jax
from conftest import drafter_param_shapes, random_params, tiny_drafter, tiny_target
from dflash_jax import sampling as smp
from dflash_jax import train
from dflash_jax.config import CheckpointError, HybridConfig, RopeConfig, default_target_layer_ids
from dflash_jax.drafters.base import ProposeSettings
from dflash_jax.io.checkpoints import make_drafter, make_target, read_drafter, write_target

F32 = dict(compute_dtype="float32")


@jax.jit
def _inference_block(drafter, target, taps, tokens_row, anchor):
    """Hidden `[b, H]` and row 1..b-1 logits of one block via ingest + draft_hidden (batch of 1).

    The cache holds the taps of positions < anchor; slots from the anchor on hold large noise,
    so a block that saw past `seq_len = anchor` could not match.
    """
    t = taps.shape[0]
    noise = 10.0 * jax.random.normal(jax.random.key(0), taps.shape)
    ctx = jnp.where(jnp.arange(t)[:, None] < anchor, taps, noise)
    cache = drafter.init_state(1, t + drafter.config.block_size)
    cache, pending = drafter.ingest(cache, ctx[None], jnp.zeros((1,), jnp.int32))
    cache = drafter.commit(cache, pending, jnp.reshape(anchor, (1,)).astype(jnp.int32))
    x = drafter.block_input(target, jnp.reshape(tokens_row[anchor], (1,)))
    h = drafter.draft_hidden(cache, x)
    return h[0], drafter.harvest_logits(target, h)[0]


@jax.jit
def _train_hidden(drafter, target, tokens, anchors):
    _, taps = target.forward(tokens, drafter.config.target_layer_ids)
    b, hidden = drafter.config.block_size, target.config.hidden_size
    x = drafter.block_input(target, jnp.take_along_axis(tokens, anchors, axis=1).reshape(-1))
    x = x.reshape(*anchors.shape, b, hidden)
    return taps, drafter.train_hidden(taps, x, anchors)


@pytest.mark.parametrize("windows, causal", [((None, None), (False, False)), ((3, None), (True, False))])
def test_training_block_forward_equals_inference_over_a_draft_cache(target, windows, causal):
    drafter = tiny_drafter(target, 4, windows=windows, causal=causal)
    tokens = jnp.asarray(np.random.default_rng(0).integers(2, 60, (2, 14)), jnp.int32)
    anchors = jnp.array([[1, 6, 10], [3, 4, 9]], jnp.int32)
    taps, h_train = _train_hidden(drafter, target, tokens, anchors)
    for row in range(2):
        for j, a in enumerate(np.asarray(anchors[row])):
            h_ref, _ = _inference_block(drafter, target, taps[row], tokens[row], a)
            err = float(jnp.max(jnp.abs(h_train[row, j] - h_ref)))
            assert err < 1e-5, f"block at anchor {a} (row {row}) differs from the inference forward by {err}"


def test_loss_weights_decay_as_exp_of_minus_slot_offset_over_gamma():
    w = train.loss_weights(5, 2.0)
    expected = [1.0, math.exp(-0.5), math.exp(-1.0), math.exp(-1.5)]
    np.testing.assert_allclose(w, expected, rtol=1e-6, err_msg="row k of 1..b-1 weighs exp(-(k-1)/gamma)")


def test_weighted_block_ce_matches_a_hand_computation():
    logits = jnp.array([[[0.0, math.log(3.0)], [math.log(2.0), 0.0]]])  # one block, rows 1 and 2, V=2
    labels = jnp.array([[0, 0]])
    weights = np.array([1.0, 0.5], np.float32)
    # row 1: p(label 0) = 1/4 -> ce ln 4; row 2: p(label 0) = 2/3 -> ce ln 1.5
    expected = (1.0 * math.log(4.0) + 0.5 * math.log(1.5)) / 1.5
    got = float(train.weighted_block_ce(logits, labels, weights))
    assert abs(got - expected) < 1e-6, f"weighted CE {got}, hand value {expected}"


def test_acceptance_length_counts_leading_agreements_plus_the_bonus_token():
    draft = jnp.array([[5, 6, 7, 8], [1, 6, 7, 8], [5, 6, 0, 8], [5, 6, 7, 8]])
    target = jnp.array([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 0]])
    got = train.acceptance_length(draft, target).tolist()
    assert got == [5, 1, 3, 4], f"1 + agreeing prefix length per block, later agreements ignored; got {got}"


@pytest.mark.parametrize("labels", train.LABELS)
def test_drafter_loss_and_metrics_equal_a_per_block_inference_reference(target, labels):
    drafter = tiny_drafter(target, 4)
    cfg, tcfg = drafter.config, target.config
    tokens = np.random.default_rng(1).integers(2, 60, (2, 12)).astype(np.int32)
    anchors = np.array([[2, 5], [1, 8]], np.int32)
    gamma = 1.5
    loss_fn = jax.jit(functools.partial(train.drafter_loss, target_cfg=tcfg, cfg=cfg,
                                        weights=train.loss_weights(4, gamma), dtype=jnp.float32, labels=labels))
    loss, metrics = loss_fn(drafter.params, target.params, jnp.asarray(tokens), jnp.asarray(anchors))
    taps, _ = _train_hidden(drafter, target, jnp.asarray(tokens), jnp.asarray(anchors))
    target_choice = np.asarray(jnp.argmax(target.full_logits(tokens), axis=-1))
    w = np.exp(-np.arange(3) / gamma)
    total, lengths, agree = 0.0, [], []
    for row in range(2):
        for a in anchors[row]:
            _, logits = _inference_block(drafter, target, taps[row], jnp.asarray(tokens[row]), a)
            logits = np.asarray(logits, np.float64)
            # "data": the text's next tokens; "target": the target's argmax, for a+k found at a+k-1
            want = tokens[row, a + 1:a + 4] if labels == "data" else target_choice[row, a:a + 3]
            ce = np.log(np.exp(logits).sum(-1)) - logits[np.arange(3), want]
            total += float((w * ce).sum())
            match = logits.argmax(-1) == target_choice[row, a:a + 3]  # target's choice for a+k is at a+k-1
            agree.append(match)
            lengths.append(1 + int(np.cumprod(match).sum()))
    expected = total / (4 * w.sum())
    assert abs(float(loss) - expected) < 1e-5 * max(1.0, expected), f"loss {float(loss)} != reference {expected}"
    assert abs(float(metrics["acc_len"]) - np.mean(lengths)) < 1e-6, "acc_len is 1 + leading agreements, averaged"
    np.testing.assert_allclose(metrics["slot_acc"], np.mean(agree, axis=0), atol=1e-6,
                               err_msg="slot_acc compares each row with the target's argmax at that position")


def test_dspark_loss_scores_shifted_rows_through_the_markov_chain_and_trains_its_confidence(target):
    """Per block, by hand: rows 0..b-1 predict offsets 1..b with `W1[text token before the slot] @ W2`
    added, and the confidence head's cross-entropy targets whether each slot's argmax is the target's."""
    cfg, params = train.init_drafter(target.config, num_layers=2, block_size=4, mask_token_id=63, family="dspark",
                                     markov_rank=4, confidence=True, target_layer_ids=(0, 2), seed=3)
    params = jax.tree.map(lambda x: 10 * x, params)  # heads large enough to matter
    drafter = make_drafter(cfg, params)
    tokens = np.random.default_rng(1).integers(2, 60, (2, 12)).astype(np.int32)
    anchors = np.array([[2, 5], [1, 7]], np.int32)
    gamma, alpha = 1.5, 0.7
    loss_fn = jax.jit(functools.partial(train.drafter_loss, target_cfg=target.config, cfg=cfg, dtype=jnp.float32,
                                        weights=train.loss_weights(5, gamma), confidence_weight=alpha))
    loss, metrics = loss_fn(params, target.params, jnp.asarray(tokens), jnp.asarray(anchors))
    taps, _ = _train_hidden(drafter, target, jnp.asarray(tokens), jnp.asarray(anchors))
    target_choice = np.asarray(jnp.argmax(target.full_logits(tokens), axis=-1))
    p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
    w = np.exp(-np.arange(4) / gamma)
    ce_total, bce = 0.0, []
    for row in range(2):
        for a in anchors[row]:
            h, logits = _inference_block(drafter, target, taps[row], jnp.asarray(tokens[row]), a)
            prev = tokens[row, a:a + 4]  # the text's token before each slot: the anchor, then slots 1..3
            emb = p["markov_w1"][prev]
            logits = np.asarray(logits, np.float64) + emb @ p["markov_w2"]
            want = tokens[row, a + 1:a + 5]
            ce_total += float((w * (np.log(np.exp(logits).sum(-1)) - logits[np.arange(4), want])).sum())
            raw = np.concatenate([np.asarray(h, np.float64), emb], -1) @ p["confidence_w"][:, 0] + p["confidence_b"][0]
            hit = logits.argmax(-1) == target_choice[row, a:a + 4]
            bce += list(np.log1p(np.exp(raw)) - raw * hit)
    expected = ce_total / (4 * w.sum()) + alpha * np.mean(bce)
    assert abs(float(loss) - expected) < 1e-4 * max(1.0, expected), f"loss {float(loss)} != reference {expected}"
    assert abs(float(metrics["confidence_bce"]) - np.mean(bce)) < 1e-4


def test_sample_anchors_are_distinct_and_leave_context_and_a_whole_block():
    rng = np.random.default_rng(0)
    anchors = train.sample_anchors(rng, 64, 5, seq_len=12, span=4)
    assert anchors.min() >= 1 and anchors.max() <= 12 - 4, f"anchors outside [1, 8]: {anchors.min()}..{anchors.max()}"
    assert all(len(set(r)) == 5 for r in anchors.tolist()), "anchors of a sequence must be distinct"
    assert set(anchors.ravel().tolist()) == set(range(1, 9)), "every admissible anchor should be drawn sometimes"
    with pytest.raises(ValueError, match="anchors_per_seq 9 exceeds the 8 possible anchors"):
        train.sample_anchors(rng, 1, 9, seq_len=12, span=4)


@pytest.mark.parametrize("field, value", [
    ("steps", 0), ("batch_size", -1), ("seq_len", 1), ("anchors_per_seq", 0), ("lr", 0.0), ("lr", float("nan")),
    ("warmup_steps", 10), ("weight_decay", -0.1), ("grad_clip", 0.0), ("gamma", -1.0), ("compute_dtype", "float16"),
    ("checkpoint_every", -1), ("log_every", 0), ("steps", 2.5), ("labels", "argmax"),
])
def test_train_config_refuses_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"TrainConfig.{field}"):
        train.TrainConfig(**{"steps": 10, "warmup_steps": 1, field: value})


def test_init_drafter_copies_target_shapes_and_uses_the_reference_tap_rule(target):
    cfg, params = train.init_drafter(target.config, num_layers=2, block_size=8, mask_token_id=5)
    t = target.config
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == \
        (t.hidden_size, t.num_heads, t.num_kv_heads, t.head_dim, t.intermediate_size)
    assert cfg.target_layer_ids == default_target_layer_ids(t.num_layers, 2)
    assert cfg.layer_window == (None, None) and cfg.causal == (False, False), "full attention, bidirectional block"
    assert bool(jnp.all(params["layers_0"]["q_norm"] == 1)), "norm weights start at one"
    std = float(jnp.std(params["layers_1"]["w_gate_up"]))
    assert 0.015 < std < 0.025, f"matrices start N(0, 0.02); std {std}"
    with pytest.raises(CheckpointError, match="mask_token_id 64 is outside"):
        train.init_drafter(target.config, num_layers=1, block_size=8, mask_token_id=64)


def test_init_drafter_for_an_experts_target_asks_for_the_mlp_width():
    moe = HybridConfig(arch="qwen3_5_moe", vocab_size=64, hidden_size=32, intermediate_size=0, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope=RopeConfig(1e4),
                       layer_types=("linear_attention", "full_attention"), rotary_dim=4, moe_layers=(True, True),
                       num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
    with pytest.raises(ValueError, match="qwen3_5_moe target's MLPs are experts .* pass intermediate_size"):
        train.init_drafter(moe, num_layers=1, block_size=4, mask_token_id=5)
    cfg, _ = train.init_drafter(moe, num_layers=1, block_size=4, mask_token_id=5, intermediate_size=96)
    assert cfg.intermediate_size == 96 and cfg.hidden_size == 32


def test_train_drafter_refuses_more_anchors_than_a_window_holds(target):
    drafter = tiny_drafter(target, 4)
    tc = train.TrainConfig(steps=2, warmup_steps=0, seq_len=8, anchors_per_seq=5, batch_size=1, **F32)
    with pytest.raises(ValueError, match="anchors_per_seq 5 exceeds the 4 possible anchors"):
        train.train_drafter(target, np.arange(20) % 50, drafter.config, drafter.params, tc, progress=False)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """30 float32 steps on one repeated 24-token window towards the target's own choices (labels="target", so
    acceptance can rise), checkpoints every 10, exported."""
    target = tiny_target(seed=3)
    cfg, params = train.init_drafter(target.config, num_layers=2, block_size=4, mask_token_id=1, seed=0)
    data = np.random.default_rng(2).integers(2, 64, 24)
    tc = train.TrainConfig(steps=30, batch_size=2, seq_len=24, anchors_per_seq=6, lr=1e-2, warmup_steps=3,
                           checkpoint_every=10, log_every=10, labels="target", **F32)
    before = train.evaluate_drafter(target, data, cfg, params, tc, n_batches=2)
    out = tmp_path_factory.mktemp("drafter")
    history = []
    new = train.train_drafter(target, data, cfg, params, tc, out_dir=out, progress=False, history=history)
    after = train.evaluate_drafter(target, data, cfg, new, tc, n_batches=2)
    return dict(target=target, cfg=cfg, params=new, before=before, after=after, out=out, history=history)


def test_a_dspark_drafter_trains_exports_and_loads_with_its_heads(tmp_path):
    target = tiny_target(seed=3)
    cfg, params = train.init_drafter(target.config, num_layers=1, block_size=4, mask_token_id=1, seed=0,
                                     family="dspark", markov_rank=8, confidence=True)
    data = np.random.default_rng(2).integers(2, 64, 24)
    tc = train.TrainConfig(steps=30, batch_size=2, seq_len=24, anchors_per_seq=6, lr=1e-2, warmup_steps=3,
                           log_every=10, **F32)
    before = train.evaluate_drafter(target, data, cfg, params, tc, n_batches=2)
    new = train.train_drafter(target, data, cfg, params, tc, out_dir=tmp_path, progress=False)
    after = train.evaluate_drafter(target, data, cfg, new, tc, n_batches=2)
    assert after["loss"] < 0.5 * before["loss"], f"30 steps on one window should fit it: {before} -> {after}"
    loaded = read_drafter(tmp_path, target.config, env={})
    assert (loaded.config.family, loaded.config.harvest, loaded.config.n_drafts) == ("dspark", "dspark", 4)
    assert (loaded.config.markov_rank, loaded.config.confidence_in_dim) == (8, target.config.hidden_size + 8)
    assert loaded.config.verify_policy == "confidence-slot", "a head-carrying checkpoint defaults to confidence-slot"


def test_training_steps_reduce_the_loss_on_a_repeated_batch(trained):
    before, after = trained["before"], trained["after"]
    assert after["loss"] < 0.7 * before["loss"], \
        f"30 steps on one repeated window should cut the loss: {before['loss']:.3f} -> {after['loss']:.3f}"
    assert after["acc_len"] > before["acc_len"] + 0.5, \
        f"learning the target's choices should raise the acceptance length: {before['acc_len']} -> {after['acc_len']}"


def test_exported_drafter_reads_back_with_read_drafter(trained):
    drafter = read_drafter(trained["out"], trained["target"].config, dtype="float32")
    cfg, params = drafter.config, drafter.params
    want = trained["cfg"]
    for name in ("block_size", "mask_token_id", "target_layer_ids", "layer_window", "causal", "harvest", "num_layers"):
        assert getattr(cfg, name) == getattr(want, name), f"{name}: {getattr(cfg, name)} != {getattr(want, name)}"
    exported = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), trained["params"])
    diffs = jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), params, exported))
    assert max(diffs) == 0.0, "the checkpoint holds the trained weights in bfloat16"


def test_training_writes_periodic_checkpoints_and_a_log(trained):
    out = trained["out"]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-20"]
    read_drafter(out / "checkpoint-20", trained["target"].config)
    log = json.loads((out / "train_log.json").read_text())
    assert [r["step"] for r in log["history"]] == [1, 10, 20, 30], "a record at step 1 and every log_every steps"
    assert log["train_config"]["steps"] == 30 and log["drafter_config"]["dflash_config"]["mask_token_id"] == 1
    assert all(len(r["slot_acc"]) == 3 for r in log["history"]), "one agreement rate per draft slot"
    loss, acc_len = ([r[k] for r in log["history"]] for k in ("loss", "acc_len"))
    assert loss[-1] < 0.7 * loss[0] and acc_len[-1] > acc_len[0] + 0.3, \
        f"the log must record the drafter learning: loss {loss}, acceptance length {acc_len}"


def test_pretrain_target_lowers_next_token_loss():
    target = tiny_target(seed=5)
    data = np.random.default_rng(4).integers(0, 64, 33)
    tc = train.TrainConfig(steps=25, batch_size=2, seq_len=32, lr=1e-2, warmup_steps=2, log_every=25, **F32)
    kw = dict(seq_len=32, batch_size=1, n_batches=1, compute_dtype="float32")
    before = train.evaluate_target(target.config, target.params, data, **kw)["loss"]
    params = train.pretrain_target(target.config, target.params, data, tc, progress=False)
    after = train.evaluate_target(target.config, params, data, **kw)["loss"]
    assert after < 0.5 * before, f"25 steps on one window should fit it: {before:.3f} -> {after:.3f}"


# ---------------------------------------------------------------------------------------
# The `train-drafter` command end to end.

TEXT = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i * i)\n",
    "import os\nprint(os.path.join('a', 'b'))\n",
]


def _tokenizer(specials):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT * 4, trainer)
    return tok


def _target_dir(path, specials):
    tok = _tokenizer(specials)
    target = tiny_target(seed=7, vocab=tok.get_vocab_size())
    write_target(path, target, dtype="float32")
    tok.save(str(path / "tokenizer.json"))
    return target


def _run_cli(argv):
    parser = argparse.ArgumentParser()
    train.add_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_train_drafter_tokenizes_trains_and_exports(tmp_path, capsys):
    target = _target_dir(tmp_path, ["<|endoftext|>", "<|mask|>"])
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"doc{i}.py").write_text("".join(TEXT[i % 4:] + TEXT[:i % 4]))
    out = tmp_path / "drafter"
    rc = _run_cli(["train-drafter", "--target", str(tmp_path), "--corpus", str(corpus), "--out", str(out),
                   "--layers", "1", "--block-size", "4", "--steps", "3", "--batch-size", "2", "--seq-len", "32",
                   "--anchors-per-seq", "4", "--dtype", "float32", "--labels", "target"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "acc-len" in captured.err, "the progress line reports the acceptance-length estimate"
    log = json.loads((out / "train_log.json").read_text())
    assert log["train_config"]["labels"] == "target", "--labels reaches the TrainConfig"
    cfg = read_drafter(out, target.config).config
    assert cfg.mask_token_id == 1, "the default mask token is the tokenizer's <|mask|>"
    assert cfg.block_size == 4 and cfg.num_layers == 1 and cfg.target_layer_ids == (target.config.num_layers // 2,)


def test_cli_refuses_a_tokenizer_without_mask_token_naming_the_option(tmp_path, capsys):
    _target_dir(tmp_path, ["<|endoftext|>"])
    (tmp_path / "c.txt").write_text("".join(TEXT))
    rc = _run_cli(["train-drafter", "--target", str(tmp_path), "--corpus", str(tmp_path / "c.txt"),
                   "--out", str(tmp_path / "d"), "--steps", "3"])
    err = capsys.readouterr().err
    assert rc == 1 and "--mask-token-id" in err and "<|mask|>" in err, err
    assert not (tmp_path / "d").exists(), "nothing is written when the command refuses"


# ---------------------------------------------------------------------------------------
# DFlash2: the backbone's CE plus the candidate selector's, metrics of the greedy walk.


def _np_selector_ce(pred, succ, unary, cand, hp, prev, labels, w):
    """(loss, masked share) in float64 numpy, one slot at a time."""
    total, masked, slots = 0.0, 0, 0
    for idx in np.ndindex(*labels.shape):
        slots += 1
        if labels[idx] not in cand[idx]:
            masked += 1
            continue
        scores = unary[idx] + np.array([np.sum(pred[prev[idx]] * hp[idx] * succ[c]) for c in cand[idx]])
        target = list(cand[idx]).index(labels[idx])
        total += w[idx[-1]] * (np.log(np.exp(scores).sum()) - scores[target])
    return total / (slots // labels.shape[-1] * w.sum()), masked / slots


def test_selector_ce_equals_a_numpy_computation_and_masks_slots_whose_label_is_no_candidate():
    rng = np.random.default_rng(0)
    v, r, k = 12, 3, 4
    pred, succ = rng.normal(size=(v, r)), rng.normal(size=(v, r))
    cand = np.stack([rng.permutation(v)[:k] for _ in range(6)]).reshape(2, 3, k).astype(np.int32)
    unary, hp = 2 * rng.normal(size=(2, 3, k)), rng.normal(size=(2, 3, r))
    prev = rng.integers(0, v, (2, 3)).astype(np.int32)
    labels = cand[..., 0].copy()
    labels[0, 1] = next(t for t in range(v) if t not in cand[0, 1])  # two slots whose label is no candidate
    labels[1, 2] = next(t for t in range(v) if t not in cand[1, 2])
    labels[1, 0] = cand[1, 0, 3]
    w = train.loss_weights(4, 1.5)
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    loss, masked = train.selector_ce(f32(pred), f32(succ), f32(unary), jnp.asarray(cand), f32(hp), jnp.asarray(prev),
                                     jnp.asarray(labels), w)
    want_loss, want_masked = _np_selector_ce(pred, succ, unary, cand, hp, prev, labels, w.astype(np.float64))
    assert abs(float(loss) - want_loss) < 1e-5 * max(1.0, want_loss), f"selector CE {float(loss)} != {want_loss}"
    assert abs(float(masked) - 2 / 6) < 1e-6, f"2 of 6 slots have their label outside the candidates; got {masked}"


def test_selector_ce_trains_the_chain_and_not_the_unary_logits():
    rng = np.random.default_rng(1)
    args = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((8, 2), (8, 2), (1, 2, 3))]
    cand, hp = jnp.array([[[1, 2, 3], [4, 5, 6]]], jnp.int32), jnp.asarray(rng.normal(size=(1, 2, 2)), jnp.float32)
    prev, labels = jnp.array([[0, 2]], jnp.int32), jnp.array([[2, 6]], jnp.int32)

    def loss(pred, succ, unary, hp):
        return train.selector_ce(pred, succ, unary, cand, hp, prev, labels, np.ones(2, np.float32))[0]

    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(*args, hp)
    assert float(jnp.max(jnp.abs(grads[2]))) == 0.0, "the unary logits enter the selector's CE under stop_gradient"
    assert all(float(jnp.max(jnp.abs(g))) > 0 for g in (grads[0], grads[1], grads[3])), \
        "the codebooks and the hidden projection's input are what the selector's CE trains"


def _tiny_dflash2(target, seed: int = 1):
    """A random DFlash2 drafter from `init_drafter`'s config: block 5, window 6 (shorter than the context), K 4, with
    codebooks strong enough that the walk leaves the per-slot argmax."""
    cfg, _ = train.init_drafter(target.config, num_layers=2, block_size=5, mask_token_id=63, family="dflash2",
                                target_layer_ids=(0, 2), selector_rank=4, selector_top_k=4, conv_group_size=8,
                                sliding_window=6)
    params = random_params(drafter_param_shapes(cfg), seed)
    return make_drafter(cfg, dict(params, selector_pred=20 * params["selector_pred"]))


@jax.jit
def _inference_proposal(drafter, target, taps, tokens_row, anchor):
    """Hidden `[b, H]` and greedy drafts `[nd]` of one block as decoding makes them: ingest the taps of positions
    < anchor, then `propose` at temperature 0 (batch of 1)."""
    t = taps.shape[0]
    cache = drafter.init_state(1, t + drafter.config.block_size)
    cache, pending = drafter.ingest(cache, taps[None], jnp.zeros((1,), jnp.int32))
    cache = drafter.commit(cache, pending, jnp.reshape(anchor, (1,)).astype(jnp.int32))
    first = jnp.reshape(tokens_row[anchor], (1,))
    h = drafter.draft_hidden(cache, drafter.block_input(target, first))
    settings = ProposeSettings(greedy=True, proposal="argmax", impl="xla", verify_cap=drafter.config.block_size)
    proposal = drafter.propose(cache, target, first, smp.row_params(None, 1), jnp.zeros((1,), jnp.uint32), settings)
    return h[0], proposal.drafts[0]


@pytest.mark.parametrize("labels", train.LABELS)
def test_dflash2_loss_and_metrics_equal_the_inference_forward_and_its_greedy_walk(target, labels):
    """Per block, by hand from the decoding path: the backbone CE of the harvested logits, the selector CE of their
    top-K (numpy) with the text's previous token, and acc_len / slot_acc of the drafts `propose` makes. The target's
    head favours tokens 0..5, so drafts often match its choices and the walk's matches differ from the argmax's."""
    target = make_target(target.config, dict(target.params, lm_head=target.params["lm_head"].at[:, 6:].multiply(0.05)))
    drafter = _tiny_dflash2(target)
    cfg, p = drafter.config, jax.tree.map(lambda x: np.asarray(x, np.float64), drafter.params)
    tokens = np.random.default_rng(1).integers(2, 60, (2, 14)).astype(np.int32)
    anchors = np.array([[2, 8], [1, 9]], np.int32)
    gamma = 1.5
    loss_fn = jax.jit(functools.partial(train.drafter_loss, target_cfg=target.config, cfg=cfg, dtype=jnp.float32,
                                        weights=train.loss_weights(5, gamma), labels=labels))
    loss, metrics = loss_fn(drafter.params, target.params, jnp.asarray(tokens), jnp.asarray(anchors))
    taps, h_train = _train_hidden(drafter, target, jnp.asarray(tokens), jnp.asarray(anchors))
    target_choice = np.asarray(jnp.argmax(target.full_logits(tokens), axis=-1))
    w = np.exp(-np.arange(4) / gamma)
    ce, sel, masked, lengths, agree, argmax_agree = 0.0, 0.0, 0.0, [], [], []
    for row in range(2):
        for j, a in enumerate(anchors[row]):
            h, drafts = _inference_proposal(drafter, target, taps[row], jnp.asarray(tokens[row]), a)
            assert float(jnp.max(jnp.abs(h_train[row, j] - h))) < 1e-5 * float(jnp.max(jnp.abs(h))), \
                "training forward != decoding forward"
            logits = np.asarray(drafter.harvest_logits(target, h[None]), np.float64)[0]
            want = tokens[row, a + 1:a + 5] if labels == "data" else target_choice[row, a:a + 4]
            ce += float((w * (np.log(np.exp(logits).sum(-1)) - logits[np.arange(4), want])).sum())
            cand = np.argsort(-logits, axis=-1)[:, :4]
            unary = np.take_along_axis(logits, cand, -1)
            hp = np.asarray(h[1:], np.float64) @ p["selector_hidden"]
            block_sel, block_masked = _np_selector_ce(p["selector_pred"], p["selector_succ"], unary[None], cand[None],
                                                      hp[None], tokens[row, a:a + 4][None], want[None], w)
            sel, masked = sel + block_sel, masked + block_masked
            match = np.asarray(drafts) == target_choice[row, a:a + 4]
            agree.append(match)
            lengths.append(1 + int(np.cumprod(match).sum()))
            argmax_agree.append(logits.argmax(-1) == target_choice[row, a:a + 4])
    assert not np.array_equal(agree, argmax_agree), "the walk must match the target elsewhere than the argmax does"
    ce, sel = ce / (4 * w.sum()), sel / 4
    assert abs(float(metrics["backbone_ce"]) - ce) < 1e-5 * max(1.0, ce), f"{metrics['backbone_ce']} != {ce}"
    assert abs(float(metrics["selector_ce"]) - sel) < 1e-5 * max(1.0, sel), f"{metrics['selector_ce']} != {sel}"
    assert abs(float(loss) - (ce + sel)) < 1e-5 * max(1.0, ce + sel), "the loss is the backbone CE plus the selector's"
    assert abs(float(metrics["selector_masked"]) - masked / 4) < 1e-6
    assert abs(float(metrics["acc_len"]) - np.mean(lengths)) < 1e-6, "acc_len follows the drafts propose makes"
    np.testing.assert_allclose(metrics["slot_acc"], np.mean(agree, axis=0), atol=1e-6,
                               err_msg="slot_acc compares the greedy walk's drafts with the target's choices")


def test_a_dflash2_drafter_trains_from_the_cli_loads_through_its_family_and_decodes_losslessly(tmp_path, capsys):
    """30 float32 steps of `train-drafter --family dflash2` on one repeated window towards the target's choices."""
    target = _target_dir(tmp_path, ["<|endoftext|>", "<|mask|>"])
    corpus = tmp_path / "window.npy"
    np.save(corpus, np.random.default_rng(2).integers(2, target.config.vocab_size, 24).astype(np.int32))
    out = tmp_path / "drafter"
    rc = _run_cli(["train-drafter", "--target", str(tmp_path), "--corpus", str(corpus), "--out", str(out),
                   "--layers", "2", "--block-size", "4", "--steps", "30", "--batch-size", "2", "--seq-len", "24",
                   "--anchors-per-seq", "6", "--lr", "1e-2", "--warmup-steps", "3", "--dtype", "float32",
                   "--labels", "target", "--family", "dflash2", "--selector-rank", "4", "--selector-top-k", "4",
                   "--conv-kernel-size", "3", "--conv-group-size", "8", "--sliding-window", "16"])
    assert rc == 0, capsys.readouterr().err
    history = json.loads((out / "train_log.json").read_text())["history"]
    assert history[-1]["loss"] < 0.7 * history[0]["loss"], [r["loss"] for r in history]
    assert history[-1]["acc_len"] > history[0]["acc_len"] + 0.3, [r["acc_len"] for r in history]
    assert {"selector_ce", "selector_masked", "argmax_acc_len"} <= set(history[-1]), "the selector's metrics are logged"
    drafter = read_drafter(out, target.config, dtype="float32")
    cfg = drafter.config
    assert (cfg.family, cfg.harvest, cfg.selector_rank, cfg.selector_top_k, cfg.conv_kernel_size,
            cfg.conv_group_size, cfg.layer_window, cfg.causal) == ("dflash2", "dflash", 4, 4, 3, 8, (16, 16),
                                                                   (False, False)), cfg
    prompts = [[5, 6, 7, 8, 9, 10, 11], [2, 3], list(range(12, 40))]
    plain = dflash_jax.generate(target, None, prompts, max_new_tokens=24).tokens
    spec = dflash_jax.generate(target, drafter, prompts, max_new_tokens=24)
    assert spec.tokens == plain and spec.stats.rounds > 0


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(family="medusa"), ValueError, r"family 'medusa' cannot be trained; choices: dflash, dspark, dflash2"),
    (dict(selector_rank=8), ValueError, r"selector_rank set for family 'dflash': it is DFlash2's; use "
                                        r"family='dflash2'"),
    (dict(family="dspark", conv_group_size=8, sliding_window=64), ValueError,
     r"conv_group_size, sliding_window set for family 'dspark': they are DFlash2's; use family='dflash2'"),
    (dict(family="dflash2", markov_rank=4), ValueError, r"markov_rank set for family 'dflash2': it is DSpark's; "
                                                        r"use family='dspark'"),
    (dict(family="dflash2", confidence=True), ValueError, r"confidence set for family 'dflash2'.*family='dspark'"),
    (dict(family="dflash2", sliding_window=3), CheckpointError, r"DFlash2 block_size 4 exceeds the sliding window 3"),
    (dict(family="dflash2", conv_group_size=5), CheckpointError, r"conv_group_size 5 does not divide hidden_size 32"),
    (dict(family="dflash2", selector_rank=0), CheckpointError, r"selector_rank 0: expected a positive integer"),
])
def test_init_drafter_refuses_a_family_with_the_wrong_arguments(target, kwargs, error, match):
    with pytest.raises(error, match=match):
        train.init_drafter(target.config, num_layers=1, block_size=4, mask_token_id=63, **kwargs)


def test_init_drafter_gives_dflash2_the_published_sizes_and_non_causal_windows_over_the_whole_target(target):
    cfg, params = train.init_drafter(target.config, num_layers=2, block_size=4, mask_token_id=63, family="dflash2")
    assert (cfg.selector_rank, cfg.selector_top_k, cfg.conv_kernel_size, cfg.conv_group_size) == (256, 16, 2, 16)
    window = target.config.max_position_embeddings
    assert cfg.layer_window == (window, window) and cfg.causal == (False, False) and cfg.harvest == "dflash"
    assert params["selector_pred"].shape == (target.config.vocab_size, 256)


def test_cli_refuses_a_dspark_head_for_dflash2_in_one_line(tmp_path, capsys):
    _target_dir(tmp_path, ["<|endoftext|>", "<|mask|>"])
    (tmp_path / "c.txt").write_text("".join(TEXT))
    rc = _run_cli(["train-drafter", "--target", str(tmp_path), "--corpus", str(tmp_path / "c.txt"),
                   "--out", str(tmp_path / "d"), "--family", "dflash2", "--markov-rank", "4"])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("refused: markov_rank set for family 'dflash2'") and "family='dspark'" in err, err
    assert not (tmp_path / "d").exists()
