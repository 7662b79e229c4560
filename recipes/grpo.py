"""GRPO-family on-policy training of a chat model: the policy samples, reward functions score, a policy-gradient loss
updates it, with FSDP2.

    torchrun --nproc_per_node 2 recipes/grpo.py [--config-name grpo/tiny] key=value ...

Each step's rows are made from the policy being trained (`chattune.rl.rollouts`): P prompts (over all ranks), G
completions of each sampled with a KV cache, scored by the reward functions, their rewards turned into advantages
within each prompt's group; each completion is a packed document whose sampled tokens are trained. The loss
(`loss.type`: grpo, dapo, dr_grpo, gspo, cispo; reverse_kl and gkd distil from a teacher instead;
`chattune.objectives.policy_gradient`) is normalised over the whole step as its paper says, however the completions
are split into microbatches and ranks. Read top to bottom; copy this file to change the story (docs/grpo.md).
"""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig

from chattune.checkpoint.output_dir import claim_output_dir
from chattune.config.policy_losses import compares_vocabularies, needs_teacher
from chattune.data.ingest.records import source_specs
from chattune.data.templates.tokenizer import load_tokenizer, pad_token_id
from chattune.distributed import init_distributed, shutdown_distributed
from chattune.launch.app import recipe_main
from chattune.launch.recipe_kinds import GRPO
from chattune.launch.validate import checked_config
from chattune.log import setup_logging
from chattune.model.build import build_trained_model
from chattune.model.peft.adapters import trainable_parameters
from chattune.objectives.policy_gradient import PolicyGradientObjective, PolicyLoss
from chattune.rl.held_out import HeldOutPrompts
from chattune.rl.prompts import PromptSource
from chattune.rl.rewards import reward_functions
from chattune.rl.rollouts import RolloutModels, RolloutSettings, RolloutSteps, SamplesLog
from chattune.train.inputs import TrainingData
from chattune.train.loop import Learning, train
from chattune.train.optimizer import build_optimizer, build_scheduler
from chattune.train.reference import reference_model, teacher_model

logger = logging.getLogger("chattune.grpo")


@recipe_main(config_name="grpo/tiny", kind=GRPO)
def main(composed: DictConfig) -> None:
    # --- set-up: every rank composes the same config and checks all of it (every problem at once, nothing
    # loaded yet, the same checks as `chattune validate`); from here on `cfg` is a GRPOConfig ---
    cfg, config_notes = checked_config(composed, GRPO)
    dims = init_distributed(cfg.device, cfg.parallel)
    setup_logging(dims.rank)
    for note in config_notes if dims.is_main else []:
        logger.info("config note: %s", note)
    # The output directory is this run's alone (a lock), and what the launch continues is settled.
    start = claim_output_dir(cfg, dims)

    # --- the prompts and what scores their completions ---
    tokenizer = load_tokenizer(cfg.tokenizer)
    prompts = PromptSource(
        source_specs(cfg.data.train), tokenizer, cfg.rollout.chat_template_kwargs, cfg.data.on_bad_record
    )
    # each a partial of its _target_, weighted (on-policy distillation learns from its teacher: rewards only logged)
    rewards = reward_functions(cfg.reward.functions, required=not needs_teacher(cfg.loss.type))

    # --- model: HF causal LM (LoRA adapters on its frozen base with peft=lora), chunked loss head, FSDP2 ---
    built = build_trained_model(cfg, tokenizer, dims)
    policy = built.model
    # The loss scores each sampled token at the temperature it was drawn at (transformers divides the logits too).
    policy.logit_transform = policy.logit_transform.at_temperature(cfg.rollout.temperature)
    trainable = trainable_parameters(policy)  # the adapters with peft=lora
    optimizer = build_optimizer(cfg.optimizer, trainable, dims.device)  # fused on CUDA
    scheduler = build_scheduler(cfg.scheduler, optimizer, cfg.max_steps)  # step k at the schedule's value at k
    loss = PolicyLoss.from_config(cfg.loss, cfg.rollout)
    # A frozen reference only for a KL penalty: reference.path, else the initial policy (with LoRA: its base);
    # a teacher only for on-policy distillation (loss.type=reverse_kl: it scores the sampled tokens in the rollout;
    # gkd: it runs beside the policy on every microbatch). Both score the samples at their temperature.
    reference = reference_model(cfg, tokenizer, dims, built) if cfg.loss.beta > 0 else None
    teacher = teacher_model(cfg, tokenizer, dims, policy) if needs_teacher(cfg.loss.type) else None
    for frozen in (reference, teacher):
        if frozen is not None and hasattr(frozen, "logit_transform"):  # (a LoRA base view is the policy's own)
            frozen.logit_transform = frozen.logit_transform.at_temperature(cfg.rollout.temperature)

    # --- the steps: rollouts of the policy as it trains (its old log-probs computed once where mu > 1) ---
    live_teacher = teacher if compares_vocabularies(cfg.loss.type) else None
    models = RolloutModels(
        policy, built.placement, cfg.rollout.steps_per_rollout > 1, reference, None if live_teacher else teacher
    )
    steps = RolloutSteps(
        models,
        tokenizer,
        prompts,
        rewards,
        RolloutSettings.from_config(cfg),
        pad_token_id(tokenizer),
        SamplesLog(Path(cfg.output_dir) / "samples.jsonl", cfg.log_every),  # a group of each logged step, rewarded
    )
    # data.eval: held-out prompts answered and rewarded at every evaluation (eval_every), nothing trained on them
    held_out = None
    if cfg.data.eval:
        eval_prompts = PromptSource(
            source_specs(cfg.data.eval), tokenizer, cfg.rollout.chat_template_kwargs, cfg.data.on_bad_record
        )
        held_out = HeldOutPrompts(steps, eval_prompts)
    data = TrainingData.made_by(steps, pad_token_id(tokenizer), held_out)

    # --- training: resume, update steps, metrics, checkpoints, the HF export (shared by every recipe) ---
    train(
        cfg,
        dims,
        start,
        built,
        data,
        Learning(PolicyGradientObjective(loss, live_teacher), optimizer, scheduler),
        tokenizer,
    )
    shutdown_distributed()


if __name__ == "__main__":
    main()
