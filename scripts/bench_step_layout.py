"""The cost of world-size-invariant steps in the data pipeline: pack fill and tokens/s, per-rank packing
(today's default) against `data.microbatches_per_step` streams.

    python scripts/bench_step_layout.py [--conversations 20000] [--max-tokens 4096] [--microbatches 8]

Data: the shared real chats (`../shared/assets/data`, as `scripts/bench_data.py` reads them) replicated to
about `--conversations` conversations, with the shared Qwen3 tokenizer, one epoch. Both layouts are driven
through `StepFeed` on one process, as one rank of a one-rank run takes them:
- per rank: one stream (the rank's share: all of it), `--microbatches` microbatches a step;
- invariant: `--microbatches` streams, one microbatch each a step (the same streams as that many ranks
  of per-rank packing would have).
Fill = document tokens / (microbatch slots x budget), counting the empty microbatches that keep streams in
step at the end of the epoch; tokens/s = document tokens packed per second of the whole pipeline
(tokenize, mask, pack, step assembly), best of `--repeats`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from bench_data import SHARED, replicated_messages
from transformers import AutoTokenizer

from chattune.data.formats import SourceSpec
from chattune.data.records import RecordSource
from chattune.data.sft_documents import SFTDocuments
from chattune.data.stream import PackedStream
from chattune.train.feed import StepFeed


def one_epoch(documents: SFTDocuments, max_tokens: int, microbatches: int, invariant: bool) -> tuple[float, float]:
    """(fill, tokens/s) of one epoch through StepFeed."""
    start = time.perf_counter()
    if invariant:
        streams = {v: PackedStream(documents, v, microbatches, 0, max_tokens, 0, num_epochs=1) for v in range(microbatches)}
        feed = StepFeed(streams, 1, 0, num_epochs=1, num_streams=microbatches, seed=0)
    else:
        feed = StepFeed({0: PackedStream(documents, 0, 1, 0, max_tokens, 0, num_epochs=1)}, microbatches, 0, num_epochs=1)
    tokens = slots = 0
    step = 0
    while not feed.finished:
        step += 1
        batches = feed.next_step(step)
        tokens += sum(b.num_document_tokens for b in batches.microbatches)
        slots += len(batches.microbatches)
        feed.close_step(batches.streams_done)
    seconds = time.perf_counter() - start
    return tokens / (slots * max_tokens), tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=20000)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(SHARED / "tokenizers" / "qwen3")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "chats.jsonl"
        path.write_text("".join(json.dumps(m) + "\n" for m in replicated_messages(args.conversations)))
        documents = SFTDocuments(RecordSource([SourceSpec(str(path))]), tokenizer, args.max_tokens, overlong="truncate")
        print("| layout | streams | microbatches per step | fill | tokens/s |\n|---|---|---|---|---|")
        for name, invariant in (("per rank (data.microbatches_per_step=null)", False),
                                (f"invariant (data.microbatches_per_step={args.microbatches})", True)):
            runs = [one_epoch(documents, args.max_tokens, args.microbatches, invariant) for _ in range(args.repeats)]
            fill = runs[0][0]
            assert all(abs(r[0] - fill) < 1e-12 for r in runs), "the same epoch packs the same way every time"
            streams = args.microbatches if invariant else 1
            print(f"| {name} | {streams} | {args.microbatches} | {fill:.4f} | {max(r[1] for r in runs):,.0f} |", flush=True)


if __name__ == "__main__":
    main()
