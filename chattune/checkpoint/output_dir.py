"""An output directory belongs to one run at a time, and a launch never damages what another left there.

- **A lock** (`.chattune.lock`): rank 0 holds an exclusive `flock` on it for the run's whole life and
  writes its pid, host, start time and command into it; a run that ends removes it. A second run into the same directory is
  refused with those facts while the first is alive (even when only its workers survived a killed
  launcher). The kernel drops an flock with the process that held it, so a lock left by a dead run
  (kill -9, a lost node) is free again: no stale lock ever blocks a relaunch.
- **What a launch continues** (`resume`): `auto`, the newest complete checkpoint; a path, that one;
  `null`, nothing. `overwrite=true` starts over whatever `resume` says (and refuses a `resume=PATH` next
  to it: the two ask for opposite things). A directory that holds an earlier run's results
  (checkpoints, metrics.jsonl, samples.jsonl, hf/, adapter/) is started over only with `overwrite=true`,
  or with resume=auto by the same run relaunched before it committed any checkpoint (a stop that saved
  nothing, a requeued job: its config.yaml is this launch's config, and it exported nothing), said so.
- **A complete run relaunched changes nothing**: a run that reached its end writes `complete.json` (its step,
  fingerprint, export settings and exports); the same run launched again with resume=auto says it is
  complete and ends with status 0 (`NothingToDo`), touching nothing. Another horizon continues it as a resume.
- **Nothing of another trajectory is deleted or resumed by accident**: the checkpoints newer than the
  one a run continues from, and everything an overwritten run left (its config.yaml and complete.json too),
  are moved aside as `*.abandoned`
  (never picked up by resume=auto, never pruned by keep_last_n; delete them when you no longer need them).
  The metrics and sample lines after the step a run continues from are kept in a copy, `metrics.jsonl.abandoned`
  (`samples.jsonl.abandoned`);
  an export that a later one replaces is set aside the same way (`chattune.model.io.export`).

`claim_output_dir` does all of it before anything is loaded or written, so a refused launch costs seconds.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from chattune.checkpoint.checkpoint import damage, find_latest, read_manifest
from chattune.checkpoint.layout import committed_checkpoints
from chattune.checkpoint.resume import (
    AcceptedChanges,
    ResumeError,
    check_resumable,
    differences,
    run_fingerprint,
    run_identity,
    trajectory_keys,
)
from chattune.checkpoint.snapshot import complete_snapshots
from chattune.config.paths import save_resolved_config
from chattune.config.schema import RunConfig
from chattune.config.typed import config_dict
from chattune.distributed import ParallelDims, broadcast_from_main
from chattune.errors import NothingToDo, UserError
from chattune.files import ABANDONED, aside_name, set_aside, write_atomically

logger = logging.getLogger(__name__)

LOCK_FILE = ".chattune.lock"
STEP_LOGS = ("metrics.jsonl", "samples.jsonl")  # one line per logged step (`chattune.train.metrics.start_step_log`)
EXPORTS = ("hf", "adapter")  # what the end of a run writes (`chattune.model.io.export.export_run`)
RESULTS = ("checkpoints", *STEP_LOGS, *EXPORTS, "ledger")  # what a run leaves
CONFIG_FILE = "config.yaml"  # the resolved config, written at every start
COMPLETE_FILE = "complete.json"  # written at the end of a run that reached it (`write_completion`)
RECORDS = (CONFIG_FILE, COMPLETE_FILE)  # what says which run left the results: set aside with them
_LISTED_DIFFERENCES = 5  # config differences named in a refusal


class OutputDirInUse(UserError):
    """Another live run holds the directory, or it holds an earlier run's results this launch would overwrite."""


class OutputDirLock:
    """An exclusive flock on `directory/.chattune.lock`, held until the run ends (or its process dies). A run
    that ends removes the file while still holding the lock, and a claimant keeps a lock only on the file
    still at the path, so a removal never lets two runs in; who holds it is the flock's, not the file's, say."""

    def __init__(self, directory: Path):
        self.path = Path(directory) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        while True:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as error:  # read-only, no permission, a file in the way: the user's to fix
                raise OutputDirInUse(
                    f"output_dir {self.path.parent}: cannot create its lock file ({error.strerror}): "
                    "choose a directory this run can write"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise OutputDirInUse(
                    f"output_dir {self.path.parent} is in use by another run: "
                    f"{describe_holder(self.holder())}. Wait for it to finish or stop it, or choose "
                    "another output_dir."
                ) from None
            # A run that ended cleanly removes the file while it holds the lock: if it did so between our open
            # and our flock, we hold a file no one else will open. Only the file at the path counts.
            if self.path.exists() and os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                break
            os.close(fd)
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join(sys.argv),
        }
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(holder).encode())
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        """Remove the lock file while still holding it, then let go (a run that ended leaves no lock behind)."""
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self._fd)
        self._fd = None

    def holder(self) -> dict:
        """What the lock file says of its holder ({} if unreadable)."""
        try:
            return json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return {}

    def is_held(self) -> bool:
        """Whether a live process holds the lock (checked by trying to take it for an instant)."""
        if not self.path.is_file():
            return False
        fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # also drops the lock if we got it
        return False


