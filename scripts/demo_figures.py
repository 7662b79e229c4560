"""The held-out figures README quotes for the default commands, reproduced: the default SFT run, then the
reward model, DPO and KTO demos from its export, each launched as README launches it (2 ranks, the shipped
tiny configs, nothing else changed but output_dir and the SFT model's path).

    python scripts/demo_figures.py [--out outputs/demo-figures] [--nproc 2]

Prints one markdown table (the first and last held-out figures of each run, and its wall time) and writes it
to OUT/figures.md. The figures depend on the machine's float arithmetic only through the order of summation,
so another CPU may move the last digits, and a change to the code more than that: README quotes this
script's output with the date and machine it was measured on.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
# (recipe, the held-out figures it logs, in the order printed)
RUNS = [
    ("sft", ["eval_loss"]),
    ("reward", ["eval_rewards/accuracies", "eval_rewards/margins", "eval_loss"]),
    ("dpo", ["eval_rewards/accuracies", "eval_rewards/margins", "eval_loss"]),
    ("kto", ["eval_rewards/margins", "eval_kl", "eval_loss"]),
]


def launch(recipe: str, out: Path, nproc: int, *overrides: str) -> float:
    """Run `recipe` as README does; its wall time in seconds."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        f"recipes/{recipe}.py",
        f"output_dir={out}",
        *overrides,
    ]
    print("$", " ".join(command[2:]), flush=True)
    started = time.monotonic()
    with open(out.parent / f"{recipe}.log", "w") as log:
        subprocess.run(command, cwd=PROJECT_ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
    return time.monotonic() - started


def held_out(out: Path) -> list[dict]:
    """The metric lines with held-out figures, in step order (step 0 first where the run evaluated it)."""
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [line for line in lines if "eval_loss" in line]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT / "outputs" / "demo-figures")
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    out = args.out.resolve()
    if out.exists():
        sys.exit(f"{out} exists: choose another --out (the runs would resume or refuse it)")
    out.mkdir(parents=True)
    rows = ["| run | held-out figure | first (step) | last (step) | wall |", "|---|---|---|---|---|"]
    sft_model = out / "sft" / "hf"
    for recipe, figures in RUNS:
        overrides = [] if recipe == "sft" else [f"model.path={sft_model}"]
        wall = launch(recipe, out / recipe, args.nproc, *overrides)
        lines = held_out(out / recipe)
        first, last = lines[0], lines[-1]
        for figure in figures:
            rows.append(
                f"| {recipe}/tiny | `{figure}` | {first[figure]:.4g} ({first['step']}) | {last[figure]:.4g} "
                f"({last['step']}) | {wall:.0f} s |"
            )
    table = "\n".join(rows)
    (out / "figures.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
