"""The optimizer step in the backward (`optimizer.in_backward: true`): each parameter is updated as soon as its
gradient shard exists, and the gradient is freed at once, so the whole model's gradients never exist together
(the gradients row of the memory estimate becomes one FSDP2 unit's).

FSDP2 calls a sharded parameter's post-accumulate-grad hooks right after it reduce-scatters the parameter's
gradient. The hook here steps the run's one optimizer, for which that parameter is the only one holding a
gradient (every earlier one was freed by its own hook), so the optimizer, its state dict, its checkpoint and the
scheduler are the ordinary ones: a checkpoint resumes with the setting on or off. torchtune builds one optimizer
per parameter instead; one optimizer keeps checkpoints and schedules unchanged.

What the whole gradient decided before the update cannot be decided here:
- clipping scales every gradient by the whole model's norm: refused (max_grad_norm must be null);
- accumulating over microbatches sums gradients before the update: one microbatch per rank per step;
- fp16 loss scaling unscales and checks for overflow over the whole gradient: refused;
- a non-finite loss must skip the update on every rank: the ranks agree on their losses' finiteness before the
  backward (one small all-reduce) and all skip it, so nothing is updated, as in the ordinary step;
- non-finite gradients from finite losses are applied as they arrive (checking each would wait on the device per
  parameter): the step then stops the run, whatever nonfinite_loss says, the last checkpoint intact.
The gradient norm is still logged: each hook adds its shard's squared norm before the update.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from chattune.parallel.fsdp import Placement
from chattune.parallel.tensor_parallel import split_over


class UpdateInBackward:
    """Hooks on the trained parameters of `model` that step `optimizer` with each one's gradient as it arrives."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, placement: Placement):
        if placement.cpu_offload:  # FSDP2's copy of a gradient to the host completes with the backward
            raise ValueError("optimizer.in_backward cannot step a model under model.fsdp.cpu_offload")
        self.optimizer = optimizer
        # Under tensor parallelism a parameter whole on every rank of a tp group holds the same gradient T times:
        # its squares count 1/T on each (as `chattune.train.step` counts them).
        self.tensor = placement.dims.tp
        self.local_squared_norm = torch.zeros((), dtype=torch.float64, device=placement.device)
        # Each parameter's group: its step sees that group holding that parameter alone (`_update`).
        self.group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
        self.handles = [
            parameter.register_post_accumulate_grad_hook(self._update)
            for parameter in model.parameters()
            if parameter.requires_grad
        ]

    def _update(self, parameter: torch.Tensor) -> None:
        grad = parameter.grad
        assert grad is not None  # (a post-accumulate-grad hook: the gradient was just accumulated)
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        norm = torch.linalg.vector_norm(local, dtype=torch.float32)
        square = norm.to(self.local_squared_norm.device, torch.float64).square()
        self.local_squared_norm += square if self.tensor == 1 or split_over(grad) else square / self.tensor
        self._step_alone(parameter)
        parameter.grad = None

    def _step_alone(self, parameter: torch.Tensor) -> None:
        """The optimizer's step over `parameter` only: its group shown holding it alone. A plain step scans every
        parameter of every group for a gradient (`_init_group`): P hooks a step would make that P² checks, inside
        FSDP2's reduce-scatter stream. The group's settings are the live ones (the scheduler's rate); whatever the
        step sets in them is kept."""
        groups, group = self.optimizer.param_groups, self.group_of[id(parameter)]
        alone = {**group, "params": [parameter]}
        self.optimizer.param_groups = [alone]
        try:
            self.optimizer.step()
        finally:
            self.optimizer.param_groups = groups
        group.update((key, value) for key, value in alone.items() if key != "params")

    def begin_step(self) -> None:
        self.local_squared_norm.zero_()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
