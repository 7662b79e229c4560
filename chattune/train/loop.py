"""The training loop every recipe runs: resume, update steps, metrics, evaluation, checkpoints.

Recipes differ in their data and their objective (`chattune.objectives.base.Objective`); everything from the
first step to the last is the same story, so it is told once here (`train`) and the recipes cannot drift apart:

- the run state (`chattune.checkpoint.run_state.training_state`): model, optimizer, scheduler, data position, RNG,
  skip counters and fp16's loss scale, by name; restored from a checkpoint on resume (`resume=auto|PATH|null`);
- each step (`UpdateSteps`): its microbatches (`StepFeed`, epochs in lockstep), the shared update step, a
  mixture's per-source figures and online update (`chattune.data.ingest.mixing_policy`), the epoch's figures when it
  closes; a non-finite loss or gradient: the update is skipped on every rank (counted) or the run stops;
- after each step, the components decide for themselves whether it is their turn (`due(step)`): the metric
  logger (every `log_every` steps and at the end), the evaluator (held-out metrics and sample replies at
  step 0, every `eval_every` steps and at the end) and the checkpointer (every `save_every` steps, and before
  a stop: `stop_after_step` for a job's time slice, or a stop signal), all reading where the run ends from
  one `Horizon`;
- at the end, a Hugging Face directory that loads without chattune.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from chattune import interrupts
from chattune.checkpoint.checkpoint import BackgroundSaves, Checkpointer
from chattune.checkpoint.output_dir import StartingPoint, release_output_dir, write_completion
from chattune.checkpoint.resume import resume_training
from chattune.checkpoint.run_state import Every, Horizon, SkippedSteps, training_state
from chattune.checkpoint.snapshot import Snapshots, SnapshotsWhenSlow, advise, killing_grace_s
from chattune.config.schema import RunConfig
from chattune.config.typed import config_dict
from chattune.data.documents import SKIP_REASONS
from chattune.data.feed import DocumentLedger, StepSource
from chattune.data.ingest.report import epoch_line
from chattune.data.ingest.sources import row_budget
from chattune.distributed import ParallelDims, reduce_sums
from chattune.errors import UserError
from chattune.faults import maybe_crash, maybe_slow
from chattune.model.build import BuiltModel
from chattune.model.cost.flops import batch_flops, peak_flops
from chattune.model.io.export import export_run
from chattune.model.sequence_score import PackedSequenceScorer
from chattune.objectives.base import Objective
from chattune.parallel.expert_parallel import routing_figures
from chattune.parallel.fsdp import Placement, compiled_graphs
from chattune.train.callbacks import Callback, SaveCheckpoints, ShowProgress, StepReport, Update
from chattune.train.evaluation import Evaluator
from chattune.train.in_backward import UpdateInBackward
from chattune.train.inputs import TrainingData
from chattune.train.metrics import MetricLogger, StepFlops, StepSeconds, StepTimer, step_metrics
from chattune.train.progress import Progress
from chattune.train.samples import run_samples
from chattune.train.step import LossScale, StepResult, UpdateRule, train_step

logger = logging.getLogger(__name__)


@dataclass
class Learning:
    """What a recipe trains the model with: the `objective` every update step minimises, the `optimizer` and
    its learning-rate `scheduler`, and the objective that scores the held-out batches where they need their
    own (`eval_objective`: e.g. cached reference log-probs of the eval records; None: `objective`)."""

    objective: Objective
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    eval_objective: Objective | None = None


def train(
    cfg: RunConfig,
    dims: ParallelDims,
    start: StartingPoint,
    built: BuiltModel,
    data: TrainingData,
    learning: Learning,
    tokenizer: PreTrainedTokenizerBase,
    callbacks: Sequence[Callback] = (),
) -> None:
    """Collective: train until max_steps (or data.num_epochs), then write the Hugging Face directory
    `output_dir/hf`; or stop after `stop_after_step` or a stop signal, its checkpoint saved. `start` is what the
    launch continues (`chattune.checkpoint.output_dir.claim_output_dir`); `built` and `data` are the builder's and
    the data set-up's results. With LoRA (`built.peft_model`), the export is a peft adapter directory,
    `output_dir/adapter`, and with export.merge the merged model in `hf`. The steps come from `data.feed`, any
    `chattune.data.feed.StepSource`; `callbacks` are the recipe's own components, called after the run's
    (`chattune.train.callbacks`)."""
    run = set_up(cfg, dims, start, built, data, learning, tokenizer, callbacks)
    feed = data.feed
    for callback in run.callbacks:
        callback.pre_train(run.start_step)

    last_step = run.start_step
    for step in range(run.start_step + 1, cfg.max_steps + 1):
        if feed.finished:  # resumed after the last epoch
            break
        # A stop signal that came after the last step's all-reduce stops the run here, with that step's
        # checkpoint: a stop never starts a step. (A fresh run's first step starts regardless: nothing is
        # trained yet to save, and a stop during the set-up is cheaper to finish than to relaunch.)
        if step > 1 and run.horizon.stops_before(step):
            return stop(run, step - 1)
        for callback in run.callbacks:
            callback.pre_step(step)
        update = run.updates.run(step)
        last_step = step
        run.horizon.hear(update.result.stop_ranks)  # a stop signal on any rank (agreed in the step's all-reduce)
        for callback in run.callbacks:  # metrics and evaluations, progress, checkpoints, then the recipe's own
            callback.post_step(update)
        if run.horizon.stops_after(step) and not run.horizon.is_last(step):
            return stop(run, step)
        if run.horizon.signalled:  # the last step: the run is complete, and its export is what a relaunch would do
            logger.info(
                "%s during the last step: the run is complete, exporting",
                interrupts.signal_name(interrupts.requested()),
            )
        if feed.finished:
            logger.info("data.num_epochs=%d epochs done at step %d", cfg.data.num_epochs, step)
            break
    for callback in run.callbacks:
        callback.post_train(last_step)
        callback.close()
    finish(cfg, dims, built, run, tokenizer, last_step)


class UpdateSteps:
    """The run's update steps, one `run(step)` each: the step's microbatches from `feed`, the shared update
    step (`chattune.train.step.train_step`), a skipped update counted in `skipped` (or the run stopped, with
    nonfinite_loss=stop), a mixture's figures and online update, the epochs the step closed; and a logged
    step's metrics (`metrics`)."""

    def __init__(
        self,
        cfg: RunConfig,
        model: torch.nn.Module,
        learning: Learning,
        feed: StepSource,
        skipped: SkippedSteps,
        loss_scale: LossScale,
        placement: Placement,
        ledger: DocumentLedger | None = None,
    ):
        self.cfg, self.model, self.learning, self.feed = cfg, model, learning, feed
        self.placement, self.dims, self.device = placement, placement.dims, placement.device
        self.skipped, self.loss_scale, self.ledger = skipped, loss_scale, ledger
        device = self.device
        self.timer = StepTimer(device)
        # plain torchrun's, where nothing else saves a stop (snapshot_steps=auto starts snapshots instead)
        self.grace = killing_grace_s(snapshots_on=cfg.snapshot_steps is not False)
        self.advised = False  # said that steps outlast it (`advise`)
        self.peak = peak_flops(device)  # the device's peak FLOP/s (MFU), None where unknown
        in_backward = getattr(cfg.optimizer, "in_backward", False)  # (a library caller's config may leave it out)
        self.in_backward = UpdateInBackward(model, learning.optimizer, placement) if in_backward else None

    def run(self, step: int) -> Update:
        """Collective: update step `step` (its microbatches: grad_accum_steps per rank, or with world-size-invariant
        steps this rank's share of data.microbatches_per_step)."""
        learning, feed = self.learning, self.feed
        self.timer.start()
        lr = float(learning.scheduler.get_last_lr()[0])  # a (CPU) tensor under torchao's optimizers
        batches = feed.next_step(step)
        self.timer.data_ready()
        if self.ledger:
            self.ledger.write(step, batches)
        maybe_crash("step", step)  # fault injection for the crash tests (CHATTUNE_CRASH_AT); a no-op otherwise
        maybe_slow("step", step)  # and for the preemption tests (CHATTUNE_SLOW_AT)
        result, grad_norm = train_step(
            self.model,
            learning.objective,
            batches,
            UpdateRule(
                learning.optimizer, learning.scheduler, self.cfg.max_grad_norm, self.loss_scale, self.in_backward
            ),
            self.placement,
            stop_requested=lambda: interrupts.requested() is not None,
        )
        self.timer.stop()
        result.figures.update(batches.figures)  # (a rollout's figures: summed over ranks with the step's own)
        host_seconds = self.timer.host_seconds()
        self.advised = self.advised or advise(host_seconds, self.grace)
        closed_epochs = feed.close_step(result.ranks_at_epoch_end)
        if result.global_units == 0 and step == 1:  # (with the data report on, caught before the model loads)
            raise UserError(
                f"the first step has no {learning.objective.unit_name} on any rank: its records were all "
                "skipped or train nothing; `chattune inspect` with this config shows what each record gives"
            )
        self._count_skipped(step, result, grad_norm)
        update = Update(step, result, grad_norm, lr, batches, host_seconds)
        if feed.mixer is not None:  # a mixture: per-source sums, and online mixing's update (collective)
            feed.mixer.observe(result.figures, math.isfinite(grad_norm))
            update.mixing = feed.mixer.maybe_update(step, self.device)
        for epoch, epoch_counts in closed_epochs:  # the step closed an epoch on every rank: its exact figures
            logger.info(
                "epoch %d done at step %d: %s",
                epoch,
                step,
                epoch_line(reduce_sums(epoch_counts, self.device), row_budget(self.cfg.data, self.dims.cp)[0]),
            )
        return update

    def _count_skipped(self, step: int, result: StepResult, grad_norm: float) -> None:
        if result.overflow:  # fp16: the loss scale was too high for this step; LossScale has lowered it
            self.skipped.count("overflow_skipped_steps")
            logger.info(
                "step %d: fp16 gradients overflowed, update skipped; loss scale now %g", step, self.loss_scale.scale
            )
        elif not math.isfinite(grad_norm):  # every rank sees the same NaN norm, so all decide alike
            if self.cfg.nonfinite_loss == "stop":
                raise FloatingPointError(
                    f"step {step}: non-finite loss or gradients; the optimizer did not step. "
                    "The last checkpoint is intact (resume=auto continues from it)."
                )
            skipped = self.skipped.count("nonfinite_skipped_steps")
            logger.warning("step %d: non-finite loss or gradients, update skipped (%d so far)", step, skipped)

    def metrics(self, update: Update) -> dict[str, float]:
        """Collective: the metrics a logged step reports, over all ranks: the step's own (`step_metrics`), its
        epoch, the run's skip counters and a mixture's update, the loss scale, compiled graphs, and a mixture's
        per-source figures."""
        model, device = self.model, self.device
        flops = getattr(model, "flops", None)  # PackedCausalLM's FLOP counts
        # Model FLOPs only where MFU is reported (a known peak), and only on the steps that log it. A row's FLOPs
        # count once over all ranks (context parallelism: on the group's first rank; the group shares them).
        step_flops = (
            sum(batch_flops(flops, b) for b in update.batches.microbatches)
            if flops and self.peak and self.dims.reports_rows
            else 0.0
        )
        metrics = step_metrics(
            update.step,
            update.result,
            self.learning.objective,
            update.grad_norm,
            update.lr,
            StepSeconds(
                self.timer.seconds(), {"data_wait_s": self.timer.data_wait_seconds(), "gc_s": self.timer.gc_seconds()}
            ),
            device,
            StepFlops(step_flops, self.peak),
        )
        metrics.update({"epoch": update.batches.epoch, **self.skipped.counts, **(update.mixing or {})})
        if self.loss_scale.enabled:
            metrics["loss_scale"] = self.loss_scale.scale
        if self.placement.compiled:  # as the builder decided (a 4-bit base stays uncompiled under model.compile=auto)
            metrics["compiled_graphs"] = compiled_graphs()
        if self.feed.mixer is not None:
            metrics.update(self.feed.mixer.metrics(device))
        metrics.update(routing_figures(model, device))  # (split experts only)
        return metrics


