"""Weighted mixtures of data sources: which record every rank trains on, decided identically everywhere.

All ranks generate the same sequence of global draws. Draw n picks a source with the probabilities in
force for n (a uniform number that is a pure function of the seed and n), then that source's next
record in its own shuffled order; each source wraps into a new pass (a new shuffle) on its own. Draw n
belongs to rank n % world_size, which tokenizes and trains it; the other ranks only count it. So the
ranks' shares are disjoint, no communication is needed to sample, and every sampling decision is the
same on every rank.

Probabilities may change during training (`chattune.data.ingest.mixing_policy`, online mixing). A change takes effect
from a draw index every rank has agreed on and not generated yet, and the whole history of changes
(`ProbabilitySchedule`) is part of the run's state, so draw n is the same in a resumed run.

A mixture "epoch" ends when the first source finishes a pass (`stopping: first_exhausted`) or when all
sources have finished one (`all_exhausted`; sources that finish early start another pass meanwhile);
epoch e ends when some / every source has completed e + 1 passes. `data.num_epochs` counts these.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np
import torch

from chattune.config.schema import MIXING_STOPPING

_BLOCK = 4096  # draws per block of uniform numbers


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
        return {
            "starts": list(self.starts),
            "probabilities": [np.diff(c, prepend=0.0).tolist() for c in self.cumulative],
        }

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

    def __init__(
        self,
        sizes: Sequence[int],
        schedule: ProbabilitySchedule,
        rank: int,
        world_size: int,
        seed: int,
        stopping: str,
        num_epochs: int | None,
        chunk_records: int,
    ):
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

    def __iter__(self) -> MixtureSampler:
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
