"""Training throughput of an SFT config for 1 and 2 ranks (torchrun), from the run's own metrics.jsonl.

    python scripts/bench/bench_train.py [--ranks 1 2] [--steps 60] [--warmup 10] [-- key=value ...]

Runs `recipes/sft.py` (default config `sft/tiny`) once per rank count with `log_every=1`, drops the
first `--warmup` steps, and reports the mean over the rest of: trainable tokens/s (`tokens_per_sec`),
all tokens/s (prompts included) and step time. Extra arguments after `--` are passed to the recipe as
overrides. Copy the printed table and command into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from chattune.launch.torchrun import torchrun_command

ROOT = Path(__file__).resolve().parents[2]  # the project: scripts/bench/ is two below it


def run_once(ranks: int, steps: int, overrides: list[str], output_dir: Path) -> list[dict]:
    command = [
        *torchrun_command(str(ROOT / "recipes" / "sft.py"), nproc=ranks),
        f"output_dir={output_dir}",
        f"max_steps={steps}",
        "log_every=1",
        "save_every=0",
        "eval_every=0",
        *overrides,
    ]
    result = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    if result.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("overrides", nargs="*", help="recipe overrides, after --")
    args = parser.parse_args()

    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
        + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "")
    )
    print(f"command: python scripts/bench/bench_train.py {' '.join(sys.argv[1:])}")
    print("| ranks | trainable tokens/s | all tokens/s | step time (s) | steps measured |")
    print("|---|---|---|---|---|")
    for ranks in args.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            metrics = run_once(ranks, args.steps, args.overrides, Path(tmp) / "run")[args.warmup :]
        trainable = sum(m["num_tokens"] for m in metrics)
        seconds = sum(m["step_time_s"] for m in metrics)
        all_tokens = sum(m["all_tokens_per_sec"] * m["step_time_s"] for m in metrics)
        print(
            f"| {ranks} | {trainable / seconds:,.0f} | {all_tokens / seconds:,.0f} | "
            f"{statistics.mean(m['step_time_s'] for m in metrics):.3f} | {len(metrics)} |"
        )


if __name__ == "__main__":
    main()
