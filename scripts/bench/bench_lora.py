"""LoRA against full fine-tuning, SFT and DPO, on the CPU: trained parameters, peak host memory per rank,
tokens/s.

    python scripts/bench/bench_lora.py [--nproc 2] [--steps 8] [--set key=value ...]

Each run is the recipe itself under torchrun, in a fresh subprocess, with a model built from
model directory made first (a random-init 127M-parameter Llama: hidden 1024, 8 layers, the demo
tokenizer's vocabulary), loaded as any model.path is (meta build, each rank its shard), so that weights,
gradients and optimizer state are visible next to the ~0.5 GiB a process starts with. Peak memory is the largest
resident set of any process of the run (`getrusage(RUSAGE_CHILDREN)`, which covers torchrun's workers);
tokens/s is the mean `all_tokens_per_sec` of the steps after the first two.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from chattune.launch.torchrun import torchrun_command

PROJECT_ROOT = Path(__file__).resolve().parents[2]  # scripts/bench/ is two below it
MODEL = dict(
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)
RUNS = {  # name -> (recipe, overrides)
    "sft full": ("sft", []),
    "sft lora r16": ("sft", ["peft=lora"]),
    "dpo full (live reference: a second model)": ("dpo", []),
    "dpo lora r16 (reference: the base, adapters off)": ("dpo", ["peft=lora"]),
}


def make_base(directory: Path) -> None:
    """A random-init Llama of the MODEL shape with the demo tokenizer's vocabulary, as a model directory."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(PROJECT_ROOT))
    from chattune.config.paths import DEMO_ASSETS

    tokenizer = AutoTokenizer.from_pretrained(DEMO_ASSETS / "tokenizer")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), **MODEL)).save_pretrained(directory)


def one_run(recipe: str, overrides: list[str], nproc: int) -> None:
    """In its own process: run the recipe, print one JSON line of figures."""
    with tempfile.TemporaryDirectory() as out:
        result = subprocess.run(
            [
                *torchrun_command(f"recipes/{recipe}.py", nproc=nproc, port=29633),
                f"output_dir={out}",
                "eval_every=0",
                "save_every=0",
                "log_every=1",
                "data.report_records=0",
                "progress=lines",
                *overrides,
            ],
            cwd=PROJECT_ROOT,
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise SystemExit(result.stdout[-2000:] + result.stderr[-4000:])
        metrics = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    trained = re.search(r"parameters \(([\d.]+)M trained\)", result.stdout + result.stderr)
    rates = [m["all_tokens_per_sec"] for m in metrics if m["step"] > 2]
    print(
        json.dumps(
            {
                "trained_millions": float(trained.group(1)) if trained else None,
                "peak_rss_gib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20,
                "all_tokens_per_sec": sum(rates) / len(rates),
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--set", nargs="*", default=[], help="more overrides for every run")
    parser.add_argument("--one", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        one_run(args.one[0], args.one[1:], args.nproc)
        return
    base = Path(tempfile.mkdtemp()) / "base"
    make_base(base)
    common = [f"model.path={base}", f"max_steps={args.steps}", "data.max_tokens_per_microbatch=1024", *args.set]
    print("| run | trained parameters | peak RSS per rank | all tokens/s |\n|---|---|---|---|")
    for name, (recipe, overrides) in RUNS.items():
        line = (
            subprocess.run(
                [sys.executable, __file__, "--nproc", str(args.nproc), "--one", recipe, *common, *overrides],
                capture_output=True,
                text=True,
                check=True,
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        figures = json.loads(line)
        print(
            f"| {name} | {figures['trained_millions']:.2f}M | {figures['peak_rss_gib']:.2f} GiB | "
            f"{figures['all_tokens_per_sec']:,.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
