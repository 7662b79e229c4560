"""The GRPO demo's figures (BENCHMARKS.md, docs/grpo.md): README's kind of command, `torchrun --nproc_per_node 2
recipes/grpo.py`, from the SFT demo's export, for several seeds (the spread), and once with the reward's sign flipped
(the control); each run's reward at its start and end, the share solved, its rollout and training speed.

    python scripts/bench/bench_grpo.py [--base outputs/sft-tiny/hf] [--seeds 1 2 3] [--steps 60] [--keep DIR]
                                       [--shared-prompts]

`--base`: the SFT demo's export (`torchrun --nproc_per_node 2 recipes/sft.py` makes it; trained here first where
absent). Every run writes into a temporary directory (`--keep DIR`: into DIR, left there). The reward at the start
is the mean of the first 3 steps, at the end the mean of the last 5 (`tests/e2e/test_grpo_recipe.py` asserts the same
measure on a smaller model). `--shared-prompts`: the first seed's run again with data.share_prompts=true (each group's
completions continuing one copy of its prompt): its training speed, and the prompt tokens it computed once per step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]  # scripts/bench/ is two below it


def launch(recipe: str, directory: Path, overrides: list[str], nproc: int = 2) -> float:
    """`torchrun --nproc_per_node NPROC recipes/RECIPE.py OVERRIDES` from the project root; its wall seconds."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    command += [str(PROJECT_ROOT / "recipes" / f"{recipe}.py"), *overrides]
    print("$ torchrun --nproc_per_node", nproc, f"recipes/{recipe}.py", " ".join(overrides), flush=True)
    environment = {**os.environ, "CHATTUNE_CACHE_DIR": str(directory / "token_cache")}
    started = time.monotonic()
    with open(directory / f"{recipe}-{len(list(directory.glob('*.log')))}.log", "w") as log:
        done = subprocess.run(command, cwd=PROJECT_ROOT, env=environment, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"{recipe} failed: see {log.name} in {directory}")
    return time.monotonic() - started


def run_once(directory: Path, out: Path, overrides: list[str]) -> float:
    """A GRPO run into `out`, unless a complete one is there already (`--keep`: a rerun reads it); its wall seconds."""
    wall_file = out / "bench_wall_s.txt"
    if (out / "complete.json").is_file() and wall_file.is_file():
        return float(wall_file.read_text())
    wall = launch("grpo", directory, [f"output_dir={out}", *overrides])
    wall_file.write_text(f"{wall:.1f}")
    return wall


def figures(run: Path, wall: float) -> dict:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if line.get("step", 0) > 0]

    def mean(key: str, part: list[dict]) -> float:
        return statistics.fmean(line[key] for line in part)

    rollout = [line for line in steps if line.get("rollout_s", 0) > 0]
    return {
        "start": mean("reward/sorted_numbers", steps[:3]),
        "end": mean("reward/sorted_numbers", steps[-5:]),
        "solved_start": mean("reward/solved", steps[:3]),
        "solved_end": mean("reward/solved", steps[-5:]),
        "rollout_tokens_per_sec": mean("rollout_tokens_per_sec", rollout),
        "rollout_share": mean("rollout_s", rollout) / mean("step_time_s", rollout),
        "train_tokens_per_sec": statistics.fmean(
            line["num_tokens"] / (line["step_time_s"] - line["rollout_s"]) for line in steps
        ),
        "step_time_s": mean("step_time_s", steps),
        "train_s": statistics.fmean(line["step_time_s"] - line["rollout_s"] for line in steps),
        "shared_prompt_tokens": statistics.fmean(line.get("shared_prompt_tokens", 0) for line in steps),
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="outputs/sft-tiny/hf")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--keep", type=Path)
    parser.add_argument("--shared-prompts", action="store_true", help="also the first seed with data.share_prompts")
    args = parser.parse_args()
    directory = args.keep or Path(tempfile.mkdtemp(prefix="bench-grpo-"))
    directory.mkdir(parents=True, exist_ok=True)
    base = Path(args.base) if Path(args.base).is_absolute() else PROJECT_ROOT / args.base
    if not (base / "config.json").is_file():
        launch("sft", directory, [f"output_dir={directory / 'sft-tiny'}"])
        base = directory / "sft-tiny" / "hf"
    runs = {}
    common = [f"model.path={base}", f"max_steps={args.steps}", "log_every=1"]
    for seed in args.seeds:
        out = directory / f"grpo-seed{seed}"
        runs[f"seed {seed}"] = figures(out, run_once(directory, out, [*common, f"seed={seed}"]))
    out = directory / "grpo-flipped"
    flipped = (
        "reward.functions=[{_target_: chattune.rl.demo_task.sorted_numbers, weight: -1.0}, "
        "{_target_: chattune.rl.rewards.answer_check, weight: 0.0, name: solved}]"
    )
    wall = run_once(directory, out, [*common, f"seed={args.seeds[0]}", flipped])
    runs[f"seed {args.seeds[0]}, sign flipped"] = figures(out, wall)
    if args.shared_prompts:
        out = directory / "grpo-shared-prompts"
        wall = run_once(directory, out, [*common, f"seed={args.seeds[0]}", "data.share_prompts=true"])
        runs[f"seed {args.seeds[0]}, shared prompts"] = figures(out, wall)
    print(f"\n{args.steps} steps from {base}; reward: mean of the first 3 steps -> of the last 5")
    print(
        "| run | reward start -> end | rise | solved start -> end | rollout tokens/s | rollout share | train tokens/s "
        "| step s | training s | prompt tokens shared | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, f in runs.items():
        print(
            f"| {name} | {f['start']:.3f} -> {f['end']:.3f} | {f['end'] - f['start']:+.3f} | "
            f"{f['solved_start']:.3f} -> {f['solved_end']:.3f} | {f['rollout_tokens_per_sec']:.0f} | "
            f"{f['rollout_share']:.2f} | {f['train_tokens_per_sec']:.0f} | {f['step_time_s']:.2f} | "
            f"{f['train_s']:.2f} | {f['shared_prompt_tokens']:.0f} | {f['wall_s']:.0f} |"
        )
    rises = [f["end"] - f["start"] for name, f in runs.items() if "," not in name]  # (the seeds' own runs)
    print(
        f"\nrise over {len(rises)} seeds: mean {statistics.fmean(rises):+.3f}, min {min(rises):+.3f}, max {max(rises):+.3f}"
    )
    print(f"runs in {directory}")


if __name__ == "__main__":
    main()
