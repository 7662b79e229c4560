"""What would make a run fit its device, from the memory estimate (`chattune.model.cost.memory`): the changes chattune
offers that fit alone, cheapest first, each with the peak it gives, or changes that fit together (none of which can
be left out), each an override (or `--ranks N`) to pass as written; and the table with that advice (`report`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from chattune.config.layout_rules import EXPERT_COUNT_KEYS
from chattune.model.cost.memory import MemoryEstimate, MemoryInputs, estimate, format_gib


@dataclass(frozen=True)
class Change:
    """A change to a run that lowers its memory: what to set, what it costs, and the run it gives."""

    setting: str  # an override (key=value), or a launch flag
    cost: str
    inputs: MemoryInputs
    excludes: str = ""  # the key of a change this one does not combine with


def candidate_changes(inputs: MemoryInputs) -> list[Change]:
    """The changes chattune offers that `inputs` does not use yet, in the order a user would try them: a mixture of
    experts' experts split over the ranks (communication only, `_expert_degree`), 8-bit optimizer states (a small
    cost in precision, none in speed), recomputed activations (compute), offloaded activations (copies, overlapped
    on CUDA), the update in the backward (no clipping), 4-bit states (more precision), CPU offload (a slower step),
    shorter rows, training adapters only (over a 4-bit base), more GPUs. On the CPU (`MemoryInputs.on_cpu`) neither offloading, a 4-bit base nor more ranks on the host is offered."""
    changes = []
    expert = _expert_degree(inputs)
    if expert > 1:
        changes.append(
            Change(
                f"parallel.expert={expert}",
                "each MoE layer's tokens sent to the ranks holding their experts and back (all-to-all), "
                "instead of every rank gathering every expert",
                replace(inputs, expert=expert),
            )
        )
    adam = inputs.optimizer.rsplit(".", 1)[-1] in ("Adam", "AdamW") and inputs.optimizer.startswith("torch.")
    if adam:
        changes.append(
            Change(
                "optimizer._target_=torchao.optim.AdamW8bit",
                "8-bit moments (pip install torchao): the loss within a few % of fp32 AdamW's",
                replace(inputs, optimizer="torchao.optim.AdamW8bit"),
            )
        )
    if not inputs.activation_checkpointing:
        changes.append(
            Change(
                "model.fsdp.activation_checkpointing=true",
                "each layer's forward runs twice: about a third more compute",
                replace(inputs, activation_checkpointing=True),
            )
        )
    if not inputs.offload_activations and not inputs.on_cpu:  # (on the CPU the host is the device)
        changes.append(
            Change(
                "model.fsdp.offload_activations=true",
                "saved activations copied to host memory and back, overlapped with compute on CUDA",
                replace(inputs, offload_activations=True),
            )
        )
    if (
        not inputs.update_in_backward
        and not inputs.cpu_offload
        and inputs.microbatches_per_rank == 1
        and inputs.compute_dtype != torch.float16
    ):
        changes.append(
            Change(
                "optimizer.in_backward=true max_grad_norm=null",
                "the optimizer steps in the backward: no gradient clipping",
                replace(inputs, update_in_backward=True),
                excludes="model.fsdp.cpu_offload",
            )
        )
    if adam:
        changes.append(
            Change(
                "optimizer._target_=torchao.optim.AdamW4bit",
                "4-bit moments: more quantization error than 8-bit",
                replace(inputs, optimizer="torchao.optim.AdamW4bit"),
            )
        )
    if not inputs.cpu_offload and not inputs.update_in_backward and not inputs.on_cpu:
        changes.append(
            Change(
                "model.fsdp.cpu_offload=true",
                "parameters, gradients and optimizer states on the host, stepped there: a slower step",
                replace(inputs, cpu_offload=True),
                excludes="optimizer.in_backward",
            )
        )
    if inputs.tokens >= 1024:
        half = inputs.tokens // 2
        changes.append(
            Change(
                f"data.max_tokens_per_microbatch={half}",
                f"chats over {half} tokens no longer fit a row, and a step has half the tokens",
                replace(inputs, tokens=half),
            )
        )
    if inputs.lora_rank is None:
        changes.append(
            Change(
                "peft=lora",
                "trains rank-16 adapters, not the whole model",
                replace(inputs, lora_rank=16, lora_targets=("all-linear",)),
            )
        )
    if not inputs.quantized_base and not inputs.on_cpu:  # bitsandbytes' 4-bit kernels: CUDA only
        changes.append(
            Change(
                "peft=qlora",
                "rank-16 adapters over a 4-bit base (bitsandbytes, CUDA): the base's rounding in every forward",
                replace(inputs, lora_rank=16, lora_targets=("all-linear",), quantized_base=True),
            )
        )
    if not inputs.on_cpu:  # (more CPU ranks on one host add to what it holds)
        ranks = 2 * inputs.ranks
        changes.append(
            Change(f"--ranks {ranks}", f"twice the GPUs: --nproc_per_node {ranks}", replace(inputs, ranks=ranks))
        )
    return changes


def _expert_degree(inputs: MemoryInputs) -> int:
    """The expert parallelism chattune would offer `inputs`: the most ranks that divide both the ranks FSDP2 shards
    over and a MoE model's experts per layer; 1 where it offers none (a dense model, ep set already, tensor
    parallelism or LoRA, which expert parallelism does not compose with yet)."""
    if inputs.expert > 1 or inputs.tensor > 1 or inputs.lora_rank is not None:
        return 1
    text = inputs.hf_config.get_text_config() if hasattr(inputs.hf_config, "get_text_config") else inputs.hf_config
    experts = next(
        (count for name in EXPERT_COUNT_KEYS if isinstance(count := getattr(text, name, None), int) and count > 1), 0
    )
    if not experts:  # a dense model
        return 1
    return max(d for d in range(1, inputs.ranks + 1) if inputs.ranks % d == 0 and experts % d == 0)


def ways_to_fit(inputs: MemoryInputs, device_memory: int, estimated: MemoryEstimate) -> list[str]:
    """Where `estimated` (the estimate of `inputs`) does not fit `device_memory`: the single changes that make it
    fit, cheapest first, each with the peak it gives; where none does alone, the changes taken in that order until
    they fit together, less each one the others do not need (a set none can be left out of, not always the
    smallest)."""
    if estimated.total is None or estimated.total <= device_memory:
        return []
    changes = candidate_changes(inputs)
    alone = [(change, estimate(change.inputs).total) for change in changes]
    fitting = [(change, total) for change, total in alone if total is not None and total <= device_memory]
    if fitting:
        lines = ["changes that make it fit, each alone, cheapest first:"]
        lines += [f"  {change.setting:<58} {format_gib(total):>10}  ({change.cost})" for change, total in fitting]
        return lines
    chosen = _together(inputs, changes, device_memory)
    if chosen is None:
        return [
            "no change chattune offers makes it fit, even all together: a larger GPU, more of them, or a smaller model"
        ]
    total = estimate(_combined(inputs, chosen)).total
    return [f"no single change makes it fit; these together ({format_gib(total)}):"] + [
        f"  {change.setting:<58} ({change.cost})" for change in chosen
    ]


def _together(inputs: MemoryInputs, changes: list[Change], device_memory: int) -> list[Change] | None:
    """Changes taken cheapest first until they fit together, then less each one the others do not need, dearest
    first; of two changes that exclude each other, each is tried without the other (the fewer changes win)."""
    best = None
    for left_out in {change.excludes for change in changes if change.excludes} or {""}:
        chosen: dict[str, Change] = {}  # by the setting's key: AdamW4bit replaces AdamW8bit in place
        for change in changes:
            if _setting_key(change) == left_out:
                continue
            chosen[_setting_key(change)] = change
            if _fits(inputs, chosen.values(), device_memory):
                break
        else:
            continue
        for key in reversed(list(chosen)[:-1]):
            rest = [change for other, change in chosen.items() if other != key]
            if _fits(inputs, rest, device_memory):
                del chosen[key]
        if best is None or len(chosen) < len(best):
            best = list(chosen.values())
    return best


def _setting_key(change: Change) -> str:
    return change.setting.split("=")[0].split()[0]


def _combined(inputs: MemoryInputs, changes) -> MemoryInputs:
    """`inputs` with the fields each of `changes` sets."""
    combined = inputs
    for change in changes:
        changed = {
            name: getattr(change.inputs, name)
            for name in inputs.__dataclass_fields__
            if getattr(change.inputs, name) != getattr(inputs, name)
        }
        combined = replace(combined, **changed)
    return combined


def _fits(inputs: MemoryInputs, changes, device_memory: int) -> bool:
    total = estimate(_combined(inputs, changes)).total
    return total is not None and total <= device_memory


def report(
    inputs: MemoryInputs, device_memory: int | None, memory_name: str | None = None
) -> tuple[MemoryEstimate, str]:
    """The estimate of `inputs` and its table, with the ways to fit `device_memory` where it does not (named
    `memory_name` in the table)."""
    estimated = estimate(inputs)
    advice = ways_to_fit(inputs, device_memory, estimated) if device_memory is not None else []
    memory_name = memory_name or ("memory (--device-memory)" if inputs.on_cpu else "device memory")
    table = estimated.table(device_memory, memory_name)
    return estimated, "\n".join([table, *(f"  {line}" for line in advice)])
