"""Packing tokenized documents into padding-free microbatches of shape (1, N).

Documents are laid back to back in one row. Position ids restart at 0 for every document and
`cu_seqlens` marks the boundaries, so the attention function keeps documents apart. Labels are already
shifted per document (labels[i] is the token position i predicts) and the last position of every
document is IGNORE_INDEX: no token is trained to predict across a document boundary.

Shared prompts (`Document.shared_prefix`): a pair [prompt + chosen][rejected reply] is two segments, the second
continuing the first's prompt. Its positions start where the prompt ends, and `PackedBatch.prefixes` tells the
attention function which earlier tokens each segment also sees, so that every token's computation equals the
unshared layout's [prompt + chosen][prompt + rejected] while the prompt is computed once. `PackedBatch.shared_keys`
lays the same structure out for one varlen attention call (`SharedKeys`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from chattune.data.documents import IGNORE_INDEX, Document


class SharedKeys(NamedTuple):
    """A row with shared prompts laid out for one varlen attention call with separate query and key offsets: the
    queries are the row's segments (`cu_seqlens`), each segment's keys its prompt's then its own. The varlen kernels
    align a causal mask bottom-right where a segment has more keys than queries, so each reply's query i sees the
    whole prompt and its own first i + 1 keys. Built on the host by the collator (no host sync per layer)."""

    index: torch.Tensor  # (K,) long: the row positions of every segment's keys, back to back
    cu_seqlens_k: torch.Tensor  # (S + 1,) int32: where each segment's keys start in `index`
    max_k: int  # the most keys a segment has


def shared_keys(cu_seqlens: torch.Tensor, prefixes: torch.Tensor) -> SharedKeys:
    """`SharedKeys` of a row from its segment boundaries and its `PackedBatch.prefixes` (both on the host)."""
    bounds, spans = cu_seqlens.tolist(), prefixes.tolist()
    pieces, counts = [], []
    for start, end, (prefix_start, prefix) in zip(bounds[:-1], bounds[1:], spans, strict=True):
        if prefix:
            pieces.append(np.arange(prefix_start, prefix_start + prefix))
        pieces.append(np.arange(start, end))
        counts.append(prefix + end - start)
    cu_seqlens_k = torch.zeros(len(counts) + 1, dtype=torch.int32)
    cu_seqlens_k[1:] = torch.cumsum(torch.tensor(counts), 0)
    return SharedKeys(torch.from_numpy(np.concatenate(pieces).astype(np.int64)), cu_seqlens_k, max(counts))


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # (1, N) long
    labels: torch.Tensor  # (1, N) long, shifted
    position_ids: torch.Tensor  # (1, N) long, restarting at 0 per document
    cu_seqlens: torch.Tensor  # (num_segments + 1,) int32
    max_seqlen: int
    # Built on the CPU by the collator, so per-segment and per-document sums on the GPU need no
    # repeat_interleave over device lengths (a host sync per microbatch).
    segment_ids: torch.Tensor  # (N,) long: each token's segment (cu_seqlens entry)
    document_ids: torch.Tensor  # (N,) long: each token's document of doc_ids (padding: len(doc_ids))
    doc_ids: list[int] = field(default_factory=list)
    doc_lengths: list[int] = field(default_factory=list)  # tokens of each document, in order
    doc_sources: list[int] = field(default_factory=list)  # data source of each document
    # The documents' declared values (`Document.token_values`, `doc_values`) by name: per token (1, N) float32,
    # padding 0; per document, in doc_ids order.
    token_values: dict[str, torch.Tensor] = field(default_factory=dict)
    doc_values: dict[str, list[float]] = field(default_factory=dict)
    padding: int = 0  # tokens of the padding segment (always last), if any
    # Shared prompts: (S, 2) int64 on the host, each segment's (row offset, length) of the earlier tokens it also
    # attends to, before its own (length 0: none); None where no segment of the row continues another.
    prefixes: torch.Tensor | None = None
    # The same for a varlen kernel (`SharedKeys`), where prefixes is not None (`to` builds it where absent).
    shared_keys: SharedKeys | None = None
    epoch: int = 0  # the epoch its documents belong to
    ends_epoch: bool = False  # the last microbatch of its rank's share of that epoch

    @property
    def num_trainable_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    @property
    def num_document_tokens(self) -> int:
        """Tokens of real documents (padding excluded)."""
        return self.num_tokens - self.padding

    def to(self, device: torch.device | str) -> PackedBatch:
        device = torch.device(device)
        # To CUDA from pinned memory: from pageable memory the copy would wait for the kernels already queued
        # (the previous microbatch's backward), leaving the device idle while the host queues the next forward.
        pinned = device.type == "cuda"

        def moved(tensor: torch.Tensor) -> torch.Tensor:
            if pinned and tensor.device.type == "cpu" and not tensor.is_pinned():
                tensor = tensor.pin_memory()
            return tensor.to(device, non_blocking=True)

        keys = self.keys_of_shared_prompts() if self.prefixes is not None else None
        return PackedBatch(
            input_ids=moved(self.input_ids),
            labels=moved(self.labels),
            position_ids=moved(self.position_ids),
            cu_seqlens=moved(self.cu_seqlens),
            max_seqlen=self.max_seqlen,
            segment_ids=moved(self.segment_ids),
            document_ids=moved(self.document_ids),
            doc_ids=self.doc_ids,
            doc_lengths=self.doc_lengths,
            doc_sources=self.doc_sources,
            token_values={name: moved(values) for name, values in self.token_values.items()},
            doc_values=self.doc_values,
            padding=self.padding,
            epoch=self.epoch,
            ends_epoch=self.ends_epoch,
            prefixes=self.prefixes,  # read on the host by the attention function (its loop over segments)
            shared_keys=SharedKeys(moved(keys.index), moved(keys.cu_seqlens_k), keys.max_k) if keys else None,
        )

    def keys_of_shared_prompts(self) -> SharedKeys:
        """`shared_keys`, built from the host's prefixes and boundaries where the batch was made without it."""
        if self.prefixes is None:
            raise ValueError("a row without shared prompts has no shared keys")
        return self.shared_keys if self.shared_keys is not None else shared_keys(self.cu_seqlens.cpu(), self.prefixes)

    @property
    def shared_prompt_tokens(self) -> int:
        """Tokens the shared prompts saved: each continuing segment's prefix, computed once instead of again."""
        return 0 if self.prefixes is None else int(self.prefixes[:, 1].sum())


