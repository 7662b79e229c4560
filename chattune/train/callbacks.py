"""The loop's components as callbacks: `train` calls each at fixed points, and each decides for itself whether it is
its turn (OLMo-core's callbacks: every hook does nothing unless a component overrides it).

The run's own components are callbacks here (the metrics and held-out evaluations, the progress display, the
checkpoints and snapshots); a recipe hands `train` more of its own (a generator's weight sync, a reward model's
figures), called after these in the order given. The stops stay in `train`: they end its loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from chattune.checkpoint.checkpoint import Checkpointer
from chattune.data.feed import StepBatches
from chattune.faults import maybe_slow
from chattune.train.evaluation import Evaluator
from chattune.train.metrics import MetricLogger
from chattune.train.progress import Progress
from chattune.train.step import StepResult

logger = logging.getLogger(__name__)


@dataclass
class Update:
    """One update step as it went: its result and gradient norm (NaN: skipped), the learning rate it used,
    its microbatches, the host's seconds for it, and a mixture's online update where the step made one."""

    step: int
    result: StepResult
    grad_norm: float
    lr: float
    batches: StepBatches
    host_seconds: float = 0.0
    mixing: dict[str, float] | None = None


class Callback:
    """A component of the loop. Collective where it runs collectives: every rank's `train` calls every hook alike."""

    def pre_train(self, start_step: int) -> None:
        """Before the first step of this launch (`start_step`: the step it continues after; 0 for a fresh run)."""

    def pre_step(self, step: int) -> None:
        """Before update step `step` takes its microbatches."""

    def post_step(self, update: Update) -> None:
        """After update step `update.step` (its all-reduce done: every rank knows the same figures)."""

    def post_train(self, last_step: int) -> None:
        """The run reached its last step, `last_step`, before the export."""

    def close(self) -> None:
        """This launch ends (complete or stopped to be continued)."""


class StepReport(Callback):
    """The metrics of the steps that log (`metric_logger`, its own `due`) and the held-out evaluations and sample
    replies (`evaluator`, its own `due`), in one line a step: a held-out result rides with its step's metrics.
    `step_metrics`: a logged step's metrics over all ranks (collective)."""

    def __init__(
        self, metric_logger: MetricLogger, evaluator: Evaluator, step_metrics: Callable[[Update], dict[str, float]]
    ):
        self.metric_logger, self.evaluator, self.step_metrics = metric_logger, evaluator, step_metrics

    def pre_train(self, start_step: int) -> None:
        """A fresh run's step 0: the starting point of the held-out curve."""
        evaluator = self.evaluator
        if start_step != 0 or not evaluator.due(0):
            return
        started = time.perf_counter()  # (on a CPU this can take minutes: said before, timed after)
        logger.info(
            "step 0: %s, before the first step (eval_every=0 and eval.samples=0 leave them out)", evaluator.describe()
        )
        if held_out := evaluator.held_out(0):
            self.metric_logger.log({"step": 0, **held_out})
        evaluator.sample(0)
        logger.info("step 0: evaluated in %.1f s", time.perf_counter() - started)

    def post_step(self, update: Update) -> None:
        # (collective: every rank decides alike; never after a stop signal, whose grace belongs to the checkpoint)
        step, evaluating = update.step, self.evaluator.due(update.step)
        if self.metric_logger.due(step) or evaluating or update.mixing:
            self.metric_logger.log(
                {**self.step_metrics(update), **(self.evaluator.held_out(step) if evaluating else {})}
            )
        if evaluating:
            self.evaluator.sample(step)


class ShowProgress(Callback):
    """The progress bar (a terminal) or lines, with the last logged metrics."""

    def __init__(self, progress: Progress, metric_logger: MetricLogger):
        self.progress, self.metric_logger = progress, metric_logger

    def post_step(self, update: Update) -> None:
        self.progress.update(update.step, self.metric_logger.last)

    def close(self) -> None:
        self.progress.close()


class SaveCheckpoints(Callback):
    """A checkpoint where `checkpointer` says one is due, else with snapshot_steps a copy of the step in host
    memory (`Checkpointer.after_step`, told how long the step took on the host)."""

    def __init__(self, checkpointer: Checkpointer):
        self.checkpointer = checkpointer

    def post_step(self, update: Update) -> None:
        maybe_slow("after_step", update.step)  # fault injection: work after the step's all-reduce, as a long save
        self.checkpointer.after_step(update.step, update.host_seconds)
