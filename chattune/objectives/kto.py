"""KTO (Ethayarajh et al. 2024; TRL's `KTOTrainer`) for the shared update step: the unit is the example, one prompt
with one completion labelled desirable or undesirable.

An example is one packed document of two segments (`chattune.data.templates.kto_documents`): the example itself, then a
*mismatched* sequence, its prompt followed by another example's completion (its partner: the same side of the next
record). Segment 2k is example k, 2k+1 its mismatched sequence. With r = log π(y|x) - log π_ref(y|x) (summed over
the completion's tokens) and z the reference point:

    desirable:   w_d (1 - σ(β (r - z)))        undesirable:   w_u (1 - σ(β (z - r)))

z is KTO's estimate of KL(π || π_ref): the mean over the step's mismatched sequences of their log-ratio, clamped at
0 and detached (no gradient flows through it). TRL averages it over one device batch (each process's mean, then
those means unweighted); here it is a **step-level** quantity: before the step's first backward, a no-grad pass over all its
microbatches (`step_statistics`) sums the mismatched log-ratios, the update step all-reduces that sum with the
step's example count in its one all-reduce (`begin_step`), and every microbatch's loss then uses the same z. So
the gradient does not depend on how a step is split into microbatches and ranks. An evaluation does the same over
the whole held-out set (`chattune.train.evaluation`).

Each pass runs only the segments it needs (`segment_batch`, built on the host): the no-grad pass the mismatched
sequences, the training forward/backward the examples (`trained_part`). The reference runs once, on whole documents,
in the first pass, and its log-probs of the examples are kept until their microbatch's loss. Per step that is the
work of TRL's KTO step: a policy forward of the mismatched sequences, a forward and backward of the examples, a
reference forward of both.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import torch
from torch import nn

from chattune.data.documents import IGNORE_INDEX, Document
from chattune.data.packing import PackedBatch, collate_packed
from chattune.data.templates.kto_documents import KTO_LABEL
from chattune.distributed import host_values_on
from chattune.objectives.base import Objective, model_losses, objective_loss
from chattune.objectives.dpo import Reference
from chattune.objectives.source_figures import source_figures


def kto_losses(
    logratios: torch.Tensor, desirable: torch.Tensor, reference_point: torch.Tensor, weights: KTOWeights
) -> torch.Tensor:
    """Each example's loss: w_d (1 - σ(β (r - z))) where desirable, w_u (1 - σ(β (z - r))) where not."""
    beta = weights.beta
    desired = weights.desirable * (1 - torch.sigmoid(beta * (logratios - reference_point)))
    undesired = weights.undesirable * (1 - torch.sigmoid(beta * (reference_point - logratios)))
    return torch.where(desirable, desired, undesired)


class KTOWeights:
    """KTO's settings: β, and the weights of desirable and undesirable examples (TRL's `desirable_weight`,
    `undesirable_weight`: the paper advises w_d n_d / (w_u n_u) in [1, 4/3] where the classes are unbalanced)."""

    def __init__(self, beta: float = 0.1, desirable: float = 1.0, undesirable: float = 1.0):
        self.beta, self.desirable, self.undesirable = beta, desirable, undesirable


def segment_batch(
    batch: PackedBatch, segment: int, pad_to_multiple_of: int | None = None, pad_token_id: int = 0
) -> PackedBatch:
    """A microbatch of documents of two segments reduced to one of them (0: each example, 1: its mismatched
    sequence), on the host: one segment per document, in order, with the documents' records, sources and labels, its
    row padded again to `pad_to_multiple_of` (data.pad_to_multiple_of: static shapes for compiled layers). A
    microbatch without documents (an empty one: padding only) is kept as it is."""
    if not batch.doc_ids:
        return batch
    bounds = batch.cu_seqlens.tolist()
    ids, labels = batch.input_ids[0].numpy(), batch.labels[0].numpy()
    pieces = [(bounds[2 * k + segment], bounds[2 * k + segment + 1]) for k in range(len(batch.doc_ids))]
    documents = [
        Document(doc_id, ids[start:end], labels[start:end], source=source)
        for doc_id, source, (start, end) in zip(batch.doc_ids, batch.doc_sources, pieces)
    ]
    return replace(
        collate_packed(documents, pad_to_multiple_of, pad_token_id),
        doc_values=batch.doc_values,
        epoch=batch.epoch,
        ends_epoch=batch.ends_epoch,
    )


