"""Rank 0's progress on the console: a tqdm bar on a terminal, plain metric lines everywhere else.

`progress: auto` (the default) shows the bar when stdout, where the log lines go, is a terminal; in CI
and in log files a bar is noise, so there the metric lines of `MetricLogger` tell the story as before.
`bar` and `lines` force one or the other.

A long pass that is no training step (an evaluation) shows its own progress the same way (`TaskProgress`), once
it has run a few seconds: a second bar under the training bar, or a line every ten seconds.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TextIO

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from chattune.config.schema import PROGRESS_MODES

logger = logging.getLogger(__name__)

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

    def __init__(
        self, start_step: int, max_steps: int, mode: str = "auto", is_main: bool = True, stream: TextIO | None = None
    ):
        stream = sys.stdout if stream is None else stream
        show = wants_bar(mode, stream)  # checked on every rank: a bad value fails everywhere alike
        self.is_main, self.stream = is_main, stream
        self.bar: tqdm | None = None
        self._redirect: AbstractContextManager | None = None
        if is_main and show:
            # ETA from the steps this launch ran (tqdm leaves `initial` out of the rate): right after a resume too.
            self.bar = tqdm(
                total=max_steps,
                initial=start_step,
                file=stream,
                bar_format=BAR_FORMAT,
                dynamic_ncols=True,
                mininterval=0.5,
            )
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

    def task(self, label: str, total: int, unit: str) -> TaskProgress:
        """The progress of a pass of `total` `unit`s (e.g. an evaluation's batches), shown as this progress shows
        steps (nothing on other ranks). Call `update` after each unit and `close` at the end."""
        return TaskProgress(label, total, unit, self.is_main, self.shows_bar, self.stream)

    def close(self) -> None:
        """Leave the bar as it ended and give console logging back. Safe to call twice."""
        if self.bar is None:
            return
        if self._redirect is not None:
            self._redirect.__exit__(None, None, None)
        self.bar.close()
        self.bar = self._redirect = None


@dataclass(frozen=True)
class Pace:
    """How often a pass that is no training step speaks: nothing for its first `delay_s` seconds, then a line
    every `every_s` seconds, by `clock`."""

    delay_s: float = 5.0
    every_s: float = 10.0
    clock: Callable[[], float] = time.monotonic


class TaskProgress:
    """Rank 0's progress through a pass of `total` units that is not a training step (an evaluation): nothing
    for its first `pace.delay_s` seconds (a short pass says nothing), then a bar under the training bar (`bar`)
    or a log line every `pace.every_s` seconds ("eval: 120/400 batches, 30 s"), and a last line at the end of a
    pass that said anything. Other ranks show nothing."""

    def __init__(
        self,
        label: str,
        total: int,
        unit: str,
        is_main: bool = True,
        bar: bool = False,
        stream: TextIO | None = None,
        pace: Pace = Pace(),
    ):
        self.label, self.total, self.unit, self.every_s, self.clock = label, total, unit, pace.every_s, pace.clock
        self.enabled = is_main
        self.started = self.clock()
        self.next_line = self.started + pace.delay_s
        self.done, self.lines = 0, 0
        self.bar: tqdm | None = None
        if is_main and bar:  # tqdm's own delay: the bar appears only once the pass has run delay_s
            self.bar = tqdm(
                total=total,
                desc=label,
                unit=f" {unit}",
                file=sys.stdout if stream is None else stream,
                delay=pace.delay_s,
                leave=False,
                position=1,
                dynamic_ncols=True,
                mininterval=0.5,
            )

    def update(self, done: int) -> None:
        """`done` units of the pass are done."""
        if not self.enabled:
            return
        self.done = done
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
            return
        now = self.clock()
        if now >= self.next_line:
            logger.info("%s: %d/%d %s, %.0f s", self.label, done, self.total, self.unit, now - self.started)
            self.lines += 1
            self.next_line = now + self.every_s

    def close(self) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        elif self.lines:
            logger.info(
                "%s: %d/%d %s done in %.0f s", self.label, self.done, self.total, self.unit, self.clock() - self.started
            )
        self.enabled = False
