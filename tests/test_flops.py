"""Model FLOPs and MFU (`chattune.model.flops`, `chattune.train.metrics.step_metrics`), against hand counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_model
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

from chattune.data.documents import Document
from chattune.data.packing import collate_packed
from chattune.model.flops import batch_flops, model_flops, peak_flops
from chattune.objectives.cross_entropy import TokenCrossEntropy
from chattune.train.metrics import step_metrics
from chattune.train.step import StepResult


@pytest.mark.parametrize("tied", [True, False])
def test_model_flops_are_the_hand_count(tied):
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100, tie_word_embeddings=tied)
    flops = model_flops(AutoModelForCausalLM.from_config(config))
    # per layer: q 64x64, k and v 64x32 (2 kv heads of 16), o 64x64, gate and up 64x96, down 96x64
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 96
    assert flops.matmul_weights == 2 * per_layer + 100 * 64  # + the output layer, tied or not; no embedding lookup
    assert flops.attention_width == 2 * 4 * 16

    documents = [Document(doc_id=i, input_ids=np.ones(n), labels=np.ones(n)) for i, n in enumerate([3, 5])]
    batch = collate_packed(documents, pad_to_multiple_of=10)  # + a padding segment of 2 tokens: not model work
    pairs = 3 * 4 // 2 + 5 * 6 // 2
    assert batch_flops(flops, batch) == 6 * flops.matmul_weights * 8 + 12 * flops.attention_width * pairs


# (config overrides of `tiny_model` (hidden 64, 4 query heads), attention width, mixers' forward FLOPs per token),
# counted by hand from the config numbers: convolution 2 × kernel × channels, state 6 × its elements per token.
HYBRID = {
    # gated DeltaNet: keys 2 heads × 16, values 4 heads × 16: conv channels 2 × 32 + 64; a 16 × 16 state
    # per value head
    "qwen3_5": ({"model_type": "qwen3_5_text", "layer_types": ["linear_attention", "full_attention"], "head_dim": 16,
                 "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
                 "linear_num_value_heads": 4, "linear_conv_kernel_dim": 4},
                1 * 4 * 16, 2 * 4 * (2 * 2 * 16 + 4 * 16) + 6 * 4 * 16 * 16),
    # a short convolution of kernel 3 over the 64 hidden channels; head dim 64 / 4
    "lfm2": ({"model_type": "lfm2", "layer_types": ["conv", "full_attention"], "conv_L_cache": 3},
             1 * 4 * 16, 2 * 3 * 64),
    # Mamba-2: 8 heads × 16 = d_inner 128, conv over d_inner + 2 × (1 group × state 16); an MLP-only layer
    "nemotron_h": ({"model_type": "nemotron_h", "num_hidden_layers": 3, "layers_block_type": ["mamba", "attention", "mlp"],
                    "head_dim": 16, "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 1, "ssm_state_size": 16,
                    "conv_kernel": 4, "chunk_size": 16},
                   1 * 4 * 16, 2 * 4 * (8 * 16 + 2 * 1 * 16) + 6 * 8 * 16 * 16),
    # no attention at all: two Mamba-2 layers, d_inner = expand 2 × 64 = 8 heads × 16
    "mamba2": ({"model_type": "mamba2", "num_heads": 8, "head_dim": 16, "expand": 2, "n_groups": 1, "state_size": 16,
                "conv_kernel": 4, "chunk_size": 16},
               0, 2 * (2 * 4 * (128 + 2 * 1 * 16) + 6 * 128 * 16)),
}


@pytest.mark.parametrize("name", HYBRID)
def test_hybrid_models_count_their_attention_layers_and_their_mixers(name):
    overrides, attention_width, mixer_flops = HYBRID[name]
    flops = model_flops(tiny_model(**overrides))
    assert (flops.attention_width, flops.mixer_flops_per_token) == (attention_width, mixer_flops)

    documents = [Document(doc_id=i, input_ids=np.ones(n), labels=np.ones(n)) for i, n in enumerate([3, 5])]
    pairs = 3 * 4 // 2 + 5 * 6 // 2
    # backward = 2 × forward for the mixers too
    expected = 6 * flops.matmul_weights * 8 + 3 * mixer_flops * 8 + 12 * attention_width * pairs
    assert batch_flops(flops, collate_packed(documents)) == expected


def test_mfu_is_model_flops_per_second_over_the_peak():
    result = StepResult(loss_sum=20.0, local_units=10, global_units=10, local_tokens=16)
    metrics = step_metrics(3, result, TokenCrossEntropy(), grad_norm=1.0, lr=1e-3, step_time_s=2.0,
                           device=torch.device("cpu"), model_flops=5e12, peak_flops=10e12)
    assert metrics["mfu"] == pytest.approx(5e12 / 2.0 / 10e12)
    assert metrics["all_tokens_per_sec_per_device"] == pytest.approx(16 / 2.0)
    assert "mfu" not in step_metrics(3, result, TokenCrossEntropy(), 1.0, 1e-3, 2.0, torch.device("cpu"), 5e12, None)
    assert peak_flops(torch.device("cpu")) is None


def test_a_mixture_of_experts_counts_the_experts_a_token_uses():
    config = Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                            num_experts_per_tok=2, vocab_size=50, decoder_sparse_step=1, mlp_only_layers=[])
    flops = model_flops(AutoModelForCausalLM.from_config(config))
    attention = 32 * 32 + 2 * 32 * 16 + 32 * 32  # q, k, v (2 kv heads of 8), o
    experts = 4 * (2 * 16 * 32 + 32 * 16)  # each expert: gate and up 32 -> 16, down 16 -> 32
    assert flops.matmul_weights == attention + experts * 2 // 4 + 50 * 32  # 2 of 4 experts per token; output layer


def test_frozen_weights_count_four_times_their_size_per_token():
    """LoRA: a frozen weight takes the forward and its input's gradient (2 + 2 FLOPs per element and token),
    not its own gradient; a trained one all three (6)."""
    from omegaconf import OmegaConf

    from chattune.model.adapters import add_adapters

    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config)
    add_adapters(model, OmegaConf.create({"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"],
                                          "use_dora": False, "modules_to_save": None}))
    flops = model_flops(model)
    base = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 96) + 100 * 64  # every base linear and the output layer
    adapters = 2 * (4 * 64 + 64 * 4 + 4 * 64 + 32 * 4)  # per layer: q's A (4x64) and B (64x4), v's A and B (32x4)
    assert (flops.frozen_matmul_weights, flops.matmul_weights) == (base, adapters)
    assert flops.step_flops(tokens=10, causal_pairs=0) == (4 * base + 6 * adapters) * 10


def test_h200_nvl_has_its_own_peak(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200 NVL")
    assert peak_flops(torch.device("cuda", 0)) == 835e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert peak_flops(torch.device("cuda", 0)) == 989e12
