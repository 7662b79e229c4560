"""The last completed step kept in host memory, written without collectives when a stop cannot finish the step
in flight: plain torchrun SIGKILLs its workers 30 s (its --shutdown-timeout) after passing a signal on, and a
step longer than that would otherwise lose everything since the last checkpoint (`checkpoint_snapshots`).

The design, and why:
- After every step that saves no checkpoint, each rank copies its part of the run state into host buffers
  allocated once (`Snapshots.stage`): its shards of the model and the optimizer (the local tensors of their
  DTensors; on CUDA pinned buffers and non-blocking copies on a stream of their own, queued after the step's
  kernels: the next step's forward and backward overlap them, and only its optimizer step, which overwrites
  what they read, waits for their event) and its own parts serialized (schedule, data position, random generators,
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
  checkpoint that resumes, reshards to another number of ranks and exports as any other. If the committing rank
  is killed before the rename, the next launch commits the snapshot before it decides what to resume
  (`complete_snapshots`); a rank killed before its marker leaves a `.snapshot` directory that is never resumed
  from (the next launch removes it).
- A step in flight that finishes within the grace is saved by the ordinary stop (`loop.stop`), which first
  waits for this rank's snapshot write: the snapshot is what is left when the SIGKILL comes first.

Cost, per step: a copy of the rank's shards of the weights and the optimizer's states (on the host: about
3x the trained parameters' fp32 bytes, divided by the ranks), measured by scripts/bench/bench_snapshots.py.
Alternatives left out: an asynchronous DCP save every step (collective, so a rank killed mid-step takes the
others' write with it, and DCP's planning costs a collective per step); writing on the signal from the live
state (the optimizer may be half-way through changing it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import shutil
import signal
import socket
import threading
import warnings
from collections.abc import Callable
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
from chattune.checkpoint.layout import MANIFEST_FILE, commit, rank_state_file, serialize, write_synced
from chattune.checkpoint.run_state import RunState
from chattune.checkpoint.staging import HostBuffers

logger = logging.getLogger(__name__)
# DCP's single-process save (each rank's own snapshot, on purpose) warns that it assumes a single process
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)

SUFFIX = ".snapshot"
_LAYOUT_FILE = "shards.pt"  # a rank's {flattened key: (global size, offsets)} of the shards it wrote
_RANK0_MANIFEST = "manifest_rank0.json"  # rank 0's manifest, renamed to the checkpoint's at the commit
_METADATA_NAMES = (".metadata", "__0.metadata")  # a single-process DCP save's metadata, by torch version


def _flatten(state: dict) -> dict:
    """DCP's own flattening (the keys its planner saves under), so the shards' layout names what DCP wrote."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return flatten_state_dict(state)[0]


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
        self,
        root: Path,
        state: RunState,
        manifest: dict,
        extra_files: dict[str, bytes],
        device: torch.device,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        self.root, self.manifest, self.extra_files = root, manifest, extra_files
        self.state: RunState | None = state  # (None once closed)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.device = device
        self._copy = HostBuffers(pinned=device.type == "cuda")
        # On CUDA the copies run on a stream of their own; `optimizer`'s next step waits for them (a pre-hook: the
        # step in the backward's per-parameter steps too), since it overwrites the shards and states they read.
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._copies_pending: torch.cuda.Event | None = None
        self._hook = optimizer.register_step_pre_hook(self._wait_for_copies) if optimizer is not None else None
        # settle()'s all-reduce is on the host (an nccl group takes no CPU tensors); collective to create
        self._group = dist.new_group(backend="gloo") if dist.is_initialized() and self.world_size > 1 else None
        self._sockets: tuple[socket.socket, socket.socket] | None = None
        self._previous_wakeup_fd = -1
        self._staged: _Staged | None = None
        self._written: int | None = None  # the step this rank last wrote
        self._committed: int | None = None  # the step this rank committed (it completed the count)
        self._lock = threading.Condition()
        self._signalled = False
        self._writing = False
        self._closed = False

    def stage(self, step: int) -> None:
        """Copy the state after `step` to the host (a checkpoint's content, without the write)."""
        with self._lock:
            while self._writing:  # the watcher is writing the buffers this copy would overwrite
                self._lock.wait()
            state = self.state
            if state is None:
                raise RuntimeError("snapshot_steps: stage() after close()")
            sharded = state.sharded_state_dict()
            layout = {
                key: (tuple(value.shape), tuple(value.__create_chunk_list__()[0].offsets))
                for key, value in _flatten(sharded).items()
                if isinstance(value, DTensor)
            }
            ready = None
            if self._stream is None:
                copied = self._copy(sharded)
            else:  # queued after the step's kernels, beside the next step's: the writer and the update wait for them
                self._stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self._stream):
                    copied = self._copy(sharded, self._stream)
                    ready = torch.cuda.Event()
                    ready.record(self._stream)
                self._copies_pending = ready
            own = serialize({"step": step, **state.state_dict()})
            self._staged = _Staged(step, copied, layout, own, ready)
            self._lock.notify_all()  # a signalled watcher writes this newer step too

    def _wait_for_copies(self, *_) -> None:
        """Before an optimizer step: the update's kernels wait for the staged copies of what they overwrite."""
        if self._copies_pending is not None:
            torch.cuda.current_stream(self.device).wait_event(self._copies_pending)
            self._copies_pending = None

    def forget(self) -> None:
        """Drop the staged step (its checkpoint was just saved): a signal now has nothing older to write."""
        with self._lock:
            while self._writing:
                self._lock.wait()
            self._staged = None

    def watch(self) -> None:
        """From the main thread: write the staged step as soon as a stop signal arrives (`set_wakeup_fd`: the
        signal wakes the watcher even while the main thread is blocked in native code)."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("Snapshots.watch() sets the signal wake-up descriptor: call it from the main thread")
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        self._previous_wakeup_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self._sockets = (reader, writer)  # open until close()
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
        if self.device.type == "cuda":  # a new thread's CUDA calls go to device 0 unless told otherwise
            torch.cuda.set_device(self.device)
        while True:
            with self._lock:
                while not (self._signalled and not self._closed and self._newer_than_written()):
                    if self._closed:
                        return
                    self._lock.wait()
                staged, self._writing = self._staged, True
            assert staged is not None  # (a step newer than the written one is staged)
            try:
                self._write(staged)
            except Exception:  # logged: the ordinary stop's checkpoint may still come; the process is ending anyway
                logger.exception("writing the snapshot of step %d failed", staged.step)
            finally:
                with self._lock:
                    self._written, self._writing = staged.step, False
                    self._lock.notify_all()

    @property
    def written_step(self) -> int | None:
        """The step this rank's watcher last wrote (None: none yet)."""
        return self._written

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
        write_synced(own / _LAYOUT_FILE, pickle.dumps(staged.layout))
        write_synced(rank_state_file(directory, self.rank), staged.own)
        if self.rank == 0:  # (rank 0's manifest: the others have no wandb run id)
            for name, data in self.extra_files.items():
                write_synced(directory / name, data)
            manifest = {**self.manifest, "step": staged.step, "written_by": "snapshot"}
            write_synced(directory / _RANK0_MANIFEST, json.dumps(manifest, indent=1).encode())
        write_synced(directory / f"done_rank_{self.rank}", str(self.world_size).encode())  # (the ranks to wait for)
        logger.info("stop signal: this rank's snapshot of step %d written to %s", staged.step, directory)
        if all((directory / f"done_rank_{rank}").is_file() for rank in range(self.world_size)):
            self._commit(directory, staged.step)

    def _commit(self, directory: Path, step: int) -> None:
        """The last rank to finish: one DCP metadata over every rank's shards, the manifest, the rename."""
        try:
            os.close(os.open(directory / "commit", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:  # another rank finished at the same moment and commits
            return
        final = _commit_directory(directory, self.world_size)
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
        written = -1.0 if self._written is None else float(self._written)
        committed = -1.0 if self._committed is None else float(self._committed)
        # the highest and lowest step written, and the step committed (by the one rank that did): every rank decides alike
        agreed = torch.tensor([written, -written, committed], dtype=torch.float64)
        if self._group is not None:
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self._group)
        highest, lowest, committed = agreed[0].item(), -agreed[1].item(), agreed[2].item()
        return int(committed) if highest == lowest == committed >= 0 else None

    def close(self) -> None:
        """From the main thread, after `settle`: the signal wake-up descriptor as it was, the watcher threads
        ended, the host copies released (a sweep's next job in this process starts clean)."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if self._sockets is not None:
            signal.set_wakeup_fd(self._previous_wakeup_fd)
            for end in self._sockets:  # the reader's recv returns b"": its thread ends
                end.close()
            self._sockets = None
        interrupts.keep_when_killed(None)
        if self._hook is not None:
            self._hook.remove()
        if self._stream is not None:  # the copies done before their buffers are unregistered
            self._stream.synchronize()
        self._copy.release()
        self._staged, self.state = None, None


class SnapshotsWhenSlow:
    """`snapshot_steps=auto` under plain torchrun: no snapshots while the steps are short, and from the first step
    that took more than half of torchrun's `grace` on any rank, snapshots for the rest of the run (`start` makes them
    and watches for the signal). The ranks agree in a one-number all-reduce on a gloo group (on the host: no device
    sync) of the longest step since they last did: after each of the first `CHECKED_EVERY` steps (a run whose steps
    are long from the start has them from step 1), then every `CHECKED_EVERY` steps (the all-reduce costs about
    0.5 ms on 2 CPU ranks, BENCHMARKS.md: a tenth of it a step)."""

    CHECKED_EVERY = 10

    def __init__(self, grace: int, start: Callable[[], Snapshots]) -> None:
        self.grace, self._start = grace, start
        self._group = None  # the host's all-reduce: the run's own group where it is gloo's (the CPU), else one made
        if dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        self._longest = 0.0  # this rank's longest step since the last check

    def after_step(self, step: int, step_seconds: float) -> Snapshots | None:
        """Collective: the snapshots, started now, where a step up to `step` (this rank's: `step_seconds`) was long
        on any rank."""
        self._longest = max(self._longest, step_seconds)
        if step > self.CHECKED_EVERY and step % self.CHECKED_EVERY:
            return None
        slowest = torch.tensor([self._longest], dtype=torch.float64)
        self._longest = 0.0
        if self._group is not None:
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=self._group)
        if slowest.item() <= self.grace / 2:
            return None
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.info(
                "snapshot_steps=auto: a step took %.0f s (by step %d), more than half of the %d s torchrun waits "
                "after a stop signal before it kills the workers: from now on each step's state is kept in host "
                "memory, and a stop that cannot finish its step writes the step before it (snapshot_steps=false: "
                "never)",
                slowest.item(),
                step,
                self.grace,
            )
        return self._start()


def killing_grace_s(snapshots_on: bool) -> int | None:
    """The grace after which a launcher kills a stopping run that has no snapshot to write: plain torchrun's;
    None under `chattune run`, one process, or with snapshots."""
    return interrupts.torchrun_grace_s() if interrupts.under_plain_torchrun() and not snapshots_on else None


def advise(step_seconds: float, grace: int | None) -> bool:
    """Where a step takes more than half of `grace` (`killing_grace_s`): say that a stop signal would then lose
    the steps since the last checkpoint, and the two remedies. Whether it said so."""
    if grace is None or step_seconds <= grace / 2:
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


def _commit_directory(directory: Path, world_size: int) -> Path:
    """One DCP metadata over every rank's shards, rank 0's manifest as the checkpoint's, the rename to
    `step_N`; an earlier run's `step_N` (a resume from an older checkpoint) is moved aside, never replaced."""
    ranks = [directory / f"rank_{rank}" for rank in range(world_size)]
    write_synced(directory / ".metadata", pickle.dumps(merged_metadata(ranks, directory)))
    if (directory / _RANK0_MANIFEST).exists():  # (renamed already by a commit cut short)
        os.rename(directory / _RANK0_MANIFEST, directory / MANIFEST_FILE)  # the checkpoint counts once renamed
    final = directory.with_name(directory.name.removesuffix(SUFFIX))
    commit(directory, final, keep_last_n=None)
    return final


def complete_snapshots(root: Path) -> list[str]:
    """Before a launch decides what it resumes (rank 0, holding the output directory): commit each snapshot
    that every rank wrote but whose committing rank was killed before the rename, and remove each one a rank
    never finished (it can never be resumed). What was done, a line each."""
    done = []
    for directory in sorted(root.glob(f"step_*{SUFFIX}")) if root.is_dir() else []:
        markers = {p.name: p.read_text() for p in directory.glob("done_rank_*")}
        world_size = int(markers.get("done_rank_0") or 0)
        complete = world_size > 0 and all(f"done_rank_{rank}" in markers for rank in range(world_size))
        if complete and ((directory / _RANK0_MANIFEST).exists() or (directory / MANIFEST_FILE).exists()):
            done.append(f"{directory} committed as {_commit_directory(directory, world_size)} (its ranks all wrote it)")
        else:
            shutil.rmtree(directory)
            done.append(f"{directory} removed: a rank never finished writing it")
    return done


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
