"""Each rank's stream of packed microbatches, epoch after epoch.

Every epoch draws one seeded permutation of all record indices (the same on every rank) and share s of
S (a rank's, or all of it for world-size-invariant steps: `StreamLayout`) takes positions s, s + S,
s + 2*S, ...: the shares are disjoint, cover every record and need no communication.

Three stages:
- `ShareSampler` walks the stream's share in chunks of `buffer_records` records, the last chunk of an
  epoch marked as closing it;
- a torchdata `StatefulDataLoader` tokenizes each chunk (in one batch), in `num_workers` worker
  processes or in this one, always in sampler order (so 0 and N workers give the same stream);
- this process packs them, one chunk (a buffer) at a time, best-fit decreasing, into token-budget
  microbatches. The least-filled bin of a buffer is carried into the next buffer, where its documents
  get another chance to fill a bin (a half-empty microbatch costs a whole step on the rank that holds
  it). At an epoch's end everything is emitted: nothing is dropped.

The stream's position (`state_dict`) is the sampler's state after the last chunk packed, with the
packed bins not yet emitted and the carried documents (by record): a resumed stream samples on from
there and tokenizes again, so it does not depend on how far the loader had prefetched or on its number
of workers, and nothing is replayed.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from chattune.config.layout_rules import pad_multiple_problem
from chattune.data.documents import OVERLONG_COUNTS, SKIP_REASONS, Document, Skipped
from chattune.data.packing import PackedBatch, best_fit_decreasing, collate_packed, empty_batch
from chattune.errors import UserError
from chattune.interrupts import ignore_in_worker
from chattune.log import EACH_RANK

logger = logging.getLogger(__name__)

LOGGED_SKIPS = 20  # skipped records logged one by one per reason and rank; the rest are only counted


@dataclass
class PackedBin:
    """A microbatch's documents as packed, with the epoch they belong to; `PackedStream.collate` makes the batch."""

    documents: list[Document]  # empty: a rank with nothing to train this epoch (an empty microbatch)
    epoch: int
    ends_epoch: bool  # the last microbatch of its share of that epoch


class DocumentSource(Protocol):
    """Documents by record index; a source may also have `get_many(indices)` (see `documents_of`)."""

    def __len__(self) -> int: ...

    def get(self, index: int) -> Document | Skipped: ...


def documents_of(source: DocumentSource, indices: list[int]) -> list[Document | Skipped]:
    """The outcomes of `indices`, flat and in order: in one batch where the source can
    (`SFTDocuments.get_many` tokenizes them in one call), else one by one. A record gives one `Skipped`
    or its documents (several pieces when `data.overlong=split` cuts it), so there may be more outcomes
    than indices: `chattune.data.documents.outcomes_by_record` regroups them."""
    get_many = getattr(source, "get_many", None)
    return get_many(indices) if get_many is not None else [source.get(i) for i in indices]


def epoch_share(
    num_records: int, epoch: int, seed: int, share: int, num_shares: int, shuffle: bool = True
) -> list[int]:
    """The record indices of share `share` of `num_shares` in `epoch`."""
    if shuffle:
        order = torch.randperm(num_records, generator=torch.Generator().manual_seed(seed + epoch))
    else:
        order = torch.arange(num_records)
    return order[share::num_shares].tolist()


@dataclass(frozen=True)
class StreamLayout:
    """Which records a stream reads, epoch after epoch: share `share` of `num_shares` of every epoch's
    permutation of the records (this rank's share, or the whole data for world-size-invariant steps;
    `chattune.train.inputs.StepLayout` decides), shuffled or in record order, for `num_epochs` epochs (None:
    unbounded). The permutation is seeded by the stream's seed and the epoch (`epoch_share`)."""

    share: int = 0
    num_shares: int = 1
    shuffle: bool = True
    num_epochs: int | None = None


@dataclass(frozen=True)
class PackingBudget:
    """How a stream packs documents into microbatches: at most `max_tokens` tokens each, padded with
    `pad_token_id` (an empty microbatch too) up to a multiple of `pad_to_multiple_of` (None: not padded), one
    buffer of `buffer_records` records at a time (best-fit decreasing within the buffer)."""

    max_tokens: int
    pad_token_id: int
    pad_to_multiple_of: int | None = None
    buffer_records: int = 256


