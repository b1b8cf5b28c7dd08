"""Issue 20, items 3 and 11: writing checkpoints never destroys, shadows or half-writes one, and the
`dflash-jax` command refuses careless input with one line on stderr (a traceback only with `--debug`)."""
import json
import os
import stat
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import tiny_drafter, tiny_target
from dflash_jax import cli
from dflash_jax.demo import DEMO_DIR
from dflash_jax.io import checkpoints
from dflash_jax.io.safetensors import INDEX_FILE, SINGLE_FILE
from dflash_jax.train import loop


@pytest.fixture(autouse=True)
def no_drafter_env(monkeypatch):
    for name in ("DFLASH_HARVEST", "DFLASH_VERIFY_T", "DFLASH_VT", "DFLASH_ADAPT", "DFLASH_MARKOV"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def pair():
    target = tiny_target(seed=3)
    return target, tiny_drafter(target, 4)


def snapshot(folder) -> dict:
    """Relative path -> bytes of every file under `folder`."""
    return {os.path.relpath(os.path.join(root, f), folder): open(os.path.join(root, f), "rb").read()
            for root, _, files in os.walk(folder) for f in files}


def siblings(folder) -> list:
    """Leftovers of staging beside `folder`."""
    return sorted(p.name for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}."))


def assert_trees_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# --- item 3: the write_* functions -------------------------------------------------------


def test_write_drafter_refuses_a_non_empty_folder_and_leaves_it_untouched(tmp_path, pair):
    target, drafter = pair
    folder = tmp_path / "target"
    checkpoints.write_target(folder, target, dtype="float32")
    before = snapshot(folder)
    with pytest.raises(FileExistsError, match=r"target is not empty \(2 entries: config.json, model.safetensors\)"
                                              r".*overwrite=True \(--overwrite\)"):
        checkpoints.write_drafter(folder, drafter)
    assert snapshot(folder) == before, "the target checkpoint was changed by a refused write"
    assert siblings(folder) == []


def test_overwrite_replaces_a_sharded_checkpoint_whole_no_stale_index_or_shards(tmp_path, pair):
    target, drafter = pair
    folder = tmp_path / "ckpt"
    checkpoints.write_target(folder, target, dtype="float32", shard_bytes=20_000)
    assert (folder / INDEX_FILE).exists() and len(os.listdir(folder)) > 3
    checkpoints.write_drafter(folder, drafter, dtype="float32", overwrite=True)
    assert sorted(os.listdir(folder)) == ["config.json", SINGLE_FILE], "stale index or shards left beside new weights"
    assert_trees_equal(checkpoints.read_drafter(folder, target.config, env={}).params, drafter.params)
    assert siblings(folder) == []


def test_overwrite_refuses_a_folder_that_holds_no_checkpoint(tmp_path, pair):
    folder = tmp_path / "home"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="holds no config.json, so it is not a checkpoint folder"):
        checkpoints.write_drafter(folder, pair[1], overwrite=True)
    assert snapshot(folder) == {"notes.txt": b"keep me"}


@pytest.mark.parametrize("error", [KeyboardInterrupt, OSError])
def test_an_interrupted_write_leaves_nothing_in_a_new_folder(tmp_path, pair, monkeypatch, error):
    def half_written(path, tensors, shard_bytes):
        (tmp_path / "reached").touch()
        open(os.path.join(path, SINGLE_FILE), "wb").write(b"\x00" * 10)
        raise error("disk full")

    monkeypatch.setattr(checkpoints, "write_tensors", half_written)
    folder = tmp_path / "new"
    with pytest.raises(error):
        checkpoints.write_target(folder, pair[0])
    assert (tmp_path / "reached").exists()
    assert not folder.exists(), f"a half-written checkpoint was left: {sorted(os.listdir(folder))}"
    assert siblings(folder) == []


def test_an_interrupted_overwrite_leaves_the_old_checkpoint(tmp_path, pair, monkeypatch):
    target, drafter = pair
    folder = tmp_path / "ckpt"
    checkpoints.write_drafter(folder, drafter, dtype="float32")
    before = snapshot(folder)

    def interrupted(path, tensors, shard_bytes):
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoints, "write_tensors", interrupted)
    with pytest.raises(KeyboardInterrupt):
        checkpoints.write_drafter(folder, tiny_drafter(target, 4, seed=9), overwrite=True)
    assert snapshot(folder) == before and siblings(folder) == []


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_written_files_get_the_mode_open_gives_under_the_umask(tmp_path, pair, umask):
    old = os.umask(umask)
    try:
        checkpoints.write_target(tmp_path / "target", pair[0], shard_bytes=20_000)
        checkpoints.write_drafter(tmp_path / "drafter", pair[1])
    finally:
        os.umask(old)
    for folder in (tmp_path / "target", tmp_path / "drafter"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o777 & ~umask, folder
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()}
        assert modes == dict.fromkeys(modes, 0o666 & ~umask), f"{folder}: {({k: oct(v) for k, v in modes.items()})}"


