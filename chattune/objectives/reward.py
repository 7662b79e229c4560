"""The reward-model objective for the shared update step: Bradley–Terry on packed preference pairs; the unit is
the pair.

A pair is one packed document of two segments, chosen then rejected (`chattune.data.templates.pair_documents`), so a
microbatch holds whole pairs: segment 2k is pair k's chosen side, 2k+1 its rejected one, and a padding segment,
if any, comes last. A side's reward is the score head's value (`chattune.model.sequence_score`) at the side's last
token: the last token of the conversation as `apply_chat_template` renders it, after the reply's end-of-turn token
and whatever the template writes after it (ChatML's newline). That is where Hugging Face's sequence classification
reads a rendered conversation (its last token that is not padding), and where TRL's RewardTrainer trains it: a
chattune reward model scores `apply_chat_template(conversation)` as it was trained to, in any stock pipeline.

Per pair, with r the rewards and m the pair's margin: -log σ(r_chosen - r_rejected - m), plus
c (r_chosen + r_rejected)² with c = loss.center_rewards_coefficient (TRL's `center_rewards_coefficient`: it keeps
rewards near 0, which the difference alone leaves free). The margin is read from the data, as TRL's RewardTrainer
reads its `margin` column: the record's `margin` field (`chattune.data.templates.pair_documents.RewardPairDocuments`,
carried as the documents' declared value `margin` to `PackedBatch.doc_values`); a pair without one has m = 0. The metrics do not see
it: the accuracy is still the fraction of pairs with r_chosen > r_rejected. The sum over a microbatch's pairs is
divided by the step's pair count over all ranks by the update step (`chattune.train.step`), so the gradient is that
of the mean over every pair of the step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from chattune.data.documents import IGNORE_INDEX
from chattune.data.packing import PackedBatch
from chattune.data.templates.pair_documents import PAIR_MARGIN
from chattune.distributed import host_values_on
from chattune.objectives.base import Objective, objective_loss
from chattune.objectives.source_figures import source_figures


def pair_margins(batch: PackedBatch, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    """The margin of each pair of the microbatch (its declared value `PAIR_MARGIN`: 0 for a pair whose record gives
    none) on `device`, copied without waiting for the device; None where the pairs declare none."""
    margins = batch.doc_values.get(PAIR_MARGIN)
    return None if margins is None else host_values_on(device, margins, dtype)


def side_end_positions(batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions in the packed row of each pair's chosen and rejected sides' last tokens (one entry per pair)."""
    pairs = len(batch.doc_ids)
    ends = batch.cu_seqlens[1 : 2 * pairs + 1].long() - 1
    return ends[0::2], ends[1::2]


def bradley_terry_losses(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    center_rewards_coefficient: float = 0.0,
    margins: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each pair's loss: -log σ(r_chosen - r_rejected - m) + c (r_chosen + r_rejected)², m the pair's margin (None:
    0 for every pair)."""
    difference = chosen - rejected
    if margins is not None:
        difference = difference - margins
    losses = -F.logsigmoid(difference)
    if center_rewards_coefficient:
        losses = losses + center_rewards_coefficient * (chosen + rejected).square()
    return losses


class RewardObjective(Objective):
    unit_name = "preference pair"

    def __init__(self, center_rewards_coefficient: float = 0.0, num_sources: int = 1):
        """`num_sources`: a mixture's sources, for the per-source sums the mixer reads
        (`chattune.data.ingest.mixing_policy`)."""
        self.center_rewards_coefficient = center_rewards_coefficient
        self.num_sources = num_sources

    def count_units(self, batch: PackedBatch) -> int:
        return len(batch.doc_ids)

    def rewards(self, model: nn.Module, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(chosen rewards, rejected rewards) of the microbatch's pairs, and the scores of every position."""
        scores = model(batch)
        chosen_ends, rejected_ends = side_end_positions(batch)
        return scores[chosen_ends], scores[rejected_ends], scores

    def loss_sum(self, model: nn.Module, batch: PackedBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        chosen, rejected, scores = self.rewards(model, batch)
        margins = pair_margins(batch, chosen.device, chosen.dtype)
        losses = bradley_terry_losses(chosen, rejected, self.center_rewards_coefficient, margins)
        # 0 * (every score) keeps a microbatch without pairs (an empty one) in the autograd graph: every rank must
        # run backward through every forward, since FSDP reduces gradients in those hooks.
        loss = losses.sum() + 0.0 * scores.sum()
        chosen, rejected = chosen.detach(), rejected.detach()
        figures = {
            "rewards_chosen": chosen.sum(),
            "rewards_rejected": rejected.sum(),
            "accuracies": (chosen > rejected).sum(),
            "tokens": (batch.labels != IGNORE_INDEX).sum(),
        }
        if self.num_sources > 1:
            figures.update(source_figures(batch, losses, self.num_sources, doc_units=torch.ones_like(losses)))
        return loss, figures

    def metrics(self, sums: dict[str, float], global_units: int) -> dict[str, float]:
        """Means over every pair of the step (all ranks and microbatches), under DPO's names (`chattune plot`
        draws them alike): the rewards, their margin, and the accuracy, the fraction of pairs whose chosen reward
        beats the rejected one (a tie counts as wrong)."""
        pairs = max(global_units, 1)
        return {
            "loss": objective_loss(sums) / pairs,
            "rewards/chosen": sums["rewards_chosen"] / pairs,
            "rewards/rejected": sums["rewards_rejected"] / pairs,
            "rewards/margins": (sums["rewards_chosen"] - sums["rewards_rejected"]) / pairs,
            "rewards/accuracies": sums["accuracies"] / pairs,
            "num_pairs": global_units,
            "num_tokens": int(sums["tokens"]),
        }
