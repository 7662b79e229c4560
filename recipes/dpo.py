"""Direct preference optimisation (DPO and relatives) of a chat model on packed preference pairs with FSDP2.

    torchrun --nproc_per_node 2 recipes/dpo.py [--config-name dpo/tiny] key=value ...

The same story as recipes/sft.py, told with preference pairs: each pair is one packed document of two
segments (chosen, rejected), the unit of the loss is the pair, and a frozen reference model (sharded
like the policy) gives the reference log-probs, or a table of them computed once before training
(`reference.cache=true`), or none (reference-free losses such as simpo). Read top to bottom; copy this
file to change the story.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from chattune.config.launch import recipe_main
from chattune.config.validate import check_config
from chattune.data.tokenizer import load_tokenizer
from chattune.distributed import init_distributed, shutdown_distributed
from chattune.log import setup_logging
from chattune.model.adapters import BaseModelView, trainable_parameters
from chattune.model.build import build_sharded_model
from chattune.model.quantize import weight_shape
from chattune.objectives import reference_cache
from chattune.objectives.dpo import CachedReference, LiveReference, PreferenceObjective
from chattune.objectives.pair_losses import PreferenceLoss
from chattune.train.inputs import build_training_data, packed_stream, pad_token_id, pair_documents
from chattune.train.loop import train
from chattune.train.optimizer import build_optimizer
from chattune.train.output_dir import claim_output_dir

logger = logging.getLogger("chattune.dpo")


@recipe_main(config_name="dpo/tiny")
def main(cfg: DictConfig) -> None:
    # --- set-up: every rank composes the same config and checks all of it (every problem at once, nothing
    # loaded yet, the same checks as `chattune validate`) ---
    config_notes = check_config(cfg, int(os.environ.get("WORLD_SIZE", "1")), recipe="dpo")
    dist_info = init_distributed(cfg.device)
    setup_logging(dist_info.rank)
    for note in config_notes if dist_info.is_main else []:
        logger.info("config note: %s", note)
    device = dist_info.device
    # The output directory is this run's alone (a lock), and what the launch continues is settled (a
    # resume is checked against the checkpoint, an earlier run is never overwritten by accident).
    start = claim_output_dir(cfg, dist_info)

    # --- data: each rank tokenizes (in loader workers) and packs only its own share of every epoch ---
    tokenizer = load_tokenizer(cfg.tokenizer.path)
    pad_id = pad_token_id(tokenizer)

    # The sources behind one record index, drawn as data.mixing says; a data report; each rank's step feed.
    data = build_training_data(cfg, dist_info, pad_id, lambda specs: pair_documents(specs, tokenizer, cfg.data))

    # --- model: HF causal LM (LoRA adapters on its frozen base with peft=lora), chunked loss head, FSDP2 ---
    hf_model, model, peft_model = build_sharded_model(cfg, tokenizer, dist_info, cfg.model.path, adapters=cfg.peft)
    model.train()  # from_pretrained returns eval mode, which also switches HF activation checkpointing off
    num_params = sum(weight_shape(p).numel() for p in hf_model.parameters())  # a 4-bit weight: its matrix
    trainable = trainable_parameters(model)  # the adapters with peft=lora: optimizer and checkpoints hold only them
    logger.info("model: %s, %.2fM parameters (%.2fM trained), %d rank(s) on %s", type(hf_model).__name__,
                num_params / 1e6, sum(p.numel() for p in trainable) / 1e6, dist_info.world_size, device)

    optimizer = build_optimizer(cfg.optimizer, trainable, dist_info.device)  # fused on CUDA
    scheduler = instantiate(cfg.scheduler)(optimizer, num_training_steps=cfg.max_steps)

    # --- the loss and its reference log-probs: none (reference-free), a live frozen model, or a cache ---
    preference_loss = PreferenceLoss(cfg.loss.type, cfg.loss.beta, cfg.loss.label_smoothing, cfg.loss.simpo_gamma,
                                     cfg.loss.sft_weight)

    def reference_model() -> torch.nn.Module:  # frozen: reference.path, else the initial policy; sharded alike
        if peft_model is not None and cfg.reference.path is None:  # LoRA: the policy's own base; no second model
            logger.info("reference: the policy's base (adapters off)")
            return BaseModelView(model, peft_model)
        return build_sharded_model(cfg, tokenizer, dist_info, cfg.reference.path or cfg.model.path,
                                   key="reference.path" if cfg.reference.path else "model.path").model

    reference = eval_reference = None
    if preference_loss.needs_reference and not cfg.reference.cache:
        reference = eval_reference = LiveReference(reference_model())
    elif preference_loss.needs_reference:  # one pass before training, stored under reference.cache_dir
        splits = {"train": data.train, **({"eval": data.eval} if data.eval else {})}
        tables = reference_cache.load_or_build(
            Path(cfg.reference.cache_dir), {split: reference_cache.cache_fingerprint(cfg, split, device.type) for split in splits},
            {split: len(documents) for split, documents in splits.items()}, reference_model,
            lambda split: packed_stream(cfg, dist_info.rank, dist_info.world_size, pad_id, splits[split], shuffle=False,
                                        num_epochs=1), device, pad_id,
            dist_info.is_main)
        reference = CachedReference(tables["train"])
        eval_reference = CachedReference(tables["eval"]) if cfg.data.eval else None
    objective = PreferenceObjective(preference_loss, reference, num_sources=data.num_sources)
    eval_objective = PreferenceObjective(preference_loss, eval_reference) if cfg.data.eval else None

    # --- training: resume, update steps, metrics, eval, checkpoints, the HF export (shared by every recipe) ---
    train(cfg, dist_info, start, model, objective, optimizer, scheduler, data.feed, data.eval_batches, tokenizer, pad_id, eval_objective,
          peft_model=peft_model)
    shutdown_distributed()


if __name__ == "__main__":
    main()
