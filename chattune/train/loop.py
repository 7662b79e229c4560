"""The training loop every recipe runs: resume, update steps, metrics, evaluation, checkpoints.

Recipes differ in their data and their objective (`chattune.objectives.base.Objective`); everything from the
first step to the last is the same story, so it is told once here and SFT and DPO cannot drift apart:

- resume (`resume=auto|PATH|null`): model, optimizer, scheduler, data position, RNG and counters;
- held-out metrics at step 0 (known without a forward where the objective says so: DPO against the initial
  policy), then every `eval_every` steps and at the end, each with the sample replies of `eval.samples` prompts;
- each step: its microbatches (`StepFeed`, epochs in lockstep), the shared update step, a mixture's
  per-source figures and online update (`chattune.data.mixing_policy`), the epoch's figures when it closes,
  metrics every `log_every` steps;
- a non-finite loss or gradient: the update is skipped on every rank (counted) or the run stops;
- checkpoints every `save_every` steps, and `stop_after_step` for a job's time slice;
- at the end, a Hugging Face directory that loads without chattune.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from transformers import PreTrainedTokenizerBase

from chattune import interrupts
from chattune.data.documents import SKIP_REASONS
from chattune.data.report import epoch_line
from chattune.data.sources import row_budget
from chattune.distributed import DistInfo, counts_rows, reduce_sums
from chattune.errors import UserError
from chattune.model.build import BuiltModel
from chattune.model.export import export_adapter, export_dtype, export_hf
from chattune.model.flops import batch_flops, peak_flops
from chattune.model.fsdp import compiled_graphs
from chattune.objectives.base import Objective
from chattune.train.checkpoint import BackgroundSaves
from chattune.train.evaluation import evaluate
from chattune.train.faults import maybe_crash, maybe_slow
from chattune.train.feed import DocumentLedger, StepBatches, StepFeed
from chattune.train.inputs import TrainingData
from chattune.train.metrics import MetricLogger, StepTimer, step_metrics
from chattune.train.output_dir import RunStart, release_output_dir
from chattune.train.progress import Progress
from chattune.train.resume import resume_training, save_training
from chattune.train.samples import run_samples
from chattune.train.step import LossScale, StepResult, train_step

logger = logging.getLogger(__name__)


def train(cfg: DictConfig, dist_info: DistInfo, start: RunStart, built: BuiltModel, data: TrainingData,
          objective: Objective, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
          tokenizer: PreTrainedTokenizerBase, eval_objective: Objective | None = None) -> None:
    """Collective: train until max_steps (or data.num_epochs), then write the Hugging Face directory
    `output_dir/hf`; or stop after `stop_after_step`, its checkpoint saved. `start` is what the launch
    continues (`chattune.train.output_dir.claim_output_dir`); `built` and `data` are the builder's and the data
    set-up's results. `eval_objective` scores the held-out batches when they need their own (e.g. cached
    reference log-probs of the eval records). With LoRA (`built.peft_model`), the export is a peft adapter
    directory, `output_dir/adapter`, and with export.merge the merged model in `hf`."""
    device, output_dir = dist_info.device, Path(cfg.output_dir)
    model, feed, eval_batches, pad_id = built.model, data.feed, data.eval_batches, data.pad_id
    eval_objective = eval_objective or objective

    # --- resume: model, optimizer, scheduler, data position and RNG, or a fresh start ---
    checkpoints = output_dir / "checkpoints"
    counters = {"nonfinite_skipped_steps": 0}
    # fp16 compute needs loss scaling (its gradients underflow otherwise); bf16 and fp32 run unscaled.
    loss_scale = LossScale(enabled=model.compute_dtype == "float16")
    if loss_scale.enabled:
        counters["overflow_skipped_steps"] = 0
    start_step, wandb_id = 0, None
    if start.resume_from is not None:
        start_step, saved_counters = resume_training(start.resume_from, start.plan, model, optimizer, scheduler, feed,
                                                     loss_scale)
        counters.update(saved_counters)
        wandb_id = start.checkpoint_meta.get("wandb_id")
        logger.info("resumed from %s at step %d (epoch %d)", start.resume_from, start_step, feed.epoch)
    metric_logger = MetricLogger(
        str(output_dir), dist_info.is_main, cfg.logger, resume_step=start_step if start.resume_from else None,
        run_config=OmegaConf.to_container(cfg, resolve=True), wandb_kwargs=OmegaConf.to_container(cfg.wandb),
        wandb_id=wandb_id,
    )
    # Written with every checkpoint (rank 0's): what a resume checks, and the wandb run it continues.
    meta = {**start.meta, "wandb_id": metric_logger.wandb_id}
    # (one ledger per row: a context group's other ranks train the same documents)
    ledger = (DocumentLedger(output_dir, dist_info.rank, start_step, data.train.origin) if cfg.ledger and counts_rows()
              else None)
    background = BackgroundSaves(device) if cfg.save_async else None  # checkpoints written while training goes on
    # eval.samples: a few prompts answered at every evaluation, into samples.jsonl (and wandb)
    samples = run_samples(cfg, tokenizer, dist_info, start_step if start.resume_from else None, data.held_out_records,
                          metric_logger.wandb_run)
    has_eval = data.eval is not None  # data.eval's sources, data.eval_split's held-out records, or both
    evaluating = cfg.eval_every > 0 and (has_eval or samples is not None)

    progress = Progress(start_step, cfg.max_steps, cfg.progress, dist_info.is_main)  # a bar on a terminal, else lines
    metric_logger.step_lines = not progress.shows_bar  # the bar shows the steps; held-out results still print
    if evaluating and start_step == 0:  # the starting point of the held-out curve
        if has_eval:
            metric_logger.log({"step": 0, **start_metrics(model, eval_objective, eval_batches, device, pad_id, progress)})
        if samples is not None:
            samples(model, 0)
    timer = StepTimer(device)
    peak = peak_flops(device)  # the device's peak FLOP/s (MFU), None where unknown

    # --- training loop: one update step = grad_accum_steps microbatches on every rank ---
    for step in range(start_step + 1, cfg.max_steps + 1):
        if feed.finished:  # resumed after the last epoch
            break
        timer.start()
        lr = scheduler.get_last_lr()[0]
        batches = feed.next_step(step)
        if ledger:
            ledger.write(step, batches)
        maybe_crash("step", step)  # fault injection for the crash tests (CHATTUNE_CRASH_AT); a no-op otherwise
        maybe_slow("step", step)  # and for the preemption tests (CHATTUNE_SLOW_AT)
        result, grad_norm = train_step(model, objective, batches, optimizer, scheduler, cfg.max_grad_norm, device,
                                       loss_scale=loss_scale, stop=interrupts.requested() is not None)
        timer.stop()
        closed_epochs = feed.close_step(result.ranks_at_epoch_end)
        if result.global_units == 0 and step == 1:  # (with the data report on, caught before the model loads)
            raise UserError(f"the first step has no {objective.unit_name} on any rank: its records were all skipped "
                            "or train nothing; `chattune inspect` with this config shows what each record gives")
        if result.overflow:  # fp16: the loss scale was too high for this step; LossScale has lowered it
            counters["overflow_skipped_steps"] += 1
            logger.info("step %d: fp16 gradients overflowed, update skipped; loss scale now %g", step, loss_scale.scale)
        elif not math.isfinite(grad_norm):  # every rank sees the same NaN norm, so all decide alike
            if cfg.nonfinite_loss == "stop":
                raise FloatingPointError(f"step {step}: non-finite loss or gradients; the optimizer did not step. "
                                         "The last checkpoint is intact (resume=auto continues from it).")
            counters["nonfinite_skipped_steps"] += 1
            logger.warning("step %d: non-finite loss or gradients, update skipped (%d so far)", step,
                           counters["nonfinite_skipped_steps"])

        mixing = None
        if feed.mixer is not None:  # a mixture: per-source sums, and online mixing's update (collective)
            feed.mixer.observe(result.figures, math.isfinite(grad_norm))
            mixing = feed.mixer.maybe_update(step, device)

        for epoch, epoch_counts in closed_epochs:  # the step closed an epoch on every rank: its exact figures
            logger.info("epoch %d done at step %d: %s", epoch, step,
                        epoch_line(reduce_sums(epoch_counts, device), row_budget(cfg.data, cfg.parallel.context)[0]))
        is_last = step == cfg.max_steps or feed.finished
        signalled = result.stop_ranks > 0  # a stop signal on any rank (agreed in the step's all-reduce)
        # Decided from the config and the step's all-reduce: evaluate() is collective, every rank must agree to
        # enter it (not on a signalled stop, whose grace period belongs to the checkpoint).
        is_eval = evaluating and (step % cfg.eval_every == 0 or is_last) and not signalled
        if step % cfg.log_every == 0 or is_last or is_eval or mixing:
            metrics = logged_metrics(step, result, grad_norm, lr, timer.seconds(), batches, model, objective, device,
                                     {**counters, **(mixing or {})}, loss_scale, feed, peak)
            if is_eval and has_eval:
                metrics.update(evaluate(model, eval_objective, eval_batches, device, pad_id, progress))
            metric_logger.log(metrics)
        if is_eval and samples is not None:
            samples(model, step)
        progress.update(step, metric_logger.last)
        stopping = step == cfg.stop_after_step or signalled
        if (cfg.save_every and step % cfg.save_every == 0) or stopping:
            saving = time.perf_counter()
            save_training(checkpoints, step, model, optimizer, scheduler, feed, meta, counters, cfg.keep_last_n, loss_scale,
                          background)
        if stopping:
            if background is not None:
                background.close()  # the checkpoint is committed before the job's slice ends
            progress.close()
            metric_logger.close()
            release_output_dir()
            if signalled:  # every rank stops here, after the same step
                raise interrupts.Preempted(
                    f"stopped by {interrupts.signal_name(interrupts.requested())} after step {step}: checkpoint "
                    f"{checkpoints / f'step_{step}'} saved in {time.perf_counter() - saving:.1f} s; run the same command "
                    "again to continue")
            logger.info("stop_after_step=%d: checkpoint saved; resume=auto continues this run", step)
            return
        if feed.finished:
            logger.info("data.num_epochs=%d epochs done at step %d", cfg.data.num_epochs, step)
            break
    progress.close()
    finish(cfg, dist_info, built, feed, tokenizer, metric_logger, background)


def start_metrics(model: torch.nn.Module, objective: Objective, batches: list, device: torch.device, pad_id: int,
                  progress: Progress) -> dict[str, float]:
    """Collective: the held-out metrics before the first step (`eval_*`): those the objective knows without a
    forward (`known_start_metrics`: DPO whose reference is the initial policy), else an evaluation."""
    known = getattr(objective, "known_start_metrics", None)
    metrics = known(batches, device) if known is not None else None
    if metrics is None:
        return evaluate(model, objective, batches, device, pad_id, progress)
    logger.info("step 0: held-out metrics known without evaluating (the reference is the initial policy: every "
                "reward 0, loss %.6g)%s", metrics["loss"],
                "" if "logps/chosen" in metrics else "; logps/* are left out: they need the model's forward")
    return {f"eval_{name}": value for name, value in metrics.items()}


def logged_metrics(step: int, result: StepResult, grad_norm: float, lr: float, step_time_s: float,
                   batches: StepBatches, model: torch.nn.Module, objective: Objective, device: torch.device,
                   counts: dict, loss_scale: LossScale, feed: StepFeed, peak: float | None) -> dict[str, float]:
    """Collective: the metrics a logged step reports, over all ranks: the step's own (`step_metrics`), its
    epoch, the run's skip counters and a mixture's update (`counts`), the loss scale, compiled graphs, and a
    mixture's per-source figures. `peak`: the device's peak FLOP/s, for MFU (None: unknown)."""
    flops = getattr(model, "flops", None)  # PackedCausalLM's FLOP counts
    # Model FLOPs only where MFU is reported (a known peak), and only on the steps that log it.
    # A row's FLOPs count once over all ranks (context parallelism: on the group's first rank; the group shares them)
    step_flops = sum(batch_flops(flops, b) for b in batches.microbatches) if flops and peak and counts_rows() else 0.0
    metrics = step_metrics(step, result, objective, grad_norm, lr, step_time_s, device, step_flops, peak)
    metrics.update(epoch=batches.epoch, **counts)
    if loss_scale.enabled:
        metrics["loss_scale"] = loss_scale.scale
    if model.compiled:  # as the builder decided (a 4-bit base stays uncompiled under model.compile=auto)
        metrics["compiled_graphs"] = compiled_graphs()
    if feed.mixer is not None:
        metrics.update(feed.mixer.metrics(device))
    return metrics


def finish(cfg: DictConfig, dist_info: DistInfo, built: BuiltModel, feed: StepFeed, tokenizer: PreTrainedTokenizerBase,
           metric_logger: MetricLogger, background: BackgroundSaves | None) -> None:
    """Collective: the end of a run that reached its last step: the records skipped over the run, the last
    checkpoint committed, then the export (a Hugging Face directory, and with LoRA the adapter directory)."""
    device, output_dir, peft_model = dist_info.device, Path(cfg.output_dir), built.peft_model
    skipped = reduce_sums(feed.skipped, device)
    logger.info("training records over all ranks and epochs: skipped %s; over the budget and kept %s",
                {k: int(skipped[k]) for k in SKIP_REASONS}, {k: int(skipped[k]) for k in skipped if k not in SKIP_REASONS})

    if background is not None:
        background.close()
    # --- save: a Hugging Face directory that loads without chattune ---
    dtype = export_dtype(cfg.export.dtype, built.model.source_dtype)
    if peft_model is not None:
        export_adapter(built.model, peft_model, tokenizer, output_dir / "adapter", dist_info.is_main, cfg.model.path)
        metric_logger.log_summary({"adapter_dir": str((output_dir / "adapter").resolve())})
    if peft_model is None or cfg.export.merge:
        export_hf(built.model, tokenizer, output_dir / "hf", dist_info.is_main, dtype)  # adapters merged, if any
        metric_logger.log_summary({"hf_dir": str((output_dir / "hf").resolve())})
    metric_logger.close()
    release_output_dir()
    logger.info("done: %s", output_dir / ("hf" if peft_model is None or cfg.export.merge else "adapter"))
