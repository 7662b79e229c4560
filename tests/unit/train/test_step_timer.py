"""chattune.train.metrics.StepTimer's parts of a step (`data_wait_s`, `gc_s`): what a slow step's time went to when
nothing in it compiled, each against a clock read around the work itself."""

from __future__ import annotations

import gc
import time

import pytest
import torch

from chattune.objectives.cross_entropy import TokenCrossEntropy
from chattune.train.metrics import StepSeconds, StepTimer, step_metrics
from chattune.train.step import StepResult


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_the_timer_splits_out_the_data_wait_and_the_garbage_collectors_time():
    timer = StepTimer(torch.device("cpu"))
    timer.start()
    time.sleep(0.05)  # the feed
    timer.data_ready()
    gc.disable()  # (no collection of the allocator's own in this window: the one below alone)
    try:
        garbage = [_Cycle() for _ in range(200_000)]
        del garbage
        collected = time.perf_counter()
        gc.collect()
        collected = time.perf_counter() - collected
    finally:
        gc.enable()
    timer.stop()
    assert 0.05 <= timer.data_wait_seconds() <= timer.host_seconds()
    assert 0.5 * collected <= timer.gc_seconds() <= collected  # the collection's own time, measured by its callbacks
    timer.start()  # a step without either
    timer.data_ready()
    timer.stop()
    assert timer.data_wait_seconds() < 0.01 and timer.gc_seconds() < 0.01


def test_the_step_metrics_report_them_as_the_mean_over_ranks():
    result = StepResult(loss_sum=20.0, local_units=10, global_units=10, local_tokens=16)
    seconds = StepSeconds(2.0, {"data_wait_s": 0.25, "gc_s": 0.5})
    metrics = step_metrics(3, result, TokenCrossEntropy(), 1.0, 1e-3, seconds, torch.device("cpu"))
    assert metrics["data_wait_s"] == pytest.approx(0.25) and metrics["gc_s"] == pytest.approx(0.5)
    assert metrics["step_time_s"] == pytest.approx(2.0)
    assert "gc_s" not in step_metrics(3, result, TokenCrossEntropy(), 1.0, 1e-3, 2.0, torch.device("cpu"))
