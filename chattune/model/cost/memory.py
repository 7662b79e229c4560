"""How much device memory a run takes per rank, from the model's config alone (no weights loaded): the table
`chattune validate` prints and rank 0 logs before it loads the model, and whether it fits the device.

What each row counts, and how:
- **parameters, gradients, optimizer states**: from the model the run builds, built on the meta device (every
  architecture transformers builds; exact counts, no memory; a vision-language checkpoint's language model alone,
  as the run trains it: `trained_config`), split into trained and frozen (LoRA: the adapters train, the
  base is frozen). FSDP2 shards each parameter along its first dimension over the ranks, padded to a multiple
  of them; the shards stay fp32 whatever the compute dtype. Gradients: the trained shards, fp32. Optimizer
  states: two fp32 tensors per trained element for Adam and AdamW, one for SGD with momentum, none for plain
  SGD, torchao's low-bit AdamW as it quantizes each shard (`LOW_BIT_STATES`); another optimizer is counted as
  two fp32 states (said so in the table). With the optimizer step in the backward (`optimizer.in_backward`), the
  gradients of one FSDP2 unit at a time: the largest (a decoder layer's, or the root's).
- **gathered for compute**: FSDP2 all-gathers one decoder layer at a time in the compute dtype and prefetches
  the next, so two of the largest layer, and the root's parameters (embeddings, final norm, output layer),
  gathered for the whole forward and backward.
- **activations**: what autograd keeps for the backward over one microbatch of `tokens` (each rank's slice
  of a row under context parallelism), found by running the decoder's forward on the meta device (shapes
  only) under a saved-tensors hook: each storage once, parameters excluded (`chattune.model.cost.activation_trace`:
  attention and a mixture of experts' experts through stand-ins that keep what the packed and grouped kernels
  keep, never a score matrix, whatever the routing). With activation checkpointing each
  layer keeps only its input, and one layer's activations exist again during its recompute. The final norm's
  output, which the loss keeps, is added. A model whose forward still cannot run on the meta device (tokens chosen
  by data-dependent shapes outside the experts: LongCat-Flash) gets no activation figure; the table says so
  instead of guessing.
- **the loss head**: one chunk of `loss_chunk` tokens' fp32 logits and their gradient (the chunked loss
  computes the output layer chunk by chunk); in bf16/fp16 also the output layer's fp32 upcast and its
  gradients; with cut-cross-entropy (no logits held) its output-layer gradient buffer (`_loss_head_rows`).
- **a live reference** (DPO, KTO, a GRPO run's KL penalty): its parameters sharded like the policy's, no gradients or
  states; **on-policy distillation's teacher** likewise, from its own config, and with loss.type=gkd (it runs beside
  the policy on every microbatch) its root unit gathered in the compute dtype for the whole run (FSDP2 reshards a root
  only after a backward). GKD's divergence chunk (a quarter of the loss chunk's positions, about six fp32 logit blocks)
  is smaller than the cross-entropy's chunk the loss-head row counts.
- **a rollout** (the GRPO recipe): a second peak, while the policy samples and no gradient or activation exists: the
  parameter shards and optimizer states, the model gathered whole in the compute dtype, the KV cache of the rank's
  sequences at their longest, and one decoding step's scores (`MemoryEstimate.rollout_rows`); the peak is the higher.
- **QLoRA's 4-bit base** (`quantized_base`): every linear weight of the decoder layers replicated on each rank as
  bitsandbytes stores it (`_four_bit_bytes`), its bias in fp32; the rest sharded as with LoRA. Each 4-bit matmul
  dequantizes its weight to the compute dtype first: the largest such weight is added to what is gathered.
- **offloading**: with `cpu_offload` the parameter, gradient and optimizer rows move to `host_rows` (FSDP2 keeps them
  on the host) and the device keeps one unit's shards copied in and its gradients out; with `offload_activations`
  the device keeps one layer's activations and the copies in flight, the host a copy of each saved tensor
  (`chattune.parallel.offload`).

Where the run does not fit, `chattune.model.cost.memory_advice` says which changes would make it fit.

Checked against measured byte counts (tests/unit/model/cost/test_memory.py): the counts exactly against the built model's
shards, the activations within 10% of a saved-tensors hook on the real packed forward on CPU.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from chattune.distributed import ParallelDims
from chattune.model.cost.activation_trace import activation_bytes, lora_targets, meta_model, repeated_layers
from chattune.model.cost.inputs import MemoryInputs

GiB = 2**30
# The rows a rollout keeps (`MemoryEstimate.rollout`): the shards and the optimizer's states; gradients are freed
# after each optimizer step and no activation is saved while the policy samples.
KEPT_THROUGH_ROLLOUTS = ("parameters", "optimizer states", "4-bit base", "live reference", "teacher")


@dataclass
class MemoryEstimate:
    """Bytes per rank, by row, with notes on what was assumed or left out. `rollout_rows`: what a rollout holds besides
    the parameter shards and optimizer states, while no gradient or activation exists (the GRPO recipe)."""

    rows: dict[str, int | None] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    host_rows: dict[str, int | None] = field(default_factory=dict)  # what offloading keeps in host memory instead
    rollout_rows: dict[str, int] = field(default_factory=dict)

    @property
    def training(self) -> int | None:
        """A training step's peak: every row at once (None when a row could not be estimated)."""
        values = list(self.rows.values())
        return None if any(v is None for v in values) else sum(values)

    @property
    def rollout(self) -> int | None:
        """A rollout's peak: the parameter shards and optimizer states, and its own rows (None: no rollout)."""
        if not self.rollout_rows:
            return None
        kept = [value for name, value in self.rows.items() if name.startswith(KEPT_THROUGH_ROLLOUTS)]
        return None if any(v is None for v in kept) else sum(v or 0 for v in kept) + sum(self.rollout_rows.values())

    @property
    def total(self) -> int | None:
        """The peak: a training step's, or a rollout's where that is higher."""
        training = self.training
        if training is None or not self.rollout_rows:
            return training
        rollout = self.rollout
        return None if rollout is None else max(training, rollout)

    def table(self, device_memory: int | None = None, memory_name: str = "device memory") -> str:
        """The rows, the peak and, against `device_memory` bytes (named `memory_name`), whether it fits."""
        lines = [f"  {name:<34} {format_gib(value):>10}" for name, value in self.rows.items()]
        if self.rollout_rows:
            lines.append(f"  {'a training step (the rows at once)':<34} {format_gib(self.training):>10}")
            lines.append("  a rollout: the parameter shards and optimizer states, and")
            lines += [f"    {name:<32} {format_gib(value):>10}" for name, value in self.rollout_rows.items()]
            lines.append(f"  {'a rollout (at once)':<34} {format_gib(self.rollout):>10}")
        total = self.total
        peak = "peak per rank (the higher)" if self.rollout_rows else "peak per rank (the rows at once)"
        lines.append(f"  {peak:<34} {format_gib(total):>10}")
        if device_memory is not None:
            verdict = "unknown" if total is None else ("fits" if total <= device_memory else "does NOT fit")
            lines.append(f"  {memory_name:<34} {format_gib(device_memory):>10}  ({verdict})")
        if self.host_rows:
            lines.append("  in host memory instead (offloaded):")
            lines += [f"    {name:<32} {format_gib(value):>10}" for name, value in self.host_rows.items()]
        return "\n".join(lines + [f"  ({note})" for note in self.notes])


