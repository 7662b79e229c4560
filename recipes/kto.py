"""KTO (Kahneman–Tversky optimisation) of a chat model on packed, unpaired examples with FSDP2.

    torchrun --nproc_per_node 2 recipes/kto.py [--config-name kto/tiny] key=value ...

The DPO story told with unpaired examples: each example is a prompt with one completion labelled desirable or
undesirable (`{prompt, completion, label}`, or each side of a preference pair), packed as one document of two
segments: the example, then its prompt with another example's completion, from which KTO estimates its reference
point (the policy's KL from the reference). The unit of the loss is the example; the reference point is the whole
step's, computed in a no-grad pass before the step's first backward (`chattune.objectives.kto`). A frozen reference
model (sharded like the policy), or a table of its log-probs computed once (`reference.cache=true`), gives the
reference log-probs. Read top to bottom; copy this file to change the story.
"""

from __future__ import annotations

import logging

from omegaconf import DictConfig

from chattune.checkpoint.output_dir import claim_output_dir
from chattune.data.templates.tokenizer import load_tokenizer
from chattune.distributed import init_distributed, shutdown_distributed
from chattune.launch.app import recipe_main
from chattune.launch.recipe_kinds import KTO
from chattune.launch.validate import checked_config
from chattune.log import setup_logging
from chattune.model.build import build_trained_model
from chattune.model.peft.adapters import trainable_parameters
from chattune.objectives.kto import KTOObjective, KTOWeights
from chattune.train.inputs import build_training_data
from chattune.train.loop import Learning, train
from chattune.train.optimizer import build_optimizer, build_scheduler
from chattune.train.reference import reference_log_probs

logger = logging.getLogger("chattune.kto")


@recipe_main(config_name="kto/tiny", kind=KTO)
def main(composed: DictConfig) -> None:
    # --- set-up: every rank composes the same config and checks all of it (every problem at once, nothing
    # loaded yet, the same checks as `chattune validate`); from here on `cfg` is a KTOConfig ---
    cfg, config_notes = checked_config(composed, KTO)
    dims = init_distributed(cfg.device, cfg.parallel)
    setup_logging(dims.rank)
    for note in config_notes if dims.is_main else []:
        logger.info("config note: %s", note)
    # The output directory is this run's alone (a lock), and what the launch continues is settled.
    start = claim_output_dir(cfg, dims)

    # --- data: examples (each with its mismatched sequence), every source behind one record index ---
    tokenizer = load_tokenizer(cfg.tokenizer)
    data = build_training_data(cfg, dims, tokenizer, KTO.data)

    # --- model: HF causal LM (LoRA adapters on its frozen base with peft=lora), chunked loss head, FSDP2 ---
    built = build_trained_model(cfg, tokenizer, dims)
    trainable = trainable_parameters(built.model)  # the adapters with peft=lora
    optimizer = build_optimizer(cfg.optimizer, trainable, dims.device)  # fused on CUDA
    scheduler = build_scheduler(cfg.scheduler, optimizer, cfg.max_steps)  # step k at the schedule's value at k

    # --- the loss and its reference log-probs: a live frozen model (or the LoRA base), or a cache ---
    weights = KTOWeights(cfg.loss.beta, cfg.loss.desirable_weight, cfg.loss.undesirable_weight)
    reference, eval_reference = reference_log_probs(cfg, tokenizer, dims, built, data, KTO.name)
    padding = (cfg.data.pad_to_multiple_of, data.pad_id)  # each pass's rows padded as the stream pads them
    objective = KTOObjective(weights, reference, data.num_sources, padding)
    eval_objective = KTOObjective(weights, eval_reference, padding=padding) if data.eval is not None else None

    # --- training: resume, update steps, metrics, eval, checkpoints, the HF export (shared by every recipe) ---
    train(cfg, dims, start, built, data, Learning(objective, optimizer, scheduler, eval_objective), tokenizer)
    shutdown_distributed()


if __name__ == "__main__":
    main()