def describe_holder(holder: dict) -> str:
    if not holder:
        return "a process whose lock file is unreadable"
    return (
        f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}: "
        f"{holder.get('command', '?')}"
    )


def previous_results(output_dir: Path) -> list[str]:
    """What an earlier run left in `output_dir` that a new start would overwrite or mix with."""
    found = []
    for name in RESULTS:
        path = output_dir / name
        if path.is_file() and path.stat().st_size > 0 or path.is_dir() and any(path.iterdir()):
            found.append(name)
    return found


@dataclass
class StartingPoint:
    """What a launch continues: nothing (a fresh start) or a checkpoint, and what the resume accepted."""

    resume_from: Path | None = None
    accepted: AcceptedChanges = field(default_factory=AcceptedChanges)  # logged and applied when the state is loaded
    identity: dict = field(default_factory=dict)  # this run's world size and fingerprint (`run_identity`)
    checkpoint_manifest: dict = field(default_factory=dict)  # the resumed checkpoint's (e.g. its wandb run id)


@dataclass
class LaunchDecision:
    """What a launch will do with `output_dir`, decided before anything is touched."""

    start: StartingPoint
    move_aside: list[Path] = field(default_factory=list)  # renamed *.abandoned
    copy_aside: list[Path] = field(default_factory=list)  # copied *.abandoned (an abandoned trajectory's full curve)
    notes: list[str] = field(default_factory=list)  # what the launch tells (a run started again)
    complete: str | None = None  # the run is complete and the launch has nothing to do: what to say


def decide_launch(cfg: RunConfig, identity: dict) -> LaunchDecision:
    """What this launch continues and what it moves aside (`identity`: this run's `run_identity`), without touching
    anything; a UserError for a launch that must not resume what it asks for, or would overwrite an earlier run
    without overwrite=true."""
    output_dir = Path(cfg.output_dir)
    checkpoints = output_dir / "checkpoints"
    if cfg.overwrite and cfg.resume not in (None, "auto"):
        raise OutputDirInUse(
            f"overwrite=true starts over, and resume={cfg.resume} continues that checkpoint: give one of the two"
        )
    if cfg.resume is None or cfg.overwrite:  # overwrite=true: a fresh start, whatever resume=auto would find
        source = None
    elif cfg.resume == "auto":
        source = find_latest(checkpoints)
        if (complete := completion(cfg, identity, source)) is not None:
            return LaunchDecision(StartingPoint(identity=identity), complete=complete)
    else:
        source = Path(cfg.resume)
        if not source.exists():
            raise ResumeError(
                f"resume={cfg.resume}: {source} does not exist. Give a checkpoint directory (OUTPUT_DIR/checkpoints/"
                "step_N), or resume=auto for the newest checkpoint of output_dir"
            )
        try:
            read_manifest(source)
        except (OSError, ValueError) as error:
            raise ResumeError(f"resume={cfg.resume}: {error}") from error
    saved = read_manifest(source) if source is not None else {}
    if source is not None and (damaged := damage(source)):
        raise ResumeError(
            f"the checkpoint {source} is damaged: {'; '.join(damaged)}. {_intact_before(source, saved['step'])}"
        )
    accepted = check_resumable(source, identity, cfg) if source is not None else AcceptedChanges()
    decision = LaunchDecision(StartingPoint(source, accepted, identity, saved))
    previous = previous_results(output_dir)
    records = [output_dir / name for name in RECORDS if (output_dir / name).is_file()]
    if source is not None and source.resolve().parent == checkpoints.resolve():
        # Continuing from an older checkpoint of this directory abandons what came after it: its later
        # checkpoints (which resume=auto and keep_last_n would otherwise prefer) and its final export.
        decision.move_aside = [
            c for c in committed_checkpoints(checkpoints) if read_manifest(c)["step"] > saved["step"]
        ]
        if decision.move_aside:
            decision.move_aside += [
                output_dir / name for name in (*EXPORTS, COMPLETE_FILE) if (output_dir / name).exists()
            ]
        # kept up to `step`: the rest in a copy
        decision.copy_aside = [
            output_dir / name for name in STEP_LOGS if logged_after(output_dir / name, saved["step"])
        ]
    elif previous or cfg.overwrite and records:  # a fresh start, or another directory's checkpoint, in a used directory
        if cfg.resume == "auto" and source is None and not cfg.overwrite:
            refusal = _restart_refusal(cfg, previous)
            if refusal is not None:
                raise OutputDirInUse(
                    f"output_dir {output_dir} holds an earlier run's results ({', '.join(previous)}) and no checkpoint "
                    f"to continue from (resume=auto), and {refusal}: start over here with overwrite=true (its files "
                    f"are moved aside as *{ABANDONED}, not deleted), or choose another output_dir."
                )
            decision.notes.append(
                f"output_dir {output_dir}: this run's earlier launch (the same config) committed no checkpoint: "
                f"starting it again from step 0, its files ({', '.join(previous)}) moved aside as *{ABANDONED}"
            )
        elif not cfg.overwrite:
            what = (
                "nothing to continue from"
                if source is None
                else f"a checkpoint of another directory to continue ({source})"
            )
            latest = find_latest(checkpoints)
            resume = (
                f"Continue that run with resume=auto (its newest checkpoint, {latest}) or resume=PATH to one of its "
                "checkpoints; "
                if latest is not None
                else ""
            )
            raise OutputDirInUse(
                f"output_dir {output_dir} holds an earlier run's results ({', '.join(previous)}), and this launch has "
                f"{what} (resume={cfg.resume}). {resume}start over here with overwrite=true (its files are moved aside "
                f"as *{ABANDONED}, not deleted); or choose another output_dir."
            )
        decision.move_aside = [output_dir / name for name in previous] + records
    return decision