def format_gib(value: int | None) -> str:
    return "not estimated" if value is None else f"{value / GiB:.2f} GiB"


def parse_size(text: str) -> int:
    """Bytes from `24GiB`, `80GB`, `24 GiB` or a plain number of bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B?|B)?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"{text!r} is not a size (e.g. 24GiB, 80GB)")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    powers = {"K": 1, "M": 2, "G": 3, "T": 4}
    if unit == "B":
        return int(number)
    base = 1024 if "I" in unit else 1000
    return int(number * base ** powers[unit[0]])


def _split_over_tensor(model: nn.Module, layers: list[nn.Module]) -> set[int]:
    """The ids of the parameters tensor parallelism splits (`chattune.parallel.tensor_parallel.PLAN`'s linears, and
    the vocabulary's: the input embedding and the output layer, `chattune.parallel.vocab_parallel`)."""
    from chattune.parallel.tensor_parallel import PLAN

    vocabulary = (model.get_input_embeddings(), model.get_output_embeddings())
    split = {id(p) for module in vocabulary if module is not None for p in module.parameters()}
    for layer in layers:
        for name in PLAN:
            try:
                split.update(id(p) for p in layer.get_submodule(name).parameters())
            except AttributeError:
                continue  # a family without the plan: refused at start-up, estimated whole here
    return split


def _stacked_experts(model: nn.Module) -> set[int]:
    """The ids of the stacked expert weights expert parallelism splits (`chattune.parallel.expert_parallel`): each
    experts module's own parameters, stacked by expert."""
    from chattune.parallel.expert_parallel import experts_modules

    return {
        id(parameter)
        for _, _, module in experts_modules(model)
        for parameter in module.parameters(recurse=False)
        if parameter.dim() > 0 and parameter.shape[0] == module.num_experts
    }


def _row_wise(model: nn.Module, linear: nn.Module) -> bool:
    """Whether tensor parallelism splits `linear` row-wise (its input features), not column-wise."""
    from chattune.parallel.tensor_parallel import PLAN, RowwiseParallel

    return any(
        path.endswith(name) and style is RowwiseParallel
        for path, module in model.named_modules()
        if module is linear
        for name, style in PLAN.items()
    )


def _shard_numel(parameter: torch.Tensor, ranks: int) -> int:
    """One rank's elements of FSDP2's shard: the first dimension padded to a multiple of the ranks."""
    if parameter.dim() == 0:
        return 1
    rows = math.ceil(parameter.shape[0] / ranks)
    return rows * (parameter.numel() // max(parameter.shape[0], 1))


def _stack_adapter_shards(experts: nn.Module, name: str, rank: int, ranks: int) -> tuple[int, int]:
    """A and B's shards of peft's LoRA on a stacked expert weight (E, d1, d2): A is (rank x E, in), B (out, rank x E),
    in and out d2 and d1 (d1 and d2 where the experts keep their weights transposed)."""
    experts_count, first, second = getattr(experts, name).shape
    in_features, out_features = (first, second) if getattr(experts, "is_transposed", False) else (second, first)
    inner = rank * experts_count
    return math.ceil(inner / ranks) * in_features, math.ceil(out_features / ranks) * inner


# torchao's low-bit Adam and AdamW (torchao.optim): each moment quantized in blocks where a rank's shard of the
# parameter has at least 4096 elements and a whole number of blocks (else that state stays fp32, as in
# bitsandbytes): the codes, one fp32 scale per block and a code book of fp32 entries. Class: (bits, block, book).
LOW_BIT_STATES = {
    "AdamW8bit": (8, 256, 256),
    "Adam8bit": (8, 256, 256),
    "AdamW4bit": (4, 128, 16),
    "Adam4bit": (4, 128, 16),
    "AdamWFp8": (8, 256, 0),
    "AdamFp8": (8, 256, 0),
}


def _low_bit_state_bytes(elements: int, bits: int, block: int, book: int) -> int:
    if elements >= 4096 and elements % block == 0:
        return elements * bits // 8 + 4 * (elements // block) + 4 * book
    return 4 * elements


def _quantized_linears(layers: list[nn.Module]) -> list[nn.Linear]:
    """The linear layers QLoRA stores in 4 bits: every nn.Linear of the decoder layers (chattune.model.quantization.quantize)."""
    return [module for layer in layers for module in layer.modules() if type(module) is nn.Linear]


def _four_bit_bytes(elements: int) -> int:
    """A bitsandbytes 4-bit weight with double-quantized statistics (chattune.model.quantization.quantize): two codes a byte, an
    8-bit scale per block of 64, an fp32 scale per 256 of those, the 16-entry and 256-entry fp32 code books and an
    fp32 offset."""
    blocks = math.ceil(elements / 64)
    return math.ceil(elements / 2) + blocks + 4 * math.ceil(blocks / 256) + 4 * 16 + 4 * 256 + 4


def _optimizer_state_bytes(inputs: MemoryInputs, shards: list[int], notes: list[str]) -> int:
    """A rank's optimizer states for trained parameters whose shards on this rank have `shards` elements (fp32)."""
    name = inputs.optimizer.rsplit(".", 1)[-1]
    elements, tensors = sum(shards), len(shards)
    if name in LOW_BIT_STATES:  # two moments, and each parameter's step count (a scalar tensor)
        return sum(2 * _low_bit_state_bytes(n, *LOW_BIT_STATES[name]) for n in shards) + 4 * tensors
    if name in ("Adam", "AdamW"):
        return 4 * (2 * elements + tensors)  # both moments, and each parameter's step count (a scalar tensor)
    if name == "SGD":
        return 4 * elements if inputs.momentum else 0
    notes.append(f"{inputs.optimizer}: counted as AdamW (two fp32 states per trained element)")
    return 4 * (2 * elements + tensors)


def trained_config(hf_config, notes: list[str]):
    """The config of the model a run trains from `hf_config`, as the builder builds it (`chattune.model.build`): a
    causal LM's own, or a vision-language checkpoint's text config (`chattune.model.io.composite`: its vision tower and
    projector are never loaded on a training rank, so they take no memory; said in `notes`). None, the reason in
    `notes`, for a config the run refuses."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from chattune.errors import UnsupportedModel
    from chattune.model.io.composite import is_composite, text_config_of

    name = type(hf_config).__name__
    if not is_composite(hf_config):
        if type(hf_config) in AutoModelForCausalLM._model_mapping:
            return hf_config
        notes.append(
            f"not estimated: {name} ({hf_config.model_type}) is neither a causal LM of transformers nor a "
            "vision-language model whose language model chattune trains"
        )
        return None
    try:
        text_config = text_config_of(hf_config)
    except UnsupportedModel as refusal:  # the launch's own refusal, with its reason
        notes.append(f"not estimated: {refusal}")
        return None
    with torch.device("meta"):
        composite = AutoModelForImageTextToText.from_config(copy.deepcopy(hf_config))
    language = {
        id(p) for module in (composite.get_decoder(), composite.get_output_embeddings()) for p in module.parameters()
    }
    others = sum(p.numel() for p in composite.parameters() if id(p) not in language)
    trained_class = AutoModelForCausalLM._model_mapping[type(text_config)].__name__
    notes.append(
        f"{type(composite).__name__}: its language model, as the run trains it ({trained_class}); its other parts "
        f"(vision tower, projector: {others / 1e6:.2f}M parameters) are not loaded on a training rank and not counted"
    )
    return text_config


def estimate(inputs: MemoryInputs) -> MemoryEstimate:
    """The per-rank memory of a run of `inputs`, by row."""
    result = MemoryEstimate()
    hf_config = trained_config(inputs.hf_config, result.notes)
    if hf_config is None:
        result.rows["model"] = None
        return result
    if inputs.on_cpu and (inputs.cpu_offload or inputs.offload_activations):
        result.notes.append("on the CPU the host is the device: offloading saves nothing, counted as without it")
    inputs = replace(
        inputs,
        hf_config=hf_config,
        cpu_offload=inputs.cpu_offload and not inputs.on_cpu,
        offload_activations=inputs.offload_activations and not inputs.on_cpu,
    )
    model = meta_model(hf_config)
    parameters = dict(model.named_parameters())  # (tied weights once)
    layers = repeated_layers(model)
    quantized = _quantized_linears(layers) if inputs.quantized_base else []
    replicated = {id(p) for linear in quantized for p in linear.parameters()}  # not FSDP2's: whole on every rank
    split = _split_over_tensor(model, layers) if inputs.tensor > 1 else set()
    split_experts = _stacked_experts(model) if inputs.expert > 1 else set()

    def shard(parameter: torch.Tensor) -> int:  # one rank's elements: split over tp or ep first, then FSDP2's shard
        if id(parameter) in split_experts:  # 1/ep of the experts, sharded over the ranks holding the same ones
            local = torch.empty((parameter.shape[0] // inputs.expert, *parameter.shape[1:]), device="meta")
            return _shard_numel(local, inputs.ranks // inputs.expert)
        whole = _shard_numel(parameter, inputs.ranks)
        return math.ceil(whole / inputs.tensor) if id(parameter) in split else whole

    def gathered(parameter: torch.Tensor) -> int:  # one rank's elements gathered for compute
        return parameter.numel() // (
            inputs.tensor if id(parameter) in split else inputs.expert if id(parameter) in split_experts else 1
        )

    if split:
        result.notes.append(
            f"parallel.tensor={inputs.tensor}: the decoder layers' linear weights and the vocabulary split "
            f"{inputs.tensor} ways; "
            "activations counted as without the split (an overestimate: the split heads and MLP width, and the "
            "stream split by tokens between the blocks, divide most of them)"
        )
    sharded = sum(shard(p) for p in parameters.values() if id(p) not in replicated)
    unit_of = {id(m): index for index, layer in enumerate(layers) for m in [*layer.modules(), *layer.parameters()]}
    trained_by_unit: dict[int | None, list[int]] = {}  # FSDP2 unit (a decoder layer; None: the root): shards
    if inputs.lora_rank:  # adapters A (rank x in) and B (out x rank) on each target, sharded like the rest
        linears, stacks = lora_targets(model, inputs.lora_targets)
        for layer in linears.values():
            # split with its base layer over tp (`chattune.parallel.tensor_parallel`): a column-wise layer's B, a
            # row-wise layer's A
            split_by = inputs.tensor if id(layer.weight) in split else 1
            rows = split_by if split_by > 1 and _row_wise(model, layer) else 1  # a row-wise layer's A
            columns = split_by // rows  # a column-wise layer's B
            trained_by_unit.setdefault(unit_of.get(id(layer)), []).extend(
                (
                    math.ceil(inputs.lora_rank / inputs.ranks) * math.ceil(layer.in_features / rows),
                    math.ceil(math.ceil(layer.out_features / columns) / inputs.ranks) * inputs.lora_rank,
                )
            )
        for experts, name in stacks:
            trained_by_unit.setdefault(unit_of.get(id(experts)), []).extend(
                _stack_adapter_shards(experts, name, inputs.lora_rank, inputs.ranks)
            )
    else:
        for parameter in parameters.values():
            trained_by_unit.setdefault(unit_of.get(id(parameter)), []).append(shard(parameter))
    trained_shards = [shard for shards in trained_by_unit.values() for shard in shards]
    trained = sum(trained_shards)
    # CPU offload: the shards, their gradients and the optimizer's states live on the host (rows moved there).
    kept = result.host_rows if inputs.cpu_offload else result.rows
    kept["parameters (fp32 shards)"] = 4 * (sharded + (trained if inputs.lora_rank else 0))
    if inputs.update_in_backward:  # one unit's reduced gradient at a time, freed as its parameters step
        kept["gradients (one unit's shards)"] = 4 * max(map(sum, trained_by_unit.values()), default=0)
    else:
        kept["gradients (fp32 shards)"] = 4 * trained
    kept["optimizer states"] = _optimizer_state_bytes(inputs, trained_shards, result.notes)
    if quantized:  # in device memory whatever the offload: FSDP2 does not manage them
        result.rows["4-bit base (replicated)"] = sum(
            _four_bit_bytes(linear.weight.numel()) + (4 * linear.bias.numel() if linear.bias is not None else 0)
            for linear in quantized
        )
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    if inputs.cpu_offload:  # a unit's shards copied in for its all-gather, and its gradients' shards out
        unit_shards = [sum(shard(p) for p in layer.parameters()) for layer in layers]
        root_shards = sum(shard(p) for p in parameters.values() if id(p) not in in_layers)
        result.rows["offload copies (one unit's shards)"] = 2 * 4 * max([*unit_shards, root_shards])
    compute_bytes = torch.empty((), dtype=inputs.compute_dtype).element_size()
    largest_layer = max(
        (sum(gathered(p) for p in layer.parameters() if id(p) not in replicated) for layer in layers), default=0
    )
    root = sum(gathered(p) for p in parameters.values() if id(p) not in in_layers)
    # A 4-bit layer's matmul dequantizes its whole weight to the compute dtype first (bitsandbytes): one at a time.
    dequantized = max((linear.weight.numel() for linear in quantized), default=0)
    result.rows["gathered for compute"] = compute_bytes * (2 * largest_layer + root + dequantized)
    if split_experts:
        _expert_dispatch_rows(inputs, hf_config, result, compute_bytes)
    if inputs.live_reference:
        result.rows["live reference (fp32 shards)"] = 4 * sharded
    if inputs.teacher_config is not None:
        result.rows.update(_teacher_rows(inputs, compute_bytes))
    device_activations, host_activations = activation_bytes(inputs, result.notes)
    result.rows["activations"] = device_activations
    if inputs.offload_activations:
        result.host_rows["activations (offloaded)"] = host_activations
    _loss_head_rows(inputs, model, result, compute_bytes)
    if inputs.rollout_sequences:
        result.rollout_rows.update(_rollout_rows(inputs, hf_config, parameters.values(), split, compute_bytes))
        result.notes.append(
            f"a rollout's KV cache counted for {inputs.rollout_sequences} sequences of {inputs.rollout_tokens} tokens "
            "(data.max_tokens_per_microbatch, the longest a prompt and its completion may be): a bound"
        )
    return result


def _expert_dispatch_rows(inputs: MemoryInputs, hf_config, result: MemoryEstimate, compute_bytes: int) -> None:
    """Expert parallelism's exchange (`chattune.parallel.expert_parallel`): each MoE layer's (token, choice) pairs sent
    to the experts' ranks and back, one layer at a time: the send and receive buffers of both exchanges, with routing
    spread evenly (a rank whose experts draw more receives more)."""
    top_k = int(getattr(hf_config, "num_experts_per_tok", 1) or 1)
    result.rows["expert dispatch buffers"] = compute_bytes * 4 * inputs.tokens * top_k * hf_config.hidden_size
    result.notes.append(
        f"parallel.expert={inputs.expert}: each rank holds 1/{inputs.expert} of every MoE layer's experts, sharded "
        f"over {inputs.ranks // inputs.expert} ranks; the dispatch buffers assume routing spread evenly (a rank "
        f"whose experts draw more tokens receives more: up to {inputs.expert} times as much if all go to its experts)"
    )


def _teacher_rows(inputs: MemoryInputs, compute_bytes: int) -> dict[str, int]:
    """On-policy distillation's teacher (`chattune.train.reference.teacher_model`): its fp32 shards, sharded like the
    policy (FSDP2 over `inputs.ranks`; tensor parallelism splits a teacher's layers as the policy's, which the shards'
    count here does not divide: an overestimate under tp), and with gkd its root unit gathered."""
    config = trained_config(inputs.teacher_config, [])  # (a vision-language teacher: its language model)
    if config is None:
        return {}
    teacher = meta_model(config)
    parameters = dict(teacher.named_parameters())
    rows = {"teacher (fp32 shards)": 4 * sum(_shard_numel(p, inputs.ranks) for p in parameters.values())}
    if inputs.teacher_in_training:
        in_layers = {id(p) for layer in repeated_layers(teacher) for p in layer.parameters()}
        root = sum(p.numel() for p in parameters.values() if id(p) not in in_layers)
        rows["teacher's root, kept gathered (gkd)"] = compute_bytes * root
    return rows


def _rollout_rows(inputs: MemoryInputs, hf_config, parameters, split: set[int], compute_bytes: int) -> dict[str, int]:
    """What sampling holds (`chattune.rl.rollouts`): the model gathered whole in the compute dtype (once for the rollout,
    where every rank has room), the KV cache of the rank's sequences at their longest (keys and values of every
    attention layer), and one decoding step's scores (its logits, their log-softmax and the entropy's, fp32)."""
    from chattune.model.cost.flops import text_config

    text = text_config(hf_config)
    layers = int(getattr(text, "num_hidden_layers", 0) or 0)
    heads = int(getattr(text, "num_attention_heads", 1) or 1)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    whole = sum(p.numel() // (inputs.tensor if id(p) in split else 1) for p in parameters)
    kv_per_token = 2 * layers * math.ceil(kv_heads / inputs.tensor) * head_dim * compute_bytes
    return {
        "the model gathered whole": compute_bytes * whole,
        "KV cache": inputs.rollout_sequences * inputs.rollout_tokens * kv_per_token,
        "a decoding step's scores": 3 * 4 * inputs.rollout_sequences * int(text.vocab_size),
    }


def _loss_head_rows(inputs: MemoryInputs, model: nn.Module, result: MemoryEstimate, compute_bytes: int) -> None:
    """What the loss head holds besides the gathered output layer (a vocabulary split over tp: each rank's rows),
    as tests/unit/model/cost/test_memory.py measures it op by op. Chunked: one chunk's fp32 logits and their gradient, and the
    output layer's gradients: with bf16/fp16 compute the layer upcast to fp32, its fp32 gradient and that gradient
    in the compute dtype (10 bytes an element in bf16); in fp32 (no upcast) a chunk's fresh gradient and the sum
    autograd makes of it beside the gradients row's (8 bytes an element, once the chunk's logits are freed: the
    larger of the two moments). Cut-cross-entropy never holds logits; its backward writes the output layer's
    gradient into one buffer of the inputs' dtype (fp32 where the release accumulates in fp32)."""
    vocab = getattr(inputs.hf_config, "vocab_size", 0)
    head = model.get_output_embeddings()
    hidden = head.weight.shape[1] if head is not None else getattr(inputs.hf_config, "hidden_size", 0)
    head_elements = math.ceil(vocab / inputs.tensor) * hidden
    if inputs.loss_implementation == "cut_cross_entropy":
        gradient_bytes = 4 if inputs.cce_fp32_gradients else compute_bytes
        result.rows["loss head (CCE gradient)"] = gradient_bytes * head_elements
        return
    chunk = 2 * 4 * min(inputs.loss_chunk, inputs.tokens) * math.ceil(vocab / inputs.tensor)
    result.rows["loss head (one chunk)"] = chunk
    if compute_bytes < 4:
        result.rows["loss head (output-layer gradients)"] = (4 + 4 + compute_bytes) * head_elements
    else:
        result.rows["loss head (output-layer gradients)"] = max(0, 8 * head_elements - chunk)


