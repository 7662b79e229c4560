"""Sharded training checkpoints (torch.distributed.checkpoint), written atomically.

Layout of `{output_dir}/checkpoints/step_{N}/`:
- DCP shards of {"model", "optimizer"} (each rank writes its own; loads reshard as DCP allows);
- `train_state_rank{R}.pt`: that rank's step, scheduler, data feed (stream position, packer buffers,
  loader worker states) and RNG states: what an exact resume needs per rank;
- `chattune.json`, written last: step, world size, loader workers and the run's fingerprint.

A checkpoint is written under `step_{N}.partial` and renamed to `step_{N}` only once every rank's files
are complete, so a crash during a save leaves a `.partial` directory that is never resumed from (and is
removed by the next save of that step). `find_latest` only considers committed directories.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from chattune.train.faults import maybe_crash

META_FILE = "chattune.json"
_COMMITTED = re.compile(r"step_(\d+)")


def _sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(root: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    train_state: dict, meta: dict, keep_last_n: int | None = None,
                    extra_files: dict[str, bytes] | None = None) -> Path:
    """Collective: write `root/step_{step}` atomically; then keep only the newest `keep_last_n`.
    `extra_files` (rank 0's): more files of the checkpoint, by name."""
    final, partial = root / f"step_{step}", root / f"step_{step}.partial"
    if _rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left by a save that crashed
        partial.mkdir(parents=True)
    _barrier()  # nobody writes into the directory before it is clean
    dcp.save(_sharded_state(model, optimizer), checkpoint_id=str(partial))
    buffer = _serialize(train_state)
    _write_synced(partial / f"train_state_rank{_rank()}.pt", buffer)
    maybe_crash("save", step)
    _barrier()  # every rank's files are complete
    if _rank() == 0:
        for name, data in (extra_files or {}).items():
            _write_synced(partial / name, data)
        _write_synced(partial / META_FILE, json.dumps({**meta, "step": step}, indent=1).encode())
        if final.exists():  # re-saving a step (a run resumed from an older checkpoint)
            shutil.rmtree(final)
        os.rename(partial, final)
        _sync_directory(root)
        if keep_last_n:
            for old in committed_checkpoints(root)[:-keep_last_n]:
                shutil.rmtree(old)
    _barrier()
    return final


def _serialize(obj: dict) -> bytes:
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
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _COMMITTED.fullmatch(p.name))
             and (p / META_FILE).is_file()]
    return [p for _, p in sorted(found)]


def find_latest(root: Path) -> Path | None:
    checkpoints = committed_checkpoints(root)
    return checkpoints[-1] if checkpoints else None


def read_meta(directory: Path) -> dict:
    path = directory / META_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a complete chattune checkpoint (no {META_FILE})")
    return json.loads(path.read_text())


def load_checkpoint(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Collective: restore model and optimizer shards in place; returns this rank's train_state."""
    state = _sharded_state(model, optimizer)
    dcp.load(state, checkpoint_id=str(directory))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    return torch.load(directory / f"train_state_rank{_rank()}.pt", weights_only=False)
