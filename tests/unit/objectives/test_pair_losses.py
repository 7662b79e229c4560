"""Each preference loss against its formula written out by hand with Python floats."""

from __future__ import annotations

import math

import pytest
import torch

from chattune.objectives.pair_losses import PreferenceLoss

# (policy chosen, policy rejected, reference chosen, reference rejected, chosen tokens, rejected tokens)
PAIRS = [(-12.0, -15.5, -13.0, -14.0, 6, 9), (-40.25, -22.0, -41.0, -20.5, 20, 11), (-3.0, -3.0, -2.5, -4.0, 2, 3)]


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def by_hand(
    loss_type: str, beta: float, eps: float, gamma: float, sft: float, pc, pr, rc, rr, nc, nr
) -> tuple[float, float, float]:
    if loss_type == "simpo":
        chosen, rejected = beta * pc / nc, beta * pr / nr
    elif loss_type in ("sigmoid_norm", "ipo"):
        chosen, rejected = beta * (pc - rc) / nc, beta * (pr - rr) / nr
    else:
        chosen, rejected = beta * (pc - rc), beta * (pr - rr)
    d = chosen - rejected
    if loss_type in ("sigmoid", "sigmoid_norm"):
        loss = -(1 - eps) * log_sigmoid(d) - eps * log_sigmoid(-d)
    elif loss_type == "robust":
        loss = (-(1 - eps) * log_sigmoid(d) + eps * log_sigmoid(-d)) / (1 - 2 * eps)
    elif loss_type == "hinge":
        loss = max(0.0, 1 - d)
    elif loss_type == "ipo":
        h = (pc - rc) / nc - (pr - rr) / nr  # per-token averaged log-ratios (the IPO paper, TRL)
        loss = (h - 1 / (2 * beta)) ** 2
    else:
        loss = -(1 - eps) * log_sigmoid(d - gamma) - eps * log_sigmoid(gamma - d)
    return loss + sft * (-pc / nc), chosen, rejected


@pytest.mark.parametrize("loss_type", ["sigmoid", "robust", "hinge", "ipo", "sigmoid_norm", "simpo"])
@pytest.mark.parametrize("eps,sft", [(0.0, 0.0), (0.2, 0.5)])
def test_loss_matches_its_formula(loss_type, eps, sft):
    beta, gamma = 0.3, 0.7
    loss_fn = PreferenceLoss(loss_type=loss_type, beta=beta, label_smoothing=eps, simpo_gamma=gamma, sft_weight=sft)
    columns = [torch.tensor(c, dtype=torch.float64) for c in zip(*PAIRS)]
    losses, chosen, rejected = loss_fn(*columns)
    for i, pair in enumerate(PAIRS):
        want_loss, want_chosen, want_rejected = by_hand(loss_type, beta, eps, gamma, sft, *pair)
        assert abs(float(losses[i]) - want_loss) <= 1e-6 * max(1.0, abs(want_loss)), (loss_type, i)
        assert abs(float(chosen[i]) - want_chosen) <= 1e-9 and abs(float(rejected[i]) - want_rejected) <= 1e-9


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="loss.type"):
        PreferenceLoss(loss_type="kto")
    with pytest.raises(ValueError, match="label_smoothing"):
        PreferenceLoss(label_smoothing=0.5)
    assert not PreferenceLoss(loss_type="simpo").needs_reference and PreferenceLoss(loss_type="ipo").needs_reference


def test_orpo_odds_ratio_term_matches_the_paper_and_stays_finite_near_certainty():
    loss = PreferenceLoss(loss_type="orpo", orpo_lambda=0.25)
    policy_chosen = torch.tensor([-6.0, -3e-7], dtype=torch.float64)  # the second: a reply the model is sure of
    policy_rejected = torch.tensor([-9.0, -20.0], dtype=torch.float64)
    chosen_tokens = torch.tensor([4.0, 3.0], dtype=torch.float64)
    rejected_tokens = torch.tensor([3.0, 5.0], dtype=torch.float64)
    losses, chosen, rejected = loss(policy_chosen, policy_rejected, None, None, chosen_tokens, rejected_tokens)
    for i in range(2):
        pc, pr = float(policy_chosen[i] / chosen_tokens[i]), float(policy_rejected[i] / rejected_tokens[i])
        # log odds = log P - log(1 - P), with 1 - P = -expm1(log P) computed without cancellation
        ratio = (pc - math.log(-math.expm1(pc))) - (pr - math.log(-math.expm1(pr)))
        want = -0.25 * log_sigmoid(ratio)
        assert math.isfinite(float(losses[i])) and abs(float(losses[i]) - want) <= 1e-12 * max(1.0, abs(want)), i
        assert abs(float(chosen[i]) - 0.1 * pc) <= 1e-15 and abs(float(rejected[i]) - 0.1 * pr) <= 1e-15