def collate_packed(
    documents: list[Document], pad_to_multiple_of: int | None = None, pad_token_id: int = 0
) -> PackedBatch:
    """One (1, N) row. With `pad_to_multiple_of`, N is rounded up by a padding segment of its own: its
    own entry in cu_seqlens (so no real token attends to it) and IGNORE_INDEX labels (never trained)."""
    if not documents:
        raise ValueError("cannot collate an empty list of documents")
    if pad_to_multiple_of:
        padding = -sum(len(d) for d in documents) % pad_to_multiple_of
        if padding:
            documents = documents + [_padding(padding, pad_token_id)]
    lengths = [n for d in documents for n in d.segment_lengths]
    if any(sum(d.segment_lengths) != len(d) for d in documents):
        raise ValueError("a document's segments must add up to its length")
    starts, prefixes = _segment_starts(documents)
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(torch.tensor(lengths), 0)
    token_values, doc_values = _declared_values(documents)
    return PackedBatch(
        input_ids=torch.from_numpy(np.concatenate([d.input_ids for d in documents], dtype=np.int64)).unsqueeze(0),
        labels=torch.from_numpy(np.concatenate([d.labels for d in documents], dtype=np.int64)).unsqueeze(0),
        position_ids=_positions(lengths, starts).unsqueeze(0),
        cu_seqlens=cu_seqlens,
        max_seqlen=max(lengths),
        segment_ids=torch.from_numpy(np.repeat(np.arange(len(lengths)), lengths)),
        document_ids=torch.from_numpy(np.repeat(np.arange(len(documents)), [len(d) for d in documents])),
        doc_ids=[d.doc_id for d in documents if d.doc_id >= 0],
        doc_lengths=[len(d) for d in documents if d.doc_id >= 0],
        doc_sources=[d.source for d in documents if d.doc_id >= 0],
        token_values=token_values,
        doc_values=doc_values,
        padding=sum(len(d) for d in documents if d.doc_id < 0),
        prefixes=prefixes,
        shared_keys=shared_keys(cu_seqlens, prefixes) if prefixes is not None else None,
    )


