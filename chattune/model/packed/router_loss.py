"""The router's load-balancing loss of mixture-of-experts models, per document of a packed row.

A MoE model of transformers (Mixtral, Qwen3-MoE, gpt-oss, OLMoE, Granite-MoE, Jamba, ...) adds
`router_aux_loss_coef × load_balancing_loss_func(router_logits, num_experts, num_experts_per_tok)` to its
loss when `output_router_logits` is set: Switch Transformer's E × Σ_e f_e P_e, with f_e the share of the
(token, layer) routings that pick expert e and P_e its mean router probability. Both are means over every
token of the forward, so the stock value depends on which sequences share a batch, and a packed row's value
on which documents share the row.

chattune's definition keeps packing's rule that a document is trained as if it were alone: each document's
load-balancing loss is the model's own function (the `load_balancing_loss_func` of its modeling module, with
its own expert counts) on that document's router logits alone, which is what stock transformers computes for
the document run alone. A document's value weighs as many loss units as it holds (trainable tokens for SFT, a
pair's two sequences half each for DPO), and the step divides by the step's global unit count like every
other loss term (`chattune.train.step`): the router loss of a step is the mean over its loss units of their
document's load-balancing loss, times the coefficient. It depends neither on how the step is split into
microbatches and ranks nor on how documents are packed. (transformers' per-forward value over a whole padded
batch would depend on both; so would a per-step f_e, whose all-reduce would also have to precede every
backward.)

Only the training forward adds it (evaluation reports the objective's own loss), and it is logged apart as
`router_loss` (the coefficient-weighted term added to the loss).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from chattune.errors import UserError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterLoss:
    coefficient: float
    num_experts: int
    top_k: int
    balance: Callable  # the model's own load_balancing_loss_func(gate_logits, num_experts, top_k)

    def per_document(self, router_logits: tuple[torch.Tensor, ...], cu_seqlens: list[int]) -> torch.Tensor:
        """coefficient × the load-balancing loss of each segment [cu_seqlens[i], cu_seqlens[i+1]) alone, (S,)
        fp32. `router_logits`: one (N, E) tensor per MoE layer, N the packed row's tokens."""
        losses = []
        for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
            gate_logits = tuple(layer[start:end] for layer in router_logits)
            losses.append(
                torch.as_tensor(
                    self.balance(gate_logits, self.num_experts, self.top_k),
                    dtype=torch.float32,
                    device=router_logits[0].device,
                )
            )
        return self.coefficient * torch.stack(losses)

    def describe(self) -> str:
        return f"router load-balancing loss × {self.coefficient:g} (per document, {self.top_k} of {self.num_experts} experts)"


def router_loss_for(hf_model: PreTrainedModel, setting: float | None) -> RouterLoss | None:
    """The run's router loss: `setting` is loss.router_aux_coef (None: the model's own choice, its
    `router_aux_loss_coef` where its config sets `output_router_logits`; 0: off). None where off."""
    config = hf_model.config.get_text_config()
    coefficient = setting
    if coefficient is None:
        coefficient = float(
            getattr(hf_model, "router_aux_loss_coef", getattr(config, "router_aux_loss_coef", 0.0)) or 0.0
        )
        if not getattr(config, "output_router_logits", False):
            coefficient = 0.0
    if coefficient == 0.0:
        return None
    balance = getattr(sys.modules[type(hf_model).__module__], "load_balancing_loss_func", None)
    num_experts = getattr(hf_model, "num_experts", None)
    top_k = getattr(hf_model, "num_experts_per_tok", None)
    if balance is None or not num_experts or not top_k:
        message = (
            f"{type(hf_model).__name__} has no router load-balancing loss in transformers (no "
            "load_balancing_loss_func with num_experts and num_experts_per_tok)"
        )
        if setting is not None:
            raise UserError(
                f"loss.router_aux_coef={setting}: {message}; set loss.router_aux_coef=0 (or leave it unset)"
            )
        logger.warning("%s, although its config sets output_router_logits: trained without one", message)
        return None
    return RouterLoss(float(coefficient), int(num_experts), int(top_k), balance)


def segment_units(
    batch_labels: torch.Tensor, segment_ids: torch.Tensor, num_segments: int, ignore_index: int
) -> torch.Tensor:
    """Trainable tokens per segment of a packed row, (S,) fp32: SFT's loss units."""
    trained = (batch_labels.reshape(-1) != ignore_index).to(torch.float32)
    return torch.zeros(num_segments, dtype=torch.float32, device=trained.device).index_add(
        0, segment_ids.to(trained.device), trained
    )
