"""Stopping on a signal without losing work: a preempted, cancelled or Ctrl-C'd run finishes the step it is
in, saves a checkpoint and exits (status `EXIT_CODE`), and its relaunch continues exactly.

Schedulers stop a job with a signal and a grace period: SLURM and Kubernetes send SIGTERM (SLURM's
`--signal=USR1@SECONDS` sends SIGUSR1 ahead of the time limit), a terminal sends SIGINT. The handlers here
only take note (`requested`). Every rank must stop after the same step, even when the signal reached them
at different times, and a stop must never start a step: the step's existing all-reduce carries the note of a
signal that came while the step computed (read after its backward, `chattune.train.step`), and a CPU
all-reduce before each step (`StopVote`) the note of one that came after (in the optimizer's step, an
evaluation, a save). The loop then saves the last step's checkpoint and raises `Preempted`, which ends the
process with `EXIT_CODE`. A signal during the run's last step lets it finish: the export follows, and the
run ends complete (status 0).

- A second SIGTERM is ignored: under torchrun a worker can get two (torchrun passes its own on, and a dying
  launcher sends another through PR_SET_PDEATHSIG), and the save must not be cut short.
- A second SIGINT (Ctrl-C twice) exits at once, with status 130 and nothing saved.
- Every line about a stop that cannot save says what is kept (`note_checkpoint`: the run's newest committed
  checkpoint, or none) and what is not: the first signal's under plain torchrun (which kills its workers when its
  grace is over: a SIGKILL, which nothing can catch, so the line comes just before it, too), a second Ctrl-C's,
  and the deadline's.
- A stop that has not ended the process `STOP_DEADLINE_S` after the signal (a peer gone in the middle of a
  collective, which only the process group's own timeout would end) exits with 128 + the signal: a
  scheduler would have killed it by then, and a worker orphaned by a killed launcher must not linger.
- Data-loader workers ignore both (`ignore_in_worker`): torchrun signals a worker's whole process group,
  and the step being finished still reads from them. They die with their trainer process instead.

Under `chattune run` (`chattune.cli.run`, torchrun's elastic agent that leaves stopping to the workers)
each worker registers its pid once its handlers are in place, so the launcher signals only workers that can take
it, and ends through `exit_code`: it records the status it means (75, 130, ...) for the launcher, which exits
with it, and itself exits 0, so that the agent sees a clean end instead of a failed worker to report and kill.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading

from chattune import errors
from chattune.streams import discard

EXIT_CODE = 75  # EX_TEMPFAIL: stopped on a signal with a checkpoint saved; run the same command again
STOP_DEADLINE_S = 600.0
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
LAUNCHER_DIR_ENV = "CHATTUNE_LAUNCHER_DIR"  # set by `chattune run`: where its workers register and leave their status

_requested: int | None = None  # the first signal received
_kept_when_killed: str | None = None  # what survives torchrun's kill (`keep_when_killed`), for the first-signal line
_last_checkpoint: str | None = None  # the run's newest committed checkpoint (`note_checkpoint`)
_stop_over = threading.Event()  # the stop has saved (or the run ended): torchrun's kill would find nothing left


class Preempted(BaseException):
    """Raised by the loop once the checkpoint of a signalled stop is saved. A BaseException, like
    SystemExit: not a user error, not a bug; the launcher ends the process with `EXIT_CODE`."""

    def __init__(self, message: str):
        super().__init__(message)
        self.code = EXIT_CODE


def say(text: str, any_rank: bool = False) -> None:
    """One line on stderr from the first rank only (every rank gets the signal), or from this one with
    `any_rank`. os.write: async-signal-safe, unlike logging or print, whose locks the signal may have interrupted."""
    if any_rank or os.environ.get("RANK", "0") == "0":
        try:
            os.write(2, text.encode())
        except OSError:  # nobody reads stderr any more (a `| tee` killed by the same Ctrl-C): the stop goes on
            discard(2)


def _handle(signum: int, frame) -> None:
    global _requested
    name = signal.Signals(signum).name
    if _requested is None and signum == signal.SIGTERM and errors.peer_reported():
        # torchrun's agent ends the ranks that are left after one failed: that rank's report is the one to read
        errors.write_error_file("stopped: another rank reported the error")
        os._exit(errors.EXIT_CODE)
    if _requested is None:
        _requested = signum
        again = " (Ctrl-C again to exit at once, without saving)" if signum == signal.SIGINT else ""
        grace = ""
        if under_plain_torchrun():
            seconds = torchrun_grace_s()
            grace = f"; torchrun kills its workers {seconds} s after passing a signal on (its --shutdown-timeout)"
            if _kept_when_killed:
                grace += f": if the step in flight has not finished by then, {_kept_when_killed}"
            else:
                grace += (
                    f": if the step in flight and its save are not done by then, {kept()}. Launch with `chattune "
                    "run` instead of torchrun to let a longer step and save finish"
                )
                _start_timer(max(seconds - 1.0, seconds * 0.8), _before_kill, signum, seconds)
        say(f"chattune: {name}: stopping after the current step, with a checkpoint{again}{grace}\n")
        _start_timer(STOP_DEADLINE_S, _give_up, signum)
    elif signum == signal.SIGINT:
        say(f"chattune: SIGINT again: exiting now, without saving: {kept()}\n")
        os._exit(exit_code(128 + signal.SIGINT))


def _start_timer(seconds: float, then, *args) -> None:
    timer = threading.Timer(seconds, then, args=args)
    timer.daemon = True
    timer.start()


def note_checkpoint(path: object | None) -> None:
    """The run's newest committed checkpoint from now on (None: it has none): what a stop that cannot save keeps."""
    global _last_checkpoint
    _last_checkpoint = None if path is None else str(path)


