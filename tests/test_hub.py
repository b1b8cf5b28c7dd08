"""Hugging Face repo ids (dflash_jax/hub.py): resolved through a Hugging Face cache laid out on disk, offline."""
import hashlib
import os
import subprocess
import sys

import pytest

import dflash_jax
from dflash_jax import CheckpointError, HubError, api, hub
from dflash_jax.demo import DEMO_DIR

REV = "0123456789abcdef0123456789abcdef01234567"
OTHER_REV = "89abcdef0123456789abcdef0123456789abcdef"


def _cache_repo(cache, repo_id: str, source: str, rev: str = REV, ref: str = "main") -> str:
    """`source`'s files as the Hugging Face cache holds a snapshot: blobs named by hash, the snapshot's
    files symlinks to them, and refs/<ref> naming the commit. Returns the snapshot folder."""
    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", rev)
    os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
    os.makedirs(snapshot, exist_ok=True)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    for name in os.listdir(source):
        data = open(os.path.join(source, name), "rb").read()
        blob = os.path.join(repo, "blobs", hashlib.sha256(data).hexdigest())
        open(blob, "wb").write(data)
        os.symlink(os.path.relpath(blob, snapshot), os.path.join(snapshot, name))
    open(os.path.join(repo, "refs", ref), "w").write(rev)
    return snapshot


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An offline Hugging Face cache in tmp holding the demo pair as org/demo-target and org/demo-drafter.
    huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE once, at import: the test patches what it read
    (the subprocess test below sets the environment itself)."""
    import huggingface_hub.constants

    root = str(tmp_path / "hub")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", root)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    _cache_repo(root, "org/demo-target", os.path.join(DEMO_DIR, "target"))
    _cache_repo(root, "org/demo-drafter", os.path.join(DEMO_DIR, "drafter"))
    return root


def test_repo_ids_load_from_the_cache_offline(cache):
    target = dflash_jax.load_target("org/demo-target", "float32")
    drafter = dflash_jax.load_drafter("org/demo-drafter", target)
    tok = dflash_jax.load_tokenizer("org/demo-target")
    snapshot = os.path.join(cache, "models--org--demo-target", "snapshots", REV)
    assert api.source_folder(target) == tok.folder == snapshot
    demo = dflash_jax.load_demo()
    ids = tok.encode("import os\n")
    assert ids == demo.tokenizer.encode("import os\n")
    out = dflash_jax.generate_text(target, drafter, "import os\n", max_new_tokens=8)
    ref = dflash_jax.generate(demo.target, demo.drafter, [ids], max_new_tokens=8, stop_tokens=0)
    assert out.tokens == ref.tokens, "a hub id loads the same pair, and its folder's tokenizer by default"


def test_revisions_are_honoured(cache):
    other = _cache_repo(cache, "org/demo-target", os.path.join(DEMO_DIR, "drafter"), rev=OTHER_REV, ref="v2")
    assert hub.resolve("org/demo-target", revision="v2") == other
    assert hub.resolve("org/demo-target", revision=OTHER_REV) == other
    assert hub.resolve("org/demo-target").endswith(REV)
    with pytest.raises(HubError, match=r"'org/demo-target' \(revision v3\).*HF_HUB_OFFLINE"):
        hub.resolve("org/demo-target", revision="v3")


def test_a_missing_repo_is_one_error_naming_the_id_and_the_cache(cache):
    for load in (dflash_jax.load_target, dflash_jax.load_tokenizer, dflash_jax.load_drafter):
        with pytest.raises(HubError) as e:
            load("org/no-such-model")
        message = str(e.value)
        assert "'org/no-such-model'" in message and cache in message and "HF_HUB_OFFLINE is set" in message, message
        assert isinstance(e.value, CheckpointError)


def test_local_paths_win_and_bad_names_are_refused(cache, tmp_path):
    local = os.path.join(DEMO_DIR, "target")
    assert hub.resolve(local) == local
    with pytest.raises(ValueError, match="revision='v2' applies to Hugging Face repo ids"):
        hub.resolve(local, revision="v2")
    with pytest.raises(CheckpointError, match="is a file"):
        hub.resolve(os.path.join(local, "config.json"))
    with pytest.raises(CheckpointError, match="no such folder, and not a Hugging Face repo id"):
        dflash_jax.load_target(str(tmp_path / "no" / "such" / "dir"))
    with pytest.raises(CheckpointError, match="must be a folder path or a Hugging Face repo id"):
        hub.resolve(b"org/demo-target")


def test_hf_home_and_hf_hub_offline_from_the_environment(tmp_path):
    """A fresh process reading HF_HOME and HF_HUB_OFFLINE from its environment, as a user's would."""
    _cache_repo(str(tmp_path / "home" / "hub"), "org/demo-target", os.path.join(DEMO_DIR, "target"))
    code = ("import dflash_jax\n"
            "t = dflash_jax.load_target('org/demo-target')\n"
            "tok = dflash_jax.load_tokenizer('org/demo-target')\n"
            "print(t.config.vocab_size, tok.vocab_size, dflash_jax.api.source_folder(t) == tok.folder)\n"
            "try:\n    dflash_jax.load_target('org/absent')\n"
            "except dflash_jax.HubError as e:\n    print(e)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "4096 4096 True"
    assert "'org/absent'" in lines[1] and str(tmp_path / "home" / "hub") in lines[1], lines[1]
