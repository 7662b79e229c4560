"""The rollout step source on one rank: a step's rows hold every completion of its prompts as documents whose
advantages are their group's (recomputed here from the decoded completions and the verifier), with the sampler's
log-probs on their trained tokens; groups of equal rewards and groups whose reward failed are counted and, as asked,
left out; a prompt over the budget is dropped and counted, or an error; with several steps per rollout the rows are
reused and declare the old policy's log-probs; the source's state continues a run exactly."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch

from chattune.config.paths import DEMO_ASSETS
from chattune.data.documents import IGNORE_INDEX
from chattune.data.ingest.formats import SourceSpec
from chattune.errors import UserError
from chattune.model.causal_lm import PackedCausalLM
from chattune.model.generate import Sampling
from chattune.objectives.policy_gradient import ADVANTAGE, BEHAVIOUR_LOGP, OLD_LOGP
from chattune.parallel.fsdp import Placement
from chattune.rl import demo_task
from chattune.rl.prompts import PromptOrder, PromptSource
from chattune.rl.rewards import RewardFunction
from chattune.rl.rollouts import RolloutModels, RolloutSettings, RolloutSteps
from conftest import demo_tokenizer, tiny_model

PROMPTS, GROUP, NEW_TOKENS = 4, 3, 6


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join((DEMO_ASSETS / "sort_prompts.jsonl").read_text().splitlines()[:6]) + "\n")
    return path


def source(prompts_file, rewards=None, old_log_probs=False, **settings) -> RolloutSteps:
    tokenizer = demo_tokenizer()
    model = tiny_model(seed=2)
    model.set_attn_implementation("sdpa")
    policy = PackedCausalLM(model, loss_chunk_size=16)
    prompts = PromptSource([SourceSpec(str(prompts_file), format="prompt")], tokenizer)
    rewards = rewards or [RewardFunction("sorted_numbers", 1.0, demo_task.sorted_numbers)]
    values = dict(
        prompts_per_step=PROMPTS,
        completions_per_prompt=GROUP,
        sampling=Sampling(max_new_tokens=NEW_TOKENS, temperature=1.0),
        seed=5,
    )
    values.update(settings)
    return RolloutSteps(
        RolloutModels(policy, Placement.one_rank(), old_log_probs),
        tokenizer,
        prompts,
        rewards,
        RolloutSettings(**values),
        pad_id=0,
    )


def completions_of(batches) -> list[tuple[int, list[int], float]]:
    """(completion id, completion tokens, declared advantage) of every completion of the step's rows: a segment with
    trained tokens; the k-th segment of a document (a group sharing its prompt) is its doc id's k-th successor."""
    found = []
    for row in batches.microbatches:
        bounds = row.cu_seqlens.tolist()
        earlier: dict[int, int] = {}  # segments seen of each document
        for start, end in zip(bounds, bounds[1:]):
            labels = row.labels[0, start:end]
            trained = labels != IGNORE_INDEX
            if not trained.any():
                continue
            document = int(row.document_ids[start])
            k = earlier.get(document, 0)
            earlier[document] = k + 1
            advantages = row.token_values[ADVANTAGE][0, start:end][trained]
            assert (advantages == advantages[0]).all()  # one advantage on each of the completion's tokens
            found.append((row.doc_ids[document] + k, labels[trained].tolist(), float(advantages[0])))
    return found


def test_a_steps_rows_hold_every_completion_with_its_groups_advantage(prompts_file):
    steps = source(prompts_file)
    batches = steps.next_step(1)
    found = completions_of(batches)
    assert sorted(d for d, _, _ in found) == list(range(PROMPTS * GROUP))  # place p's k-th completion: p*G + k
    records = [json.loads(line) for line in prompts_file.read_text().splitlines()]
    order = PromptOrder(len(records), 5)
    tokenizer = demo_tokenizer()
    stops = set(steps.how.stop_ids)
    for place in range(PROMPTS):
        record = records[order.at(place)[1]]
        group = sorted((d, tokens, a) for d, tokens, a in found if d // GROUP == place)
        texts = [tokenizer.decode([t for t in tokens if t not in stops]) for _, tokens, _ in group]
        rewards = [demo_task.sort_score(text, record["numbers"], record["order"]) for text in texts]
        mean = sum(rewards) / GROUP
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (GROUP - 1))
        for (_, _, advantage), reward in zip(group, rewards):
            assert advantage == pytest.approx((reward - mean) / (std + 1e-4), abs=1e-6)
    for row in batches.microbatches:  # the sampler's log-probs on the trained tokens, nothing elsewhere
        trained = row.labels[0] != IGNORE_INDEX
        behaviour = row.token_values[BEHAVIOUR_LOGP][0]
        assert (behaviour[trained] < 0).all() and (behaviour[~trained] == 0).all()
    figures = batches.figures
    assert (figures["sampled"], figures["groups"], figures["ranks"]) == (PROMPTS * GROUP, PROMPTS, 1.0)
    assert figures["sampled_tokens"] == sum(len(tokens) for _, tokens, _ in found) and figures["rollout_s"] > 0


