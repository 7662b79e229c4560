"""QLoRA's 4-bit base (`peft.quantize_base: nf4|fp4`): the frozen linear layers of the decoder stored in 4 bits
with bitsandbytes, under peft's LoRA adapters.

The quantized weights are replicated on every rank, not sharded: FSDP2 gathers a parameter as a plain tensor
and so loses the quantization state bitsandbytes keeps on its `Params4bit` (its scales), which is known to
corrupt QLoRA under FSDP2 silently (bitsandbytes issue 1945, accelerate issue 3983). They are handed to
`fully_shard` as ignored parameters instead; at 4 bits the whole base is already an eighth of its fp32
shards on two ranks. Everything else (embeddings, norms, output layer, the adapters) is sharded as in LoRA.

The weights are quantized from the compute dtype (bf16 on CUDA), so their quantization state is in it and
each forward dequantizes straight to it (quantized from fp32, every layer of every step would dequantize to
fp32 and then cast). The layers are bitsandbytes' `Linear4bit` with one change, `ExactBiasLinear4bit`: its
forward casts a frozen bias (Qwen2-style qkv biases) to the compute dtype out of place, where bitsandbytes
replaces the stored bias by its bf16 copy, which a merged export would then write.

bitsandbytes is imported only here and only when a 4-bit base is asked for: it is no install dependency
(`pip install "chattune[qlora]"`). The recipes refuse a 4-bit base on the CPU (`chattune.launch.run_rules`):
the point of QLoRA is GPU memory, and bitsandbytes' CPU kernels are not what we train on; the functions
below run on any device bitsandbytes supports, so the tests exercise them on the CPU.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from chattune.errors import UserError

BLOCKSIZE = 64  # QLoRA's block size for the 4-bit weights (bitsandbytes' default)


def bitsandbytes():
    """The bitsandbytes module, or a clear error saying how to install it."""
    try:
        import bitsandbytes
    except ImportError as error:
        raise UserError('peft.quantize_base needs bitsandbytes: pip install "chattune[qlora]"') from error
    return bitsandbytes


@functools.cache
def linear4bit_class() -> type[nn.Module]:
    """bitsandbytes' 4-bit linear layer whose forward leaves the stored bias as it is (see the module docstring)."""
    bnb = bitsandbytes()
    from bitsandbytes.nn.modules import fix_4bit_weight_quant_state_from_module

    class ExactBiasLinear4bit(bnb.nn.Linear4bit):
        """`bnb.nn.Linear4bit` computing in its construction's `compute_dtype`, the bias cast out of place."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            fix_4bit_weight_quant_state_from_module(self)  # bitsandbytes' own repair of a state lost in a move
            bias = None if self.bias is None else self.bias.to(self.compute_dtype)
            return bnb.matmul_4bit(
                x.to(self.compute_dtype), self.weight, bias=bias, quant_state=self.weight.quant_state
            ).to(x.dtype)

    return ExactBiasLinear4bit


def is_quantized(tensor: torch.Tensor) -> bool:
    """A bitsandbytes 4-bit weight (without importing bitsandbytes)."""
    return type(tensor).__name__ == "Params4bit"


def weight_shape(weight: torch.Tensor) -> torch.Size:
    """The shape of the matrix a weight stands for (a 4-bit weight is stored packed, two values a byte)."""
    if is_quantized(weight):
        state = weight.quant_state
        return torch.Size(state.shape) if state is not None else weight.shape  # quantized, or the placeholder
    return weight.shape


def quantize_linears(
    layers: list[nn.Module], quant_type: str, compute_dtype: torch.dtype, device: torch.device
) -> list[nn.Module]:
    """Replace every nn.Linear of the frozen base inside `layers` (the decoder layers; the LoRA adapters' own
    linears excepted) with a bitsandbytes 4-bit linear; returns the new modules. peft's LoRA layer keeps
    running its base layer and adds the adapters' output, so the adapters are injected first, on the
    full-precision structure (peft's DoRA set-up cannot copy a 4-bit layer on the meta device). Weights
    already in memory are quantized on `device` now, from `compute_dtype`; meta weights (a model built to be
    loaded shard by shard) stay unquantized placeholders until `load_quantized` fills them."""
    linear4bit = linear4bit_class()
    replaced = []
    for layer in layers:
        for name, linear in list(layer.named_modules()):
            if type(linear) is not nn.Linear or any(part.startswith("lora_") for part in name.split(".")):
                continue
            quantized = linear4bit(
                linear.in_features,
                linear.out_features,
                bias=linear.bias is not None,
                compute_dtype=compute_dtype,
                quant_type=quant_type,
                device="meta",
            )
            # bitsandbytes' CPU inference path repacks the weight in place in eval mode; we keep one layout.
            quantized.support_avx512bf16_for_cpu = False
            if linear.bias is not None:
                quantized.bias = nn.Parameter(linear.bias.detach(), requires_grad=False)
            quantized.weight = _params4bit(linear.weight.detach().to(compute_dtype), quant_type, quantized)
            if not linear.weight.is_meta:
                quantized.weight = quantized.weight.to(device)  # bitsandbytes quantizes on the move
                if quantized.bias is not None:
                    quantized.bias = nn.Parameter(quantized.bias.to(device), requires_grad=False)
            parent, _, child = name.rpartition(".")
            setattr(layer.get_submodule(parent) if parent else layer, child, quantized)
            replaced.append(quantized)
    return replaced


def _params4bit(data: torch.Tensor, quant_type: str, module: nn.Module) -> nn.Parameter:
    bnb = bitsandbytes()
    return bnb.nn.Params4bit(
        data,
        requires_grad=False,
        blocksize=BLOCKSIZE,
        compress_statistics=True,
        quant_type=quant_type,
        quant_storage=torch.uint8,
        module=module,
    )


def has_quantized_weight(module: nn.Module) -> bool:
    """A 4-bit layer itself (peft's LoRA layer around it reads as having its weight too: not counted)."""
    return is_quantized(module._parameters.get("weight"))


def quantized_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if has_quantized_weight(m)]


def replicated_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The parameters of the 4-bit layers: kept whole on every rank, out of FSDP2's sharding."""
    return {p for m in quantized_modules(model) for p in m.parameters(recurse=False)}


@torch.no_grad()
def load_quantized(module: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None, device: torch.device) -> None:
    """Fill a placeholder 4-bit layer from its full-precision weight (and bias), quantized on `device` from the
    layer's compute dtype."""
    placeholder = module.weight
    module.weight = _params4bit(weight.to(device=device, dtype=module.compute_dtype), placeholder.quant_type, module)
    module.weight = module.weight.to(device)
    if bias is not None:
        module.bias = nn.Parameter(bias.to(device=device, dtype=torch.float32), requires_grad=False)


def dequantized(weight: torch.Tensor) -> torch.Tensor:
    """The full-precision matrix of a weight (a 4-bit one dequantized, in the dtype it was quantized from)."""
    if not is_quantized(weight):
        return weight
    return bitsandbytes().functional.dequantize_4bit(weight.data, weight.quant_state)
