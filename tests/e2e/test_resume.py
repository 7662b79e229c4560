"""Exact resume and crash safety, with real torchrun processes on CPU.

The reference is always an uninterrupted run: a resumed run must reproduce its per-step losses and final
weights bit for bit, and after a SIGKILL (in a step or in a checkpoint write) the document ledger must show
every document trained exactly once per epoch."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from test_sft_recipe import read_metrics

import conftest
from chattune.launch.torchrun import TORCHRUN
from conftest import SMALL_MODEL, exported_weights, free_port
from reference_runs import RESUME_KEYS, reference_data, reference_run

NUM_RECORDS = 60  # reference_runs.DATA["chats-60"]


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> Path:
    """60 demo chats, at one path on every xdist worker: the reference runs' data fingerprints name it."""
    return reference_data(tmp_path_factory, "chats-60")


CHATTUNE_RUN = (sys.executable, "-m", "chattune.cli.main", "run")  # `chattune run`


def launch_command(
    out: Path, data: Path, nproc: int, *overrides: str, launcher: tuple[str, ...] = TORCHRUN
) -> list[str]:
    """The reference resume runs' command (`reference_runs.RESUME_KEYS`: 8 steps over ~3 epochs of the small data,
    a checkpoint every 3) into `out`, reading `data`."""
    keys = [key.replace("{data:chats-60}", str(data)) for key in RESUME_KEYS]
    return [
        *launcher,
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(free_port()),
        "recipes/sft.py",
        *keys,
        f"output_dir={out}",
        *overrides,
    ]


def launch(
    out: Path,
    data: Path,
    nproc: int,
    *overrides: str,
    env: dict | None = None,
    check: bool = True,
    launcher: tuple[str, ...] = TORCHRUN,
):
    return conftest.launch(launch_command(out, data, nproc, *overrides, launcher=launcher), env_extra=env, check=check)


