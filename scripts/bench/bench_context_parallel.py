"""Context parallelism on the CPU: peak host memory per rank and step time for one long document, on C=1 and C=2.

    python scripts/bench/bench_context_parallel.py [--tokens 16384] [--contexts 1 2] [--steps 3]

One document of `--tokens` tokens (random ids, its last three quarters trained) is one packed row; each run spawns
C ranks on gloo that form one context group (`parallel.context=C`: each rank computes N/C tokens of the row) and
train `--steps` optimizer steps of a random-init Qwen3-shaped model (hidden 256, 2 layers, 4 query and 2 kv heads
of 64, the demo tokenizer's vocabulary) under FSDP2 over the group, through chattune's own update step. Reported per rank:
the resident set before the first step (imports, the model's shard, the row) and the process's peak resident set
(VmHWM), so that the difference is what training adds: activations, gathered weights, gradients, the optimizer's
state (freed memory is not always returned to the system between steps, so only the peak is compared); and the
mean time of the steps after the first.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp

PROJECT_ROOT = Path(__file__).resolve().parents[2]  # scripts/bench/ is two below it
sys.path.insert(0, str(PROJECT_ROOT))
# Small enough that a 16k-token step takes a minute on 2 CPU cores: attention's work grows as N^2.
MODEL = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=65536,
    tie_word_embeddings=True,
)


def resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_resident_mib() -> float:
    """VmHWM: the largest resident set since the process started."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def worker(rank: int, context: int, port: int, tokens: int, steps: int, out: str, threads: int | None) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(context),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(context),
    )
    from transformers import AutoConfig, AutoTokenizer

    from chattune.config.paths import DEMO_ASSETS
    from chattune.config.schema import ParallelConfig
    from chattune.data.documents import IGNORE_INDEX, Document
    from chattune.data.feed import StepBatches
    from chattune.data.packing import collate_packed
    from chattune.distributed import init_distributed, shutdown_distributed
    from chattune.model.causal_lm import PackedCausalLM, build_hf_model
    from chattune.objectives.cross_entropy import TokenCrossEntropy
    from chattune.parallel.fsdp import shard_model
    from chattune.train.step import UpdateRule, train_step

    dims = init_distributed("cpu", ParallelConfig(context=context))  # (threads: the cores over the ranks)
    if threads:
        torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(DEMO_ASSETS / "tokenizer")
    torch.manual_seed(0)
    hf_model = build_hf_model(tokenizer, AutoConfig.for_model("qwen3", **MODEL))
    model = PackedCausalLM(hf_model, context_group=dims.cp_group)
    placement = shard_model(model, dims)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    ids = np.random.default_rng(0).integers(16, len(tokenizer), size=tokens)
    labels = np.full(tokens, IGNORE_INDEX)
    labels[tokens // 4 : -1] = ids[tokens // 4 + 1 :]
    row = collate_packed([Document(0, ids, labels)])
    times, losses = [], []
    before = resident_mib()  # imports, the model's shard and the row
    for _ in range(steps):
        start = time.perf_counter()
        result, _ = train_step(
            model, TokenCrossEntropy(), StepBatches([row]), UpdateRule(optimizer, scheduler, 1.0), placement
        )
        times.append(time.perf_counter() - start)
        losses.append(result.loss_sum / max(result.global_units, 1))
    peak = peak_resident_mib()
    torch.save({"before": before, "peak": peak, "times": times, "losses": losses}, f"{out}.rank{rank}")
    shutdown_distributed()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=3, help="at least 2: the first one is not measured")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cores / ranks)")
    args = parser.parse_args()
    from chattune.distributed import free_port

    print(f"one document of {args.tokens} tokens, Qwen3-shaped {MODEL}, {args.steps} steps, {os.cpu_count()} cores")
    print(
        "| parallel.context | ranks | resident before training (MiB/rank) | peak (MiB/rank) | peak - before | step time (s) | first loss |"
    )
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for context in args.contexts:
            out = f"{tmp}/c{context}"
            mp.spawn(
                worker,
                args=(context, free_port(), args.tokens, args.steps, out, args.threads),
                nprocs=context,
                join=True,
            )
            ranks = [torch.load(f"{out}.rank{r}") for r in range(context)]
            before = max(r["before"] for r in ranks)
            peak = max(r["peak"] for r in ranks)
            step = float(np.mean([t for r in ranks for t in r["times"][1:]] or [r["times"][0] for r in ranks]))
            print(
                f"| {context} | {context} | {before:.0f} | {peak:.0f} | {peak - before:.0f} | {step:.2f} | "
                f"{ranks[0]['losses'][0]:.6f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
