"""Preference losses on per-pair log-probabilities, one value per pair (the caller sums and divides by
the global pair count, so the unit of normalisation is the pair).

Inputs per pair: the summed log-probabilities of the chosen and rejected replies under the policy and
the reference, and the replies' token counts. Each loss compares implicit rewards r = beta * (policy -
reference) log-ratios, normalised the way that loss is defined:

- `sigmoid` (DPO, Rafailov et al. 2023), with label smoothing eps (conservative DPO):
  -(1 - eps) log s(d) - eps log s(-d),  d = beta * (log-ratio chosen - log-ratio rejected)
- `robust` (Chowdhury et al. 2024): ((1 - eps) * -log s(d) + eps * log s(-d)) / (1 - 2 eps)
- `hinge` (SLiC): max(0, 1 - d)
- `ipo` (Azar et al. 2023): (h - 1 / (2 beta))^2,  h = log-ratio chosen - log-ratio rejected (summed log-probs)
- `sigmoid_norm`: `sigmoid` with each log-ratio divided by its reply's token count
- `simpo` (Meng et al. 2024, reference-free): -log s(beta * (mean logp chosen - mean logp rejected) - gamma)

An optional SFT term adds `sft_weight` * the mean token NLL of the chosen reply (per pair).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from chattune.config.schema import LOSS_TYPES, REFERENCE_FREE


@dataclass(frozen=True)
class PreferenceLoss:
    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    sft_weight: float = 0.0

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss.type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"loss.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.beta <= 0:
            raise ValueError(f"loss.beta must be positive, got {self.beta}")

    @property
    def needs_reference(self) -> bool:
        return self.loss_type not in REFERENCE_FREE

    def loss_without_preference(self) -> float | None:
        """The per-pair loss where the policy is its reference (every reward 0, so the margin 0): this loss's
        formula at margin 0, whatever the log-probs (sigmoid, sigmoid_norm and robust: ln 2 at any label
        smoothing; hinge: 1; ipo: 1 / (4 beta^2)). None where it depends on the policy's log-probs: a
        reference-free loss (simpo) or an SFT term (the chosen reply's NLL)."""
        if not self.needs_reference or self.sft_weight:
            return None
        zero, one = torch.zeros(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64)
        losses, _, _ = self(zero, zero, zero, zero, one, one)
        return float(losses[0])

    def rewards(self, policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor | None,
                ref_rejected: torch.Tensor | None, chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Implicit rewards of each side, normalised as this loss compares them."""
        if self.loss_type == "simpo":
            return self.beta * policy_chosen / chosen_tokens, self.beta * policy_rejected / rejected_tokens
        chosen, rejected = policy_chosen - ref_chosen, policy_rejected - ref_rejected
        if self.loss_type == "sigmoid_norm":
            chosen, rejected = chosen / chosen_tokens, rejected / rejected_tokens
        return self.beta * chosen, self.beta * rejected

    def __call__(self, policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor | None,
                 ref_rejected: torch.Tensor | None, chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(per-pair losses, chosen rewards, rejected rewards); rewards are detached."""
        chosen_reward, rejected_reward = self.rewards(policy_chosen, policy_rejected, ref_chosen, ref_rejected,
                                                      chosen_tokens, rejected_tokens)
        margin = chosen_reward - rejected_reward
        eps = self.label_smoothing
        if self.loss_type in ("sigmoid", "sigmoid_norm"):
            losses = -(1 - eps) * F.logsigmoid(margin) - eps * F.logsigmoid(-margin)
        elif self.loss_type == "robust":
            losses = ((1 - eps) * -F.logsigmoid(margin) + eps * F.logsigmoid(-margin)) / (1 - 2 * eps)
        elif self.loss_type == "hinge":
            losses = torch.relu(1 - margin)
        elif self.loss_type == "ipo":
            losses = (margin / self.beta - 1 / (2 * self.beta)) ** 2
        else:  # simpo
            losses = -(1 - eps) * F.logsigmoid(margin - self.simpo_gamma) - eps * F.logsigmoid(-(margin - self.simpo_gamma))
        if self.sft_weight:
            losses = losses + self.sft_weight * (-policy_chosen / chosen_tokens)
        return losses, chosen_reward.detach(), rejected_reward.detach()