def test_groups_of_equal_rewards_are_counted_and_left_out_where_asked(prompts_file):
    constant = [
        RewardFunction("constant", 1.0, lambda prompts, completions, completion_ids, **f: [0.5] * len(completions))
    ]
    kept = source(prompts_file, constant).next_step(1)
    assert kept.figures["uniform_groups"] == PROMPTS and kept.figures["skipped_groups"] == 0
    assert all(a == 0.0 for _, _, a in completions_of(kept)) and len(completions_of(kept)) == PROMPTS * GROUP
    left_out = source(prompts_file, constant, skip_uniform_groups=True).next_step(1)
    assert left_out.figures["skipped_groups"] == PROMPTS and completions_of(left_out) == []
    assert len(left_out.microbatches) == 1 and left_out.microbatches[0].doc_ids == []  # an empty row: it still steps


def test_a_failed_reward_under_skip_leaves_its_group_out(prompts_file):
    def fails_on_the_first(prompts, completions, completion_ids, **fields):
        return [None] + [1.0] * (len(completions) - 1)

    batches = source(
        prompts_file, [RewardFunction("flaky", 1.0, fails_on_the_first)], on_reward_error="skip"
    ).next_step(1)
    assert batches.figures["skipped_groups"] == 1
    assert len(completions_of(batches)) == (PROMPTS - 1) * GROUP


def test_a_prompt_over_the_budget_is_dropped_and_counted_or_an_error(prompts_file):
    steps = source(prompts_file, budget=40)  # the descending prompts (two turns) do not fit with 6 new tokens
    batches = steps.next_step(1)
    dropped = steps.skipped["overlong"]
    assert dropped > 0 and batches.figures["groups"] == PROMPTS - dropped
    with pytest.raises(UserError, match="record .* exceed data.max_tokens_per_microbatch=40"):
        source(prompts_file, budget=40, overlong="error").next_step(1)


def test_a_rollout_serves_its_steps_with_the_old_policys_log_probs_then_the_next_is_sampled(prompts_file):
    steps = source(prompts_file, old_log_probs=True, steps_per_rollout=2)
    first, second, third = (steps.next_step(step) for step in (1, 2, 3))
    assert second.microbatches == first.microbatches and second.figures["rollout_s"] == 0.0
    assert completions_of(third) != completions_of(first) and third.figures["rollout_s"] > 0
    for row in first.microbatches:  # the policy's own log-probs of the rows, as sampled
        with torch.no_grad():
            want = -steps.models.policy(row).float()
        torch.testing.assert_close(row.token_values[OLD_LOGP][0], want)


def test_the_sources_state_continues_a_run_inside_a_rollout(prompts_file):
    steps = source(prompts_file, steps_per_rollout=2)
    steps.next_step(1)
    state = steps.state_dict()
    want = completions_of(steps.next_step(2))
    resumed = source(prompts_file, steps_per_rollout=2)
    resumed.load_state_dict(state)
    assert completions_of(resumed.next_step(2)) == want
    # and a fresh rollout after a resume draws what the uninterrupted run draws
    assert completions_of(resumed.next_step(3)) == completions_of(steps.next_step(3))


def test_the_prompts_must_divide_over_the_data_ranks_and_be_prompts(prompts_file, tmp_path):
    from chattune.data.ingest.formats import DataError
    from chattune.distributed import ParallelDims

    steps = source(prompts_file)
    with pytest.raises(UserError, match="does not divide over the run's 2 data-parallel ranks"):
        RolloutSteps(
            RolloutModels(steps.models.policy, Placement(ParallelDims(0, 2, 0, torch.device("cpu")))),
            steps.tokenizer,
            steps.prompts,
            steps.rewards,
            RolloutSettings(prompts_per_step=3, completions_per_prompt=2, sampling=Sampling(temperature=1.0)),
            pad_id=0,
        )
    with pytest.raises(DataError, match="format: prompt"):
        PromptSource([SourceSpec(str(prompts_file), format="messages")], demo_tokenizer())


def test_data_num_epochs_ends_the_run_after_the_rollouts_that_start_within_them(prompts_file):
    # 6 prompts, 4 a rollout, 2 steps a rollout: rollout 0 takes places 0-3, rollout 1 places 4-7 (the second epoch
    # from place 6), rollout 2 starts in the second epoch
    steps = source(prompts_file, steps_per_rollout=2, num_epochs=1)
    assert not steps.finished
    steps.next_step(1)
    assert not steps.finished and steps.epoch == 0
    steps.next_step(2)
    assert not steps.finished  # rollout 1 starts at place 4, in the first epoch
    steps.next_step(3)
    assert not steps.finished  # its second step still trains on it
    steps.next_step(4)
    assert steps.finished and steps.epoch == 1  # rollout 2 would start at place 8, past the first epoch


