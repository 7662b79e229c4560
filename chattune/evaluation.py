"""Held-out loss, computed the same way as the training loss (sum of unit losses / global units)."""

from __future__ import annotations

import torch
from torch import nn

from chattune.distributed import all_reduce_max, all_reduce_sum
from chattune.packing import PackedBatch, empty_batch
from chattune.train_step import Objective


@torch.no_grad()
def evaluate(model: nn.Module, objective: Objective, batches: list[PackedBatch], device: torch.device, pad_token_id: int) -> float:
    """Mean held-out loss over all ranks' batches. A rank with fewer batches runs empty ones: every FSDP
    forward is a collective, so all ranks must make the same number of them."""
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, units
    was_training = model.training
    model.eval()
    for i in range(all_reduce_max(len(batches), device)):
        batch = batches[i] if i < len(batches) else empty_batch(pad_token_id)
        totals[0] += objective.loss_sum(model, batch.to(device)).double()
        totals[1] += objective.count_units(batch)
    model.train(was_training)
    loss_sum, units = all_reduce_sum(totals).tolist()
    return loss_sum / max(units, 1.0)
