"""Supervised fine-tuning of a chat model on packed, padding-free conversations with FSDP2.

    torchrun --nproc_per_node 2 recipes/sft.py [--config-name sft/tiny] key=value ...

Read top to bottom: set-up, data, model and objective, then the shared training loop
(`chattune.train.loop.train`). Copy this file to change the story.
"""

from __future__ import annotations

import logging

from omegaconf import DictConfig

from chattune.checkpoint.output_dir import claim_output_dir
from chattune.data.templates.tokenizer import load_tokenizer
from chattune.distributed import init_distributed, shutdown_distributed
from chattune.launch.app import recipe_main
from chattune.launch.recipe_kinds import SFT
from chattune.launch.validate import checked_config
from chattune.log import setup_logging
from chattune.model.build import build_trained_model
from chattune.model.peft.adapters import trainable_parameters
from chattune.objectives.cross_entropy import TokenCrossEntropy
from chattune.train.inputs import build_training_data
from chattune.train.loop import Learning, train
from chattune.train.optimizer import build_optimizer, build_scheduler

logger = logging.getLogger("chattune.sft")


@recipe_main(config_name="sft/tiny", kind=SFT)
def main(composed: DictConfig) -> None:
    # --- set-up: every rank composes the same config and checks all of it (every problem at once, nothing
    # loaded yet, the same checks as `chattune validate`) ---
    # Checked as an SFT config (its schema, formats and rules); from here on `cfg` is typed: the
    # schema's dataclasses (SFTConfig), every interpolation resolved.
    cfg, config_notes = checked_config(composed, SFT)
    dims = init_distributed(cfg.device, cfg.parallel)
    setup_logging(dims.rank)
    for note in config_notes if dims.is_main else []:
        logger.info("config note: %s", note)
    # The output directory is this run's alone (a lock), and what the launch continues is settled (a
    # resume is checked against the checkpoint, an earlier run is never overwritten by accident).
    start = claim_output_dir(cfg, dims)

    # --- data: each rank tokenizes (in loader workers) and packs only its own share of every epoch ---
    tokenizer = load_tokenizer(cfg.tokenizer)
    # Conversations with assistant-only labels, every source behind one record index, drawn as data.mixing
    # says; a data report; each rank's step feed.
    data = build_training_data(cfg, dims, tokenizer, SFT.data)

    # --- model: HF causal LM (LoRA adapters on its frozen base with peft=lora), chunked loss head, FSDP2 ---
    built = build_trained_model(cfg, tokenizer, dims)
    # With peft=lora the adapters alone: the optimizer and the checkpoints hold only them.
    trainable = trainable_parameters(built.model)
    optimizer = build_optimizer(cfg.optimizer, trainable, dims.device)  # fused on CUDA
    scheduler = build_scheduler(cfg.scheduler, optimizer, cfg.max_steps)  # step k at the schedule's value at k
    objective = TokenCrossEntropy(num_sources=data.num_sources)

    # --- training: resume, update steps, metrics, eval, checkpoints, the HF export (shared by every recipe) ---
    train(cfg, dims, start, built, data, Learning(objective, optimizer, scheduler), tokenizer)
    shutdown_distributed()


if __name__ == "__main__":
    main()
