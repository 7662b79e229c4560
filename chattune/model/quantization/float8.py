"""Float8 training of the decoder's linear layers (`model.fp8`), with torchao's `Float8Linear`.

The decoder layers' `nn.Linear` modules are swapped for torchao's, which cast their input, weight and output
gradient to float8 for the three matmuls (`tensorwise`: one scale per tensor; `rowwise`: one per row, closer to
bf16 and a little slower; a mixture of experts' router stays out); the weights stay the same fp32 parameters (same names: checkpoints and the export do not
change). The embeddings, norms, output layer and loss stay in the compute dtype: the logits and the loss are where
float8's 3-bit mantissa would cost the most. `emulate` runs tensorwise scaling with the float8 rounding emulated in
ordinary matmuls: the CPU path that tests the numerics (it is slower than bf16, never faster).

With one scale per weight (tensorwise, emulate) FSDP2 gathers each weight's shard already cast to float8
(`enable_fsdp_float8_all_gather`): half the bytes of a bf16 gather, and the fp32 master is rounded to float8 once
(without it, to bf16 for the gather and then to float8). Its scale comes from the whole weight's largest value, an
all-reduce per weight in the gather (torchao's `precompute_float8_dynamic_scale_for_fsdp`, one all-reduce for all
after the optimizer step, is not wired in: a latency cost on GPUs, not a numerical one). Rowwise scaling gathers in
the compute dtype. Left out: float8 inside LoRA's adapted layers (refused).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from chattune.model.peft.adapter_targets import ROUTER_NAMES

FP8_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with float8 matmuls


def fp8_problem(mode: str, device: torch.device, adapted: bool) -> str | None:
    """Why `model.fp8=mode` cannot run on `device` (with LoRA adapters: `adapted`), or None. A CUDA device on a
    machine without one is a GPU planned from elsewhere (`chattune validate --device-memory`): its compute capability
    is unknown here, so it is checked at launch, on the GPU itself."""
    if adapted:
        return (
            f"{mode} with peft: LoRA wraps the decoder's linear layers that float8 would replace (not supported "
            "yet); set model.fp8=null, or train without peft"
        )
    if mode == "emulate":
        return None
    if device.type != "cuda":
        return f"{mode} needs a GPU with float8 matmuls; on the CPU, model.fp8=emulate checks the numerics"
    if not torch.cuda.is_available():  # planned for a GPU this machine lacks
        return None
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        return (
            f"{mode} needs float8 matmuls (compute capability 8.9 or newer: Ada, Hopper); this GPU has "
            f"{capability[0]}.{capability[1]}: set model.fp8=null"
        )
    return None


def convert_linear_layers(decoder_layers: list[nn.Module], mode: str) -> int:
    """Swap the linear layers inside `decoder_layers` for torchao's Float8Linear; how many were swapped. Only
    layers whose both dimensions are multiples of 16 (float8 matmuls need them)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    if mode == "emulate":  # ordinary matmuls on the dequantized data: no inner dimension to pad
        config = Float8LinearConfig(emulate=True)
    else:
        # CUDA's _scaled_mm wants the inner dimension of every matmul a multiple of 16; the weight gradient's is the
        # row's token count (grad_output.t() @ input), which packed rows (and the 1-token empty microbatch) are not:
        # torchao pads it with zeros, an exact copy of the fp8 operands (CPU's _scaled_mm checks nothing).
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(mode), pad_inner_dim=True)
    if mode in ("tensorwise", "emulate"):  # one scale per weight: FSDP2 gathers the shards already in float8
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    for layer in decoder_layers:
        convert_to_float8_training(
            layer,
            config=config,
            module_filter_fn=lambda module, name: (
                isinstance(module, nn.Linear)
                and module.in_features % 16 == 0
                and module.out_features % 16 == 0
                # a mixture of experts' router: its logits pick the experts, and a float8 rounding would move
                # tokens between them (torchtitan leaves it out too)
                and name.rsplit(".", 1)[-1] not in ROUTER_NAMES
            ),
        )
    return sum(isinstance(module, Float8Linear) for layer in decoder_layers for module in layer.modules())
