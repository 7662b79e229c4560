"""The command line of a recipe launch under torchrun, built in one place for the tests, the benchmarks and the GPU
check (each had its own copy, and they drifted: one passed `--standalone`, one a fixed port that two benchmarks
shared)."""

from __future__ import annotations

import sys
from pathlib import Path

TORCHRUN = (sys.executable, "-m", "torch.distributed.run")  # torchrun of this interpreter (a venv's own)


def torchrun_command(script: str | Path, *arguments: str, nproc: int = 1, port: int | None = None) -> list[str]:
    """`torchrun --nproc_per_node NPROC (--master_port PORT | --standalone) SCRIPT ARGUMENTS...`: with a `port`, the
    rendezvous on it (tests running side by side each take a free one); without, torchrun's standalone rendezvous
    (one launch on the machine at a time)."""
    rendezvous = ["--master_port", str(port)] if port is not None else ["--standalone"]
    return [*TORCHRUN, "--nproc_per_node", str(nproc), *rendezvous, str(script), *arguments]