@dataclass
class Run:
    """A run's parts, as `set_up` made them: the step it starts after, its update steps, where it ends, and
    the components that act after a step."""

    start_step: int
    updates: UpdateSteps
    horizon: Horizon
    metric_logger: MetricLogger
    evaluator: Evaluator
    checkpointer: Checkpointer
    progress: Progress
    callbacks: list[Callback]  # the run's components (`chattune.train.callbacks`), then the recipe's


def set_up(
    cfg: RunConfig,
    dims: ParallelDims,
    start: StartingPoint,
    built: BuiltModel,
    data: TrainingData,
    learning: Learning,
    tokenizer: PreTrainedTokenizerBase,
    callbacks: Sequence[Callback] = (),
) -> Run:
    """Collective: the run state, restored from the checkpoint `start` continues (if any), and the loop's
    components, each told its timing."""
    device, output_dir, model, feed = dims.device, Path(cfg.output_dir), built.model, data.feed
    # fp16 compute needs loss scaling (its gradients underflow otherwise); bf16 and fp32 run unscaled.
    loss_scale = LossScale(enabled=built.placement.compute_dtype == "float16")
    skipped = SkippedSteps(overflow=loss_scale.enabled)
    state = training_state(model, learning.optimizer, learning.scheduler, feed, skipped, loss_scale)
    resumed = start.resume_from is not None
    start_step = resume_training(start.resume_from, start.accepted, state) if start.resume_from is not None else 0
    interrupts.note_checkpoint(start.resume_from)  # what a stop cut short keeps, until this run commits its own
    if resumed:
        logger.info("resumed from %s at step %d (epoch %d)", start.resume_from, start_step, feed.epoch)
    horizon = Horizon(cfg.max_steps, cfg.stop_after_step, feed, interrupts.StopVote())
    metric_logger = MetricLogger(
        str(output_dir),
        dims.is_main,
        cfg.logger,
        resume_step=start_step if resumed else None,
        run_config=config_dict(cfg),
        wandb_kwargs=config_dict(cfg.wandb),
        wandb_id=start.checkpoint_manifest.get("wandb_id"),
        every=Every(cfg.log_every, horizon),
    )
    # (one ledger per row: a context group's other ranks train the same documents)
    ledger = (
        DocumentLedger(output_dir, dims.rank, start_step, data.train.origin if data.train is not None else None)
        if cfg.ledger and dims.reports_rows
        else None
    )
    # Every checkpoint's manifest: what a resume checks, and the wandb run it continues.
    manifest = {**start.identity, "wandb_id": metric_logger.wandb_id}
    background = BackgroundSaves(device) if cfg.save_async else None  # checkpoints written while training goes on
    checkpointer = Checkpointer(
        output_dir / "checkpoints", state, manifest, cfg.save_every, cfg.keep_last_n, horizon, background
    )

    def start_snapshots() -> Snapshots:  # every step's state in host memory, written on a stop signal
        snapshots = Snapshots(
            checkpointer.root, state, manifest, checkpointer.extra_files(), device, learning.optimizer
        )
        snapshots.watch()
        return snapshots

    if cfg.snapshot_steps is True:
        checkpointer.snapshots = start_snapshots()
    elif cfg.snapshot_steps == "auto" and (grace := killing_grace_s(snapshots_on=False)) is not None:
        checkpointer.when_slow = SnapshotsWhenSlow(grace, start_snapshots)  # (plain torchrun: a stop has a grace)
    # eval.samples: a few prompts answered at every evaluation, into samples.jsonl (and wandb)
    samples = run_samples(
        cfg,
        tokenizer,
        dims,
        start_step if resumed else None,
        data.held_out_records,
        metric_logger.wandb_run,
        model.hf_model,
    )
    progress = Progress(start_step, cfg.max_steps, cfg.progress, dims.is_main)  # a bar on a terminal, else lines
    metric_logger.step_lines = not progress.shows_bar  # the bar shows the steps; held-out results still print
    # data.eval's sources, data.eval_split's held-out records, or both (None: no held-out data)
    # (a recipe that makes its own steps may score held-out data its own way: the GRPO recipe's prompts)
    held_out = data.eval_batches if data.eval is not None else data.held_out_scorer
    evaluator = Evaluator(
        model,
        learning.eval_objective or learning.objective,
        held_out,
        data.pad_id,
        built.placement,
        samples,
        Every(cfg.eval_every, horizon),
        progress,
    )
    updates = UpdateSteps(cfg, model, learning, feed, skipped, loss_scale, built.placement, ledger)
    components: list[Callback] = [
        StepReport(metric_logger, evaluator, updates.metrics),
        ShowProgress(progress, metric_logger),
        SaveCheckpoints(checkpointer),
    ]
    return Run(
        start_step, updates, horizon, metric_logger, evaluator, checkpointer, progress, [*components, *callbacks]
    )


