"""Hybrid models on the CPU: what the exact per-document path of `chattune.model.packed.mixers` costs.

    python scripts/bench/bench_hybrid.py [--tokens 2048] [--documents 8] [--steps 5] [--warmup 2] [--threads N]

Token mixers other than attention (Qwen3.5's gated delta rule, LFM2's short convolutions) run once per
document of a packed row on the CPU, a Python loop per layer: this measures what that costs in training speed.
Each model is random-init from a transformers config (no downloads; the demo tokenizer's 1,024-token
vocabulary, hidden 256, 4 layers, fp32) and trained on one packed row through `PackedCausalLM`: tokens/s of
forward + backward of the mean token loss, the median of --steps timed steps after --warmup untimed ones.

- the models, on a row of --documents documents of mixed lengths (fixed seed) adding up to --tokens:
  Qwen3 (attention only), Qwen3.5 (3 gated-delta-rule layers then 1 attention layer, its 3:1 pattern) and
  LFM2 (3 short-convolution layers then 1 attention layer), sizes chosen so the parameter counts are close;
- the per-document overhead: the same models on one document of --tokens tokens per row. Attention also
  changes there (one long document is quadratic work), so each kind of mixer alone (the first gated-delta-rule
  layer, the first short-convolution layer: forward + backward on random hidden states) is timed on both
  rows too: that difference is the loop's (and, for the delta rule, its padding of each document to 64-token
  chunks).

The steps are timed in rounds (one of each per round), so that another process's load falls on all of them
alike, and the cores other processes used meanwhile are printed (from /proc/stat).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project: scripts/bench/ is two below it
from chattune.config.paths import DEMO_ASSETS  # noqa: E402
from chattune.data.documents import Document  # noqa: E402
from chattune.data.packing import collate_packed  # noqa: E402
from chattune.model.causal_lm import PackedCausalLM, build_hf_model  # noqa: E402
from chattune.model.packed.mixers import isolate_documents  # noqa: E402

COMMON = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
)
MODELS = {  # name -> (model_type, overrides); qwen3's wider MLP makes up for the other two's mixer weights
    "Qwen3 (attention only)": ("qwen3", dict(intermediate_size=832)),
    "Qwen3.5 (3 gated delta rule + 1 attention)": (
        "qwen3_5_text",
        dict(
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
        ),
    ),
    "LFM2 (3 short conv + 1 attention)": (
        "lfm2",
        dict(layer_types=["conv"] * 3 + ["full_attention"], block_ff_dim=768, block_auto_adjust_ff_dim=False),
    ),
}
ATTENTION_ONLY, HYBRID, LFM2 = MODELS


def document_lengths(tokens: int, documents: int, seed: int = 0) -> list[int]:
    """`documents` lengths from 0.25 to 1.75 times the mean, adding up to `tokens`."""
    weights = np.random.default_rng(seed).uniform(0.25, 1.75, documents)
    lengths = [int(w) for w in weights / weights.sum() * tokens]
    lengths[-1] += tokens - sum(lengths)
    return lengths


def packed_row(lengths: list[int], vocab: int, seed: int = 0):
    """One packed row of random tokens, every token trained (labels: the next token of its document)."""
    rng = np.random.default_rng(seed)
    documents = []
    for i, n in enumerate(lengths):
        ids = rng.integers(0, vocab, n)
        documents.append(Document(doc_id=i, input_ids=ids, labels=np.append(ids[1:], -100)))
    return collate_packed(documents)


def build(name: str, tokenizer):
    model_type, overrides = MODELS[name]
    torch.manual_seed(0)
    hf_model = build_hf_model(tokenizer, AutoConfig.for_model(model_type, **{**COMMON, **overrides}))
    isolate_documents(hf_model)  # the per-document path (`packed_hidden_states` does it too; the mixers alone need it)
    return PackedCausalLM(hf_model)


def busy_seconds() -> tuple[float, float]:
    """CPU seconds used so far by the whole machine and by this process (Linux /proc), to tell other load apart."""
    tick = os.sysconf("SC_CLK_TCK")
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    machine = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
    own = sum(int(x) for x in Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[11:13])
    return machine / tick, own / tick


def median_seconds(steps: dict[tuple, Callable], count: int, warmup: int) -> tuple[dict[tuple, float], float]:
    """{name: median seconds of a step}, the steps timed in turn (one of each per round, so that load from
    other processes spreads over all of them), and the cores other processes used meanwhile."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    times = {name: [] for name in steps}
    machine, own, wall = *busy_seconds(), time.perf_counter()
    for _ in range(count):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    machine_after, own_after = busy_seconds()
    others = ((machine_after - machine) - (own_after - own)) / (time.perf_counter() - wall)
    return {name: statistics.median(t) for name, t in times.items()}, others


def train_step(model: PackedCausalLM, batch):
    def step():
        model.zero_grad(set_to_none=True)
        losses = model(batch)
        (losses.sum() / batch.num_trainable_tokens).backward()

    return step


def mixer_step(mixer: torch.nn.Module, batch):
    """Forward + backward of one mixer alone (its projections included), on the row's (random) hidden states."""
    hidden = torch.randn(1, batch.num_tokens, COMMON["hidden_size"], generator=torch.Generator().manual_seed(0))

    def step():
        mixer.zero_grad(set_to_none=True)
        output = mixer(hidden.requires_grad_(), cu_seq_lens_q=batch.cu_seqlens)
        # .sum(), not .mean(): with random-init weights, gradients 1/N times smaller went denormal (slow on x86).
        output[0].sum().backward()  # [0]: the hidden states of a tuple, or the batch's only row

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(DEMO_ASSETS / "tokenizer")
    lengths = document_lengths(args.tokens, args.documents)
    rows = {
        f"{args.documents} documents": packed_row(lengths, len(tokenizer)),
        "1 document": packed_row([args.tokens], len(tokenizer)),
    }
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32; rows of {args.tokens} tokens; "
        f"document lengths {lengths}; median of {args.steps} steps after {args.warmup}\n"
    )

    models = {name: build(name, tokenizer) for name in MODELS}
    steps = {(name, row): train_step(model, batch) for row, batch in rows.items() for name, model in models.items()}
    mixers = [models[HYBRID].hf_model.model.layers[0].linear_attn, models[LFM2].hf_model.model.layers[0].conv]
    steps |= {
        (f"{type(mixer).__name__} alone", row): mixer_step(mixer, batch)
        for row, batch in rows.items()
        for mixer in mixers
    }
    seconds, others = median_seconds(steps, args.steps, args.warmup)
    rate = {key: args.tokens / value for key, value in seconds.items()}

    print("| model | parameters | layers | row | tokens/s | relative to attention only (same row) |")
    print("|---|---|---|---|---|---|")
    for (name, row), value in rate.items():
        if name in models:
            params = sum(p.numel() for p in models[name].parameters())
            print(
                f"| {name} | {params / 1e6:.2f}M | {COMMON['num_hidden_layers']} | {row} | {value:,.0f} | "
                f"{value / rate[ATTENTION_ONLY, row]:.2f} |"
            )
    packed, alone = rows
    print(f"\nper-document overhead: tokens/s on the {packed} row / on the {alone} row (forward + backward)")
    for name in [*models, *(f"{type(mixer).__name__} alone" for mixer in mixers)]:
        print(
            f"- {name}: {rate[name, packed]:,.0f} / {rate[name, alone]:,.0f} = "
            f"{rate[name, packed] / rate[name, alone]:.2f}"
        )
    print(f"\nother processes used {others:.2f} cores on average while the steps were timed")


if __name__ == "__main__":
    main()
