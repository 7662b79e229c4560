"""Expert parallelism (parallel.expert=E): a MoE layer's experts split over the E ranks of an expert group, each rank
holding num_experts / E whole experts, and every token sent to the ranks that hold the experts its router chose,
computed there, and sent back.

transformers 5 gives the MoE families one experts interface: `experts(hidden (T, H), top_k_index (T, k),
top_k_weights (T, k)) -> (T, H)`, the stacked expert weights as parameters whose first dimension is the expert
(Qwen3-MoE's `gate_up_proj` (E, 2I, H) and `down_proj` (E, H, I); biases, gpt-oss's clamped SwiGLU and the rest live
in each family's own class). `ExpertParallelExperts` takes such a module's place, under the same name and with
parameters of the same names and global shapes: each a DTensor on the expert mesh, sharded by expert (Shard(0)), so
that checkpoints, the HF export and loading see the stock layout on every layout, and FSDP2 shards what each rank
holds over the ranks holding the same experts (`chattune.parallel.fsdp.shard_model`). The router runs as before on
every rank (the routing computed once, on the rank that holds the token), then

1. dispatch: each (token, choice) pair goes to the rank holding its expert, by one all-to-all with uneven splits,
   sorted by expert (the counts per expert exchanged first: a rank learns how many pairs it receives from each rank
   for each of its experts, so the pairs' expert indices need no exchange of their own);
2. compute: the family's own experts class, run on this rank's experts only (its weights the local parts of the
   DTensors), computes each received pair with its local expert index and weight 1;
3. combine: a second all-to-all sends each result back, where it is weighted by its routing weight and summed over
   the token's choices, as the stock class does inside.

Nothing is dropped (no capacity factor): every pair reaches its expert, so the layer's output and every gradient
equal the whole layer's (tested on gloo with real processes against the unsplit model). The all-to-alls are
torch's functional ones, whose backward is the reverse exchange: an expert's gradient sums the contributions of every
rank's tokens routed to it, which is what the whole layer's gradient over the group's tokens is. The exchange is a
collective: every rank of a group runs each MoE layer as often as the others (the update step's equal microbatch
counts, generation's synced forwards) and it stays outside compiled graphs (its split sizes are host values).

The routing of the training forwards is counted per expert where the exchange already runs (outside compiled graphs,
no extra host sync) and logged over the steps since the last logged one (`routing_figures`): the busiest expert's
load over the mean, per MoE layer. Not here yet (issue 72): tensor parallelism with it, LoRA on the experts, the
routing figures without expert parallelism.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from transformers import PretrainedConfig


def expert_range(num_experts: int, size: int, rank: int) -> tuple[int, int]:
    """The experts [first, end) rank `rank` of an expert group of `size` holds: num_experts / size consecutive
    ones."""
    if num_experts % size:
        raise ValueError(f"{num_experts} experts cannot be split evenly over an expert group of {size} ranks")
    per_rank = num_experts // size
    return rank * per_rank, (rank + 1) * per_rank


def stacked_tensors(experts: nn.Module) -> dict[str, torch.Tensor]:
    """A stacked experts module's own parameters by name, each checked to be stacked by expert (its first dimension
    `num_experts`): a ValueError naming the one that is not, or the module's buffers."""
    num_experts = experts.num_experts
    if buffers := [name for name, _ in experts.named_buffers()]:  # (no transformers family has any)
        raise ValueError(
            f"{type(experts).__name__} holds buffers ({', '.join(buffers)}), which the split does not carry: its "
            "experts cannot be split over ranks"
        )
    tensors = dict(experts.named_parameters(recurse=False))
    for name, tensor in tensors.items():
        if tensor.dim() == 0 or tensor.shape[0] != num_experts:
            raise ValueError(
                f"{type(experts).__name__}.{name} of shape {tuple(tensor.shape)} is not stacked by expert "
                f"({num_experts}): its experts cannot be split over ranks"
            )
    inner = [name for name, _ in experts.named_parameters() if "." in name]
    if not any(isinstance(t, nn.Parameter) for t in tensors.values()) or inner:
        raise ValueError(
            f"{type(experts).__name__} holds no stacked expert weights of its own, or weights in modules "
            f"({', '.join(inner)}): its experts cannot be split over ranks"
        )
    return tensors


