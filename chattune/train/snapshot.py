"""The last completed step kept in host memory, written without collectives when a stop cannot finish the step
in flight: plain torchrun SIGKILLs its workers 30 s (its --shutdown-timeout) after passing a signal on, and a
step longer than that would otherwise lose everything since the last checkpoint (`checkpoint_snapshots`).

The design, and why:
- After every step that saves no checkpoint, each rank copies its part of the run state into host buffers
  allocated once (`Snapshots.stage`): its shards of the model and the optimizer (the local tensors of their
  DTensors; on CUDA pinned buffers, non-blocking copies and one event, so the next step's kernels queue behind
  the copy instead of waiting for it) and its own parts serialized (schedule, data position, random generators,
  counters): the state a checkpoint of that step would hold, taken where the loop would have saved it.
- Whether a step is staged is decided alike on every rank (a checkpoint due, or the step's all-reduce saying
  a stop is on, saves instead), so every rank holds the same step.
- A watcher thread wakes on the signal itself (`signal.set_wakeup_fd`), not when the main thread next runs
  Python: a rank blocked in a collective or a long kernel still writes.
- On a stop signal each rank writes the step it holds, with no collective (a peer may be in the middle of the
  step): DCP's single-process save of its own shards into `step_N.snapshot/rank_R/`, its own parts as
  `train_state_rank{R}.pt`, and a `done_rank_R` marker. The rank that sees every marker after writing its own
  (an `O_EXCL` file elects exactly one when two finish together) merges the ranks' DCP metadata into one,
  each shard at its global offset, writes the manifest and renames the directory to `step_N`: an ordinary
  checkpoint that resumes, reshards to another number of ranks and exports as any other. A rank killed before
  its marker leaves a `.snapshot` directory that is never resumed from (removed when the next run starts).
- A step in flight that finishes within the grace is saved by the ordinary stop (`loop.stop`), which first
  waits for this rank's snapshot write: the snapshot is what is left when the SIGKILL comes first.

Cost, per step: a copy of the rank's shards of the weights and the optimizer's states (on the host: about
3x the trained parameters' fp32 bytes, divided by the ranks), measured by scripts/bench_snapshots.py.
Alternatives left out: an asynchronous DCP save every step (collective, so a rank killed mid-step takes the
others' write with it, and DCP's planning costs a collective per step); writing on the signal from the live
state (the optimizer may be half-way through changing it).
"""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import logging
import os
import pickle
import shutil
import signal
import socket
import threading
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.tensor import DTensor

from chattune import errors, interrupts
from chattune.train.checkpoint import MANIFEST_FILE, rank_state_file, sync_directory, write_synced
from chattune.train.run_state import RunState

logger = logging.getLogger(__name__)
# DCP's single-process save (each rank's own snapshot, on purpose) warns that it assumes a single process
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)

SUFFIX = ".snapshot"
_LAYOUT_FILE = "shards.pt"  # a rank's {flattened key: (global size, offsets)} of the shards it wrote
_METADATA_NAMES = (".metadata", "__0.metadata")  # a single-process DCP save's metadata, by torch version


