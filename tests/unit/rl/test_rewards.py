"""Reward functions: each shipped one on hand-made cases; the config's entries made and checked (a typo'd argument is
refused, not passed on as a record field); every bad value a function can give is one error naming the function, the
record and the value, or with on_error=skip a left-out completion; group advantages; the demo task's verifier and its
shipped prompts."""

from __future__ import annotations

import json
import math
import random

import pytest

from chattune.rl import demo_task
from chattune.rl.advantages import group_advantages, is_uniform
from chattune.rl.rewards import (
    RewardError,
    answer_check,
    entry_problem,
    format_check,
    length_penalty,
    reward_functions,
    score,
)

PROMPTS = [[{"role": "user", "content": "q"}]] * 4


def test_answer_check_exact_numeric_and_math():
    replies = ["42", " 42 ", "The answer is 1,234.0.", "x = 3/4"]
    assert answer_check(PROMPTS, replies, answer=["42", "41", "1234", "0.75"]) == [1.0, 0.0, 0.0, 0.0]
    numeric = answer_check(PROMPTS, replies, mode="numeric", answer=["42", "41", 1234, "0.75"])
    assert numeric == [1.0, 0.0, 1.0, 0.0]  # the last number of "x = 3/4" is 4
    assert answer_check(PROMPTS[:1], ["5, 7, 9"], answer=[[5, 7, 9]]) == [1.0]  # a list answer: ", "-joined
    assert answer_check(PROMPTS[:2], ["7", "7"], solution=["7", None], answer_field="solution") == [1.0, 0.0]
    pytest.importorskip("math_verify")
    maths = answer_check(
        PROMPTS[:3], ["so $\\frac{3}{4}$", "$0.75$", "$\\frac{1}{2}$"], mode="math", answer=["3/4"] * 3
    )
    assert maths == [1.0, 1.0, 0.0]


def test_answer_check_refuses_a_mode_it_does_not_know_and_a_missing_field():
    with pytest.raises(ValueError, match="mode"):
        answer_check(PROMPTS[:1], ["1"], mode="fuzzy", answer=["1"])
    with pytest.raises(ValueError, match="'answer' field"):
        answer_check(PROMPTS[:1], ["1"])


def test_format_check_by_pattern_or_tags():
    replies = ["<think>a\nb</think> <answer>7</answer>", "<answer>7</answer>", "12, 13"]
    assert format_check(PROMPTS[:3], replies, tags=["think", "answer"]) == [1.0, 0.0, 0.0]
    assert format_check(PROMPTS[:3], replies, pattern=r"\d+(, \d+)*") == [0.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="one of pattern"):
        format_check(PROMPTS[:1], ["x"])


def test_length_penalty_is_dapos_soft_overlong_punishment():
    ids = [[0] * n for n in (6, 8, 9, 10, 12)]
    assert length_penalty(PROMPTS * 2, [""] * 5, ids, max_tokens=10, buffer_tokens=4) == [0.0, -0.5, -0.75, -1.0, -1.0]


def test_the_demo_tasks_verifier_gives_partial_credit_and_1_only_for_the_sorted_list():
    assert demo_task.sort_score("3, 5, 9", [5, 3, 9], "ascending") == 1.0
    assert demo_task.sort_score("9, 5, 3", [5, 3, 9], "descending") == 1.0
    assert demo_task.sort_score("9, 5, 3", [5, 3, 9], "ascending") == 0.5  # the numbers, in the wrong order
    assert demo_task.sort_score("1, 2", [5, 3, 9], "ascending") == 0.5  # in order, no number of the prompt's
    assert demo_task.sort_score("3, 5", [5, 3, 9], "ascending") == 0.5 + 0.5 * 0.8  # in order, 2 of 3 (F1 0.8)
    assert demo_task.sort_score("sorted: 3, 5, 9", [5, 3, 9], "ascending") == 0.0  # no list of integers
    assert demo_task.sort_score("5", [5, 3, 9], "ascending") == 0.25  # no neighbours to order; F1 0.5


def test_the_shipped_demo_prompts_are_the_generators_and_answer_themselves():
    from chattune.config.paths import DEMO_ASSETS

    path = DEMO_ASSETS / "sort_prompts.jsonl"
    lines = path.read_text().splitlines()
    rng = random.Random(0)
    assert lines == [json.dumps(demo_task.make_prompt(rng)) for _ in range(len(lines))] and len(lines) == 1000
    for line in lines[:50]:
        record = json.loads(line)
        assert demo_task.sort_score(record["answer"], record["numbers"], record["order"]) == 1.0


def test_entries_are_made_as_partials_named_and_weighted():
    made = reward_functions(
        [
            {"_target_": "chattune.rl.rewards.answer_check", "weight": 2.0, "mode": "numeric"},
            {"_target_": "chattune.rl.rewards.answer_check", "weight": 0.0},
            {"_target_": "chattune.rl.rewards.format_check", "name": "form", "pattern": r"\d+"},
        ]
    )
    assert [(f.name, f.weight) for f in made] == [("answer_check", 2.0), ("answer_check_2", 0.0), ("form", 1.0)]
    assert made[0].fn(prompts=PROMPTS[:1], completions=["it is 3.0"], completion_ids=[[1]], answer=["3"]) == [1.0]


