"""Each update step's microbatches from a rank's packed stream.

Per rank (the default) each rank packs its own share of the data, and epochs are kept in lockstep across
ranks. The ranks' shares of an epoch hold the same number of records (±1) but pack into different numbers
of microbatches. Left alone, a rank would run into epoch e+1 while another still trains on epoch e: the
"epoch" each logs would differ, and a finite stream would end on one rank while the others still wait in a
collective. So a rank that reaches the end of its share stops there, fills the rest of the step with empty
microbatches and keeps taking empty steps until every rank has reached the end; the step in which the last
rank does closes the epoch for all. Whether a rank has reached the end travels in the step's one all-reduce
(`chattune.train.step`'s counts), so agreeing costs no extra communication. The price is the empty microbatches of
the ranks whose share packed tighter.

World-size-invariant (`data.microbatches_per_step` = M): every rank reads, tokenizes and packs the whole
data into the same one stream, takes the next M microbatches of it every step and trains only its own M/W
of them (`slots`). A step's documents are then fixed by the data and the seed, not by the number of ranks
W, and a checkpoint's data position is the same on every rank, so any other number of ranks can continue
it. Every rank sees where an epoch ends, so no agreement is needed, and no step waits for one: a step that
reaches an epoch's last microbatch fills its remaining slots from the next epoch (only the run's very end
leaves slots empty). The price is that each rank packs all the data, W times its own share: from a token cache
(`chattune.data.token_cache`) packing reads only the documents' lengths, and a rank collates (reads the tokens of)
only the microbatches it trains; with data.cache=off it also tokenizes all of it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from chattune.data.packing import PackedBatch, empty_batch
from chattune.errors import UserError

if TYPE_CHECKING:
    from chattune.data.ingest.mixing_policy import Mixer
    from chattune.data.stream import PackedStream


@dataclass
class StepBatches:
    microbatches: list[PackedBatch]
    epoch: int = 0  # the epoch of the step's first microbatch (world-size-invariant steps may also start the next)
    # Per rank: this rank's stream has given the last microbatch of the epoch (invariant: of the run).
    epoch_end_reached: bool = False
    # World-size-invariant steps: each microbatch's RNG seed, a function of the run's seed, the step and the
    # microbatch's place in the global step (dropout draws the same masks on any number of ranks). None:
    # the ranks' RNG streams as they run.
    seeds: list[int] | None = None
    # A source's own figures of the step on this rank (a rollout's rewards, lengths and time), summed over ranks with
    # the step's sums, where the objective's `metrics` reads them; the same names on every rank and every step.
    figures: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class InvariantSlots:
    """World-size-invariant steps, on one rank: the microbatches of each step it trains (`slots`: rank r of W
    trains r*M/W .. (r+1)*M/W - 1 of the step's M), each seeded from the run's `seed`, the step and the slot
    (`microbatch_seed`: dropout draws the same masks on any number of ranks)."""

    slots: range
    seed: int = 0


class StepSource(Protocol):
    """Where the loop (`chattune.train.loop.train`) takes its update steps from: `StepFeed` reads them from the
    run's data files; a recipe that makes its own steps (rollouts of the policy being trained, documents made from
    the model's outputs) implements this instead and hands it to `train` in its `TrainingData`.

    Every rank's source gives the same number of microbatches per step (a rank short of data gives empty ones:
    every forward is a collective). `state_dict`/`load_state_dict` are this rank's position, saved in every
    checkpoint under "data" and restored on resume, so that a resumed run makes the steps the uninterrupted run
    would have made."""

    mixer: Mixer | None  # a mixture's sampling state and per-source figures (None: one source)

    @property
    def finished(self) -> bool:
        """No step after this one (the last epoch ended; False for a source without end: max_steps ends the run)."""
        ...

    @property
    def epoch(self) -> int:
        """The epoch of the next step (0 for a source without epochs)."""
        ...

    @property
    def skipped(self) -> dict[str, int]:
        """This rank's counted skips by reason (summed over ranks at the end of the run); {} for none."""
        ...

    def next_step(self, step: int) -> StepBatches:
        """Step `step`'s microbatches on this rank (`step` counts from 1)."""
        ...

    def close_step(self, ranks_at_epoch_end: int) -> list[tuple[int, dict[str, int]]]:
        """After the step's all-reduce: how many ranks reached their epoch's end; the epochs the step closed, each
        with this rank's figures (summable over ranks). [] for a source without epochs."""
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def close(self) -> None:
        """The run is over (complete or stopped): free what the source holds (loader workers, a generator)."""
        ...


