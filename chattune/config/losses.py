"""The preference losses' catalogue: what each `loss.type` needs, and every `loss.*` setting with its default, its
meaning and its bounds, without the formulas (torch-free): the one table the config's keys and choices
(`chattune.config.schema`, and so the configuration reference and `chattune validate`), the memory estimate and
the objectives (`chattune.objectives.pair_losses`, which pairs each row with its function and checks a
`PreferenceLoss`'s settings here) all read.

A row says whether the loss compares the policy with a reference model (`needs_reference`: one is built or cached),
whether each reply's reward is divided by its token count (`per_token`), which `loss.*` settings its formula reads
(`reads`) and whether the objective adds the chosen replies' NLL per chosen token of the step (`chosen_nll`: ORPO).
A new loss is one row here and one function there (`chattune.objectives.pair_losses.register_pair_loss`, which
adds the row for a loss defined outside chattune).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class LossSetting:
    """A `loss.*` setting of the preference losses: its default, what it means, and the values it may take
    (`bound`: a test and what it says when the value fails it; None: any float)."""

    name: str
    default: float
    meaning: str
    bound: tuple[Callable[[float], bool], str] | None = None

    def problem(self, value: float) -> str | None:
        """Why `value` is refused (None: it is not)."""
        if self.bound is None or self.bound[0](value):
            return None
        return f"loss.{self.name} {self.bound[1]}, got {value}"


# The `loss.*` settings of every preference loss besides its type: `beta` scales every loss's rewards and
# `sft_weight` weighs every loss's SFT term; a loss's function takes those it reads by keyword (`LossSpec.reads`).
LOSS_SETTINGS: dict[str, LossSetting] = {
    setting.name: setting
    for setting in (
        LossSetting("beta", 0.1, "the preference loss's inverse temperature", (lambda v: v > 0, "must be positive")),
        LossSetting(
            "label_smoothing",
            0.0,
            "the share of pairs taken as mislabelled",
            (lambda v: 0 <= v < 0.5, "must be in [0, 0.5)"),
        ),
        LossSetting("simpo_gamma", 0.5, "simpo's target reward margin"),
        LossSetting("sft_weight", 0.0, "adds this times the chosen reply's mean token NLL"),
        LossSetting(
            "orpo_lambda",
            0.1,
            "the weight of the odds-ratio term beside the chosen replies' NLL per token, TRL's ORPOConfig.beta",
            (lambda v: v >= 0, "must not be negative"),
        ),
    )
}


@dataclass(frozen=True)
class LossSpec:
    """One preference loss: its `loss.type` and what it needs."""

    name: str
    needs_reference: bool  # rewards are log-ratios against a reference; False: the policy's own log-probs
    per_token: bool  # each side's reward is divided by its reply's token count (length-normalised)
    reads: tuple[str, ...] = ()  # the settings (of LOSS_SETTINGS) its function takes by keyword
    # The objective adds the chosen reply's NLL averaged over all chosen tokens of the step (ORPO's SFT term: the
    # unit of that part is the token, not the pair).
    chosen_nll: bool = False


PREFERENCE_LOSSES: dict[str, LossSpec] = {
    spec.name: spec
    for spec in (
        LossSpec("sigmoid", needs_reference=True, per_token=False, reads=("label_smoothing",)),
        LossSpec("robust", needs_reference=True, per_token=False, reads=("label_smoothing",)),
        LossSpec("hinge", needs_reference=True, per_token=False),
        LossSpec("ipo", needs_reference=True, per_token=True, reads=("beta",)),
        LossSpec("sigmoid_norm", needs_reference=True, per_token=True, reads=("label_smoothing",)),
        LossSpec("simpo", needs_reference=False, per_token=True, reads=("label_smoothing", "simpo_gamma")),
        LossSpec("orpo", needs_reference=False, per_token=True, reads=("orpo_lambda",), chosen_nll=True),
    )
}


def needs_reference(loss_type: object) -> bool:
    """Whether a run of `loss.type` compares with a reference model (an unknown type: as the default does; its
    name is reported by the config's choices)."""
    spec = PREFERENCE_LOSSES.get(loss_type) if isinstance(loss_type, str) else None
    return spec.needs_reference if spec is not None else True


def setting_help(name: str) -> str:
    """A setting's meaning, with the losses whose formula reads it (beta and sft_weight: every loss's)."""
    readers = [spec.name for spec in PREFERENCE_LOSSES.values() if name in spec.reads]
    meaning = LOSS_SETTINGS[name].meaning
    return f"{meaning} (read by {', '.join(readers)})" if readers and name not in ("beta", "sft_weight") else meaning
