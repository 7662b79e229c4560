"""Standard output and error that survive their reader: a run must not die because nobody reads its log.

`chattune run ... 2>&1 | tee log`, then Ctrl-C: the terminal sends SIGINT to the whole foreground process
group, `tee` included, which dies at once. From then on every write to the pipe fails with EPIPE (Python
ignores SIGPIPE, so it raises BrokenPipeError): the worker's one-line note of the signal raised inside its
signal handler and ended the worker before its save, the launcher's report crashed the launcher, and log
lines left `--- Logging error ---` stacks wherever stderr still went.

Output that can no longer be read is dropped instead: at the first EPIPE on a stream its file descriptor is
pointed at /dev/null (`os.dup2`, so that C++ and `os.write` stop failing too) and the write that failed is
dropped. The run goes on, saves and exits as it would have; what it keeps on disk (metrics.jsonl, samples,
checkpoints, the export) is untouched. `keep_writing` is called first thing in every chattune process
(the recipes' ranks, the `chattune` command and so `chattune run`'s launcher).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import TextIO


def discard(fd: int) -> None:
    """Point `fd` at /dev/null: its reader is gone. Only system calls, so a signal handler may call it."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)


class ReaderGoneTolerant:
    """A text stream (sys.stdout, sys.stderr) whose writes, once its reader is gone, are dropped (`discard`)
    instead of raising BrokenPipeError. Everything else is the stream's own."""

    def __init__(self, stream: TextIO):
        self._stream = stream

    def _reader_gone(self) -> None:
        with contextlib.suppress(OSError, ValueError):  # no descriptor (a StringIO): nothing to repoint
            discard(self._stream.fileno())

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._reader_gone()
            return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._reader_gone()
            with contextlib.suppress(OSError):  # what it still held goes to /dev/null now
                self._stream.flush()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def keep_writing() -> None:
    """From now on this process's stdout and stderr (and the log handlers that write to them) drop what a
    closed pipe cannot take instead of raising. Idempotent."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None or isinstance(stream, ReaderGoneTolerant):
            continue
        tolerant = ReaderGoneTolerant(stream)
        setattr(sys, name, tolerant)
        # Handlers made before (a library's at import) hold the stream itself.
        for handler in _stream_handlers():
            if handler.stream is stream:
                handler.setStream(tolerant)


def _stream_handlers() -> list[logging.StreamHandler]:
    loggers = [
        logging.getLogger(),
        *(v for v in logging.Logger.manager.loggerDict.values() if isinstance(v, logging.Logger)),
    ]
    return [h for logger in loggers for h in logger.handlers if isinstance(h, logging.StreamHandler)]
