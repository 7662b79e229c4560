"""FSDP2 sharding for HF decoder models: one `fully_shard` unit per decoder layer plus the root."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from chattune.config.schema import DTYPES
from chattune.model.causal_lm import PackedCausalLM

TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}


def decoder_layers(model: PackedCausalLM) -> list[nn.Module]:
    """The repeated blocks, found through the class names HF lists in `_no_split_modules`."""
    names = set(model.hf_model._no_split_modules or [])
    # Match along the MRO: once sharded, a layer's class is FSDP2's dynamic subclass (FSDPLlamaDecoderLayer).
    layers = [m for m in model.hf_model.modules() if any(c.__name__ in names for c in type(m).__mro__)]
    if not layers:
        raise ValueError(f"found no decoder layers in {type(model.hf_model).__name__} (looked for {sorted(names)})")
    return layers


def compute_dtype(param_dtype: str, device_type: str) -> str:
    """model.fsdp.param_dtype resolved: `auto` is bf16 where it is fast (CUDA) and fp32 on CPU."""
    if param_dtype == "auto":
        return "bfloat16" if device_type == "cuda" else "float32"
    return param_dtype


def shard_model(
    model: PackedCausalLM,
    device_type: str,
    world_size: int,
    param_dtype: str = "auto",
    reduce_dtype: str = "float32",
    activation_checkpointing: bool = False,
) -> PackedCausalLM:
    if activation_checkpointing:
        model.hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    param_dtype = compute_dtype(param_dtype, device_type)
    mesh = init_device_mesh(device_type, (world_size,))
    # Parameters stay fp32 in their shards (the optimizer's master copy); FSDP casts them to
    # param_dtype when it gathers them for compute, and reduces gradients in reduce_dtype.
    policy = MixedPrecisionPolicy(param_dtype=TORCH_DTYPES[param_dtype], reduce_dtype=TORCH_DTYPES[reduce_dtype])
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Each rank's loss is already divided by the GLOBAL token count, so the cross-rank
            # gradient reduction must be a plain sum, not FSDP's default average.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model