def test_trained_for_record_names_a_folder_never_a_path(pair):
    cfg = pair[0].config
    assert checkpoints.trained_for_record(cfg, "Qwen3-8B") == {
        "name": "Qwen3-8B", "architecture": "Qwen3ForCausalLM", "hidden_size": 32, "num_hidden_layers": 3,
        "vocab_size": 64}
    assert "name" not in checkpoints.trained_for_record(cfg)
    with pytest.raises(ValueError, match="expected a folder name, not a path"):
        checkpoints.trained_for_record(cfg, "/home/me/models/Qwen3-8B")


# --- item 3: train-drafter ---------------------------------------------------------------


def _train_args(target_dir, corpus, out, *extra):
    return ["train-drafter", "--target", str(target_dir), "--corpus", str(corpus), "--out", str(out),
            "--mask-token-id", "1", "--layers", "1", "--block-size", "4", "--steps", "2", "--batch-size", "1",
            "--seq-len", "16", "--anchors-per-seq", "2", "--dtype", "float32", "--checkpoint-every", "1", *extra]


@pytest.fixture(scope="module")
def train_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target = tiny_target(seed=3)
    checkpoints.write_target(root / "my-target", target, dtype="float32")
    np.save(root / "corpus.npy", np.random.default_rng(0).integers(2, 64, 400).astype(np.int32))
    return root, target


@pytest.fixture(scope="module")
def trained(train_setup):
    """`train-drafter --overwrite` over an older sharded drafter, under umask 0o022."""
    root, target = train_setup
    out = root / "drafter"
    checkpoints.write_drafter(out, tiny_drafter(target, 4, seed=5), shard_bytes=5_000)
    old = os.umask(0o022)
    try:
        rc = cli.main(_train_args(root / "my-target", root / "corpus.npy", out, "--overwrite"))
    finally:
        os.umask(old)
    assert rc == 0
    return out, target


def test_train_drafter_refuses_an_existing_checkpoint_as_out(train_setup, capsys):
    root, _ = train_setup
    before = snapshot(root / "my-target")
    rc = cli.main(_train_args(root / "my-target", root / "corpus.npy", root / "my-target"))
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and err.startswith("refused: ") and "is not empty" in err, err
    assert "--overwrite" in err and "Traceback" not in err
    assert snapshot(root / "my-target") == before, "train-drafter overwrote the target's checkpoint"


def test_train_drafter_overwrite_leaves_no_stale_index_and_loads_the_new_weights(trained):
    out, target = trained
    names = sorted(os.listdir(out))
    assert names == ["checkpoint-1", "config.json", SINGLE_FILE, "train_log.json"], names
    assert sorted(os.listdir(out / "checkpoint-1")) == ["config.json", SINGLE_FILE]
    new = checkpoints.read_drafter(out, target.config, env={})
    assert new.config.num_layers == 1, "the old 2-layer drafter's shards shadow the new one"
    assert siblings(out) == []


def test_train_drafter_writes_files_with_normal_permissions(trained):
    out, _ = trained
    for root, dirs, files in os.walk(out):
        assert stat.S_IMODE(os.stat(root).st_mode) == 0o755, root
        for f in files:
            assert stat.S_IMODE(os.stat(os.path.join(root, f)).st_mode) == 0o644, os.path.join(root, f)


def test_train_drafter_records_its_target_without_a_host_path_and_inspect_shows_it(trained, capsys):
    out, target = trained
    text = (out / "config.json").read_text()
    assert json.loads(text)["dflash_jax"]["trained_for_target"] == {
        "name": "my-target", "architecture": "Qwen3ForCausalLM", "hidden_size": 32, "num_hidden_layers": 3,
        "vocab_size": 64}
    assert str(out.parent) not in text, "the config leaks the training machine's paths"
    assert json.loads((out / "checkpoint-1" / "config.json").read_text())["dflash_jax"]["trained_for_target"][
        "name"] == "my-target"
    capsys.readouterr()
    assert cli.main(["inspect", str(out)]) == 0
    assert ("trained for target: name 'my-target', architecture 'Qwen3ForCausalLM', hidden_size 32, "
            "num_hidden_layers 3, vocab_size 64") in capsys.readouterr().out.splitlines()


def test_inspect_shows_a_hostile_record_safely(tmp_path, pair, capsys):
    checkpoints.write_drafter(tmp_path / "d", pair[1])
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    config["dflash_jax"] = {"trained_for_target": {"name": "x\x1b[2J", "vocab_size": [1], "hidden_size": 8}}
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    assert cli.main(["inspect", str(tmp_path / "d")]) == 0
    assert "trained for target: name 'x\\x1b[2J', hidden_size 8" in capsys.readouterr().out.splitlines()


