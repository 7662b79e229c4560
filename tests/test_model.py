"""The architecture checks refuse models whose logits are not hidden @ output_embedding.T, on the model
itself and on the miniature the builder checks instead of the (possibly unloaded) real model."""

import torch

from chattune.model.architecture_check import check_architecture
from chattune.model.causal_lm import check_output_head
from conftest import tiny_config, tiny_model


def test_plain_heads_are_accepted():
    check_output_head(tiny_model())
    check_output_head(tiny_model(tie_word_embeddings=False))
    check_architecture(tiny_config())
    check_architecture(tiny_config(tie_word_embeddings=False, vocab_size=5000))


def test_scaled_logits_are_accepted():
    """Granite divides its logits by `logits_scaling`: the losses apply it too (tests/test_output_logits.py checks
    the numbers), so the head check accepts it, on the model and on the miniature."""
    check_output_head(tiny_model(model_type="granite", logits_scaling=4.0))
    check_architecture(tiny_config(model_type="granite", logits_scaling=4.0, vocab_size=5000))


def test_the_head_check_is_not_fooled_by_bf16():
    """A bf16 model's logits are a bf16 GEMM: compared in fp32 against our own upcast product they differ by
    bf16 rounding, and a stock model was refused. Scaled logits are accepted in bf16 too."""
    check_output_head(tiny_model().to(torch.bfloat16))
    check_output_head(tiny_model(tie_word_embeddings=False).to(torch.bfloat16))
    check_output_head(tiny_model(model_type="granite", logits_scaling=4.0).to(torch.bfloat16))
