"""The packing probe: a model whose layers let packed documents see each other (convolutions, SSMs,
linear attention: anything that ignores cu_seqlens) is refused at start-up; ordinary softmax-attention
models pass. An independent check confirms the verdict on real demo documents' token losses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers import CONFIG_MAPPING

from chattune.data.documents import IGNORE_INDEX, Document, shifted_labels
from chattune.data.packing import collate_packed
from chattune.model.checks.packing_probe import ALONE_TOLERANCE, SWAP_TOLERANCE, check_packing_isolation, probe_packing
from chattune.model.packed import isolation
from chattune.model.packed.mixers import MIXERS, isolate_documents
from conftest import demo_documents, tiny_config, tiny_model

# Softmax attention only. Windows shorter than the probe's documents, so the windowed path is probed too.
ORDINARY = {
    "llama": {},
    "qwen2": {"model_type": "qwen2"},
    "qwen3": {"model_type": "qwen3"},
    "mistral_window": {"model_type": "mistral", "sliding_window": 4},
    "phi3_window": {"model_type": "phi3", "sliding_window": 4},
    "gemma": {"model_type": "gemma"},
    "gemma3_window": {
        "model_type": "gemma3_text",
        "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "smollm3": {"model_type": "smollm3"},
    "olmo2": {"model_type": "olmo2"},
    "qwen3_moe": {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "lfm2_attention_only": {"model_type": "lfm2", "layer_types": ["full_attention", "full_attention"]},
}

SMALL_MAMBA2 = {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_chunk_size": 16}
# (overrides, a module class the message must name). Torch fallback paths: no mamba_ssm / causal_conv1d.
# chattune keeps their mixers per document (`chattune.model.packed.mixers`): the probe accepts them, and refuses them
# with the mixers over the whole row (`isolation.leaking(MIXERS)`), as it refuses a mixer chattune does not handle.
HYBRID = {
    "lfm2": ({"model_type": "lfm2", "layer_types": ["conv", "full_attention"]}, "Lfm2ShortConv"),
    # The smallest leak: a conv after the last attention reaches only the first 2 tokens after a boundary.
    "lfm2_conv_last": ({"model_type": "lfm2", "layer_types": ["full_attention", "conv"]}, "Lfm2ShortConv"),
    "lfm2_moe": (
        {
            "model_type": "lfm2_moe",
            "layer_types": ["conv", "full_attention"],
            "num_dense_layers": 1,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
        },
        "Lfm2MoeShortConv",
    ),
    "falcon_h1": (
        {
            "model_type": "falcon_h1",
            "mamba_d_ssm": 128,
            "mamba_n_heads": 8,
            "mamba_d_head": 16,
            "mamba_d_state": 16,
            "head_dim": 16,
        },
        "FalconH1Mixer",
    ),
    "bamba": ({"model_type": "bamba", "attn_layer_indices": [1], **SMALL_MAMBA2}, "BambaMixer"),
    "granitemoehybrid": (
        {
            "model_type": "granitemoehybrid",
            "layer_types": ["mamba", "attention"],
            **SMALL_MAMBA2,
            "num_local_experts": 4,
            "shared_intermediate_size": 64,
        },
        "GraniteMoeHybridMambaLayer",
    ),
    "jamba": (
        {
            "model_type": "jamba",
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "expert_layer_period": 2,
            "expert_layer_offset": 1,
            "num_experts": 4,
        },
        "JambaMambaMixer",
    ),
    "lfm3": ({"model_type": "lfm3", "layer_types": ["conv", "full_attention"], "head_dim": 16}, "Lfm3ShortConv"),
    "mamba2": (
        {"model_type": "mamba2", "num_heads": 8, "head_dim": 16, "n_groups": 1, "state_size": 16, "chunk_size": 16},
        "Mamba2Mixer",
    ),
    "nemotron_h": (
        {
            "model_type": "nemotron_h",
            "layers_block_type": ["mamba", "attention"],
            "head_dim": 16,
            "mamba_num_heads": 8,
            "mamba_head_dim": 16,
            "n_groups": 1,
            "ssm_state_size": 16,
            "chunk_size": 16,
            "n_routed_experts": 4,
            "moe_intermediate_size": 32,
            "moe_shared_expert_intermediate_size": 32,
        },
        "NemotronHMamba2Mixer",
    ),
    "zamba": (
        {
            "model_type": "zamba",
            "num_hidden_layers": 5,
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "n_mamba_heads": 2,
            "mamba_d_state": 16,
        },
        "ZambaMambaMixer",
    ),
    "zamba2": (
        {
            "model_type": "zamba2",
            "layers_block_type": ["mamba", "hybrid"],
            "n_mamba_heads": 4,
            "mamba_d_state": 16,
            "chunk_size": 16,
            "adapter_rank": 8,
        },
        "Zamba2MambaMixer",
    ),
    "kimi_linear": (
        {
            "model_type": "kimi_linear",
            "layer_types": ["linear_attention", "full_attention"],
            "linear_head_dim": 16,
            "linear_num_heads": 4,
            "kv_lora_rank": 32,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
        },
        "KimiLinearDeltaAttention",
    ),
}
# Gated delta rule (whose torch path in transformers refuses cu_seqlens without flash-linear-attention).
GATED_DELTA_NET = {
    "layer_types": ["linear_attention", "full_attention"],
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}
HYBRID.update(
    {
        "qwen3_next": (
            {
                "model_type": "qwen3_next",
                "head_dim": 16,
                **GATED_DELTA_NET,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 32,
            },
            "Qwen3NextGatedDeltaNet",
        ),
        "qwen3_5": ({"model_type": "qwen3_5_text", "head_dim": 16, **GATED_DELTA_NET}, "Qwen3_5GatedDeltaNet"),
        "olmo_hybrid": ({"model_type": "olmo_hybrid", **GATED_DELTA_NET}, "OlmoHybridGatedDeltaNet"),
    }
)
# The recurrent families: their layers pass the mixers no document boundaries (pure Mamba-1, RWKV), or their forwards
# take more than hidden states or return their state (MiniMax's lightning attention, RecurrentGemma): the decoder's
# hook hands the mixers the boundaries (`chattune.model.packed.mixers`).
HYBRID.update(
    {
        "minimax": (
            {
                "model_type": "minimax",
                "layer_types": ["linear_attention", "full_attention"],
                "head_dim": 16,
                "num_local_experts": 4,
                "block_size": 16,
            },
            "MiniMaxLightningAttention",
        ),
        "mamba": ({"model_type": "mamba", "state_size": 16}, "MambaMixer"),
        "falcon_mamba": ({"model_type": "falcon_mamba", "state_size": 16}, "FalconMambaMixer"),
        "recurrent_gemma": (
            {
                "model_type": "recurrent_gemma",
                "lru_width": 64,
                "attention_window_size": 16,
                "block_types": ["recurrent", "attention"],
                "head_dim": 16,
                "num_key_value_heads": 1,
            },
            "RecurrentGemmaRglru",
        ),
        "rwkv": ({"model_type": "rwkv", "attention_hidden_size": 64, "context_length": 128}, "RwkvSelfAttention"),
    }
)
# Mixers chattune does not handle: Zaya's (its CCA projection holds a convolution over the whole row). Still refused.
UNHANDLED = {"zaya": ({"model_type": "zaya", "num_experts": 4, "num_experts_per_tok": 1}, "ZayaCCAProjection")}


@pytest.mark.parametrize("name", ORDINARY)
def test_ordinary_models_pass(name):
    model = tiny_model(**ORDINARY[name])
    result = probe_packing(model)
    # Same shapes and offsets, another document before B: a dense model computes B bit for bit the same
    # (MoE routing of the other documents regroups expert matmuls: rounding only).
    if "moe" in name:
        assert result.swapped.max_relative <= SWAP_TOLERANCE / 10, result
    else:
        assert result.swapped.max_relative == 0, result
    assert result.noise.max_relative <= 1e-5 and result.alone.max_relative <= 1e-5, result  # fp32 rounding
    assert result.isolated
    check_packing_isolation(model)


def skip_if_absent(overrides: dict) -> None:
    """Architectures newer than the installed transformers (lfm3 is not in 5.17) are skipped, named."""
    model_type = overrides.get("model_type", "llama")
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"{model_type} is not in transformers {transformers.__version__}")


@pytest.mark.parametrize("name", HYBRID)
def test_hybrid_models_pass_with_their_mixers_per_document(name):
    overrides, mixer = HYBRID[name]
    skip_if_absent(overrides)
    model = tiny_model(**overrides)
    result = probe_packing(model)
    assert result.swapped.max_relative <= SWAP_TOLERANCE / 10 and result.alone.max_relative <= 1e-5, result
    check_packing_isolation(model)
    # The leak control: the same mixers over the whole row are refused, and named.
    with (
        isolation.leaking(MIXERS),
        pytest.raises(NotImplementedError, match="does not keep packed documents apart") as refusal,
    ):
        check_packing_isolation(model)
    message = str(refusal.value)
    assert mixer in message and "document B changes by up to" in message and "not supported" in message, message
    with isolation.leaking(MIXERS):  # orders of magnitude above the tolerance even with random weights
        assert probe_packing(model).swapped.max_relative > 30 * SWAP_TOLERANCE


@pytest.mark.parametrize("name", UNHANDLED)
def test_mixers_chattune_does_not_handle_are_refused(name):
    overrides, mixer = UNHANDLED[name]
    model = tiny_model(**overrides)
    with pytest.raises(NotImplementedError, match="does not keep packed documents apart") as refusal:
        check_packing_isolation(model)
    message = str(refusal.value)
    assert mixer in message and "document B changes by up to" in message and "not supported" in message, message
    assert probe_packing(model).swapped.max_relative > 30 * SWAP_TOLERANCE


def test_the_lfm2_message_says_what_and_why():
    """The message a mixer chattune does not keep per document gets (LFM2's, with the handling off)."""
    model = tiny_model(model_type="lfm2", layer_types=["conv", "full_attention"])
    with isolation.leaking(MIXERS), pytest.raises(NotImplementedError) as refusal:
        check_packing_isolation(model)
    message = str(refusal.value)
    for part in (
        "Lfm2ForCausalLM does not keep packed documents apart",
        "Lfm2ShortConv x1",
        "config.layer_types: conv x1, full_attention x1",
        "ignore the document boundaries (cu_seqlens)",
        "let every document see the ones before it",
        "packing cannot be turned off",
        "not supported",
    ):
        assert part in message, message


def packed_token_losses(model, docs) -> list[torch.Tensor]:
    """Per-token losses of each document, all in one packed row as chattune trains them."""
    batch = collate_packed(docs)
    isolate_documents(model)  # as chattune's packed forward does (`packed_hidden_states`)
    with torch.no_grad():
        logits = (
            model(
                input_ids=batch.input_ids,
                position_ids=batch.position_ids,
                use_cache=False,
                cu_seq_lens_q=batch.cu_seqlens,
                cu_seq_lens_k=batch.cu_seqlens,
                max_length_q=batch.max_seqlen,
                max_length_k=batch.max_seqlen,
            )
            .logits[0]
            .float()
        )
    return list(
        F.cross_entropy(logits, batch.labels[0], ignore_index=IGNORE_INDEX, reduction="none").split(batch.doc_lengths)
    )


def plain_token_losses(model, docs) -> list[torch.Tensor]:
    """Per-token losses of each document on its own, the plain Hugging Face way: no packing arguments."""
    losses = []
    with torch.no_grad():
        for doc in docs:
            logits = model(input_ids=torch.tensor([doc.input_ids.tolist()]), use_cache=False).logits[0].float()
            losses.append(
                F.cross_entropy(logits, torch.tensor(doc.labels), ignore_index=IGNORE_INDEX, reduction="none")
            )
    return losses


@pytest.mark.parametrize("name", ["llama", "lfm2", "falcon_h1", "minimax", "rwkv", "zaya"])
def test_verdict_matches_real_token_losses(name):
    """Independent of the probe's documents and measure: the training loss of real demo conversations,
    packed as chattune trains them vs each document alone in the same model with stock SDPA attention.
    Unchanged for what the probe accepts, changed after a boundary for what it refuses."""
    overrides = ORDINARY[name] if name in ORDINARY else {**HYBRID, **UNHANDLED}[name][0]
    model = tiny_model(**overrides).eval()
    plain = tiny_model(**overrides).eval()  # same seed, same weights
    plain.set_attn_implementation("sdpa")
    # Every next token trained: assistant-only labels can miss the tokens right after a boundary.
    docs = [
        Document(d.doc_id, d.input_ids, shifted_labels(d.input_ids.tolist(), [True] * len(d)))
        for d in demo_documents(3)
    ]
    differences = [
        float((p - a).abs().max()) for p, a in zip(packed_token_losses(model, docs), plain_token_losses(plain, docs))
    ]
    assert differences[0] <= 1e-5  # nothing before the first document: the same either way
    if name not in UNHANDLED:
        check_packing_isolation(model)
        assert max(differences) <= 1e-5, differences
    else:
        with pytest.raises(NotImplementedError):
            check_packing_isolation(model)
        assert min(differences[1:]) > 3e-5, differences


class TokenShift(nn.Module):
    """Adds a small part of the previous token's input to each token's MLP output, across any boundary:
    a leak like a short convolution's, in a module whose name gives nothing away."""

    def __init__(self, mlp: nn.Module, strength: float):
        super().__init__()
        self.mlp, self.strength = mlp, strength

    def forward(self, x):
        return self.mlp(x) + self.strength * F.pad(x, (0, 0, 1, 0))[:, :-1]


def test_a_small_unnamed_leak_is_refused():
    model = tiny_model()
    model.model.layers[1].mlp = TokenShift(model.model.layers[1].mlp, strength=1e-5)
    with pytest.raises(NotImplementedError, match="No module looks like a convolution") as refusal:
        check_packing_isolation(model)
    assert "document B changes by up to" in str(refusal.value)
    assert probe_packing(model).alone.max_relative < ALONE_TOLERANCE  # only the swap sees a leak this small


def test_positions_that_do_not_restart_are_refused():
    """Not a leak of content (the swap sees nothing), but packed != alone: GPT-2's learned absolute
    positions, given positions counted over the whole row. (Rotary models would not mind: a shift of all
    positions of a document changes no attention score.)"""
    model = tiny_model(model_type="gpt2")

    def row_positions(module, args, kwargs):
        kwargs["position_ids"] = torch.arange(kwargs["input_ids"].shape[1]).unsqueeze(0)
        return args, kwargs

    model.transformer.register_forward_pre_hook(row_positions, with_kwargs=True)
    result = probe_packing(model)
    assert result.swapped.max_relative == 0 and result.noise.max_relative <= 1e-5  # A starts at position 0 anyway
    assert result.alone.max_relative > 10 * ALONE_TOLERANCE
    with pytest.raises(NotImplementedError, match="document B packed after A differs from B alone") as refusal:
        check_packing_isolation(model)
    assert "No module looks like" in str(refusal.value)


class RefusesRows(nn.Module):
    """A layer that refuses packed rows, as transformers' gated delta rule did without flash-linear-attention."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        if x.shape[1] > 16:  # a packed row of the probe (one document alone, as stock transformers runs it: fine)
            raise ValueError("can't keep packed sequences apart")
        return self.mlp(x)


def test_a_failing_packed_forward_is_refused():
    """A model whose packed forward raises is refused with that reason at start-up, not a crash at the first step."""
    model = tiny_model()
    model.model.layers[1].mlp = RefusesRows(model.model.layers[1].mlp)
    with pytest.raises(
        NotImplementedError, match="cannot run chattune's packed forward.*apart.*not supported"
    ) as refusal:
        check_packing_isolation(model)
    assert isinstance(refusal.value.__cause__, ValueError)


@pytest.mark.parametrize("training", [True, False])
def test_training_mode_is_restored(training):
    accepted, refused = tiny_model(), tiny_model(**UNHANDLED["zaya"][0])
    accepted.train(training), refused.train(training)
    check_packing_isolation(accepted)
    with pytest.raises(NotImplementedError):
        check_packing_isolation(refused)
    for model in (accepted, refused):
        assert all(module.training == training for module in model.modules())


ALL_ARCHITECTURES = {
    **{name: (overrides, True) for name, overrides in ORDINARY.items()},
    **{name: (overrides, True) for name, (overrides, _) in HYBRID.items()},
    **{name: (overrides, False) for name, (overrides, _) in UNHANDLED.items()},
}


@pytest.mark.parametrize("name", ALL_ARCHITECTURES)
def test_the_miniature_gives_the_full_models_verdict(name):
    """The builder checks a random-init miniature of the config (first layers, vocabulary cut to 1024), not
    the model it loads shard by shard: every architecture above gets the verdict its full model gets."""
    from chattune.model.checks.architecture import check_architecture

    overrides, accepted = ALL_ARCHITECTURES[name]
    skip_if_absent(overrides)
    config = tiny_config(**{"vocab_size": 5000, **overrides})  # larger than the miniature's vocabulary
    if accepted:
        check_architecture(config)
    else:
        with pytest.raises(NotImplementedError):
            check_architecture(config)


def test_the_miniature_keeps_a_late_kind_of_layer():
    """Six layers, the one convolution last: the miniature keeps all six (every kind the config lists),
    so the leak is found (the convolution over the whole row); without the convolution two layers suffice."""
    from chattune.model.checks.architecture import check_architecture, miniature_config

    leaky = tiny_config(model_type="lfm2", num_hidden_layers=6, layer_types=["full_attention"] * 5 + ["conv"])
    assert miniature_config(leaky).num_hidden_layers == 6
    with isolation.leaking(MIXERS), pytest.raises(NotImplementedError, match="Lfm2ShortConv"):
        check_architecture(leaky)
    check_architecture(leaky)  # per document, as chattune runs it
    plain = tiny_config(model_type="lfm2", num_hidden_layers=6, layer_types=["full_attention"] * 6)
    assert miniature_config(plain).num_hidden_layers == 2
    check_architecture(plain)


def test_a_config_that_stock_transformers_cannot_run_is_the_users_to_fix():
    """More experts per token than experts: transformers' own forward fails on one document, so the message says the
    config is wrong, not that chattune cannot pack the model."""
    from transformers import AutoConfig

    from chattune.errors import UserError
    from chattune.model.checks.architecture import check_architecture

    config = AutoConfig.for_model(
        "qwen3_moe", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=8, head_dim=16,
    )  # fmt: skip
    with pytest.raises(
        UserError,
        match=r"Qwen3MoeForCausalLM fails in stock transformers on a single document with this config, in forward \(qwen3_moe/modeling_qwen3_moe.py, line \d+: `.*torch.topk.*`\): RuntimeError: .*: the config is wrong",
    ):
        check_architecture(config)
    config.num_experts_per_tok = 2  # the control: accepted
    check_architecture(config)
