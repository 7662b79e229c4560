"""The update step: the one place that owns microbatching and loss normalisation, for every recipe.

For one optimizer step every rank trains the same number of microbatches (`chattune.data.feed`):
`grad_accum_steps` of its own share, or with world-size-invariant steps its M/W of the
`data.microbatches_per_step` M that every step takes from the one stream. It counts the units the loss
averages over (trainable tokens for SFT, preference pairs for DPO), and all-reduces that count ONCE. Each microbatch's loss is then (sum of unit losses) / (global unit count), and FSDP reduces
gradients as a plain sum. The result is the gradient of the mean loss over every unit of the step,
whatever the split into microbatches and ranks, and is never rescaled afterwards.

An objective whose loss needs a figure of the whole step before any of its losses (KTO's reference point, the
mean log-ratio of the step's mismatched sequences) first runs a no-grad pass over the step's microbatches
(`step_statistics`); its sums ride in the same all-reduce, as float64 beside the counts.

Every rank runs the same number of forward/backward calls (ranks short of data get empty microbatches),
so the end of the data can never leave one rank waiting in a collective. The same all-reduce carries
how many data streams have finished their share of the epoch (see `chattune.data.feed`).

Under context parallelism (`chattune.parallel.context_parallel`) the C ranks of a group train the same rows,
each computing a slice; the group's first rank alone counts their units and reports their sums, so the
normaliser and the metrics count every row once.

On CUDA the host waits for the device once per step (`train_step`): the unit count stays on the device as
the normaliser, and the step's sums, counts, gradient norm and the finite checks come back in one
transfer, right before the optimizer's step, which needs them. Host values go to the device from pinned
memory (`host_values_on`, `PackedBatch.to`): a copy from pageable memory would wait for the device too.
What remains: cut-cross-entropy's `nonzero()`, one sync per microbatch (`chattune.model.head.fused_loss`); and,
only on the steps that log, the step timer's event and the metrics' reductions (`chattune.train.metrics`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from chattune.data.feed import StepBatches
from chattune.data.packing import PackedBatch, empty_batch
from chattune.distributed import MAX_FIGURE, ParallelDims, all_reduce_sum, host_values_on
from chattune.objectives.base import Objective
from chattune.parallel.fsdp import Placement
from chattune.parallel.tensor_parallel import split_over
from chattune.train.in_backward import UpdateInBackward


@dataclass
class StepResult:
    loss_sum: float  # this rank's summed unit losses
    local_units: int  # this rank's loss units
    global_units: int  # all ranks' loss units (the normaliser)
    local_tokens: int  # this rank's tokens, trained or not
    shared_tokens: int = 0  # this rank's prompt tokens computed once instead of again (data.share_prompts)
    ranks_at_epoch_end: int = 0  # ranks whose data stream has finished the epoch
    figures: dict[str, float] = field(default_factory=dict)  # this rank's other per-unit sums (the objective's)
    overflow: bool = False  # fp16: finite losses, non-finite gradients (the loss scale was too high)
    stop_ranks: int = 0  # ranks that received a stop signal (chattune.interrupts): every rank stops after this step


@dataclass
class StepSums:
    """A step's figures while they are still on the device (read later, in the step's one transfer)."""

    counts: torch.Tensor  # int64 (2 + extras,): all ranks' loss units, ranks whose stream is done, `step_extras`
    loss_sum: torch.Tensor  # this rank's summed unit losses (fp32)
    figures: dict[str, torch.Tensor]  # the objective's other sums (fp64)
    local_units: int
    local_tokens: int
    shared_tokens: int = 0

    def tensors(self) -> list[torch.Tensor]:
        return [self.loss_sum.double(), *self.figures.values(), *self.counts.double()]

    def result(self, values: list[float]) -> StepResult:
        """The StepResult from `tensors()`'s values, read to the host."""
        loss_sum, rest = values[0], values[1:]
        figures, counts = rest[: len(self.figures)], rest[len(self.figures) :]
        global_units, ranks_at_epoch_end = counts[0], counts[1]
        return StepResult(
            loss_sum=loss_sum,
            local_units=self.local_units,
            global_units=int(global_units),
            local_tokens=self.local_tokens,
            shared_tokens=self.shared_tokens,
            ranks_at_epoch_end=int(ranks_at_epoch_end),
            figures=dict(zip(self.figures, figures)),
        )


def step_extras(objective: Objective, microbatches: list[PackedBatch]) -> list[int]:
    """An objective's counts besides its units, summed over `microbatches` (`count_step_extras`; none for most):
    all-reduced with the units, in the step's one all-reduce."""
    totals = objective.count_step_extras(empty_batch(0))  # zeros, as wide as every rank's (an empty one's too)
    for batch in microbatches:
        totals = [total + value for total, value in zip(totals, objective.count_step_extras(batch), strict=True)]
    return totals