def stop(run: Run, step: int) -> None:
    """Collective: the end of a run that stops after `step` to be continued (stop_after_step, a stop signal),
    its checkpoint saved: committed, and the run's files closed. A stop signal raises `interrupts.Preempted`."""
    checkpointer = run.checkpointer
    checkpointer.settle_snapshots(step)  # a step its snapshot already wrote is not saved again
    if step > run.start_step and not checkpointer.holds(step):  # stopped before a step: the last one's checkpoint
        checkpointer.save(step)
    checkpointer.close()  # the checkpoint is committed before the job's slice ends
    interrupts.stop_over()
    for callback in run.callbacks:
        callback.close()
    run.updates.feed.close()
    run.metric_logger.close()
    release_output_dir()
    if run.horizon.signalled:  # every rank stops here, after the same step
        saved = (
            f"checkpoint {checkpointer.last_saved} saved in {time.perf_counter() - checkpointer.last_started:.1f} s"
            if step > run.start_step
            else "nothing trained since the checkpoint it resumed from"
        )
        raise interrupts.Preempted(
            f"stopped by {interrupts.signal_name(interrupts.requested())} after step {step}: {saved}; run the same "
            "command again to continue"
        )
    logger.info("stop_after_step=%d: checkpoint saved; resume=auto continues this run", step)