def hf_config_of(cfg, tokenizer_size: int | None = None):
    """The HF config a run of `cfg` builds or loads (no weights): `model.path`'s config.json, else `model.config`
    instantiated with the vocabulary the builder gives it: the `vocab_size` written there, else the tokenizer's
    (`tokenizer_size`; `chattune.model.causal_lm.written_vocab_size`)."""
    if cfg.model.path is not None:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(cfg.model.path)
    from hydra.utils import instantiate

    from chattune.model.causal_lm import written_vocab_size

    config = instantiate(cfg.model.config, _convert_="all")
    if tokenizer_size is not None:
        vocab_size = written_vocab_size(cfg.model.config, tokenizer_size)
        config.vocab_size = vocab_size
        config.get_text_config().vocab_size = vocab_size
    return config


def inputs_of(cfg, hf_config, layout: ParallelDims, on_cuda: bool) -> MemoryInputs:
    """The memory inputs of a run of `cfg` (a composed recipe config) laid out as `layout` (its meshes not
    needed: `ParallelDims.from_config`), on CUDA or on the CPU, in the compute dtype it takes there."""
    from chattune.parallel.fsdp import compile_enabled, compute_dtype

    fsdp, peft = cfg.model.fsdp, _get(cfg, "peft")
    dtype_name = compute_dtype(fsdp.param_dtype, "cuda" if on_cuda else "cpu")
    reference = _get(cfg, "reference")
    # A live reference is a second sharded model, except with LoRA and no reference.path: the policy's own base,
    # adapters off (chattune.train.reference).
    live_reference = (
        reference is not None
        and not _get(reference, "cache")
        and _needs_reference(cfg)
        and (peft is None or reference.path is not None)
    )
    targets = peft.target_modules if peft is not None else ()
    return MemoryInputs(
        hf_config=hf_config,
        ranks=layout.shard_ranks,
        tokens=int(cfg.data.max_tokens_per_microbatch),
        compute_dtype=getattr(torch, dtype_name),
        activation_checkpointing=bool(fsdp.activation_checkpointing),
        compiled=compile_enabled(_get(cfg.model, "compile") or False, "cuda" if on_cuda else "cpu"),
        loss_chunk=int(cfg.loss.chunk_size),
        optimizer=str(_get(cfg.optimizer, "_target_")),
        momentum=float(_get(cfg.optimizer, "momentum") or 0.0),
        lora_rank=int(peft.rank) if peft is not None else None,
        lora_targets=(targets,) if isinstance(targets, str) else tuple(targets),
        quantized_base=peft is not None and _get(peft, "quantize_base") is not None,
        live_reference=live_reference,
        update_in_backward=bool(_get(cfg.optimizer, "in_backward")),
        offload_activations=bool(_get(fsdp, "offload_activations")),
        cpu_offload=bool(_get(fsdp, "cpu_offload")),
        microbatches_per_rank=_microbatches_per_rank(cfg, layout.data_ranks),
        tensor=layout.tp,
        expert=layout.ep,
        on_cpu=not on_cuda,
        **_loss_head_of(str(_get(cfg.loss, "implementation") or "auto"), on_cuda, dtype_name),
        **_rollout_of(cfg, layout.data_ranks),
        **_teacher_of(cfg),
    )


