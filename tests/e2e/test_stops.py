"""A stop never starts a step, ends a run whose last step it interrupts with the export, and survives a log
reader that died with the same Ctrl-C (`chattune.interrupts`, `chattune.streams`). Steps of known length come
from fault injection (`CHATTUNE_SLOW_AT`); the signals reach real processes as a scheduler's or a terminal's
would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_run_safety import SMALL, chats, steps
from test_sft_recipe import read_metrics

import conftest
from chattune.checkpoint.checkpoint import read_manifest
from chattune.streams import ReaderGoneTolerant
from conftest import SMALL_MODEL, free_port

LONG = [*SMALL, "max_steps=40", "save_every=0"]


def _start(command: list[str], tmp_path: Path, slow: str, env_extra: dict | None = None, **popen) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CHATTUNE_SLOW_AT": slow, **(env_extra or {})}
    popen.setdefault("stdout", open(tmp_path / "run.log", "w"))  # noqa: SIM115 (closed with the test's tmp_path)
    popen.setdefault("stderr", subprocess.STDOUT)
    conftest.refuse_a_default_model(command)
    return subprocess.Popen(command, env=env, **popen)


def _until_step_logged(process: subprocess.Popen, out: Path, step: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not ((out / "metrics.jsonl").is_file() and step in steps(out)):
        assert process.poll() is None and time.monotonic() < deadline, "the run ended or stalled before the signal"
        time.sleep(0.1)


def _until_step_started(process: subprocess.Popen, out: Path, step: int, timeout: float = 300) -> None:
    """Until a rank has begun `step` (its microbatches taken: the ledger's line, written before the step trains and
    before CHATTUNE_SLOW_AT's sleep in it). The run must have ledger=true."""
    deadline = time.monotonic() + timeout
    while not any(f'{{"step": {step},' in path.read_text() for path in (out / "ledger").glob("rank*.jsonl")):
        assert process.poll() is None and time.monotonic() < deadline, "the run ended or stalled before the step"
        time.sleep(0.1)


def _checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir()) if (out / "checkpoints").is_dir() else []


def _workers(launcher: int) -> list[int]:
    """The launcher's child processes (torchrun's workers)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == launcher:
            children.append(int(stat.parent.name))
    return children


@pytest.mark.launch
def test_a_signal_during_a_step_stops_after_that_step_not_the_next(tmp_path):
    """Step 3 takes 10 s; SIGTERM once it has begun. The stop used to read the signal only at the next step's start,
    and trained step 4 before saving."""
    out = tmp_path / "run"
    command = [
        sys.executable,
        "recipes/sft.py",
        *SMALL_MODEL,
        f"output_dir={out}",
        f"data.train=[{chats(tmp_path)}]",
        *LONG,
        "ledger=true",
    ]
    process = _start(command, tmp_path, "step:3:10")
    _until_step_started(process, out, 3)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 75, (tmp_path / "run.log").read_text()[-3000:]
    assert steps(out) == [1, 2, 3] and _checkpoints(out) == ["step_3"]


@pytest.mark.launch
def test_a_signal_to_one_rank_after_a_step_stops_every_rank_before_the_next(tmp_path):
    """After step 2's all-reduce (and its metrics line) the ranks spend 10 s, as a long evaluation or save
    would; one rank alone gets SIGTERM then. Both stop before step 3, with step 2's checkpoint: the vote
    before each step, not the step's own all-reduce (which would have trained step 3 first)."""
    out = tmp_path / "run"
    command = conftest.torchrun(
        "recipes/sft.py", *SMALL_MODEL, f"output_dir={out}", f"data.train=[{chats(tmp_path)}]", *LONG
    )
    process = _start(command, tmp_path, "after_step:2:10")  # (real torchrun: the test signals one worker's pid)
    _until_step_logged(process, out, 2)  # (logged after the step's all-reduces: the ranks are past them)
    workers = _workers(process.pid)
    assert len(workers) == 2, workers
    os.kill(workers[-1], signal.SIGTERM)
    process.wait(timeout=120)  # torchrun reports its workers' status 75 as a failure: the files are the verdict
    log = (tmp_path / "run.log").read_text()
    assert steps(out) == [1, 2] and _checkpoints(out) == ["step_2"], log[-3000:]
    assert f"chattune: stopped by a signal (on another rank) after step 2: checkpoint {out}/checkpoints/step_2" in log


