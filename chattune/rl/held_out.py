"""The GRPO recipe's held-out evaluation (data.eval: prompts, format prompt): at each evaluation every held-out
prompt is answered by G completions sampled from the policy as the rollouts sample (the rollout section's settings),
scored by the run's reward functions, and reported as the rollouts' figures are, named `eval_*`: eval_reward,
eval_reward_std, eval_reward/NAME, eval_completion_length, eval_truncated, eval_entropy, eval_uniform_groups. Nothing
is trained on them. A rank samples as many prompts at once as a training rollout does (its KV cache no larger).
The draws are seeded by an evaluation seed of their own and the prompt's place: every evaluation
samples the same way (a change between two is the policy's), and a resumed run's evaluations are the uninterrupted
run's."""

from __future__ import annotations

from dataclasses import replace

from chattune.distributed import reduce_sums
from chattune.objectives.policy_gradient import rollout_metrics
from chattune.rl.prompts import PromptSource
from chattune.rl.rollouts import RolloutModels, RolloutSteps

# Metrics of a rollout that say nothing about held-out prompts: its time, and what only training uses.
NOT_REPORTED = ("rollout_s", "rollout_tokens_per_sec", "advantage_abs_mean", "skipped_groups", "on_policy")
EVAL_SEED = 0x6576616C  # mixed into the run's seed: held-out draws apart from the training rollouts'


class HeldOutPrompts:
    """Collective when called: the `eval_*` metrics of the policy on `prompts` (the module docstring), sampled and
    scored as `training` (the run's rollouts) samples and scores."""

    def __init__(self, training: RolloutSteps, prompts: PromptSource):
        dims = training.models.placement.dims
        settings = training.settings
        per_step = -(-len(prompts) // dims.data_ranks) * dims.data_ranks  # (every prompt in one pass)
        # sampled on-policy, every group kept: the rollout's settings less what only training reads
        held_out = replace(
            settings,
            prompts_per_step=max(per_step, dims.data_ranks),
            seed=(settings.seed * 1_000_003 + EVAL_SEED) % 2**63,
            skip_uniform_groups=False,
            on_policy_share=1.0,
            share_prompts=False,
        )
        self.at_once = training.per_rank  # a training rollout's prompts per rank: its KV cache no larger
        models = RolloutModels(training.models.policy, training.models.placement)  # (no scores: nothing trains)
        self.rollouts = RolloutSteps(models, training.tokenizer, prompts, training.rewards, held_out, training.pad_id)

    def describe(self) -> str:
        settings = self.rollouts.settings
        return (
            f"{len(self.rollouts.prompts)} held-out prompts answered {settings.completions_per_prompt} times each "
            f"(up to {settings.sampling.max_new_tokens} new tokens)"
        )

    def __call__(self) -> dict[str, float]:
        sums = reduce_sums(self.rollouts.held_out_sums(self.at_once), self.rollouts.models.placement.device)
        metrics = rollout_metrics(sums)
        return {f"eval_{name}": value for name, value in metrics.items() if name not in NOT_REPORTED}
