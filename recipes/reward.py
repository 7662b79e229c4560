"""A reward model (Bradley–Terry) trained on packed preference pairs with FSDP2.

    torchrun --nproc_per_node 2 recipes/reward.py [--config-name reward/tiny] key=value ...

The same story as recipes/dpo.py without a reference: each pair is one packed document of two segments
(chosen, rejected), the model is the decoder under a scalar score head (Hugging Face sequence
classification, num_labels=1), a side's reward is that head at the side's last token (where transformers reads
a rendered conversation), and the unit of the loss is the pair: -log σ(r_chosen - r_rejected - margin), plus
loss.center_rewards_coefficient × (r_chosen + r_rejected)². The export (output_dir/hf) loads with
`AutoModelForSequenceClassification`. Read top to bottom; copy this file to change the story.
"""

from __future__ import annotations

import logging

from omegaconf import DictConfig

from chattune.checkpoint.output_dir import claim_output_dir
from chattune.data.templates.tokenizer import load_tokenizer
from chattune.distributed import init_distributed, shutdown_distributed
from chattune.launch.app import recipe_main
from chattune.launch.recipe_kinds import REWARD
from chattune.launch.validate import checked_config
from chattune.log import setup_logging
from chattune.model.build import build_trained_model
from chattune.model.head.kinds import SCORE_HEAD
from chattune.model.peft.adapters import trainable_parameters
from chattune.objectives.reward import RewardObjective
from chattune.train.inputs import build_training_data
from chattune.train.loop import Learning, train
from chattune.train.optimizer import build_optimizer, build_scheduler

logger = logging.getLogger("chattune.reward")


@recipe_main(config_name="reward/tiny", kind=REWARD)
def main(composed: DictConfig) -> None:
    # --- set-up: every rank composes the same config and checks all of it (every problem at once, nothing
    # loaded yet, the same checks as `chattune validate`); from here on `cfg` is a typed RewardConfig ---
    cfg, config_notes = checked_config(composed, REWARD)
    dims = init_distributed(cfg.device, cfg.parallel)
    setup_logging(dims.rank)
    for note in config_notes if dims.is_main else []:
        logger.info("config note: %s", note)
    # The output directory is this run's alone (a lock), and what the launch continues is settled.
    start = claim_output_dir(cfg, dims)

    # --- data: preference pairs (one document of two segments each), as DPO reads them ---
    tokenizer = load_tokenizer(cfg.tokenizer)
    data = build_training_data(cfg, dims, tokenizer, REWARD.data)

    # --- model: the HF sequence-classification model (num_labels=1) of model.path or model.config, its decoder
    # run packed as a causal LM's is, its score head read at each side's last token; LoRA adapters on
    # its frozen base with peft=lora (the score head trains in full next to them); FSDP2 ---
    built = build_trained_model(cfg, tokenizer, dims, head=SCORE_HEAD)
    trainable = trainable_parameters(built.model)
    optimizer = build_optimizer(cfg.optimizer, trainable, dims.device)  # fused on CUDA
    scheduler = build_scheduler(cfg.scheduler, optimizer, cfg.max_steps)  # step k at the schedule's value at k

    # --- the loss: Bradley–Terry per pair, normalised by the step's pairs over all ranks ---
    objective = RewardObjective(cfg.loss.center_rewards_coefficient, num_sources=data.num_sources)
    eval_objective = RewardObjective(cfg.loss.center_rewards_coefficient)

    # --- training: resume, update steps, metrics, eval, checkpoints, the HF export (shared by every recipe) ---
    train(cfg, dims, start, built, data, Learning(objective, optimizer, scheduler, eval_objective), tokenizer)
    shutdown_distributed()


if __name__ == "__main__":
    main()