def _teacher_of(cfg) -> dict:
    """On-policy distillation's teacher: its config (teacher.path's config.json) where the loss distills from one."""
    from chattune.config.policy_losses import compares_vocabularies, needs_teacher

    loss_type, teacher = _get(cfg.loss, "type"), _get(cfg, "teacher")
    path = _get(teacher, "path") if teacher is not None else None
    if not needs_teacher(loss_type) or path is None or not (Path(str(path)) / "config.json").is_file():
        return {}  # (validate names a teacher.path that is no model directory)
    from transformers import AutoConfig

    return {"teacher_config": AutoConfig.from_pretrained(path), "teacher_in_training": compares_vocabularies(loss_type)}


def _rollout_of(cfg, data_ranks: int) -> dict:
    """A GRPO run's rollout: the sequences a rank samples at once (its prompts x their completions) and their longest
    (the row budget bounds a prompt and its completion)."""
    rollout = _get(cfg, "rollout")
    if rollout is None:
        return {}
    prompts = max(1, int(_get(rollout, "prompts_per_step") or 1) // max(data_ranks, 1))
    return {
        "rollout_sequences": prompts * int(_get(rollout, "completions_per_prompt") or 1),
        "rollout_tokens": int(cfg.data.max_tokens_per_microbatch),
    }


def _loss_head_of(setting: str, on_cuda: bool, dtype_name: str) -> dict:
    """The loss head a run takes (the run's own resolution, quietly: the run gives its warnings) and whether the
    output layer's gradient accumulates in fp32 there (CCE's CUDA kernels where the release has the option; its
    torch implementation off CUDA computes in the inputs' dtype)."""
    from chattune.model.head import fused_loss

    device_type = "cuda" if on_cuda else "cpu"
    if fused_loss.resolve_loss_implementation(setting, device_type, dtype_name, quiet=True) == "chunked":
        return {"loss_implementation": "chunked"}
    fp32 = dtype_name == "float32" or "accum_c_fp32" in fused_loss.cce_options(on_cuda=on_cuda)
    return {"loss_implementation": "cut_cross_entropy", "cce_fp32_gradients": fp32}


def memory_levers(cfg) -> str:
    """The memory and speed levers of issue 53 a run of `cfg` uses, for its `compute:` line ('' where none; a
    library caller's config may lack the sections)."""
    optimizer, model = _get(cfg, "optimizer") or {}, _get(cfg, "model") or {}
    fsdp, fp8 = _get(model, "fsdp") or {}, _get(model, "fp8")
    name = str(_get(optimizer, "_target_")).rsplit(".", 1)[-1]
    levers = [
        "activation checkpointing" if _get(fsdp, "activation_checkpointing") else "",
        "activation offloading" if _get(fsdp, "offload_activations") else "",
        "CPU offload" if _get(fsdp, "cpu_offload") else "",
        f"low-bit optimizer states ({name})" if name in LOW_BIT_STATES else "",
        "optimizer step in the backward" if _get(optimizer, "in_backward") else "",
        f"float8 linear layers ({fp8})" if fp8 else "",
    ]
    return ", ".join(lever for lever in levers if lever)


def _microbatches_per_rank(cfg, data_ranks: int) -> int:
    total = _get(cfg.data, "microbatches_per_step")
    return max(1, int(total) // data_ranks) if total else int(_get(cfg, "grad_accum_steps") or 1)


def _needs_reference(cfg) -> bool:
    """DPO and KTO compare with a reference; DPO's reference-free losses (simpo, orpo) do not; a policy-gradient
    loss where its KL penalty is on (loss.beta > 0)."""
    from chattune.config.losses import needs_reference
    from chattune.config.policy_losses import POLICY_LOSSES

    if _get(cfg.loss, "type") in POLICY_LOSSES:
        return bool(_get(cfg.loss, "beta"))
    return needs_reference(_get(cfg.loss, "type"))


def _get(section, name: str):
    """A key of a config section, composed (DictConfig, dict) or typed (a schema instance); None if absent."""
    if isinstance(section, dict) or hasattr(section, "get") and not hasattr(section, "__dataclass_fields__"):
        return section.get(name)
    return getattr(section, name, None)
