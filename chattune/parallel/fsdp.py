"""Parallelising an HF decoder model, in torchtitan's order: activation checkpointing, then
`torch.compile` of each decoder layer, then FSDP2 (one `fully_shard` unit per decoder layer plus the root).

Compiling per layer (not the whole model) keeps graphs small and shared: every layer runs the same code,
so one compiled graph serves them all. FSDP2's hooks stay outside the graphs (dynamo skips them). The
first change of the packed length N recompiles once with dynamic shapes; `compiled_graphs` counts the
graphs so far, and a count that keeps growing means recompiles."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.utils.checkpoint import checkpoint

from chattune.config.layout_rules import experts_split_problem
from chattune.config.schema import DTYPES, FSDPConfig
from chattune.distributed import ParallelDims, spare_device_memory
from chattune.errors import UnsupportedModel, UserError
from chattune.hf_layout import decoder_layers
from chattune.parallel import tensor_parallel
from chattune.parallel.expert_parallel import experts_modules, split_experts
from chattune.parallel.offload import ActivationOffload
from chattune.parallel.vocab_parallel import parallelize_vocabulary

TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}


@dataclass(frozen=True)
class Placement:
    """Where and how a sharded model computes: what `shard_model` applied, handed explicitly to what reads it (the
    update step, the evaluation, the reference pass, generation, the loop's figures) and never kept on the model.

    `dims`: the run's layout (its device, its data, context and tensor groups). `compiled`: the decoder layers run
    compiled. `compute_dtype`: what FSDP2 gathers the parameters in (fp32 masters either way). `cpu_offload`: the
    shards, their gradients and the optimizer step live on the host. `activation_offload`: a training forward's
    saved tensors go to host memory under its hooks (None: they stay)."""

    dims: ParallelDims
    compiled: bool = False
    compute_dtype: str = "float32"
    cpu_offload: bool = False
    activation_offload: ActivationOffload | None = None

    @property
    def device(self) -> torch.device:
        """Where the model computes (under `cpu_offload` its shards live on the host)."""
        return self.dims.device

    @classmethod
    def one_rank(cls, device: torch.device | str = "cpu") -> Placement:
        """An unsharded model on one process (a plain HF model, a test's): fp32, nothing compiled or offloaded."""
        return cls(ParallelDims.one_rank(torch.device(device)))

    def training_forward(self) -> contextlib.AbstractContextManager:
        """The context a training forward runs under: the activation offload's hooks, or nothing."""
        offload = self.activation_offload
        return offload.hooks() if offload is not None else contextlib.nullcontext()


def compute_dtype(param_dtype: str, device_type: str) -> str:
    """model.fsdp.param_dtype resolved: `auto` is bf16 where it is fast (CUDA) and fp32 on CPU."""
    if param_dtype == "auto":
        return "bfloat16" if device_type == "cuda" else "float32"
    return param_dtype


def compile_enabled(setting: bool | str, device_type: str) -> bool:
    """model.compile resolved: `auto` compiles on CUDA (where it pays) and not on the CPU."""
    return device_type == "cuda" if setting == "auto" else setting is True


def compiled_graphs() -> int:
    """Graphs torch.compile has produced in this process so far (the first, plus each recompile)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_layers(layers: list[nn.Module], activation_checkpointing: bool) -> None:
    """Replace each layer's forward with one compiled function per layer class, checkpointed around it
    when asked. The layer's own (undecorated) forward is compiled: transformers wraps `forward` for its
    gradient checkpointing, and FSDP2's subclass of the layer wraps it again, so compiling through those
    wrappers recompiles on every layer (they share one code object). The forward is set on the instance,
    so parameter names (checkpoints, export) and FSDP2's module hooks (outside the graph) are unchanged."""
    # Every layer shares one forward code object, whose cache also holds the graphs of eval (no grad), a
    # DPO reference (frozen), one-token empty microbatches and the dynamic-shape recompile: more than
    # dynamo's default limit of 8, past which it would silently run the layers uncompiled.
    if hasattr(torch._dynamo.config, "recompile_limit"):  # cache_size_limit before torch 2.7
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    compiled: dict[type, object] = {}
    for layer in layers:
        cls = type(layer)
        if cls not in compiled:
            forward = getattr(cls.forward, "__wrapped__", cls.forward)  # under transformers' checkpointing wrapper
            compiled[cls] = torch.compile(forward)
        layer.forward = functools.partial(_checkpointed if activation_checkpointing else _called, compiled[cls], layer)


@contextlib.contextmanager
def eager_layers(model: nn.Module) -> Iterator[None]:
    """The decoder layers' own (uncompiled) forwards while the block runs: generation's shapes (a prompt, then
    one token against a growing cache) would otherwise compile graphs of their own, for a few short prompts,
    and count as recompiles in `compiled_graphs`. A no-op for layers that are not compiled."""
    replaced = {layer: layer.__dict__.pop("forward") for layer in decoder_layers(model) if "forward" in layer.__dict__}
    try:
        yield
    finally:
        for layer, forward in replaced.items():
            layer.forward = forward


def _called(forward, layer, *args, **kwargs):
    return forward(layer, *args, **kwargs)


def _checkpointed(forward, layer, *args, **kwargs):
    return checkpoint(forward, layer, *args, use_reentrant=False, **kwargs)


def reshard(model: nn.Module) -> None:
    """Free the gathered parameters of every FSDP2 unit of `model` and register its fp32 shards again.

    Call after a forward-only pass (evaluation, a DPO reference, the reference cache pass) and before
    reading parameters by name (the export). FSDP2 never reshards the root unit after a forward, only
    after a backward (in training its parameters are needed again at once): after a forward with no
    backward the root's embeddings, final norm and output layer stay gathered, in `param_dtype`, and
    `named_parameters()` returns those bf16 copies instead of the fp32 masters. A no-op on units that are
    already sharded."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def gathered_size(model: nn.Module, compute_dtype: str = "float32") -> int:
    """Bytes of `model`'s parameters gathered whole in the dtype they compute in (FSDP2's param_dtype)."""
    element = torch.empty((), dtype=TORCH_DTYPES[compute_dtype]).element_size()
    return sum(
        p.numel() * element if p.is_floating_point() else p.numel() * p.element_size() for p in model.parameters()
    )


def can_stay_gathered(model: nn.Module, placement: Placement) -> bool:
    """Collective: whether every rank has room for the whole model gathered (`stay_gathered`) with half its free
    device memory to spare. The CPU always has: the models trained there are small. Every rank gets the same
    answer (an all-reduce), since a rank that gathered alone would skip its peers' all-gathers. Free memory counts
    the allocator's cached blocks: a large model's training leaves most of the device cached, not free."""
    device = placement.device
    if device.type != "cuda":
        return True
    room = float(spare_device_memory(device)) - 2.0 * gathered_size(model, placement.compute_dtype)
    if torch.distributed.is_initialized():
        least = torch.tensor([room], device=device)
        torch.distributed.all_reduce(least, op=torch.distributed.ReduceOp.MIN)
        room = least.item()
    return room > 0


@contextlib.contextmanager
def stay_gathered(model: nn.Module) -> Iterator[None]:
    """Collective: every FSDP2 unit of `model` gathered on entry and kept gathered until the block ends (then
    all are resharded). Generation runs one forward per new token; resharding after each would gather
    every layer again for every token: the sample replies of the tiny CPU run spent most of their time in those
    gathers. The price is the whole model gathered on every rank for the block (`can_stay_gathered`), and
    forwards in the block that run no collective, so ranks need not step together. Restores `shard_model`'s
    setting on the way out: decoder layers reshard after forward, the root does not."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:  # every rank gathers here, in the same order: none inside the block
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            if unit is not model:
                unit.set_reshard_after_forward(True, recurse=False)
        reshard(model)


def shard_model(
    model: nn.Module,
    dims: ParallelDims,
    compile: bool = False,
    replicated: set[nn.Parameter] | None = None,
    **fsdp: Any,
) -> Placement:
    """`model`: the packed model (`chattune.model.causal_lm.PackedCausalLM`, or a reward model's
    `PackedSequenceScorer`) around its HF model. `dims`: the run's layout (`chattune.distributed.ParallelDims`,
    built on its process group): the decoder
    layers split over its tp group (`chattune.parallel.tensor_parallel`) with the vocabulary
    (`chattune.parallel.vocab_parallel`), then each parameter sharded over its
    `fsdp_mesh`, in place.
    `replicated`: parameters FSDP2 leaves whole on every rank (a 4-bit base, chattune.model.quantization.quantize). `fsdp`: the
    keys of `model.fsdp` (`FSDPConfig`; those not given keep its defaults): the compute and reduction dtypes,
    activation checkpointing, offloaded activations (a training forward's saved tensors in host memory,
    `chattune.parallel.offload`) and CPU offload (the shards, their gradients and the optimizer step on the host,
    FSDP2's CPUOffloadPolicy). Returns what was applied (`Placement`): the caller hands it to what reads it, the
    model keeps none of it."""
    settings = FSDPConfig(**fsdp)
    activation_checkpointing, cpu_offload = settings.activation_checkpointing, settings.cpu_offload
    tp_mesh = dims.mesh("tp")
    if tp_mesh is not None:  # the layers split over tp first: FSDP2 then shards what each rank holds
        model.stream = tensor_parallel.parallelize(model.hf_model, decoder_layers(model), tp_mesh)
        parallelize_vocabulary(model.hf_model, tp_mesh, model.stream)  # loss-parallel: the vocabulary's rows
    if dims.splits_experts:  # each MoE layer's experts split over the expert group (before compiling: a graph break)
        _split_experts(model.hf_model, dims)
    if compile:
        compile_layers(decoder_layers(model), activation_checkpointing)
    elif activation_checkpointing:
        hf_model = model.hf_model
        if hasattr(hf_model, "activation_checkpointing_enable"):  # transformers' name since 5.2x (the old one warns)
            hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    device = dims.device
    device_type = device.type
    param_dtype = compute_dtype(settings.param_dtype, device_type)
    mesh = dims.fsdp_mesh
    placement = Placement(
        dims, compile, param_dtype, cpu_offload, ActivationOffload(device) if settings.offload_activations else None
    )
    # Parameters stay fp32 in their shards (the optimizer's master copy); FSDP casts them to
    # param_dtype when it gathers them for compute, and reduces gradients in reduce_dtype.
    policy = MixedPrecisionPolicy(
        param_dtype=TORCH_DTYPES[param_dtype], reduce_dtype=TORCH_DTYPES[settings.reduce_dtype]
    )
    # Page-locked host shards copy to and from the GPU without a staging copy, overlapped with compute.
    offload = CPUOffloadPolicy(pin_memory=device_type == "cuda") if cpu_offload else OffloadPolicy()
    for layer in decoder_layers(model):
        # The experts' own units, over the ranks holding the same experts (their DTensors' ep mesh composed with
        # it): a layer's all-gather then moves 1/ep of its experts, not all of them
        if dims.splits_experts:
            for _, _, experts in experts_modules(layer):
                fully_shard(experts, mesh=dims.expert_fsdp_mesh, mp_policy=policy, offload_policy=offload)
        fully_shard(layer, mesh=mesh, mp_policy=policy, offload_policy=offload, ignored_params=replicated)
    fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=offload, ignored_params=replicated)
    # generate() runs the HF model directly: FSDP2 must gather the root's parameters around it as around forward.
    if hasattr(model, "generate"):  # a causal LM's (a reward model's score head generates nothing)
        register_fsdp_forward_method(model, "generate")
    if hasattr(model, "distillation_target"):  # a causal LM as a teacher: its hidden states and output layer
        register_fsdp_forward_method(model, "distillation_target")
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Each rank's loss is already divided by the GLOBAL token count, so the cross-rank
            # gradient reduction must be a plain sum, not FSDP's default average.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return placement


def _split_experts(hf_model: nn.Module, dims: ParallelDims) -> None:
    """parallel.expert: every MoE layer's stacked experts split over the expert group
    (`chattune.parallel.expert_parallel`); refused with the reason where the model has none, or its experts
    cannot be split."""
    name = type(hf_model).__name__
    found = experts_modules(hf_model)
    if not found:
        raise UnsupportedModel(
            f"parallel.expert={dims.ep}: {name} has no mixture-of-experts layers with stacked experts "
            "(transformers' experts interface) to split; set parallel.expert=1"
        )
    for _, _, experts in found:
        problem = experts_split_problem(dims.ep, experts.num_experts)
        if problem:
            raise UserError(f"parallel.expert={dims.ep}: {problem}")
    mesh = dims.mesh("ep")
    try:
        split_experts(hf_model, mesh)
    except ValueError as error:  # (stacked_tensors' reasons)
        raise UnsupportedModel(f"parallel.expert={dims.ep}: {name}: {error}; set parallel.expert=1") from None


def model_device(model: nn.Module) -> torch.device:
    """Where an unsharded `model` (a plain HF model, or a peft model over one) computes: its parameters' device. A
    sharded model's is its `Placement`'s."""
    return next(model.parameters()).device