def _flatten(state: dict) -> dict:
    """DCP's own flattening (the keys its planner saves under), so the shards' layout names what DCP wrote."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return flatten_state_dict(state)[0]


class _HostCopy:
    """Host buffers, one per tensor of a state dict, allocated at the first copy and reused by every later one."""

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self._buffers: dict[tuple, torch.Tensor] = {}

    def __call__(self, obj, path: tuple = ()):
        if isinstance(obj, DTensor):
            obj = obj.to_local()
        if isinstance(obj, torch.Tensor):
            buffer = self._buffers.get(path)
            if buffer is None or buffer.shape != obj.shape or buffer.dtype != obj.dtype:
                buffer = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=self.pinned and obj.is_cuda)
                self._buffers[path] = buffer
            buffer.copy_(obj.detach(), non_blocking=buffer.is_pinned())
            return buffer
        if isinstance(obj, dict):
            return {key: self(value, (*path, key)) for key, value in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self(value, (*path, i)) for i, value in enumerate(obj))
        return copy.deepcopy(obj)


@dataclasses.dataclass
class _Staged:
    step: int
    sharded: dict  # the shards' host copies, nested as `RunState.sharded_state_dict()`
    layout: dict  # flattened key -> (global size, offsets) of each DTensor's local shard
    own: bytes  # this rank's own parts and the step, serialized as a checkpoint's train_state_rank file
    ready: torch.cuda.Event | None  # recorded after the device-to-host copies


class Snapshots:
    """This rank's copy of the last staged step, and the watcher that writes it under `root` on a stop signal.
    `manifest`: every checkpoint's manifest (rank 0 writes it into the snapshot); `extra_files`: rank 0's more
    files of a checkpoint, by name. Start the watcher with `watch()` from the main thread."""

    def __init__(
        self, root: Path, state: RunState, manifest: dict, extra_files: dict[str, bytes], device: torch.device
    ) -> None:
        self.root, self.state, self.manifest, self.extra_files = root, state, manifest, extra_files
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self._copy = _HostCopy(pinned=device.type == "cuda")
        self._staged: _Staged | None = None
        self._written: int | None = None  # the step this rank last wrote
        self._committed: int | None = None  # the step this rank committed (it completed the count)
        self._lock = threading.Condition()
        self._signalled = False
        self._writing = False
        self._closed = False
        if self.rank == 0:  # a snapshot never completed by an earlier launch (a rank killed before writing it)
            for stale in root.glob(f"step_*{SUFFIX}") if root.is_dir() else ():
                shutil.rmtree(stale, ignore_errors=True)

    def stage(self, step: int) -> None:
        """Copy the state after `step` to the host (a checkpoint's content, without the write)."""
        with self._lock:
            while self._writing:  # the watcher is writing the buffers this copy would overwrite
                self._lock.wait()
            sharded = self.state.sharded_state_dict()
            layout = {
                key: (tuple(value.shape), tuple(value.__create_chunk_list__()[0].offsets))
                for key, value in _flatten(sharded).items()
                if isinstance(value, DTensor)
            }
            copied = self._copy(sharded)
            ready = None
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                ready = torch.cuda.Event()
                ready.record()
            buffer = io.BytesIO()
            torch.save({"step": step, **self.state.state_dict()}, buffer)
            self._staged = _Staged(step, copied, layout, buffer.getvalue(), ready)
            self._lock.notify_all()  # a signalled watcher writes this newer step too

    @property
    def staged_step(self) -> int | None:
        return self._staged.step if self._staged is not None else None

    def watch(self) -> None:
        """From the main thread: write the staged step as soon as a stop signal arrives (`set_wakeup_fd`: the
        signal wakes the watcher even while the main thread is blocked in native code)."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("Snapshots.watch() sets the signal wake-up descriptor: call it from the main thread")
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self._sockets = (reader, writer)  # kept open as long as the process
        interrupts.keep_when_killed("each rank writes the last completed step's snapshot (snapshot_steps)")
        threading.Thread(target=self._wake_on_signal, args=(reader,), name="chattune-snapshot", daemon=True).start()
        threading.Thread(target=self._write_when_signalled, name="chattune-snapshot-writer", daemon=True).start()

    def _wake_on_signal(self, reader: socket.socket) -> None:
        stops = {int(signum) for signum in interrupts.SIGNALS}
        while True:
            received = reader.recv(64)
            if not received:
                return
            if stops.intersection(received) and not errors.peer_reported():
                with self._lock:
                    self._signalled = True
                    self._lock.notify_all()

    def _write_when_signalled(self) -> None:
        while True:
            with self._lock:
                while not (self._signalled and not self._closed and self._newer_than_written()):
                    if self._closed:
                        return
                    self._lock.wait()
                staged, self._writing = self._staged, True
            try:
                self._write(staged)
            except Exception:  # logged: the ordinary stop's checkpoint may still come; the process is ending anyway
                logger.exception("writing the snapshot of step %d failed", staged.step)
            finally:
                with self._lock:
                    self._written, self._writing = staged.step, False
                    self._lock.notify_all()

    def _newer_than_written(self) -> bool:
        return self._staged is not None and self._staged.step != self._written

    def _write(self, staged: _Staged) -> None:
        if staged.ready is not None:
            staged.ready.synchronize()
        directory = self.root / f"step_{staged.step}{SUFFIX}"
        own = directory / f"rank_{self.rank}"
        shutil.rmtree(own, ignore_errors=True)
        own.mkdir(parents=True, exist_ok=True)
        dcp.save(staged.sharded, checkpoint_id=str(own), no_dist=True)
        write_synced(own / _LAYOUT_FILE, _pickled(staged.layout))
        write_synced(rank_state_file(directory, self.rank), staged.own)
        if self.rank == 0:
            for name, data in self.extra_files.items():
                write_synced(directory / name, data)
        write_synced(directory / f"done_rank_{self.rank}", b"")
        logger.info("stop signal: this rank's snapshot of step %d written to %s", staged.step, directory)
        if all((directory / f"done_rank_{rank}").is_file() for rank in range(self.world_size)):
            self._commit(directory, staged.step)

    def _commit(self, directory: Path, step: int) -> None:
        """The last rank to finish: one DCP metadata over every rank's shards, the manifest, the rename."""
        try:
            os.close(os.open(directory / "commit", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:  # another rank finished at the same moment and commits
            return
        ranks = [directory / f"rank_{rank}" for rank in range(self.world_size)]
        write_synced(directory / ".metadata", _pickled(merged_metadata(ranks, directory)))
        manifest = {**self.manifest, "step": step, "written_by": "snapshot"}
        write_synced(directory / MANIFEST_FILE, json.dumps(manifest, indent=1).encode())
        final = self.root / f"step_{step}"
        if final.exists():  # the ordinary save of the same step got there first: that one stays
            shutil.rmtree(directory, ignore_errors=True)
            return
        os.rename(directory, final)
        sync_directory(self.root)
        self._committed = step
        interrupts.say(
            f"chattune: the snapshot of step {step} (the last completed step) is saved as {final}\n", any_rank=True
        )

    def settle(self) -> int | None:
        """Collective, at an ordinary stop: stop writing snapshots once this rank's write in flight is done, and
        return the step whose snapshot every rank wrote (committed), or None."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            while self._writing:
                self._lock.wait()
        written = torch.tensor([float(self._written if self._written is not None else -1)])
        if dist.is_initialized() and self.world_size > 1:
            low, high = written.clone(), written.clone()
            dist.all_reduce(low, op=dist.ReduceOp.MIN)
            dist.all_reduce(high, op=dist.ReduceOp.MAX)
            if low.item() != high.item():
                return None
        step = int(written.item())
        return step if step >= 0 and (self.root / f"step_{step}" / MANIFEST_FILE).is_file() else None


def advise(step_seconds: float, snapshots_on: bool) -> bool:
    """Once, under plain torchrun without snapshots, where a step takes more than half torchrun's grace: say
    that a stop signal would then lose the steps since the last checkpoint, and the two remedies. Whether it
    said so."""
    grace = interrupts.torchrun_grace_s() if interrupts.under_plain_torchrun() else None
    if snapshots_on or grace is None or step_seconds <= grace / 2:
        return False
    logger.warning(
        "a step takes %.0f s and torchrun kills its workers %d s after passing a stop signal on: a preemption "
        "would lose the steps since the last checkpoint. Launch with `chattune run` (a stop is never cut short), "
        "or set snapshot_steps=true (each step's state kept in host memory, written when the step in flight "
        "cannot finish)",
        step_seconds,
        grace,
    )
    return True


def _pickled(obj) -> bytes:
    return pickle.dumps(obj)


def _rank_metadata(directory: Path) -> Metadata:
    for name in _METADATA_NAMES:
        if (directory / name).is_file():
            with open(directory / name, "rb") as f:
                return pickle.load(f)
    raise FileNotFoundError(f"{directory}: no DCP metadata ({' or '.join(_METADATA_NAMES)})")


def merged_metadata(rank_directories: list[Path], checkpoint: Path) -> Metadata:
    """One DCP metadata for the checkpoint directory `checkpoint` from single-process saves of each rank's own
    shards (in `rank_directories`, with their layout files): each shard at its global offset in a tensor of its
    global size; a tensor every rank holds whole (an optimizer's step count) and non-tensor entries from the
    first rank that has them."""
    entries: dict = {}
    storage: dict = {}
    merged: Metadata | None = None
    for directory in rank_directories:
        metadata = _rank_metadata(directory)
        layout = pickle.loads((directory / _LAYOUT_FILE).read_bytes())
        prefix = directory.relative_to(checkpoint).as_posix() + "/"
        merged = merged or metadata
        by_key: dict[str, list] = {}
        for index, info in metadata.storage_data.items():
            by_key.setdefault(index.fqn, []).append((index, info))
        for key, item in metadata.state_dict_metadata.items():
            moved = [
                (index, dataclasses.replace(info, relative_path=prefix + info.relative_path))
                for index, info in by_key.get(key, [])
            ]
            if isinstance(item, TensorStorageMetadata) and key in layout:
                size, offsets = layout[key]
                entry = entries.setdefault(key, TensorStorageMetadata(item.properties, torch.Size(size), []))
                (chunk,) = item.chunks
                if chunk.sizes.numel() == 0 or any(tuple(c.offsets) == tuple(offsets) for c in entry.chunks):
                    continue  # an empty shard (fewer rows than ranks), or one another rank holds too (replicated)
                entry.chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=chunk.sizes))
                ((_, info),) = moved
                storage[MetadataIndex(key, torch.Size(offsets))] = info
            elif key not in entries:
                entries[key] = item
                storage.update(dict(moved))
    assert merged is not None, "no rank directories"
    return Metadata(
        state_dict_metadata=entries,
        planner_data=merged.planner_data,
        storage_data=storage,
        storage_meta=None,
    )
