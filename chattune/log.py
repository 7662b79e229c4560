"""Console logging for multi-rank runs: rank 0 speaks at INFO, the other ranks only warn."""

from __future__ import annotations

import logging
import sys

import transformers


def setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stdout,
        force=True,
    )
    # Libraries log progress bars and cache notices at INFO; keep the training log readable.
    for noisy in ("transformers", "httpx", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    transformers.utils.logging.disable_progress_bar()
