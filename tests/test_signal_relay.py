"""`chattune run`'s signal relay (chattune.cli.run.SignalRelay), with real processes: every stop signal reaches
every registered worker exactly once, a signal received before a worker registered reaches it when it does, and a
registered pid that is not the launcher's own child is never signalled."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from chattune.cli.run import SignalRelay, meant_status, recipe_path

WORKER = """
import os, signal, sys, time
received = []
for signum in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
    signal.signal(signum, lambda signum, frame: received.append(signum))
open(os.path.join(sys.argv[1], f"worker-{os.getpid()}"), "w").close()  # registered, its handlers in place
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


def test_each_signal_reaches_each_registered_child_once_and_early_ones_wait_for_it(tmp_path):
    stranger = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!"], stdout=subprocess.PIPE, text=True)
    stranger_pid = int(stranger.stdout.readline())  # a grandchild: registered below, but not the launcher's child
    (tmp_path / f"worker-{stranger_pid}").touch()
    relay = SignalRelay(tmp_path)
    relay._on_signal(signal.SIGUSR1, None)  # before the worker exists: held
    worker = subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    _wait_registered(tmp_path, 2)
    relay.relay()  # what the relay's watcher does every 0.2 s
    relay._on_signal(signal.SIGTERM, None)
    relay.relay()
    relay.relay()
    output, _ = worker.communicate(timeout=60)
    assert output.split() == [str(int(signal.SIGUSR1)), str(int(signal.SIGTERM))]
    assert _alive(stranger_pid), "a process that is not a worker was signalled"
    subprocess.run(["kill", str(stranger_pid)])
    stranger.wait()


def test_the_launcher_exits_with_the_status_its_workers_meant(tmp_path):
    assert meant_status(tmp_path) == 0  # nobody stopped: the run ended as the agent says
    (tmp_path / "exit-101").write_text("75")
    (tmp_path / "exit-102").write_text("75")
    assert meant_status(tmp_path) == 75
    (tmp_path / "exit-103").write_text("130")  # Ctrl-C twice on one of them: the harder stop is the run's
    assert meant_status(tmp_path) == 130


def test_a_shipped_recipe_is_found_by_its_name():
    assert recipe_path("sft").endswith("recipes/sft.py") and Path(recipe_path("dpo")).is_file()
    assert recipe_path("my_recipe.py") == "my_recipe.py"  # anything else is torchrun's to find
