"""What a model does to `hidden @ output_embedding.T` before its logits: scaling and soft-capping.

The losses never build a model's full logits (`chattune.model.head.chunked_loss`, `chattune.model.head.fused_loss`), so
they must apply what the model's own forward applies after its output layer:
- Granite (and its MoE and hybrid variants) divides the logits by `config.logits_scaling`;
- Cohere / Command-R multiplies them by `config.logit_scale`;
- Gemma 2, 3 and 4 soft-cap them where `config.final_logit_softcapping` is set: cap × tanh(logits / cap);
  RecurrentGemma always, at `config.logits_soft_cap` (30 by default), and xLSTM where its
  `config.output_logit_soft_cap` is set (30 by default), the same way.

A policy trained on its own samples (the GRPO recipe) scores them at the temperature they were drawn at:
`at_temperature(t)` divides the model's logits by t last, as transformers' sampling does.

`LogitTransform.from_config` reads these from the (text) config; `check_output_head` then verifies on a
miniature that hidden @ W.T transformed this way is what the model's forward returns, so a model that does
something else is refused rather than trained differently.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

# The config attributes that soft-cap the logits, by family: Gemma 2/3/4, RecurrentGemma, xLSTM.
SOFTCAPS = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap")


@dataclass(frozen=True)
class LogitTransform:
    multiplier: float = 1.0  # Cohere's logit_scale
    divisor: float = 1.0  # Granite's logits_scaling (divided, as Granite's forward does: bit for bit)
    softcap: float | None = None  # Gemma's final_logit_softcapping, RecurrentGemma's and xLSTM's caps
    temperature: float = 1.0  # the sampling temperature a policy's samples are scored at (last, after the cap)

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> LogitTransform:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        return cls(
            multiplier=float(getattr(text, "logit_scale", None) or 1.0),
            divisor=float(getattr(text, "logits_scaling", None) or 1.0),
            softcap=next((cap for name in SOFTCAPS if (cap := getattr(text, name, None))), None),
        )

    def at_temperature(self, temperature: float) -> LogitTransform:
        """This transform, the logits then divided by `temperature` (> 0)."""
        if not temperature > 0:
            raise ValueError(f"a temperature must be positive, got {temperature}")
        return dataclasses.replace(self, temperature=float(temperature))

    @property
    def is_identity(self) -> bool:
        return self.multiplier == 1.0 and self.divisor == 1.0 and self.softcap is None and self.temperature == 1.0

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """The model's logits from hidden @ W.T, in the order its forward applies the operations."""
        if self.multiplier != 1.0:
            logits = logits * self.multiplier
        if self.divisor != 1.0:
            logits = logits / self.divisor
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if self.temperature != 1.0:
            logits = logits / self.temperature
        return logits

    def describe(self) -> str:
        """For the start-up `compute:` line ('' where the head is plain)."""
        parts = []
        if self.multiplier != 1.0:
            parts.append(f"logits × {self.multiplier:g}")
        if self.divisor != 1.0:
            parts.append(f"logits / {self.divisor:g}")
        if self.softcap is not None:
            parts.append(f"soft-capped at {self.softcap:g}")
        if self.temperature != 1.0:
            parts.append(f"at temperature {self.temperature:g}")
        return ", ".join(parts)