def _restart_refusal(cfg: RunConfig, previous: list[str]) -> str | None:
    """Why a launch with resume=auto must not start again the earlier run whose `previous` results, and no
    checkpoint, are in output_dir (None: it may). Only the same run may be started again: its config.yaml is this
    launch's config (its free keys aside: logging, saving, evaluating), and it had not ended (no export)."""
    saved = Path(cfg.output_dir) / CONFIG_FILE
    if not saved.is_file():
        return f"no {CONFIG_FILE} says which run left them"
    try:
        earlier = trajectory_keys(yaml.safe_load(saved.read_text()) or {})
    except (OSError, yaml.YAMLError) as error:
        return f"its {CONFIG_FILE} cannot be read to tell whether it is this run ({type(error).__name__})"
    now = trajectory_keys(yaml.safe_load(OmegaConf.to_yaml(config_dict(cfg))))  # as config.yaml writes it
    changed = [d.text for d in differences({"config": earlier}, {"config": now})]
    if changed:
        more = f"; and {len(changed) - _LISTED_DIFFERENCES} more" if len(changed) > _LISTED_DIFFERENCES else ""
        return f"that run's {CONFIG_FILE} is another config ({'; '.join(changed[:_LISTED_DIFFERENCES])}{more})"
    if exported := [name for name in EXPORTS if name in previous]:
        return f"that run ended: its export ({', '.join(exported)}) is there"
    return None


def completion(cfg: RunConfig, identity: dict, latest: Path | None) -> str | None:
    """What to say when output_dir holds this very run, complete (its `complete.json` has this launch's fingerprint
    and export settings, its exports are there, no checkpoint is newer than its end): a relaunch has nothing to
    do. None otherwise. `latest`: the newest committed checkpoint of output_dir."""
    output_dir = Path(cfg.output_dir)
    try:
        record = json.loads((output_dir / COMPLETE_FILE).read_text())
    except (OSError, ValueError):
        return None
    exports = [output_dir / name for name in record.get("exports", [])]
    if (
        differences(record.get("fingerprint", {}), identity["fingerprint"])
        or record.get("export") != config_dict(getattr(cfg, "export", None))
        or not exports
        or not all(path.is_dir() for path in exports)
        or latest is not None
        and read_manifest(latest)["step"] > record["step"]
    ):
        return None
    horizon = "data.num_epochs" if cfg.data.num_epochs is not None and record["step"] < cfg.max_steps else "max_steps"
    further = (
        f"To train further raise {horizon} (the run continues from {latest}); to train it again, start over with "
        if latest is not None
        else "To train it again, start over with "
    )
    return (
        f"output_dir {output_dir} holds this run, complete: trained to step {record['step']} and exported to "
        f"{', '.join(map(str, exports))}. Nothing to do. {further}overwrite=true (its files are moved aside as "
        f"*{ABANDONED}, not deleted)."
    )