class ShareSampler:
    """One share of the records (`epoch_share`), as (epoch, record indices, closes_epoch) chunks of up to `chunk_records` records
    of one epoch; the last chunk of an epoch closes it (an empty share gives one empty closing chunk).
    A chunk is one loader item, tokenized in one batch and packed as one buffer: per-item costs (the
    loader's bookkeeping, a worker's queue) are paid per chunk, not per record.
    Its own iterator and stateful, so StatefulDataLoader restores its position without replaying it."""

    def __init__(
        self,
        num_records: int,
        share: int,
        num_shares: int,
        seed: int,
        shuffle: bool,
        num_epochs: int | None,
        chunk_records: int,
    ):
        self.num_records, self.share, self.num_shares = num_records, share, num_shares
        self.seed, self.shuffle, self.num_epochs, self.chunk_records = seed, shuffle, num_epochs, chunk_records
        self.epoch, self.position = 0, 0
        self._share: tuple[int, list[int]] | None = None

    def __iter__(self) -> ShareSampler:
        return self

    def __next__(self) -> tuple[int, list[int], bool]:
        if self.num_epochs is not None and self.epoch >= self.num_epochs:
            raise StopIteration
        if self._share is None or self._share[0] != self.epoch:
            self._share = (
                self.epoch,
                epoch_share(self.num_records, self.epoch, self.seed, self.share, self.num_shares, self.shuffle),
            )
        share = self._share[1]
        chunk = share[self.position : self.position + self.chunk_records]
        item = (self.epoch, chunk, self.position + len(chunk) >= len(share))
        self.position += len(chunk)
        if item[2]:
            self.epoch, self.position = self.epoch + 1, 0
        return item

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]


class _Positioned:
    """A stateful sampler whose chunks carry its state after each: the stream keeps the state after the
    last chunk it consumed as its data position, which therefore does not depend on how far the loader
    has prefetched, nor on how many worker processes it has."""

    def __init__(self, sampler):
        self.sampler = sampler

    def __iter__(self) -> _Positioned:
        return self

    def __next__(self) -> tuple[int, list[int], bool, dict]:
        epoch, indices, closes_epoch = next(self.sampler)
        return epoch, indices, closes_epoch, self.sampler.state_dict()


class _TokenizedChunks(torch.utils.data.Dataset):
    """Map-style view for the loader: (epoch, records, closes_epoch, position) -> (epoch, [Document |
    Skipped], closes_epoch, position). A user error (a bad record) travels back as the item itself, so
    the trainer raises it with its own message: the loader would wrap it in a worker's traceback text."""

    def __init__(self, documents: DocumentSource):
        self.documents = documents

    def __len__(self) -> int:
        return len(self.documents)

    def __getitem__(self, item: tuple[int, list[int], bool, dict]):
        epoch, indices, closes_epoch, position = item
        try:
            outcomes = documents_of(self.documents, indices)
        except UserError as error:
            outcomes = error
        return epoch, outcomes, closes_epoch, position


def _as_is(item):
    return item


