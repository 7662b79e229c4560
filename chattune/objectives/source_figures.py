"""Per-source figures of a microbatch: what a mixture's metrics and online mixing read
(`chattune.data.ingest.mixing_policy`), summed from the per-document losses an objective has already computed."""

from __future__ import annotations

import torch

from chattune.data.documents import IGNORE_INDEX
from chattune.data.packing import PackedBatch
from chattune.distributed import host_values_on


def document_sums(batch: PackedBatch, per_token: torch.Tensor) -> torch.Tensor:
    """Sums of a per-token value over each document of the microbatch (padding excluded)."""
    num_docs = len(batch.doc_lengths)
    sums = torch.zeros(num_docs + 1, dtype=torch.float64, device=per_token.device)  # + padding, dropped
    return sums.index_add(0, batch.document_ids.to(per_token.device), per_token.double())[:num_docs]


def source_figures(
    batch: PackedBatch, doc_losses: torch.Tensor, num_sources: int, doc_units: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Per-source sums of one microbatch (documents, trainable tokens, loss units, summed loss), from
    per-document losses the objective has already computed: no extra forward. `doc_units`: each
    document's loss units (None: its trainable tokens). The same keys for every microbatch (zeros where a
    source is absent), so ranks can all-reduce them stacked."""
    device = doc_losses.device
    sources = host_values_on(device, batch.doc_sources, torch.long)
    doc_tokens = document_sums(batch, (batch.labels[0] != IGNORE_INDEX).to(device))
    doc_units = doc_tokens if doc_units is None else doc_units

    def per_source(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(num_sources, dtype=torch.float64, device=device).index_add(0, sources, values.double())

    sums = {
        "documents": per_source(torch.ones(len(sources), device=device)),
        "tokens": per_source(doc_tokens),
        "units": per_source(doc_units.detach()),
        "loss": per_source(doc_losses.detach()),
    }
    return {f"source_{name}/{k}": values[k] for name, values in sums.items() for k in range(num_sources)}