def write_completion(cfg: RunConfig, manifest: dict, step: int, exports: list[str]) -> None:
    """Rank 0, at the end of a run: `complete.json`, what says that the run in output_dir reached its end
    (`completion`): its last step, its identity (`manifest`: world size and fingerprint), its export settings
    and the exports written. One an earlier trajectory left is set aside first."""
    path = Path(cfg.output_dir) / COMPLETE_FILE
    if path.exists():
        set_aside(path)
    record = {
        "step": step,
        "exports": exports,
        "export": config_dict(getattr(cfg, "export", None)),
        "world_size": manifest.get("world_size"),
        "fingerprint": manifest.get("fingerprint", {}),
    }
    write_atomically(path, json.dumps(record, indent=1).encode())


def _intact_before(source: Path, step: int) -> str:
    """The remedy for a damaged checkpoint: the newest intact one before it, or starting over."""
    for candidate in reversed(committed_checkpoints(source.parent)):
        if read_manifest(candidate)["step"] < step and not damage(candidate):
            return (
                f"The newest intact checkpoint before it is {candidate} (step {read_manifest(candidate)['step']}): "
                f"continue from there with resume={candidate}"
            )
    return "No intact checkpoint comes before it: start over with overwrite=true (it is set aside), or choose another output_dir"


def logged_after(metrics: Path, step: int) -> bool:
    """Whether `metrics` (a metrics.jsonl or samples.jsonl) holds a line of a step after `step`."""
    if not metrics.is_file():
        return False
    with metrics.open() as lines:
        return any(line.strip() and json.loads(line).get("step", 0) > step for line in lines)


def set_aside_abandoned(decision: LaunchDecision) -> list[str]:
    """Move and copy aside what the decision abandons; the moves as "old -> new" lines."""
    moved = [f"{path} -> {set_aside(path)}" for path in decision.move_aside]
    for path in decision.copy_aside:
        copy = aside_name(path)
        shutil.copy2(path, copy)
        moved.append(f"{path} copied to {copy}")
    return moved


_lock: OutputDirLock | None = None  # this process's lock, held until it exits


def claim_output_dir(cfg: RunConfig, dims: ParallelDims) -> StartingPoint:
    """Collective, before anything is loaded or written: rank 0 locks `output_dir`, decides what the
    launch continues (refusing what it must not), moves aside what another trajectory left and writes
    config.yaml. Every rank gets the same decision, or raises the same error (`NothingToDo` for a complete
    run relaunched: nothing touched)."""
    global _lock
    outcome: StartingPoint | UserError | NothingToDo | None = None
    if dims.is_main:
        output_dir = Path(cfg.output_dir)
        created = not output_dir.exists()
        try:
            lock = OutputDirLock(output_dir)
            lock.acquire()
            _lock = lock
            for line in complete_snapshots(output_dir / "checkpoints"):  # a stop's snapshot, cut short by a kill
                logger.warning("snapshot: %s", line)
            decision = decide_launch(cfg, run_identity(dims.world_size, run_fingerprint(cfg)))
            if decision.complete is not None:  # touched nothing, and will not
                outcome = NothingToDo(decision.complete)
                release_output_dir()
            else:
                for line in decision.notes:
                    logger.warning("%s", line)
                for line in set_aside_abandoned(decision):
                    logger.warning("moved aside: %s", line)
                outcome = decision.start
                save_resolved_config(cfg, output_dir)
        except UserError as error:
            outcome = error
            release_output_dir()
            if created and output_dir.is_dir() and not any(output_dir.iterdir()):
                output_dir.rmdir()  # a refused launch leaves no empty directory behind
    outcome = broadcast_from_main(outcome)
    if isinstance(outcome, (UserError, NothingToDo)):
        raise outcome
    return outcome


def release_output_dir() -> None:
    """Let go of this process's output directory (its lock file removed): at the end of a run, or of each
    job of a multirun sweep, which claims its own directory next."""
    global _lock
    if _lock is not None:
        _lock.release()
        _lock = None
