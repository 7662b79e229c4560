"""Sharded training checkpoints (torch.distributed.checkpoint), written atomically: the one module that
knows a checkpoint's files.

A checkpoint saves a `RunState` (`chattune.checkpoint.run_state`) by its parts' names. Layout of
`{output_dir}/checkpoints/step_{N}/`:
- DCP shards of the sharded parts, {"model", "optimizer"} (each rank writes its own; loads reshard as DCP allows);
- `train_state_rank{R}.pt`: that rank's own parts by name (scheduler, data position, RNG states, skip
  counters, fp16's loss scale) and the step: what an exact resume needs per rank;
- `chattune.json`, written last: the manifest (step, world size, the run's fingerprint, the wandb run id);
- more files of rank 0's by name (`record_hashes.npz`, `chattune.data.ingest.fingerprint`).

A checkpoint is written under `step_{N}.partial` and renamed to `step_{N}` only once every rank's files
are complete, so a crash during a save leaves a `.partial` directory that is never resumed from (and is
removed by the next save of that step). `find_latest` only considers committed directories.

With `save_async` (`BackgroundSaves`), the state is copied to host memory (a few seconds' pause at most) and DCP
writes it from a thread while training goes on. The copy goes into host buffers allocated at the first save and
reused by every later one (`chattune.checkpoint.staging.ReusedHostStager`: page-locked on CUDA, torchao's quantized
states kept as their codes and scales, on every torch: 2.11 and 2.12's own stager copies one state only), not
into a fresh copy of the whole state per save; the same rename commits it, from that thread, once every rank's
shards and DCP's metadata are on disk. A crash before that leaves the `.partial` directory, as above; at most
one save is in flight (the next one waits for it, and only then overwrites the buffers).

`Checkpointer` is the training loop's: it decides when a checkpoint is due (every `save_every` steps, and
before a stop) and saves the run state with the run's manifest.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from chattune.checkpoint.layout import (
    MANIFEST_FILE,
    barrier,
    commit,
    committed_checkpoints,
    rank_state_file,
    serialize,
    write_synced,
)
from chattune.checkpoint.run_state import Horizon, RunState
from chattune.checkpoint.staging import ReusedHostStager
from chattune.data.ingest.fingerprint import RECORD_HASHES, record_hashes_file
from chattune.distributed import world_rank
from chattune.faults import maybe_crash

if TYPE_CHECKING:
    from chattune.checkpoint.snapshot import Snapshots, SnapshotsWhenSlow

logger = logging.getLogger(__name__)


class BackgroundSaves:
    """Checkpoint writes in a background thread (`dcp.async_save`), each committed by that thread when it is
    complete. Collective to create (a gloo group of its own, so the writer's collectives never interleave
    with training's). Every save stages through one `ReusedHostStager` (page-locked buffers on CUDA)."""

    def __init__(self, device: torch.device | None = None) -> None:
        self._group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chattune-checkpoint")
        self._pending: Future | None = None
        self.stager = ReusedHostStager(pinned=device is not None and device.type == "cuda")

    def start(self, state: dict, directory: Path, commit: Callable[[], None]) -> None:
        """Copy `state` to host memory now; write it to `directory` and then call `commit` in the background."""
        self.wait()  # the buffers are the last save's until it is written
        written = dcp.async_save(
            state, checkpoint_id=str(directory), process_group=self._group, async_stager=self.stager
        )

        def write_then_commit() -> None:
            cast(
                Future, written
            ).result()  # on rank 0 (DCP's coordinator) this returns once every rank's shards are written
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
        self.stager.close()  # its buffers


def save_checkpoint(
    root: Path,
    step: int,
    state: RunState,
    manifest: dict,
    keep_last_n: int | None = None,
    extra_files: dict[str, bytes] | None = None,
    background: BackgroundSaves | None = None,
) -> Path:
    """Collective: write `state` as `root/step_{step}` atomically, with `manifest` (and the step) as its
    chattune.json; then keep only the newest `keep_last_n`. `extra_files` (rank 0's): more files of the
    checkpoint, by name. With `background`, return once the state is copied; the write and the commit
    finish in the background."""
    if background is not None:
        background.wait()  # one save in flight at a time
    final, partial = root / f"step_{step}", root / f"step_{step}.partial"
    if world_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left by a save that crashed
        partial.mkdir(parents=True)
    barrier()  # nobody writes into the directory before it is clean
    if background is None:
        dcp.save(state.sharded_state_dict(), checkpoint_id=str(partial))
    write_synced(rank_state_file(partial, world_rank()), serialize({"step": step, **state.state_dict()}))

    def rank0_files() -> None:
        for name, data in (extra_files or {}).items():
            write_synced(partial / name, data)
        write_synced(partial / MANIFEST_FILE, json.dumps({**manifest, "step": step}, indent=1).encode())

    if background is not None:
        if world_rank() == 0:
            rank0_files()  # the directory only counts once renamed, after every shard is written
        background.start(
            state.sharded_state_dict(),
            partial,
            lambda: commit(partial, final, keep_last_n) if world_rank() == 0 else None,
        )
        maybe_crash("save", step)
        return final
    maybe_crash("save", step)
    barrier()  # every rank's files are complete
    if world_rank() == 0:
        rank0_files()
        commit(partial, final, keep_last_n)
    barrier()
    return final


def find_latest(root: Path) -> Path | None:
    checkpoints = committed_checkpoints(root)
    return checkpoints[-1] if checkpoints else None


def damage(directory: Path) -> list[str]:
    """What is missing or cut short in a committed checkpoint, against its own records: DCP's `.metadata`
    (every shard file and the bytes it must hold) and the manifest (every saving rank's own state).
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
    ranks = read_manifest(directory).get("world_size") or 0
    problems += [
        f"{rank_state_file(directory, rank).name} is missing"
        for rank in range(ranks)
        if not rank_state_file(directory, rank).is_file()
    ]
    return problems


def read_manifest(directory: Path) -> dict:
    """A committed checkpoint's chattune.json: its step, world size, run fingerprint and wandb run id."""
    path = directory / MANIFEST_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a complete chattune checkpoint (no {MANIFEST_FILE})")
    return json.loads(path.read_text())


def load_sharded(directory: Path, state: RunState) -> None:
    """Collective: restore the sharded parts of `state` (model, optimizer) in place; DCP reshards them for
    another number of ranks."""
    sharded = state.sharded_state_dict()
    dcp.load(sharded, checkpoint_id=str(directory))
    state.load_sharded_state_dict(sharded)


def rank_states(directory: Path) -> list[dict]:
    """Every saving rank's own parts of the run state (and the step), by rank."""
    return [
        torch.load(rank_state_file(directory, rank), weights_only=False)
        for rank in range(read_manifest(directory)["world_size"])
    ]


def load_checkpoint(directory: Path, state: RunState) -> int:
    """Collective: restore every part of `state` by name, the sharded ones resharded as needed, this rank's
    own ones from its own file; returns the checkpoint's step."""
    load_sharded(directory, state)
    saved = torch.load(rank_state_file(directory, world_rank()), weights_only=False)
    state.load_state_dict(saved)
    return saved["step"]


class Checkpointer:
    """The run's checkpoints under `root`: due every `every` steps (0: never) and when the run stops after a
    step to be continued (`horizon`); each saves `state` with the run's `manifest` (world size, fingerprint,
    wandb run id) and the record hashes of its training files, in the background with `background`."""

    def __init__(
        self,
        root: Path,
        state: RunState,
        manifest: dict,
        every: int,
        keep_last_n: int | None,
        horizon: Horizon,
        background: BackgroundSaves | None = None,
    ):
        self.root, self.state, self.manifest, self.every = root, state, manifest, every
        self.keep_last_n, self.horizon, self.background = keep_last_n, horizon, background
        self.snapshots: Snapshots | None = (
            None  # a chattune.checkpoint.snapshot.Snapshots with snapshot_steps: every other step staged
        )
        self.when_slow: SnapshotsWhenSlow | None = None  # snapshot_steps=auto: starts them after a long step
        self.last_saved: Path | None = None
        self.last_started = 0.0  # time.perf_counter() at the last save's start

    def due(self, step: int) -> bool:
        return bool(self.every and step % self.every == 0) or self.horizon.stops_after(step)

    def holds(self, step: int) -> bool:
        """Whether this run saved the checkpoint of `step`."""
        return self.last_saved is not None and self.last_saved.name == f"step_{step}"

    def after_step(self, step: int, step_seconds: float = 0.0) -> None:
        """Collective: the checkpoint of `step` where one is due, else (with snapshots) its copy in host memory;
        with `when_slow`, snapshots from the first step that took long (`step_seconds`, this rank's) on any rank."""
        if self.when_slow is not None and (started := self.when_slow.after_step(step, step_seconds)) is not None:
            self.snapshots, self.when_slow = started, None
        if self.due(step):
            self.save(step)
            if self.snapshots is not None:
                self.snapshots.forget()  # a signal in the next step has nothing newer than this checkpoint to write
        elif self.snapshots is not None:
            self.snapshots.stage(step)

    def extra_files(self) -> dict[str, bytes]:
        """Rank 0's more files of a checkpoint, by name (the record hashes of the training files)."""
        hashes = record_hashes_file(self.manifest["fingerprint"]) if world_rank() == 0 else None
        return {RECORD_HASHES: hashes} if hashes else {}

    def settle_snapshots(self, step: int | None) -> None:
        """Collective, at a stop: no snapshot written from now on; the one of `step`, if every rank wrote it,
        counts as this run's checkpoint of `step` (no second save of the same state)."""
        if self.snapshots is None:
            return
        if self.snapshots.settle() == step is not None:
            self.last_saved, self.last_started = self.root / f"step_{step}", time.perf_counter()
        self.snapshots.close()
        self.snapshots = None

    def save(self, step: int) -> Path:
        """Collective: the checkpoint of `step` (copied and left to the background with save_async)."""
        self.last_started = time.perf_counter()
        self.last_saved = save_checkpoint(
            self.root,
            step,
            self.state,
            self.manifest,
            self.keep_last_n,
            extra_files=self.extra_files(),
            background=self.background,
        )
        return self.last_saved

    def close(self) -> None:
        """Wait for the save in flight, if any, to be committed."""
        if self.background is not None:
            self.background.close()