def test_interrupted_training_leaves_the_old_checkpoint_and_keeps_its_periodic_checkpoints(
        train_setup, tmp_path, monkeypatch, capsys):
    root, target = train_setup
    out = tmp_path / "drafter"
    checkpoints.write_drafter(out, tiny_drafter(target, 4, seed=5))
    before = snapshot(out)

    def fit_then_interrupt(loss_fn, params, frozen, tc, next_batch, *, on_checkpoint, **kw):
        on_checkpoint(1, params)
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "_fit", fit_then_interrupt)
    rc = cli.main(_train_args(root / "my-target", root / "corpus.npy", out, "--overwrite"))
    err = capsys.readouterr().err
    (kept,) = siblings(out)
    assert rc == 130 and err.endswith(f"\ninterrupted; what was written before this is kept in {tmp_path / kept}\n")
    assert "Traceback" not in err, err
    assert snapshot(out) == before, "an interrupted run changed the old checkpoint"
    assert os.listdir(tmp_path / kept) == ["checkpoint-1"]


def test_train_drafter_refuses_an_out_below_a_file_before_training(train_setup, tmp_path, capsys):
    root, _ = train_setup
    (tmp_path / "file").write_text("")
    rc = cli.main(_train_args(root / "my-target", root / "corpus.npy", tmp_path / "file" / "out"))
    err = capsys.readouterr().err
    assert rc == 1 and err == f"refused: {tmp_path / 'file'} is a file, so {tmp_path / 'file' / 'out'} cannot be a " \
                              "checkpoint folder\n", err


# --- item 11: the CLI --------------------------------------------------------------------


def run_cli(*args, stdin=b""):
    """`python -m dflash_jax.cli` with byte arguments, as a shell passes them."""
    return subprocess.run([sys.executable, "-m", "dflash_jax.cli", *args], input=stdin, capture_output=True,
                          timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_a_non_utf8_prompt_in_argv_is_one_line_refusal():
    done = run_cli("generate", "--prompt", b"caf\xe9 ok", "--max-new-tokens", "2")
    assert done.returncode == 1 and done.stdout == b""
    assert done.stderr == b"refused: --prompt is not UTF-8 text: undecodable byte 0xe9 at character 3\n", done.stderr


def test_a_non_utf8_prompt_on_stdin_is_one_line_refusal():
    done = run_cli("generate", "--max-new-tokens", "2", stdin=b"def f():\n    \xff\xfe")
    assert done.returncode == 1 and done.stdout == b""
    assert done.stderr == b"refused: standard input is not UTF-8 text: byte 0xff at offset 13\n", done.stderr


def test_debug_raises_the_refusal_with_its_traceback(capsys):
    with pytest.raises(ValueError, match="--prompt is not UTF-8 text"):
        cli.main(["generate", "--prompt", "ab\udcff", "--debug"])
    assert cli.main(["generate", "--prompt", "ab\udcff"]) == 1
    assert capsys.readouterr().err == "refused: --prompt is not UTF-8 text: undecodable byte 0xff at character 2\n"


@pytest.mark.parametrize("size", ["0", "-3"])
def test_block_size_below_two_is_refused_not_ignored(size, capsys):
    rc = cli.main(["generate", "--prompt", "x", "--block-size", size, "--max-new-tokens", "2"])
    out, err = capsys.readouterr()
    assert rc == 1 and out == "" and err == f"refused: block_size {size}: expected an integer >= 2 " \
                                            "(anchor + at least one draft) (keyword override block_size)\n", err


def test_an_out_of_vocabulary_stop_token_is_refused_naming_the_config(tmp_path, capsys):
    target = tmp_path / "target"
    target.mkdir()
    for name in ("model.safetensors", "tokenizer.json"):
        (target / name).symlink_to(os.path.join(DEMO_DIR, "target", name))
    config = json.loads(open(os.path.join(DEMO_DIR, "target", "config.json")).read())
    (target / "config.json").write_text(json.dumps({**config, "eos_token_id": [0, 5000]}))
    rc = cli.main(["generate", "--prompt", "x", "--target", str(target), "--drafter",
                   os.path.join(DEMO_DIR, "drafter"), "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert rc == 1 and err == (f"refused: {target / 'config.json'}: eos_token_id 5000 is outside the vocabulary "
                               "[0, 4096) (vocab_size), so it cannot be a stop token\n"), err


def test_command_line_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["generate", "--block-size", "two"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == ("dflash-jax generate: error: argument --block-size: invalid int value: 'two' "
                                       "(see dflash-jax generate --help)\n")


def test_inspect_refusals_are_one_line_and_debug_raises(tmp_path, capsys):
    assert cli.main(["inspect", str(tmp_path)]) == 1
    assert capsys.readouterr().err == f"refused: {tmp_path}: no config.json (expected a Hugging Face checkpoint " \
                                      "directory)\n"
    with pytest.raises(ValueError, match="no config.json"):
        cli.main(["inspect", str(tmp_path), "--debug"])