def _seeded(microbatches: list[PackedBatch], seeds: list[int] | None) -> Iterator[PackedBatch]:
    """`microbatches` in turn, each after seeding the RNG with its seed (None: unseeded), as its training forward is."""
    for index, batch in enumerate(microbatches):
        if seeds is not None:
            torch.manual_seed(seeds[index])
        yield batch


def forward_backward(
    model: nn.Module,
    objective: Objective,
    batches: StepBatches,
    placement: Placement,
    loss_scale: float,
    agree_before_backward: bool = False,
) -> StepSums:
    """Collective: forward/backward every microbatch of one step with the global normaliser (the module
    docstring); the gradients accumulate in the parameters, the step's sums stay on the device (`StepSums`) for
    `optim_step`. `agree_before_backward` (the update in the backward): the ranks agree that their losses are
    finite before the backward, and none runs it otherwise (the backward is the update there, and a non-finite
    loss skips it)."""
    microbatches, seeds, device = batches.microbatches, batches.seeds, placement.device
    # Context parallelism: every rank of a group trains the same rows, and only the first counts and reports them.
    counted = placement.dims.reports_rows
    weight = 1.0 if counted else 0.0
    local_units = sum(objective.count_units(b) for b in microbatches) if counted else 0
    extras = step_extras(objective, microbatches if counted else [])
    local_counts = host_values_on(device, [local_units, int(batches.epoch_end_reached), *extras], torch.int64)
    local_tokens = sum(b.num_tokens for b in microbatches) if counted else 0
    shared_tokens = sum(b.shared_prompt_tokens for b in microbatches) if counted else 0
    # KTO's reference point: a no-grad pass over the whole step before its first backward (None for most)
    local = objective.step_statistics(model, _seeded(microbatches, seeds), device)
    if local is not None:
        microbatches = [objective.trained_part(b) for b in microbatches]  # what the forward/backward runs of each
        reduced = all_reduce_sum(torch.cat([local_counts.double(), local * weight]))  # still the one all-reduce
        counts, global_statistics = reduced[: len(local_counts)].round().long(), reduced[len(local_counts) :]
    else:
        counts, global_statistics = all_reduce_sum(local_counts), None
    # The normaliser stays on the device: reading it here would wait for every kernel queued before it (the
    # previous step's optimizer). A step with nothing to train gives zero gradients, not NaN.
    global_units = counts[0].clamp(min=1)
    # the step's counts (ORPO's chosen tokens weigh its NLL term) and statistics, before the first forward
    objective.begin_step(global_units, counts[2:], global_statistics)
    normaliser = global_units.to(torch.float32)  # as `loss / int` would convert it
    scale = (loss_scale / global_units.double()).to(torch.float32) if loss_scale != 1.0 else None
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    figures: dict[str, torch.Tensor] = {}
    for index, batch in enumerate(microbatches):
        if seeds is not None:
            torch.manual_seed(seeds[index])
        with placement.training_forward():  # the forward's saved tensors on the host, where model.fsdp asks
            batch_loss, batch_figures = objective.loss_sum(model, batch.to(device))
        if not agree_before_backward or _finite_on_every_rank(batch_loss):
            (batch_loss * scale if scale is not None else batch_loss / normaliser).backward()
        loss_sum += batch_loss.detach().float() * weight
        for name, value in batch_figures.items():
            figures[name] = accumulate_figure(name, figures.get(name), value.detach().double(), weight)
    return StepSums(counts, loss_sum, figures, local_units, local_tokens, shared_tokens)


def accumulate_figure(name: str, total: torch.Tensor | None, value: torch.Tensor, weight: float) -> torch.Tensor:
    """A figure over the step's microbatches: summed (times the rank's reporting weight), or the largest for a
    `MAX_FIGURE` (-inf on a rank that does not report)."""
    if name.startswith(MAX_FIGURE):
        value = value if weight else torch.full_like(value, -math.inf)
        return value if total is None else torch.maximum(total, value)
    return value * weight if total is None else total + value * weight


def _finite_on_every_rank(loss: torch.Tensor) -> bool:
    """Collective: whether every rank's `loss` is finite (waits for the forward)."""
    return all_reduce_sum((~torch.isfinite(loss.detach())).double().reshape(1)).item() == 0


