"""The packed model wrapper refuses models whose logits are not hidden @ output_embedding.T."""

import pytest
from conftest import tiny_model

from chattune.model.causal_lm import PackedCausalLM


def test_plain_heads_are_accepted():
    PackedCausalLM(tiny_model())
    PackedCausalLM(tiny_model(tie_word_embeddings=False))


def test_scaled_logits_are_refused():
    """Granite divides its logits by `logits_scaling`; the chunked loss would silently train another model."""
    with pytest.raises(NotImplementedError, match="computes its logits differently"):
        PackedCausalLM(tiny_model(model_type="granite", logits_scaling=4.0))
