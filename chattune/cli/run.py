"""`chattune run`: torchrun that never cuts a stopping run short.

    chattune run --nproc_per_node 8 recipes/sft.py key=value ...     # torchrun's options, then the recipe

torchrun's elastic agent takes SIGTERM and SIGINT itself: it passes the signal on to its workers, kills them
30 s later (its shutdown timeout), prints a traceback and exits 1. A step and a checkpoint's save of a large
model can take longer than that, and a preempted run then lost everything since its last checkpoint.

`chattune run` runs the same agent, with the same options, rendezvous and environment
(`torch.distributed.run`), but keeps SIGTERM, SIGINT and SIGUSR1 to itself (torchrun's `--signals-to-handle`):
it passes each one on to every worker exactly once and waits for them, however long their step and save take
(a stop that cannot finish gives up on its own after `interrupts.STOP_DEADLINE_S`). It then exits with the
status the workers meant (75: stopped with a checkpoint; 130: Ctrl-C twice), without a traceback; a worker
that failed gets torchrun's report of it, without the agent's own traceback. What a worker does on a signal
is `chattune.interrupts`.

Workers register (a file named by their pid in the launcher's directory) once their handlers are in place. A
signal that arrives before, while they import, is held and passed on when they register: no worker dies of
a signal it could not take yet. Only this process's own children are signalled, so a registered pid that has
ended and been reused by another program is left alone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path

from chattune.cli.catalog import RECIPES_DIR
from chattune.errors import UserError
from chattune.interrupts import LAUNCHER_DIR_ENV, SIGNALS

_POLL_S = 0.2  # how often a held signal looks for workers that registered since


class SignalRelay:
    """The stop signals this launcher received, each passed on once, in order, to every registered worker."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.received: list[int] = []
        self._sent: dict[int, int] = {}  # pid -> how many of `received` it has been sent
        self._lock = threading.RLock()  # a signal may arrive while the watcher relays
        self._closed = threading.Event()

    def install(self) -> None:
        for signum in SIGNALS:
            signal.signal(signum, self._on_signal)
        threading.Thread(target=self._watch, name="chattune-signal-relay", daemon=True).start()

    def close(self) -> None:
        self._closed.set()

    def _on_signal(self, signum: int, frame) -> None:
        self.received.append(signum)
        self.relay()

    def _watch(self) -> None:
        while not self._closed.wait(_POLL_S):
            if self.received:
                self.relay()

    def relay(self) -> None:
        with self._lock:
            for pid in self.workers():
                first, self._sent[pid] = self._sent.get(pid, 0), len(self.received)  # marked before sending
                for signum in self.received[first:len(self.received)]:
                    with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                        os.kill(pid, signum)

    def workers(self) -> list[int]:
        """The registered workers that are still this process's children."""
        pids = (int(path.name.removeprefix("worker-")) for path in self.directory.glob("worker-*"))
        return [pid for pid in pids if _is_child(pid)]


def _is_child(pid: int) -> bool:
    if not sys.platform.startswith("linux"):
        return True  # no /proc to ask: trust the registration
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # it ended
        return False
    return int(stat.rpartition(")")[2].split()[1]) == os.getpid()  # the command may hold spaces and parentheses


def meant_status(directory: Path) -> int:
    """The status the workers stopped with (the most severe, where they differ), or 0 when none stopped."""
    return max((int(path.read_text()) for path in directory.glob("exit-*")), default=0)


def recipe_path(word: str) -> str:
    """A recipe's script: `word` itself, or a shipped recipe named as `chattune ls` names it (sft, dpo)."""
    if Path(word).exists() or not (RECIPES_DIR / f"{word}.py").is_file():
        return word
    return str(RECIPES_DIR / f"{word}.py")


def main(argv: list[str]) -> int:
    """`chattune run ARGS`: ARGS as torchrun takes them. Returns the exit status."""
    print("chattune run: starting torchrun's agent (stop signals are passed on to the workers, who save and exit 75)",
          file=sys.stderr, flush=True)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    sys.argv[0] = "chattune run"  # torchrun's parser names its program from it (usage, --help)
    args = parse_args(argv)
    if not hasattr(args, "signals_to_handle"):
        raise UserError("chattune run needs a torchrun that leaves signals to it (--signals-to-handle, torch 2.9 and "
                        "later); with this torch, launch with torchrun")
    args.training_script = recipe_path(args.training_script)
    relayed = {signal.Signals(s).name for s in SIGNALS}
    # The agent keeps the other signals it handles (SIGHUP, SIGQUIT): a closed terminal still ends the run.
    args.signals_to_handle = ",".join(name for name in args.signals_to_handle.split(",")
                                      if name.strip() not in relayed) or "SIGHUP"
    with tempfile.TemporaryDirectory(prefix="chattune-run-") as directory:
        os.environ[LAUNCHER_DIR_ENV] = directory
        relay = SignalRelay(Path(directory))
        relay.install()
        try:
            run(args)
        except ChildFailedError as failure:  # a worker failed: torchrun's report (which points to its error block)
            print(failure.format_msg(), file=sys.stderr, flush=True)
            return 1
        finally:
            relay.close()
        return meant_status(Path(directory))
