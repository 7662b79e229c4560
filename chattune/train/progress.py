"""Rank 0's progress on the console: a tqdm bar on a terminal, plain metric lines everywhere else.

`progress: auto` (the default) shows the bar when stdout, where the log lines go, is a terminal; in CI
and in log files a bar is noise, so there the metric lines of `MetricLogger` tell the story as before.
`bar` and `lines` force one or the other.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import TextIO

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from chattune.config.schema import PROGRESS_MODES

BAR_FORMAT = "step {n_fmt}/{total_fmt} |{bar}| {percentage:3.0f}%{postfix} [{elapsed}<{remaining}]"


def wants_bar(mode: str, stream: TextIO) -> bool:
    """Whether `mode` ('auto', 'bar' or 'lines') shows a bar on `stream`."""
    if mode not in PROGRESS_MODES:
        raise ValueError(f"progress must be one of {', '.join(PROGRESS_MODES)}, got {mode!r}")
    return mode == "bar" or (mode == "auto" and hasattr(stream, "isatty") and stream.isatty())


def bar_postfix(metrics: Mapping[str, float]) -> str:
    """The last logged loss, tokens/s, MFU and peak memory (where measured), as the bar shows them."""
    parts = []
    if "loss" in metrics:
        parts.append(f"loss {metrics['loss']:.4g}")
    if "tokens_per_sec" in metrics:
        parts.append(f"{tqdm.format_sizeof(metrics['tokens_per_sec'])} tok/s")
    if "mfu" in metrics:
        parts.append(f"MFU {metrics['mfu']:.1%}")
    if "peak_memory_allocated_gib" in metrics:
        parts.append(f"{metrics['peak_memory_allocated_gib']:.1f} GiB")
    return " | ".join(parts)


class Progress:
    """Steps done out of max_steps, the last logged loss and tokens/s, and an ETA, on rank 0.

    Without a bar (other ranks, `lines`, or `auto` off a terminal) every call does nothing. While the bar
    is open, console log lines go through `tqdm.write`, so they print above the bar instead of through it.
    """

    def __init__(self, start_step: int, max_steps: int, mode: str = "auto", is_main: bool = True,
                 stream: TextIO | None = None):
        stream = sys.stdout if stream is None else stream
        show = wants_bar(mode, stream)  # checked on every rank: a bad value fails everywhere alike
        self.bar: tqdm | None = None
        self._redirect: AbstractContextManager | None = None
        if is_main and show:
            # ETA from the steps this launch ran (tqdm leaves `initial` out of the rate): right after a resume too.
            self.bar = tqdm(total=max_steps, initial=start_step, file=stream, bar_format=BAR_FORMAT,
                            dynamic_ncols=True, mininterval=0.5)
            self._redirect = logging_redirect_tqdm()
            self._redirect.__enter__()

    @property
    def shows_bar(self) -> bool:
        return self.bar is not None

    def update(self, step: int, metrics: Mapping[str, float] | None = None) -> None:
        """`step` is done; `metrics` are the latest logged ones (None: keep showing the previous ones)."""
        if self.bar is None:
            return
        if metrics:
            self.bar.set_postfix_str(bar_postfix(metrics), refresh=False)
        self.bar.update(step - self.bar.n)

    def close(self) -> None:
        """Leave the bar as it ended and give console logging back. Safe to call twice."""
        if self.bar is None:
            return
        self._redirect.__exit__(None, None, None)
        self.bar.close()
        self.bar = self._redirect = None
