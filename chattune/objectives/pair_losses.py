"""Preference losses on per-pair log-probabilities, one value per pair (the caller sums and divides by
the global pair count, so the unit of normalisation is the pair), kept as a table of functions.

Inputs per pair: the summed log-probabilities of the chosen and rejected replies under the policy and
the reference, and the replies' token counts. Each loss compares implicit rewards r = beta * (policy -
reference) log-ratios, normalised the way that loss is defined:

- `sigmoid` (DPO, Rafailov et al. 2023), with label smoothing eps (conservative DPO):
  -(1 - eps) log s(d) - eps log s(-d),  d = beta * (log-ratio chosen - log-ratio rejected)
- `robust` (Chowdhury et al. 2024): ((1 - eps) * -log s(d) + eps * log s(-d)) / (1 - 2 eps)
- `hinge` (SLiC): max(0, 1 - d)
- `ipo` (Azar et al. 2023): (h - 1 / (2 beta))^2,  h = the difference of the per-token averaged log-ratios (each
  divided by its reply's token count), as the paper's experiments and TRL define it: on summed log-ratios the
  squared term grows with the square of the replies' length
- `sigmoid_norm`: `sigmoid` with each log-ratio divided by its reply's token count
- `simpo` (Meng et al. 2024, reference-free): -log s(beta * (mean logp chosen - mean logp rejected) - gamma)
- `orpo` (Hong et al. 2024, reference-free): -lambda log s(log odds chosen - log odds rejected), odds = P / (1 - P)
  with log P a reply's mean token log-prob, per pair; plus the chosen replies' NLL averaged over the step's chosen
  tokens (the row's `chosen_nll`: that part's unit is the token, as the paper and TRL define it)

An optional SFT term adds `sft_weight` * the mean token NLL of the chosen reply (per pair).

Why a table: the losses differ in one formula each and in what they need, and the rest of chattune asks
about the needs, never about a loss's name: whether a reference model is built (`needs_reference`), whether
the rewards are length-normalised (`per_token`), which `loss.*` settings the formula reads (`reads`). The needs
are the torch-free catalogue's (`chattune.config.losses.PREFERENCE_LOSSES`, which the config's choices and
`chattune validate` read too); `PAIR_LOSSES` pairs each of its rows with its function (`FORMULAS`). A loss defined
outside chattune is one function and one `PairLossRow` (`register_pair_loss`, which adds its needs to the
catalogue: a `loss.type` choice from then on).
`PreferenceLoss` is built from keyword arguments or from a config's `loss` section (`from_config`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from chattune.config import losses
from chattune.config.losses import LOSS_SETTINGS, LossSpec
from chattune.config.schema import DPOLossConfig
from chattune.config.typed import config_dict


@dataclass(frozen=True)
class PairRewards:
    """What a loss function is given, one entry per pair: the implicit rewards (normalised as its row says) and
    their margin, and the policy's summed log-probs and the replies' token counts they came from."""

    margin: torch.Tensor  # chosen_reward - rejected_reward
    chosen_reward: torch.Tensor
    rejected_reward: torch.Tensor
    policy_chosen: torch.Tensor
    policy_rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor


PairLossFunction = Callable[..., torch.Tensor]  # (PairRewards, **the settings of its row's `reads`) -> per-pair losses


@dataclass(frozen=True)
class PairLossRow:
    """One preference loss: its formula and what it needs."""

    name: str  # its loss.type
    function: PairLossFunction
    needs_reference: bool  # rewards are log-ratios against a reference; False: the policy's own log-probs
    per_token: bool  # each side's reward is divided by its reply's token count (length-normalised)
    reads: tuple[str, ...] = ()  # the settings (of LOSS_SETTINGS) `function` takes by keyword
    # The objective adds the chosen reply's NLL averaged over all chosen tokens of the step (ORPO's SFT term: the
    # unit of that part is the token, not the pair; `PreferenceObjective` normalises it by the step's count).
    chosen_nll: bool = False

    @classmethod
    def of(cls, spec: LossSpec, function: PairLossFunction) -> PairLossRow:
        """The row of the catalogue's `spec`, computed by `function`."""
        return cls(spec.name, function, spec.needs_reference, spec.per_token, spec.reads, spec.chosen_nll)

    @property
    def spec(self) -> LossSpec:
        """What the catalogue (`chattune.config.losses`) knows of this loss."""
        return LossSpec(self.name, self.needs_reference, self.per_token, self.reads, self.chosen_nll)