def losses(out: Path) -> list[tuple[int, float]]:
    return [(m["step"], m["loss"]) for m in read_metrics(out)]


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = exported_weights(a / "hf"), exported_weights(b / "hf")
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "final weights differ"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The uninterrupted 8-step run on 1 and on 2 ranks (tests/reference_runs.py: made once, when first asked for):
    the reference of every interrupted one. Loader workers change nothing of it (tests/e2e/test_sft_recipe.py), so one
    run serves them all."""
    return lambda nproc: reference_run(tmp_path_factory, "resume-1-rank" if nproc == 1 else "resume-2-ranks")


@pytest.mark.parametrize(
    "nproc,num_workers,save_async", [(1, 0, False), (2, 0, False), (1, 2, False), (2, 2, False), (2, 0, True)]
)
@pytest.mark.launch
def test_stop_and_resume_reproduces_the_uninterrupted_run(
    tmp_path, small_data, uninterrupted, nproc, num_workers, save_async
):
    """With save_async the checkpoints are written from a thread while the next steps train: what they hold
    must still be the state of their step (DCP copies it before training goes on)."""
    workers = f"data.num_workers={num_workers}"
    straight = uninterrupted(nproc)
    launch(tmp_path / "resumed", small_data, nproc, workers, "stop_after_step=4", f"save_async={save_async}")
    assert [s for s, _ in losses(tmp_path / "resumed")] == [1, 2, 3, 4]
    assert not (tmp_path / "resumed" / "hf").exists()
    assert (tmp_path / "resumed" / "checkpoints" / "step_4" / "chattune.json").is_file()
    launch(tmp_path / "resumed", small_data, nproc, workers, f"save_async={save_async}")  # resume=auto is the default
    assert losses(tmp_path / "resumed") == losses(straight)
    assert_same_weights(tmp_path / "resumed", straight)


def ledger_steps(out: Path) -> dict[str, dict[int, tuple[int, dict[str, list[int]]]]]:
    """Per launch file stem: step -> (epoch, {rank: its doc ids})."""
    launches: dict[str, dict[int, tuple[int, dict[str, list[int]]]]] = {}
    for path in sorted((out / "ledger").glob("rank*.from_step*.jsonl")):
        rank, launch = path.name.split(".", 1)
        steps = launches.setdefault(launch, {})
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            epoch, ids = steps.setdefault(entry["step"], (entry["epoch"], {}))
            assert epoch == entry["epoch"], "ranks disagree on a step's epoch"
            ids[rank] = entry["doc_ids"]
    return launches


@pytest.mark.parametrize(
    "crash,save_async,lora",
    [
        ("step:7:1", False, False),
        ("save:6:1", False, False),
        ("step:7:1", True, False),
        ("save:6:1", True, False),
        ("save:6:1", False, True),
    ],
)
@pytest.mark.launch
def test_sigkill_then_resume_trains_every_document_once_per_epoch(tmp_path, small_data, crash, save_async, lora):
    out = tmp_path / "run"
    extra = ["ledger=true", f"save_async={save_async}", *(["peft=lora", "peft.rank=4"] if lora else [])]
    crashed = launch(out, small_data, 2, *extra, env={"CHATTUNE_CRASH_AT": crash}, check=False)
    assert crashed.returncode != 0, "the injected SIGKILL should have ended the run"
    checkpoints = out / "checkpoints"
    if crash.startswith("save"):  # killed with its files half written: never committed, never resumed from
        assert (checkpoints / "step_6.partial").is_dir() and not (checkpoints / "step_6").exists()
        resume_step = 3
    elif save_async:  # step 6's write may or may not have been complete (and committed) when step 7 was killed
        resume_step = 6 if (checkpoints / "step_6").is_dir() else 3
    else:
        resume_step = 6
    assert sorted(p.name for p in checkpoints.iterdir() if not p.name.endswith(".partial")) == [
        f"step_{s}" for s in (3, 6) if s <= resume_step
    ]

    launch(out, small_data, 2, *extra)
    launches = ledger_steps(out)
    before, after = launches["from_step0.jsonl"], launches[f"from_step{resume_step}.jsonl"]
    assert max(before) > resume_step, "the crash should have lost some trained steps"
    assert sorted(after) == list(range(resume_step + 1, 9))
    # The lost steps are retrained on the same documents, not skipped. (A rank may have logged a step its
    # peer never reached: with save_async, rank 0 goes on into step 7 while the killed rank 1 is gone.)
    for s in (s for s in before if s > resume_step):
        assert after[s][0] == before[s][0] and all(after[s][1][rank] == ids for rank, ids in before[s][1].items())
    per_epoch: dict[int, Counter] = {}
    for steps in ({s: v for s, v in before.items() if s <= resume_step}, after):
        for epoch, ids in steps.values():
            per_epoch.setdefault(epoch, Counter()).update(i for rank_ids in ids.values() for i in rank_ids)
    final_epoch = max(per_epoch)
    for epoch, counts in per_epoch.items():
        assert max(counts.values()) == 1, f"epoch {epoch}: a document trained twice"
        if epoch < final_epoch:
            assert sorted(counts) == list(range(NUM_RECORDS)), f"epoch {epoch}: documents missing"
    assert (checkpoints / "step_6" / "chattune.json").is_file() and not (checkpoints / "step_6.partial").exists()


@pytest.mark.launch
def test_changed_config_data_or_world_size_is_refused_with_what_differs(tmp_path, small_data):
    out, shared = tmp_path / "run", small_data
    small_data = tmp_path / "chats.jsonl"  # a copy of its own: the shared file is other tests' data
    small_data.write_text(shared.read_text())
    launch(out, small_data, 2, "stop_after_step=3")

    changed_lr = launch(out, small_data, 2, "optimizer.lr=1e-3", check=False)
    assert changed_lr.returncode != 0
    assert "config optimizer.lr: 0.003 -> 0.001" in changed_lr.stdout + changed_lr.stderr

    fewer_ranks = launch(out, small_data, 1, check=False)
    assert fewer_ranks.returncode != 0
    assert "was written by 2 rank(s), this run has 1" in fewer_ranks.stdout + fewer_ranks.stderr

    with small_data.open("a") as f:  # the same path, one more record
        f.write(small_data.read_text().splitlines(keepends=True)[0])
    changed_data = launch(out, small_data, 2, check=False)
    assert changed_data.returncode != 0
    assert f"data file {small_data}: 60 -> 61 records" in changed_data.stdout + changed_data.stderr
    allowed = launch(out, small_data, 2, "resume_allow_changes=true")
    # a note of the run, which every rank finds: printed once, by rank 0 (it used to be once per rank)
    assert (allowed.stdout + allowed.stderr).count("resuming despite a change") == 1
    assert f"[rank0] resuming despite a change: data file {small_data}: 60 -> 61 records" in allowed.stdout
    assert read_metrics(out)[-1]["step"] == 8
    # An explicit checkpoint: its metrics lines are kept, later ones retrained and logged again.
    explicit = launch(out, small_data, 2, f"resume={out}/checkpoints/step_3", "resume_allow_changes=true")
    assert f"resumed from {out}/checkpoints/step_3 at step 3" in explicit.stdout + explicit.stderr
    assert [m["step"] for m in read_metrics(out)] == list(range(1, 9))
    assert (out / "checkpoints" / "step_6.abandoned").is_dir()  # the trajectory it abandoned, set aside
    # (resume=null and overwrite=true in a used directory: tests/e2e/test_run_safety.py)


class FakeCuda:
    """torch.cuda's generator functions for a process that sees `visible` devices and runs on `current`:
    each device's generator state is a tensor holding its index; another device's index is an error, as
    on a real machine."""

    def __init__(self, visible: int, current: int):
        self.visible, self.current, self.restored = visible, current, {}

    def install(self, monkeypatch) -> None:
        for name in ("is_available", "is_initialized"):
            monkeypatch.setattr(torch.cuda, name, lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.visible)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": torch.tensor([self._index(device)]))
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [torch.tensor([i]) for i in range(self.visible)])
        monkeypatch.setattr(torch.cuda, "set_rng_state", self._set)
        monkeypatch.setattr(
            torch.cuda, "set_rng_state_all", lambda states: [self._set(s, i) for i, s in enumerate(states)]
        )

    def _index(self, device) -> int:
        index = device if isinstance(device, int) else torch.device(device).index
        if index >= self.visible:
            raise RuntimeError(f"invalid device ordinal {index}: {self.visible} visible")
        return index

    def _set(self, state, device="cuda") -> None:
        self.restored[self._index(device)] = int(state[0])


def test_a_rank_resumes_its_own_cuda_generator_on_fewer_visible_devices(monkeypatch):
    """Rank 1 saved on cuda:1 of 2 visible devices; relaunched with one device visible (one GPU a process) it
    runs on cuda:0 and gets the generator it saved, not every device's (which crashed the resume)."""
    from chattune.checkpoint.run_state import rng_state, set_rng_state

    saved_on = FakeCuda(visible=2, current=1)
    saved_on.install(monkeypatch)
    state = rng_state()
    assert int(state["cuda"][0]) == 1, "the state of the rank's own device"

    resumed_on = FakeCuda(visible=1, current=0)
    resumed_on.install(monkeypatch)
    set_rng_state(state)
    assert resumed_on.restored == {0: 1}