def _compute_module(experts: nn.Module, first: int, end: int) -> nn.Module:
    """A copy of `experts` that computes experts [first, end): its parameters empty placeholders of the local shape
    (on the meta device: the weights are handed to each call, `torch.func.functional_call`), its `num_experts` the
    range's size; its config the model's own (shared, not copied: the experts implementation is read from it)."""
    memo: dict[int, object] = {}
    for parameter in experts.parameters(recurse=False):
        shape = (end - first, *parameter.shape[1:])
        memo[id(parameter)] = nn.Parameter(
            torch.empty(shape, dtype=parameter.dtype, device="meta"), requires_grad=parameter.requires_grad
        )
    for value in vars(experts).values():  # the config, and process groups set on every module (the context
        # group), are shared
        if isinstance(value, (dist.ProcessGroup, DeviceMesh, PretrainedConfig)):
            memo[id(value)] = value
    compute = copy.deepcopy(experts, memo)
    compute.num_experts = end - first
    return compute


def _exchange(tensor: torch.Tensor, send: list[int], receive: list[int], group) -> torch.Tensor:
    """All-to-all of `tensor`'s rows: `send[r]` rows to rank r (in rank order), `receive[r]` rows from it; through
    autograd where `tensor` requires a gradient (its backward the reverse exchange, so every rank of the group must
    take the same path: `ExpertParallelExperts.forward` keeps that so where a rank has nothing to send or compute)."""
    if tensor.requires_grad:  # (torch's functional collective: asynchronous, waited for here)
        return wait_tensor(all_to_all_single_autograd(tensor.contiguous(), receive, send, group))
    output = tensor.new_empty((sum(receive), *tensor.shape[1:]))
    dist.all_to_all_single(output, tensor.contiguous(), receive, send, group=group)
    return output


def _recomputing() -> bool:
    """Whether this forward runs inside a backward: activation checkpointing's recomputation of a layer."""
    return torch._C._current_graph_task_id() != -1


