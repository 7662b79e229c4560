"""Data-pipeline throughput and pack fill: tokenize + assistant mask + pack, chattune vs TRL.

    python scripts/bench/bench_data.py [--conversations 20000] [--max-tokens 4096] [--repeats 3]

Data: the shared real chats (`../shared/assets/data`: the ShareGPT chats and the long messages-format
conversations) replicated to about `--conversations` conversations, with the shared Qwen3 tokenizer.

- chattune: `SFTDocuments` + `PackedStream` (one rank, one epoch), with 0 and 2 loader workers;
  assistant-only masks; conversations over the budget truncated (as TRL does) or dropped (counted).
- TRL (only when `trl` is importable; install it in a separate benchmark environment, never as a
  chattune dependency): `SFTTrainer`'s own dataset preparation (tokenize + BFD packing) on the same
  conversations, with 1 and 2 processes (its BFD packing truncates conversations over the budget). TRL's
  assistant masks need `{% generation %}` markers, so it runs without them here: it does less work per
  conversation than chattune.

Throughput counts the tokens that end up in packed microbatches; fill = those tokens / (rows x budget).
Every row runs `--repeats` times, the rows taking turns (so a slow spell of a shared machine falls on all
of them), and each row's best run is reported. The last lines compare like-for-like (truncating) rows:
their best runs, and within each round (chattune's best row over TRL's best row of the same round).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import tempfile
import time
from pathlib import Path

import datasets
from transformers import AutoTokenizer

from chattune.data.ingest.formats import SourceSpec, to_conversation
from chattune.data.ingest.records import RecordSource
from chattune.data.stream import PackedStream, PackingBudget, StreamLayout
from chattune.data.templates.sft_documents import SFTDocuments

SHARED = Path(__file__).resolve().parents[3] / "shared" / "assets"  # ../shared/assets of the project


def replicated_messages(count: int) -> list[dict]:
    sources = [
        SourceSpec(str(SHARED / "data" / "sharegpt_fastchat_dummy.json"), format="sharegpt"),
        SourceSpec(str(SHARED / "data" / "messages_deita_long.parquet")),
    ]
    records = RecordSource(sources)
    conversations = []
    for index in range(len(records)):
        spec, where, record = records.locate(index)
        conversations.append({"messages": to_conversation(record, spec, where).messages})
    return [conversations[i % len(conversations)] for i in range(count)]


def bench_chattune(path: str, tokenizer, max_tokens: int, num_workers: int, overlong: str) -> tuple[float, float, int]:
    start = time.perf_counter()
    documents = SFTDocuments(RecordSource([SourceSpec(path)]), tokenizer, max_tokens, overlong=overlong)
    stream = PackedStream(
        documents, StreamLayout(num_epochs=1), 0, PackingBudget(max_tokens, 0), num_workers=num_workers
    )
    sizes = [batch.num_tokens for batch in stream]
    seconds = time.perf_counter() - start
    over = sum(stream.skipped.values()) + sum(stream.overlong.values())
    return sum(sizes) / seconds, sum(sizes) / (len(sizes) * max_tokens), over


def bench_trl(path: str, tokenizer, max_tokens: int, num_proc: int | None) -> tuple[float, float]:
    from trl import SFTConfig, SFTTrainer

    datasets.disable_caching()  # or a second run would read the first one's result from disk
    dataset = datasets.load_dataset("json", data_files=path, split="train")

    class _Trainer:  # the attributes _prepare_dataset reads from its trainer
        _tokenizer, chat_template, completion_only_loss = tokenizer, None, None

    with tempfile.TemporaryDirectory() as tmp:
        args = SFTConfig(
            output_dir=tmp,
            max_length=max_tokens,
            packing=True,
            packing_strategy="bfd",
            dataset_num_proc=num_proc,
            report_to=[],
            bf16=False,
            use_cpu=True,
        )
        start = time.perf_counter()
        packed = SFTTrainer._prepare_dataset(_Trainer(), dataset, tokenizer, args, True, None, "train")
        seconds = time.perf_counter() - start
    tokens = sum(len(ids) for ids in packed["input_ids"])
    return tokens / seconds, tokens / (len(packed) * max_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=20000)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not SHARED.exists():
        raise SystemExit(f"needs the shared test assets at {SHARED}")

    logging.getLogger("chattune").setLevel(logging.ERROR)  # one warning per dropped conversation otherwise
    datasets.disable_progress_bars()
    tokenizer = AutoTokenizer.from_pretrained(SHARED / "tokenizers" / "qwen3")
    try:
        import trl
    except ImportError:
        trl = None
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "chats.jsonl")
        Path(path).write_text("".join(json.dumps(c) + "\n" for c in replicated_messages(args.conversations)))
        # TRL's BFD packing truncates what is over the budget ("truncate" is its default overflow policy).
        rows = {}
        for overlong, workers in (("truncate", 0), ("truncate", 2), ("drop", 0), ("drop", 2)):
            where = "in-process" if workers == 0 else f"{workers} workers"
            rows[("chattune", overlong, where)] = functools.partial(
                bench_chattune, path, tokenizer, args.max_tokens, workers, overlong
            )
        if trl is not None:
            for num_proc in (None, 2):
                rows[("trl", "truncate", str(num_proc or 1))] = functools.partial(
                    bench_trl, path, tokenizer, args.max_tokens, num_proc
                )
        best: dict[tuple, tuple] = {}
        rounds: list[dict[tuple, float]] = []
        for _ in range(args.repeats):
            rounds.append({})
            for row, run in rows.items():
                result = run()
                rounds[-1][row] = result[0]
                if row not in best or result[0] > best[row][0]:
                    best[row] = result
        print(
            f"{args.conversations} conversations, Qwen3 tokenizer, budget {args.max_tokens} tokens, best of {args.repeats}"
        )
        print("| pipeline | processes | tokens/s | fill |")
        print("|---|---|---|---|")
        for (name, overlong, where), (rate, fill, *over) in best.items():
            if name == "chattune":
                done = "truncated" if overlong == "truncate" else "dropped"
                label = f"chattune (assistant masks; {over[0]} over-budget {done})"
            else:
                label = f"TRL {trl.__version__} SFT preparation (no assistant masks)"
            print(f"| {label} | {where} | {rate:,.0f} | {fill:.4f} |")
        if trl is None:
            print("(trl not importable: no TRL reference)")
            return

        def ratio(rates: dict[tuple, float]) -> float:
            ours = max(
                rate for (name, overlong, _), rate in rates.items() if name == "chattune" and overlong == "truncate"
            )
            return ours / max(rate for (name, *_), rate in rates.items() if name == "trl")

        print(f"chattune / TRL, best runs: {ratio({row: result[0] for row, result in best.items()}):.2f}x")
        per_round = sorted(ratio(rates) for rates in rounds)
        print(
            f"chattune / TRL within each round: {', '.join(f'{r:.2f}x' for r in per_round)} "
            f"(median {per_round[len(per_round) // 2]:.2f}x)"
        )


if __name__ == "__main__":
    main()