class StepFeed:
    """The run's `StepSource` of its data files. `next_step()` gives a step's microbatches; `close_step(ranks_at_epoch_end)` is told after the step's all-reduce
    how many ranks have finished an epoch and returns the epochs the step closed. `num_epochs` (None:
    unbounded) ends the feed on the same step on every rank (`finished`).

    Each step takes `microbatches_per_step` microbatches of `stream`. Per rank (`invariant` None) they are all
    this rank's, and a step never runs past the end of an epoch; `num_ranks` ranks agree on the epoch's end.
    World-size-invariant (`invariant`, `InvariantSlots`), `stream` is the same on every rank, steps run on across
    epoch ends, and this rank trains the step's microbatches `invariant.slots`, seeded from `invariant.seed`, the
    step and the slot. `reports_figures`: whether this rank's figures (epoch counts, skips) go into the sums over
    ranks: not on the other ranks of a context group, which read the same microbatches as its first
    (chattune.parallel.context_parallel)."""

    def __init__(
        self,
        stream: PackedStream,
        microbatches_per_step: int,
        pad_token_id: int,
        num_epochs: int | None = None,
        mixer: Mixer | None = None,
        num_ranks: int = 1,
        invariant: InvariantSlots | None = None,
        reports_figures: bool = True,
    ):
        slots, seed = (invariant.slots, invariant.seed) if invariant is not None else (None, 0)
        if microbatches_per_step < 1:
            raise ValueError(f"microbatches per step must be at least 1, got {microbatches_per_step}")
        if slots is not None and (slots.start < 0 or slots.stop > microbatches_per_step):
            raise ValueError(f"slots {slots} are not microbatches of a step of {microbatches_per_step}")
        self.stream, self.microbatches_per_step, self.pad_token_id = stream, microbatches_per_step, pad_token_id
        self.num_epochs, self.num_ranks = num_epochs, num_ranks
        self.slots, self.seed = slots, seed  # None, 0: per rank
        # Whether this rank's figures go into the sums over ranks (the class docstring).
        self.reports_figures = reports_figures
        self.mixer = mixer  # a mixture's sampling state (chattune.data.ingest.mixing_policy), checkpointed with the data position
        self.epoch = 0  # the epoch of the next microbatch
        self.epoch_end_reached = False  # per rank: the stream finished the epoch, empty steps until every rank has
        self.epoch_counts = _zero_counts()  # this rank's figures of the epoch so far
        self._closing: list[tuple[int, dict[str, int]]] = []  # epochs this step ended, with their figures
        self._batches: Iterator[PackedBatch] | None = None

    @property
    def invariant(self) -> bool:
        return self.slots is not None

    @property
    def finished(self) -> bool:
        return self.num_epochs is not None and self.epoch >= self.num_epochs

    @property
    def skipped(self) -> dict[str, int]:
        """Skipped and over-budget-but-kept records that this rank counts (summed over ranks, they are the
        run's): its share's; world-size-invariant, every rank reads every record, so rank 0 counts them."""
        counts = {**self.stream.skipped, **self.stream.overlong}
        mine = self.reports_figures and (self.slots is None or self.slots.start == 0)
        return counts if mine else dict.fromkeys(counts, 0)

    def close(self) -> None:
        """Nothing to free: the stream's loader workers end with its iterator."""

    def next_step(self, step: int = 0) -> StepBatches:
        """`step`: the step number (the per-microbatch seeds of world-size-invariant steps)."""
        if self.finished:
            raise RuntimeError(f"the data feed finished after {self.num_epochs} epoch(s)")
        if self._batches is None:  # world-size-invariant: packed, collated below only where this rank trains it
            bins = getattr(self.stream, "bins", None)
            self._batches = iter(bins() if self.invariant and bins is not None else self.stream)
        step_epoch = self.epoch
        taken: list = []  # PackedBatch, or PackedBin where this rank does not train it
        while not self.epoch_end_reached and len(taken) < self.microbatches_per_step:
            batch = next(self._batches, None)
            if batch is None:  # a finite stream ended: its last epoch is over
                self.epoch_end_reached = True
                if self.invariant:
                    self._close_epoch()
                break
            if batch.epoch != self.epoch:
                raise RuntimeError(
                    f"the stream gave a microbatch of epoch {batch.epoch} during epoch {self.epoch} "
                    "without marking the end of the epoch"
                )
            trained_here = self.slots is None or len(taken) in self.slots
            if trained_here and not isinstance(batch, PackedBatch):
                batch = self.stream.collate(batch)
            taken.append(batch)
            if self.reports_figures and trained_here:
                _count(self.epoch_counts, batch)
            if not self.invariant:  # the step stops at the epoch's end; the ranks agree on it in the all-reduce
                self.epoch_end_reached = batch.ends_epoch
            elif batch.ends_epoch:  # every rank sees this end: the step runs on into the next epoch
                self._close_epoch()
                self.epoch_end_reached = self.finished
        slots = self.slots if self.slots is not None else range(self.microbatches_per_step)
        mine = [taken[i] if i < len(taken) else empty_batch(self.pad_token_id) for i in slots]
        seeds = [microbatch_seed(self.seed, step, slot) for slot in slots] if self.invariant else None
        return StepBatches(mine, step_epoch, self.epoch_end_reached, seeds)

    def _close_epoch(self) -> None:
        self._closing.append((self.epoch, self.epoch_counts))
        self.epoch, self.epoch_counts = self.epoch + 1, _zero_counts()

    def close_step(self, ranks_at_epoch_end: int) -> list[tuple[int, dict[str, int]]]:
        """Record the step's agreement (`ranks_at_epoch_end`: how many ranks' streams reached it). Returns the epochs the step closed
        (on every rank alike), each with this rank's figures of it (summable over ranks)."""
        if self.invariant:
            closed, self._closing = self._closing, []
            return closed
        if ranks_at_epoch_end < self.num_ranks:
            return []
        self._close_epoch()
        closed, self._closing, self.epoch_end_reached = self._closing, [], False
        return closed

    def state_dict(self) -> dict:
        # "rank_done": the key checkpoints have always had for epoch_end_reached.
        state = {
            "stream": self.stream.state_dict(),
            "epoch": self.epoch,
            "rank_done": self.epoch_end_reached,
            "epoch_counts": dict(self.epoch_counts),
            "mixer": self.mixer.state_dict() if self.mixer else None,
        }
        if self.invariant:
            state["microbatches_per_step"] = self.microbatches_per_step
        return state

    def load_state_dict(self, state: dict) -> None:
        if "streams" in state:
            raise UserError(
                "this checkpoint was written by an earlier chattune's world-size-invariant steps (one "
                "stream per microbatch): resume it with the chattune that wrote it, or start over"
            )
        saved = state.get("microbatches_per_step")
        if saved != (self.microbatches_per_step if self.invariant else None):
            raise UserError(
                f"this checkpoint was written with data.microbatches_per_step={saved}, this run has "
                f"{self.microbatches_per_step if self.invariant else None}: a run's steps cannot change "
                "their microbatches on resume"
            )
        self.stream.load_state_dict(state["stream"])
        if self.mixer is not None:
            self.mixer.load_state_dict(state["mixer"])
        self._batches = None
        self.epoch, self.epoch_end_reached = state["epoch"], state["rank_done"]
        self.epoch_counts = dict(state["epoch_counts"])


