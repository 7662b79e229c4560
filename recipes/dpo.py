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
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from transformers import PreTrainedTokenizerBase

from chattune.config.schema import DPOConfig
from chattune.data.stream import StreamLayout
from chattune.data.tokenizer import load_tokenizer
from chattune.distributed import DistInfo, init_distributed, shutdown_distributed
from chattune.launch.app import recipe_main
from chattune.launch.recipe_kinds import DPO
from chattune.launch.validate import checked_config
from chattune.log import setup_logging
from chattune.model.adapters import BaseModelView, trainable_parameters
from chattune.model.build import BuiltModel, build_sharded_model, build_trained_model
from chattune.objectives import reference_cache
from chattune.objectives.dpo import CachedReference, LiveReference, PreferenceObjective, is_initial_policy
from chattune.objectives.pair_losses import PreferenceLoss
from chattune.train.inputs import TrainingData, build_training_data, packed_stream
from chattune.train.loop import Learning, train
from chattune.train.optimizer import build_optimizer
from chattune.train.output_dir import claim_output_dir

logger = logging.getLogger("chattune.dpo")


@recipe_main(config_name="dpo/tiny", kind=DPO)
def main(composed: DictConfig) -> None:
    # --- set-up: every rank composes the same config and checks all of it (every problem at once, nothing
    # loaded yet, the same checks as `chattune validate`) ---
    # Checked as a DPO config (its schema, formats and rules); from here on `cfg` is typed: the
    # schema's dataclasses (DPOConfig), every interpolation resolved.
    cfg, config_notes = checked_config(composed, DPO)
    dist_info = init_distributed(cfg.device, cfg.parallel.context)
    setup_logging(dist_info.rank)
    for note in config_notes if dist_info.is_main else []:
        logger.info("config note: %s", note)
    # The output directory is this run's alone (a lock), and what the launch continues is settled (a
    # resume is checked against the checkpoint, an earlier run is never overwritten by accident).
    start = claim_output_dir(cfg, dist_info)

    # --- data: each rank tokenizes (in loader workers) and packs only its own share of every epoch ---
    tokenizer = load_tokenizer(cfg.tokenizer)
    # Preference pairs (one document of two segments each), every source behind one record index, drawn as
    # data.mixing says; a data report; each rank's step feed.
    data = build_training_data(cfg, dist_info, tokenizer, DPO.data)

    # --- model: HF causal LM (LoRA adapters on its frozen base with peft=lora), chunked loss head, FSDP2 ---
    built = build_trained_model(cfg, tokenizer, dist_info)
    trainable = trainable_parameters(
        built.model
    )  # the adapters with peft=lora: optimizer and checkpoints hold only them
    optimizer = build_optimizer(cfg.optimizer, trainable, dist_info.device)  # fused on CUDA
    scheduler = instantiate(cfg.scheduler)(optimizer, num_training_steps=cfg.max_steps)

    # --- the loss and its reference log-probs: none (reference-free), a live frozen model, or a cache ---
    preference_loss = PreferenceLoss.from_config(cfg.loss)  # loss.type's row of PAIR_LOSSES, with its settings
    reference, eval_reference = (
        reference_log_probs(cfg, tokenizer, dist_info, built, data) if preference_loss.needs_reference else (None, None)
    )
    objective = PreferenceObjective(preference_loss, reference, num_sources=data.num_sources)
    # A reference that is the initial policy makes the held-out figures before the first step known (every
    # reward 0): they are logged without running the model (PreferenceObjective.known_start_metrics).
    quantized = cfg.peft is not None and cfg.peft.quantize_base is not None
    eval_objective = (
        PreferenceObjective(
            preference_loss,
            eval_reference,
            reference_is_start=is_initial_policy(cfg.reference.path, cfg.model.path, quantized),
        )
        if data.eval is not None
        else None
    )

    # --- training: resume, update steps, metrics, eval, checkpoints, the HF export (shared by every recipe) ---
    train(cfg, dist_info, start, built, data, Learning(objective, optimizer, scheduler, eval_objective), tokenizer)
    shutdown_distributed()


def reference_log_probs(
    cfg: DPOConfig, tokenizer: PreTrainedTokenizerBase, dist_info: DistInfo, built: BuiltModel, data: TrainingData
):
    """The reference log-probs of the training and held-out pairs: a live frozen model, or (reference.cache)
    a table of them computed in one pass before training and stored under reference.cache_dir."""

    def reference_model() -> torch.nn.Module:  # frozen: reference.path, else the initial policy; sharded alike
        if built.peft_model is not None and cfg.reference.path is None:  # LoRA: the policy's own base; no second model
            logger.info("reference: the policy's base (adapters off)")
            return BaseModelView(built.model, built.peft_model)
        return build_sharded_model(
            cfg,
            tokenizer,
            dist_info,
            cfg.reference.path or cfg.model.path,
            key="reference.path" if cfg.reference.path else "model.path",
        ).model

    if not cfg.reference.cache:
        live = LiveReference(reference_model())
        return live, live
    device = dist_info.device
    splits = {"train": data.train, **({"eval": data.eval} if data.eval is not None else {})}
    tables = reference_cache.load_or_build(
        Path(cfg.reference.cache_dir),
        {split: reference_cache.cache_fingerprint(cfg, split, device.type) for split in splits},
        {split: len(documents) for split, documents in splits.items()},
        reference_model,
        lambda split: packed_stream(
            cfg,
            splits[split],
            StreamLayout(dist_info.data_rank, dist_info.data_ranks, shuffle=False, num_epochs=1),
            data.pad_id,
        ),
        device,
        data.pad_id,
        dist_info.is_main,
    )
    return CachedReference(tables["train"]), CachedReference(tables["eval"]) if data.eval is not None else None


if __name__ == "__main__":
    main()
