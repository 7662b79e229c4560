"""End to end: the GRPO recipe on 2 ranks. From a small model SFT-trained on the demo chats, the demo task's reward
rises by a margin that the same run with the reward's sign flipped does not reach (it falls); a run stopped inside a
rollout (two optimizer steps per rollout) and resumed makes the same completions, rewards and losses as the
uninterrupted run, bit for bit, and its first step with each group sharing its prompt (data.share_prompts) the same; a less-trained student distilled on-policy from that model (a teacher directory)
comes closer to it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_sft_recipe import read_metrics

from conftest import SMALL_MODEL, launch, made_once, torchrun

pytestmark = pytest.mark.launch

SFT_STEPS = 120  # the small model learns the demo's form (a list of numbers) in these, not their order
LEARN_STEPS, FLIPPED_STEPS = 20, 8
MARGIN = 0.05  # the demo's reward: the mean of the last 5 steps over the mean of the first 3 (measured: +0.12)
SORT_REWARD = "reward/sorted_numbers"
# The demo's held-out prompts are answered (32 x 8 completions) before the first step and at the last: the runs that
# check nothing of them leave them out.
NO_EVAL = "data.eval=null"


def sft(steps: int):
    def make(directory: Path) -> None:
        launch(
            torchrun(
                "sft",
                *SMALL_MODEL,
                f"output_dir={directory / 'run'}",
                f"max_steps={steps}",
                "eval_every=0",
                "eval.samples=0",
                "save_every=0",
                "log_every=40",
            )
        )

    return make


@pytest.fixture(scope="module")
def sft_base(tmp_path_factory) -> Path:
    """The small model after SFT on the demo chats: its export, made once for the session."""
    return made_once(tmp_path_factory, "grpo-sft-base", sft(SFT_STEPS)) / "run" / "hf"


def grpo(out: Path, base: Path, *overrides: str, lr: float = 1e-3) -> list[dict]:
    launch(
        torchrun(
            "grpo",
            f"model.path={base}",
            f"output_dir={out}",
            "log_every=1",
            "save_every=0",
            f"optimizer.lr={lr}",
            *overrides,
        )
    )
    return read_metrics(out)


def raised(metrics: list[dict]) -> float:
    """How much the demo's reward rose: the mean of the last 5 steps' over the mean of the first 3 steps'."""
    first = [m[SORT_REWARD] for m in metrics[:3]]
    last = [m[SORT_REWARD] for m in metrics[-5:]]
    return sum(last) / len(last) - sum(first) / len(first)


def test_the_demo_raises_its_reward_and_the_same_run_with_the_sign_flipped_does_not(tmp_path, sft_base):
    learned = grpo(tmp_path / "learn", sft_base, f"max_steps={LEARN_STEPS}")
    assert [m["step"] for m in learned] == list(range(1, LEARN_STEPS + 1))
    assert all(m["completions"] == 128 and m["groups"] == 16 for m in learned)  # 16 prompts x 8, over 2 ranks
    assert raised(learned) >= MARGIN, [round(m[SORT_REWARD], 3) for m in learned]
    # The control: the same run rewarded for the opposite (the advantages' sign flipped) fails the same margin.
    flipped = grpo(
        tmp_path / "flipped",
        sft_base,
        f"max_steps={FLIPPED_STEPS}",
        "reward.functions=[{_target_: chattune.rl.demo_task.sorted_numbers, weight: -1.0}]",
        NO_EVAL,
    )
    assert raised(flipped) < MARGIN and raised(flipped) < 0, [round(m[SORT_REWARD], 3) for m in flipped]
    samples = [json.loads(line) for line in (tmp_path / "learn" / "samples.jsonl").read_text().splitlines()]
    assert samples[0]["step"] == 1 and len([s for s in samples if s["step"] == 1]) == 8  # a group of 8, rewarded
    assert set(samples[0]["rewards"]) == {"sorted_numbers", "solved"} and "advantage" in samples[0]
    assert (tmp_path / "learn" / "hf" / "config.json").is_file()
    # the demo's held-out prompts (data.eval: 32, never trained on), answered 8 times each before the first step and
    # at the last (eval_every=20)
    evaluated = [m for m in read_metrics(tmp_path / "learn", include_start=True) if "eval_reward" in m]
    assert [m["step"] for m in evaluated] == [0, LEARN_STEPS]
    assert all(m["eval_groups"] == 32 and 0 <= m["eval_reward"] <= 1 for m in evaluated), evaluated
    # what it learned holds on prompts it never trained on (measured: 0.115 -> 0.215)
    assert evaluated[-1]["eval_reward"] > evaluated[0]["eval_reward"], evaluated


RESUME = (
    "max_steps=6",
    "rollout.steps_per_rollout=2",
    "rollout.prompts_per_step=8",
    "rollout.completions_per_prompt=4",
)
SAME = (
    "loss",
    "reward",
    "reward_std",
    "num_tokens",
    "grad_norm",
    "ratio_mean",
    "ratio_min",
    "ratio_max",
    "clipped_low",
    "clipped_high",
    "entropy",
)


