"""What the model a recipe trains ends in: a causal LM's output layer (SFT, DPO) or a scalar score head (a reward
model). The head decides which transformers class a config or a checkpoint is built as, what its config must
say, and peft's task type; the decoder under it, its packed forward and its sharding are the same for both."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification


@dataclass(frozen=True)
class ModelHead:
    name: str  # for messages
    auto_class: type  # the transformers Auto class a config or a model directory is built with
    config_overrides: dict[str, Any] = field(default_factory=dict)  # set on the model's config before building it
    peft_task_type: str = "CAUSAL_LM"  # peft's name for the task: what its adapter directory says it loads into


CAUSAL_LM_HEAD = ModelHead("causal LM", AutoModelForCausalLM)
# Hugging Face sequence classification with one label: a scalar per sequence, read at its last token. peft's
# SEQ_CLS task trains the score head in full next to the adapters (its `modules_to_save`).
SCORE_HEAD = ModelHead("sequence score", AutoModelForSequenceClassification, {"num_labels": 1}, "SEQ_CLS")
