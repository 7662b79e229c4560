"""What the training data holds: records read, skipped by reason, documents, tokens and the trainable
fraction. `chattune inspect` counts every record; a recipe counts a sample before its first step (summed
over ranks) and the exact figures of each epoch as it closes. One set of names and one wording for all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from chattune.data.documents import IGNORE_INDEX, OVERLONG_COUNTS, SKIP_REASONS, Document, Skipped
from chattune.data.stream import documents_of


@dataclass
class DataReport:
    records: int = 0
    skipped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SKIP_REASONS, 0))
    lengths: list[int] = field(default_factory=list)  # tokens per document
    trainable_tokens: int = 0
    examples: list[Document] = field(default_factory=list)
    overlong: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OVERLONG_COUNTS, 0))
    outcomes: list[int | Skipped] = field(default_factory=list)  # per document: its length, or why skipped
    microbatches: int = 0  # when packed (inspect): microbatches and the tokens in them
    packed_tokens: int = 0
    shared_prompt_tokens: int = 0  # data.share_prompts: the prompt tokens each pair holds once instead of twice
    held_out: str = ""  # what data.eval_split holds out of the sources (`chattune.data.ingest.held_out.held_out_line`)

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def counts(self) -> dict[str, int]:
        """Flat figures, summable over ranks."""
        return {
            "records": self.records,
            "documents": len(self.lengths),
            "tokens": self.tokens,
            "trainable_tokens": self.trainable_tokens,
            "shared_prompt_tokens": self.shared_prompt_tokens,
            **{f"skipped/{r}": n for r, n in self.skipped.items()},
            **{f"overlong/{r}": n for r, n in self.overlong.items()},
        }


def scan_documents(documents, indices: Sequence[int], num_examples: int = 0, batch_records: int = 256) -> DataReport:
    """Tokenize the records at `indices` (a `SFTDocuments`-like source), `batch_records` at a time as the
    training stream does, and count what they give."""
    report = DataReport()
    for document in (
        d
        for start in range(0, len(indices), batch_records)
        for d in documents_of(documents, list(indices[start : start + batch_records]))
    ):
        report.records += isinstance(document, Skipped) or document.piece == 0
        if isinstance(document, Skipped):
            report.skipped[document.reason] += 1
            report.outcomes.append(document)
            continue
        report.outcomes.append(len(document))
        if document.overlong:
            report.overlong[document.overlong] += 1
        report.overlong["split_pieces_left_out"] += document.pieces_left_out
        report.lengths.append(len(document))
        report.trainable_tokens += int(np.count_nonzero(document.labels != IGNORE_INDEX))
        report.shared_prompt_tokens += document.shared_prefix * (len(document.segment_lengths) - 1)
        if len(report.examples) < num_examples:
            report.examples.append(document)
    return report


def count_lines(counts: dict[str, float]) -> list[str]:
    """The figures of `DataReport.counts()` (or their sum over ranks) as report lines."""
    skipped = {name.removeprefix("skipped/"): int(n) for name, n in counts.items() if name.startswith("skipped/")}
    reasons = ", ".join(f"{reason} {n}" for reason, n in skipped.items() if n)
    tokens, left_out = int(counts["tokens"]), int(counts["overlong/split_pieces_left_out"])
    shared = int(counts.get("shared_prompt_tokens", 0))
    saved = f"shared prompts: {shared} tokens not computed again ({shared / max(tokens + shared, 1):.1%} of the unshared tokens)"
    return [
        f"records read: {int(counts['records'])}",
        f"skipped: {sum(skipped.values())}" + (f" ({reasons})" if reasons else ""),
        f"over the budget and kept: truncated {int(counts['overlong/truncated'])}, split {int(counts['overlong/split'])}"
        + (f" ({left_out} of their pieces train nothing: left out)" if left_out else ""),
        f"documents: {int(counts['documents'])}",
        f"tokens: {tokens}",
        f"trainable tokens: {int(counts['trainable_tokens'])} ({counts['trainable_tokens'] / max(tokens, 1):.1%})",
        *([saved] if shared else []),
    ]


def report_sample(num_records: int, size: int | None, seed: int) -> list[int]:
    """The records a start-of-training report reads: `size` of them at random (all when None or more)."""
    order = torch.randperm(num_records, generator=torch.Generator().manual_seed(seed))
    return order[: size if size is not None else num_records].tolist()


def epoch_line(counts: dict[str, float], budget: int) -> str:
    """An epoch's figures over all ranks (`StepFeed` counts summed), as one log line."""
    fill = counts["tokens"] / max(counts["microbatches"] * budget, 1)
    return (
        f"{int(counts['documents'])} documents, {int(counts['tokens'])} tokens, {int(counts['trainable_tokens'])} "
        f"trainable, {int(counts['microbatches'])} microbatches (fill {fill:.1%})"
    )
