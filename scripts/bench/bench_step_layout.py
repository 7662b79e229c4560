"""The cost of world-size-invariant steps in the data pipeline: pack fill and tokens/s, per-rank packing
(today's default) against `data.microbatches_per_step`, for a job of `--ranks` ranks.

    python scripts/bench/bench_step_layout.py [--conversations 20000] [--max-tokens 4096] [--ranks 8] [--microbatches 8]
                                        [--epochs 1] [--cache]

Data: the shared real chats (`../shared/assets/data`, as `scripts/bench/bench_data.py` reads them) replicated to
about `--conversations` conversations, with the shared Qwen3 tokenizer, `--epochs` epochs, no loader workers. The
ranks are simulated in this one process, their step all-reduce done by hand:
- per rank: each rank packs its own share, `--microbatches / --ranks` microbatches a step, the ranks
  waiting for each other at the end of the epoch;
- invariant: every rank packs all the data the same way and trains its `--microbatches / --ranks` of
  each step's `--microbatches`, steps running on across epoch ends (one rank is timed: they all do the
  same work).
Fill = document tokens / (microbatch slots x budget) over all ranks, counting the empty microbatches of
every epoch's end (per rank) or of the run's end (invariant); also without the run's last step (whose
empty slots any layout has, once per run). tokens/s per rank = the document tokens a rank trains / the seconds its pipeline takes
(tokenize, mask, pack, assemble its steps): what one rank's training can consume at most from the pipeline
of one process (loader workers take the tokenizing off it).

--cache: the documents come from a warm token cache (`chattune.data.token_cache`, built before the timing starts):
packing reads the lengths, and a rank reads only the tokens of the microbatches it trains.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from bench_data import SHARED, replicated_messages
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from chattune.data.feed import InvariantSlots, StepFeed
from chattune.data.ingest.cached_sources import open_documents
from chattune.data.ingest.formats import SourceSpec
from chattune.data.ingest.records import RecordSource
from chattune.data.stream import PackedStream, PackingBudget, StreamLayout
from chattune.data.templates.sft_documents import SFTDocuments


def drive(feeds: list[StepFeed]) -> tuple[int, int, int, int]:
    """Run the feeds (the ranks of one job) to their end: (document tokens, microbatch slots) over them, and
    the same of the run's last step alone."""
    tokens = slots = step = 0
    while not feeds[0].finished:
        step += 1
        taken = [feed.next_step(step) for feed in feeds]
        last_tokens = sum(b.num_document_tokens for t in taken for b in t.microbatches)
        last_slots = sum(len(t.microbatches) for t in taken)
        tokens, slots = tokens + last_tokens, slots + last_slots
        ranks_at_epoch_end = sum(t.epoch_end_reached for t in taken)
        for feed in feeds:
            feed.close_step(ranks_at_epoch_end)
    return tokens, slots, last_tokens, last_slots


def fills(counts: tuple[int, int, int, int], max_tokens: int) -> tuple[float, float]:
    """(fill of the run, fill of the run without its last step)."""
    tokens, slots, last_tokens, last_slots = counts
    return tokens / (slots * max_tokens), (tokens - last_tokens) / ((slots - last_slots) * max_tokens)


def per_rank(
    documents, max_tokens: int, ranks: int, microbatches: int, epochs: int
) -> tuple[tuple[float, float], float]:
    """(fills, tokens/s per rank) of per-rank packing."""
    feeds = [
        StepFeed(
            PackedStream(documents, StreamLayout(rank, ranks, num_epochs=epochs), 0, PackingBudget(max_tokens, 0)),
            microbatches // ranks,
            0,
            num_epochs=epochs,
            num_ranks=ranks,
        )
        for rank in range(ranks)
    ]
    start = time.perf_counter()
    counts = drive(feeds)
    seconds_per_rank = (time.perf_counter() - start) / ranks  # the ranks' pipelines ran one after another here
    return fills(counts, max_tokens), counts[0] / ranks / seconds_per_rank


def invariant(
    documents, max_tokens: int, ranks: int, microbatches: int, epochs: int
) -> tuple[tuple[float, float], float]:
    """(fills, tokens/s per rank) of world-size-invariant steps: the fill of all slots (one feed training all
    of them), the time of rank 0 of `ranks` (it packs everything and trains its slots)."""
    counts = drive(
        [
            StepFeed(
                PackedStream(documents, StreamLayout(num_epochs=epochs), 0, PackingBudget(max_tokens, 0)),
                microbatches,
                0,
                num_epochs=epochs,
                invariant=InvariantSlots(range(microbatches)),
            )
        ]
    )
    per_rank_slots = range(microbatches // ranks)
    start = time.perf_counter()
    mine = drive(
        [
            StepFeed(
                PackedStream(documents, StreamLayout(num_epochs=epochs), 0, PackingBudget(max_tokens, 0)),
                microbatches,
                0,
                num_epochs=epochs,
                invariant=InvariantSlots(per_rank_slots),
            )
        ]
    )[0]
    return fills(counts, max_tokens), mine / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=20000)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=8, help="per step, over all ranks")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cache", action="store_true", help="read the documents from a warm token cache")
    args = parser.parse_args()
    if args.microbatches % args.ranks:
        parser.error("--ranks must divide --microbatches")
    tokenizer = AutoTokenizer.from_pretrained(SHARED / "tokenizers" / "qwen3")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "chats.jsonl"
        path.write_text("".join(json.dumps(m) + "\n" for m in replicated_messages(args.conversations)))
        documents = SFTDocuments(RecordSource([SourceSpec(str(path))]), tokenizer, args.max_tokens, overlong="truncate")
        if args.cache:
            data = OmegaConf.create(
                {
                    "cache": str(Path(tmp) / "cache"),
                    "train_on": "assistant",
                    "overlong": "truncate",
                    "on_bad_record": "error",
                    "max_tokens_per_microbatch": args.max_tokens,
                    "num_workers": 0,
                    "share_prompts": False,
                }
            )
            documents = open_documents("sft", [SourceSpec(str(path))], tokenizer, data).sources[0]
            assert documents.cached
        print(
            "| layout | ranks | microbatches per step | epochs | fill | fill without the last step | tokens/s per rank |\n"
            "|---|---|---|---|---|---|---|"
        )
        for name, measure in (
            ("per rank (`data.microbatches_per_step=null`)", per_rank),
            (f"invariant (`data.microbatches_per_step={args.microbatches}`)", invariant),
        ):
            for ranks in sorted({1, args.ranks}):
                runs = [
                    measure(documents, args.max_tokens, ranks, args.microbatches, args.epochs)
                    for _ in range(args.repeats)
                ]
                fill, steady = runs[0][0]
                assert all(r[0] == runs[0][0] for r in runs), "the same data packs the same way every time"
                print(
                    f"| {name} | {ranks} | {args.microbatches} | {args.epochs} | {fill:.4f} | {steady:.4f} | "
                    f"{max(r[1] for r in runs):,.0f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
