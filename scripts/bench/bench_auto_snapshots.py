"""The price of `snapshot_steps=auto` while the steps are short (`chattune.checkpoint.snapshot.SnapshotsWhenSlow`): the
ranks' one-number gloo all-reduce after every step, on the host, that decides together whether a step was long.

    torchrun --nproc_per_node 2 scripts/bench/bench_auto_snapshots.py [--steps 2000]

Each rank times a check (`after_step` at a checked step) over `--steps` calls, then `--steps` steps as a run
calls it (a check at steps 1-10, then every 10th), steps far shorter than the grace (nothing starts); rank 0
prints the check's median and 99th percentile and the mean a step, in microseconds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    from chattune.checkpoint.snapshot import SnapshotsWhenSlow

    dist.init_process_group("gloo")
    when_slow = SnapshotsWhenSlow(grace=30, start=lambda: None)
    checks, steps = [], []
    for _ in range(args.steps):
        started = time.perf_counter()
        assert when_slow.after_step(1, 0.3) is None  # (step 1: a check every call)
        checks.append(time.perf_counter() - started)
    for step in range(1, args.steps + 1):  # as a run calls it: a check at steps 1-10, then every 10th
        started = time.perf_counter()
        assert when_slow.after_step(step, 0.3) is None
        steps.append(time.perf_counter() - started)
    checks.sort()
    if dist.get_rank() == 0:
        print(
            f"{dist.get_world_size()} ranks, {args.steps} calls: a check's all-reduce {1e6 * statistics.median(checks):.0f} "
            f"us (median), {1e6 * checks[int(0.99 * len(checks))]:.0f} us (99th percentile); over a run's "
            f"{args.steps} steps {1e6 * statistics.mean(steps):.0f} us a step on average"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
