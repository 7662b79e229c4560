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

Workers register (a file named by their pid in the launcher's directory) once their handlers are in place, and
only registered workers that are this process's own children are signalled (a pid that has ended and been
reused by another program is left alone). A signal that finds none registered stops the agent as torchrun
would (`SignalRelay`): the run had not begun to train.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
from pathlib import Path

from chattune.cli.catalog import RECIPES_DIR
from chattune.errors import UserError
from chattune.interrupts import LAUNCHER_DIR_ENV, SIGNALS


class SignalRelay:
    """The stop signals this launcher received, each passed on once, in order, to every registered worker. A
    signal that finds no worker registered (a rendezvous still waiting for its nodes, workers still importing, a
    script that is not a chattune recipe) stops the agent as torchrun's own handler does: nothing has trained,
    nothing is lost, and the launcher must not ignore it."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.received: list[int] = []
        self._sent: dict[int, int] = {}  # pid -> how many of `received` it has been sent

    def install(self) -> None:
        for signum in SIGNALS:
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        self.received.append(signum)
        if not self.relay():  # the agent stops its workers with SIGTERM: a Ctrl-C would give each a traceback
            raise SignalException(
                f"chattune run got {signal.Signals(signum).name} before any worker could take it", sigval=signal.SIGTERM
            )

    def relay(self) -> list[int]:
        """Send every registered worker the signals it has not had yet; the workers it found. Runs in the main
        thread only (signal handlers do), so a signal arriving meanwhile re-enters it: each pid's count is marked
        before its signals are sent, and never lowered."""
        count, workers = len(self.received), self.workers()
        for pid in workers:
            first = self._sent.get(pid, 0)
            if first >= count:
                continue
            self._sent[pid] = count
            for signum in self.received[first:count]:
                with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                    os.kill(pid, signum)
        return workers

    def workers(self) -> list[int]:
        """The registered workers (of the agent's latest attempt) that are still this process's children."""
        return [pid for pid in registered(self.directory, "worker") if _is_child(pid)]


def registered(directory: Path, kind: str) -> dict[int, Path]:
    """The files of `kind` ("worker": a registration, "exit": a status) that the workers of the agent's latest
    attempt left, by pid: under `--max-restarts` an earlier attempt's are stale. Named `KIND-ATTEMPT-PID`."""
    files = [(path, *map(int, path.name.split("-")[1:])) for path in directory.glob(f"{kind}-*-*")]
    attempts = [int(path.name.split("-")[1]) for path in directory.glob("worker-*-*")]
    latest = max(attempts, default=0)
    return {pid: path for path, attempt, pid in files if attempt == latest}


def _is_child(pid: int) -> bool:
    if not sys.platform.startswith("linux"):
        return True  # no /proc to ask: trust the registration
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # it ended
        return False
    return int(stat.rpartition(")")[2].split()[1]) == os.getpid()  # the command may hold spaces and parentheses


def meant_status(directory: Path) -> int:
    """The status the workers of the latest attempt stopped with (the most severe, where they differ), or 0 when
    none stopped."""
    return max((int(path.read_text()) for path in registered(directory, "exit").values()), default=0)


def recipe_path(word: str) -> str:
    """A recipe's script: `word` itself, or a shipped recipe named as `chattune ls` names it (sft, dpo)."""
    if Path(word).is_file() or not (RECIPES_DIR / f"{word}.py").is_file():
        return word
    return str(RECIPES_DIR / f"{word}.py")


def main(argv: list[str]) -> int:
    """`chattune run ARGS`: ARGS as torchrun takes them. Returns the exit status."""
    print(
        "chattune run: starting torchrun's agent (stop signals are passed on to the workers, who save and exit 75)",
        file=sys.stderr,
        flush=True,
    )
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    sys.argv[0] = "chattune run"  # torchrun's parser names its program from it (usage, --help)
    args = parse_args(argv)
    if not hasattr(args, "signals_to_handle"):
        raise UserError(
            "chattune run needs a torchrun that leaves signals to it (--signals-to-handle, torch 2.9 and "
            "later); with this torch, launch with torchrun"
        )
    args.training_script = recipe_path(args.training_script)
    relayed = {signal.Signals(s).name for s in SIGNALS}
    # The agent keeps the other signals it handles (SIGHUP, SIGQUIT): a closed terminal still ends the run.
    args.signals_to_handle = (
        ",".join(name for name in args.signals_to_handle.split(",") if name.strip() not in relayed) or "SIGHUP"
    )
    with tempfile.TemporaryDirectory(prefix="chattune-run-") as directory:
        os.environ[LAUNCHER_DIR_ENV] = directory
        relay = SignalRelay(Path(directory))
        relay.install()
        try:
            run(args)
        except ChildFailedError as failure:  # a worker failed: torchrun's report (which points to its error block)
            print(failure.format_msg(), file=sys.stderr, flush=True)
            return 1
        except SignalException:  # before any worker could take it: the agent has stopped them
            first = signal.Signals(relay.received[0])
            print(
                f"chattune run: stopped by {first.name} before training began; nothing to save",
                file=sys.stderr,
                flush=True,
            )
            return 128 + first
        return meant_status(Path(directory))
