"""SFT's objective: the token-weighted mean cross-entropy over every trainable token of a step."""

from __future__ import annotations

import torch
from torch import nn

from chattune.data.documents import IGNORE_INDEX
from chattune.data.packing import PackedBatch
from chattune.model.packed.router_loss import segment_units
from chattune.objectives.base import Objective, model_losses, objective_loss
from chattune.objectives.source_figures import document_sums, source_figures


class TokenCrossEntropy(Objective):
    """SFT: the unit is a trainable token (label != IGNORE_INDEX)."""

    unit_name = "trainable token"

    def __init__(self, num_sources: int = 1):
        self.num_sources = (
            num_sources  # a mixture's sources: per-source sums for the mixer (chattune.data.ingest.mixing_policy)
        )

    def count_units(self, batch: PackedBatch) -> int:
        return batch.num_trainable_tokens

    def loss_sum(self, model: nn.Module, batch: PackedBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        token_losses, router_losses = model_losses(model, batch)  # token losses: 0 at ignored labels
        loss, figures = token_losses.sum(), {}
        if router_losses is not None:  # each trainable token carries its document's router loss
            units = segment_units(batch.labels, batch.segment_ids, router_losses.shape[0], IGNORE_INDEX)
            router = (units.to(router_losses.device) * router_losses).sum()
            loss, figures["router_loss"] = loss + router, router.detach()
        if self.num_sources > 1:
            doc_losses = document_sums(batch, token_losses.detach())
            figures.update(source_figures(batch, doc_losses, self.num_sources))  # units: trainable tokens
        return loss, figures

    def metrics(self, sums: dict[str, float], global_units: int) -> dict[str, float]:
        """loss: token-weighted mean cross-entropy over every trainable token of the step; num_tokens: those
        tokens; router_loss (MoE models trained with one): the router term's mean over them, added to the loss
        trained but not to `loss`."""
        units = max(global_units, 1)
        metrics = {"loss": objective_loss(sums) / units, "num_tokens": global_units}
        if "router_loss" in sums:
            metrics["router_loss"] = sums["router_loss"] / units
        return metrics
