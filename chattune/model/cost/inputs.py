"""What the memory estimate (`chattune.model.cost.memory`) reads of a run: the model's HF config and the settings that
decide a rank's bytes. Its own module, so that the activation trace and the estimate both read it and neither
imports the other for it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MemoryInputs:
    """What decides a rank's memory: the model's HF config and the run's settings."""

    hf_config: object
    ranks: int  # the ranks FSDP shards each parameter over (`ParallelDims.shard_ranks`)
    tokens: int  # tokens of one microbatch on one rank
    compute_dtype: torch.dtype = torch.float32
    activation_checkpointing: bool = False
    compiled: bool = False  # model.compile resolved: compiled layers keep what the compiler's partition saves
    loss_chunk: int = 1024
    optimizer: str = "torch.optim.AdamW"
    momentum: float = 0.0  # SGD's
    lora_rank: int | None = None  # LoRA: the adapters' rank (targets: `lora_targets`)
    lora_targets: tuple[str, ...] = ()
    quantized_base: bool = False  # QLoRA (peft.quantize_base): the decoder's linear weights in 4 bits, replicated
    live_reference: bool = False
    update_in_backward: bool = False  # optimizer.in_backward
    offload_activations: bool = False  # model.fsdp.offload_activations
    cpu_offload: bool = False  # model.fsdp.cpu_offload
    microbatches_per_rank: int = 1  # a step's, on each rank
    tensor: int = 1  # parallel.tensor: the decoder layers' linear weights split over this many ranks first
    expert: int = 1  # parallel.expert: each MoE layer's experts split over this many of the `ranks`
    on_cpu: bool = False  # the run computes on the CPU: the host is the device (offloading moves nothing)
    loss_implementation: str = "chunked"  # as the run resolves loss.implementation: chunked | cut_cross_entropy
    cce_fp32_gradients: bool = False  # the CCE release accumulates the output layer's gradient in fp32
    # A policy that samples its own steps (the GRPO recipe): the sequences a rank generates at once and the longest
    # of them in tokens (the prompt and its completion: at most the row budget); 0: no rollout.
    rollout_sequences: int = 0
    rollout_tokens: int = 0
    # On-policy distillation's teacher (teacher.path): its HF config, sharded like the policy (None: no teacher); with
    # loss.type=gkd it runs beside the policy in training and its embeddings and output layer stay gathered.
    teacher_config: object | None = None
    teacher_in_training: bool = False
