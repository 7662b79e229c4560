"""Each update step's microbatches from a rank's packed stream, with epochs kept in lockstep across ranks.

The ranks' shares of an epoch hold the same number of records (±1) but pack into different numbers of
microbatches. Left alone, a rank would run into epoch e+1 while another still trains on epoch e: the
"epoch" each logs would differ, and a finite stream would end on one rank while the others still wait
in a collective. So a rank that reaches the end of its share stops there, fills the rest of the step
with empty microbatches and keeps taking empty steps until every rank has reached the end; the step in
which the last rank does closes the epoch for all. Whether a rank has reached the end travels in the
step's one all-reduce (`accumulate_gradients`), so agreeing costs no extra communication.

The price is a few empty microbatches per epoch on the ranks whose share packed tighter.

With `data.microbatches_per_step` the unit of this is not the rank but the stream: a fixed number of them,
dealt to the ranks, so that a step's documents do not depend on the number of ranks (`StepFeed`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from chattune.data.packing import PackedBatch, empty_batch
from chattune.errors import UserError

if TYPE_CHECKING:
    from chattune.data.mixing_policy import Mixer


@dataclass
class StepBatches:
    microbatches: list[PackedBatch]
    epoch: int
    streams_done: int  # this rank's streams that have taken the last microbatch of their share of `epoch`
    # World-size-invariant steps: each microbatch's RNG seed, a function of the run's seed, the step and the
    # microbatch's place in the global step (dropout draws the same masks on any number of ranks). None:
    # the ranks' RNG streams as they run.
    seeds: list[int] | None = None


class StepFeed:
    """`next_step()` gives a step's microbatches; `close_step(streams_done)` is told after the step's
    all-reduce how many streams, over all ranks, have finished the epoch. `num_epochs` (None: unbounded) ends
    the feed on the same step on every rank (`finished`).

    `streams` maps a stream's number to this rank's packed streams. Per rank (the default) a rank has one
    stream, its share of the data, numbered by its rank, and takes `microbatches_per_stream` (grad_accum_steps)
    microbatches of it per step. World-size-invariant (`data.microbatches_per_step` = M): there are M streams
    whatever the number of ranks W, stream v packing the v-th of M shares of the data, and each step takes
    one microbatch from every stream; rank r owns streams r*M/W .. (r+1)*M/W - 1. Which documents a step
    trains on is then fixed by the data and the seed, not by W, and a checkpoint's per-stream positions can
    be dealt to another number of ranks (`merge_states`)."""

    def __init__(self, streams: dict[int, Iterable[PackedBatch]], microbatches_per_stream: int, pad_token_id: int,
                 num_epochs: int | None = None, mixer: "Mixer | None" = None, num_streams: int | None = None,
                 seed: int | None = None):
        if microbatches_per_stream < 1:
            raise ValueError(f"grad_accum_steps must be at least 1, got {microbatches_per_stream}")
        self.streams = dict(sorted(streams.items()))
        self.microbatches_per_stream, self.pad_token_id = microbatches_per_stream, pad_token_id
        self.num_streams = num_streams or len(self.streams)  # over all ranks
        self.invariant = seed is not None  # world-size-invariant steps (per-microbatch seeds)
        self.seed = seed
        self.num_epochs = num_epochs
        self.mixer = mixer  # a mixture's sampling state (chattune.data.mixing_policy), checkpointed with the data position
        self.epoch = 0
        self.done = dict.fromkeys(self.streams, False)  # a stream waiting for the others to finish the epoch
        self.epoch_counts = _zero_counts()  # this rank's figures of the epoch so far
        self._batches: dict[int, Iterator[PackedBatch]] | None = None

    @property
    def finished(self) -> bool:
        return self.num_epochs is not None and self.epoch >= self.num_epochs

    @property
    def skipped(self) -> dict[str, int]:
        """This rank's skipped and over-budget-but-kept records, over its streams."""
        totals: dict[str, int] = {}
        for stream in self.streams.values():
            for name, count in {**stream.skipped, **stream.overlong}.items():
                totals[name] = totals.get(name, 0) + count
        return totals

    def next_step(self, step: int | None = None) -> StepBatches:
        """`step`: the step number (the per-microbatch seeds of world-size-invariant steps)."""
        if self.finished:
            raise RuntimeError(f"the data feed finished after {self.num_epochs} epoch(s)")
        if self._batches is None:
            self._batches = {number: iter(stream) for number, stream in self.streams.items()}
        taken: list[PackedBatch] = []
        for number in self.streams:
            from_stream = []
            while not self.done[number] and len(from_stream) < self.microbatches_per_stream:
                batch = next(self._batches[number], None)
                if batch is None:  # a finite stream ended: its last epoch is over
                    self.done[number] = True
                    break
                if batch.epoch != self.epoch:
                    raise RuntimeError(f"the stream gave a microbatch of epoch {batch.epoch} during epoch {self.epoch} "
                                       "without marking the end of the epoch")
                from_stream.append(batch)
                self.done[number] = batch.ends_epoch
                self._count(batch)
            taken += from_stream
            taken += [empty_batch(self.pad_token_id) for _ in range(self.microbatches_per_stream - len(from_stream))]
        seeds = None
        if self.invariant:
            if step is None:
                raise ValueError("world-size-invariant steps need the step number (their microbatches' seeds)")
            seeds = [microbatch_seed(self.seed, step, number) for number in self.streams]
        return StepBatches(taken, self.epoch, sum(self.done.values()), seeds)

    def close_step(self, streams_done: int) -> dict[str, int] | None:
        """Record the step's agreement (`streams_done` over all ranks). When it closed the epoch (on every
        rank alike), returns this rank's figures of that epoch (summable over ranks); otherwise None."""
        if streams_done < self.num_streams:
            return None
        counts, self.epoch_counts = self.epoch_counts, _zero_counts()
        self.epoch += 1
        self.done = dict.fromkeys(self.streams, False)
        return counts

    def _count(self, batch: PackedBatch) -> None:
        if batch.doc_ids:  # not an empty microbatch
            self.epoch_counts["microbatches"] += 1
        self.epoch_counts["documents"] += len(batch.doc_ids)
        self.epoch_counts["tokens"] += batch.num_document_tokens
        self.epoch_counts["trainable_tokens"] += batch.num_trainable_tokens

    def state_dict(self) -> dict:
        mixer = self.mixer.state_dict() if self.mixer else None
        if not self.invariant:  # one stream per rank: the layout of earlier checkpoints
            (number,) = self.streams
            return {"stream": self.streams[number].state_dict(), "epoch": self.epoch, "rank_done": self.done[number],
                    "epoch_counts": dict(self.epoch_counts), "mixer": mixer}
        return {"streams": {number: stream.state_dict() for number, stream in self.streams.items()},
                "done": dict(self.done), "epoch": self.epoch, "epoch_counts": dict(self.epoch_counts), "mixer": mixer,
                "num_streams": self.num_streams}

    def load_state_dict(self, state: dict) -> None:
        if self.invariant != ("streams" in state):
            raise UserError("this checkpoint's data position is per " + ("rank" if self.invariant else "stream") +
                            ": data.microbatches_per_step cannot be switched on or off in a resumed run")
        if self.invariant:
            if state["num_streams"] != self.num_streams:
                raise UserError(f"this checkpoint has {state['num_streams']} data streams, this run "
                                f"{self.num_streams} (data.microbatches_per_step): it cannot continue it")
            for number, stream in self.streams.items():
                stream.load_state_dict(state["streams"][number])
            self.done = {number: state["done"][number] for number in self.streams}
        else:
            (number,) = self.streams
            self.streams[number].load_state_dict(state["stream"])
            self.done = {number: state["rank_done"]}
        if self.mixer is not None:
            self.mixer.load_state_dict(state["mixer"])
        self._batches = None
        self.epoch = state["epoch"]
        self.epoch_counts = dict(state["epoch_counts"])


