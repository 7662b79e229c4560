"""Tensor parallelism (parallel.tensor=T): each decoder layer's linear layers split across the T ranks of a tp
group (Megatron's layout, with torch's DTensor plans), before FSDP2 shards what each rank holds over dp_shard_cp.

- Attention: q, k and v column-wise (each rank computes H/T query heads and their K/T kv heads), the output
  projection row-wise (its partial sums all-reduced): the packed attention sees only its own heads, which it
  reads from the tensors' shapes. The MLP: gate and up column-wise, down row-wise.
- Everything else stays whole on every rank of the group: the embeddings, the norms, the output layer. The
  hidden states between the layers are the same on every rank of the group, so the loss is computed whole on
  each (no loss-parallel vocabulary split yet: the output layer's weight is the biggest one left whole), and
  only the group's first rank reports a row's figures (`ParallelDims.reports_rows`).
- A parameter that acts on one rank's heads while being whole on every rank (Qwen3's and Gemma 3's per-head q
  and k norms) gets only its heads' part of the gradient on each rank: its gradient is summed over the group in
  the backward (`_sum_gradients_over`), so every rank of the group holds the whole one, as for the norms
  outside attention.
- The gradient norm: a parameter split over tp holds distinct shards on the group's ranks, one whole on each
  holds the same gradient T times; `chattune.train.step` divides the latter's squares by T (`split_over`).

Which families: those whose decoder layers are `self_attn.{q,k,v,o}_proj` and `mlp.{gate,up,down}_proj` (or a
mixture of experts, left whole: Qwen3-MoE) with no other layer acting on the heads than per-head norms
(`FAMILIES`); others are refused (UnsupportedModel).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, parallelize_module
from torch.nn.utils.stateless import _reparametrize_module
from transformers import PretrainedConfig

from chattune.errors import UnsupportedModel

# transformers' model types whose layers follow the plan below (checked against their modules by `parallelize`).
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "qwen3_moe")
ATTENTION_PLAN = {
    "self_attn.q_proj": ColwiseParallel,
    "self_attn.k_proj": ColwiseParallel,
    "self_attn.v_proj": ColwiseParallel,
    "self_attn.o_proj": RowwiseParallel,
}
# A dense MLP's; a mixture of experts (Qwen3-MoE's sparse layers) stays whole on every rank of the group: each
# rank runs every expert on the same tokens (experts replicated over tp, sharded by FSDP2 as the rest).
MLP_PLAN = {"mlp.gate_proj": ColwiseParallel, "mlp.up_proj": ColwiseParallel, "mlp.down_proj": RowwiseParallel}
PLAN = {**ATTENTION_PLAN, **MLP_PLAN}
HEAD_NORMS = ("self_attn.q_norm", "self_attn.k_norm")  # whole on every rank, applied to the rank's own heads


def tensor_parallel_problem(config: PretrainedConfig, tensor: int) -> str | None:
    """Why `config`'s model cannot be split over `tensor` ranks (None: it can): its family, or sizes that T does
    not divide."""
    if tensor <= 1:
        return None
    text = config.get_text_config()
    if text.model_type not in FAMILIES:
        return (
            f"{text.model_type} has no tensor-parallel plan in chattune (families: {', '.join(FAMILIES)}); train it "
            "with parallel.tensor=1"
        )
    sizes = {
        "attention heads": text.num_attention_heads,
        "key-value heads": getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
        "MLP width": text.intermediate_size,  # (Qwen3-MoE's dense layers')
    }
    for what, size in sizes.items():
        if size % tensor:
            return f"{tensor} does not divide the model's {size} {what}: each rank holds 1/{tensor} of them"
    return None


class SumGradientOverGroup(torch.autograd.Function):
    """The identity forward; the backward sums the gradient over `group` (Megatron's "f" operator)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _sum_gradients_over(norm: nn.Module, group: dist.ProcessGroup) -> None:
    """`norm`'s forward with its own parameters' gradients summed over `group` (each rank normalises its own
    heads); an instance attribute, so its parameter names and state dict are unchanged."""
    forward = type(norm).forward

    def summed_forward(*args, **kwargs):
        weights = {name: SumGradientOverGroup.apply(p, group) for name, p in norm.named_parameters(recurse=False)}
        with _reparametrize_module(norm, weights):
            return forward(norm, *args, **kwargs)

    norm.forward = summed_forward


def parallelize(layers: list[nn.Module], tp_mesh: DeviceMesh, config: PretrainedConfig) -> None:
    """Split each decoder layer of `layers` over `tp_mesh` (in place), before compiling and FSDP2."""
    problem = tensor_parallel_problem(config, tp_mesh.size())
    if problem:
        raise UnsupportedModel(f"parallel.tensor={tp_mesh.size()}: {problem}")
    group = tp_mesh.get_group()
    for layer in layers:
        if not all(isinstance(_submodule(layer, name), nn.Linear) for name in ATTENTION_PLAN):
            raise UnsupportedModel(
                f"parallel.tensor: {type(layer).__name__} is not laid out as chattune's plan expects "
                f"({', '.join(ATTENTION_PLAN)} linear layers)"
            )
        dense = all(isinstance(_submodule(layer, name), nn.Linear) for name in MLP_PLAN)
        plan = {name: style() for name, style in (PLAN if dense else ATTENTION_PLAN).items()}
        # The attention's and the MLP's input as one replicated DTensor: the column-wise layers that read it (q,
        # k, v; gate, up) add their input gradients into it, and the backward all-reduces their sum once per
        # block (Megatron's "f"), not once per layer.
        plan["self_attn"] = PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Replicate()},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
        )
        if dense:
            plan["mlp"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))
        parallelize_module(layer, tp_mesh, plan)
        for name in HEAD_NORMS:
            parent_name, _, child = name.rpartition(".")
            norm = getattr(_submodule(layer, parent_name), child, None)
            if norm is not None:
                _sum_gradients_over(norm, group)


def _submodule(module: nn.Module, name: str) -> nn.Module | None:
    try:
        return module.get_submodule(name)
    except AttributeError:
        return None


def split_over(tensor: torch.Tensor, axis: str = "tp") -> bool:
    """Whether `tensor` (a parameter or its gradient) is a DTensor sharded along the mesh axis `axis`."""
    if not isinstance(tensor, DTensor):
        return False
    names = tensor.device_mesh.mesh_dim_names or ()
    return axis in names and tensor.placements[names.index(axis)].is_shard()
