"""Weighted mixtures of data sources: which record every rank trains on, decided identically everywhere.

All ranks generate the same sequence of global draws. Draw n picks a source with the probabilities in
force for n (a uniform number that is a pure function of the seed and n), then that source's next
record in its own shuffled order; each source wraps into a new pass (a new shuffle) on its own. Draw n
belongs to rank n % world_size, which tokenizes and trains it; the other ranks only count it. So the
ranks' shares are disjoint, no communication is needed to sample, and every sampling decision is the
same on every rank.

Probabilities may change during training (`chattune.data.mixing_policy`, online mixing). A change takes effect
from a draw index every rank has agreed on and not generated yet, and the whole history of changes
(`ProbabilitySchedule`) is part of the run's state, so draw n is the same in a resumed run.

A mixture "epoch" ends when the first source finishes a pass (`stopping: first_exhausted`) or when all
sources have finished one (`all_exhausted`; sources that finish early start another pass meanwhile);
epoch e ends when some / every source has completed e + 1 passes. `data.num_epochs` counts these.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from chattune.config.schema import MIXING_STOPPING
from chattune.data.documents import IGNORE_INDEX, Document, Skipped, outcomes_by_record
from chattune.data.packing import PackedBatch
from chattune.data.stream import DocumentSource, documents_of

_BLOCK = 4096  # draws per block of uniform numbers


class MixedDocuments:
    """Several document sources behind one record index (source k's records follow source k-1's).
    Each document is re-addressed by that global index and tagged with its source."""

    def __init__(self, sources: Sequence[tuple[str, DocumentSource]]):
        self.names = [name for name, _ in sources]
        self.sources = [documents for _, documents in sources]
        self.sizes = [len(documents) for documents in self.sources]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).tolist()

    def __len__(self) -> int:
        return self.offsets[-1]

    def source_of(self, index: int) -> int:
        return bisect.bisect_right(self.offsets, index) - 1

    def get(self, index: int) -> Document | Skipped:
        return self.get_many([index])[0]

    def get_many(self, indices: Sequence[int]) -> list[Document | Skipped]:
        """The outcomes of `indices` in order, flat like `documents_of` (a split record gives all its pieces)."""
        by_source: dict[int, list[int]] = {}
        for position, index in enumerate(indices):
            by_source.setdefault(self.source_of(index), []).append(position)
        out: list[list[Document | Skipped]] = [[] for _ in indices]
        for source, positions in by_source.items():  # one batch per source, as its tokenizer prefers
            offset = self.offsets[source]
            got = documents_of(self.sources[source], [indices[p] - offset for p in positions])
            for position, outcomes in zip(positions, outcomes_by_record(got, len(positions))):
                out[position] = [replace(item, doc_id=item.doc_id + offset, source=source) if isinstance(item, Document)
                                 else item for item in outcomes]
        return [item for outcomes in out for item in outcomes]


class ProbabilitySchedule:
    """The source probabilities in force from each draw index on; shared by the sampler (which reads
    it) and the mixer (which extends and checkpoints it)."""

    def __init__(self, probabilities: Sequence[float]):
        self.starts: list[int] = [0]
        self.cumulative: list[np.ndarray] = [_cumulative(probabilities)]

    def add(self, from_draw: int, probabilities: Sequence[float]) -> None:
        if from_draw < self.starts[-1]:
            raise ValueError(f"a schedule entry from draw {from_draw} cannot precede the last one ({self.starts[-1]})")
        self.starts.append(from_draw)
        self.cumulative.append(_cumulative(probabilities))

    def source(self, draw: int, uniform: float) -> int:
        entry = bisect.bisect_right(self.starts, draw) - 1
        cumulative = self.cumulative[entry]
        return min(int(np.searchsorted(cumulative, uniform, side="right")), len(cumulative) - 1)

    def latest(self) -> np.ndarray:
        return np.diff(self.cumulative[-1], prepend=0.0)

    def state_dict(self) -> dict:
        return {"starts": list(self.starts), "probabilities": [np.diff(c, prepend=0.0).tolist() for c in self.cumulative]}

    def load_state_dict(self, state: dict) -> None:
        # In place: the sampler inside the data loader holds this very object.
        self.starts[:] = state["starts"]
        self.cumulative[:] = [_cumulative(p) for p in state["probabilities"]]


def _cumulative(probabilities: Sequence[float]) -> np.ndarray:
    p = np.asarray(probabilities, dtype=np.float64)
    if p.ndim != 1 or (p < 0).any() or p.sum() <= 0:
        raise ValueError(f"source probabilities must be non-negative with a positive sum, got {p.tolist()}")
    return np.cumsum(p / p.sum())


class MixtureSampler:
    """One rank's records of a mixture, as (epoch, record indices, closes_epoch) chunks of up to
    `chunk_records` records, like `ShareSampler`. Its state is its position; the probabilities live in
    the shared `schedule` (checkpointed by the mixer: the loader snapshots this sampler's state when it
    prefetches, possibly before the latest schedule change)."""

    def __init__(self, sizes: Sequence[int], schedule: ProbabilitySchedule, rank: int, world_size: int, seed: int,
                 stopping: str, num_epochs: int | None, chunk_records: int):
        if stopping not in MIXING_STOPPING:
            raise ValueError(f"data.mixing.stopping must be one of {MIXING_STOPPING}, got {stopping!r}")
        if min(sizes) < 1:
            raise ValueError(f"every source of a mixture needs records; sizes {list(sizes)}")
        self.sizes, self.offsets = list(sizes), np.concatenate([[0], np.cumsum(sizes)]).tolist()
        self.schedule, self.rank, self.world_size, self.seed = schedule, rank, world_size, seed
        self.stopping, self.num_epochs, self.chunk_records = stopping, num_epochs, chunk_records
        self.draw = 0  # the next global draw
        self.picks = [0] * len(self.sizes)  # draws of each source so far, over all ranks
        self.epoch = 0
        self._uniforms: tuple[int, np.ndarray] | None = None
        self._orders: dict[int, tuple[int, np.ndarray]] = {}

    def __iter__(self) -> "MixtureSampler":
        return self

    def __next__(self) -> tuple[int, list[int], bool]:
        if self.num_epochs is not None and self.epoch >= self.num_epochs:
            raise StopIteration
        epoch, indices, closes = self.epoch, [], False
        while len(indices) < self.chunk_records and not closes:
            draw = self.draw
            source = self.schedule.source(draw, self._uniform(draw))
            pick = self.picks[source]
            self.picks[source] += 1
            self.draw += 1
            if draw % self.world_size == self.rank:
                indices.append(self.offsets[source] + self._record(source, pick))
            closes = self._epoch_done()
        if closes:
            self.epoch += 1
        return epoch, indices, closes

    def _epoch_done(self) -> bool:
        passes = [picks // size for picks, size in zip(self.picks, self.sizes)]
        done = max(passes) if self.stopping == "first_exhausted" else min(passes)
        return done >= self.epoch + 1

    def _uniform(self, draw: int) -> float:
        block = draw // _BLOCK
        if self._uniforms is None or self._uniforms[0] != block:
            self._uniforms = (block, np.random.default_rng([self.seed, 0x5EED, block]).random(_BLOCK))
        return float(self._uniforms[1][draw % _BLOCK])

    def _record(self, source: int, pick: int) -> int:
        size = self.sizes[source]
        source_pass = pick // size
        cached = self._orders.get(source)
        if cached is None or cached[0] != source_pass:
            generator = torch.Generator().manual_seed(self.seed + 1_000_003 * (source + 1) + source_pass)
            cached = self._orders[source] = (source_pass, torch.randperm(size, generator=generator).numpy())
        return int(cached[1][pick % size])

    def state_dict(self) -> dict:
        return {"draw": self.draw, "picks": list(self.picks), "epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.draw, self.picks, self.epoch = state["draw"], list(state["picks"]), state["epoch"]


def document_sums(batch: PackedBatch, per_token: torch.Tensor) -> torch.Tensor:
    """Sums of a per-token value over each document of the microbatch (padding excluded)."""
    num_docs = len(batch.doc_lengths)
    sums = torch.zeros(num_docs + 1, dtype=torch.float64, device=per_token.device)  # + padding, dropped
    return sums.index_add(0, batch.document_ids.to(per_token.device), per_token.double())[:num_docs]


def source_figures(batch: PackedBatch, doc_losses: torch.Tensor, num_sources: int,
                   doc_units: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Per-source sums of one microbatch (documents, trainable tokens, loss units, summed loss), from
    per-document losses the objective has already computed: no extra forward. `doc_units`: each
    document's loss units (None: its trainable tokens). The same keys for every microbatch (zeros where a
    source is absent), so ranks can all-reduce them stacked."""
    device = doc_losses.device
    sources = torch.tensor(batch.doc_sources, dtype=torch.long, device=device)
    doc_tokens = document_sums(batch, (batch.labels[0] != IGNORE_INDEX).to(device))
    doc_units = doc_tokens if doc_units is None else doc_units

    def per_source(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(num_sources, dtype=torch.float64, device=device).index_add(0, sources, values.double())

    sums = {"documents": per_source(torch.ones(len(sources), device=device)), "tokens": per_source(doc_tokens),
            "units": per_source(doc_units.detach()), "loss": per_source(doc_losses.detach())}
    return {f"source_{name}/{k}": values[k] for name, values in sums.items() for k in range(num_sources)}