def finish(
    cfg: RunConfig, dims: ParallelDims, built: BuiltModel, run: Run, tokenizer: PreTrainedTokenizerBase, step: int
) -> None:
    """Collective: the end of a run that reached its last step, `step`: the records skipped over the run, the last
    checkpoint committed, then the export (a Hugging Face directory, and with LoRA the adapter directory), and
    the record that the run is complete (`chattune.checkpoint.output_dir.write_completion`)."""
    device, output_dir = dims.device, Path(cfg.output_dir)
    if counted := run.updates.feed.skipped:  # (a recipe's own steps may skip nothing: {})
        skipped = reduce_sums(counted, device)
        logger.info(
            "training records over all ranks and epochs: skipped %s; over the budget and kept %s",
            {k: int(skipped.get(k, 0)) for k in SKIP_REASONS},
            {k: int(skipped[k]) for k in skipped if k not in SKIP_REASONS},
        )

    run.checkpointer.settle_snapshots(None)  # no snapshot written during the export
    run.checkpointer.close()
    metric_logger = run.metric_logger
    # --- save: a Hugging Face directory that loads without chattune (and with LoRA, the adapter directory) ---
    written = export_run(cfg, built, tokenizer, output_dir, dims.is_main)
    metric_logger.log_summary({f"{name}_dir": str(path.resolve()) for name, path in written.items()})
    metric_logger.close()
    if dims.is_main:
        write_completion(cfg, run.checkpointer.manifest, step, sorted(written))
    interrupts.stop_over()  # (a signal in the last step: its export is written)
    run.updates.feed.close()
    release_output_dir()
    scores, base_saved = isinstance(built.model, PackedSequenceScorer), cfg.peft is None or cfg.model.path is not None
    logger.info("%s", done_line(output_dir, written, scores=scores, base_saved=base_saved))


def done_line(output_dir: Path, written: dict[str, Path], scores: bool, base_saved: bool = True) -> str:
    """The last line of a complete run: its export, and what to do with it (`scores`: a reward model, which
    scores conversations and writes no reply: `chattune chat` is for the models that reply; not `base_saved`:
    adapters on a random-init base, which no one can load again unless merged into it)."""
    exported = written.get("hf", written.get("adapter"))
    curves = f"its curves: chattune plot {output_dir}"
    if importlib.util.find_spec("matplotlib") is None:  # not in chattune's own requirements (the plot extra)
        curves += ", after pip install matplotlib"
    if not base_saved and "hf" not in written:
        return (
            f"done: {exported} (its base is a random-init model saved nowhere, so nothing can load this adapter: "
            f"train with export.merge=true for the merged model in output_dir/hf; {curves})"
        )
    if not scores:
        return f"done: {exported} (talk to it: chattune chat {output_dir}; {curves})"
    loads = (
        f"AutoModelForSequenceClassification.from_pretrained('{exported}')"
        if "hf" in written
        else "PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(BASE, num_labels=1), "
        f"'{exported}')"
    )
    return f"done: {exported} (a reward model: it scores conversations, with {loads}, docs/reward.md; {curves})"
