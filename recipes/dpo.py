"""Direct preference optimisation (DPO and relatives) of a chat model on packed preference pairs with FSDP2.

    torchrun --nproc_per_node 2 recipes/dpo.py [--config-name dpo/tiny] key=value ...

The same story as recipes/sft.py, told with preference pairs: each pair is one packed document of two
segments (chosen, rejected), the unit of the loss is the pair, and a frozen reference model (sharded
like the policy) gives the reference log-probs. Read top to bottom; copy this file to change the story.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import hydra
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from transformers import AutoTokenizer

from chattune.config import save_resolved_config
from chattune.data_report import count_lines, epoch_line, report_sample, scan_documents
from chattune.data_stream import PackedStream
from chattune.distributed import exit_process, init_distributed, shutdown_distributed
from chattune.evaluation import evaluate
from chattune.faults import maybe_crash
from chattune.fsdp import shard_model
from chattune.hf_export import export_hf
from chattune.log import setup_logging
from chattune.metrics import MetricLogger, reduce_sums, step_metrics
from chattune.model import PackedCausalLM, build_hf_model
from chattune.formats import SourceSpec
from chattune.resume import checkpoint_to_resume, resume_training, run_fingerprint, run_meta, save_training
from chattune.dpo_data import PairDocuments
from chattune.dpo_loss import PreferenceLoss
from chattune.dpo_objective import LiveReference, PreferenceObjective
from chattune.sft_data import RecordSource
from chattune.step_feed import DocumentLedger, StepFeed
from chattune.train_step import train_step

logger = logging.getLogger("chattune.dpo")


@hydra.main(config_path="../configs", config_name="dpo/tiny", version_base=None)
def main(cfg: DictConfig) -> None:
    # --- set-up: every rank composes the same config; rank 0 records it ---
    dist_info = init_distributed(cfg.device)
    setup_logging(dist_info.rank)
    device, output_dir = dist_info.device, Path(cfg.output_dir)
    if dist_info.is_main:
        save_resolved_config(cfg, output_dir)

    # --- data: each rank tokenizes (in loader workers) and packs only its own share of every epoch ---
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer.path)
    # Empty microbatches hold one token that nothing attends to and nothing trains: any valid id will do.
    pad_id = next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)

    def pair_documents(sources) -> PairDocuments:  # a pair: one document of two segments, chosen then rejected
        specs = [SourceSpec.from_config(entry) for entry in OmegaConf.to_container(sources, resolve=True)]
        return PairDocuments(RecordSource(specs), tokenizer, cfg.data.max_tokens_per_microbatch, cfg.data.overlong)

    def packed_stream(documents: PairDocuments, shuffle: bool, num_epochs: int | None) -> PackedStream:
        return PackedStream(
            documents, dist_info.rank, dist_info.world_size, cfg.seed, cfg.data.max_tokens_per_microbatch,
            pad_id, cfg.data.buffer_records, shuffle=shuffle, num_epochs=num_epochs, num_workers=cfg.data.num_workers,
            pad_to_multiple_of=cfg.data.pad_to_multiple_of,
        )

    train_documents = pair_documents(cfg.data.train)
    if cfg.data.report_records != 0:  # what the data holds, from a sample that the ranks count in parts
        sample = report_sample(len(train_documents), cfg.data.report_records, cfg.seed)
        counts = reduce_sums(scan_documents(train_documents, sample[dist_info.rank :: dist_info.world_size]).counts(), device)
        logger.info("training data (%d of %d records sampled): %s", len(sample), len(train_documents), "; ".join(count_lines(counts)))
    # Every step takes grad_accum_steps microbatches per rank; epochs end on the same step on every rank.
    feed = StepFeed(packed_stream(train_documents, shuffle=True, num_epochs=cfg.data.num_epochs),
                    cfg.grad_accum_steps, pad_id, num_epochs=cfg.data.num_epochs)
    eval_batches = list(packed_stream(pair_documents(cfg.data.eval), shuffle=False, num_epochs=1)) if cfg.data.eval else []

    # --- model: HF causal LM, chunked loss head, FSDP2 per decoder layer + root ---
    torch.manual_seed(cfg.seed)  # same seed on every rank: identical initial weights before sharding
    model_config = instantiate(cfg.model.config) if cfg.model.path is None else None
    hf_model = build_hf_model(tokenizer, path=cfg.model.path, config=model_config)  # on CPU; fully_shard moves each shard
    model = shard_model(PackedCausalLM(hf_model, cfg.loss.chunk_size), device.type, dist_info.world_size, **cfg.model.fsdp)
    model.train()  # from_pretrained returns eval mode, which also switches HF activation checkpointing off
    num_params = sum(p.numel() for p in hf_model.parameters())
    logger.info("model: %s, %.2fM parameters, %d rank(s) on %s", type(hf_model).__name__, num_params / 1e6, dist_info.world_size, device)

    optimizer = instantiate(cfg.optimizer)(model.parameters())
    scheduler = instantiate(cfg.scheduler)(optimizer, num_training_steps=cfg.max_steps)
    # The loss and its reference: a frozen copy of the initial policy (or reference.path), sharded alike.
    preference_loss = PreferenceLoss(cfg.loss.type, cfg.loss.beta, cfg.loss.label_smoothing, cfg.loss.simpo_gamma,
                                     cfg.loss.sft_weight)
    reference = None
    if preference_loss.needs_reference:
        torch.manual_seed(cfg.seed)  # built from config: the same weights as the initial policy
        reference_hf = build_hf_model(tokenizer, path=cfg.reference.path or cfg.model.path, config=model_config)
        reference = LiveReference(shard_model(PackedCausalLM(reference_hf, cfg.loss.chunk_size), device.type,
                                              dist_info.world_size, **cfg.model.fsdp))
    objective = PreferenceObjective(preference_loss, reference)

    # --- resume: model, optimizer, scheduler, data position and RNG, or a fresh start ---
    checkpoints = output_dir / "checkpoints"
    meta = run_meta(dist_info.world_size, cfg.data.num_workers, run_fingerprint(cfg))
    counters = {"nonfinite_skipped_steps": 0}
    start_step = 0
    resume_from = checkpoint_to_resume(cfg.resume, checkpoints)
    if resume_from is not None:
        start_step, counters = resume_training(resume_from, model, optimizer, scheduler, feed, meta, cfg.resume_allow_changes)
        logger.info("resumed from %s at step %d (epoch %d)", resume_from, start_step, feed.epoch)
    elif dist_info.is_main and checkpoints.exists():
        logger.warning("%s holds checkpoints but resume=%s: this run starts from scratch", output_dir, cfg.resume)
    metric_logger = MetricLogger(
        str(output_dir), dist_info.is_main, cfg.logger, resume_step=start_step if resume_from else None,
        run_config=OmegaConf.to_container(cfg, resolve=True), wandb_kwargs=OmegaConf.to_container(cfg.wandb),
    )
    ledger = DocumentLedger(output_dir, dist_info.rank, start_step) if cfg.ledger else None

    if cfg.data.eval and cfg.eval_every > 0 and start_step == 0:  # the starting point of the held-out curve
        metric_logger.log({"step": 0, **evaluate(model, objective, eval_batches, device, pad_id)})

    # --- training loop: one update step = grad_accum_steps microbatches on every rank ---
    step = start_step
    for step in range(start_step + 1, cfg.max_steps + 1):
        if feed.finished:  # resumed after the last epoch
            break
        start = time.perf_counter()
        lr = scheduler.get_last_lr()[0]
        batches = feed.next_step()
        if ledger:
            ledger.write(step, batches)
        maybe_crash("step", step)  # fault injection for the crash tests (CHATTUNE_CRASH_AT); a no-op otherwise
        result, grad_norm = train_step(model, objective, batches.microbatches, optimizer, scheduler, cfg.max_grad_norm,
                                       device, rank_done=batches.rank_done)
        epoch_counts = feed.close_step(result.ranks_done, dist_info.world_size)
        if device.type == "cuda":
            torch.cuda.synchronize()  # the step's kernels belong to its time, not the next one's
        step_time = time.perf_counter() - start
        if result.global_units == 0 and step == 1:
            raise RuntimeError("the first step has no preference pair on any rank: check the data")
        if not math.isfinite(grad_norm):  # every rank sees the same NaN norm, so all decide alike
            if cfg.nonfinite_loss == "stop":
                raise FloatingPointError(f"step {step}: non-finite loss or gradients; the optimizer did not step. "
                                         "The last checkpoint is intact (resume=auto continues from it).")
            counters["nonfinite_skipped_steps"] += 1
            logger.warning("step %d: non-finite loss or gradients, update skipped (%d so far)", step,
                           counters["nonfinite_skipped_steps"])

        if epoch_counts is not None:  # the step closed an epoch on every rank: its exact figures
            logger.info("epoch %d done at step %d: %s", batches.epoch, step,
                        epoch_line(reduce_sums(epoch_counts, device), cfg.data.max_tokens_per_microbatch))
        is_last = step == cfg.max_steps or feed.finished
        # Decided from the config alone: evaluate() is collective, every rank must agree to enter it.
        is_eval = bool(cfg.data.eval) and cfg.eval_every > 0 and (step % cfg.eval_every == 0 or is_last)
        if step % cfg.log_every == 0 or is_last or is_eval:
            metrics = step_metrics(step, result, objective, grad_norm, lr, step_time, device)
            metrics.update(epoch=batches.epoch, **counters)
            if is_eval:
                metrics.update(evaluate(model, objective, eval_batches, device, pad_id))
            metric_logger.log(metrics)
        stopping = step == cfg.stop_after_step
        if (cfg.save_every and step % cfg.save_every == 0) or stopping:
            save_training(checkpoints, step, model, optimizer, scheduler, feed, meta, counters, cfg.keep_last_n)
        if stopping:
            logger.info("stop_after_step=%d: checkpoint saved; resume=auto continues this run", step)
            metric_logger.close()
            shutdown_distributed()
            return
        if feed.finished:
            logger.info("data.num_epochs=%d epochs done at step %d", cfg.data.num_epochs, step)
            break

    skipped = reduce_sums({**feed.stream.skipped, **feed.stream.overlong}, device)
    logger.info("training records over all ranks and epochs: skipped %s; over the budget and kept %s",
                {k: int(skipped[k]) for k in feed.stream.skipped}, {k: int(skipped[k]) for k in feed.stream.overlong})

    # --- save: a Hugging Face directory that loads without chattune ---
    export_hf(model, tokenizer, output_dir / "hf", dist_info.is_main)
    metric_logger.log_summary({"hf_dir": str((output_dir / "hf").resolve())})
    metric_logger.close()
    logger.info("done: %s", output_dir / "hf")
    shutdown_distributed()


if __name__ == "__main__":
    main()
    exit_process()  # the run is complete; skip interpreter teardown (see exit_process)
