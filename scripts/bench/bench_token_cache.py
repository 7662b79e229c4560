"""The token cache (`data.cache`): how long a first build takes, how fast a warm cache starts, its size on disk,
and how a memory map reads documents against `datasets`' Arrow files.

    python scripts/bench/bench_token_cache.py [--records 1000000] [--builds 1x0,1x2,2x0,2x2]

Data: `--records` short chats, the demo chats (chattune/assets/demo, 2-6 turns) repeated, each made distinct by
its number, tokenized with the shared Qwen3 tokenizer (`../shared/assets`) at a 4096-token budget.
- Build, per `RANKSxWORKERS`: ranks are processes of a gloo group (torch.multiprocessing), each building its
  share of the records with WORKERS loader processes, through `chattune.data.ingest.cached_sources.open_documents`, the
  recipes' own call; timed on rank 0 from the call to its return (hashing the file included), on a cold cache.
- Warm start: a new process opens the warm cache (hashes the file and the tokenizer, reads the index) and packs
  the first microbatch of a world-size-invariant stream; the imports and the tokenizer's loading are given apart.
- Read speed: 20,000 random documents, from the cache's memory maps against an Arrow dataset of the same
  documents (`datasets`, numpy format).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch.multiprocessing as mp

PROJECT = Path(__file__).resolve().parents[2]  # scripts/bench/ is two below it
SHARED = PROJECT.parent / "shared" / "assets"
QWEN3 = SHARED / "tokenizers" / "qwen3"
BUDGET = 4096


def write_chats(path: Path, records: int) -> None:
    demo = [json.loads(line) for line in (PROJECT / "chattune/assets/demo/chat_train.jsonl").read_text().splitlines()]
    with open(path, "w") as f:
        for i in range(records):
            record = demo[i % len(demo)]
            messages = [dict(m) for m in record["messages"]]
            messages[0]["content"] = f"[{i}] {messages[0]['content']}"
            f.write(json.dumps({"messages": messages}) + "\n")


def data_section(cache: Path, workers: int):
    from omegaconf import OmegaConf

    return OmegaConf.create(
        {
            "cache": str(cache),
            "train_on": "assistant",
            "overlong": "truncate",
            "on_bad_record": "error",
            "max_tokens_per_microbatch": BUDGET,
            "num_workers": workers,
            "share_prompts": False,
        }
    )


def _build_rank(rank: int, world: int, port: int, path: str, cache: str, workers: int, result: str) -> None:
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from chattune.data.ingest.cached_sources import open_documents
    from chattune.data.ingest.formats import SourceSpec

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    tokenizer = AutoTokenizer.from_pretrained(QWEN3)
    dist.barrier()
    start = time.perf_counter()
    documents = open_documents("sft", [SourceSpec(path)], tokenizer, data_section(Path(cache), workers))
    seconds = time.perf_counter() - start
    if rank == 0:
        Path(result).write_text(json.dumps({"seconds": seconds, **documents.sources[0].manifest}))
    dist.destroy_process_group()


def build(path: Path, cache: Path, ranks: int, workers: int) -> dict:
    from chattune.distributed import free_port

    shutil.rmtree(cache, ignore_errors=True)
    result = cache.parent / "build.json"
    mp.spawn(_build_rank, args=(ranks, free_port(), str(path), str(cache), workers, str(result)), nprocs=ranks)
    return json.loads(result.read_text())


WARM = r"""
import json, sys, time
started = time.perf_counter()
from pathlib import Path
from transformers import AutoTokenizer
from chattune.data.ingest.cached_sources import open_documents
from chattune.data.ingest.formats import SourceSpec
from chattune.data.stream import PackedStream, PackingBudget, StreamLayout
sys.path.insert(0, "scripts/bench")  # (run from the project root)
from bench_token_cache import data_section
tokenizer = AutoTokenizer.from_pretrained(sys.argv[3])
imported = time.perf_counter()
documents = open_documents("sft", [SourceSpec(sys.argv[1])], tokenizer, data_section(Path(sys.argv[2]), 0), build=False)
assert documents.cached
opened = time.perf_counter()
first = next(iter(PackedStream(documents, StreamLayout(), 0, PackingBudget(4096, 0, None, 256))))
ready = time.perf_counter()
print(json.dumps({"imports_and_tokenizer": imported - started, "open": opened - imported, "first_microbatch": ready - opened}))
"""


def warm_start(path: Path, cache: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", WARM, str(path), str(cache), str(QWEN3)],
        cwd=PROJECT,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def read_speeds(cache: Path, count: int = 20_000) -> tuple[float, float]:
    """(documents/s from the memory maps, from an Arrow dataset of the same documents)."""
    import datasets
    import numpy as np

    from chattune.data.token_cache import CachedDocuments

    (directory,) = [p for p in cache.iterdir() if not p.name.startswith(".")]
    cached = CachedDocuments(directory)
    picks = random.Random(0).sample(range(len(cached)), count)
    start = time.perf_counter()
    for i in picks:
        (d,) = cached.get_many([i])
        np.asarray(d.input_ids).sum(), np.asarray(d.labels).sum()  # read the tokens
    mapped = count / (time.perf_counter() - start)
    first = list(range(min(len(cached), 200_000)))
    docs = cached.get_many(first)
    table = datasets.Dataset.from_dict(
        {"ids": [d.input_ids.tolist() for d in docs], "labels": [d.labels.tolist() for d in docs]}
    )
    with tempfile.TemporaryDirectory() as tmp:
        table.save_to_disk(tmp)
        arrow = datasets.load_from_disk(tmp).with_format("numpy")
        picks = random.Random(0).sample(first, count)
        start = time.perf_counter()
        for i in picks:
            row = arrow[i]
            row["ids"].sum(), row["labels"].sum()
        arrowed = count / (time.perf_counter() - start)
    return mapped, arrowed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--builds", default="1x0,1x2,2x0,2x2", help="RANKSxWORKERS, comma-separated")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path, cache = Path(tmp) / "chats.jsonl", Path(tmp) / "cache"
        write_chats(path, args.records)
        print(f"{args.records:,} chats, {path.stat().st_size / 2**20:,.0f} MiB of JSONL\n")
        print("| build | seconds | records/s | tokens/s |\n|---|---|---|---|")
        for spec in args.builds.split(","):
            ranks, workers = map(int, spec.split("x"))
            got = build(path, cache, ranks, workers)
            print(
                f"| {ranks} rank(s) x {workers} worker(s) | {got['seconds']:.1f} | {got['records'] / got['seconds']:,.0f} | "
                f"{got['tokens'] / got['seconds']:,.0f} |",
                flush=True,
            )
        size = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
        print(
            f"\ncache: {got['documents']:,} documents, {got['tokens']:,} tokens, {size / 2**20:,.1f} MiB on disk = "
            f"{size / 2**20 / (got['tokens'] / 1e6):.2f} MiB per million tokens"
        )
        warm = [warm_start(path, cache) for _ in range(3)]
        best = min(warm, key=lambda w: w["open"] + w["first_microbatch"])
        print(
            f"warm start (best of 3): open {best['open']:.2f} s + first microbatch {best['first_microbatch']:.2f} s "
            f"(imports and the tokenizer's loading before it: {best['imports_and_tokenizer']:.1f} s)"
        )
        mapped, arrowed = read_speeds(cache)
        print(f"random document reads: memory maps {mapped:,.0f}/s, Arrow (datasets, numpy format) {arrowed:,.0f}/s")


if __name__ == "__main__":
    main()
