"""Expert parallelism's token exchange (issue 72, its first part): a MoE layer's experts split over the ranks of an
expert group, each rank holding num_experts / E whole experts, and every token sent to the ranks that hold the experts
its router chose, computed there, and sent back.

transformers 5 gives the MoE families one experts interface: `experts(hidden (T, H), top_k_index (T, k),
top_k_weights (T, k)) -> (T, H)`, the stacked expert weights as parameters whose first dimension is the expert
(Qwen3-MoE's `gate_up_proj` (E, 2I, H) and `down_proj` (E, H, I); biases, gpt-oss's clamped SwiGLU and the rest live
in each family's own class). `ExpertParallelExperts` wraps such a module: the router runs as before on every rank
(the routing computed once, on the rank that holds the token), then

1. dispatch: each (token, choice) pair goes to the rank holding its expert, by one all-to-all with uneven splits
   (the counts exchanged first: a rank learns how many pairs it receives from each);
2. compute: the family's own experts class, holding this rank's experts only, runs each received pair with its
   local expert index and weight 1;
3. combine: a second all-to-all sends each result back, where it is weighted by its routing weight and summed over
   the token's choices, as the stock class does inside.

Nothing is dropped (no capacity factor): every pair reaches its expert, so the layer's output and every gradient
equal the whole layer's (tested on gloo with real processes against the unsplit model). The all-to-alls are
torch's functional ones, whose backward is the reverse exchange: an expert's gradient sums the contributions of every
rank's tokens routed to it, which is what the whole layer's gradient over the group's tokens is.

Not yet here (the rest of issue 72): the `parallel.expert` key and its mesh axis, FSDP2 over the expert shards, the
router's global load-balancing counts, checkpoints, export and the memory estimate.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor


def expert_range(num_experts: int, group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """The experts [first, end) this rank holds: num_experts / E consecutive ones (E: the group's size)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if num_experts % size:
        raise ValueError(f"{num_experts} experts cannot be split evenly over an expert group of {size} ranks")
    per_rank = num_experts // size
    return rank * per_rank, (rank + 1) * per_rank


def local_experts(experts: nn.Module, first: int, end: int) -> nn.Module:
    """A copy of a stacked experts module holding experts [first, end) only: every parameter and buffer whose first
    dimension is the expert count cut to that range, and the module's `num_experts` set to the range's size."""
    num_experts = experts.num_experts
    local = copy.deepcopy(experts)
    for name, tensor in [*experts.named_parameters(recurse=False), *experts.named_buffers(recurse=False)]:
        if tensor.dim() == 0 or tensor.shape[0] != num_experts:
            raise ValueError(
                f"{type(experts).__name__}.{name} of shape {tuple(tensor.shape)} is not stacked by expert "
                f"({num_experts}): its experts cannot be split over ranks"
            )
        part = tensor.detach()[first:end].clone()
        if isinstance(tensor, nn.Parameter):
            setattr(local, name, nn.Parameter(part, requires_grad=tensor.requires_grad))
        else:
            local.register_buffer(name, part)
    local.num_experts = end - first
    return local


def _exchange(tensor: torch.Tensor, send: list[int], receive: list[int], group) -> torch.Tensor:
    """All-to-all of `tensor`'s rows: `send[r]` rows to rank r (in rank order), `receive[r]` rows from it; through
    autograd where `tensor` requires a gradient (its backward the reverse exchange, so every rank of the group must
    take the same path: `ExpertParallelExperts.forward` keeps that so where a rank has nothing to send or compute)."""
    if tensor.requires_grad:  # (torch's functional collective: asynchronous, waited for here)
        group = group if group is not None else dist.group.WORLD
        return wait_tensor(all_to_all_single_autograd(tensor.contiguous(), receive, send, group))
    output = tensor.new_empty((sum(receive), *tensor.shape[1:]))
    dist.all_to_all_single(output, tensor.contiguous(), receive, send, group=group)
    return output


class ExpertParallelExperts(nn.Module):
    """A stacked experts module (module docstring) split over an expert group: this rank holds experts
    [first, end) in `local`, and its forward exchanges tokens with the group (collective: every rank of the group
    calls it the same number of times, a rank with no tokens too)."""

    def __init__(self, experts: nn.Module, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.group = group
        self.num_experts = experts.num_experts
        self.first, self.end = expert_range(self.num_experts, group)
        self.local = local_experts(experts, self.first, self.end)

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        size = dist.get_world_size(self.group)
        per_rank = self.num_experts // size
        tokens, choices = top_k_index.shape
        experts = top_k_index.reshape(-1)  # (T * k): each pair's expert, token-major
        destination = torch.div(experts, per_rank, rounding_mode="floor")
        order = torch.argsort(destination, stable=True)  # the pairs grouped by the rank they go to
        send_counts = torch.bincount(destination, minlength=size)
        receive_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(receive_counts, send_counts, group=self.group)  # how many each rank sends here
        send, receive = send_counts.tolist(), receive_counts.tolist()  # (the split sizes: a host sync per layer)
        pair_tokens = torch.div(order, choices, rounding_mode="floor")
        arrived = _exchange(hidden[pair_tokens], send, receive, self.group)
        arrived_experts = _exchange(experts[order], send, receive, self.group) - self.first  # this rank's indices
        ones = arrived.new_ones(arrived.shape[0], 1)
        computed = self.local(arrived, arrived_experts.unsqueeze(1), ones)  # each pair's expert output, weight 1
        if arrived.requires_grad and not computed.requires_grad:  # nothing arrived: the experts' loop ran no expert
            computed = computed + arrived.sum() * 0  # still in the graph, so this rank's backward exchanges too
        returned = _exchange(computed, receive, send, self.group)  # back, in the order the pairs were sent
        outputs = torch.empty_like(returned).index_copy(0, order, returned)  # token-major again
        weighted = outputs.view(tokens, choices, -1) * top_k_weights.unsqueeze(-1).to(outputs.dtype)
        return weighted.sum(1).to(hidden.dtype)


def split_experts(hf_model: nn.Module, group: dist.ProcessGroup | None = None) -> int:
    """Replace every stacked experts module of `hf_model` (a module with `num_experts` and a parameter stacked by
    expert, called as `experts(hidden, top_k_index, top_k_weights)`) by its `ExpertParallelExperts`. Returns how many
    it replaced."""
    targets = [
        (parent, name, child)
        for parent in hf_model.modules()
        for name, child in parent.named_children()
        if name == "experts"
        and isinstance(getattr(child, "num_experts", None), int)
        and not isinstance(child, ExpertParallelExperts)  # (split already)
    ]
    for parent, name, child in targets:
        setattr(parent, name, ExpertParallelExperts(child, group))
    return len(targets)