@pytest.mark.launch
def test_under_plain_torchrun_a_step_longer_than_its_grace_keeps_the_step_before(tmp_path):
    """Plain torchrun SIGKILLs its workers 3 s (here) after passing SIGTERM on, in the middle of a 60 s step 3.
    snapshot_steps=auto (the default) has turned snapshots on after step 2 took 2 s, more than half that grace:
    each rank writes step 2's state, kept in host memory, without collectives; step 2 is committed as an ordinary
    checkpoint, and the relaunch continues the losses of an uninterrupted run. Without snapshots the same stop
    keeps nothing since the last checkpoint, as its lines say
    (`test_a_stop_that_cannot_save_says_what_is_kept_at_the_signal_and_before_it_ends`)."""
    data, run = f"data.train=[{chats(tmp_path)}]", [*SMALL, "max_steps=4", "save_every=0"]
    out = tmp_path / "run"
    command = conftest.torchrun("recipes/sft.py", *SMALL_MODEL, f"output_dir={out}", data, *run, "ledger=true")
    process = _start(command, tmp_path, "step:2:2,step:3:60", env_extra={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "3"})
    _until_step_started(process, out, 3)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) != 0  # killed by its own launcher: the step never finished
    log = (tmp_path / "run.log").read_text()
    assert _checkpoints(out) == ["step_2"], log[-3000:]
    assert read_manifest(out / "checkpoints" / "step_2")["written_by"] == "snapshot"
    assert f"the snapshot of step 2 (the last completed step) is saved as {out}/checkpoints/step_2" in log
    assert "snapshot_steps=auto: a step took " in log and "from now on each step's state is kept in host memory" in log

    conftest.launch(
        conftest.torchrun("recipes/sft.py", *SMALL_MODEL, f"output_dir={out}", data, *run), real_torchrun=True
    )
    reference = tmp_path / "reference"
    conftest.launch(conftest.torchrun("recipes/sft.py", *SMALL_MODEL, f"output_dir={reference}", data, *run))
    resumed = {m["step"]: m["loss"] for m in read_metrics(out)}
    assert [resumed[step] for step in (3, 4)] == [m["loss"] for m in read_metrics(reference)][2:]


@pytest.mark.launch
def test_a_signal_during_the_last_step_finishes_the_run_with_its_export(tmp_path):
    """Ctrl-C in the last step used to save, exit 75 and skip the export: a relaunch only to export."""
    out = tmp_path / "run"
    command = [
        sys.executable,
        "recipes/sft.py",
        *SMALL_MODEL,
        f"output_dir={out}",
        f"data.train=[{chats(tmp_path)}]",
        *SMALL,
        "max_steps=3",
        "save_every=0",
        "ledger=true",
    ]
    process = _start(command, tmp_path, "step:3:10")
    _until_step_started(process, out, 3)
    process.send_signal(signal.SIGINT)
    log_path = tmp_path / "run.log"
    assert process.wait(timeout=120) == 0, log_path.read_text()[-3000:]
    log = log_path.read_text()
    assert "SIGINT during the last step: the run is complete, exporting" in log
    assert (out / "hf" / "config.json").is_file() and _checkpoints(out) == ["step_3"]
    assert steps(out) == [1, 2, 3]


@pytest.mark.launch
@pytest.mark.parametrize("stderr", ["2>&1", "2>file"])
def test_ctrl_c_with_the_log_piped_to_tee_saves_and_exits_75(tmp_path, stderr):
    """`chattune run ... 2>&1 | tee log`, Ctrl-C: the terminal's SIGINT kills tee as well, and every later write
    to the pipe failed. The signal note raised in the workers' handler and they died: no checkpoint, the lock
    left behind. With `2>file | tee log` the run saved, but each metric line's write to the dead pipe put a
    `--- Logging error ---` stack into the file. Here tee dies first, then the launcher gets its SIGINT."""
    out = tmp_path / "run"
    tee = subprocess.Popen(["tee", str(tmp_path / "tee.log")], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    command = [
        sys.executable,
        "-m",
        "chattune.cli.main",
        "run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        "recipes/sft.py",
        *SMALL_MODEL,
        f"output_dir={out}",
        f"data.train=[{chats(tmp_path)}]",
        *LONG,
    ]
    errors = subprocess.STDOUT if stderr == "2>&1" else open(tmp_path / "stderr.log", "w")  # noqa: SIM115
    process = _start(command, tmp_path, "step:3:10", stdout=tee.stdin, stderr=errors)
    tee.stdin.close()  # the pipe's writers are the launcher and its workers alone
    _until_step_logged(process, out, 2)
    tee.kill()  # (how it dies does not matter; under xdist a child may inherit SIGINT ignored)
    tee.wait(timeout=10)
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=120) == 75
    saved = _checkpoints(out)
    assert len(saved) == 1 and saved[0] in ("step_2", "step_3"), saved
    assert not (out / ".chattune.lock").exists(), "the stopped run left its lock behind"
    assert "Traceback" not in (tmp_path / "tee.log").read_text()
    if stderr == "2>file":
        written = (tmp_path / "stderr.log").read_text()
        assert "Logging error" not in written and "Traceback" not in written, written[-3000:]
        assert "SIGINT: stopping after the current step" in written


