"""Publishing a checkpoint folder whole: written into a temporary sibling, then renamed into place.

A reader of the destination sees the old checkpoint or the new one, never a mix: no stale
index or shard survives beside new weights, because the old folder is replaced, not
merged into. A non-empty destination is refused unless the caller asks to overwrite it,
and then only when it holds a `config.json` (a checkpoint, not an arbitrary folder).

The swap is two renames (old folder aside, new folder in). An exception between them
puts the old folder back; a process killed between them leaves the old checkpoint in
its `.NAME.replaced-*` sibling. An interrupted write leaves a `.NAME.incomplete-*`
sibling only when the caller asked to keep it (a training run's periodic checkpoints).
"""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat


def destination(path, overwrite: bool = False) -> str:
    """The absolute folder `path` names (symlinks resolved), refused when writing there would
    destroy something: a file, or a non-empty folder unless `overwrite` (and it is a checkpoint)."""
    path = os.path.realpath(os.fspath(path))
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise NotADirectoryError(f"{existing} is a file, so {path} cannot be a checkpoint folder")
    entries = sorted(os.listdir(path)) if os.path.isdir(path) else []
    if entries and not overwrite:
        shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
        raise FileExistsError(
            f"{path} is not empty ({len(entries)} entries: {shown}); refusing to write a checkpoint over it: "
            "choose an empty or new folder, or pass overwrite=True (--overwrite) to replace its whole contents"
        )
    if entries and "config.json" not in entries:
        raise FileExistsError(f"{path} holds no config.json, so it is not a checkpoint folder; overwrite replaces "
                              "only a previous checkpoint, choose an empty or new folder")
    return path


def _sibling(path: str, tag: str) -> str:
    parent, name = os.path.split(path)
    return os.path.join(parent, f".{name}.{tag}-{secrets.token_hex(4)}")


def _file_mode(folder: str) -> int:
    """The mode `open` gives a new file in `folder` (0o666 less the umask), read off a probe file:
    the umask cannot be read without setting it, which would race with other threads."""
    probe = _sibling(os.path.join(folder, "probe"), "mode")
    with open(probe, "x"):
        pass
    try:
        return stat.S_IMODE(os.stat(probe).st_mode)
    finally:
        os.remove(probe)


def _normal_permissions(folder: str) -> None:
    """Give files written by libraries that create them private (safetensors: 0600) the mode of `open`."""
    mode = _file_mode(folder)
    for root, _, files in os.walk(folder):
        for name in files:
            os.chmod(os.path.join(root, name), mode)


def _swap_in(stage: str, path: str, overwrite: bool) -> None:
    destination(path, overwrite)  # again: something may have appeared there while we wrote
    if not os.path.lexists(path):
        os.rename(stage, path)
        return
    old = _sibling(path, "replaced")
    os.rename(path, old)
    try:
        os.rename(stage, path)
    except BaseException:
        os.rename(old, path)
        raise
    shutil.rmtree(old)


@contextlib.contextmanager
def staged(path, overwrite: bool = False, keep_on_error: bool = False):
    """Yield a new empty sibling folder of `path` to write into; when the block ends without an
    exception, its files get the usual permissions and it replaces `path` (see `destination`
    for what is refused). On an exception it is removed, or with `keep_on_error` kept (when
    not empty) and named in a note on the exception."""
    path = destination(path, overwrite)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    stage = _sibling(path, "incomplete")
    os.mkdir(stage)
    try:
        yield stage
        _normal_permissions(stage)
        _swap_in(stage, path, overwrite)
    except BaseException as e:
        if keep_on_error and os.path.isdir(stage) and os.listdir(stage):
            e.add_note(f"what was written before this is kept in {stage}")
        else:
            shutil.rmtree(stage, ignore_errors=True)
        raise