def _segment_starts(documents: list[Document]) -> tuple[list[int] | None, torch.Tensor | None]:
    """Each segment's first position, and the row's `PackedBatch.prefixes` (None where no document shares a
    prompt): a continuing segment starts at its prompt's end and sees the prompt, the first segment's first tokens."""
    if not any(d.shared_prefix for d in documents):
        return None, None  # (every segment from 0: the plain row, no work added to it)
    starts, spans, offset = [], [], 0
    for d in documents:
        shared = d.shared_prefix
        if shared and (len(d.segment_lengths) < 2 or shared >= d.segment_lengths[0]):
            raise ValueError(
                f"document {d.doc_id}: a shared prompt of {shared} tokens needs a first segment longer than it "
                f"and a segment after it (segments {d.segment_lengths})"
            )
        for index in range(len(d.segment_lengths)):
            continues = shared and index > 0
            starts.append(shared if continues else 0)
            spans.append((offset, shared) if continues else (0, 0))
        offset += len(d)
    return starts, torch.tensor(spans, dtype=torch.int64)


def _declared_values(documents: list[Document]) -> tuple[dict[str, torch.Tensor], dict[str, list[float]]]:
    """The documents' per-token values back to back (padding: 0) and their per-document values, by name. A
    document without a name the others have is refused: a value missing is not a value of 0."""
    real = [d for d in documents if d.doc_id >= 0]
    token_names = sorted({name for d in real for name in d.token_values})
    doc_names = sorted({name for d in real for name in d.doc_values})
    for d in real:
        missing = [n for n in token_names if n not in d.token_values] + [n for n in doc_names if n not in d.doc_values]
        if missing:
            raise ValueError(f"document {d.doc_id} has no value {missing}, which other documents of its batch have")
        wrong = [n for n in token_names if len(d.token_values[n]) != len(d)]
        if wrong:
            raise ValueError(f"document {d.doc_id}: token values {wrong} are not one per token ({len(d)} tokens)")
    tokens = {
        name: torch.from_numpy(
            np.concatenate(
                [d.token_values[name] if d.doc_id >= 0 else np.zeros(len(d)) for d in documents], dtype=np.float32
            )
        ).unsqueeze(0)
        for name in token_names
    }
    return tokens, {name: [float(d.doc_values[name]) for d in real] for name in doc_names}


def _positions(lengths: list[int], first: list[int] | None = None) -> torch.Tensor:
    """s, s+1, ..., s+n-1 for each length n and first position s (0 where `first` is None), back to back."""
    lengths_array = np.asarray(lengths, dtype=np.int64)
    starts = np.cumsum(lengths_array) - lengths_array
    positions = np.arange(int(lengths_array.sum()), dtype=np.int64) - np.repeat(starts, lengths_array)
    if first is not None:
        positions += np.repeat(np.asarray(first, dtype=np.int64), lengths_array)
    return torch.from_numpy(positions)


def _padding(length: int, pad_token_id: int) -> Document:
    """Tokens that are no document (doc_id -1) and train nothing."""
    return Document(doc_id=-1, input_ids=np.full(length, pad_token_id), labels=np.full(length, IGNORE_INDEX))


def empty_batch(pad_token_id: int) -> PackedBatch:
    """A one-token microbatch with nothing to train: lets a rank without data still run forward/backward,
    so every rank makes the same collective calls and none waits forever."""
    return collate_packed([_padding(1, pad_token_id)])


def best_fit_decreasing(documents: list[Document], max_tokens: int) -> list[list[Document]]:
    """Pack documents into bins of at most `max_tokens` tokens: longest first, each into the fullest bin
    it still fits (the first created among equally full ones; a new bin when none fits). Bins are
    returned in creation order, documents in a bin in insertion order."""
    bins: list[list[Document]] = []
    rooms: list[tuple[int, int]] = []  # (free tokens, bin index) of every bin, sorted
    for doc in sorted(documents, key=len, reverse=True):
        size = len(doc)
        if size > max_tokens:
            raise ValueError(f"document {doc.doc_id} has {size} tokens, more than the budget {max_tokens}")
        at = bisect.bisect_left(rooms, (size, -1))  # the least room that still fits, earliest bin first
        if at < len(rooms):
            room, best = rooms.pop(at)
            bins[best].append(doc)
            bisect.insort(rooms, (room - size, best))
        else:
            bins.append([doc])
            bisect.insort(rooms, (max_tokens - size, len(bins) - 1))
    return bins
