"""Errors that are the user's to fix, told apart from bugs, and reported once.

A `UserError` (a bad config or command line, a bad record, a refused resume, an output directory in use)
is printed once, as one block without a traceback, and the process exits with status 1
(`report_errors`, around every recipe and the `chattune` command). Anything else is a bug and keeps
its traceback.

On several ranks, one rank finding the problem must not drown it: the other ranks' collectives fail
("Connection closed by peer") and, without care, each adds a traceback. So the rank that reports leaves
a note in the process group's key-value store (torchrun's agent holds it, so it outlives the rank);
the first rank to claim the note prints, and a rank whose collective fails because a peer stopped
after leaving a note exits silently. A bug leaves a note too, so its one traceback stands alone.
Before the process group exists (config errors, found alike by every rank) only rank 0 prints.

A launch with nothing to do (`NothingToDo`: a complete run relaunched with the same config) is no error: rank 0
says so in one line and the recipe ends there, with status 0 (a sweep goes on to its next job).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator

EXIT_CODE = 1
NOTE = "chattune/stopped"  # store key: the rank that reported why the run stops
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")  # gloo's words
_GRACE_S = 3.0  # a rank that leaves the reporting to another waits this long, so the reporter speaks first
_REPORTER_WAIT_S = 120.0  # ... or, where it can see rank 0's progress, until rank 0 has reported (at most this)


class UserError(Exception):
    """A problem in what the user gave (config, data, command line, output directory), stated so that
    the message alone says what to fix."""


class NothingToDo(Exception):  # not an error: what `report_errors` ends a task with, status 0
    """Every rank's: the launch has nothing to do (the message says why, and what would do something)."""


class UnsupportedModel(UserError, NotImplementedError):
    """A model chattune cannot train correctly (yet): refused at start-up rather than trained wrong."""


def _process_group():
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


def _note_store():
    """The process group's store (torchrun's agent store: it outlives any rank), or None on one rank."""
    dist = _process_group()
    if dist is None or dist.get_world_size() == 1:  # torch's, as in `_rank`: there may be no mesh yet
        return None
    from torch.distributed import distributed_c10d

    try:
        store = distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None
    # Unprefixed by the group, prefixed by the launch attempt: an earlier attempt's note is never read.
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return dist.PrefixStore(f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def _rank() -> int:
    # torch's own rank, not the mesh's (`chattune.distributed.ParallelDims`): errors are reported from before any
    # mesh exists (the launcher, init_distributed itself) and from groups made without one.
    dist = _process_group()
    return dist.get_rank() if dist is not None else int(os.environ.get("RANK", "0"))


def _claim_report(store) -> bool:
    """Whether this rank is the first to report (and so prints); the claim is the note the others read."""
    if store is None:  # one rank, or before the process group: every rank found the same, rank 0 speaks
        return _rank() == 0
    me = str(_rank())
    try:
        return store.compare_set(NOTE, "", me).decode() == me
    except RuntimeError:  # the store is gone (its host stopped): speak rather than stay silent
        return True


def _peer_reported(store, error: BaseException) -> bool:
    """Whether `error` is this rank's collective failing because a peer stopped after reporting."""
    if store is None or not any(words in str(error) for words in _PEER_GONE):
        return False
    try:
        return store.check([NOTE])
    except RuntimeError:  # the store went with its host, rank 0, which reported first
        return True


def peer_reported() -> bool:
    """Whether another rank has left the note that it reported why the run stops (an error, a bug): a SIGTERM
    that follows is torchrun's agent ending this rank because that one failed, not a stop to save for."""
    store = _note_store()
    if store is None:
        return False
    try:
        return store.check([NOTE])
    except RuntimeError:  # the store is gone with its host
        return False


def write_error_file(message: str) -> None:
    """torchrun's failure report shows this rank's TORCHELASTIC_ERROR_FILE as its "traceback" (instead of
    a link to its docs). Written whole, atomically: torchrun fails on a partial file."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}}
    with contextlib.suppress(OSError):
        partial = f"{path}.{os.getpid()}.partial"
        with open(partial, "w") as f:
            json.dump(data, f)
        os.replace(partial, path)


def _wait_for_the_reporter(store) -> None:
    """Before a rank that left the report to another exits (its exit makes torchrun end the others): until the
    reporter has spoken. Before the process group (no store: config and data errors) the reporter is rank 0,
    which on this node writes its torchrun error file, a sibling of this rank's, after printing: wait for that
    file (a rank 0 slower to start, under load, was killed before it printed anything), at most
    `_REPORTER_WAIT_S`. Elsewhere (rank 0 on another node, no torchrun, a store's claimant, which prints at once
    after its claim) a fixed grace."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    on_rank0_node = os.environ.get("GROUP_RANK", "0") == "0" and os.environ.get("LOCAL_RANK") not in (None, "0")
    if store is not None or not path or not on_rank0_node:
        time.sleep(_GRACE_S)
        return
    rank0_file = os.path.join(os.path.dirname(os.path.dirname(path)), "0", os.path.basename(path))
    deadline = time.monotonic() + _REPORTER_WAIT_S
    while not os.path.exists(rank0_file) and time.monotonic() < deadline:
        time.sleep(0.05)


def _exit() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_CODE)  # now: a slow teardown would let torchrun kill this rank before it exits on its own


def format_user_error(error: UserError) -> str:
    return f"chattune: error: {error}"


@contextlib.contextmanager
def report_errors() -> Iterator[None]:
    """Around a recipe: a UserError printed once without a traceback; a rank whose collective failed
    because a peer reported stays silent; a bug keeps its traceback. Each ends the process (status 1). A
    `NothingToDo` is said once (rank 0) and ends the task alone: the code after this block runs on."""
    try:
        yield
    except NothingToDo as done:  # raised alike by every rank
        if _rank() == 0:
            print(f"chattune: {done}", file=sys.stderr, flush=True)
        # Every rank here, then the group torn down (a sweep's next job makes its own). This module talks to
        # torch.distributed itself, as for the note's store: chattune.distributed is above it (it raises UserError).
        dist = _process_group()
        if dist is not None:
            dist.barrier()
            dist.destroy_process_group()
    except UserError as error:
        store = _note_store()
        if _claim_report(store):
            print(format_user_error(error), file=sys.stderr)
            write_error_file("the chattune error printed above (a user error, not a bug: no traceback)")
        else:
            write_error_file("stopped: another rank reported the error")
            _wait_for_the_reporter(store)
        _exit()
    except Exception as error:  # not BaseException: Ctrl-C and sys.exit pass through
        store = _note_store()
        if _peer_reported(store, error):
            write_error_file("stopped: another rank reported the error")
            _exit()
        if store is not None:
            with contextlib.suppress(RuntimeError):
                store.compare_set(NOTE, "", str(_rank()))  # this bug's traceback is the one to read
        write_error_file(f"{type(error).__name__}: {error} (the traceback above, rank {_rank()})")
        sys.excepthook(type(error), error, error.__traceback__)
        _exit()
