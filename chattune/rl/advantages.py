"""Group-relative advantages: each completion's reward against the other completions of its prompt.

GRPO divides by the group's standard deviation (unbiased, plus 1e-4, as TRL 1.16's `GRPOTrainer`); Dr. GRPO keeps the
mean only (`advantage.scale=none`: dividing by the spread weighs easy and hard prompts unequally). A group whose
rewards are all equal teaches nothing (every advantage 0): it is counted, and with `rollout.skip_uniform_groups`
left out of the step, as DAPO's dynamic sampling does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from chattune.config.policy_losses import ADVANTAGE_SCALES

STD_EPSILON = 1e-4  # TRL's: added to the group's standard deviation


def group_advantages(rewards: Sequence[float], scale: str = "std") -> list[float]:
    """The advantages of one prompt's completions from their rewards: reward minus the group's mean, divided by the
    group's unbiased standard deviation + 1e-4 (`scale="std"`) or not (`"none"`)."""
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"advantage.scale must be one of {ADVANTAGE_SCALES}, got {scale!r}")
    count = len(rewards)
    if count == 0:
        return []
    mean = sum(rewards) / count
    centred = [r - mean for r in rewards]
    if scale == "none":
        return centred
    std = math.sqrt(sum(c * c for c in centred) / (count - 1)) if count > 1 else 0.0
    return [c / (std + STD_EPSILON) for c in centred]


def is_uniform(rewards: Sequence[float]) -> bool:
    """Every completion of the group got the same reward (to float rounding): its advantages are all 0."""
    return max(rewards) - min(rewards) <= 1e-9 * max(1.0, max(abs(r) for r in rewards))
