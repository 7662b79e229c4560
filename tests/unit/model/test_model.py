"""The architecture checks refuse models whose logits are not hidden @ output_embedding.T, on the model
itself and on the miniature the builder checks instead of the (possibly unloaded) real model. Every accepted
case has a twin whose forward scales its logits behind the config's back, which must be refused: a check that
accepted everything would fail here."""

import pytest
import torch
from transformers.models.granite.modeling_granite import GraniteForCausalLM
from transformers.models.llama.modeling_llama import LlamaForCausalLM

from chattune.errors import UnsupportedModel
from chattune.model.causal_lm import check_output_head
from chattune.model.checks.architecture import check_architecture
from conftest import tiny_config, tiny_model

GRANITE = {"model_type": "granite", "logits_scaling": 4.0}


@pytest.fixture
def hidden_scaling(monkeypatch):
    """Make a model class's forward multiply its logits by 1.5, which no config key says (the miniature
    `check_architecture` builds is of that class too)."""

    def patch(model_class) -> None:
        forward = model_class.forward

        def scaled(self, *args, **kwargs):
            output = forward(self, *args, **kwargs)
            output.logits = output.logits * 1.5
            return output

        monkeypatch.setattr(model_class, "forward", scaled)

    return patch


def test_plain_heads_are_accepted_and_a_hidden_scaling_is_refused(hidden_scaling):
    models = [tiny_model(), tiny_model(tie_word_embeddings=False)]
    configs = [tiny_config(), tiny_config(tie_word_embeddings=False, vocab_size=5000)]
    for model in models:
        check_output_head(model)
    for config in configs:
        check_architecture(config)
    hidden_scaling(LlamaForCausalLM)
    for model in models:
        with pytest.raises(UnsupportedModel):
            check_output_head(model)
    for config in configs:
        with pytest.raises(UnsupportedModel):
            check_architecture(config)


def test_scaled_logits_are_accepted_and_another_scaling_is_refused(hidden_scaling):
    """Granite divides its logits by `logits_scaling`: the losses apply it too (tests/unit/model/head/test_output_logits.py checks
    the numbers), so the head check accepts it, on the model and on the miniature; a scaling on top is not."""
    model, config = tiny_model(**GRANITE), tiny_config(**GRANITE, vocab_size=5000)
    check_output_head(model)
    check_architecture(config)
    hidden_scaling(GraniteForCausalLM)
    with pytest.raises(UnsupportedModel):
        check_output_head(model)
    with pytest.raises(UnsupportedModel):
        check_architecture(config)


def test_the_head_check_is_not_fooled_by_bf16(hidden_scaling):
    """A bf16 model's logits are a bf16 GEMM: compared in fp32 against our own upcast product they differ by
    bf16 rounding, and a stock model was refused. Scaled logits are accepted in bf16 too; the bf16 tolerance
    still refuses a scaling the config does not name."""
    models = {
        LlamaForCausalLM: [tiny_model().to(torch.bfloat16), tiny_model(tie_word_embeddings=False).to(torch.bfloat16)],
        GraniteForCausalLM: [tiny_model(**GRANITE).to(torch.bfloat16)],
    }
    for family in models.values():
        for model in family:
            check_output_head(model)
    for model_class, family in models.items():
        hidden_scaling(model_class)
        for model in family:
            with pytest.raises(UnsupportedModel):
                check_output_head(model)
