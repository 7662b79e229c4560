"""The policy-gradient losses' catalogue (the GRPO recipe's `loss.type`), torch-free: what each loss averages over,
the clip range its paper uses, and which settings it reads. The config schema (its choices and help), `chattune
validate` and the objective (`chattune.objectives.policy_gradient`, which holds the formulas) read this one table.

Every loss is a sum over the step's completion tokens of a per-token term, divided by a count of the whole step (over
every microbatch and rank, all-reduced once), never a per-rank or per-microbatch count:

| type | per-token term | divided by |
|---|---|---|
| `grpo` | the clipped ratio times the advantage, each completion's tokens averaged | the step's completions |
| `dapo` | the clipped ratio times the advantage (clip-higher) | the step's completion tokens |
| `dr_grpo` | the clipped ratio times the advantage | the step's completions x rollout.max_new_tokens |
| `gspo` | the clipped sequence-level ratio (the geometric mean of its tokens') times the advantage | the step's completions |
| `cispo` | the detached, capped ratio times the advantage times the log-prob | the step's completion tokens |
| `reverse_kl` | the ratio times the token's advantage log p_teacher - log p_old (on-policy distillation) | the step's completion tokens |
| `gkd` | the generalised JSD (loss.jsd_beta) between the teacher's and the policy's whole next-token distributions | the step's completion tokens |
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PolicyLossSpec:
    """One policy-gradient loss: its `loss.type`, its unit, its paper's clip range (`clip`: epsilon_low, epsilon_high
    where loss.epsilon_low / epsilon_high are null; None: the loss does not clip the ratio) and whether its ratio is a
    sequence's rather than a token's."""

    name: str
    unit: str  # "completion" or "completion token": what the step's loss is a mean over
    clip: tuple[float, float] | None
    sequence_ratio: bool = False
    paper: str = ""
    teacher: bool = False  # it learns from a teacher (teacher.path), not from rewards
    vocabulary: bool = False  # it compares whole distributions (the teacher run live), not sampled tokens' log-probs


POLICY_LOSSES: dict[str, PolicyLossSpec] = {
    spec.name: spec
    for spec in (
        PolicyLossSpec("grpo", "completion", (0.2, 0.2), paper="DeepSeekMath (arXiv 2402.03300)"),
        PolicyLossSpec("dapo", "completion token", (0.2, 0.28), paper="DAPO (arXiv 2503.14476)"),
        PolicyLossSpec("dr_grpo", "completion", (0.2, 0.2), paper="Dr. GRPO (arXiv 2503.20783)"),
        PolicyLossSpec("gspo", "completion", (3e-4, 4e-4), sequence_ratio=True, paper="GSPO (arXiv 2507.18071)"),
        PolicyLossSpec("cispo", "completion token", None, paper="MiniMax-M1 (arXiv 2506.13585)"),
        PolicyLossSpec(
            "reverse_kl",
            "completion token",
            None,
            paper="on-policy distillation (Agarwal et al., arXiv 2306.13649; Thinking Machines 2025)",
            teacher=True,
        ),
        PolicyLossSpec(
            "gkd",
            "completion token",
            None,
            paper="GKD (Agarwal et al., arXiv 2306.13649): generalised JSD over the vocabulary",
            teacher=True,
            vocabulary=True,
        ),
    )
}

ADVANTAGE_SCALES = ("std", "none")  # advantage.scale: the group's standard deviation (GRPO) | none (Dr. GRPO)
IS_CORRECTIONS = ("truncate", "none")  # rollout.is_correction: truncated importance sampling | none
REWARD_ON_ERROR = ("error", "skip")
ROLLOUT_ENGINES = ("hf", "vllm")


def needs_teacher(loss_type: object) -> bool:
    """Whether a run of `loss.type` scores its samples with a teacher (teacher.path)."""
    spec = POLICY_LOSSES.get(loss_type) if isinstance(loss_type, str) else None
    return spec is not None and spec.teacher


def compares_vocabularies(loss_type: object) -> bool:
    """Whether a run of `loss.type` compares the policy's whole distributions with its teacher's (gkd)."""
    spec = POLICY_LOSSES.get(loss_type) if isinstance(loss_type, str) else None
    return spec is not None and spec.vocabulary


def clip_range(loss_type: str, epsilon_low: float | None, epsilon_high: float | None) -> tuple[float, float]:
    """The clip range a run of `loss_type` uses: the settings where given, else its paper's (cispo clips nothing:
    its own cap is loss.cispo_max_ratio, and its range is reported as (0, 0))."""
    default = POLICY_LOSSES[loss_type].clip or (0.0, 0.0)
    return (
        default[0] if epsilon_low is None else float(epsilon_low),
        default[1] if epsilon_high is None else float(epsilon_high),
    )