def _tokenize_on_one_thread(worker_id: int) -> None:
    """Each loader worker is one of `num_workers` processes already: the Rust tokenizer's own thread pool
    on top of them only oversubscribes the cores (measured ~10% slower with 2 workers on 2 cores). The
    tokenizer reads this variable on every call, and its output does not depend on it. A stop signal is the
    trainer's to act on (`chattune.interrupts`): the step it finishes still reads from this worker."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    ignore_in_worker()


class PackedStream:
    def __init__(
        self,
        documents: DocumentSource,
        layout: StreamLayout,
        seed: int,
        budget: PackingBudget,
        num_workers: int = 0,
        sampler: Iterator[tuple[int, list[int], bool]] | None = None,
        log_skips: bool = True,
    ):
        """`layout`: which records it reads (share `layout.share` of `layout.num_shares` of each epoch);
        `seed`: each epoch's permutation and the loader's; `budget`: how it packs them (`PackingBudget`);
        `num_workers`: loader processes that tokenize (0: this one).
        `sampler`: another source of (epoch, record indices, closes_epoch) chunks than the layout's share
        of each epoch (`chattune.data.ingest.source_mixture.MixtureSampler`); it must be stateful like `ShareSampler`.
        `log_skips`: log skipped records and empty epochs (they are counted either way)."""
        padding = pad_multiple_problem(budget.max_tokens, budget.pad_to_multiple_of)
        if padding:
            raise ValueError(
                f"data.max_tokens_per_microbatch: {padding} (it must be a multiple of data.pad_to_multiple_of)"
            )
        if budget.buffer_records < 1:
            raise ValueError(f"data.buffer_records must be at least 1, got {budget.buffer_records}")
        if layout.num_epochs is None and len(documents) < layout.num_shares:
            raise ValueError(f"{len(documents)} records cannot be shared by {layout.num_shares} ranks")
        self.documents, self.share, self.budget, self.log_skips = documents, layout.share, budget, log_skips
        self.sampler = sampler or ShareSampler(
            len(documents),
            layout.share,
            layout.num_shares,
            seed,
            layout.shuffle,
            layout.num_epochs,
            budget.buffer_records,
        )
        self.position: dict | None = None  # the sampler's state after the last chunk taken (None: none yet)
        with warnings.catch_warnings():  # torchdata calls a deprecated torch API on construction
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
            self.loader = StatefulDataLoader(
                _TokenizedChunks(documents),
                batch_size=None,
                collate_fn=_as_is,
                num_workers=num_workers,
                worker_init_fn=_tokenize_on_one_thread,
                sampler=_Positioned(self.sampler),
                # Its own generator: a loader otherwise draws its worker seed from the global torch RNG,
                # and the model's random init would depend on the data pipeline.
                generator=torch.Generator().manual_seed(seed),
            )
        self._items: Iterator | None = None
        self.epoch = 0  # epoch of the documents being packed and emitted
        self.docs_in_epoch = 0  # documents of this epoch taken so far
        self.pending: list[list[Document]] = []  # packed bins not yet emitted
        self.pending_ends_epoch = False  # `pending` holds the last bins of the epoch
        self.carried: list[Document] = []  # documents of the last buffer's least-filled bin
        self.skipped = dict.fromkeys(SKIP_REASONS, 0)
        self.overlong = dict.fromkeys(
            OVERLONG_COUNTS, 0
        )  # records over the budget that were kept, cut; pieces left out

    def _take(self) -> tuple[list[Document], str]:
        """The next chunk of up to buffer_records records from the loader (skipped ones counted and left
        out), and why taking stopped: "full", "epoch_end" or "exhausted" (a finite stream has no more epochs)."""
        item = next(self._items, None)
        if item is None:
            return [], "exhausted"
        self.epoch, chunk, closes_epoch, self.position = item
        if isinstance(chunk, UserError):  # found by a loader worker: raised here, with its own message
            raise chunk
        documents = []
        for document in chunk:
            if isinstance(document, Skipped):
                self.skipped[document.reason] += 1
                reason = document.reason
                self._log_counted(f"skipped ({reason}): {document.detail}", f"{reason} skips", self.skipped[reason], 1)
            else:
                if document.overlong:
                    self.overlong[document.overlong] += 1
                if document.pieces_left_out:
                    self.overlong["split_pieces_left_out"] += document.pieces_left_out
                    self._log_counted(
                        f"split pieces left out: {document.left_out_detail}",
                        "split pieces left out",
                        self.overlong["split_pieces_left_out"],
                        document.pieces_left_out,
                    )
                documents.append(document)
        return documents, "epoch_end" if closes_epoch else "full"

    def _log_counted(self, line: str, kind: str, count: int, added: int) -> None:
        """Log `line`, about `added` things of `kind` just counted (`count` so far): the first LOGGED_SKIPS of each
        kind one by one, then once that the rest are only counted."""
        if not self.log_skips or count - added >= LOGGED_SKIPS:
            return
        logger.warning("%s", line, extra=EACH_RANK)  # this rank's share of the data: its own finding
        if count >= LOGGED_SKIPS:
            logger.warning(
                "rank %d: further %s are counted (in the end-of-run figures), not logged",
                self.share,
                kind,
                extra=EACH_RANK,
            )

    def _refill(self) -> bool:
        """Pack the next buffer into `pending`; False once a finite stream is exhausted."""
        documents, stopped = self._take()
        self.docs_in_epoch += len(documents)
        bins = best_fit_decreasing(self.carried + documents, self.budget.max_tokens)
        self.carried = []
        if stopped == "full" and len(bins) > 1:
            least_filled = min(range(len(bins)), key=lambda i: sum(map(len, bins[i])))
            self.carried = bins.pop(least_filled)
        self.pending = bins
        self.pending_ends_epoch = stopped == "epoch_end"
        if stopped == "epoch_end":
            if self.docs_in_epoch == 0:
                # Every record of this stream's share was skipped (or it had none): an empty microbatch
                # keeps the rank in step with the others (and the loop from spinning) instead of hanging.
                if self.log_skips:
                    logger.warning(
                        "rank %d: no trainable documents in epoch %d", self.share, self.epoch, extra=EACH_RANK
                    )
                self.pending = [[]]
            self.docs_in_epoch = 0
        return bool(self.pending) or stopped != "exhausted"

    def __iter__(self) -> Iterator[PackedBatch]:
        return map(self.collate, self.bins())

    def bins(self) -> Iterator[PackedBin]:
        """The microbatches as packed, not yet collated: a world-size-invariant step collates only those its rank
        trains (from a token cache, the others' tokens are then never read)."""
        if self._items is None:
            self._items = iter(self.loader)
        while True:
            if not self.pending and not self._refill():
                return
            if self.pending:
                bin_ = self.pending.pop(0)
                yield PackedBin(bin_, self.epoch, self.pending_ends_epoch and not self.pending)

    def collate(self, packed: PackedBin) -> PackedBatch:
        batch = (
            collate_packed(packed.documents, self.budget.pad_to_multiple_of, self.budget.pad_token_id)
            if packed.documents
            else empty_batch(self.budget.pad_token_id)
        )
        batch.epoch, batch.ends_epoch = packed.epoch, packed.ends_epoch
        return batch

    def state_dict(self) -> dict:
        return {
            "sampler": self.position,
            "epoch": self.epoch,
            "docs_in_epoch": self.docs_in_epoch,
            "pending_doc_keys": [[doc.key for doc in bin_] for bin_ in self.pending],
            "pending_ends_epoch": self.pending_ends_epoch,
            "carried_doc_keys": [doc.key for doc in self.carried],
            "skipped": dict(self.skipped),
            "overlong": dict(self.overlong),
        }

    def load_state_dict(self, state: dict) -> None:
        if "sampler" not in state:
            raise UserError(
                "this checkpoint was written by an earlier chattune, whose data position was the data "
                "loader's own state: resume it with the chattune that wrote it, or start over"
            )
        self.position = state["sampler"]  # sampling continues after the last chunk taken; the loader starts afresh
        if self.position is not None:
            self.sampler.load_state_dict(self.position)
        self._items = None
        self.epoch, self.docs_in_epoch = state["epoch"], state["docs_in_epoch"]
        # Each document is (a piece of) a record that was not skipped: reading the record again gives it again.
        keys = [tuple(k) for bin_ in state["pending_doc_keys"] for k in bin_] + [
            tuple(k) for k in state["carried_doc_keys"]
        ]
        records = sorted({record for record, _ in keys})
        by_key = {d.key: d for d in documents_of(self.documents, records) if isinstance(d, Document)}
        self.pending = [[by_key[tuple(k)] for k in bin_] for bin_ in state["pending_doc_keys"]]
        self.pending_ends_epoch = state["pending_ends_epoch"]
        self.carried = [by_key[tuple(k)] for k in state["carried_doc_keys"]]
        self.skipped = {**dict.fromkeys(SKIP_REASONS, 0), **state["skipped"]}  # a reason added since the save: 0
        self.overlong = {**dict.fromkeys(OVERLONG_COUNTS, 0), **state["overlong"]}  # (a count added since: 0)
