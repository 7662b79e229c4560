"""Exact resume: what a checkpoint holds beyond the weights, which checkpoint to continue from, and
whether it fits the run that wants to continue it.

A run's fingerprint is its resolved config (minus the keys that may change between launches without
changing what is trained: logging, saving, output, eval) and a fingerprint of each training data file
and of the tokenizer files. Resuming under a different fingerprint is an error that lists every
difference, unless `resume_allow_changes=true` (then the differences are logged).
"""

from __future__ import annotations

import hashlib
import logging
import random
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from chattune.checkpoint import find_latest, load_checkpoint, read_meta, save_checkpoint
from chattune.formats import SourceSpec

logger = logging.getLogger(__name__)

# Config keys a resumed run may change freely: they do not change the training trajectory.
RUNTIME_KEYS = ("output_dir", "resume", "resume_allow_changes", "log_every", "save_every", "keep_last_n",
                "eval_every", "logger", "progress", "wandb", "stop_after_step", "nonfinite_loss", "ledger",
                "data.eval", "data.report_records", "data.num_workers")
_EDGE_BYTES = 1 << 20


class ResumeError(RuntimeError):
    """The checkpoint cannot continue this run exactly."""


def file_fingerprint(path: Path) -> str:
    """Size and a hash of the first and last MiB: catches edits, appends and truncation without reading
    a large file whole (which would make start-up time grow with the data)."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(_EDGE_BYTES))
        if size > _EDGE_BYTES:
            f.seek(max(size - _EDGE_BYTES, _EDGE_BYTES))
            digest.update(f.read())
    return f"{size}:{digest.hexdigest()[:16]}"


def _flatten(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        flat = {}
        for key, value in tree.items():
            flat.update(_flatten(value, f"{prefix}{key}."))
        return flat
    return {prefix[:-1]: tree}


def data_file_fingerprints(sources, tokenizer_path: str) -> dict[str, str]:
    """Fingerprints of the files behind data sources (config entries) and of the tokenizer's files."""
    files: dict[str, str] = {}
    for entry in OmegaConf.to_container(sources, resolve=True):
        path = Path(SourceSpec.from_config(entry).path)
        if path.is_file():
            files[str(path)] = file_fingerprint(path)
        elif path.is_dir():  # a dataset directory: every file in it
            files.update({str(p): file_fingerprint(p) for p in sorted(path.rglob("*")) if p.is_file()})
        else:  # a hub dataset id: its name only (its content is the hub's to version)
            files[str(path)] = "hub dataset"
    tokenizer_dir = Path(tokenizer_path)
    if tokenizer_dir.is_dir():
        files.update({str(p): file_fingerprint(p) for p in sorted(tokenizer_dir.iterdir()) if p.is_file()})
    return files


def run_fingerprint(cfg: DictConfig) -> dict:
    config = _flatten(OmegaConf.to_container(cfg, resolve=True))
    config = {k: v for k, v in config.items() if not any(k == r or k.startswith(r + ".") for r in RUNTIME_KEYS)}
    return {"config": config, "files": data_file_fingerprints(cfg.data.train, cfg.tokenizer.path)}


def differences(saved: dict, current: dict) -> list[str]:
    """Human-readable differences between two fingerprints."""
    lines = []
    for section in ("config", "files"):
        before, now = saved.get(section, {}), current.get(section, {})
        for key in sorted(set(before) | set(now)):
            if before.get(key, "<absent>") != now.get(key, "<absent>"):
                lines.append(f"{section} {key}: {before.get(key, '<absent>')!r} -> {now.get(key, '<absent>')!r}")
    return lines


def checkpoint_to_resume(resume: str | None, checkpoints: Path) -> Path | None:
    """`resume`: "auto" (the newest complete checkpoint under `checkpoints`, or none), a checkpoint
    directory, or None (never)."""
    if resume is None:
        return None
    if resume == "auto":
        return find_latest(checkpoints)
    directory = Path(resume)
    read_meta(directory)  # raises unless it is a complete checkpoint
    return directory


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def run_meta(world_size: int, num_workers: int, fingerprint: dict) -> dict:
    return {"world_size": world_size, "num_workers": num_workers, "fingerprint": fingerprint}


def check_resumable(directory: Path, meta: dict, allow_changes: bool) -> None:
    """Raise ResumeError when the checkpoint cannot continue this run exactly."""
    saved = read_meta(directory)
    if saved["world_size"] != meta["world_size"]:
        raise ResumeError(
            f"{directory} was written by {saved['world_size']} rank(s), this run has {meta['world_size']}: each rank's "
            "data position is a place in its own share of the epoch, which another number of ranks would split "
            f"differently. Relaunch with --nproc_per_node {saved['world_size']} (or start afresh with resume=null).")
    if saved["num_workers"] != meta["num_workers"]:
        raise ResumeError(
            f"{directory} was written with data.num_workers={saved['num_workers']}, this run has "
            f"data.num_workers={meta['num_workers']}: the loader's per-worker states do not carry over. "
            f"Resume with data.num_workers={saved['num_workers']}.")
    changed = differences(saved["fingerprint"], meta["fingerprint"])
    if changed and not allow_changes:
        raise ResumeError(f"{directory} belongs to a different run (config or data changed):\n  " + "\n  ".join(changed)
                          + "\nResume anyway with resume_allow_changes=true, or start afresh with resume=null.")
    for line in changed:
        logger.warning("resuming despite a change (resume_allow_changes=true): %s", line)


def save_training(root: Path, step: int, model, optimizer, scheduler, feed, meta: dict, counters: dict,
                  keep_last_n: int | None) -> Path:
    """Collective: everything an exact resume needs, atomically."""
    train_state = {"step": step, "scheduler": scheduler.state_dict(), "data": feed.state_dict(),
                   "rng": rng_state(), "counters": dict(counters)}
    return save_checkpoint(root, step, model, optimizer, train_state, meta, keep_last_n)


def resume_training(directory: Path, model, optimizer, scheduler, feed, meta: dict, allow_changes: bool) -> tuple[int, dict]:
    """Collective: restore a run from `directory`; returns (its step, its counters)."""
    check_resumable(directory, meta, allow_changes)
    train_state = load_checkpoint(directory, model, optimizer)
    scheduler.load_state_dict(train_state["scheduler"])
    feed.load_state_dict(train_state["data"])
    set_rng_state(train_state["rng"])
    return train_state["step"], train_state["counters"]
