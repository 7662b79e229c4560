"""Models, tokenizers and datasets by hub id: `hf:org/name`, or `hf:org/name@revision` (a branch, tag or
commit). A missing local path is never taken for a hub id, so a typo fails at once instead of trying the
network; a path that looks like one gets the hint.

A model or tokenizer (`model.path`, `reference.path`, `tokenizer.path`) is downloaded once per node, by its
local rank 0, into the Hugging Face cache (huggingface_hub's `snapshot_download`: weights in safetensors,
config, tokenizer and chat-template files, nothing else), while the node's other ranks wait; every rank then
reads the cached directory, as it reads a local one (the sharded loader included). Offline
(`HF_HUB_OFFLINE=1`) a model already in the cache is read from it. The cache is huggingface_hub's: HF_HOME
or HF_HUB_CACHE choose it, HF_TOKEN opens gated repositories.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from chattune.errors import UserError

HUB_PREFIX = "hf:"
HUB_LIKE = re.compile(r"[\w.-]+/[\w.-]+")  # a missing path that may have meant a hub id (for the hint)
# What a model directory needs (safetensors weights, config, tokenizer and template files), not the other
# weight formats a repository may also hold (pytorch_model.bin, GGUF, ONNX, ...).
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def hub_id(path: str) -> str | None:
    """The hub id of a path written `hf:org/name[@revision]`; None for a local path."""
    return path[len(HUB_PREFIX) :] if path.startswith(HUB_PREFIX) else None


def hub_hint(path: str, kind: str) -> str:
    """ " (a hub model is written hf:org/name)" for a missing path that looks like a hub id, else ""."""
    return f" (a hub {kind} is written {HUB_PREFIX}{path})" if HUB_LIKE.fullmatch(path) else ""


def local_directory(path: str, key: str) -> Path:
    """The local directory of a model or tokenizer path: itself, or for a hub id its snapshot in the Hugging
    Face cache, downloaded first by each node's local rank 0 (the other ranks wait in a barrier). Collective
    for a hub id under torch.distributed: every rank calls it, for the same paths, in the same order.
    `key` names the config key in errors."""
    repo = hub_id(path)
    if repo is None:
        return Path(path)
    from huggingface_hub import snapshot_download

    repo_id, _, revision = repo.partition("@")
    failure = None
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        try:
            snapshot_download(repo_id, revision=revision or None, allow_patterns=MODEL_FILES)
        except Exception as error:  # noqa: BLE001  (offline, gated, missing, network: all said below)
            failure = f"{type(error).__name__}: {error}"
    _barrier()
    try:  # every rank: the node's cached copy (downloaded above, or there before)
        directory = snapshot_download(
            repo_id, revision=revision or None, allow_patterns=MODEL_FILES, local_files_only=True
        )
    except Exception as error:  # noqa: BLE001
        reason = failure or f"{type(error).__name__}: {error}"
        raise UserError(
            f"{key} {path!r}: neither downloaded nor in the Hugging Face cache ({reason.splitlines()[0]}). "
            "Check the id (and HF_TOKEN for a gated model); offline (HF_HUB_OFFLINE=1), download it once "
            "where there is a network into the same HF_HOME, or give a local directory"
        ) from None
    return Path(directory)


def _barrier() -> None:
    import torch.distributed as dist

    from chattune.distributed import world_size  # torch: only where a hub id is read

    if world_size() > 1:
        dist.barrier()
