"""`dflash-jax inspect DIR`: prints the census, exits non-zero with the refusal."""
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from conftest import drafter_param_shapes, target_param_shapes
from dflash_jax import cli
from dflash_jax.config import DrafterConfig, RopeConfig, TargetConfig
from dflash_jax.io.checkpoints import make_drafter, make_target, write_drafter, write_target

TARGET = TargetConfig("qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6,
                      rope=RopeConfig(1e6, "yarn", (("factor", 4.0), ("original_max_position_embeddings", 128))))
DRAFTER = DrafterConfig("dflash", hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_dim=8, rms_norm_eps=1e-6, rope=RopeConfig(1e6), block_size=4, mask_token_id=60,
                        target_layer_ids=(0, 1), layer_window=(None, 16), causal=(False, True), vocab_size=64)


def zeros(shapes):
    return jax.tree.map(lambda s: jnp.zeros(s, jnp.float32), shapes, is_leaf=lambda x: isinstance(x, tuple))


@pytest.fixture(autouse=True)
def no_harvest_env(monkeypatch):
    monkeypatch.delenv("DFLASH_HARVEST", raising=False)


@pytest.fixture
def target_dir(tmp_path):
    path = tmp_path / "target"
    write_target(path, make_target(TARGET, zeros(target_param_shapes(TARGET))))
    return path


@pytest.fixture
def drafter_dir(tmp_path):
    path = tmp_path / "drafter"
    write_drafter(path, make_drafter(DRAFTER, zeros(drafter_param_shapes(DRAFTER))))
    return path


def run(capsys, *argv):
    code = cli.main(["inspect", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_inspect_target_prints_arch_layers_heads_rope_tied_dtype_and_parameter_count(capsys, target_dir):
    code, out, err = run(capsys, target_dir)
    assert code == 0, err
    for line in ("kind: target", "arch: qwen3", "layers: 2", "heads: 4 query, 2 kv, head_dim 8",
                 "rope: yarn (theta 1e+06, factor=4.0, original_max_position_embeddings=128)",
                 "tied embeddings: False", "dtype: bfloat16"):
        assert line in out.splitlines(), f"{line!r} missing from:\n{out}"
    expected = 2 * 64 * 32 + 32 + 2 * (32 + 32 * 32 + 2 * 16 * 32 + 32 * 32 + 32 + 3 * 48 * 32 + 2 * 8)
    assert f"parameters: {expected:,}" in out, out


def test_inspect_drafter_prints_family_block_harvest_drafts_layers_and_heads(capsys, drafter_dir):
    code, out, err = run(capsys, drafter_dir)
    assert code == 0, err
    for line in ("kind: drafter", "family: dflash", "block size: 4", "harvest: dflash (draft rows 1..3)",
                 "drafts per round: 3", "layers: 2 [0:full bidirectional, 1:sliding 16 causal]",
                 "target layers tapped: [0, 1]", "mask token: 60", "extra heads: none"):
        assert line in out.splitlines(), f"{line!r} missing from:\n{out}"
    assert "reason: family dflash: architectures ['DFlashDraftModel'], no markov/confidence/selector tensors" in out


def test_inspect_overrides_and_target_check(capsys, drafter_dir, target_dir):
    code, out, _ = run(capsys, drafter_dir, "--target", target_dir, "--harvest", "dspark", "--block-size", "6")
    assert code == 0
    assert "drafts per round: 6" in out and "harvest: dspark (draft rows 0..5)" in out


def test_inspect_refuses_a_drafter_that_does_not_fit_the_target(capsys, drafter_dir, tmp_path):
    other = TargetConfig("llama", 64, 24, 40, 2, 4, 2, 6, 1e-5, RopeConfig(1e4))
    write_target(tmp_path / "llama", make_target(other, zeros(target_param_shapes(other))))
    code, out, err = run(capsys, drafter_dir, "--target", tmp_path / "llama")
    assert code == 1 and out == ""
    assert "refused: drafter hidden_size 32 != target hidden_size 24" in err


def test_inspect_reports_the_dspark_harvest_and_verify_window_with_their_reasons(capsys, drafter_dir, monkeypatch):
    config = json.loads((drafter_dir / "config.json").read_text())
    config["dflash_config"]["projector_type"] = "dspark"
    (drafter_dir / "config.json").write_text(json.dumps(config))
    for name in ("DFLASH_VT", "DFLASH_VT_TAU", "DFLASH_ADAPT", "DFLASH_MARKOV"):
        monkeypatch.delenv(name, raising=False)
    code, out, err = run(capsys, drafter_dir)
    assert code == 0, err
    assert "family: dspark" in out and "harvest: dspark (draft rows 0..3)" in out
    assert "reason: harvest dspark: trained with shifted labels" in out
    assert "verify window: ladder, adapt on" in out and "reason: verify policy ladder (no confidence head)" in out
    monkeypatch.setenv("DFLASH_ADAPT", "0")
    code, out, _ = run(capsys, drafter_dir)
    assert code == 0 and "verify window: ladder, adapt off" in out and "adapt 0 from DFLASH_ADAPT" in out
    monkeypatch.setenv("DFLASH_VT", "confidence")
    code, _, err = run(capsys, drafter_dir)
    assert code == 1 and "refused: verify policy 'confidence' (DFLASH_VT) with DFLASH_ADAPT=0 is contradictory" in err


def test_inspect_refuses_a_drafter_without_mask_token(capsys, drafter_dir):
    config = json.loads((drafter_dir / "config.json").read_text())
    del config["dflash_config"]["mask_token_id"]
    (drafter_dir / "config.json").write_text(json.dumps(config))
    code, _, err = run(capsys, drafter_dir)
    assert code == 1 and "refused: drafter config has no mask_token_id" in err


def test_inspect_refuses_a_corrupted_target(capsys, target_dir):
    (target_dir / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    code, _, err = run(capsys, target_dir)
    assert code == 1 and "unreadable safetensors header" in err


def test_python_dash_m_runs_inspect(drafter_dir):
    done = subprocess.run([sys.executable, "-m", "dflash_jax.cli", "inspect", str(drafter_dir)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "family: dflash" in done.stdout
