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

from omegaconf import DictConfig

from chattune.checkpoint.output_dir import claim_output_dir
from chattune.data.templates.tokenizer import load_tokenizer
from chattune.distributed import init_distributed, shutdown_distributed
from chattune.launch.app import recipe_main
from chattune.launch.recipe_kinds import DPO
from chattune.launch.validate import checked_config
from chattune.log import setup_logging
from chattune.model.build import build_trained_model
from chattune.model.peft.adapters import trainable_parameters
from chattune.objectives.dpo import PreferenceObjective, is_initial_policy
from chattune.objectives.pair_losses import PreferenceLoss
from chattune.train.inputs import build_training_data
from chattune.train.loop import Learning, train
from chattune.train.optimizer import build_optimizer, build_scheduler
from chattune.train.reference import reference_log_probs

logger = logging.getLogger("chattune.dpo")


@recipe_main(config_name="dpo/tiny", kind=DPO)
def main(composed: DictConfig) -> None:
    # --- set-up: every rank composes the same config and checks all of it (every problem at once, nothing
    # loaded yet, the same checks as `chattune validate`) ---
    # Checked as a DPO config (its schema, formats and rules); from here on `cfg` is typed: the
    # schema's dataclasses (DPOConfig), every interpolation resolved.
    cfg, config_notes = checked_config(composed, DPO)
    dims = init_distributed(cfg.device, cfg.parallel)
    setup_logging(dims.rank)
    for note in config_notes if dims.is_main else []:
        logger.info("config note: %s", note)
    # The output directory is this run's alone (a lock), and what the launch continues is settled (a
    # resume is checked against the checkpoint, an earlier run is never overwritten by accident).
    start = claim_output_dir(cfg, dims)

    # --- data: each rank tokenizes (in loader workers) and packs only its own share of every epoch ---
    tokenizer = load_tokenizer(cfg.tokenizer)
    # Preference pairs (one document of two segments each), every source behind one record index, drawn as
    # data.mixing says; a data report; each rank's step feed.
    data = build_training_data(cfg, dims, tokenizer, DPO.data)

    # --- model: HF causal LM (LoRA adapters on its frozen base with peft=lora), chunked loss head, FSDP2 ---
    built = build_trained_model(cfg, tokenizer, dims)
    # With peft=lora the adapters alone: the optimizer and the checkpoints hold only them.
    trainable = trainable_parameters(built.model)
    optimizer = build_optimizer(cfg.optimizer, trainable, dims.device)  # fused on CUDA
    scheduler = build_scheduler(cfg.scheduler, optimizer, cfg.max_steps)  # step k at the schedule's value at k

    # --- the loss and its reference log-probs: none (reference-free), a live frozen model, or a cache ---
    preference_loss = PreferenceLoss.from_config(cfg.loss)  # loss.type's row of PAIR_LOSSES, with its settings
    reference, eval_reference = (
        reference_log_probs(cfg, tokenizer, dims, built, data, DPO.name)
        if preference_loss.needs_reference
        else (None, None)
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
    train(cfg, dims, start, built, data, Learning(objective, optimizer, scheduler, eval_objective), tokenizer)
    shutdown_distributed()


if __name__ == "__main__":
    main()