PAIR_LOSSES: dict[str, PairLossRow] = {}


def register_pair_loss(row: PairLossRow) -> PairLossRow:
    """Add `row` to `PAIR_LOSSES`, after checking that its name is new and that its function takes exactly the
    settings it declares it reads (by keyword, besides the rewards)."""
    catalogued = losses.PREFERENCE_LOSSES.get(row.name)
    if row.name in PAIR_LOSSES or (catalogued is not None and catalogued != row.spec):
        raise ValueError(f"a preference loss named {row.name!r} is registered already")
    unknown = [name for name in row.reads if name not in LOSS_SETTINGS]
    if unknown:
        raise ValueError(
            f"preference loss {row.name!r} reads {unknown}, which are not loss settings {tuple(LOSS_SETTINGS)}"
        )
    parameters = list(inspect.signature(row.function).parameters.values())[1:]
    taken = {p.name for p in parameters if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    if taken != set(row.reads):
        raise ValueError(
            f"preference loss {row.name!r} declares reads={row.reads} but its function takes {sorted(taken)}"
        )
    losses.PREFERENCE_LOSSES[row.name] = row.spec
    PAIR_LOSSES[row.name] = row
    return row


# --- the losses: one function each (a function may serve several rows), and their rows ---


def smoothed_sigmoid(pairs: PairRewards, *, label_smoothing: float) -> torch.Tensor:
    eps = label_smoothing
    return -(1 - eps) * F.logsigmoid(pairs.margin) - eps * F.logsigmoid(-pairs.margin)


def robust(pairs: PairRewards, *, label_smoothing: float) -> torch.Tensor:
    eps = label_smoothing
    return ((1 - eps) * -F.logsigmoid(pairs.margin) + eps * F.logsigmoid(-pairs.margin)) / (1 - 2 * eps)


def hinge(pairs: PairRewards) -> torch.Tensor:
    return torch.relu(1 - pairs.margin)


def ipo(pairs: PairRewards, *, beta: float) -> torch.Tensor:
    return (pairs.margin / beta - 1 / (2 * beta)) ** 2


def simpo(pairs: PairRewards, *, label_smoothing: float, simpo_gamma: float) -> torch.Tensor:
    eps, margin = label_smoothing, pairs.margin
    return -(1 - eps) * F.logsigmoid(margin - simpo_gamma) - eps * F.logsigmoid(-(margin - simpo_gamma))


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate at both ends (Maechler 2012): log(-expm1(x)) near 0, log1p(-exp(x))
    below -ln 2. ORPO's odds of a reply whose mean log-prob is near 0 need the first."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def orpo(pairs: PairRewards, *, orpo_lambda: float) -> torch.Tensor:
    """ORPO's odds-ratio term (Hong et al. 2024; TRL's ORPOTrainer): -lambda log s(log odds(chosen) - log
    odds(rejected)), odds(y) = P / (1 - P) with log P the reply's mean token log-prob; its NLL term is the row's
    `chosen_nll`."""
    chosen = pairs.policy_chosen / pairs.chosen_tokens
    rejected = pairs.policy_rejected / pairs.rejected_tokens
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    return -orpo_lambda * F.logsigmoid(log_odds)


# The catalogue's losses, each computed by (a function may serve several):
FORMULAS: dict[str, PairLossFunction] = {
    "sigmoid": smoothed_sigmoid,
    "robust": robust,
    "hinge": hinge,
    "ipo": ipo,
    "sigmoid_norm": smoothed_sigmoid,
    "simpo": simpo,
    "orpo": orpo,
}
for _spec in list(losses.PREFERENCE_LOSSES.values()):
    register_pair_loss(PairLossRow.of(_spec, FORMULAS[_spec.name]))
del _spec


@dataclass(frozen=True, kw_only=True)
class PreferenceLoss:
    """A preference loss of `PAIR_LOSSES` with its settings: `PreferenceLoss(loss_type="ipo", beta=0.3)`, or
    `PreferenceLoss.from_config(cfg.loss)`."""

    loss_type: str = "sigmoid"
    beta: float = LOSS_SETTINGS["beta"].default
    label_smoothing: float = LOSS_SETTINGS["label_smoothing"].default
    simpo_gamma: float = LOSS_SETTINGS["simpo_gamma"].default
    sft_weight: float = LOSS_SETTINGS["sft_weight"].default
    orpo_lambda: float = LOSS_SETTINGS["orpo_lambda"].default

    def __post_init__(self):
        if self.loss_type not in PAIR_LOSSES:
            raise ValueError(f"loss.type must be one of {tuple(PAIR_LOSSES)}, got {self.loss_type!r}")
        for name, setting in LOSS_SETTINGS.items():  # the catalogue's bounds, as the config's checks hold them
            if problem := setting.problem(getattr(self, name)):
                raise ValueError(problem)

    @classmethod
    def from_config(cls, loss: DPOLossConfig | Mapping[str, Any]) -> PreferenceLoss:
        """The loss of a config's `loss` section (typed, or a mapping): its `type` and the settings it holds (the
        others at their defaults); the section's other keys (chunk_size, implementation, ...) are the output
        layer's."""
        values = config_dict(loss)
        return cls(loss_type=values["type"], **{name: values[name] for name in LOSS_SETTINGS if name in values})

    @property
    def row(self) -> PairLossRow:
        return PAIR_LOSSES[self.loss_type]

    @property
    def needs_reference(self) -> bool:
        return self.row.needs_reference

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

    def rewards(
        self,
        policy_chosen: torch.Tensor,
        policy_rejected: torch.Tensor,
        ref_chosen: torch.Tensor | None,
        ref_rejected: torch.Tensor | None,
        chosen_tokens: torch.Tensor,
        rejected_tokens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Implicit rewards of each side, normalised as this loss compares them (its row's `needs_reference` and
        `per_token`)."""
        row = self.row
        if not row.needs_reference:  # reference-free: the policy's own log-probs
            if row.per_token:
                return self.beta * policy_chosen / chosen_tokens, self.beta * policy_rejected / rejected_tokens
            return self.beta * policy_chosen, self.beta * policy_rejected
        chosen, rejected = policy_chosen - ref_chosen, policy_rejected - ref_rejected
        if row.per_token:
            chosen, rejected = chosen / chosen_tokens, rejected / rejected_tokens
        return self.beta * chosen, self.beta * rejected

    def __call__(
        self,
        policy_chosen: torch.Tensor,
        policy_rejected: torch.Tensor,
        ref_chosen: torch.Tensor | None,
        ref_rejected: torch.Tensor | None,
        chosen_tokens: torch.Tensor,
        rejected_tokens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(per-pair losses, chosen rewards, rejected rewards); rewards are detached."""
        chosen_reward, rejected_reward = self.rewards(
            policy_chosen, policy_rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens
        )
        pairs = PairRewards(
            chosen_reward - rejected_reward,
            chosen_reward,
            rejected_reward,
            policy_chosen,
            policy_rejected,
            chosen_tokens,
            rejected_tokens,
        )
        losses = self.row.function(pairs, **{name: getattr(self, name) for name in self.row.reads})
        if self.sft_weight:
            losses = losses + self.sft_weight * (-policy_chosen / chosen_tokens)
        return losses, chosen_reward.detach(), rejected_reward.detach()