def test_a_run_stopped_inside_a_rollout_resumes_to_the_same_completions_rewards_and_losses(tmp_path, sft_base):
    whole = grpo(tmp_path / "whole", sft_base, *RESUME, "save_every=3")
    grpo(tmp_path / "cut", sft_base, *RESUME, "save_every=3", "stop_after_step=3")
    resumed = grpo(tmp_path / "cut", sft_base, *RESUME, "save_every=3")
    assert [m["step"] for m in resumed] == list(range(1, 7))
    # step 4 trains again on step 3's rollout, saved with the checkpoint: its ratio is no longer 1
    assert resumed[3]["ratio_mean"] != 1.0 and resumed[3]["rollout_s"] == 0.0
    for got, want in zip(resumed, whole):
        assert {k: got[k] for k in SAME} == {k: want[k] for k in SAME}, got["step"]
    # the held-out prompts at the last step (eval_every=20: the end), answered after the resume as without it
    held_out = [{k: v for k, v in run[-1].items() if k.startswith("eval_")} for run in (resumed, whole)]
    assert held_out[0] == held_out[1] and "eval_reward" in held_out[0]
    samples = [(tmp_path / run / "samples.jsonl").read_text() for run in ("whole", "cut")]
    assert samples[0] == samples[1]  # the same completions, with the same rewards and advantages
    # data.share_prompts: each group's completions continue one copy of its prompt; the same first step, exact up to
    # fp32 rounding (rows of other lengths), in fewer tokens
    (shared,) = grpo(tmp_path / "shared", sft_base, *RESUME, "max_steps=1", "data.share_prompts=true", NO_EVAL)
    assert shared["shared_prompt_tokens"] > 0
    assert {k: shared[k] for k in SAME} == pytest.approx({k: whole[0][k] for k in SAME}, rel=1e-5, abs=1e-6)


@pytest.fixture
def distill(tmp_path, tmp_path_factory, sft_base):
    """A 2-rank distillation run of the small model SFT-trained 30 steps (made once), its teacher the one trained
    SFT_STEPS, with no reward function, at lr 3e-3: its metrics."""

    def run(loss_type: str, steps: int, *overrides: str) -> list[dict]:
        student = made_once(tmp_path_factory, "grpo-sft-student", sft(30)) / "run" / "hf"
        return grpo(
            tmp_path / loss_type,
            student,
            f"max_steps={steps}",
            f"loss.type={loss_type}",
            f"teacher.path={sft_base}",
            "reward.functions=[]",
            NO_EVAL,
            *overrides,
            lr=3e-3,
        )

    return run


def test_a_student_distilled_on_policy_from_a_teacher_directory_comes_closer_to_it(distill):
    metrics = distill("reverse_kl", 10)
    kl = [m["teacher_kl"] for m in metrics]  # the student's sampled reverse KL to its teacher (measured: 1.64 -> 1.26)
    assert kl[0] > 0.1 and sum(kl[-3:]) / 3 < 0.85 * sum(kl[:3]) / 3, [round(k, 3) for k in kl]
    assert "reward" not in metrics[0]  # (no reward function: nothing to report)


def test_a_student_distilled_by_gkd_over_the_whole_vocabulary_comes_closer_to_its_teacher(distill):
    metrics = distill("gkd", 8)
    jsd = [m["loss"] for m in metrics]  # the generalised JSD (beta 0.5) per completion token (measured: 0.291 -> 0.228)
    assert jsd[0] > 0.01 and sum(jsd[-3:]) / 3 < 0.85 * sum(jsd[:3]) / 3, [round(k, 4) for k in jsd]
    assert "ratio_mean" not in metrics[0] and "reward" not in metrics[0]


def test_gkd_with_lambda_mixes_rollouts_of_the_datas_replies_in_and_learns_on_both(distill):
    """rollout.on_policy_share=0.5 (GKD's λ), the demo's answers as the data's replies: some steps train on sampled
    completions, the others on one reply per prompt, and the divergence falls on both kinds."""
    metrics = distill("gkd", 6, "rollout.on_policy_share=0.5", "rollout.reply_field=answer")
    kinds = [m["on_policy"] for m in metrics]
    assert set(kinds) == {0.0, 1.0}, kinds
    for kind in (0.0, 1.0):
        jsd = [m["loss"] for m in metrics if m["on_policy"] == kind]
        assert jsd[-1] < jsd[0], (kind, jsd)
    data_steps = [m for m in metrics if m["on_policy"] == 0.0]
    # one completion a prompt (16 a step), never cut at the budget, with no sampling entropy to report
    assert all(m["completions"] == 16 and m["truncated"] == 0 and "entropy" not in m for m in data_steps)


LAYOUT = ("max_steps=2", "rollout.prompts_per_step=4", "rollout.completions_per_prompt=4")
SAME_LAYOUT = ("reward", "num_tokens", "completions", "loss")


def test_tensor_parallelism_and_hsdp_train_as_the_plain_layouts_with_as_many_data_ranks(tmp_path, sft_base):
    """tp=2 on 2 ranks is one data rank: the same prompts, completions, rewards and losses as 1 rank; replicate=2 on 2
    ranks is two data ranks: as plain FSDP on 2 ranks (the gradient norm to 1e-5)."""

    def run(name: str, nproc: int, *overrides: str) -> list[dict]:
        out = tmp_path / name
        launch(
            torchrun(
                "grpo",
                f"model.path={sft_base}",
                f"output_dir={out}",
                "log_every=1",
                "save_every=0",
                *LAYOUT,
                NO_EVAL,
                *overrides,
                nproc=nproc,
            )
        )
        return read_metrics(out)

    one, tp = run("one", 1), run("tp", 2, "parallel.tensor=2")
    two, hsdp = run("two", 2), run("hsdp", 2, "parallel.replicate=2")
    for got, want in ((tp, one), (hsdp, two)):
        for g, w in zip(got, want):
            assert {k: g[k] for k in SAME_LAYOUT if k != "loss"} == {k: w[k] for k in SAME_LAYOUT if k != "loss"}
            assert g["loss"] == pytest.approx(w["loss"], rel=1e-5, abs=1e-7)
            assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-5)
    assert (tmp_path / "tp" / "samples.jsonl").read_text() == (tmp_path / "one" / "samples.jsonl").read_text()