def test_a_write_to_a_pipe_nobody_reads_is_dropped_and_later_writes_go_to_dev_null():
    read_end, write_end = os.pipe()
    stream = ReaderGoneTolerant(os.fdopen(write_end, "w", buffering=1))
    stream.write("read\n")
    assert os.read(read_end, 100) == b"read\n"
    os.close(read_end)  # the reader is gone
    stream.write("lost\n")  # would raise BrokenPipeError
    stream.flush()
    assert os.readlink(f"/proc/self/fd/{write_end}") == "/dev/null"
    print("still written", file=stream, flush=True)
    stream.close()


def test_the_stop_line_names_torchruns_own_grace():
    """What the first-signal line under plain torchrun says the workers have: the agent's --shutdown-timeout,
    else its environment's, else torch's 30 s."""
    from chattune.interrupts import torchrun_grace_s

    assert torchrun_grace_s(["torchrun", "--shutdown-timeout", "120", "recipes/sft.py"], {}) == 120
    assert torchrun_grace_s(["torchrun", "--shutdown_timeout=45", "recipes/sft.py"], {}) == 45
    assert torchrun_grace_s(["torchrun", "recipes/sft.py"], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "7"}) == 7
    assert torchrun_grace_s(["torchrun", "recipes/sft.py"], {}) == 30


def test_a_stop_that_cannot_save_says_what_is_kept_at_the_signal_and_before_it_ends(monkeypatch, capfd, tmp_path):
    """Plain torchrun, SIGTERM in a step longer than its grace: the workers used to be killed without a word of what
    was saved. The first line says what a kill would keep; just before torchrun's kill (its grace, here 2 s), and
    when the stop gives up, a line says what is kept and what is not."""
    from chattune import interrupts

    exits = []
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")  # plain torchrun's worker
    monkeypatch.delenv(interrupts.LAUNCHER_DIR_ENV, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(interrupts, "_requested", None)
    monkeypatch.setattr(interrupts, "_stop_over", threading.Event())
    monkeypatch.setattr(interrupts, "STOP_DEADLINE_S", 3.0)
    monkeypatch.setattr(interrupts.os, "_exit", exits.append)
    monkeypatch.setattr(interrupts, "torchrun_grace_s", lambda: 2)  # (this test process has no torchrun parent)
    interrupts.note_checkpoint(None)  # a fresh run, nothing committed yet
    interrupts._handle(signal.SIGTERM, None)
    deadline = time.monotonic() + 30
    while not exits and time.monotonic() < deadline:  # the deadline's exit, a second after the kill's line
        time.sleep(0.05)
    nothing = "no checkpoint was committed, so nothing is kept (the same command starts the run again)"
    assert capfd.readouterr().err.splitlines() == [
        "chattune: SIGTERM: stopping after the current step, with a checkpoint; torchrun kills its workers 2 s after "
        f"passing a signal on (its --shutdown-timeout): if the step in flight and its save are not done by then, "
        f"{nothing}. Launch with `chattune run` instead of torchrun to let a longer step and save finish",
        f"chattune: SIGTERM 2 s ago: torchrun kills the workers now, before the stop has saved: {nothing}",
        f"chattune: SIGTERM: the stop did not finish within 3 s; exiting without saving: {nothing}",
    ]
    assert exits == [128 + signal.SIGTERM]

    checkpoint = tmp_path / "checkpoints" / "step_4"
    interrupts.note_checkpoint(checkpoint)  # committed (`chattune.checkpoint.layout.commit`)
    assert interrupts.kept() == (
        f"the checkpoint {checkpoint} is kept (the same command continues from it), the steps after it are not"
    )
    interrupts.note_checkpoint(None)
