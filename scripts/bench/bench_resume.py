"""Resume cost does not grow with how far into the data a run is: time to the first step's microbatches
after restoring a data position at the start of the data and about a million records in.

    python scripts/bench/bench_resume.py [--records 1100000] [--position 1000000] [--workers 0 2]

Data: `--records` short demo-style conversations written to a temporary JSONL file, the demo tokenizer,
the recipe's pipeline (`SFTDocuments` -> `PackedStream` -> `StepFeed`, 2 microbatches per step).

The far position is reached by running the same stream over placeholder documents of the same record
count (no tokenization, so getting there takes seconds instead of the ~10 minutes real tokenization
would): its state (epoch, place in the rank's share, the packer's buffered document ids, the loader's
state) is exactly what a checkpoint at that point holds. The timed part is what a resume does: build
the real stream, `load_state_dict`, take the next step.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from transformers import AutoTokenizer

from chattune.config.paths import DEMO_ASSETS
from chattune.data.documents import Document
from chattune.data.feed import StepFeed
from chattune.data.ingest.formats import SourceSpec
from chattune.data.ingest.records import RecordSource
from chattune.data.stream import PackedStream, PackingBudget, StreamLayout
from chattune.data.templates.sft_documents import SFTDocuments

BUDGET, ACCUM, SEED = 2048, 2, 0


class Placeholders:
    """Documents of a fixed plausible length, one per record, without reading anything."""

    def __init__(self, count: int):
        self.count = count

    def __len__(self) -> int:
        return self.count

    def get(self, index: int) -> Document:
        length = 40 + index % 80
        return Document(index, [0] * length, [1] * length)


def write_records(path: Path, count: int) -> None:
    template = (DEMO_ASSETS / "chat_train.jsonl").read_text().splitlines()
    with path.open("w") as f:
        for i in range(count):
            f.write(template[i % len(template)] + "\n")


def feed(documents, workers: int) -> StepFeed:
    stream = PackedStream(documents, StreamLayout(), SEED, PackingBudget(BUDGET, 0, None, 256), num_workers=workers)
    return StepFeed(stream, ACCUM, 0)


def state_at(records: int, position: int, workers: int) -> tuple[dict, int]:
    """The feed state after about `position` records; returns it and the records actually consumed."""
    placeholder = feed(Placeholders(records), workers)
    consumed = 0
    while consumed < position:
        step = placeholder.next_step()
        consumed += sum(len(b.doc_ids) for b in step.microbatches)
        placeholder.close_step(step.epoch_end_reached)
    return placeholder.state_dict(), consumed


def time_resume(documents: SFTDocuments, state: dict | None, workers: int) -> float:
    start = time.perf_counter()
    resumed = feed(documents, workers)
    if state is not None:
        resumed.load_state_dict(state)
    resumed.next_step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=1_100_000)
    parser.add_argument("--position", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(DEMO_ASSETS / "tokenizer")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "records.jsonl"
        write_records(path, args.records)
        start = time.perf_counter()
        documents = SFTDocuments(RecordSource([SourceSpec(str(path))]), tokenizer, BUDGET)
        print(f"{args.records} records; indexing the file took {time.perf_counter() - start:.2f} s (paid by any start)")
        print("| loader workers | resumed at record | time to the first step's microbatches (s) |")
        print("|---|---|---|")
        for workers in args.workers:
            far, consumed = state_at(args.records, args.position, workers)
            near, _ = state_at(args.records, 1, workers)
            for label, state in (("0 (fresh start)", None), ("~1 step", near), (f"{consumed:,}", far)):
                seconds = min(time_resume(documents, state, workers) for _ in range(3))
                print(f"| {workers} | {label} | {seconds:.3f} |")


if __name__ == "__main__":
    main()