def segment_logps(token_losses: torch.Tensor, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob, trained tokens) of each document of a one-segment-per-document microbatch (`segment_batch`)."""
    segment = batch.segment_ids.to(token_losses.device)
    num_segments = batch.cu_seqlens.shape[0] - 1
    zeros = torch.zeros(num_segments, dtype=token_losses.dtype, device=token_losses.device)
    logps = zeros.index_add(0, segment, -token_losses)
    tokens = zeros.index_add(0, segment, (batch.labels[0] != IGNORE_INDEX).to(token_losses.dtype))
    documents = len(batch.doc_ids)
    return logps[:documents], tokens[:documents]


def _records(batch: PackedBatch) -> tuple[int, tuple[int, ...]]:
    """What identifies a microbatch within a step: its epoch and records (a record is once in an epoch)."""
    return batch.epoch, tuple(batch.doc_ids)


class KTOObjective(Objective):
    unit_name = "example"

    def __init__(
        self,
        weights: KTOWeights,
        reference: Reference,
        num_sources: int = 1,
        padding: tuple[int | None, int] = (None, 0),
    ):
        """`num_sources`: a mixture's sources (per-source sums for the mixer); `padding`: (data.pad_to_multiple_of,
        the pad token id), with which the rows of each pass (`segment_batch`) are padded as the stream pads rows."""
        self.weights, self.reference, self.num_sources, self.padding = weights, reference, num_sources, padding
        self.reference_point: torch.Tensor | None = None  # z of the current step (or evaluation), on the device
        # Each microbatch's reference log-probs of its examples from the step's first pass, by its records.
        self._reference_logps: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}

    def count_units(self, batch: PackedBatch) -> int:
        return len(batch.doc_ids)

    def trained_part(self, batch: PackedBatch) -> PackedBatch:
        """What the training forward runs of a microbatch (on the host): its examples, not their mismatched
        sequences, whose only use is the reference point (`step_statistics`)."""
        return segment_batch(batch, 0, *self.padding)

    @torch.no_grad()
    def step_statistics(
        self, model: nn.Module, microbatches: Iterable[PackedBatch], device: torch.device
    ) -> torch.Tensor:
        """The sum of the mismatched sequences' log-ratios (policy - reference) over `microbatches` (this rank's
        share of the step, on the host), as a (1,) float64 tensor on `device`. Runs the policy without gradients on
        the mismatched sequences, and the reference on whole documents, once per microbatch: its log-probs of the
        examples are kept for `loss_sum`."""
        self._reference_logps = {}
        total = torch.zeros((), dtype=torch.float64, device=device)
        for batch in microbatches:
            mismatched_batch = segment_batch(batch, 1, *self.padding).to(device)
            policy, _ = segment_logps(model(mismatched_batch), mismatched_batch)
            examples, mismatched = self.reference(batch.to(device))
            if batch.doc_ids:
                self._reference_logps[_records(batch)] = examples
            total = total + (policy.double() - mismatched.double()).sum()
        return total.reshape(1)

    def begin_step(
        self, global_units: torch.Tensor, global_extras: torch.Tensor, global_statistics: torch.Tensor | None = None
    ) -> None:
        """z = max(0, the mean mismatched log-ratio over every example of the step, all ranks), detached."""
        self.reference_point = (global_statistics[0] / global_units.double().clamp(min=1)).clamp(min=0).detach()

    def loss_sum(self, model: nn.Module, batch: PackedBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self.reference_point is None:
            raise RuntimeError("KTO's loss needs its step's reference point: run step_statistics and begin_step first")
        token_losses, router_losses = model_losses(model, batch)  # `batch`: the examples alone (`trained_part`)
        policy, tokens = segment_logps(token_losses, batch)
        if batch.doc_ids and _records(batch) not in self._reference_logps:
            raise RuntimeError(f"no reference log-probs for records {batch.doc_ids}: step_statistics runs first")
        reference = self._reference_logps.pop(_records(batch)) if batch.doc_ids else torch.zeros_like(policy)
        logratios = policy - reference.to(policy.dtype)
        labels = batch.doc_values.get(KTO_LABEL, [])  # (declared by every example: `KTODocuments`)
        desirable = host_values_on(policy.device, [label == 1.0 for label in labels], torch.bool)
        z = self.reference_point.to(policy.dtype)
        losses = kto_losses(logratios, desirable, z, self.weights)
        # 0 * (all token losses): a microbatch without examples (an empty one) still runs backward, as FSDP needs.
        loss = losses.sum() + 0.0 * token_losses.sum()
        rewards = self.weights.beta * logratios.detach()
        zero = torch.zeros_like(rewards)
        figures = {
            "desirable": desirable.sum(),
            "rewards_chosen": torch.where(desirable, rewards, zero).sum(),
            "rewards_rejected": torch.where(desirable, zero, rewards).sum(),
            "logps_chosen": torch.where(desirable, policy.detach(), zero).sum(),
            "logps_rejected": torch.where(desirable, zero, policy.detach()).sum(),
            "tokens": tokens.sum(),
            "kl": z.detach() * len(batch.doc_ids),  # z is the step's: summed per example, its mean is z again
        }
        if router_losses is not None:  # an example: its own sequence's router loss
            router = router_losses[: len(batch.doc_ids)].sum()
            loss, figures["router_loss"] = loss + router, router.detach()
        if self.num_sources > 1:
            figures.update(source_figures(batch, losses, self.num_sources, doc_units=torch.ones_like(losses)))
        return loss, figures

    def metrics(self, sums: dict[str, float], global_units: int) -> dict[str, float]:
        """Means over the step's examples (all ranks and microbatches): the loss and the reference point z (`kl`);
        the rewards β r and log-probs of the desirable examples (`*/chosen`) over those, of the undesirable ones
        (`*/rejected`) over those; their margin is the difference of the two means (no example has both). The mean
        of a kind the step has no example of is 0."""
        examples = max(global_units, 1)
        desirable = sums["desirable"]
        undesirable = global_units - desirable
        router = {"router_loss": sums["router_loss"] / examples} if "router_loss" in sums else {}
        chosen = sums["rewards_chosen"] / max(desirable, 1)
        rejected = sums["rewards_rejected"] / max(undesirable, 1)
        return {
            "loss": objective_loss(sums) / examples,
            **router,
            "kl": sums["kl"] / examples,
            "rewards/chosen": chosen,
            "rewards/rejected": rejected,
            "rewards/margins": chosen - rejected,
            "logps/chosen": sums["logps_chosen"] / max(desirable, 1),
            "logps/rejected": sums["logps_rejected"] / max(undesirable, 1),
            "num_examples": global_units,
            "num_desirable": int(desirable),
            "num_tokens": int(sums["tokens"]),
        }
