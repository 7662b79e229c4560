"""Each rank's stream of packed microbatches, epoch after epoch.

Every epoch draws one seeded permutation of all record indices (the same on every rank) and rank r
takes positions r, r + world, r + 2*world, ...: the ranks' shares are disjoint, cover every record and
need no communication. A rank tokenizes only its own share, a buffer of records at a time, and packs
each buffer best-fit-decreasing into token-budget microbatches. The least-filled bin of a buffer is not
emitted but carried into the next buffer, where its documents get another chance to fill a bin (a
half-empty microbatch costs a whole step on the rank that holds it). Nothing is dropped at the end of an
epoch: the last buffer's bins, carried ones included, are emitted before the next epoch begins.

The stream's position (epoch, records consumed, carried documents, bins not yet emitted) is kept in
`state_dict()`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Protocol

import torch

from chattune.packing import Document, PackedBatch, best_fit_decreasing, collate_packed, empty_batch

logger = logging.getLogger(__name__)


class DocumentSource(Protocol):
    def __len__(self) -> int: ...

    def get(self, index: int) -> Document | None: ...


def epoch_share(num_records: int, epoch: int, seed: int, rank: int, world_size: int, shuffle: bool = True) -> list[int]:
    """The record indices rank `rank` trains on in `epoch`."""
    if shuffle:
        order = torch.randperm(num_records, generator=torch.Generator().manual_seed(seed + epoch))
    else:
        order = torch.arange(num_records)
    return order[rank::world_size].tolist()


class PackedStream:
    def __init__(
        self,
        documents: DocumentSource,
        rank: int,
        world_size: int,
        seed: int,
        max_tokens: int,
        pad_token_id: int,
        buffer_records: int = 256,
        shuffle: bool = True,
        num_epochs: int | None = None,
    ):
        if num_epochs is None and len(documents) < world_size:
            raise ValueError(f"{len(documents)} records cannot be shared by {world_size} ranks")
        self.documents = documents
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.max_tokens, self.pad_token_id = max_tokens, pad_token_id
        self.buffer_records, self.shuffle, self.num_epochs = buffer_records, shuffle, num_epochs
        self.epoch = 0
        self.position = 0  # records of this epoch's share already taken into the buffer
        self.emitted = 0  # microbatches emitted in this epoch
        self.pending: list[list[Document]] = []  # packed bins not yet emitted
        self.carried: list[Document] = []  # documents of the last buffer's least-filled bin
        self._share_cache: tuple[int, list[int]] | None = None

    def _share(self) -> list[int]:
        if self._share_cache is None or self._share_cache[0] != self.epoch:
            share = epoch_share(len(self.documents), self.epoch, self.seed, self.rank, self.world_size, self.shuffle)
            self._share_cache = (self.epoch, share)
        return self._share_cache[1]

    def _refill(self) -> None:
        share = self._share()
        chunk = share[self.position : self.position + self.buffer_records]
        self.position += len(chunk)
        docs = self.carried + [doc for doc in map(self.documents.get, chunk) if doc is not None]
        bins = best_fit_decreasing(docs, self.max_tokens)
        self.carried = []
        if self.position < len(share) and len(bins) > 1:
            least_filled = min(range(len(bins)), key=lambda i: sum(map(len, bins[i])))
            self.carried = bins.pop(least_filled)
        self.pending = bins

    def _epoch_done(self) -> bool:
        return not self.pending and self.position >= len(self._share())

    def _next_epoch(self) -> None:
        self.epoch, self.position, self.emitted = self.epoch + 1, 0, 0

    def __iter__(self) -> Iterator[PackedBatch]:
        while self.num_epochs is None or self.epoch < self.num_epochs:
            if not self.pending and not self._epoch_done():
                self._refill()
                continue
            if self.pending:
                batch = collate_packed(self.pending.pop(0))
                self.emitted += 1
            else:
                # Every record of this rank's share was skipped (or it had none); an empty microbatch
                # keeps the rank in step with the others (and the loop from spinning) instead of hanging.
                logger.warning("rank %d: no trainable documents in epoch %d", self.rank, self.epoch)
                batch = empty_batch(self.pad_token_id)
            if self._epoch_done():
                # Roll over before yielding, so a state taken now already points at the next epoch.
                self._next_epoch()
            yield batch

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "emitted": self.emitted,
            "pending_doc_ids": [[doc.doc_id for doc in bin_] for bin_ in self.pending],
            "carried_doc_ids": [doc.doc_id for doc in self.carried],
        }

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position, self.emitted = state["epoch"], state["position"], state["emitted"]
        self.pending = [[self.documents.get(i) for i in bin_] for bin_ in state["pending_doc_ids"]]
        self.carried = [self.documents.get(i) for i in state["carried_doc_ids"]]
