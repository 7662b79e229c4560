"""Start-up times a user waits through: to a command's first line, to `chattune validate`'s verdict, and to a
launch's first line and its step 1.

    python scripts/bench/bench_startup.py [--repeats 3]

Each command runs as a fresh process (as a user runs it) from the project root, its output read line by line as
it is written; the figures are the median (min-max) over the repeats, in seconds of wall time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from chattune.launch.torchrun import torchrun_command

ROOT = Path(__file__).resolve().parents[2]  # the project: scripts/bench/ is two below it


def timed_lines(command: list[str], env: dict | None = None) -> tuple[list[tuple[float, str]], float]:
    """Every line the command writes (stdout and stderr), with the seconds since its start; and its run time."""
    start = time.perf_counter()
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}
    )
    lines: list[tuple[float, str]] = []
    lock = threading.Lock()

    def read(stream) -> None:
        for line in stream:
            with lock:
                lines.append((time.perf_counter() - start, line.rstrip("\n")))

    readers = [threading.Thread(target=read, args=(s,)) for s in (process.stdout, process.stderr)]
    for reader in readers:
        reader.start()
    code = process.wait()
    for reader in readers:
        reader.join()
    if code != 0:
        raise SystemExit(f"{' '.join(command)} failed ({code}):\n" + "\n".join(line for _, line in lines[-30:]))
    return sorted(lines), time.perf_counter() - start


def first(lines: list[tuple[float, str]], contains: str = "") -> float:
    return next(t for t, line in lines if contains in line)


def first_of_chattune(lines: list[tuple[float, str]]) -> float:
    """The first line chattune writes (not torchrun's banner): its start-up line, or its first log line."""
    return next(t for t, line in lines if line.startswith("chattune") or "[rank0]" in line)


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):5.2f} s ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    chattune = [sys.executable, "-m", "chattune.cli.main"]
    figures: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            lines, total = timed_lines([*chattune, "validate", "sft/tiny", f"output_dir={scratch}/validate"])
            figures.setdefault("chattune validate sft/tiny: first line", []).append(first(lines))
            figures.setdefault("chattune validate sft/tiny: verdict", []).append(total)
            lines, total = timed_lines([*chattune, "inspect", "sft/tiny", "--limit", "200"])
            figures.setdefault("chattune inspect sft/tiny --limit 200: first line", []).append(first(lines))
            figures.setdefault("chattune inspect sft/tiny --limit 200: report", []).append(total)
            out = f"{scratch}/launch{repeat}"
            lines, _ = timed_lines(
                [
                    *torchrun_command("recipes/sft.py", nproc=2),
                    f"output_dir={out}",
                    "max_steps=1",
                    "log_every=1",
                    "eval_every=0",
                    "save_every=0",
                ],
                env={"OMP_NUM_THREADS": "1"},
            )
            figures.setdefault("torchrun --nproc_per_node 2 recipes/sft.py: chattune's first line", []).append(
                first_of_chattune(lines)
            )
            figures.setdefault("torchrun --nproc_per_node 2 recipes/sft.py: step 1 logged", []).append(
                first(lines, "step 1 |")
            )
    width = max(map(len, figures))
    for name, values in figures.items():
        print(f"{name:<{width}}  {summary(values)}")


if __name__ == "__main__":
    main()
