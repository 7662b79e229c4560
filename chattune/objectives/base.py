"""What every objective provides to the update step, evaluation and metrics (SFT's cross-entropy and
DPO's preference objective implement it side by side)."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from chattune.data.packing import PackedBatch


class Objective(Protocol):
    """What a recipe trains: how many loss units a microbatch holds, their summed loss (with any other
    per-unit figures it reports, summed), and how the step's sums over all ranks become metrics.

    An objective whose loss has a part over a second unit (ORPO: the chosen replies' NLL per chosen token) also
    has `count_step_extras(batch) -> list[int]` (those counts, the same width for every batch) and
    `begin_step(global_units, global_extras)`: the update step all-reduces them with the units, in its one
    all-reduce, and hands them over (device tensors) before the step's first forward.

    An objective whose loss needs a figure of the whole step before any of its losses (KTO's reference point) also
    has `step_statistics(model, microbatches, device) -> (k,) float64 tensor`: a no-grad pass over this rank's
    microbatches of the step (on the host), whose sums the step all-reduces in the same all-reduce and hands to
    `begin_step(global_units, global_extras, global_statistics)`, and `trained_part(batch)`: what of a microbatch
    its forward/backward then runs (on the host); an evaluation does the same over its batches."""

    unit_name: str  # what one loss unit is, for messages

    def count_units(self, batch: PackedBatch) -> int: ...

    def loss_sum(self, model: nn.Module, batch: PackedBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...

    def metrics(self, sums: dict[str, float], global_units: int) -> dict[str, float]: ...


def model_losses(model: nn.Module, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The model's per-token losses (N,), and in training each segment's router loss (S,) where the model trains
    with one (`chattune.model.router_loss`; None otherwise). Evaluation reports the objective's loss alone."""
    if getattr(model, "router_loss", None) is not None and model.training:
        return model(batch, router_losses=True)
    return model(batch), None


def objective_loss(sums: dict[str, float]) -> float:
    """The step's summed objective loss without the router term it trained with (logged apart, `router_loss`)."""
    return sums["loss_sum"] - sums.get("router_loss", 0.0)
