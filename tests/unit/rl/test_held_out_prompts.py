"""The GRPO recipe's held-out evaluation (data.eval) on one rank: every held-out prompt is answered G times, and the
eval_* metrics are the figures of those completions, recomputed here from what the reward functions were given; the
same policy gives the same figures at every evaluation (its draws seeded apart from the training rollouts'), and an
evaluation leaves the global RNG and the training rollouts alone."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from chattune.config.paths import DEMO_ASSETS
from chattune.data.ingest.formats import SourceSpec
from chattune.model.causal_lm import PackedCausalLM
from chattune.model.generate import Sampling
from chattune.parallel.fsdp import Placement
from chattune.rl import demo_task
from chattune.rl.held_out import HeldOutPrompts
from chattune.rl.prompts import PromptSource
from chattune.rl.rewards import RewardFunction
from chattune.rl.rollouts import RolloutModels, RolloutSettings, RolloutSteps
from conftest import demo_tokenizer, tiny_model

GROUP, NEW_TOKENS = 3, 6
EVAL_PROMPTS = DEMO_ASSETS / "sort_prompts_eval.jsonl"


class Recorded:
    """The demo's reward, recording what it was given and what it returned."""

    def __init__(self):
        self.calls: list[dict] = []

    def __call__(self, prompts, completions, completion_ids=None, **fields):
        rewards = demo_task.sorted_numbers(prompts, completions, completion_ids, **fields)
        self.calls.append({"prompts": prompts, "ids": completion_ids, "rewards": rewards})
        return rewards


def settings(**values) -> RolloutSettings:
    sampling = Sampling(max_new_tokens=NEW_TOKENS, temperature=1.0)
    return RolloutSettings(prompts_per_step=4, completions_per_prompt=GROUP, sampling=sampling, seed=5, **values)


@pytest.fixture
def models() -> RolloutModels:
    model = tiny_model(seed=2)
    model.set_attn_implementation("sdpa")
    return RolloutModels(PackedCausalLM(model, loss_chunk_size=16), Placement.one_rank())


def held_out(models, reward) -> HeldOutPrompts:
    tokenizer = demo_tokenizer()
    train_prompts = PromptSource([SourceSpec(str(DEMO_ASSETS / "sort_prompts.jsonl"), format="prompt")], tokenizer)
    training = RolloutSteps(
        models, tokenizer, train_prompts, [RewardFunction("sorted_numbers", 1.0, reward)], settings(), 0
    )
    return HeldOutPrompts(training, PromptSource([SourceSpec(str(EVAL_PROMPTS), format="prompt")], tokenizer))


def test_every_held_out_prompt_is_answered_and_the_metrics_are_its_completions_figures(models):
    reward = Recorded()
    metrics = held_out(models, reward)()
    records = [json.loads(line) for line in EVAL_PROMPTS.read_text().splitlines()]
    (call,) = reward.calls  # one call for the rank's whole evaluation, sampled 4 prompts at a time
    asked = [json.dumps(messages) for messages in call["prompts"]]
    assert sorted(asked) == sorted(json.dumps(r["messages"]) for r in records for _ in range(GROUP))
    rewards = call["rewards"]
    assert metrics["eval_reward"] == pytest.approx(statistics.fmean(rewards))
    assert metrics["eval_reward_std"] == pytest.approx(statistics.pstdev(rewards), abs=1e-9)
    assert metrics["eval_reward/sorted_numbers"] == pytest.approx(statistics.fmean(rewards))
    assert metrics["eval_completion_length"] == pytest.approx(statistics.fmean(len(ids) for ids in call["ids"]))
    assert metrics["eval_groups"] == len(records) and 0 <= metrics["eval_truncated"] <= 1
    assert not any(name.startswith("eval_rollout") or name == "eval_advantage_abs_mean" for name in metrics)


def test_the_same_policy_gives_the_same_figures_and_an_evaluation_leaves_the_training_draws_alone(models):
    evaluation = held_out(models, Recorded())
    tokenizer = demo_tokenizer()
    train_prompts = PromptSource([SourceSpec(str(DEMO_ASSETS / "sort_prompts.jsonl"), format="prompt")], tokenizer)
    reward = [RewardFunction("sorted_numbers", 1.0, demo_task.sorted_numbers)]

    def training_step(evaluate_first: bool) -> list:
        steps = RolloutSteps(models, tokenizer, train_prompts, reward, settings(), 0)
        if evaluate_first:
            evaluation()
        return [row.input_ids.tolist() for row in steps.next_step(1).microbatches]

    torch.manual_seed(0)
    state = torch.get_rng_state()
    first = evaluation()
    assert torch.equal(torch.get_rng_state(), state)
    assert evaluation() == first
    assert training_step(evaluate_first=True) == training_step(evaluate_first=False)
    # the held-out draws are not the training rollouts': the same prompts as training prompts are sampled otherwise
    as_training = RolloutSteps(models, tokenizer, evaluation.rollouts.prompts, reward, settings(), 0)
    assert as_training.held_out_sums(4) != evaluation.rollouts.held_out_sums(4)