def stop_over() -> None:
    """The stop has saved its checkpoint, or the run has ended: nothing is left for torchrun's kill to cut short."""
    _stop_over.set()


def kept() -> str:
    """What a run ended now, without saving, keeps and what it does not."""
    if _last_checkpoint is None:
        return "no checkpoint was committed, so nothing is kept (the same command starts the run again)"
    return f"the checkpoint {_last_checkpoint} is kept (the same command continues from it), the steps after it are not"


def _before_kill(signum: int, grace: int) -> None:
    """Just before plain torchrun's SIGKILL (its grace after the signal): what the run keeps, since a killed process
    says nothing."""
    if not _stop_over.is_set():
        say(
            f"chattune: {signal.Signals(signum).name} {grace} s ago: torchrun kills the workers now, before the stop "
            f"has saved: {kept()}\n"
        )


def under_plain_torchrun() -> bool:
    """Whether torchrun's own agent launched this process (not `chattune run`'s): a stop then has its grace."""
    return "TORCHELASTIC_RUN_ID" in os.environ and LAUNCHER_DIR_ENV not in os.environ


def keep_when_killed(what: str | None) -> None:
    """Say in the first-signal line under plain torchrun what a kill at the end of its grace leaves."""
    global _kept_when_killed
    _kept_when_killed = what


def torchrun_grace_s(agent_argv: list[str] | None = None, env: dict | None = None) -> int:
    """How long torchrun's agent waits after passing a signal on before it kills its workers: its
    `--shutdown-timeout` (read from the agent's command line, this process's parent's, unless `agent_argv`),
    else `TORCH_ELASTIC_SHUTDOWN_TIMEOUT`, else 30 s (torch's default)."""
    env = os.environ if env is None else env
    if agent_argv is None:
        try:
            with open(f"/proc/{os.getppid()}/cmdline", "rb") as cmdline:
                agent_argv = [word.decode(errors="replace") for word in cmdline.read().split(b"\0")]
        except OSError:  # no /proc: the environment decides
            agent_argv = []
    for i, word in enumerate(agent_argv):
        flag, equals, value = word.partition("=")
        if flag in ("--shutdown-timeout", "--shutdown_timeout"):
            value = value if equals else (agent_argv[i + 1] if i + 1 < len(agent_argv) else "")
            if value.isdigit():
                return int(value)
    for name in ("PET_SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        if env.get(name, "").isdigit():
            return int(env[name])
    return 30


def _give_up(signum: int) -> None:
    say(
        f"chattune: {signal.Signals(signum).name}: the stop did not finish within {STOP_DEADLINE_S:.0f} s; exiting "
        f"without saving: {kept()}\n"
    )
    os._exit(exit_code(128 + signum))


def install() -> None:
    """Take note of SIGTERM, SIGINT and SIGUSR1 from now on, in this (main) thread's process."""
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may set handlers (an embedding application keeps its own)
    for signum in SIGNALS:
        signal.signal(signum, _handle)
    if os.environ.get(LAUNCHER_DIR_ENV):  # registered only now: a signal the launcher forwards finds these handlers
        with contextlib.suppress(OSError):  # its directory is gone with the launcher: nobody to register with
            _launcher_file("worker").close()


def _launcher_file(kind: str):
    """A new file of `kind` in `chattune run`'s directory, named for the agent's attempt and this process: the
    launcher reads the latest attempt's (`chattune.cli.run.registered`)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return open(os.path.join(os.environ[LAUNCHER_DIR_ENV], f"{kind}-{attempt}-{os.getpid()}"), "w")


def exit_code(code: int) -> int:
    """The status this process exits with to end with `code` (75: stopped with a checkpoint; 128 + a signal):
    `code` itself, or under `chattune run` 0, with `code` left in the launcher's directory for it to exit with."""
    if not os.environ.get(LAUNCHER_DIR_ENV) or code == 0:
        return code
    try:
        with _launcher_file("exit") as status:
            status.write(str(code))
    except OSError:  # the launcher is gone (and its directory with it): nobody reads a status but the agent
        return code
    return 0


def requested() -> int | None:
    """The first stop signal this process received, or None."""
    return _requested


class StopVote:
    """Collective: whether any rank has received a stop signal, agreed before a step starts. The step's own
    all-reduce carries a signal that arrives while it computes (`chattune.train.step`); one that arrives after
    it (in the optimizer's step, an evaluation, a save) is found here, so the run stops with the last step's
    checkpoint instead of training one more. Over a CPU (gloo) group: one scalar, and on CUDA no wait for the
    device, whose queue still holds the last step's optimizer. Collective to create."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._group = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")

    def __call__(self) -> bool:
        import torch
        import torch.distributed as dist

        local = _requested is not None
        if self._group is None:
            return local
        votes = torch.tensor([float(local)])
        dist.all_reduce(votes, group=self._group)
        return votes.item() > 0


def signal_name(signum: int | None) -> str:
    return signal.Signals(signum).name if signum is not None else "a signal (on another rank)"


def ignore_in_worker() -> None:
    """In a data-loader worker: leave stopping to the trainer, whose current step still reads from us. A worker
    that ignores SIGTERM also ignores its trainer's own terminate() at exit, so it ends with its trainer instead:
    the kernel kills it when the trainer dies (Linux's PR_SET_PDEATHSIG), and it exits at once if the trainer
    is already gone. Otherwise a preempted run would leave its workers behind, blocked on a full queue."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    trainer = os.getppid()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != trainer:  # the trainer died before the request above took effect
        os._exit(0)
