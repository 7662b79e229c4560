"""What autograd keeps for one microbatch's backward, found without memory: the decoder's forward run on the meta
device (shapes only) under a saved-tensors hook that counts each storage once, parameters excluded
(`activation_bytes`, the memory estimate's activations row, `chattune.model.cost.memory`).

The kernels whose meta forward would not say what the real one keeps run through stand-ins registered in
transformers' interfaces under TRACE_ATTENTION: attention keeps what the packed kernels keep (query, key, value,
output and a log-sum-exp per head and token, never a score matrix); a mixture of experts' experts follow
transformers' grouped-GEMM forward, whose saved tensors depend on the number of token-expert pairs and not on the
routing (which the meta device cannot compute). LoRA's adapters are added to the meta model as chattune places them
(`lora_targets`), on stacked experts with the merged weight peft computes in each forward.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import types
from collections import OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from chattune.model.cost.inputs import MemoryInputs

TRACE_ATTENTION = "chattune_memory_trace"  # the stand-ins' name in transformers' Attention and Experts interfaces


def meta_model(hf_config, dtype: torch.dtype = torch.float32, attention: str | None = None) -> nn.Module:
    """The model of `hf_config` on the meta device: shapes without memory or initialisation; `attention`: the
    attention (and a mixture of experts' experts) implementation's name."""
    from transformers import AutoModelForCausalLM

    kwargs = {"attn_implementation": attention, "experts_implementation": attention} if attention else {}
    # A copy: from_config records the attention implementation in the config, which a live model may share.
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(copy.deepcopy(hf_config), dtype=dtype, **kwargs)


def repeated_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder's repeated layers (the largest ModuleList of the model)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return max(lists, key=len) if lists else []


def lora_targets(
    model: nn.Module, targets: tuple[str, ...]
) -> tuple[dict[str, nn.Linear], list[tuple[nn.Module, str]]]:
    """What LoRA adapts, as chattune resolves `peft.target_modules` (`chattune.model.peft.adapter_targets`): the linear
    layers by name (`all-linear`: every one but the output layer; on a mixture of experts also but its routers and
    the layers peft's conversion would move), and the stacked expert weights as (experts module, parameter name)."""
    from types import SimpleNamespace

    from chattune.model.peft.adapter_targets import resolve_targets

    named = "all-linear" if "all-linear" in targets else list(targets)
    settings = SimpleNamespace(target_modules=named, rank=8, alpha=16, train_router=False)
    resolved = resolve_targets(model, settings, "CAUSAL_LM")
    linears = {path: m for path, m in model.named_modules() if isinstance(m, nn.Linear)}
    if resolved.modules == "all-linear":  # peft's meaning: every linear layer but the output layer
        chosen = {path for path, m in linears.items() if m is not model.get_output_embeddings()}
    else:
        names = [resolved.modules] if isinstance(resolved.modules, str) else resolved.modules
        chosen = {path for path in linears if any(path == n or path.endswith(f".{n}") for n in names)}
    stacks = [(model.get_submodule(p.rsplit(".", 1)[0]), p.rsplit(".", 1)[1]) for p in resolved.parameters]
    return {path: m for path, m in linears.items() if path in chosen}, stacks


class _KeptByPackedAttention(torch.autograd.Function):
    """Attention's stand-in for the trace: keeps what a packed kernel keeps for its backward."""

    @staticmethod
    def forward(ctx, query, key, value):
        output = query.new_empty(*query.shape[:-1], value.shape[-1])  # (MLA: the value's head size, not the query's)
        log_sum_exp = torch.empty(query.shape[:-1], dtype=torch.float32, device=query.device)
        ctx.save_for_backward(query, key, value, output, log_sum_exp)
        return output

    @staticmethod
    def backward(ctx, grad):  # never run: the trace only counts
        query, key, value, _, _ = ctx.saved_tensors
        return torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)


@torch.compiler.disable  # opaque to a compiled layer's trace, as the packed kernels are: it keeps what they keep
def _traced_attention(module, query, key, value, attention_mask, **kwargs):
    return _KeptByPackedAttention.apply(query, key, value).transpose(1, 2), None


class _KeptByGroupedLinear(torch.autograd.Function):
    """A mixture of experts' grouped matmul's stand-in for the trace: keeps its input (and the experts' weights,
    parameters, not counted), as torch's grouped_mm does; the output's shape only (meta grouped_mm takes bf16 alone)."""

    @staticmethod
    def forward(ctx, hidden, weight, offsets, out_features: int):
        ctx.save_for_backward(hidden, weight, offsets)
        return hidden.new_empty(hidden.shape[0], out_features)

    @staticmethod
    def backward(ctx, grad):  # never run: the trace only counts
        hidden, weight, _ = ctx.saved_tensors
        return torch.zeros_like(hidden), torch.zeros_like(weight), None, None


@torch.compiler.disable  # opaque to a compiled layer's trace, as grouped_mm's backward keeps its input
def _grouped_linear(experts, hidden, weight, offsets, bias):
    out_features = weight.shape[-1] if experts.is_transposed else weight.shape[-2]
    out = _KeptByGroupedLinear.apply(hidden, weight, offsets, out_features)
    return out if bias is None else out + bias


def _traced_experts(experts, hidden_states, top_k_index, top_k_weights):
    """transformers' grouped_mm experts forward (integrations/moe.py, without expert parallelism's sentinels) with
    the stand-in matmul: each token's hidden state copied to each of its top-k experts, the up (and gate)
    projection, the activation, the down projection and the routing weights over those copies. What autograd keeps
    depends on the number of copies, not on the routing, so the meta device can trace it."""
    top_k = top_k_index.size(-1)
    weights, expert_ids = top_k_weights.reshape(-1), top_k_index.reshape(-1)
    expert_ids_g, perm = torch.sort(expert_ids)
    hidden_g, weights_g = hidden_states[perm // top_k], weights[perm]
    offsets = torch.cumsum(torch.histc(expert_ids_g.float(), bins=experts.num_experts), dim=0).int()
    up_name = "gate_up_proj" if experts.has_gate else "up_proj"
    up_bias = getattr(experts, f"{up_name}_bias", None)
    up = _expert_weight(experts, up_name)
    out = _grouped_linear(experts, hidden_g, up, offsets, up_bias[expert_ids_g] if experts.has_bias else None)
    out = experts._apply_gate(out) if experts.has_gate else experts.act_fn(out)
    down_bias = experts.down_proj_bias[expert_ids_g] if experts.has_bias else None
    out = _grouped_linear(experts, out, _expert_weight(experts, "down_proj"), offsets, down_bias)
    if getattr(experts, "has_post_expert_norm", False):
        out = experts.post_expert_norm(out)
    out = out * weights_g.unsqueeze(-1)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.size(0), device=perm.device)
    return out[inverse].view(hidden_states.shape[0], top_k, -1).sum(dim=1).to(hidden_states.dtype)


def _expert_weight(experts: nn.Module, name: str) -> torch.Tensor:
    """A stacked expert weight as the forward uses it: with LoRA on it, a new tensor (peft's W + B @ A, which the
    matmul keeps for the backward), else the parameter."""
    weight = getattr(experts, name)
    return weight.clone() if name in getattr(experts, "_chattune_merged_stacks", ()) else weight


def _register_trace_attention() -> None:
    """The attention and experts stand-ins, under TRACE_ATTENTION in transformers' interfaces."""
    from transformers import AttentionInterface
    from transformers.integrations.moe import ExpertsInterface

    AttentionInterface.register(TRACE_ATTENTION, _traced_attention)
    ExpertsInterface.register(TRACE_ATTENTION, _traced_experts)


@contextlib.contextmanager
def _saved_bytes_by_layer(model: nn.Module, layers: list[nn.Module]) -> Iterator[tuple[dict, dict]]:
    """Count the bytes of every storage autograd saves in the block, once, parameters excluded, attributed to the
    decoder layer running (key its index; None: outside the layers); and the bytes activation offloading copies to
    the host (`chattune.parallel.offload`: each saved tensor of at least MIN_OFFLOAD_BYTES once, however often it is
    saved, views each on their own)."""
    from chattune.parallel.offload import MIN_OFFLOAD_BYTES

    parameters = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: set[int] = set()
    copied: set[tuple] = set()  # (storage, view, version): what the offloading hooks copy once
    alive: list[torch.UntypedStorage] = []  # (held: a freed storage's id could come back for another)
    counts: dict[int | None, int] = {}
    moved: dict[int | None, int] = {}
    current: list[int | None] = [None]
    handles = []
    for index, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(lambda m, a, i=index: current.__setitem__(0, i)))
        handles.append(layer.register_forward_hook(lambda m, a, o: current.__setitem__(0, None)))

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage._cdata in parameters:
            return tensor
        if storage._cdata not in seen:
            seen.add(storage._cdata)
            alive.append(storage)
            counts[current[0]] = counts.get(current[0], 0) + storage.nbytes()
        size = tensor.numel() * tensor.element_size()
        view = (storage._cdata, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
        if size >= MIN_OFFLOAD_BYTES and (*view, tensor._version) not in copied:
            copied.add((*view, tensor._version))
            moved[current[0]] = moved.get(current[0], 0) + size
        return tensor

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield counts, moved
    finally:
        for handle in handles:
            handle.remove()


@dataclasses.dataclass(frozen=True)
class _Trace:
    """What one traced forward keeps, in bytes: per decoder layer (each storage once) and outside them (the final
    norm's output, which the loss keeps, included); what offloading copies in and outside the layers; a layer's
    input."""

    per_layer: tuple[int, ...]
    outside: int
    moved_layers: int
    moved_outside: int
    layer_input: int
    note: str | None = None  # said beside the row (a compiled trace that fell back to the eager one)


# The last traces, by what decides them (the model config's class and contents, then dtype, tokens, LoRA and
# compile): the memory advice estimates a run under a dozen changes, most of which change none of these, and
# `validate`'s plans of one model each build the config anew.
_TRACES: OrderedDict[tuple, _Trace | str] = OrderedDict()
_TRACES_KEPT = 8


def activation_bytes(inputs: MemoryInputs, notes: list[str]) -> tuple[int | None, int | None]:
    """The activations one microbatch keeps for its backward (see the module docstring), on the device and, with
    `offload_activations`, on the host; None where the forward cannot run on the meta device, with a note why.
    With activation checkpointing each layer keeps its input, and one layer's activations exist again in its
    recompute; offloaded (chattune.parallel.offload), the device holds one layer's activations at a time (recomputed,
    or brought back for its backward) and the copies in flight (a layer's input, or a tensor of at most a layer's),
    the host a copy of each tensor the forward saved, once (views of one storage each their own)."""
    trace = _cached_trace(inputs)
    if isinstance(trace, str):
        notes.append(trace)
        return None, None
    if trace.note:
        notes.append(trace.note)
    largest = max(trace.per_layer, default=0)
    layers = len(trace.per_layer)
    checkpointed = inputs.activation_checkpointing
    saved = layers * trace.layer_input if checkpointed else sum(trace.per_layer)  # what the layers keep
    if not inputs.offload_activations:
        return trace.outside + saved + (largest if checkpointed else 0), None
    in_flight = trace.layer_input if checkpointed else largest
    moved_layers = layers * trace.layer_input if checkpointed else trace.moved_layers
    return largest + in_flight, trace.moved_outside + moved_layers


def _cached_trace(inputs: MemoryInputs) -> _Trace | str:
    config = inputs.hf_config
    key = (
        type(config).__qualname__,
        config.to_json_string(use_diff=False),
        inputs.compute_dtype,
        inputs.tokens,
        inputs.lora_rank,
        inputs.lora_targets,
        inputs.compiled,
    )
    if key not in _TRACES:
        _TRACES[key] = _trace(inputs)
        if len(_TRACES) > _TRACES_KEPT:
            _TRACES.popitem(last=False)
    _TRACES.move_to_end(key)
    return _TRACES[key]


def _trace(inputs: MemoryInputs) -> _Trace | str:
    """The decoder's forward of `inputs.tokens` tokens on the meta device, counted, its layers compiled where the
    run compiles them; or why it cannot run. A compiled trace that dynamo cannot make counts the eager layers (what
    they keep is at least what compiled ones keep), and says so."""
    if not inputs.compiled:
        return _traced(inputs, compiled=False)
    try:
        return _traced(inputs, compiled=True)
    except torch._dynamo.exc.TorchDynamoException as error:
        eager = _traced(inputs, compiled=False)
        if isinstance(eager, str):
            return eager
        reason = " ".join(str(error).split("Set TORCHDYNAMO_VERBOSE")[0].split())[:240]  # (without dynamo's hints)
        note = (
            f"activations counted as eager layers keep them, an upper bound: the compiled layers' trace failed "
            f"({type(error).__name__}: {reason})"
        )
        return dataclasses.replace(eager, note=note)


def _traced(inputs: MemoryInputs, compiled: bool) -> _Trace | str:
    _register_trace_attention()
    model = meta_model(inputs.hf_config, inputs.compute_dtype, attention=TRACE_ATTENTION)
    model.train()
    if inputs.lora_rank:  # the frozen base keeps no inputs for its own weights' gradients
        model.requires_grad_(False)
        _add_meta_adapters(model, inputs.lora_rank, inputs.lora_targets, inputs.compute_dtype)
    layers = repeated_layers(model)
    if compiled:
        _compile_for_the_trace(layers)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    if decoder is model:  # (Llama 4's causal LM names itself its decoder)
        decoder = getattr(model, "model", model)
    tokens = torch.zeros(1, inputs.tokens, dtype=torch.long, device="meta")
    positions = torch.arange(inputs.tokens, device="meta").unsqueeze(0)
    try:
        with _saved_bytes_by_layer(model, layers) as (counts, moved):
            hidden = decoder(input_ids=tokens, position_ids=positions, use_cache=False).last_hidden_state
    except (NotImplementedError, RuntimeError) as error:
        if isinstance(error, RuntimeError) and "meta" not in str(error):
            raise  # a bug, not the meta device's limit
        # (torch.nonzero's or .item()'s: said, never guessed)
        return (
            f"activations not estimated: {type(model).__name__}'s forward does not run on the meta device, which "
            "has shapes but no values (the forward computes a shape from values, as torch.nonzero does)"
        )
    final = hidden.numel() * hidden.element_size()  # the final norm's output, which the loss keeps
    return _Trace(
        per_layer=tuple(counts.get(index, 0) for index in range(len(layers))),
        outside=counts.get(None, 0) + final,
        moved_layers=sum(moved.values()) - moved.get(None, 0),
        moved_outside=moved.get(None, 0) + final,
        layer_input=inputs.tokens * inputs.hf_config.hidden_size * hidden.element_size(),
    )


def _compile_for_the_trace(layers: list[nn.Module]) -> None:
    """Each layer's forward compiled as `chattune.parallel.fsdp.compile_layers` compiles it, with the partition of
    forward and backward inductor uses (AOTAutograd's min-cut: a fused RMSNorm's fp32 upcast or a SiLU's
    intermediate is recomputed in the backward, not kept) and no code generated: the graphs run on the meta device,
    where the saved-tensor hooks count what they keep. A copy of the forward's code object, so that dynamo's cache
    of the real one (which the run's compile fills) never holds these graphs."""
    compiled: dict[type, object] = {}
    for layer in layers:
        cls = type(layer)
        if cls not in compiled:
            forward = getattr(cls.forward, "__wrapped__", cls.forward)
            copy_of_forward = types.FunctionType(
                forward.__code__.replace(),
                forward.__globals__,
                forward.__name__,
                forward.__defaults__,
                forward.__closure__,
            )
            copy_of_forward.__kwdefaults__ = forward.__kwdefaults__
            compiled[cls] = torch.compile(copy_of_forward, backend="aot_eager_decomp_partition")
        layer.forward = functools.partial(compiled[cls], layer)


def _add_meta_adapters(model: nn.Module, rank: int, targets: tuple[str, ...], dtype: torch.dtype) -> None:
    """LoRA's adapters on the meta model's target layers: x -> base(x) + B(A(x)), A and B trained; on its adapted
    expert stacks, the merged weight peft computes in each forward (and the grouped matmul keeps)."""

    class _Adapted(nn.Module):
        def __init__(self, base: nn.Linear):
            super().__init__()
            self.base = base
            self.lora_a = nn.Linear(base.in_features, rank, bias=False, device="meta", dtype=dtype)
            self.lora_b = nn.Linear(rank, base.out_features, bias=False, device="meta", dtype=dtype)

        def forward(self, x):
            return self.base(x) + self.lora_b(self.lora_a(x))

    linears, stacks = lora_targets(model, targets)
    for name, linear in linears.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, _Adapted(linear))
    for experts, stack in stacks:  # peft merges B @ A into the weight each forward
        experts._chattune_merged_stacks = {*getattr(experts, "_chattune_merged_stacks", ()), stack}
