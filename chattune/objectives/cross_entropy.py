"""SFT's objective: the token-weighted mean cross-entropy over every trainable token of a step."""

from __future__ import annotations

import torch
from torch import nn

from chattune.data.packing import PackedBatch
from chattune.objectives.source_figures import document_sums, source_figures


class TokenCrossEntropy:
    """SFT: the unit is a trainable token (label != IGNORE_INDEX)."""

    unit_name = "trainable token"

    def __init__(self, num_sources: int = 1):
        self.num_sources = num_sources  # a mixture's sources: per-source sums for the mixer (chattune.data.mixing_policy)

    def count_units(self, batch: PackedBatch) -> int:
        return batch.num_trainable_tokens

    def loss_sum(self, model: nn.Module, batch: PackedBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        token_losses = model(batch)  # 0 at ignored labels
        if self.num_sources == 1:
            return token_losses.sum(), {}
        doc_losses = document_sums(batch, token_losses.detach())
        return token_losses.sum(), source_figures(batch, doc_losses, self.num_sources)  # units: trainable tokens

    def metrics(self, sums: dict[str, float], global_units: int) -> dict[str, float]:
        """loss: token-weighted mean over every trainable token of the step; num_tokens: those tokens."""
        return {"loss": sums["loss_sum"] / max(global_units, 1), "num_tokens": global_units}
