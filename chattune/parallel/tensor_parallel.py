"""Tensor parallelism (parallel.tensor=T): each decoder layer's linear layers split across the T ranks of a tp
group (Megatron's layout, with torch's DTensor plans), before FSDP2 shards what each rank holds over dp_shard_cp.

- Attention: q, k and v column-wise (each rank computes H/T query heads and their K/T kv heads), the output
  projection row-wise (its partial sums reduced over the group): the packed attention sees only its own heads,
  which it reads from the tensors' shapes. The MLP: gate and up column-wise, down row-wise.
- Between the blocks the residual stream is split by tokens (sequence parallelism,
  `chattune.parallel.sequence_parallel`): a block's input is all-gathered as one replicated DTensor, so its
  column-wise layers add their input gradients into it and the backward reduces their sum once per block, and its
  partial sums are reduce-scattered back to the ranks' tokens. The norms between the blocks run on each rank's
  tokens; their gradients are summed over the group (`_sum_gradients_over`).
- The vocabulary is split too (loss-parallel, `chattune.parallel.vocab_parallel`): the embedding's and the output
  layer's rows, the loss reduced over the group.
- LoRA's adapters split with their base layers (`_layer_plan`).
- A parameter that acts on one rank's heads while being whole on every rank (Qwen3's and Gemma 3's per-head q
  and k norms) gets only its heads' part of the gradient on each rank: its gradient is summed over the group in
  the backward, so every rank of the group holds the whole one, as for the norms between the blocks.
- The ranks of the group compute the same losses; only the group's first rank reports a row's figures
  (`ParallelDims.reports_rows`).
- The gradient norm: a parameter split over tp holds distinct shards on the group's ranks, one whole on each
  holds the same gradient T times; `chattune.train.step` divides the latter's squares by T (`split_over`).

Which families: those whose decoder layers are `self_attn.{q,k,v,o}_proj` and `mlp.{gate,up,down}_proj` (or a
mixture of experts, left whole: Qwen3-MoE, Qwen2-MoE, Mixtral, which take the row's tokens gathered and hand back
their rank's part) with no other layer acting on the heads than per-head norms (`FAMILIES`, each checked against
stock transformers in tests/distributed/test_tensor_parallel.py); others are refused (UnsupportedModel): OLMo 2's q/k norms
over all heads at once, StableLM's partial per-head norms, OLMo's q/k/v clipped in place, Phi-3's fused
projections among them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module
from torch.nn.utils.stateless import _reparametrize_module
from transformers import PretrainedConfig, PreTrainedModel

from chattune.errors import UnsupportedModel
from chattune.hf_layout import decoder_of
from chattune.parallel.sequence_parallel import (
    Stream,
    finish_block_output,
    finish_whole_block_output,
    gather_block_input,
    gather_whole_block_input,
)

# transformers' model types whose layers follow the plan below (checked against their modules by `parallelize`).
FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma3_text",
    "qwen3_moe",
    "gemma",
    "gemma2",
    "smollm3",
    "granite",
    "mixtral",
    "qwen2_moe",
    "exaone4",
)
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


def parallelize(hf_model: PreTrainedModel, layers: list[nn.Module], tp_mesh: DeviceMesh) -> Stream:
    """Split each decoder layer of `layers` over `tp_mesh` (in place), before compiling and FSDP2, with the
    residual stream split by tokens between the blocks (`chattune.parallel.sequence_parallel`): the returned
    `Stream`, which the embedding and the loss read too."""
    problem = tensor_parallel_problem(hf_model.config, tp_mesh.size())
    if problem:
        raise UnsupportedModel(f"parallel.tensor={tp_mesh.size()}: {problem}")
    group = tp_mesh.get_group()
    stream = Stream(tp_mesh)
    for layer in layers:
        if not all(_linear(_submodule(layer, name)) for name in ATTENTION_PLAN):
            raise UnsupportedModel(
                f"parallel.tensor: {type(layer).__name__} is not laid out as chattune's plan expects "
                f"({', '.join(ATTENTION_PLAN)} linear layers; a 4-bit base's are not split)"
            )
        dense = all(_linear(_submodule(layer, name)) for name in MLP_PLAN)
        plan: dict[str, ParallelStyle] = {}
        for name, style in (PLAN if dense else ATTENTION_PLAN).items():
            plan.update(_layer_plan(layer, name, style))
        parallelize_module(layer, tp_mesh, plan)
        for name in PLAN if dense else ATTENTION_PLAN:  # LoRA's whole halves (`_layer_plan`)
            adapter = _submodule(layer, name)
            if _is_lora(adapter):
                whole = adapter.lora_A if PLAN[name] is ColwiseParallel else adapter.lora_B
                for module in whole.values():
                    distribute_module(module, tp_mesh)
        _hook_block(layer.self_attn, stream, gather_block_input, finish_block_output)
        if dense:
            _hook_block(layer.mlp, stream, gather_block_input, finish_block_output)
        else:  # a mixture of experts, whole on every rank: the row's tokens in, this rank's out
            _hook_block(layer.mlp, stream, gather_whole_block_input, finish_whole_block_output)
        for name in HEAD_NORMS:
            parent_name, _, child = name.rpartition(".")
            norm = getattr(_submodule(layer, parent_name), child, None)
            if norm is not None:
                _sum_gradients_over(norm, group)
        # What runs on the rank's tokens between the blocks (the norms): its gradient summed over the group.
        for name, child in layer.named_children():
            if name not in ("self_attn", "mlp") and any(True for _ in child.parameters()):
                _sum_gradients_over(child, group)
    decoder = decoder_of(hf_model)
    embedding = hf_model.get_input_embeddings()
    for name, child in decoder.named_children():  # the final norm
        if child is not embedding and name != "layers" and any(True for _ in child.parameters()):
            _sum_gradients_over(child, group)
    return stream


def _is_lora(module: nn.Module | None) -> bool:
    """peft's LoRA layer (peft imported only where a model has adapters: it is slow to import)."""
    return any(cls.__name__ == "LoraLayer" and cls.__module__.startswith("peft.") for cls in type(module).__mro__)


