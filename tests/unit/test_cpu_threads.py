"""The torch threads of a CPU rank (`chattune.distributed.cpu_threads`): the process's cores shared among the
machine's ranks, unless CHATTUNE_CPU_THREADS says how many (a machine shared with other jobs); a bad value is one
error that names the variable."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from chattune.distributed import CPU_THREADS_ENV, cpu_threads
from chattune.errors import UserError


def test_the_cores_are_shared_among_the_machines_ranks_unless_the_variable_says():
    cores = len(os.sched_getaffinity(0))
    assert cpu_threads({}) == cores
    assert cpu_threads({"LOCAL_WORLD_SIZE": str(cores * 4)}) == 1  # never 0
    assert cpu_threads({"LOCAL_WORLD_SIZE": "1", CPU_THREADS_ENV: ""}) == cores  # empty: not set
    assert cpu_threads({"LOCAL_WORLD_SIZE": "4", CPU_THREADS_ENV: " 3 "}) == 3  # more than the share: the user's call


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_a_bad_thread_count_is_refused_with_the_variable_named(value):
    with pytest.raises(UserError, match=f"CHATTUNE_CPU_THREADS='{value}': the torch threads of each CPU rank"):
        cpu_threads({CPU_THREADS_ENV: value})


@pytest.mark.launch
def test_a_rank_started_with_the_variable_runs_that_many_threads():
    script = (
        "import torch; from chattune.distributed import init_distributed, shutdown_distributed; "
        "init_distributed('cpu'); print(torch.get_num_threads()); shutdown_distributed()"
    )
    environment = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**environment, CPU_THREADS_ENV: "3"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "3"
