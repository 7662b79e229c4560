"""`chattune run`'s signal relay (chattune.cli.run.SignalRelay), with real processes: every stop signal reaches
every registered worker exactly once, a registered pid that is not the launcher's own child is never signalled,
and a signal that finds no worker registered stops the launch instead of waiting for one."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.api import SignalException

from chattune.cli.run import SignalRelay, meant_status, recipe_path

WORKER = """
import os, signal, sys, time
received = []
for signum in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
    signal.signal(signum, lambda signum, frame: received.append(signum))
open(os.path.join(sys.argv[1], f"worker-0-{os.getpid()}"), "w").close()  # registered, its handlers in place
deadline = time.monotonic() + 30
while len(received) < 2 and time.monotonic() < deadline:
    time.sleep(0.05)
time.sleep(1.0)  # a duplicate would arrive now
print(" ".join(str(s) for s in received))
"""


def _wait_registered(directory: Path, count: int) -> None:
    deadline = time.monotonic() + 30
    while len(list(directory.glob("worker-*"))) < count:
        assert time.monotonic() < deadline, "the worker did not register"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"  # killed, its parent gone: a zombie until something reaps it


@pytest.mark.launch
def test_each_signal_reaches_each_registered_child_once(tmp_path):
    stranger = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!"], stdout=subprocess.PIPE, text=True)
    stranger_pid = int(stranger.stdout.readline())  # a grandchild: registered below, but not the launcher's child
    (tmp_path / f"worker-0-{stranger_pid}").touch()
    relay = SignalRelay(tmp_path)
    with pytest.raises(SignalException):  # no worker of its own yet: the launch stops, as torchrun's would
        relay._on_signal(signal.SIGUSR1, None)
    relay.received.clear()
    worker = subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    _wait_registered(tmp_path, 2)
    relay._on_signal(signal.SIGUSR1, None)
    relay._on_signal(signal.SIGTERM, None)
    relay.relay()  # nothing new: nothing sent again
    output, _ = worker.communicate(timeout=60)
    # each once; the order two signals close together are handled in is not the order they were sent (seen under load)
    assert sorted(output.split()) == sorted([str(int(signal.SIGUSR1)), str(int(signal.SIGTERM))])
    assert _alive(stranger_pid), "a process that is not a worker was signalled"
    subprocess.run(["kill", str(stranger_pid)])
    stranger.wait()


@pytest.mark.launch
def test_a_signal_before_any_worker_registered_stops_the_launch(tmp_path):
    """A rendezvous waiting for its nodes, workers still importing, a script that is no chattune recipe: Ctrl-C
    stops the launch at once (nothing has trained) instead of being held for workers that never take it."""
    script, started = tmp_path / "sleeper.py", tmp_path / "started"
    script.write_text(f"import time\nopen({str(started)!r}, 'w').close()\ntime.sleep(120)\n")  # no chattune recipe
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "chattune.cli.main",
            "run",
            "--nproc_per_node",
            "1",
            "--monitor-interval",
            "0.1",
            str(script),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not started.exists():  # the agent has started its worker, which registers no handler
        assert process.poll() is None and time.monotonic() < deadline, "the worker did not start"
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGINT, output
    assert "chattune run: stopped by SIGINT before training began; nothing to save" in output
    assert "Traceback" not in output


def test_the_launcher_exits_with_the_status_its_latest_workers_meant(tmp_path):
    assert meant_status(tmp_path) == 0  # nobody stopped: the run ended as the agent says
    for pid in (101, 102, 103):
        (tmp_path / f"worker-0-{pid}").touch()
    (tmp_path / "exit-0-101").write_text("75")
    (tmp_path / "exit-0-102").write_text("75")
    assert meant_status(tmp_path) == 75
    (tmp_path / "exit-0-103").write_text("130")  # Ctrl-C twice on one of them: the harder stop is the run's
    assert meant_status(tmp_path) == 130
    (tmp_path / "worker-1-201").touch()  # the agent restarted its workers (--max-restarts): the old statuses are stale
    assert meant_status(tmp_path) == 0
    (tmp_path / "exit-1-201").write_text("75")
    assert meant_status(tmp_path) == 75


def test_a_shipped_recipe_is_found_by_its_name(tmp_path, monkeypatch):
    assert recipe_path("sft").endswith("recipes/sft.py") and Path(recipe_path("dpo")).is_file()
    assert recipe_path("my_recipe.py") == "my_recipe.py"  # anything else is torchrun's to find
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sft").mkdir()  # a directory of that name is no script
    assert recipe_path("sft").endswith("recipes/sft.py")
