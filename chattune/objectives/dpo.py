"""The DPO objective for the shared update step: the unit is the preference pair.

A pair is one packed document of two segments, chosen then rejected (`chattune.data.templates.pair_documents`), so a
microbatch holds whole pairs: segment 2k is pair k's chosen reply in context, 2k+1 its rejected one,
and a padding segment, if any, comes last. Per-pair log-probabilities are sums of the chunked loss's
per-token values over each segment's trained positions (the final reply and its end-of-turn token):
no full logits, no second forward of the policy.

The reference log-probabilities come from a frozen reference model run under no_grad on the same
packed microbatch (`LiveReference`), or from a table computed once before training (`CachedReference`,
see `chattune.objectives.reference_cache`); reference-free losses need neither.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from chattune.data.documents import IGNORE_INDEX
from chattune.data.packing import PackedBatch
from chattune.distributed import reduce_sums
from chattune.hub import hub_id
from chattune.model.peft.adapters import BaseModelView
from chattune.objectives.base import Objective, model_losses, objective_loss
from chattune.objectives.pair_losses import PreferenceLoss
from chattune.objectives.source_figures import source_figures
from chattune.parallel.fsdp import reshard


def pair_logps(token_losses: torch.Tensor, batch: PackedBatch) -> tuple[torch.Tensor, ...]:
    """(chosen log-probs, rejected log-probs, chosen tokens, rejected tokens), one entry per pair."""
    num_segments = batch.cu_seqlens.shape[0] - 1
    segment = batch.segment_ids.to(token_losses.device)
    logps = torch.zeros(num_segments, dtype=token_losses.dtype, device=token_losses.device)
    logps = logps.index_add(0, segment, -token_losses)
    trained = (batch.labels[0] != IGNORE_INDEX).to(token_losses.dtype)
    tokens = torch.zeros(num_segments, dtype=token_losses.dtype, device=token_losses.device).index_add(
        0, segment, trained
    )
    pairs = len(batch.doc_ids)
    return logps[0 : 2 * pairs : 2], logps[1 : 2 * pairs : 2], tokens[0 : 2 * pairs : 2], tokens[1 : 2 * pairs : 2]


class Reference(Protocol):
    def __call__(self, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]: ...


class LiveReference:
    """A frozen reference model (sharded like the policy) run on the same packed microbatch.

    A reference of its own is resharded after each forward: FSDP2 leaves a root unit gathered after a
    forward (only a backward reshards it), and a reference never runs one, so its embeddings and output
    layer would otherwise stay gathered on every rank for the whole run. A view of the policy's base
    (LoRA, `BaseModelView`) is not: it shares the policy's root, gathered for the policy's own backward."""

    def __init__(self, model: nn.Module | BaseModelView):
        self.model = model.eval().requires_grad_(False)

    @torch.no_grad()
    def __call__(self, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        chosen, rejected, _, _ = pair_logps(self.model(batch), batch)
        if not isinstance(self.model, BaseModelView):
            reshard(self.model)
        return chosen, rejected


class CachedReference:
    """Reference log-probs looked up by record index in a table made before training."""

    def __init__(self, table: torch.Tensor):
        self.table = table  # (num_records, 2) float64: chosen, rejected; NaN where never computed

    def __call__(self, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.table[torch.tensor(batch.doc_ids, dtype=torch.long)]
        if torch.isnan(rows).any():
            raise RuntimeError(f"the reference cache has no entry for some of records {batch.doc_ids}")
        device = batch.input_ids.device
        rows = rows.float()
        if device.type == "cuda":  # from pinned memory: a pageable copy would wait for every kernel queued before it
            rows = rows.pin_memory().to(device, non_blocking=True)
        return rows[:, 0].to(device), rows[:, 1].to(device)


def is_initial_policy(reference_path: str | None, model_path: str | None, quantized_base: bool = False) -> bool:
    """Whether the reference (reference.path) is the policy as training starts: none given (the initial policy,
    or with LoRA the policy's base with its adapters off, which is the policy while its B matrices are zero, as
    peft initialises them), or the policy's own model.path, read at the policy's precision (not where the
    policy's base is quantized, `quantized_base`: a reference.path is loaded whole)."""
    if reference_path is None:
        return True
    if model_path is None or quantized_base:
        return False
    if hub_id(reference_path) is not None or hub_id(model_path) is not None:
        return reference_path == model_path
    return Path(reference_path).resolve() == Path(model_path).resolve()


class PreferenceObjective(Objective):
    unit_name = "preference pair"

    def __init__(
        self, loss: PreferenceLoss, reference: Reference | None, num_sources: int = 1, reference_is_start: bool = False
    ):
        """`reference_is_start`: the reference is the policy as training starts (`is_initial_policy`), so the
        held-out metrics before the first step are known without a forward (`known_start_metrics`)."""
        if loss.needs_reference and reference is None:
            raise ValueError(f"loss.type={loss.loss_type!r} needs reference log-probs (a reference model or cache)")
        self.loss, self.reference = loss, reference
        self.num_sources = (
            num_sources  # a mixture's sources: per-source sums for the mixer (chattune.data.ingest.mixing_policy)
        )
        self.reference_is_start = reference_is_start
        # ORPO's NLL term is averaged over the step's chosen tokens, not its pairs: the step's loss is divided by
        # its pairs, so that term is weighed by pairs / chosen tokens of the whole step (`begin_step`). None:
        # outside a training step (evaluation reports the loss from its sums, `metrics`).
        self.pairs_per_chosen_token: torch.Tensor | None = None

    def count_units(self, batch: PackedBatch) -> int:
        return len(batch.doc_ids)

    def count_step_extras(self, batch: PackedBatch) -> list[int]:
        """What the loss is normalised by besides the pairs, counted over the step with them: the chosen replies'
        trained tokens for a loss with a chosen-NLL term (ORPO). Counted on the host, where the batch was built."""
        if not self.loss.row.chosen_nll:
            return []
        chosen = (batch.segment_ids % 2 == 0) & (batch.segment_ids < 2 * len(batch.doc_ids))
        return [int(((batch.labels[0] != IGNORE_INDEX) & chosen).sum())]

    def begin_step(
        self, global_units: torch.Tensor, global_extras: torch.Tensor, global_statistics: torch.Tensor | None = None
    ) -> None:
        """The step's counts over all ranks (on the device, not read back: no host sync)."""
        if self.loss.row.chosen_nll:
            self.pairs_per_chosen_token = global_units.double() / global_extras[0].clamp(min=1).double()

    def loss_sum(self, model: nn.Module, batch: PackedBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        token_losses, router_losses = model_losses(model, batch)
        chosen, rejected, chosen_tokens, rejected_tokens = pair_logps(token_losses, batch)
        ref_chosen, ref_rejected = self.reference(batch) if self.loss.needs_reference else (None, None)
        losses, chosen_reward, rejected_reward = self.loss(
            chosen, rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens
        )
        # 0 * (all token losses) keeps a microbatch without pairs (an empty one) in the autograd graph: every
        # rank must run backward through every forward, since FSDP reduces gradients in those hooks.
        loss = losses.sum() + 0.0 * token_losses.sum()
        figures: dict[str, torch.Tensor] = {}
        if self.loss.row.chosen_nll:  # ORPO: the chosen replies' NLL, per chosen token of the step
            nll = -chosen.sum()
            weight = self.pairs_per_chosen_token
            loss = loss + (nll * weight.to(nll.dtype) if weight is not None else nll)
            figures = {
                "pair_loss": losses.detach().sum(),
                "nll_chosen": nll.detach(),
                "tokens_chosen": chosen_tokens.sum(),
            }
        figures |= {
            "rewards_chosen": chosen_reward.sum(),
            "rewards_rejected": rejected_reward.sum(),
            "accuracies": (chosen_reward > rejected_reward).sum(),
            "logps_chosen": chosen.detach().sum(),
            "logps_rejected": rejected.detach().sum(),
            "tokens": chosen_tokens.sum() + rejected_tokens.sum(),
        }
        if router_losses is not None:  # a pair: the mean of its two sequences' router losses
            pairs = len(batch.doc_ids)
            router = 0.5 * (router_losses[0 : 2 * pairs : 2] + router_losses[1 : 2 * pairs : 2]).sum()
            loss, figures["router_loss"] = loss + router, router.detach()
        if self.num_sources > 1:
            figures.update(source_figures(batch, losses, self.num_sources, doc_units=torch.ones_like(losses)))
        return loss, figures

    def known_start_metrics(self, batches: list[PackedBatch], device: torch.device) -> dict[str, float] | None:
        """Collective: the metrics of `batches` (all ranks') before the first step, where the reference is the
        initial policy, without running the model: every reward is 0 (so the margins, and the accuracy, which
        counts pairs whose chosen reward beats the rejected one), the loss is the loss type's at margin 0
        (`PreferenceLoss.loss_without_preference`), and the pairs and tokens are counted. The policy's
        log-probs are the reference's: with cached ones (`CachedReference`) they are read from its table, with
        a live reference they would need its forward and are left out. None where the figures are not known
        in advance (another reference, simpo, an SFT term)."""
        loss = self.loss.loss_without_preference()
        if not self.reference_is_start or loss is None:
            return None
        sums = {"pairs": 0.0, "tokens": 0.0, "logps_chosen": 0.0, "logps_rejected": 0.0}
        for batch in batches:
            sums["pairs"] += self.count_units(batch)
            sums["tokens"] += int((batch.labels != IGNORE_INDEX).sum())
            if isinstance(self.reference, CachedReference) and batch.doc_ids:
                chosen, rejected = self.reference(batch)
                sums["logps_chosen"] += float(chosen.double().sum())
                sums["logps_rejected"] += float(rejected.double().sum())
        sums = reduce_sums(sums, device)
        pairs = int(sums["pairs"])
        figures = {
            "loss_sum": loss * pairs,
            "rewards_chosen": 0.0,
            "rewards_rejected": 0.0,
            "accuracies": 0.0,
            "logps_chosen": sums["logps_chosen"],
            "logps_rejected": sums["logps_rejected"],
            "tokens": sums["tokens"],
        }
        metrics = self.metrics(figures, pairs)
        if not isinstance(self.reference, CachedReference):
            del metrics["logps/chosen"], metrics["logps/rejected"]
        return metrics

    def metrics(self, sums: dict[str, float], global_units: int) -> dict[str, float]:
        """Means over every pair of the step (all ranks and microbatches); accuracies is the fraction of
        pairs whose chosen reward beats the rejected one (not a comparison of mean rewards)."""
        pairs = max(global_units, 1)
        router = {"router_loss": sums["router_loss"] / pairs} if "router_loss" in sums else {}
        chosen_nll = {}
        loss = objective_loss(sums) / pairs
        if "nll_chosen" in sums:  # ORPO: its two parts, each over its own unit (the loss above holds them weighed)
            nll = sums["nll_chosen"] / max(sums["tokens_chosen"], 1.0)
            chosen_nll = {"nll_loss": nll, "odds_ratio_loss": sums["pair_loss"] / pairs}
            loss = chosen_nll["odds_ratio_loss"] + nll  # as trained; also where no step weighed it (evaluation)
        return {
            "loss": loss,
            **router,
            **chosen_nll,
            "rewards/chosen": sums["rewards_chosen"] / pairs,
            "rewards/rejected": sums["rewards_rejected"] / pairs,
            "rewards/margins": (sums["rewards_chosen"] - sums["rewards_rejected"]) / pairs,
            "rewards/accuracies": sums["accuracies"] / pairs,
            "logps/chosen": sums["logps_chosen"] / pairs,
            "logps/rejected": sums["logps_rejected"] / pairs,
            "num_pairs": global_units,
            "num_tokens": int(sums["tokens"]),
        }