def merge_states(states: list[dict], rank: int) -> dict:
    """The data position of a world-size-invariant run saved by `len(states)` ranks, for rank `rank` of
    another number of ranks. The stream's position is every rank's alike; the sums that are only ever
    reduced over ranks (the epoch's counts, a mixer's loss and document sums) are put whole on rank 0,
    zeros elsewhere, so that their all-reduced totals are unchanged."""
    first = states[0]
    if any(
        (s["stream"], s["epoch"], s["rank_done"]) != (first["stream"], first["epoch"], first["rank_done"])
        for s in states
    ):
        raise RuntimeError("the checkpoint's ranks disagree on the data position of a world-size-invariant run")
    counts = {name: sum(s["epoch_counts"][name] for s in states) if rank == 0 else 0 for name in first["epoch_counts"]}
    merged = {**first, "epoch_counts": counts}
    if first["mixer"] is not None:
        from chattune.data.ingest.mixing_policy import Mixer

        merged["mixer"] = Mixer.merge_states([s["mixer"] for s in states], rank)
    return merged


def microbatch_seed(seed: int, step: int, slot: int) -> int:
    """The RNG seed of the microbatch in place `slot` of `step`: the same on any number of ranks."""
    return (seed * 1_000_003 + step * 65_537 + slot) % 2**63


def _count(counts: dict[str, int], batch: PackedBatch) -> None:
    if batch.doc_ids:  # not an empty microbatch
        counts["microbatches"] += 1
    counts["documents"] += len(batch.doc_ids)
    counts["tokens"] += batch.num_document_tokens
    counts["trainable_tokens"] += batch.num_trainable_tokens


def _zero_counts() -> dict[str, int]:
    return {"microbatches": 0, "documents": 0, "tokens": 0, "trainable_tokens": 0}


class DocumentLedger:
    """Debug record (`ledger=true`) of the documents each step trained on, one JSON line per step in
    `{output_dir}/ledger/rank{R}.from_step{S}.jsonl` (a file per launch, so a resumed run's lines never mix
    with those of the run it continues): their ids (the training data's record indices) and, with `origin`
    (`MixedDocuments.origin`), each one's [source, record number in that source]. The crash tests audit
    exactly-once training with it."""

    def __init__(
        self, output_dir: Path, rank: int, start_step: int, origin: Callable[[int], tuple[int, int]] | None = None
    ):
        self.path = Path(output_dir) / "ledger" / f"rank{rank}.from_step{start_step}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")
        self.origin = origin

    def write(self, step: int, batches: StepBatches) -> None:
        doc_ids = [i for batch in batches.microbatches for i in batch.doc_ids]
        doc_epochs = [batch.epoch for batch in batches.microbatches for _ in batch.doc_ids]  # a step may cross one
        line = {"step": step, "epoch": batches.epoch, "doc_ids": doc_ids, "doc_epochs": doc_epochs}
        if self.origin is not None:
            line["records"] = [list(self.origin(i)) for i in doc_ids]
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")