def test_a_checkpoint_with_every_devices_generator_still_resumes(monkeypatch):
    """Checkpoints written before saved `get_rng_state_all()`: the rank's own device's entry is restored."""
    from chattune.checkpoint.run_state import set_rng_state

    old = {
        "torch": torch.get_rng_state(),
        "python": __import__("random").getstate(),
        "numpy": __import__("numpy").random.get_state(),
        "cuda": [torch.tensor([0]), torch.tensor([1])],
    }
    resumed_on = FakeCuda(visible=2, current=1)
    resumed_on.install(monkeypatch)
    set_rng_state(old)
    assert resumed_on.restored == {1: 1}


def _until_logged(process: subprocess.Popen, out: Path, step: int, timeout: float = 300) -> None:
    """Wait until the run has logged `step` (its output goes to files: a pipe nobody reads would block it)."""
    import time

    metrics, deadline = out / "metrics.jsonl", time.monotonic() + timeout
    while not metrics.is_file() or len(metrics.read_text().splitlines()) < step:
        assert process.poll() is None and time.monotonic() < deadline, "the run ended or stalled before the signal"
        time.sleep(0.2)


def _until_said(process: subprocess.Popen, log: Path, words: str, timeout: float = 120) -> None:
    """Wait until the run's log file holds `words`."""
    import time

    deadline = time.monotonic() + timeout
    while words not in log.read_text():
        assert process.poll() is None and time.monotonic() < deadline, f"the run ended or stalled before {words!r}"
        time.sleep(0.05)