def test_gkds_off_policy_rollouts_train_the_datas_own_replies_as_the_template_renders_them(prompts_file):
    """rollout.on_policy_share=0: each prompt's one completion is its record's reply (the demo's `answer`): the tokens
    the chat template writes for it as the conversation's next assistant turn, through its end of turn."""
    steps = source(prompts_file, on_policy_share=0.0, reply_field="answer")
    batches = steps.next_step(1)
    found = completions_of(batches)
    assert sorted(d for d, _, _ in found) == [p * GROUP for p in range(PROMPTS)]  # one a prompt, at its place
    records = [json.loads(line) for line in prompts_file.read_text().splitlines()]
    tokenizer = steps.tokenizer
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for doc_id, tokens, _ in found:
        record = records[steps.order.at(doc_id // GROUP)[1]]
        prompt = tokenizer.apply_chat_template(record["messages"], add_generation_prompt=True, tokenize=True)
        whole = tokenizer.apply_chat_template(
            [*record["messages"], {"role": "assistant", "content": record["answer"]}], tokenize=True
        )
        prompt, whole = list(prompt["input_ids"]), list(whole["input_ids"])
        assert whole[: len(prompt)] == prompt
        assert tokens == whole[len(prompt) : whole.index(end, len(prompt)) + 1]
    figures = batches.figures
    assert figures["on_policy"] == 0.0 and figures["sampled"] == PROMPTS and "entropy_sum" not in figures
    assert figures["sampled_tokens"] == sum(len(tokens) for _, tokens, _ in found)


def test_gkds_lambda_draws_each_rollout_from_the_seed_and_its_index(prompts_file):
    half = source(prompts_file, on_policy_share=0.5, reply_field="answer")
    draws = [half.on_policy(index) for index in range(40)]
    assert 10 <= sum(draws) <= 30 and draws == [half.on_policy(index) for index in range(40)]
    assert all(source(prompts_file).on_policy(index) for index in range(40))  # λ = 1: every rollout sampled
    step = next(index for index, sampled in enumerate(draws) if not sampled) + 1
    assert half.next_step(step).figures["on_policy"] == 0.0
    step = next(index for index, sampled in enumerate(draws) if sampled) + 1
    sampled = half.next_step(step)
    assert sampled.figures["on_policy"] == 1.0 and len(completions_of(sampled)) == PROMPTS * GROUP


def test_a_record_without_its_reply_is_an_error_naming_it_or_a_counted_skip(prompts_file, tmp_path):
    from chattune.data.ingest.formats import DataError

    with pytest.raises(DataError, match=r"record .*: no reply in its field 'reply' \(rollout.reply_field\)"):
        source(prompts_file, on_policy_share=0.0).next_step(1)
    steps = source(prompts_file, on_policy_share=0.0)
    steps.prompts.on_bad_record = "skip"
    batches = steps.next_step(1)
    assert steps.skipped["bad_record"] == PROMPTS and completions_of(batches) == []


def trained_values(batches, name: str) -> list[float]:
    """The values `name` declared on every trained token of the step, sorted."""
    return sorted(
        v for row in batches.microbatches for v in row.token_values[name][0][row.labels[0] != IGNORE_INDEX].tolist()
    )


def test_a_groups_completions_sharing_their_prompt_are_the_unshared_completions_in_fewer_tokens(prompts_file):
    unshared = source(prompts_file).next_step(1)
    shared = source(prompts_file, share_prompts=True).next_step(1)
    assert sorted(completions_of(shared)) == sorted(completions_of(unshared))
    assert trained_values(shared, BEHAVIOUR_LOGP) == trained_values(unshared, BEHAVIOUR_LOGP)
    saved = sum(row.shared_prompt_tokens for row in shared.microbatches)
    tokens = {id(kind): sum(row.num_tokens for row in kind.microbatches) for kind in (unshared, shared)}
    assert saved > 0 and tokens[id(shared)] == tokens[id(unshared)] - saved
    assert shared.figures == pytest.approx(unshared.figures | {"rollout_s": shared.figures["rollout_s"]})


def test_a_group_over_the_row_budget_shares_its_prompt_in_as_many_documents_as_fit(prompts_file):
    budget = 48
    steps = source(prompts_file, share_prompts=True, budget=budget)
    batches = steps.next_step(1)
    assert sorted(completions_of(batches)) == sorted(completions_of(source(prompts_file, budget=budget).next_step(1)))
    assert all(row.num_tokens <= budget for row in batches.microbatches)
    per_document = [
        count
        for row in batches.microbatches
        for count in Counter(int(row.document_ids[start]) for start in row.cu_seqlens[:-1].tolist()).values()
    ]
    assert 1 < max(per_document) < GROUP and min(per_document) == 1  # groups split: 2 sharing a prompt, 1 alone
