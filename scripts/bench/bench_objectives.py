"""Step time and tokens/s of each preference objective against DPO (sigmoid, live reference), on the same demo
preference pairs, packed, CPU or GPU, from each run's own metrics.jsonl.

    python scripts/bench/bench_objectives.py [--steps 40] [--warmup 10] [--rounds 3] [--ranks 1] [--only NAME ...]
                                       [-- key=value ...]

Every run starts from a random-initialised tiny model (`model.path=null`: `model.config` of sft/tiny, so no SFT run
is needed first; the reward recipe puts its score head on it) and trains `--steps` steps on
chattune/assets/demo/preference_train.jsonl with `log_every=1`, no checkpoints, no evaluation. The first `--warmup`
steps are dropped. The objectives run interleaved: each round runs every objective once, in the same order, so
that a busy spell of a shared machine falls on all of them; the table gives, per objective, the median over the
rounds of each run's figures (and the range of the step times). Each run's figures are medians over its measured
steps (`summarise`): on a shared machine some steps run many times slower while another job holds the cores.

Columns:
- step time: the median of the measured steps' `step_time_s` (the mean beside it; forward, backward and optimizer step; KTO's no-grad
  pass and every reference forward included; a cached reference's pass before training is not: it is reported
  apart, as the wall time before step 1).
- trainable tokens/s: the median of the metrics' `tokens_per_sec`, the objective's `num_tokens` (the scored reply tokens, with
  their end-of-turn token: both replies of a DPO/reward pair, the completion of a KTO example; prompts and KTO's
  mismatched sequences not counted) per second of step time.
- all tokens/s: the median of `all_tokens_per_sec`, every token of the step's packed microbatches (prompts, both sides, KTO's
  mismatched sequences, padding if any) per second of step time.
- units/step: pairs (DPO, reward) or examples (KTO, two a pair: the chosen reply desirable, the rejected one
  undesirable); tokens/step: all tokens per step (what the model's forward runs over).
- × DPO: step time over DPO sigmoid's (live reference) in the same table.
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
import time
from pathlib import Path

import torch

from chattune.launch.torchrun import torchrun_command

ROOT = Path(__file__).resolve().parents[2]  # the project: scripts/bench/ is two below it
BASELINE = "dpo-sigmoid"

# name -> (recipe, overrides, description). {cache} is a reference-cache directory shared by the benchmark's runs.
OBJECTIVES: dict[str, tuple[str, list[str], str]] = {
    "dpo-sigmoid": ("dpo", ["loss.type=sigmoid"], "DPO sigmoid, live reference"),
    "dpo-sigmoid-cached": (
        "dpo",
        ["loss.type=sigmoid", "reference.cache=true", "reference.cache_dir={cache}"],
        "DPO sigmoid, `reference.cache=true`",
    ),
    "dpo-ipo": ("dpo", ["loss.type=ipo"], "DPO ipo, live reference"),
    "simpo": ("dpo", ["loss.type=simpo"], "SimPO (no reference)"),
    "orpo": ("dpo", ["loss.type=orpo"], "ORPO (no reference)"),
    "reward": ("reward", [], "reward model (score head, no reference)"),
    "kto": ("kto", [], "KTO, live reference"),
    "kto-cached": (
        "kto",
        ["reference.cache=true", "reference.cache_dir={cache}"],
        "KTO, `reference.cache=true`",
    ),
}


def run_once(
    recipe: str, ranks: int, steps: int, overrides: list[str], output_dir: Path
) -> tuple[list[dict], float, float]:
    """The run's step metrics, its wall time and the wall time from launch to the first step's metrics line."""
    command = [
        *torchrun_command(str(ROOT / "recipes" / f"{recipe}.py"), nproc=ranks),
        "model.path=null",
        f"output_dir={output_dir}",
        f"max_steps={steps}",
        "log_every=1",
        "save_every=0",
        "eval_every=0",
        "eval.samples=0",
        "progress=lines",
        *overrides,
    ]
    start = time.perf_counter()
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    first_step = None
    lines = []
    for line in process.stdout:
        lines.append(line)
        if first_step is None and "] step 1 |" in line:
            first_step = time.perf_counter() - start
    process.wait()
    wall = time.perf_counter() - start
    if process.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{''.join(lines[-60:])}")
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "step_time_s" in row], wall, first_step if first_step is not None else float("nan")


def summarise(metrics: list[dict]) -> dict[str, float]:
    """One run's figures over its measured steps. The step time and the rates are medians over the steps: on a
    shared machine another job's busy spell makes some steps many times slower (threads contending for the cores),
    and a median keeps the run's undisturbed figure where those are a minority; the mean is kept beside it."""
    seconds = sum(m["step_time_s"] for m in metrics)
    all_tokens = sum(m["all_tokens_per_sec"] * m["step_time_s"] for m in metrics)
    units = [m.get("num_pairs", m.get("num_examples", 0)) for m in metrics]
    return {
        "step_time": statistics.median(m["step_time_s"] for m in metrics),
        "mean_step_time": seconds / len(metrics),
        "trainable_per_sec": statistics.median(m["tokens_per_sec"] for m in metrics),
        "all_per_sec": statistics.median(m["all_tokens_per_sec"] for m in metrics),
        "units": statistics.mean(units),
        "trainable_per_step": statistics.mean(m["num_tokens"] for m in metrics),
        "all_per_step": all_tokens / len(metrics),
    }


