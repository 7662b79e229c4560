"""Sharded training checkpoints (torch.distributed.checkpoint), written atomically.

Layout of `{output_dir}/checkpoints/step_{N}/`:
- DCP shards of {"model", "optimizer"} (each rank writes its own; loads reshard as DCP allows);
- `train_state_rank{R}.pt`: that rank's step, scheduler, data feed (stream position, packer buffers,
  loader worker states) and RNG states: what an exact resume needs per rank;
- `chattune.json`, written last: step, world size, loader workers and the run's fingerprint.

A checkpoint is written under `step_{N}.partial` and renamed to `step_{N}` only once every rank's files
are complete, so a crash during a save leaves a `.partial` directory that is never resumed from (and is
removed by the next save of that step). `find_latest` only considers committed directories.

With `save_async` (`BackgroundSaves`), DCP copies the state to CPU memory (a few seconds' pause at most)
and writes it from a thread while training goes on; on CUDA that copy goes into pinned buffers allocated at
the first save and reused by every later one (DCP's `DefaultStager`; on torch 2.11 and 2.12, whose stager
copies one state only, fresh pinned buffers per save), not into a fresh pageable copy of the whole state per save; the same rename commits it, from that thread, once
every rank's shards and DCP's metadata are on disk. A crash before that leaves the `.partial` directory,
as above; at most one save is in flight (the next one waits for it).
"""

from __future__ import annotations

import functools
import io
import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from chattune.files import set_aside
from chattune.model.quantize import has_quantized_weight
from chattune.train.faults import maybe_crash

logger = logging.getLogger(__name__)

META_FILE = "chattune.json"
_COMMITTED = re.compile(r"step_(\d+)")


# Frozen parameters (a LoRA run's base) are not saved: they are the model directory's, reloaded at resume.
TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True)


def _sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    # ignore_frozen_params still lists a frozen output layer tied to the embedding, and a 4-bit layer adds its
    # quantization state to the state dict as entries of their own: only trained parameters and buffers stay.
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    quantization_state = tuple(f"{name}.weight." for name, module in model.named_modules()
                               if has_quantized_weight(module))  # weight.absmax, weight.quant_map..
    weights = {k: v for k, v in get_model_state_dict(model, options=TRAINED_ONLY).items()
               if k not in frozen and not k.startswith(quantization_state)}
    return {"model": weights, "optimizer": get_optimizer_state_dict(model, optimizer, options=TRAINED_ONLY)}


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


def pinned_stager():
    """DCP's stager into pinned host buffers that it keeps (by source storage) and reuses for every save. The
    copy is made before `async_save` returns (the optimizer changes the state right after), with
    non-blocking copies and one device sync; nothing is shared with another process. None (DCP's default,
    a fresh copy per save) on a torch without it, with a warning."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError as error:
        logger.warning("save_async: this torch's DCP has no DefaultStager (%s): every save copies the state afresh",
                       error)
        return None

    return DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False, use_async_staging=False,
                                        use_non_blocking_copy=True))


@functools.cache
def stager_is_reusable() -> bool:
    """Whether one DCP `DefaultStager` can stage more than one save. torch 2.11 and 2.12 close its copier at
    the end of every stage (to break a reference cycle), so a second save through the same stager fails
    (`KeyError: <class 'type'>`, found by the first GPU run of scripts/gpu_check.py); 2.13 keeps it open
    until `close()`. Settled by staging a tiny state twice through a CPU stager, not by version numbers."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:
        return False
    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                          use_async_staging=False, use_non_blocking_copy=False))
    try:
        for _ in range(2):
            stager.stage({"probe": torch.zeros(1), "nested": {"step": 0}})
    except KeyError:
        return False
    finally:
        stager.close()
    return True