def _until_step_started(process: subprocess.Popen, out: Path, step: int, timeout: float = 300) -> None:
    """Wait until a rank has begun `step` (its ledger line, written before the step trains; ledger=true)."""
    import time

    deadline = time.monotonic() + timeout
    while not any(f'{{"step": {step},' in path.read_text() for path in (out / "ledger").glob("rank*.jsonl")):
        assert process.poll() is None and time.monotonic() < deadline, "the run ended or stalled before the step"
        time.sleep(0.1)


@pytest.mark.launch
def test_sigterm_to_torchrun_saves_and_the_relaunch_continues_exactly(tmp_path, small_data, uninterrupted):
    """What a scheduler's preemption does: SIGTERM to the launcher mid-run. Every rank finishes its step, all agree
    in the step's all-reduce, the checkpoint of the step reached is saved, and the relaunch trains on exactly as
    the uninterrupted run did (losses and weights bit for bit), every document once per epoch."""
    import signal
    import sys

    straight = uninterrupted(2)
    out = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        "recipes/sft.py",
        *SMALL_MODEL,
        f"output_dir={out}",
        "max_steps=8",
        "save_every=0",
        "log_every=1",
        f"data.train=[{small_data}]",
        "data.eval=[]",
        "grad_accum_steps=2",
        "data.max_tokens_per_microbatch=512",
        "data.buffer_records=16",
        "data.report_records=0",
        "data.num_workers=2",
        "ledger=true",
    ]
    with open(tmp_path / "stopped.log", "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)
        _until_logged(process, out, 2)
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)
    output = (tmp_path / "stopped.log").read_text()
    saved = [p.name for p in (out / "checkpoints").iterdir()]
    assert len(saved) == 1, saved
    step = int(saved[0].removeprefix("step_"))
    assert 2 <= step < 8 and [s for s, _ in losses(out)] == list(range(1, step + 1))
    assert (
        output.count(f"chattune: stopped by SIGTERM after step {step}: checkpoint {out}/checkpoints/step_{step} saved")
        == 1
    )
    assert output.count("chattune: SIGTERM: stopping after the current step") == 1  # rank 0's line only
    assert _processes_left(out) == [], "the stopped run's data-loader workers outlived it"

    launch(out, small_data, 2, "data.num_workers=2", "ledger=true", "save_every=0")
    assert losses(out) == losses(straight)
    assert_same_weights(out, straight)
    per_epoch: dict[int, Counter] = {}
    for steps in ledger_steps(out).values():
        for epoch, ids in steps.values():
            per_epoch.setdefault(epoch, Counter()).update(i for rank_ids in ids.values() for i in rank_ids)
    assert all(max(counts.values()) == 1 for counts in per_epoch.values()), "a document trained twice in an epoch"
    assert all(
        sorted(counts) == list(range(NUM_RECORDS)) for epoch, counts in per_epoch.items() if epoch < max(per_epoch)
    )


