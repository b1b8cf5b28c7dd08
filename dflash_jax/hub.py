"""Checkpoint folders from a local path or a Hugging Face repository id.

A local directory is used as it is. Anything else that reads as a repo id ("org/name") goes through
`huggingface_hub.snapshot_download`, which honours its own settings (`HF_HOME`, `HF_HUB_CACHE`,
`HF_HUB_OFFLINE`, `HF_TOKEN`): files already in the cache are used without the network, and missing
ones are downloaded where the network allows. Only the files a loader reads are fetched.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

from dflash_jax.config import CheckpointError

MODEL_FILES = ("*.json", "*.safetensors", "*.jinja")
"""What a target or drafter folder needs: config.json, the weights and their index, and the tokenizer
files beside them (tokenizer.json, tokenizer_config.json, generation_config.json, chat_template.jinja)."""
TOKENIZER_FILES = ("*.json", "*.jinja")
"""What `load_tokenizer` needs: no weights."""


class HubError(CheckpointError):
    """A repository id that could not be resolved to a folder: the message names the id, the revision,
    the cache folder and why."""


def resolve(path_or_id: str | os.PathLike, *, revision: Optional[str] = None, what: str = "model",
            files: Sequence[str] = MODEL_FILES) -> str:
    """The folder of `path_or_id`: a local directory as is, else the snapshot of the Hugging Face repo
    id at `revision` (default: the main branch), downloading `files` (glob patterns) it lacks.

    `what` names the role in error messages ("target", "drafter", "tokenizer"). A path that is neither a
    directory nor a repo id, and a repo that cannot be had, raise `CheckpointError` (`HubError` for the
    latter) naming the id and the cache folder."""
    name = os.fspath(path_or_id)
    if not isinstance(name, str):
        raise CheckpointError(f"{what} must be a folder path or a Hugging Face repo id; got {name!r:.60}")
    if os.path.isdir(name):
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to Hugging Face repo ids; {name} is a local folder")
        return name
    if os.path.exists(name):
        raise CheckpointError(f"{what} {name} is a file; expected a checkpoint folder or a Hugging Face repo id")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        raise CheckpointError(f"{what} {name}: no such folder, and not a Hugging Face repo id (\"org/name\")") \
            from None
    where = f"{what} {name!r} (revision {revision or 'main'}) is not a local folder, and"
    try:
        return snapshot_download(name, revision=revision, allow_patterns=list(files))
    except (OSError, ValueError) as e:  # the hub client's errors: not found, gated, offline, network, disk
        raise HubError(f"{where} the Hugging Face cache {constants.HF_HUB_CACHE} cannot supply it: "
                       f"{_reason(e, name, constants.HF_HUB_OFFLINE)}") from e


def _reason(e: Exception, repo_id: str, offline: bool) -> str:
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    if isinstance(e, GatedRepoError):
        return "the repository is gated: accept its terms on huggingface.co and log in (`hf auth login`)"
    if isinstance(e, RepositoryNotFoundError):
        return "no such repository on the Hub (or it is private: log in with `hf auth login`)"
    if isinstance(e, RevisionNotFoundError):
        return "the repository has no such revision (branch, tag or commit)"
    if offline:
        return (f"it is not cached, and HF_HUB_OFFLINE is set, so nothing is downloaded (download it once online: "
                f"`hf download {repo_id}`)")
    return f"{type(e).__name__}: {e}"