class BackgroundSaves:
    """Checkpoint writes in a background thread (`dcp.async_save`), each committed by that thread when it is
    complete. Collective to create (a gloo group of its own, so the writer's collectives never interleave
    with training's). On CUDA the state is staged through pinned buffers (`pinned_stager`): one stager and
    its buffers for every save where this torch's stager can be reused (`stager_is_reusable`), else a fresh
    one per save. `make_stager` replaces `pinned_stager` (the tests stage through a CPU stager)."""

    def __init__(self, device: torch.device | None = None,
                 make_stager: Callable[[], object] | None = None) -> None:
        self._group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chattune-checkpoint")
        self._pending: Future | None = None
        if make_stager is None and device is not None and device.type == "cuda":
            make_stager = pinned_stager
        self._make_stager = make_stager
        self._stager = None

    def _stager_for_next_save(self):
        """The stager of the next save: the one made before where it can be reused, else a fresh one."""
        if self._make_stager is None:
            return None
        if self._stager is not None and not stager_is_reusable():
            self._stager.close()  # spent: this torch's stager copies one state only
            self._stager = None
        if self._stager is None:
            if not stager_is_reusable():
                logger.debug("save_async: this torch's DCP stager copies one state only: fresh pinned buffers")
            self._stager = self._make_stager()
            if self._stager is None:  # a torch without DefaultStager: DCP's default staging from now on
                self._make_stager = None
        return self._stager

    def start(self, state: dict, directory: Path, commit: Callable[[], None]) -> None:
        """Copy `state` to CPU memory now; write it to `directory` and then call `commit` in the background."""
        written = dcp.async_save(state, checkpoint_id=str(directory), process_group=self._group,
                                 async_stager=self._stager_for_next_save())

        def write_then_commit() -> None:
            written.result()  # on rank 0 (DCP's coordinator) this returns once every rank's shards are written
            commit()

        self._pending = self._executor.submit(write_then_commit)

    def wait(self) -> None:
        """Block until the save in flight, if any, is written and committed; raise its error if it failed."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self) -> None:
        self.wait()
        self._executor.shutdown()
        if self._stager is not None:  # its pinned buffers (a stager we pass in stays ours to close)
            self._stager.close()
            self._stager = None


def save_checkpoint(root: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    train_state: dict, meta: dict, keep_last_n: int | None = None,
                    extra_files: dict[str, bytes] | None = None, background: BackgroundSaves | None = None) -> Path:
    """Collective: write `root/step_{step}` atomically; then keep only the newest `keep_last_n`.
    `extra_files` (rank 0's): more files of the checkpoint, by name. With `background`, return once the state
    is copied; the write and the commit finish in the background."""
    if background is not None:
        background.wait()  # one save in flight at a time
    final, partial = root / f"step_{step}", root / f"step_{step}.partial"
    if _rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left by a save that crashed
        partial.mkdir(parents=True)
    _barrier()  # nobody writes into the directory before it is clean
    if background is None:
        dcp.save(_sharded_state(model, optimizer), checkpoint_id=str(partial))
    _write_synced(partial / f"train_state_rank{_rank()}.pt", _serialize(train_state))

    def rank0_files() -> None:
        for name, data in (extra_files or {}).items():
            _write_synced(partial / name, data)
        _write_synced(partial / META_FILE, json.dumps({**meta, "step": step}, indent=1).encode())

    if background is not None:
        if _rank() == 0:
            rank0_files()  # the directory only counts once renamed, after every shard is written
        background.start(_sharded_state(model, optimizer), partial,
                         lambda: _commit(partial, final, keep_last_n) if _rank() == 0 else None)
        maybe_crash("save", step)
        return final
    maybe_crash("save", step)
    _barrier()  # every rank's files are complete
    if _rank() == 0:
        rank0_files()
        _commit(partial, final, keep_last_n)
    _barrier()
    return final


def _commit(partial: Path, final: Path, keep_last_n: int | None) -> None:
    """Rank 0: the rename that makes a complete checkpoint count, then pruning."""
    if final.exists():  # a step saved again (a run resumed from an older checkpoint): never replaced in place
        logger.warning("moved aside: %s -> %s (saved again by this run)", final, set_aside(final))
    os.rename(partial, final)
    _sync_directory(final.parent)
    if keep_last_n:
        for old in committed_checkpoints(final.parent)[:-keep_last_n]:
            shutil.rmtree(old)


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


def damage(directory: Path) -> list[str]:
    """What is missing or cut short in a committed checkpoint, against its own records: DCP's `.metadata`
    (every shard file and the bytes it must hold) and chattune.json (every saving rank's train state).
    Empty for an intact one. (A file lost or truncated after the commit: a failed copy, a full disk.)"""
    problems = []
    try:
        storage = FileSystemReader(str(directory)).read_metadata().storage_data
    except Exception as error:  # noqa: BLE001  (missing, truncated or foreign: reported as damage, never hidden)
        problems.append(f"its DCP metadata (.metadata) cannot be read ({type(error).__name__}: {error})")
        storage = {}
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = directory / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size < size:
            problems.append(f"{name} is cut short ({path.stat().st_size} of {size} bytes)")
    ranks = read_meta(directory).get("world_size") or 0
    problems += [f"train_state_rank{rank}.pt is missing" for rank in range(ranks)
                 if not (directory / f"train_state_rank{rank}.pt").is_file()]
    return problems


def read_meta(directory: Path) -> dict:
    path = directory / META_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a complete chattune checkpoint (no {META_FILE})")
    return json.loads(path.read_text())


def load_checkpoint(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    own_state: bool = True) -> dict:
    """Collective: restore model and optimizer shards in place (DCP reshards them for another number of ranks);
    returns this rank's train_state (`own_state=False`: rank 0's)."""
    state = _sharded_state(model, optimizer)
    dcp.load(state, checkpoint_id=str(directory))
    # Not strict: the frozen keys are absent by design; every trained key is present (dcp.load fills exactly
    # the keys `_sharded_state` lists, and raises when the checkpoint lacks one).
    set_model_state_dict(model, state["model"], options=StateDictOptions(ignore_frozen_params=True, strict=False))
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=TRAINED_ONLY)
    return torch.load(directory / f"train_state_rank{_rank() if own_state else 0}.pt", weights_only=False)
