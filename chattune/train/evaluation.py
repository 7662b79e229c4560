"""Held-out evaluation: the loss and the objective's metrics, computed the same way as the training loss (sum of
unit losses / global units), and the sample replies (`chattune.train.samples`), at the times `Evaluator` decides."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol, cast

import torch
from torch import nn

from chattune.data.packing import PackedBatch, empty_batch
from chattune.distributed import ParallelDims, all_reduce_max, all_reduce_sum, host_values_on
from chattune.objectives.base import Objective
from chattune.parallel.fsdp import Placement, reshard
from chattune.train.progress import Progress

if TYPE_CHECKING:
    from chattune.checkpoint.run_state import Every
    from chattune.model.causal_lm import PackedCausalLM
    from chattune.train.samples import EvalSamples

logger = logging.getLogger(__name__)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    objective: Objective,
    batches: list[PackedBatch],
    dims: ParallelDims,
    pad_token_id: int,
    progress: Progress | None = None,
) -> dict[str, float]:
    """The objective's metrics over all ranks' held-out batches, named `eval_*` (eval_loss, ...). A rank with
    fewer batches runs empty ones: every FSDP forward is a collective, so all ranks make the same number.
    The model is resharded after the last forward (`chattune.parallel.fsdp.reshard`). `progress`: the run's, which
    shows where a long evaluation is (rank 0)."""
    # The losses and figures summed on the device (no transfer per batch: `float(loss)` waited for each batch's
    # kernels); the units on the host. One transfer at the end, with the all-reduce.
    device = dims.device
    on_device: dict[str, torch.Tensor] = {"loss_sum": torch.zeros((), dtype=torch.float64, device=device)}
    units = 0.0
    was_training = model.training
    model.eval()
    weight = 1.0 if dims.reports_rows else 0.0  # context parallelism: a row's figures count on one rank of its group
    total = all_reduce_max(len(batches), device)
    held_out = [batches[i] if i < len(batches) else empty_batch(pad_token_id) for i in range(total)]
    local = objective.step_statistics(model, held_out, device)  # KTO: its reference point over the whole set first
    if local is not None:
        _begin_held_out(objective, held_out, local * weight, device, weight)
        held_out = [objective.trained_part(batch) for batch in held_out]
    shown = progress.task("eval", total, "batches") if progress is not None else None
    for i, batch in enumerate(held_out):
        loss, figures = objective.loss_sum(model, batch.to(device))
        for name, value in {"loss_sum": loss, **figures}.items():
            value = torch.as_tensor(value, device=device).detach().to(torch.float64).reshape(()) * weight
            on_device[name] = on_device[name] + value if name in on_device else value
        units += objective.count_units(batch) * weight
        if shown is not None:
            shown.update(i + 1)
    if shown is not None:
        shown.close()
    model.train(was_training)
    reshard(model)  # the root's gathered bf16 copies would otherwise stay (and be what an export reads)
    names = sorted(on_device)  # (every rank reports the same names: the same objective on as many batches)
    local = torch.cat(
        [torch.stack([on_device[name] for name in names]), host_values_on(device, [units], torch.float64)]
    )
    sums = dict(zip([*names, "units"], all_reduce_sum(local).tolist()))
    return {f"eval_{name}": value for name, value in objective.metrics(sums, int(sums["units"])).items()}


def _begin_held_out(
    objective: Objective, batches: list[PackedBatch], local: torch.Tensor, device: torch.device, weight: float
) -> None:
    """Collective: an objective's figures of the whole held-out set (all ranks: `local`, this rank's
    `step_statistics`) that its losses need first (`begin_step`), as a training step's are of the step."""
    units = sum(objective.count_units(batch) for batch in batches) * weight
    reduced = all_reduce_sum(torch.cat([host_values_on(device, [units], torch.float64), local]))
    objective.begin_step(reduced[0], reduced[1:1], reduced[1:])


def start_metrics(
    model: nn.Module,
    objective: Objective,
    batches: list[PackedBatch],
    dims: ParallelDims,
    pad_id: int,
    progress: Progress | None = None,
) -> dict[str, float]:
    """Collective: the held-out metrics before the first step (`eval_*`): those the objective knows without a
    forward (`known_start_metrics`: DPO whose reference is the initial policy), else an evaluation."""
    # context parallelism: a row's figures count on one rank of its group (the others sum none)
    metrics = objective.known_start_metrics(batches if dims.reports_rows else [], dims.device)
    if metrics is None:
        return evaluate(model, objective, batches, dims, pad_id, progress)
    logger.info(
        "step 0: held-out metrics known without evaluating (the reference is the initial policy: every "
        "reward 0, loss %.6g)%s",
        metrics["loss"],
        "" if "logps/chosen" in metrics else "; logps/* are left out: they need the model's forward",
    )
    return {f"eval_{name}": value for name, value in metrics.items()}


class HeldOutScorer(Protocol):
    """A recipe's own held-out evaluation (the GRPO recipe's rollouts on held-out prompts): collective when called,
    its `eval_*` metrics of the model as it is."""

    def __call__(self) -> dict[str, float]: ...

    def describe(self) -> str: ...


class Evaluator:
    """A run's evaluations: the held-out metrics (`held_out`: this rank's share of the held-out batches, scored by
    `objective`, or a recipe's own `HeldOutScorer`; None: no held-out data) and the replies to the sample prompts
    (`samples`; None: none), at step 0 of a fresh run, every eval_every steps and at the end (`every`) — never after
    a stop signal, whose grace period belongs to the checkpoint. Every rank decides alike (the config, the step's
    all-reduce): an evaluation is collective."""

    def __init__(
        self,
        model: nn.Module,
        objective: Objective,
        held_out: list[PackedBatch] | HeldOutScorer | None,
        pad_id: int,
        placement: Placement,
        samples: EvalSamples | None,
        every: Every,
        progress: Progress | None = None,
    ):
        self.model, self.objective, self.pad_id = model, objective, pad_id
        self.batches = held_out if isinstance(held_out, list) else None
        self.scorer = None if isinstance(held_out, list) else held_out
        self.placement, self.samples, self.every, self.progress = placement, samples, every, progress

    def due(self, step: int) -> bool:
        evaluates = self.batches is not None or self.samples is not None or self.scorer is not None
        return evaluates and self.every.due(step) and not self.every.horizon.signalled

    def describe(self) -> str:
        """What one evaluation runs (this rank's share of the held-out set), for the line before step 0's."""
        parts = [self.scorer.describe()] if self.scorer is not None else []
        if self.batches is not None:
            tokens = sum(batch.input_ids.shape[-1] for batch in self.batches)
            parts.append(f"the held-out metrics over {len(self.batches)} batches ({tokens} tokens on this rank)")
        if self.samples is not None:
            parts.append(
                f"{len(self.samples.prompts)} sample replies of up to {self.samples.sampling.max_new_tokens} new tokens"
            )
        return " and ".join(parts)

    def held_out(self, step: int) -> dict[str, float]:
        """Collective: the held-out metrics of the model as it is after `step` (before the first: `start_metrics`),
        `eval_*`; {} without held-out data."""
        if self.scorer is not None:
            return self.scorer()
        if self.batches is None:
            return {}
        score = start_metrics if step == 0 else evaluate
        return score(self.model, self.objective, self.batches, self.placement.dims, self.pad_id, self.progress)

    def sample(self, step: int) -> None:
        """Collective: the sample prompts' replies, written to samples.jsonl (and wandb); nothing without prompts."""
        if self.samples is not None:
            self.samples(
                cast("PackedCausalLM", self.model), self.placement, step
            )  # (sample replies: a causal LM's alone)
