"""Models that scale or soft-cap their logits after the output layer train exactly: Gemma 2's final-logit
soft-capping, Granite's `logits_scaling`, Cohere / Command-R's `logit_scale`. One packed row of documents
gives the per-token losses and gradients of stock transformers run on each document alone, through the
chunked fp32 head and cut-cross-entropy's torch implementation; the control drops the transform and fails.
A head the config does not describe is still refused."""

from __future__ import annotations

import copy

import pytest
import torch
from test_hybrid_models import compare_with_stock, random_documents, relative

from chattune.errors import UnsupportedModel
from chattune.model.causal_lm import PackedCausalLM, check_output_head
from chattune.model.checks.architecture import check_architecture
from chattune.model.head.output_logits import LogitTransform
from conftest import tiny_config, tiny_model

# Random-init logits are small (|logit| ~ 0.1-0.5): a cap of 0.1 bends most of them.
FAMILIES = {
    "gemma2": {"model_type": "gemma2", "head_dim": 16, "final_logit_softcapping": 0.1, "attn_logit_softcapping": None},
    # both of Gemma 2's soft-caps: the attention's (tests/unit/model/packed/test_attention_features.py) and the output's
    "gemma2_both": {
        "model_type": "gemma2",
        "head_dim": 16,
        "final_logit_softcapping": 0.1,
        "attn_logit_softcapping": 0.5,
    },
    "granite": {"model_type": "granite", "logits_scaling": 4.0},
    "cohere": {"model_type": "cohere", "logit_scale": 3.0},
    "cohere2": {"model_type": "cohere2", "logit_scale": 0.5, "head_dim": 16},
}
LENGTHS = (37, 12, 29)


def packed_and_stock(overrides: dict, implementation: str = "chunked", transform: LogitTransform | None = None):
    model = tiny_model(**overrides)
    stock = copy.deepcopy(model)
    stock.set_attn_implementation("eager")  # transformers' own attention (Gemma 2 has no SDPA path)
    packed = PackedCausalLM(model, loss_chunk_size=32, loss_implementation=implementation)
    if transform is not None:
        packed.logit_transform = transform
    return compare_with_stock(packed, stock, random_documents(model.config.vocab_size, LENGTHS))


@pytest.mark.parametrize("implementation", ["chunked", "cut_cross_entropy"])
@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.launch
def test_scaled_or_capped_logits_train_exactly(name, implementation):
    overrides = FAMILIES[name]
    assert not LogitTransform.from_config(tiny_model(**overrides).config).is_identity
    check_architecture(tiny_config(**overrides))  # accepted by the start-up checks
    losses, reference, grads = packed_and_stock(overrides, implementation)
    trained = reference != 0
    assert float(((losses - reference).abs()[trained] / reference[trained]).max()) <= 1e-5
    worst = max(grads, key=lambda g: relative(g[1], g[2]))
    assert relative(worst[1], worst[2]) <= 1e-4, (worst[0], relative(worst[1], worst[2]))


@pytest.mark.parametrize("name", FAMILIES)
def test_control_without_the_transform_differs(name):
    losses, reference, grads = packed_and_stock(FAMILIES[name], transform=LogitTransform())
    assert relative(losses, reference) > 1e-3  # 100 times the tolerance of the exactness test
    worst = max(grads, key=lambda g: relative(g[1], g[2]))
    assert relative(worst[1], worst[2]) > 1e-2


class _DoubledHead(torch.nn.Linear):
    """An output layer whose forward does what no config key says (a stand-in for an unknown architecture)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(hidden)


def test_a_head_the_config_does_not_describe_is_refused():
    for overrides in ({}, FAMILIES["granite"]):
        model = tiny_model(tie_word_embeddings=False, **overrides)
        doubled = _DoubledHead(model.lm_head.in_features, model.lm_head.out_features, bias=False)
        doubled.weight = model.lm_head.weight
        model.lm_head = doubled
        with pytest.raises(UnsupportedModel, match="computes its logits differently"):
            check_output_head(model)


class _BiasLeftOut(torch.nn.Linear):
    """An output layer that has a bias and leaves it out of its logits."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.weight)


def test_a_head_bias_is_added_not_refused():
    """An output layer with a bias is trained with it (tests/unit/model/head/test_output_bias.py); one whose forward leaves its
    bias out is refused (the check sets the bias to random values: at zero, the two would agree)."""
    model = tiny_model(tie_word_embeddings=False, model_type="granite", logits_scaling=4.0)
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(model.lm_head.out_features))
    check_output_head(model)
    unbiased = _BiasLeftOut(model.lm_head.in_features, model.lm_head.out_features)
    unbiased.weight, unbiased.bias = model.lm_head.weight, model.lm_head.bias
    model.lm_head = unbiased
    with pytest.raises(UnsupportedModel, match=r"output_embedding.T \+ its bias followed by"):
        check_output_head(model)