def routing_figures(model: nn.Module, device: torch.device) -> dict[str, float]:
    """Collective (every rank, in the same order): the routing of the training forwards since the last call, over
    every rank, from each split experts module's counts (then reset): `experts_imbalance`, the largest over MoE
    layers of the busiest expert's pairs over the mean per expert (1: even), `experts_imbalance_mean` its mean over
    the layers, and `experts_routed`, the (token, choice) pairs a layer routed (every token's top-k). {} for a model
    without split experts."""
    from chattune.distributed import all_reduce_sum

    modules = [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]
    if not modules:
        return {}
    local = [
        (m.routed if m.routed is not None else torch.zeros(m.num_experts, dtype=torch.long)).to(device) for m in modules
    ]
    for module in modules:
        module.routed = None
    counts = all_reduce_sum(torch.cat(local).double()).split([m.num_experts for m in modules])  # one collective
    imbalance = torch.stack([c.max() / c.mean().clamp_min(1e-12) for c in counts])
    return {
        "experts_imbalance": float(imbalance.max()),
        "experts_imbalance_mean": float(imbalance.mean()),
        "experts_routed": float(torch.stack([c.sum() for c in counts]).mean()),
    }


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a stacked weight (a DTensor's local part, through autograd: its gradient arrives as
    the DTensor's, sharded by expert)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class ExpertParallelExperts(nn.Module):
    """A stacked experts module (module docstring) split over the ranks of `mesh` (1-D, the expert group): its
    parameters keep their names and global shapes as DTensors sharded by expert, this rank's part experts
    [first, end); its forward exchanges tokens with the group (collective: every rank of the group calls it the
    same number of times, a rank with no tokens too)."""

    def __init__(self, experts: nn.Module, mesh: DeviceMesh) -> None:
        super().__init__()
        tensors = stacked_tensors(experts)
        self.mesh, self.group = mesh, mesh.get_group()
        self.num_experts = experts.num_experts
        self.first, self.end = expert_range(self.num_experts, mesh.size(), mesh.get_local_rank())
        self.family = type(experts).__name__
        # (token, choice) pairs this rank's training forwards routed to each expert since `routing_figures` last
        # read them (None: none yet); evaluation, references, generation and recomputed forwards are not counted
        self.routed: torch.Tensor | None = None
        self._compute = (_compute_module(experts, self.first, self.end),)  # (a tuple: not a submodule, no names)
        self._weights = [name for name, t in tensors.items() if isinstance(t, nn.Parameter)]
        for name in self._weights:
            whole = tensors[name]
            local = whole.detach()[self.first : self.end].clone()
            sharded = DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False, shape=whole.shape, stride=whole.stride()
            )
            self.register_parameter(name, nn.Parameter(sharded, requires_grad=whole.requires_grad))

    @property
    def compute(self) -> nn.Module:
        """The family's own experts module that computes this rank's experts (its weights handed to each call)."""
        return self._compute[0]

    def extra_repr(self) -> str:
        return f"{self.family}, experts {self.first}..{self.end - 1} of {self.num_experts} on this rank"

    @torch._dynamo.disable  # host-side split sizes and collectives: outside a compiled layer's graph
    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        size = self.mesh.size()
        per_rank = self.num_experts // size
        tokens, choices = top_k_index.shape
        experts = top_k_index.reshape(-1)  # (T * k): each pair's expert, token-major
        order = torch.argsort(experts, stable=True)  # the pairs by expert: grouped by the rank they go to, too
        routed = torch.zeros(self.num_experts, dtype=torch.long, device=experts.device)  # (index_add: no host sync,
        routed.index_add_(0, experts, torch.ones_like(experts))  # which bincount makes on CUDA to size its output)
        if self.training and torch.is_grad_enabled() and not _recomputing():
            self.routed = routed if self.routed is None else self.routed + routed
        # Each rank learns how many pairs every rank sends to each of its experts: the split sizes of the exchange,
        # and (the pairs arrive sorted by expert) each arrived pair's local expert, with no exchange of indices
        arriving = torch.empty_like(routed)
        dist.all_to_all_single(arriving, routed, group=self.group)  # (size, per_rank): from each rank, per expert
        counts = torch.cat([routed, arriving]).tolist()  # (the split sizes: a host sync per layer)
        sent_per_expert, arrived_per_expert = counts[: self.num_experts], counts[self.num_experts :]
        send = [sum(sent_per_expert[r * per_rank : (r + 1) * per_rank]) for r in range(size)]
        receive = [sum(arrived_per_expert[r * per_rank : (r + 1) * per_rank]) for r in range(size)]
        local = torch.arange(per_rank, device=experts.device).repeat(size)
        arrived_experts = local.repeat_interleave(arriving, output_size=sum(receive))  # this rank's indices
        pair_tokens = torch.div(order, choices, rounding_mode="floor")
        arrived = _exchange(hidden[pair_tokens], send, receive, self.group)
        ones = arrived.new_ones(arrived.shape[0], 1)
        weights = {name: _local(getattr(self, name)).to(arrived.dtype) for name in self._weights}
        computed = torch.func.functional_call(self.compute, weights, (arrived, arrived_experts.unsqueeze(1), ones))
        if torch.is_grad_enabled() and arrived.shape[0] == 0:  # nothing arrived: the experts' loop ran no expert
            # Still in the graph, tokens and weights: this rank's backward exchanges too, and its experts get a zero
            # gradient, so that their FSDP2 unit reduce-scatters with the ranks holding the same experts (a weight
            # without a gradient skips it, and those ranks would wait for it)
            computed = computed + (arrived.sum() + sum(w.sum() for w in weights.values())) * 0
        returned = _exchange(computed, receive, send, self.group)  # back, in the order the pairs were sent
        outputs = torch.empty_like(returned).index_copy(0, order, returned)  # token-major again
        weighted = outputs.view(tokens, choices, -1) * top_k_weights.unsqueeze(-1).to(outputs.dtype)
        return weighted.sum(1).to(hidden.dtype)


def experts_modules(root: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """Every stacked experts module under `root` (a child named `experts` with an int `num_experts`, called as
    `experts(hidden, top_k_index, top_k_weights)`) as (parent, name, module), split ones included."""
    return [
        (parent, name, child)
        for parent in root.modules()
        for name, child in parent.named_children()
        if name == "experts" and isinstance(getattr(child, "num_experts", None), int)
    ]


def split_experts(hf_model: nn.Module, mesh: DeviceMesh) -> int:
    """Replace every stacked experts module of `hf_model` by its `ExpertParallelExperts` over `mesh` (the expert
    group). Returns how many it replaced (those split already are left as they are). A ValueError where a module's
    weights are not all stacked by expert or its experts do not split evenly over the group."""
    targets = [t for t in experts_modules(hf_model) if not isinstance(t[2], ExpertParallelExperts)]
    for _, _, child in targets:  # every module checked before any is split: a refusal leaves the model whole
        stacked_tensors(child)
    for parent, name, child in targets:
        setattr(parent, name, ExpertParallelExperts(child, mesh))
    return len(targets)
