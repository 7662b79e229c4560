"""What every objective provides to the update step, evaluation and metrics (SFT's cross-entropy, the preference
objectives of DPO and KTO and the reward model's implement it side by side)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch
from torch import nn

from chattune.data.packing import PackedBatch


class Objective(ABC):
    """What a recipe trains: how many loss units a microbatch holds, their summed loss (with any other
    per-unit figures it reports, summed), and how the step's sums over all ranks become metrics. Those three
    are abstract; every other hook has a default that does nothing, so the update step and the evaluation call
    each hook of every objective (no probing for optional methods) and a new objective overrides what it needs:

    - a loss with a part over a second unit (ORPO: the chosen replies' NLL per chosen token) counts those units
      (`count_step_extras`); the update step all-reduces them with the units, in its one all-reduce, and hands
      them over (device tensors) in `begin_step`, before the step's first forward;
    - a loss that needs a figure of the whole step before any of its losses (KTO's reference point) computes its
      share of it (`step_statistics`: a no-grad pass over this rank's microbatches), summed in the same
      all-reduce and handed over in `begin_step`; its forward/backward then runs `trained_part` of each
      microbatch. An evaluation does the same over its batches;
    - held-out metrics known before the first step without a forward (DPO whose reference is the initial
      policy): `known_start_metrics`."""

    unit_name: str  # what one loss unit is, for messages

    @abstractmethod
    def count_units(self, batch: PackedBatch) -> int:
        """The loss units of `batch` (its loss is their sum; the step divides by the global count)."""

    @abstractmethod
    def loss_sum(self, model: nn.Module, batch: PackedBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The summed loss of `batch`'s units, and the other figures it reports, summed."""

    @abstractmethod
    def metrics(self, sums: dict[str, float], global_units: int) -> dict[str, float]:
        """The step's (or an evaluation's) metrics from its sums over all ranks."""

    def count_step_extras(self, batch: PackedBatch) -> list[int]:
        """Counts besides the units that the loss is normalised by (the same width for every batch): none."""
        return []

    def step_statistics(
        self, model: nn.Module, microbatches: Iterable[PackedBatch], device: torch.device
    ) -> torch.Tensor | None:
        """This rank's share of a figure of the whole step that every loss needs ((k,) float64 on `device`),
        from a no-grad pass over `microbatches` (on the host): None, no such figure (nothing is run)."""
        return None

    def trained_part(self, batch: PackedBatch) -> PackedBatch:
        """What the forward/backward runs of a microbatch once `step_statistics` ran: the whole batch."""
        return batch

    def begin_step(
        self, global_units: torch.Tensor, global_extras: torch.Tensor, global_statistics: torch.Tensor | None = None
    ) -> None:
        """The step's counts and statistics over all ranks (device tensors, not read back), before its first
        forward: nothing to do."""
        return

    def known_start_metrics(self, batches: list[PackedBatch], device: torch.device) -> dict[str, float] | None:
        """Collective: the held-out metrics of `batches` (this rank's to report: none on a rank whose context
        group's first rank reports them) before the first step without a forward; None: not known in advance (an
        evaluation computes them)."""
        return None


def model_losses(model: nn.Module, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The model's per-token losses (N,), and in training each segment's router loss (S,) where the model trains
    with one (`chattune.model.packed.router_loss`; None otherwise). Evaluation reports the objective's loss alone."""
    if getattr(model, "router_loss", None) is not None and model.training:
        return model(batch, router_losses=True)
    return model(batch), None


def objective_loss(sums: dict[str, float]) -> float:
    """The step's summed objective loss without the router term it trained with (logged apart, `router_loss`)."""
    return sums["loss_sum"] - sums.get("router_loss", 0.0)