def merge_states(states: list[dict], rank: int) -> dict:
    """The data position of a world-size-invariant run saved by `len(states)` ranks, for rank `rank` of
    another number of ranks: every stream's own position (the new rank takes those it owns), and the
    sums that are only ever reduced over ranks (the epoch's counts, a mixer's loss and document sums) put
    whole on rank 0, zeros elsewhere, so that their all-reduced totals are unchanged."""
    merged = {"streams": {}, "done": {}, "epoch": states[0]["epoch"], "num_streams": states[0]["num_streams"]}
    for state in states:
        merged["streams"].update(state["streams"])
        merged["done"].update(state["done"])
        if state["epoch"] != merged["epoch"]:
            raise RuntimeError("the checkpoint's ranks disagree on the epoch")
    counts = _zero_counts()
    for state in states:
        for name in counts:
            counts[name] += state["epoch_counts"][name] if rank == 0 else 0
    merged["epoch_counts"] = counts
    merged["mixer"] = None
    if states[0]["mixer"] is not None:
        from chattune.data.mixing_policy import Mixer

        merged["mixer"] = Mixer.merge_states([state["mixer"] for state in states], rank)
    return merged


def microbatch_seed(seed: int, step: int, stream: int) -> int:
    """The RNG seed of stream `stream`'s microbatch in `step`: the same on any number of ranks."""
    return (seed * 1_000_003 + step * 65_537 + stream) % 2**63


def _zero_counts() -> dict[str, int]:
    return {"microbatches": 0, "documents": 0, "tokens": 0, "trainable_tokens": 0}


class DocumentLedger:
    """Debug record (`ledger=true`) of the documents each step trained on, one JSON line per step in
    `{output_dir}/ledger/rank{R}.from_step{S}.jsonl` (a file per launch, so a resumed run's lines never mix
    with those of the run it continues). The crash tests audit exactly-once training with it."""

    def __init__(self, output_dir: Path, rank: int, start_step: int):
        self.path = Path(output_dir) / "ledger" / f"rank{rank}.from_step{start_step}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")

    def write(self, step: int, batches: StepBatches) -> None:
        doc_ids = [i for batch in batches.microbatches for i in batch.doc_ids]
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, "epoch": batches.epoch, "doc_ids": doc_ids}) + "\n")
