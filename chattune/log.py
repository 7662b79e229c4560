"""Console logging for multi-rank runs: rank 0 speaks at INFO, the other ranks only warn.

On a terminal rank 0 may be drawing a progress bar on the last line (`chattune.train.progress`): its own log
lines print above it (tqdm.write), but another rank's would land inside it. So on a terminal another rank's
line first returns to the start of the line and clears it (the bar's text), and tqdm redraws the bar below
at its next update."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import transformers

CLEAR_LINE = "\r\x1b[K"  # to the start of the line, then erase it


def setup_logging(rank: int, stream: TextIO | None = None) -> None:
    stream = sys.stdout if stream is None else stream
    clear = CLEAR_LINE if rank != 0 and hasattr(stream, "isatty") and stream.isatty() else ""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"{clear}%(asctime)s [rank{rank}] %(message)s",
        datefmt="%H:%M:%S",
        stream=stream,
        force=True,
    )
    # Libraries log progress bars and cache notices at INFO; keep the training log readable.
    for noisy in ("transformers", "httpx", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    transformers.utils.logging.disable_progress_bar()