def _processes_left(out: Path, wait_s: float = 10.0) -> list[str]:
    """The processes whose command line names `out`, after up to `wait_s` for them to end."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        left = []
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                words = cmdline.read_bytes().split(b"\0")
            except OSError:  # ended meanwhile
                continue
            if f"output_dir={out}".encode() in words:
                left.append(cmdline.parent.name)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


@pytest.mark.launch
def test_ctrl_c_saves_and_says_so_in_one_line_and_twice_exits_at_once(tmp_path, small_data):
    import os
    import signal
    import sys

    command = [
        sys.executable,
        "recipes/sft.py",
        *SMALL_MODEL,
        "max_steps=200",
        "save_every=0",
        "log_every=1",
        "eval_every=0",
        f"data.train=[{small_data}]",
        "data.eval=[]",
        "data.max_tokens_per_microbatch=512",
        "data.report_records=0",
    ]
    out = tmp_path / "once"
    with open(tmp_path / "once.log", "w") as log:
        process = subprocess.Popen(
            [*command, f"output_dir={out}"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        _until_logged(process, out, 2)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=120) == 75
    output = (tmp_path / "once.log").read_text()
    step = max(s for s, _ in losses(out))
    assert (out / "checkpoints" / f"step_{step}" / "chattune.json").is_file()
    assert output.count(f"chattune: stopped by SIGINT after step {step}") == 1
    assert "Traceback" not in output and "KeyboardInterrupt" not in output

    # Ctrl-C twice in the first steps: nothing saved, and the line says so. The run sleeps 20 s after step 2 is
    # logged (fault injection), before anything saves: both Ctrl-Cs land there, the first one's save still ahead
    # (a slow step 3 left a race: a first Ctrl-C after step 2's all-reduce stops before step 3, and saves at once,
    # so the second found a save half-written in checkpoints/).
    out = tmp_path / "twice"
    twice = [*command, "max_steps=4", f"output_dir={out}"]
    slow = {**os.environ, "CHATTUNE_SLOW_AT": "after_step:2:20"}
    with open(tmp_path / "twice.log", "w") as log:
        process = subprocess.Popen(twice, stdout=log, stderr=subprocess.STDOUT, env=slow)
        _until_logged(process, out, 2)
        process.send_signal(signal.SIGINT)
        _until_said(process, tmp_path / "twice.log", "chattune: SIGINT: stopping after the current step")
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 130
    output = (tmp_path / "twice.log").read_text()
    assert (
        "chattune: SIGINT again: exiting now, without saving: no checkpoint was committed, so nothing is kept (the "
        "same command starts the run again)" in output
    )
    assert "Traceback" not in output
    # ... and the same command starts it again (it used to be refused, "Continue that run with resume=auto"), with
    # what the stopped launch left set aside.
    earlier_config = (out / "config.yaml").read_text()
    again = conftest.launch(twice)
    assert (
        f"output_dir {out}: this run's earlier launch (the same config) committed no checkpoint: starting it again "
        "from step 0, its files (metrics.jsonl) moved aside as *.abandoned" in again.stdout
    )
    assert [s for s, _ in losses(out)] == [1, 2, 3, 4] and (out / "hf" / "config.json").is_file()
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl.abandoned").read_text().splitlines()] == [1, 2]
    assert (out / "config.yaml.abandoned").read_text() == earlier_config


def test_a_stop_that_cannot_finish_gives_up_after_its_deadline(monkeypatch):
    """A peer gone in the middle of a collective would hold a signalled worker until the process group's own
    timeout (an hour): after STOP_DEADLINE_S the process exits without saving."""
    import signal
    import time

    from chattune import interrupts

    exits = []
    monkeypatch.setattr(interrupts, "STOP_DEADLINE_S", 0.2)
    monkeypatch.setattr(interrupts, "_requested", None)
    monkeypatch.setattr(interrupts.os, "_exit", exits.append)
    interrupts._handle(signal.SIGTERM, None)
    assert interrupts.requested() == signal.SIGTERM and not exits
    interrupts._handle(signal.SIGTERM, None)  # a second SIGTERM changes nothing
    deadline = time.monotonic() + 30
    while not exits and time.monotonic() < deadline:
        time.sleep(0.01)
    assert exits == [128 + signal.SIGTERM]


# torchrun's agent kills its workers 30 s after passing a signal on; these launches set that grace to 5 s
# (TORCH_ELASTIC_SHUTDOWN_TIMEOUT) and make a step last 10 s: a step longer than the grace, in 25 s less.
AGENT_GRACE_S = 5
SLOW_STEP_S = 10


def _run_processes(out: Path) -> list[int]:
    """Every process of the run into `out`: the launcher, its workers and their loader workers."""
    return [int(pid) for pid in _processes_left(out, wait_s=0)]


@pytest.mark.parametrize("signum,everyone", [("SIGTERM", True), ("SIGINT", False)])
@pytest.mark.launch
def test_chattune_run_lets_a_step_longer_than_torchruns_grace_finish_and_save(
    tmp_path, small_data, uninterrupted, signum, everyone
):
    """A preemption in a step that takes longer than torchrun's grace: SIGTERM to every process of the job
    (as SLURM signals a job step) or Ctrl-C to the launcher alone (as a terminal does). Under `chattune run` the
    step finishes and its checkpoint is saved, the launcher exits 75 without a traceback, nothing of the run is
    left (processes, lock), and the relaunch trains on exactly as the uninterrupted run did."""
    import os
    import signal
    import time

    straight = uninterrupted(2)
    out = tmp_path / "run"
    command = launch_command(
        out, small_data, 2, "save_every=0", "data.num_workers=2", "ledger=true", launcher=CHATTUNE_RUN
    )
    env = {
        **os.environ,
        "CHATTUNE_SLOW_AT": f"step:3:{SLOW_STEP_S}",
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(AGENT_GRACE_S),
    }
    with open(tmp_path / "stopped.log", "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        _until_step_started(process, out, 3)  # the workers are in step 3, asleep
        signalled = time.monotonic()
        for pid in _run_processes(out) if everyone else [process.pid]:
            os.kill(pid, getattr(signal, signum))
        assert process.wait(timeout=SLOW_STEP_S + 120) == 75
    assert time.monotonic() - signalled > AGENT_GRACE_S, "the step should have outlived torchrun's grace period"
    output = (tmp_path / "stopped.log").read_text()
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_3"]
    assert (out / "checkpoints" / "step_3" / "chattune.json").is_file()
    assert output.count(f"chattune: stopped by {signum} after step 3: checkpoint {out}/checkpoints/step_3 saved") == 1
    assert "Traceback" not in output and "forcefully exiting" not in output and "FAILED" not in output, output
    assert not (out / ".chattune.lock").exists()
    assert _processes_left(out) == [], "the stopped run left processes behind"

    launch(out, small_data, 2, "save_every=0", "data.num_workers=2", launcher=CHATTUNE_RUN)
    assert losses(out) == losses(straight)
    assert_same_weights(out, straight)


@pytest.mark.launch
def test_chattune_run_reports_a_failed_worker_once_without_a_traceback(tmp_path):
    """What chattune prints is checked (the workers' own output, which torchrun's --log-dir keeps apart, and any
    traceback of chattune's code): the agent's own words under load (a peer's closed connection) are torchrun's."""
    from test_run_safety import our_traceback_lines, worker_logs

    result = subprocess.run(
        [
            *CHATTUNE_RUN,
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            "--log-dir",
            str(tmp_path / "logs"),
            "--tee",
            "3",
            "sft",
            f"output_dir={tmp_path / 'run'}",
            f"data.train=[{tmp_path / 'missing.jsonl'}]",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    error = f"chattune: error: data.train[0]: data file '{tmp_path / 'missing.jsonl'}' does not exist"
    assert result.returncode == 1
    assert output.count(error) == 1 and "recipes/sft.py FAILED" in output and not our_traceback_lines(output)
    workers = worker_logs(tmp_path / "logs")
    assert workers.count(error) == 1 and "Traceback" not in workers, workers[-3000:]
