"""What fits where, from the memory estimate (`chattune.model.cost.memory`): three model shapes (Qwen3-0.6B, Llama-3.1-8B,
Qwen2.5-32B widths) x full fine-tuning, LoRA and QLoRA x 24/48/80 GiB GPUs, each with its peak per rank and, where it does
not fit, the changes the estimate advises. bf16 compute, fp32 AdamW, 2048 tokens a microbatch. Also the optimizer
states' bytes per trained parameter for each optimizer. Shapes only: nothing is downloaded or loaded.

    python scripts/bench/what_fits.py [--ranks 1]
"""

from __future__ import annotations

import argparse
import re
from dataclasses import replace

import torch
from transformers import LlamaConfig, Qwen2Config, Qwen3Config

from chattune.model.cost.memory import GiB, MemoryInputs, estimate
from chattune.model.cost.memory_advice import ways_to_fit

SHAPES = {
    "0.6B (Qwen3-0.6B)": lambda: Qwen3Config(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    "8B (Llama-3.1-8B)": lambda: LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
    "32B (Qwen2.5-32B)": lambda: Qwen2Config(
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=27648,
        num_hidden_layers=64,
        num_attention_heads=40,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
}
DEVICES = {"24 GiB": 24 * GiB, "48 GiB": 48 * GiB, "80 GiB": 80 * GiB}
OPTIMIZERS = ("torch.optim.AdamW", "torchao.optim.AdamW8bit", "torchao.optim.AdamW4bit", "torchao.optim.AdamWFp8")


def advice(inputs: MemoryInputs, device: int) -> str:
    estimated = estimate(inputs)
    if estimated.total is None:
        return "not estimated"
    if estimated.total <= device:
        return f"fits ({estimated.total / GiB:.1f})"
    lines = ways_to_fit(inputs, device, estimated)
    if lines[0].startswith("changes that make it fit"):
        cheapest = re.split(r"\s{2,}", lines[1].strip())[0]  # the setting, before its padding and peak
        return f"{estimated.total / GiB:.0f}: {cheapest}"
    if lines[0].startswith("no single change"):
        return f"{estimated.total / GiB:.0f}: " + " + ".join(line.split("  (")[0].strip() for line in lines[1:])
    return f"{estimated.total / GiB:.0f}: does not fit"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1)
    ranks = parser.parse_args().ranks
    print(f"peak GiB per rank on {ranks} rank(s), and the cheapest change(s) that fit where it does not:\n")
    print("| model | training | " + " | ".join(DEVICES) + " |")
    print("|---|---|" + "---|" * len(DEVICES))
    for name, make in SHAPES.items():
        for training, lora, four_bit in (("full", None, False), ("LoRA r16", 16, False), ("QLoRA r16", 16, True)):
            inputs = MemoryInputs(
                make(),
                ranks=ranks,
                tokens=2048,
                compute_dtype=torch.bfloat16,
                lora_rank=lora,
                lora_targets=("all-linear",),
                quantized_base=four_bit,
            )
            cells = [advice(inputs, device) for device in DEVICES.values()]
            print(f"| {name} | {training} | " + " | ".join(cells) + " |")
    print("\noptimizer states, bytes per trained parameter (8B shape, full, 1 rank):\n")
    print("| optimizer | bytes per parameter |")
    print("|---|---|")
    inputs = MemoryInputs(SHAPES["8B (Llama-3.1-8B)"](), ranks=1, tokens=2048, compute_dtype=torch.bfloat16)
    parameters = estimate(inputs).rows["parameters (fp32 shards)"] / 4
    for optimizer in OPTIMIZERS:
        states = estimate(replace(inputs, optimizer=optimizer)).rows["optimizer states"]
        print(f"| {optimizer} | {states / parameters:.3f} |")


if __name__ == "__main__":
    main()
