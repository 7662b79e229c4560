"""Console logging for multi-rank runs: rank 0 speaks for the run, the other ranks only for themselves.

A note or warning of the run (a resume's accepted changes, the schedule it follows, a step slower than
torchrun's grace) is found alike by every rank: printed by every rank it would come N times. So rank 0 logs
at INFO, and another rank prints only its errors and the warnings that are its own (what only that rank saw:
a bad record in its share of the data, its device's generator state), which say so by logging with
`extra=EACH_RANK`:

    logger.warning("skipped (%s): %s", reason, detail, extra=EACH_RANK)

On a terminal rank 0 may be drawing a progress bar on the last line (`chattune.train.progress`): its own log
lines print above it (tqdm.write), but another rank's would land inside it. So on a terminal another rank's
line first returns to the start of the line and clears it (the bar's text), and tqdm redraws the bar below
at its next update."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

CLEAR_LINE = "\r\x1b[K"  # to the start of the line, then erase it
EACH_RANK = {"each_rank": True}  # `extra=` of a record that every rank logging it prints (its own finding)


def own_findings_only(record: logging.LogRecord) -> bool:
    """Another rank's filter: its errors, and the records it marked as its own (`EACH_RANK`)."""
    return record.levelno >= logging.ERROR or getattr(record, "each_rank", False)


def setup_logging(rank: int, stream: TextIO | None = None) -> None:
    import transformers  # (here: the modules that mark their records import this one without transformers)

    stream = sys.stdout if stream is None else stream
    clear = CLEAR_LINE if rank != 0 and hasattr(stream, "isatty") and stream.isatty() else ""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"{clear}%(asctime)s [rank{rank}] %(message)s",
        datefmt="%H:%M:%S",
        stream=stream,
        force=True,
    )
    # On the handlers: a library's records are the run's too (transformers' go to a handler of its own).
    for handler in [*logging.getLogger().handlers, *logging.getLogger("transformers").handlers]:
        (handler.addFilter if rank != 0 else handler.removeFilter)(own_findings_only)
    # Libraries log progress bars and cache notices at INFO; keep the training log readable.
    for noisy in ("transformers", "httpx", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    transformers.utils.logging.disable_progress_bar()
