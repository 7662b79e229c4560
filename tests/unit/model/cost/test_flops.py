"""Model FLOPs and MFU (`chattune.model.cost.flops`, `chattune.train.metrics.step_metrics`), against hand counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    DbrxConfig,
    DeepseekV3Config,
    Gemma4TextConfig,
    GPT2Config,
    GptOssConfig,
    LlamaConfig,
    Qwen3MoeConfig,
)

from chattune.data.documents import Document
from chattune.data.packing import collate_packed
from chattune.model.cost.flops import batch_flops, model_flops, peak_flops
from chattune.objectives.cross_entropy import TokenCrossEntropy
from chattune.train.metrics import StepFlops, step_metrics
from chattune.train.step import StepResult
from conftest import tiny_model


@pytest.mark.parametrize("tied", [True, False])
def test_model_flops_are_the_hand_count(tied):
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        tie_word_embeddings=tied,
    )
    flops = model_flops(AutoModelForCausalLM.from_config(config))
    # per layer: q 64x64, k and v 64x32 (2 kv heads of 16), o 64x64, gate and up 64x96, down 96x64
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 96
    assert flops.matmul_weights == 2 * per_layer + 100 * 64  # + the output layer, tied or not; no embedding lookup
    assert flops.attention_width == 2 * 4 * 16

    documents = [Document(doc_id=i, input_ids=np.ones(n), labels=np.ones(n)) for i, n in enumerate([3, 5])]
    batch = collate_packed(documents, pad_to_multiple_of=10)  # + a padding segment of 2 tokens: not model work
    pairs = 3 * 4 // 2 + 5 * 6 // 2
    assert batch_flops(flops, batch) == 6 * flops.matmul_weights * 8 + 12 * flops.attention_width * pairs
    # a pair sharing its prompt: [4 prompt + 3 chosen][2 rejected], the rejected segment's 2 queries also see the 4
    shared = Document(doc_id=0, input_ids=np.ones(9), labels=np.ones(9), segments=(7, 2), shared_prefix=4)
    pairs = 7 * 8 // 2 + (2 * 3 // 2 + 2 * 4)
    assert (
        batch_flops(flops, collate_packed([shared]))
        == 6 * flops.matmul_weights * 9 + 12 * flops.attention_width * pairs
    )


# (config overrides of `tiny_model` (hidden 64, 4 query heads), attention width, mixers' forward FLOPs per token),
# counted by hand from the config numbers: convolution 2 × kernel × channels, state 6 × its elements per token.
HYBRID = {
    # gated DeltaNet: keys 2 heads × 16, values 4 heads × 16: conv channels 2 × 32 + 64; a 16 × 16 state
    # per value head
    "qwen3_5": (
        {
            "model_type": "qwen3_5_text",
            "layer_types": ["linear_attention", "full_attention"],
            "head_dim": 16,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_conv_kernel_dim": 4,
        },
        1 * 4 * 16,
        2 * 4 * (2 * 2 * 16 + 4 * 16) + 6 * 4 * 16 * 16,
    ),
    # a short convolution of kernel 3 over the 64 hidden channels; head dim 64 / 4
    "lfm2": (
        {"model_type": "lfm2", "layer_types": ["conv", "full_attention"], "conv_L_cache": 3},
        1 * 4 * 16,
        2 * 3 * 64,
    ),
    # Mamba-2: 8 heads × 16 = d_inner 128, conv over d_inner + 2 × (1 group × state 16); an MLP-only layer
    "nemotron_h": (
        {
            "model_type": "nemotron_h",
            "num_hidden_layers": 3,
            "layers_block_type": ["mamba", "attention", "mlp"],
            "head_dim": 16,
            "mamba_num_heads": 8,
            "mamba_head_dim": 16,
            "n_groups": 1,
            "ssm_state_size": 16,
            "conv_kernel": 4,
            "chunk_size": 16,
        },
        1 * 4 * 16,
        2 * 4 * (8 * 16 + 2 * 1 * 16) + 6 * 8 * 16 * 16,
    ),
    # no attention at all: two Mamba-2 layers, d_inner = expand 2 × 64 = 8 heads × 16
    "mamba2": (
        {
            "model_type": "mamba2",
            "num_heads": 8,
            "head_dim": 16,
            "expand": 2,
            "n_groups": 1,
            "state_size": 16,
            "conv_kernel": 4,
            "chunk_size": 16,
        },
        0,
        2 * (2 * 4 * (128 + 2 * 1 * 16) + 6 * 128 * 16),
    ),
    # Mamba (1): d_inner = expand 2 × 64, its convolution of kernel 4 over d_inner, two layers
    "mamba": ({"model_type": "mamba", "state_size": 16, "conv_kernel": 4}, 0, 2 * (2 * 4 * 128 + 6 * 128 * 16)),
    # lightning attention is no softmax attention: 4 heads × 16 in the one full-attention layer, 4 × 4 × 16² for it
    "minimax": (
        {
            "model_type": "minimax",
            "layer_types": ["linear_attention", "full_attention"],
            "head_dim": 16,
            "num_local_experts": 4,
            "block_size": 16,
        },
        1 * 4 * 16,
        4 * 4 * 16 * 16,
    ),
    # the RG-LRU's recurrence is elementwise: its convolution of width 4 over lru_width 64 only
    "recurrent_gemma": (
        {
            "model_type": "recurrent_gemma",
            "lru_width": 64,
            "conv1d_width": 4,
            "block_types": ["recurrent", "attention"],
            "head_dim": 16,
            "num_key_value_heads": 1,
        },
        1 * 4 * 16,
        2 * 4 * 64,
    ),
    # RWKV: elementwise recurrences and token shifts, nothing beyond its projections
    "rwkv": ({"model_type": "rwkv", "attention_hidden_size": 64, "context_length": 128}, 0, 0),
    # mLSTM: 4 heads of (32 / 4 key dims × 64 / 4 value dims) memory, two layers
    "xlstm": ({"model_type": "xlstm", "num_heads": 4, "qk_dim_factor": 0.5}, 0, 2 * 4 * 4 * 8 * 16),
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
    metrics = step_metrics(
        3,
        result,
        TokenCrossEntropy(),
        grad_norm=1.0,
        lr=1e-3,
        step_time_s=2.0,
        device=torch.device("cpu"),
        flops=StepFlops(model_flops=5e12, peak_flops=10e12),
    )
    assert metrics["mfu"] == pytest.approx(5e12 / 2.0 / 10e12)
    assert metrics["all_tokens_per_sec_per_device"] == pytest.approx(16 / 2.0)
    assert "mfu" not in step_metrics(
        3, result, TokenCrossEntropy(), 1.0, 1e-3, 2.0, torch.device("cpu"), StepFlops(5e12, None)
    )
    assert peak_flops(torch.device("cpu")) is None


def test_a_mixture_of_experts_counts_the_experts_a_token_uses():
    config = Qwen3MoeConfig(
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        vocab_size=50,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    flops = model_flops(AutoModelForCausalLM.from_config(config))
    attention = 32 * 32 + 2 * 32 * 16 + 32 * 32  # q, k, v (2 kv heads of 8), o
    router = 4 * 32  # a TopKRouter's own weight (F.linear, no nn.Linear): 32 -> 4 experts' scores
    experts = 4 * (2 * 16 * 32 + 32 * 16)  # each expert: gate and up 32 -> 16, down 16 -> 32
    # 2 of 4 experts per token; the output layer
    assert flops.matmul_weights == attention + router + experts * 2 // 4 + 50 * 32


DOCUMENTS = [3, 5]  # two documents: 3 · 4 / 2 + 5 · 6 / 2 = 21 causal pairs
PAIRS = 3 * 4 // 2 + 5 * 6 // 2


def packed_documents():
    documents = [Document(doc_id=i, input_ids=np.ones(n), labels=np.ones(n)) for i, n in enumerate(DOCUMENTS)]
    return collate_packed(documents)


def test_deepseek_v3_counts_latent_attention_the_router_the_active_experts_and_the_shared_one():
    """Multi-head latent attention, a dense first layer (first_k_dense_replace), then routed experts (2 of 4 per
    token) beside a shared expert that every token uses."""
    config = DeepseekV3Config(
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_rope_head_dim=4,
        qk_nope_head_dim=8,
        v_head_dim=6,
        vocab_size=50,
        tie_word_embeddings=False,
    )
    flops = model_flops(AutoModelForCausalLM.from_config(config))
    # per layer, 4 heads: q_a 32 -> 24 (q_lora_rank), q_b 24 -> 4 × (8 + 4) (query/key head: nope + rope),
    # kv_a 32 -> 16 + 4 (kv_lora_rank + the shared rotary key), kv_b 16 -> 4 × (8 + 6) (key nope + value),
    # o 4 × 6 -> 32
    attention = 32 * 24 + 24 * 4 * 12 + 32 * 20 + 16 * 4 * 14 + 4 * 6 * 32
    dense_mlp = 3 * 32 * 64  # layer 0: gate, up 32 -> 64, down 64 -> 32
    router = 32 * 4
    routed = 4 * (2 * 16 * 32 + 16 * 32)  # 4 experts: gate and up 32 -> 16, down 16 -> 32
    shared = 3 * 32 * 16  # one shared expert (nn.Linear), always used
    lm_head = 50 * 32
    assert flops.matmul_weights == 2 * attention + dense_mlp + router + routed * 2 // 4 + shared + lm_head
    # QKᵀ over the 12-wide query/key heads, AV over the 6-wide value heads: 4 · (12 + 6) / 2 per layer
    assert flops.attention_width == 2 * 4 * (12 + 6) // 2
    assert batch_flops(flops, packed_documents()) == 6 * flops.matmul_weights * 8 + 12 * flops.attention_width * PAIRS


def test_gemma4_counts_each_layers_own_head_size_and_its_active_experts():
    """Gemma 4 keeps the head size per layer (`per_layer_config`: its global layers' `global_head_dim`); its config
    refuses a global `head_dim` read. Its MoE layers add routed experts (`top_k_experts` of `num_experts`) to the
    dense MLP."""
    config = Gemma4TextConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        global_head_dim=16,
        vocab_size=50,
        layer_types=["sliding_attention", "full_attention"],
        hidden_size_per_layer_input=0,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=16,
    )
    flops = model_flops(AutoModelForCausalLM.from_config(config))
    sliding = 32 * 4 * 8 + 2 * 32 * 2 * 8 + 4 * 8 * 32  # q, k and v (2 kv heads), o; heads of 8
    full = 32 * 4 * 16 + 2 * 32 * 2 * 16 + 4 * 16 * 32  # the same with heads of 16
    mlp = 3 * 32 * 64
    router = 32 * 4  # an nn.Linear (its `proj`)
    experts = 4 * (2 * 16 * 32 + 16 * 32)
    lm_head = 50 * 32  # tied: the output layer is counted, the embedding lookup not
    assert flops.matmul_weights == sliding + full + 2 * (mlp + router + experts * 2 // 4) + lm_head
    assert flops.attention_width == 4 * 8 + 4 * 16
    assert batch_flops(flops, packed_documents()) == 6 * flops.matmul_weights * 8 + 12 * flops.attention_width * PAIRS


def test_gpt_oss_counts_its_experts_without_their_biases():
    config = GptOssConfig(
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=50,
        layer_types=["full_attention"],
        tie_word_embeddings=False,
    )
    flops = model_flops(AutoModelForCausalLM.from_config(config))
    attention = 32 * 32 + 2 * 32 * 16 + 32 * 32  # its sinks are one scalar per head: no matmul
    router = 32 * 4
    experts = 4 * (32 * 2 * 16 + 16 * 32)  # gate_up 32 -> 2 × 16, down 16 -> 32; their biases are no matmul
    assert flops.matmul_weights == attention + router + experts * 2 // 4 + 50 * 32


def test_dbrx_counts_its_flat_expert_stacks_at_the_active_share():
    """DBRX stores each expert weight as one 2-D stack (experts × rows, hidden), its expert numbers in ffn_config."""
    config = DbrxConfig(
        d_model=32,
        n_heads=4,
        n_layers=1,
        vocab_size=50,
        max_seq_len=64,
        attn_config={"kv_n_heads": 2, "rope_theta": 1e4, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": 16, "moe_num_experts": 4, "moe_top_k": 2},
    )
    flops = model_flops(AutoModelForCausalLM.from_config(config))
    attention = 32 * (32 + 2 * 2 * 8) + 32 * 32  # Wqkv: q and 2 kv heads of 8 for k and v; out_proj
    router = 32 * 4
    experts = 3 * 4 * 16 * 32  # w1, v1, w2: 4 experts × 16 rows × 32
    assert flops.matmul_weights == attention + router + experts * 2 // 4 + 50 * 32


def test_gpt2_counts_its_conv1d_projections():
    """GPT-2's `Conv1D` is a linear layer (its weight transposed), not a convolution."""
    config = GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=50)
    flops = model_flops(AutoModelForCausalLM.from_config(config))
    per_layer = 32 * 3 * 32 + 32 * 32 + 32 * 4 * 32 + 4 * 32 * 32  # c_attn (q, k, v), c_proj, c_fc, mlp c_proj
    assert flops.matmul_weights == 2 * per_layer + 50 * 32
    assert flops.attention_width == 2 * 32


def test_frozen_weights_count_four_times_their_size_per_token():
    """LoRA: a frozen weight takes the forward and its input's gradient (2 + 2 FLOPs per element and token),
    not its own gradient; a trained one all three (6)."""
    from omegaconf import OmegaConf

    from chattune.model.peft.adapters import add_adapters

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        tie_word_embeddings=True,
    )
    model = AutoModelForCausalLM.from_config(config)
    add_adapters(
        model,
        OmegaConf.create(
            {
                "rank": 4,
                "alpha": 8,
                "dropout": 0.0,
                "target_modules": ["q_proj", "v_proj"],
                "use_dora": False,
                "modules_to_save": None,
            }
        ),
    )
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