def accumulate_gradients(
    model: nn.Module, objective: Objective, batches: StepBatches, placement: Placement, loss_scale: float = 1.0
) -> StepResult:
    """Forward/backward every microbatch of one step with the global normaliser. The gradients come out
    multiplied by `loss_scale` (fp16 loss scaling; `clip_gradients` divides it out). Whether this rank's data
    stream finished the epoch (`batches.epoch_end_reached`) is counted over ranks in the same all-reduce;
    `batches.seeds`: the RNG seed of each microbatch (world-size-invariant steps: dropout independent of which
    rank runs it). `placement`: what `chattune.parallel.fsdp.shard_model` applied to `model`."""
    sums = forward_backward(model, objective, batches, placement, loss_scale)
    return sums.result(torch.stack(sums.tensors()).tolist())


def _clip_on_device(
    model: nn.Module,
    dims: ParallelDims,
    max_norm: float | None,
    local_loss_finite: torch.Tensor,
    loss_scale: float,
    stop_requested: Callable[[], bool] | None = None,
    local_norm: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`clip_gradients` with its results left on the device: (total norm, NaN where any rank's loss is not
    finite; whether every rank's loss was finite; how many ranks asked to stop). Nothing here waits for the
    device: the gradients are unscaled and clipped whatever the norm (with a non-finite norm they become NaN,
    and the step is skipped). The same all-reduce carries this rank's stop request, asked of `stop_requested`
    now, after the backward: a signal that arrived while the step computed stops the run after this step, not
    the next one (read at the step's start, it made a stop run one more whole step). `local_norm`: this rank's
    shards' norm, measured already (the update in the backward freed the gradients)."""
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [g for p in params if (g := p.grad) is not None]
    # FSDP2 gradients are DTensor shards: each rank's squared norm covers only its shards, so they sum (each shard
    # counted once: divided by how many ranks hold it).
    if any(not isinstance(g, DTensor) for g in grads) and dims.world_size > 1:
        raise ValueError("clip_gradients expects every gradient sharded (FSDP2 DTensors) when running on several ranks")
    local_grads = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    device = local_loss_finite.device  # the loss's device: CPU offload keeps the shards on the host
    if local_norm is not None:
        squares = local_norm.to(device).double().square() / dims.grad_norm_replicas
    else:
        # a parameter split over tp: distinct shards on the tp group's ranks; one whole on each: the same T times
        split = [local for grad, local in zip(grads, local_grads) if split_over(grad)] if dims.tp > 1 else []
        whole = [local for grad, local in zip(grads, local_grads) if not split_over(grad)] if split else local_grads
        squares = torch.zeros((), dtype=torch.float64, device=device)
        for part, holders in ((split, dims.grad_norm_replicas), (whole, dims.grad_norm_replicas * dims.tp)):
            if part:
                squares += torch.nn.utils.get_total_norm(part, foreach=True).to(device).double().square() / holders
    stop = stop_requested is not None and stop_requested()
    stop_flag = host_values_on(device, [float(stop)], torch.float64)[0]
    # every rank: the flags and the stop requests are the whole run's
    sums = all_reduce_sum(torch.stack([squares, (~local_loss_finite).to(device).double(), stop_flag]))
    losses_finite = sums[1] == 0
    total_norm = torch.where(losses_finite, sums[0].sqrt() / loss_scale, torch.full_like(sums[0], float("nan")))
    if loss_scale != 1.0:  # unscale the local shards in place
        torch._foreach_mul_(local_grads, 1.0 / loss_scale)
    if max_norm is not None:  # torch's clip_grads_with_norm_ on the local shards (a foreach over DTensors of
        # several meshes, tensor parallelism's and FSDP2's alone, is refused): the same coefficient
        coefficient = (max_norm / (total_norm.float() + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(local_grads, coefficient.to(local_grads[0].device) if local_grads else coefficient)
    return total_norm, losses_finite, sums[2]


def clip_gradients(
    model: nn.Module,
    placement: Placement,
    max_norm: float | None,
    local_loss_finite: bool = True,
    loss_scale: float = 1.0,
) -> tuple[float, bool]:
    """(Total gradient norm over all ranks, whether every rank's loss was finite); the gradients are
    divided by `loss_scale` and clipped to max_norm when set. The norm is NaN on every rank when any rank's
    loss or gradients are non-finite: one all-reduce carries both, so all ranks decide alike (and tell
    an fp16 overflow, finite losses with non-finite gradients, from a non-finite loss)."""
    finite = torch.tensor(local_loss_finite, device=placement.device)
    total_norm, losses_finite, _ = _clip_on_device(model, placement.dims, max_norm, finite, loss_scale)
    norm, all_finite = torch.stack([total_norm, losses_finite.double()]).tolist()
    return norm, bool(all_finite)


class LossScale:
    """Dynamic loss scaling, for fp16 compute (model.fsdp.param_dtype=float16), whose gradients would
    otherwise underflow: every unit's loss is already divided by the step's global unit count, so most
    gradient values are far below fp16's smallest normal number (6e-5).

    The loss is multiplied by `scale` before backward and the gradients divided by it before clipping.
    A step whose losses are finite but whose gradients are not (an overflow) is skipped on every rank and
    halves the scale; `growth_interval` finite steps in a row double it. The decision rides on the global
    gradient norm's all-reduce (`clip_gradients`), so every rank takes the same one, which a per-rank
    overflow check (torch.amp.GradScaler's) does not promise for sharded gradients. The algorithm and
    defaults are GradScaler's. Disabled (scale 1, no state changes) for bf16 and fp32."""

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_interval: int = 2000):
        self.enabled, self.growth_interval = enabled, growth_interval
        self.scale = init_scale if enabled else 1.0
        self.good_steps = 0

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            self.scale, self.good_steps = self.scale / 2, 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale, self.good_steps = self.scale * 2, 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = state["scale"], state["good_steps"]


@dataclass
class UpdateRule:
    """How a step's gradients update the weights (`train_step`): divided by the fp16 `loss_scale` (None: no
    loss scaling) and clipped to `max_grad_norm` (None: not clipped), then the `optimizer` steps and the
    learning-rate `scheduler` advances."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    max_grad_norm: float | None
    loss_scale: LossScale | None = None
    in_backward: UpdateInBackward | None = None  # optimizer.in_backward: the optimizer steps in the backward


def train_step(
    model: nn.Module,
    objective: Objective,
    batches: StepBatches,
    update: UpdateRule,
    placement: Placement,
    stop_requested: Callable[[], bool] | None = None,
) -> tuple[StepResult, float]:
    """One optimizer step: `forward_backward`, then `optim_step` (clipping, optimizer and scheduler: `update`).
    Returns the step and grad norm.

    A non-finite grad norm (any rank's loss or gradients) means the optimizer did not step, on every rank:
    the parameters and optimizer state stay as they were (the schedule still advances with the step
    number). `result.overflow` tells an fp16 overflow (handled by `update.loss_scale`: the step is retried at
    a lower scale on the next data) from a non-finite loss, for which the caller decides whether to go
    on or stop. `stop_requested`: whether this rank has received a stop signal, asked after the backward;
    `result.stop_ranks` counts the ranks that had."""
    in_backward = update.in_backward
    loss_scale = update.loss_scale or LossScale(enabled=False)
    if in_backward is not None:
        if update.max_grad_norm is not None or loss_scale.enabled or len(batches.microbatches) != 1:
            raise ValueError(
                "optimizer.in_backward needs no clipping, no fp16 loss scaling and one microbatch per rank per step "
                f"(max_grad_norm={update.max_grad_norm}, {len(batches.microbatches)} microbatches)"
            )
        in_backward.begin_step()
    sums = forward_backward(model, objective, batches, placement, loss_scale.scale, in_backward is not None)
    return optim_step(model, placement, sums, update, stop_requested)


def optim_step(
    model: nn.Module,
    placement: Placement,
    sums: StepSums,
    update: UpdateRule,
    stop_requested: Callable[[], bool] | None = None,
) -> tuple[StepResult, float]:
    """Collective: the update of the gradients `forward_backward` left (its `sums`): unscaled and clipped, the
    step's one device-to-host transfer, the optimizer's step where every rank's losses and gradients are finite,
    the loss scale and the schedule advanced, the gradients freed. Returns the step and its gradient norm."""
    optimizer, scheduler, in_backward = update.optimizer, update.scheduler, update.in_backward
    loss_scale = update.loss_scale or LossScale(enabled=False)
    total_norm, losses_finite, stop_ranks = _clip_on_device(
        model,
        placement.dims,
        update.max_grad_norm,
        torch.isfinite(sums.loss_sum),
        loss_scale.scale,
        stop_requested,
        local_norm=in_backward.local_squared_norm.sqrt() if in_backward is not None else None,
    )
    # The step's one device-to-host transfer: its sums, counts, gradient norm and finiteness together. The
    # optimizer's step below is the one decision that needs them on the host.
    values = torch.stack([total_norm, losses_finite.double(), stop_ranks, *sums.tensors()]).tolist()
    grad_norm, all_finite, result = values[0], bool(values[1]), sums.result(values[3:])
    result.stop_ranks = int(values[2])
    if in_backward is not None and all_finite and not math.isfinite(grad_norm):
        raise FloatingPointError(
            "non-finite gradients from finite losses, and optimizer.in_backward applied them as they were reduced: "
            "the weights are no longer finite. The last checkpoint is intact (resume=auto continues from it; "
            "optimizer.in_backward=false skips such a step instead)."
        )
    if math.isfinite(grad_norm) and in_backward is None:
        optimizer.step()
    result.overflow = loss_scale.enabled and all_finite and not math.isfinite(grad_norm)
    loss_scale.update(result.overflow)
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return result, grad_norm