def _linear(module: nn.Module | None) -> bool:
    """A linear layer, or peft's LoRA layer around one."""
    return isinstance(module, nn.Linear) or (_is_lora(module) and isinstance(module.base_layer, nn.Linear))


def _layer_plan(layer: nn.Module, name: str, style: type[ParallelStyle]) -> dict[str, ParallelStyle]:
    """The styles for the linear layer `name` of `layer`. A row-wise layer hands its partial sums on as they are:
    the block's hook reduces them, scattered to the ranks' tokens or whole (`finish_block_output`).

    Under LoRA (peft's layer around the linear one) the base layer takes the style, and the adapter splits as
    Megatron's LoRA does: a column-wise layer's A (rank x in) stays whole on every rank (`distribute_module`,
    applied by `parallelize`) and its B (out x rank) is split column-wise like the base; a row-wise layer's A is
    split row-wise (its partial sums, rank wide, added into the base's) and its B stays whole."""
    rowwise = {"output_layouts": Partial(), "use_local_output": False} if style is RowwiseParallel else {}
    module = _submodule(layer, name)
    if not _is_lora(module):
        return {name: style(**rowwise)}
    if any(module.use_dora.values()):  # (validate refuses peft.use_dora first)
        raise UnsupportedModel(
            "parallel.tensor: DoRA's magnitudes need each output row's whole norm, which a row-wise split divides"
        )
    halves = module.lora_B if style is ColwiseParallel else module.lora_A
    return {f"{name}.base_layer": style(**rowwise)} | {
        f"{name}.{'lora_B' if style is ColwiseParallel else 'lora_A'}.{adapter}": style(**rowwise) for adapter in halves
    }


def _hook_block(block: nn.Module, stream: Stream, take: Callable, give: Callable) -> None:
    """`block`'s input hidden states through `take(stream, .)` and its output (the first of several) through
    `give(stream, .)`: a split block's (`gather_block_input`, `finish_block_output`) or a whole one's."""

    def take_input(module, args, kwargs):
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": take(stream, kwargs["hidden_states"])}
        return (take(stream, args[0]), *args[1:]), kwargs

    def give_output(module, args, kwargs, output):
        if isinstance(output, tuple):
            return (give(stream, output[0]), *output[1:])
        return give(stream, output)

    block.register_forward_pre_hook(take_input, with_kwargs=True)
    block.register_forward_hook(give_output, with_kwargs=True)


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
