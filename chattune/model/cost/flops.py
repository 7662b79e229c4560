"""Model FLOPs of a training step and MFU (model FLOPs utilisation).

A step's model FLOPs are those of its matmuls, forward and backward (backward = 2 × forward):
- dense: 6 × (trained matmul weights) + 4 × (frozen matmul weights) per token: a frozen weight (a LoRA
  run's base, a 4-bit base) takes the forward and the gradient of its input, not its own gradient. The
  matmul weights are every `nn.Linear` weight of the model (GPT-2's `Conv1D` too), the output layer included (an
  embedding lookup is no matmul), the routers' weights of mixture-of-experts layers, and the stacked expert weights
  of transformers 5 (3-D): a stack of the routed experts scaled by the share each token uses (`num_experts_per_tok`
  / the number of routed experts; a shared expert, an `nn.Linear` or a stack of its own, is always used;
  `_matmul_weights`);
- attention: per softmax-attention layer and per document of n tokens, QKᵀ takes 2 × (query heads × query/key
  head dim) and AV 2 × (query heads × value head dim) FLOPs per (query, key) pair, and causal attention has
  n (n + 1) / 2 pairs: 12 × Σ over layers of (query heads × (query/key + value head dim) / 2) × Σ n (n + 1) / 2
  per step, training included (the head sizes are equal but for multi-head latent attention). Heads and head
  sizes are read per layer from the attention modules (`attention_shapes`): Gemma 4's global layers have wider
  heads than its sliding ones. Sliding windows are not subtracted.
- hybrid models (the token mixers of `chattune.model.packed.mixers.HANDLED`: short convolutions, Mamba SSMs, the
  gated delta rule, KDA, the recurrent families): the attention term counts only their softmax-attention layers, and each mixer adds
  its sequence work beyond its `nn.Linear` projections (which the dense term counts), per token, forward
  (backward = 2 × forward; a frozen convolution's weight gradient, a negligible share, is counted too):
  - its causal convolution(s): 2 × kernel × channels (2 per weight element of the depthwise `nn.Conv1d`);
  - gated delta rule / KDA: per value head, reading out the (key dim × value dim) state for the delta, updating
    it and reading out the output, 2 FLOPs per state element each: 6 × key dim × value dim;
  - Mamba-2: per head, the decay, the input's outer product and the readout of the (head dim × state size)
    state: ≈ 6 × head dim × state size, 6 × d_inner × state size over the heads; Mamba (1) likewise
    ≈ 6 × d_inner × state size (its per-element exp of Δ·A not counted);
  - MiniMax's lightning attention: per head, adding the key-value outer product to the (head dim × head dim)
    state and reading it out: 4 × head dim²; xLSTM's mLSTM likewise on its (key dim × value dim) memory per head,
    4 × key dim × value dim (its normaliser, a vector, not counted);
  - the recurrences of RWKV and RecurrentGemma's RG-LRU are elementwise (not counted; RG-LRU's block-diagonal
    gates are 3-D weights, counted in the dense term), their convolutions and token shifts as above (a token shift
    is no convolution module: not counted);
  - elementwise gates, norms and activations are not counted, nor the extra intra-chunk work of the chunked
    kernels (like recomputation, it is the algorithm's cost, not the model's).
Modules run more than once per token (looped or shared layers) are counted once.

MFU = model FLOPs per second per device / the device's peak dense bf16 FLOP/s (`PEAK_FLOPS`). Recomputed
activations (activation checkpointing, the chunked loss) are not model FLOPs: they lower MFU, as they
should. On a device without a table entry (CPU, an unknown GPU) MFU is not reported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from chattune.data.packing import PackedBatch
from chattune.model.packed.mixers import BAILING_KDA, GATED_DELTA_RULE, HANDLED, KDA, LIGHTNING, MAMBA, MAMBA2, MLSTM
from chattune.model.quantization.quantize import weight_shape

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


def text_config(config):
    """The text config of a model's config: the config itself or its text model's, the object itself (changes to
    it are the config's). A config holding a text encoder and a decoder (MusicGen) gives its decoder's."""
    try:
        return config.get_text_config()
    except ValueError:  # several text configs: get_text_config(decoder=True) names the decoder's
        return config.get_text_config(decoder=True)


# Config names of the number of routed experts and of the experts each token uses.
ROUTED_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
ACTIVE_EXPERTS = ("num_experts_per_tok", "top_k_experts", "moe_topk", "moe_k", "num_experts_per_token", "moe_top_k")


def _config_int(source, names: tuple[str, ...]) -> int | None:
    """The first of `names` that `source` holds as a positive int. A heterogeneous config's per-layer attributes are
    not read globally (transformers refuses: they differ by layer)."""
    per_layer = getattr(source, "per_layer_attributes", None) or ()
    for name in names:
        value = getattr(source, name, None) if name not in per_layer else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


@dataclass(frozen=True)
class ModelFlops:
    matmul_weights: int  # elements of every trained nn.Linear weight (the output layer included)
    attention_width: int  # Σ over attention layers of query heads × head dim: the width of QKᵀ and AV
    frozen_matmul_weights: int = 0  # elements of the frozen ones (no weight gradient)
    mixer_flops_per_token: int = 0  # forward FLOPs per token of the mixers other than attention (hybrid models)

    def step_flops(self, tokens: int, causal_pairs: int) -> float:
        """Model FLOPs (forward + backward) of `tokens` tokens whose documents hold `causal_pairs`
        (query, key) pairs in all (Σ n (n + 1) / 2)."""
        return (
            6.0 * self.matmul_weights + 4.0 * self.frozen_matmul_weights + 3.0 * self.mixer_flops_per_token
        ) * tokens + 12.0 * self.attention_width * causal_pairs


def model_flops(hf_model: PreTrainedModel) -> ModelFlops:
    """The FLOP counts of a (not yet sharded) HF causal LM, from its modules and config; frozen weights (those
    that do not require gradients when it is called) apart."""
    weights = {True: 0, False: 0}  # by requires_grad
    config = text_config(hf_model.config)
    moe = (config, getattr(config, "ffn_config", None))  # DBRX keeps its experts' numbers in its ffn_config
    routed = next((n for source in moe if (n := _config_int(source, ROUTED_EXPERTS))), None)
    active = next((n for source in moe if (n := _config_int(source, ACTIVE_EXPERTS))), None)
    for m in hf_model.modules():
        for p, share in _matmul_weights(m, routed, active):
            weights[p.requires_grad] += int(weight_shape(p).numel() * share)  # 4-bit: unpacked
    decoder = hf_model.get_decoder()  # the text decoder: a vision tower's modules are not counted here
    mixers = [m for m in decoder.modules() if type(m).__name__ in HANDLED]
    return ModelFlops(
        matmul_weights=weights[True],
        attention_width=sum(attention_widths(hf_model)),
        frozen_matmul_weights=weights[False],
        mixer_flops_per_token=sum(mixer_forward_flops(m) for m in mixers),
    )


def _matmul_weights(module: nn.Module, routed: int | None, active: int | None) -> list[tuple[nn.Parameter, float]]:
    """The matmul weights a module holds itself, each with the share of it a token uses: an `nn.Linear`'s weight
    (GPT-2's `Conv1D` is one, transposed), a router's (`...TopKRouter`, a weight of its own applied with F.linear),
    and the stacked weights of the routed experts (3-D, DBRX's 2-D stacks of experts × rows in its `...Expert...`
    modules), scaled by active / routed experts. Any other 3-D weight (a shared expert kept as a stack of one,
    block-diagonal gates) counts whole; biases, norms, embeddings and convolution kernels are no matmul weights."""
    if isinstance(module, (nn.Linear, Conv1D)):
        return [(module.weight, 1.0)]
    if isinstance(module, nn.modules.conv._ConvNd):
        return []
    name = type(module).__name__
    found = []
    for parameter_name, p in module.named_parameters(recurse=False):
        if parameter_name.endswith("bias"):
            continue
        stacked = p.dim() == 3 or p.dim() == 2 and "Expert" in name
        if stacked:
            share = (
                active / routed
                if routed and active and p.shape[0] % routed == 0 and (p.dim() == 2 or p.shape[0] == routed)
                else 1.0
            )
            found.append((p, share))
        elif p.dim() == 2 and parameter_name == "weight" and name.lower().endswith("topkrouter"):
            found.append((p, 1.0))
    return found


def attention_modules(hf_model: PreTrainedModel) -> list[nn.Module]:
    """The softmax-attention modules of the text decoder, one per attention layer, read from the modules rather than
    the config: families spell per-layer kinds differently (layer_types, layers_block_type, attention indices or
    periods, "hybrid" layers holding attention and a mixer, MLP-only layers) and some keep head sizes per layer
    (Gemma 4's global layers), while their attention classes are all `...Attention`. A mixer of `HANDLED` is not
    softmax attention (KDA's `KimiLinearDeltaAttention`); a wrapper holding the attention proper (BERT's
    `BertAttention` around `BertSelfAttention`) is not counted apart from it."""

    def attention(module: nn.Module) -> bool:
        name = type(module).__name__
        return name.endswith("Attention") and name not in HANDLED

    found = [m for m in hf_model.get_decoder().modules() if attention(m)]
    return [m for m in found if not any(attention(inner) for inner in m.modules() if inner is not m)]


def attention_shapes(hf_model: PreTrainedModel) -> list[tuple[int, int, int]]:
    """Per attention layer (`attention_modules`): (query heads, query/key head dim, value head dim), read from the
    module's own attributes where it has them (per layer: Gemma 4's global layers' `head_dim`, Laguna's heads,
    multi-head latent attention's `qk_head_dim` and `v_head_dim`), else from its config's, else the text config's.
    A module naming no heads anywhere is no multi-head attention and is left out."""
    config = text_config(hf_model.config)
    shapes = []
    for module in attention_modules(hf_model):
        sources = (module, getattr(module, "config", None), config)
        heads = next(
            (n for s in sources if (n := _config_int(s, ("num_heads", "num_attention_heads", "n_heads")))), None
        )
        if heads is None:
            continue
        qk_dim = next(
            (
                n
                for s in sources
                if (n := _config_int(s, ("qk_head_dim", "head_dim", "head_size", "attention_head_size")))
            ),
            None,
        )
        qk_dim = qk_dim or config.hidden_size // heads
        shapes.append((heads, qk_dim, _config_int(module, ("v_head_dim",)) or qk_dim))
    return shapes


def attention_widths(hf_model: PreTrainedModel) -> list[int]:
    """Per attention layer, the width of QKᵀ and AV: query heads × (query/key head dim + value head dim) / 2
    (query heads × head dim where both are the head dim)."""
    return [heads * (qk_dim + v_dim) // 2 for heads, qk_dim, v_dim in attention_shapes(hf_model)]


def attention_heads(hf_model: PreTrainedModel) -> list[int]:
    """The query heads of each attention layer (what context parallelism divides)."""
    return [heads for heads, _, _ in attention_shapes(hf_model)]


def mixer_forward_flops(mixer: nn.Module) -> int:
    """Forward FLOPs per token of a mixer of `HANDLED` beyond its `nn.Linear` projections (module docstring)."""
    # A stride-1 convolution takes 2 FLOPs per weight element per output token (2 × kernel × channels, depthwise).
    convolution = sum(2 * m.weight.numel() for m in mixer.modules() if isinstance(m, nn.Conv1d))
    kind = HANDLED[type(mixer).__name__]
    if kind == GATED_DELTA_RULE:
        state = mixer.num_v_heads * mixer.head_k_dim * mixer.head_v_dim
    elif kind in (KDA, BAILING_KDA):
        state = mixer.num_heads * mixer.head_dim * mixer.head_dim
    elif kind in (MAMBA2, MAMBA):  # d_inner = Mamba-2's heads × head dim
        state = mixer.intermediate_size * mixer.ssm_state_size
    elif kind == LIGHTNING:  # no delta: the state is updated and read out, 4 FLOPs per element
        return convolution + 4 * mixer.num_attention_heads * mixer.head_dim * mixer.head_dim
    elif kind == MLSTM:
        return convolution + 4 * mixer.qk_dim * mixer.v_dim // mixer.config.num_heads
    else:  # a short convolution, RWKV's and RG-LRU's elementwise recurrences: the convolution only
        state = 0
    return convolution + 6 * state


def causal_pairs(cu_seqlens: torch.Tensor) -> int:
    """Σ n (n + 1) / 2 over the segments of a packed row (from its CPU `cu_seqlens`; no device sync)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    return int((lengths * (lengths + 1) // 2).sum())


def batch_flops(flops: ModelFlops, batch: PackedBatch) -> float:
    """Model FLOPs of a packed microbatch's documents (its padding segment, if any, is not model work). A segment
    continuing a shared prompt (data.share_prompts) also attends to the prompt's keys: its length times the prompt's
    more query-key pairs."""
    segments = batch.cu_seqlens[:-1] if batch.padding else batch.cu_seqlens
    pairs = causal_pairs(segments)
    if batch.prefixes is not None:
        lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).to(torch.int64)
        pairs += int((lengths * batch.prefixes[:, 1]).sum())
    return flops.step_flops(batch.num_document_tokens, pairs)


def peak_flops(device: torch.device) -> float | None:
    """The device's peak dense bf16 FLOP/s, None where unknown (CPU, a GPU not in the table)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for part, peak in PEAK_FLOPS if part in name), None)