def median(results: dict[str, list[dict[str, float]]], name: str, key: str) -> float:
    return statistics.median(r[key] for r in results[name])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", nargs="+", choices=list(OBJECTIVES), default=list(OBJECTIVES))
    parser.add_argument("overrides", nargs="*", help="overrides for every recipe, after --")
    args = parser.parse_args()
    names = [BASELINE] + [name for name in args.only if name != BASELINE]

    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
        + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "")
    )
    print(f"command: python scripts/bench/bench_objectives.py {' '.join(sys.argv[1:])}")
    print(f"load average at start (1, 5, 15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "reference_cache"
        for ranks in args.ranks:
            results: dict[str, list[dict[str, float]]] = {name: [] for name in names}
            for round_index in range(args.rounds):
                for name in names:
                    recipe, overrides, _ = OBJECTIVES[name]
                    overrides = [o.format(cache=cache) for o in overrides] + args.overrides
                    output_dir = Path(tmp) / f"{name}-{ranks}-{round_index}"
                    metrics, wall, first_step = run_once(recipe, ranks, args.steps, overrides, output_dir)
                    figures = summarise(metrics[args.warmup :])
                    figures.update(wall=wall, first_step=first_step, load=os.getloadavg()[0])
                    results[name].append(figures)
                    print(
                        f"  ranks {ranks} round {round_index + 1} {name}: step median {figures['step_time']:.3f} s, "
                        f"mean {figures['mean_step_time']:.3f} s, "
                        f"{figures['all_per_sec']:,.0f} all tokens/s, first step line after {first_step:.1f} s, "
                        f"wall {wall:.1f} s, load (1 min) {figures['load']:.2f}",
                        flush=True,
                    )

            baseline = median(results, BASELINE, "step_time")
            print(f"\n{ranks} rank(s), {args.steps} steps, first {args.warmup} dropped, median of {args.rounds} rounds")
            print(
                "| objective | step time (s) | range | mean step time (s) | × DPO | trainable tokens/s | all tokens/s | units/step "
                "| trainable tokens/step | all tokens/step | launch → step 1 (s), each round |"
            )
            print("|---|---|---|---|---|---|---|---|---|---|---|")
            for name in names:
                times = [r["step_time"] for r in results[name]]
                launches = " / ".join(f"{r['first_step']:.1f}" for r in results[name])
                unit = "examples" if OBJECTIVES[name][0] == "kto" else "pairs"
                print(
                    f"| {OBJECTIVES[name][2]} | {median(results, name, 'step_time'):.3f} | {min(times):.3f}–{max(times):.3f} "
                    f"| {median(results, name, 'mean_step_time'):.3f} | {median(results, name, 'step_time') / baseline:.2f} | {median(results, name, 'trainable_per_sec'):,.0f} "
                    f"| {median(results, name, 'all_per_sec'):,.0f} | {median(results, name, 'units'):.1f} {unit} "
                    f"| {median(results, name, 'trainable_per_step'):,.0f} | {median(results, name, 'all_per_step'):,.0f} "
                    f"| {launches} |"
                )
    print(f"load average at end (1, 5, 15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
