"""Held-out loss, computed the same way as the training loss (sum of unit losses / global units)."""

from __future__ import annotations

import torch
from torch import nn

from chattune.data.packing import PackedBatch, empty_batch
from chattune.distributed import all_reduce_max, counts_rows, reduce_sums
from chattune.model.fsdp import reshard
from chattune.objectives.base import Objective
from chattune.train.progress import Progress


@torch.no_grad()
def evaluate(model: nn.Module, objective: Objective, batches: list[PackedBatch], device: torch.device,
             pad_token_id: int, progress: Progress | None = None) -> dict[str, float]:
    """The objective's metrics over all ranks' held-out batches, named `eval_*` (eval_loss, ...). A rank with
    fewer batches runs empty ones: every FSDP forward is a collective, so all ranks make the same number.
    The model is resharded after the last forward (`chattune.model.fsdp.reshard`). `progress`: the run's, which
    shows where a long evaluation is (rank 0)."""
    sums: dict[str, float] = {"loss_sum": 0.0, "units": 0.0}
    was_training = model.training
    model.eval()
    weight = 1.0 if counts_rows() else 0.0  # context parallelism: a row's figures count on one rank of its group
    total = all_reduce_max(len(batches), device)
    shown = progress.task("eval", total, "batches") if progress is not None else None
    for i in range(total):
        batch = batches[i] if i < len(batches) else empty_batch(pad_token_id)
        loss, figures = objective.loss_sum(model, batch.to(device))
        sums["loss_sum"] += float(loss) * weight
        sums["units"] += objective.count_units(batch) * weight
        for name, value in figures.items():
            sums[name] = sums.get(name, 0.0) + float(value) * weight
        if shown is not None:
            shown.update(i + 1)
    if shown is not None:
        shown.close()
    model.train(was_training)
    reshard(model)  # the root's gathered bf16 copies would otherwise stay (and be what an export reads)
    sums = reduce_sums(sums, device)
    return {f"eval_{name}": value for name, value in objective.metrics(sums, int(sums["units"])).items()}
