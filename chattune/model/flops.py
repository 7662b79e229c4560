"""Model FLOPs of a training step and MFU (model FLOPs utilisation).

A step's model FLOPs are those of its matmuls, forward and backward (backward = 2 × forward):
- dense: 6 × (trained matmul weights) + 4 × (frozen matmul weights) per token: a frozen weight (a LoRA
  run's base, a 4-bit base) takes the forward and the gradient of its input, not its own gradient. The
  matmul weights are every `nn.Linear` weight of the model, the output layer included (an embedding lookup
  is no matmul), and the experts of a mixture-of-experts layer (3-D parameters in transformers 5) scaled by
  the share each token uses (`num_experts_per_tok` / the number of experts);
- attention: per layer and per document of n tokens, QKᵀ and AV each take 2 × (query heads × head dim)
  FLOPs per (query, key) pair, and causal attention has n (n + 1) / 2 pairs: 12 × layers × query heads
  × head dim × Σ n (n + 1) / 2 per step, training included. Sliding windows are not subtracted.
- hybrid models (the token mixers of `chattune.model.mixers.HANDLED`: short convolutions, Mamba SSMs, the
  gated delta rule, KDA): the attention term counts only their softmax-attention layers, and each mixer adds
  its sequence work beyond its `nn.Linear` projections (which the dense term counts), per token, forward
  (backward = 2 × forward; a frozen convolution's weight gradient, a negligible share, is counted too):
  - its causal convolution(s): 2 × kernel × channels (2 per weight element of the depthwise `nn.Conv1d`);
  - gated delta rule / KDA: per value head, reading out the (key dim × value dim) state for the delta, updating
    it and reading out the output, 2 FLOPs per state element each: 6 × key dim × value dim;
  - Mamba-2: per head, the decay, the input's outer product and the readout of the (head dim × state size)
    state: ≈ 6 × head dim × state size, 6 × d_inner × state size over the heads; Mamba (1) likewise
    ≈ 6 × d_inner × state size (its per-element exp of Δ·A not counted);
  - elementwise gates, norms and activations are not counted, nor the extra intra-chunk work of the chunked
    kernels (like recomputation, it is the algorithm's cost, not the model's).

MFU = model FLOPs per second per device / the device's peak dense bf16 FLOP/s (`PEAK_FLOPS`). Recomputed
activations (activation checkpointing, the chunked loss) are not model FLOPs: they lower MFU, as they
should. On a device without a table entry (CPU, an unknown GPU) MFU is not reported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from chattune.data.packing import PackedBatch
from chattune.model.mixers import GATED_DELTA_RULE, HANDLED, KDA, MAMBA, MAMBA2
from chattune.model.quantize import weight_shape

# Dense bf16 tensor-core peaks from the vendors' data sheets (SXM parts unless named), FLOP/s.
# Matched against torch.cuda.get_device_name() in order: the first name it contains wins.
PEAK_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("GH200", 989e12),
    ("H200 NVL", 835e12),
    ("H200", 989e12),
    ("GB200", 2500e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
)


@dataclass(frozen=True)
class ModelFlops:
    matmul_weights: int  # elements of every trained nn.Linear weight (the output layer included)
    attention_width: int  # attention layers × query heads × head dim: the width of QKᵀ and AV over all layers
    frozen_matmul_weights: int = 0  # elements of the frozen ones (no weight gradient)
    mixer_flops_per_token: int = 0  # forward FLOPs per token of the mixers other than attention (hybrid models)

    def step_flops(self, tokens: int, causal_pairs: int) -> float:
        """Model FLOPs (forward + backward) of `tokens` tokens whose documents hold `causal_pairs`
        (query, key) pairs in all (Σ n (n + 1) / 2)."""
        return ((6.0 * self.matmul_weights + 4.0 * self.frozen_matmul_weights + 3.0 * self.mixer_flops_per_token)
                * tokens + 12.0 * self.attention_width * causal_pairs)


def model_flops(hf_model: PreTrainedModel) -> ModelFlops:
    """The FLOP counts of a (not yet sharded) HF causal LM, from its modules and config; frozen weights (those
    that do not require gradients when it is called) apart."""
    weights = {True: 0, False: 0}  # by requires_grad
    for m in hf_model.modules():
        if isinstance(m, nn.Linear):
            weights[m.weight.requires_grad] += weight_shape(m.weight).numel()  # 4-bit: unpacked
    config = hf_model.config.get_text_config() if hasattr(hf_model.config, "get_text_config") else hf_model.config
    experts = [p for m in hf_model.modules() if not isinstance(m, nn.modules.conv._ConvNd)
               for p in m.parameters(recurse=False) if p.dim() == 3]  # stacked expert weights (not conv kernels)
    if experts:
        total = next((getattr(config, name) for name in ("num_experts", "num_local_experts", "n_routed_experts")
                      if getattr(config, name, None)), None)
        active = getattr(config, "num_experts_per_tok", None)
        share = active / total if total and active else 1.0
        for p in experts:
            weights[p.requires_grad] += int(p.numel() * share)
    decoder = hf_model.get_decoder()  # the text decoder: a vision tower's modules are not counted here
    mixers = [m for m in decoder.modules() if type(m).__name__ in HANDLED]
    attention_layers = config.num_hidden_layers
    if mixers:
        # Count the softmax-attention modules, not config entries: the families spell per-layer kinds
        # differently (layer_types, layers_block_type, attention indices or periods; "hybrid" layers holding
        # attention and a mixer, MLP-only layers), while their attention classes are all `...Attention`
        # (KDA's `KimiLinearDeltaAttention`, a mixer, apart). Zamba's shared blocks are one module per layer.
        attention_layers = sum(type(m).__name__.endswith("Attention") and type(m).__name__ not in HANDLED
                               for m in decoder.modules())
    attention_width = 0
    if attention_layers:  # a pure Mamba-2 model has no attention heads in its config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        attention_width = attention_layers * heads * head_dim
    return ModelFlops(matmul_weights=weights[True], attention_width=attention_width,
                      frozen_matmul_weights=weights[False],
                      mixer_flops_per_token=sum(mixer_forward_flops(m) for m in mixers))


def mixer_forward_flops(mixer: nn.Module) -> int:
    """Forward FLOPs per token of a mixer of `HANDLED` beyond its `nn.Linear` projections (module docstring)."""
    # A stride-1 convolution takes 2 FLOPs per weight element per output token (2 × kernel × channels, depthwise).
    convolution = sum(2 * m.weight.numel() for m in mixer.modules() if isinstance(m, nn.Conv1d))
    kind = HANDLED[type(mixer).__name__]
    if kind == GATED_DELTA_RULE:
        state = mixer.num_v_heads * mixer.head_k_dim * mixer.head_v_dim
    elif kind == KDA:
        state = mixer.num_heads * mixer.head_dim * mixer.head_dim
    elif kind in (MAMBA2, MAMBA):  # d_inner = Mamba-2's heads × head dim
        state = mixer.intermediate_size * mixer.ssm_state_size
    else:  # a short convolution: its convolution only
        state = 0
    return convolution + 6 * state


def causal_pairs(cu_seqlens: torch.Tensor) -> int:
    """Σ n (n + 1) / 2 over the segments of a packed row (from its CPU `cu_seqlens`; no device sync)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    return int((lengths * (lengths + 1) // 2).sum())


def batch_flops(flops: ModelFlops, batch: PackedBatch) -> float:
    """Model FLOPs of a packed microbatch's documents (its padding segment, if any, is not model work)."""
    segments = batch.cu_seqlens[:-1] if batch.padding else batch.cu_seqlens
    return flops.step_flops(batch.num_document_tokens, causal_pairs(segments))


def peak_flops(device: torch.device) -> float | None:
    """The device's peak dense bf16 FLOP/s, None where unknown (CPU, a GPU not in the table)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for part, peak in PEAK_FLOPS if part in name), None)
