"""A checkpoint directory's files, and the rename that commits one: the manifest, each rank's own state file, writes
that reach the disk, and the list of committed checkpoints. Shared by the collective saves (`checkpoint`) and the
snapshots each rank writes alone (`snapshot`)."""

from __future__ import annotations

import io
import logging
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from chattune import interrupts
from chattune.files import set_aside
from chattune.log import EACH_RANK

logger = logging.getLogger(__name__)

MANIFEST_FILE = "chattune.json"


_COMMITTED = re.compile(r"step_(\d+)")


def rank_state_file(directory: Path, rank: int) -> Path:
    """A rank's own parts of the run state in the checkpoint `directory`."""
    return directory / f"train_state_rank{rank}.pt"


def barrier() -> None:
    """Every rank here (a no-op in one process)."""
    if dist.is_initialized():
        dist.barrier()


def write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def commit(partial: Path, final: Path, keep_last_n: int | None) -> None:
    """The rename that makes a complete checkpoint count (rank 0's, or a snapshot's committing rank's), then
    pruning."""
    if final.exists():  # a step saved again (a run resumed from an older checkpoint): never replaced in place
        # (the committing rank's alone: a snapshot's may be any rank)
        logger.warning("moved aside: %s -> %s (saved again by this run)", final, set_aside(final), extra=EACH_RANK)
    os.rename(partial, final)
    _sync_directory(final.parent)
    interrupts.note_checkpoint(final)  # what a stop that cannot save keeps from now on
    if keep_last_n:
        for old in committed_checkpoints(final.parent)[:-keep_last_n]:
            shutil.rmtree(old)


def serialize(obj: dict) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _sync_directory(path: Path) -> None:
    """Make a rename durable (on POSIX the directory entry needs its own fsync)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def committed_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _COMMITTED.fullmatch(p.name)) and (p / MANIFEST_FILE).is_file()
    ]
    return [p for _, p in sorted(found)]