@pytest.mark.parametrize(
    "entry, problem",
    [
        ({"_target_": "chattune.rl.rewards.answer_check", "mdoe": "numeric"}, "mdoe: not a parameter of"),
        ({"_target_": "chattune.rl.rewards.nothing"}, "cannot import 'chattune.rl.rewards.nothing'"),
        ({"weight": 1.0}, "no _target_"),
        ({"_target_": "chattune.rl.rewards.answer_check", "weight": "high"}, "weight must be a number"),
        ({"_target_": "os.path.join"}, "takes no prompts, completions, completion_ids"),
        ({"_target_": "chattune.rl.rewards.answer_check", "completions": []}, "passed by the recipe"),
        ("chattune.rl.rewards.answer_check", "a reward function is a mapping"),
    ],
)
def test_an_entry_that_cannot_be_made_is_one_problem(entry, problem):
    assert problem in entry_problem(entry)
    with pytest.raises(RewardError, match="reward.functions\\[0\\]"):
        reward_functions([entry])


def _returns(values):
    def fn(prompts, completions, completion_ids, **fields):
        if isinstance(values, Exception):
            raise values
        return values

    return fn


WHERE = [f"prompts.jsonl record {i + 1} (line {i + 1})" for i in range(3)]


@pytest.mark.parametrize(
    "values, problem",
    [
        (ValueError("no answer"), "raised ValueError: no answer"),
        ([1.0, 2.0], "returned 2 values for 3 completions"),
        ([1.0, None, 0.0], "returned None for completion 1"),
        ([1.0, float("nan"), 0.0], "returned nan for completion 1"),
        ([1.0, "1", 0.0], "returned '1' for completion 1"),
    ],
)
def test_a_bad_reward_is_one_error_naming_the_function_and_record_or_a_skip(values, problem, caplog):
    from chattune.rl.rewards import RewardFunction

    functions = [RewardFunction("checker", 1.0, _returns(values))]
    args = (PROMPTS[:3], ["a", "b", "c"], [[1], [2], [3]], [{}, {}, {}], WHERE)
    with pytest.raises(RewardError) as raised:
        score(functions, *args)
    message = str(raised.value)
    assert "reward function 'checker'" in message and problem in message and "record" in message
    assert "reward.on_error=skip" in message  # the remedy, named
    scores = score(functions, *args, on_error="skip")
    assert scores.failed and all(0 <= i < 3 for i in scores.failed)
    assert problem in caplog.text


def test_the_reward_is_the_weighted_sum_and_fields_reach_every_function_as_lists():
    from chattune.rl.rewards import RewardFunction

    seen = {}

    def fields_seen(prompts, completions, completion_ids, **fields):
        seen.update(fields)
        return [float(len(c)) for c in completions]

    functions = [RewardFunction("length", 0.5, fields_seen), RewardFunction("one", 2.0, _returns([1.0, 1.0]))]
    records = [{"answer": "x", "tests": [1]}, {"answer": "y"}]
    scores = score(functions, PROMPTS[:2], ["ab", "abcd"], [[1], [2]], records, WHERE[:2])
    assert scores.total == [0.5 * 2 + 2.0, 0.5 * 4 + 2.0] and not scores.failed
    assert scores.parts == {"length": [2.0, 4.0], "one": [1.0, 1.0]}
    assert seen == {"answer": ["x", "y"], "tests": [[1], None]}


def test_group_advantages_are_trls_and_dr_grpos():
    rewards = [1.0, 0.0, 0.5, 0.5]
    mean, std = 0.5, math.sqrt(sum((r - 0.5) ** 2 for r in rewards) / 3)  # unbiased, as torch.std
    assert group_advantages(rewards) == pytest.approx([(r - mean) / (std + 1e-4) for r in rewards])
    assert group_advantages(rewards, scale="none") == [0.5, -0.5, 0.0, 0.0]
    assert group_advantages([0.3] * 4) == [0.0] * 4 and is_uniform([0.3] * 4) and not is_uniform(rewards)
    with pytest.raises(ValueError, match="advantage.scale"):
        group_advantages(rewards, scale="rank")


def test_reward_model_scores_each_prompt_with_its_completion_as_a_plain_forward_does(tmp_path):
    import torch
    from transformers import AutoModelForSequenceClassification

    from chattune.rl.rewards import _reward_model, reward_model
    from conftest import demo_tokenizer, tiny_config

    tokenizer = demo_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(
        tiny_config(num_labels=1, pad_token_id=tokenizer.pad_token_id)
    ).eval()
    model.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    prompts = [[{"role": "user", "content": "Sort 3, 1"}], [{"role": "user", "content": "Sort 9, 2"}]]
    scores = reward_model(prompts, ["1, 3", "9, 2"], None, path=str(tmp_path / "rm"))
    for prompt, reply, got in zip(prompts, ["1, 3", "9, 2"], scores):
        ids = tokenizer.apply_chat_template(
            [*prompt, {"role": "assistant", "content": reply}], return_tensors="pt", return_dict=True
        )
        with torch.no_grad():
            assert got == pytest.approx(float(model(input_ids=ids["input_ids"]).logits[0, 0]), abs=1e-6)
    assert scores[0] != scores[1]
    _reward_model.cache_clear()
    with pytest.raises(Exception, match="reward_model: cannot load"):
        reward_model(prompts, ["x", "y"], None, path=str(tmp_path / "none"))
