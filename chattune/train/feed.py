"""Each update step's microbatches from a rank's packed stream, with epochs kept in lockstep across ranks.

The ranks' shares of an epoch hold the same number of records (±1) but pack into different numbers of
microbatches. Left alone, a rank would run into epoch e+1 while another still trains on epoch e: the
"epoch" each logs would differ, and a finite stream would end on one rank while the others still wait
in a collective. So a rank that reaches the end of its share stops there, fills the rest of the step
with empty microbatches and keeps taking empty steps until every rank has reached the end; the step in
which the last rank does closes the epoch for all. Whether a rank has reached the end travels in the
step's one all-reduce (`accumulate_gradients`), so agreeing costs no extra communication.

The price is a few empty microbatches per epoch on the ranks whose share packed tighter.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from chattune.data.packing import PackedBatch, empty_batch

if TYPE_CHECKING:
    from chattune.data.mixing_policy import Mixer


@dataclass
class StepBatches:
    microbatches: list[PackedBatch]
    epoch: int
    rank_done: bool  # this rank has taken the last microbatch of its share of `epoch`


class StepFeed:
    """`next_step()` gives a step's microbatches; `close_step(ranks_done, world_size)` is told after the
    step's all-reduce how many ranks have finished the epoch. `num_epochs` (None: unbounded) ends the feed
    on the same step on every rank (`finished`)."""

    def __init__(self, stream: Iterable[PackedBatch], grad_accum_steps: int, pad_token_id: int,
                 num_epochs: int | None = None, mixer: "Mixer | None" = None):
        if grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps must be at least 1, got {grad_accum_steps}")
        self.stream, self.grad_accum_steps, self.pad_token_id = stream, grad_accum_steps, pad_token_id
        self.num_epochs = num_epochs
        self.mixer = mixer  # a mixture's sampling state (chattune.data.mixing_policy), checkpointed with the data position
        self.epoch = 0
        self.rank_done = False  # waiting for the other ranks to finish the epoch
        self.epoch_counts = _zero_counts()  # this rank's figures of the epoch so far
        self._batches: Iterator[PackedBatch] | None = None

    @property
    def finished(self) -> bool:
        return self.num_epochs is not None and self.epoch >= self.num_epochs

    def next_step(self) -> StepBatches:
        if self.finished:
            raise RuntimeError(f"the data feed finished after {self.num_epochs} epoch(s)")
        if self._batches is None:
            self._batches = iter(self.stream)
        taken: list[PackedBatch] = []
        while not self.rank_done and len(taken) < self.grad_accum_steps:
            batch = next(self._batches, None)
            if batch is None:  # a finite stream ended: its last epoch is over on this rank
                self.rank_done = True
                break
            if batch.epoch != self.epoch:
                raise RuntimeError(f"the stream gave a microbatch of epoch {batch.epoch} during epoch {self.epoch} "
                                   "without marking the end of the epoch")
            taken.append(batch)
            self.rank_done = batch.ends_epoch
            self._count(batch)
        taken += [empty_batch(self.pad_token_id) for _ in range(self.grad_accum_steps - len(taken))]
        return StepBatches(taken, self.epoch, self.rank_done)

    def close_step(self, ranks_done: int, world_size: int) -> dict[str, int] | None:
        """Record the step's agreement. When it closed the epoch (on every rank alike), returns this rank's
        figures of that epoch (summable over ranks); otherwise None."""
        if ranks_done < world_size:
            return None
        counts, self.epoch_counts = self.epoch_counts, _zero_counts()
        self.epoch += 1
        self.rank_done = False
        return counts

    def _count(self, batch: PackedBatch) -> None:
        if batch.doc_ids:  # not an empty microbatch
            self.epoch_counts["microbatches"] += 1
        self.epoch_counts["documents"] += len(batch.doc_ids)
        self.epoch_counts["tokens"] += batch.num_document_tokens
        self.epoch_counts["trainable_tokens"] += batch.num_trainable_tokens

    def state_dict(self) -> dict:
        return {"stream": self.stream.state_dict(), "epoch": self.epoch, "rank_done": self.rank_done,
                "epoch_counts": dict(self.epoch_counts), "mixer": self.mixer.state_dict() if self.mixer else None}

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state["stream"])
        if self.mixer is not None:
            self.mixer.load_state_dict(state["mixer"])
        self._batches = None
        self.epoch, self.rank_done = state["epoch"], state["rank_done"]
        self.epoch_counts = dict(state["epoch_counts"])


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
