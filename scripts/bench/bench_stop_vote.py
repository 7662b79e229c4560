"""The cost of the stop vote before every step (`chattune.interrupts.StopVote`): one float all-reduced over a
gloo group, on the host, per step.

    python scripts/bench/bench_stop_vote.py [--ranks 2] [--calls 2000]

Spawns the ranks on this machine (gloo over localhost) and prints the mean time of one vote. Across nodes it
is one small TCP all-reduce: the network's latency, not the data, decides.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, port: int, calls: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from chattune.interrupts import StopVote

    vote = StopVote()
    for _ in range(50):  # warm-up
        vote()
    dist.barrier()
    started = time.perf_counter()
    for _ in range(calls):
        vote()
    if rank == 0:
        print(f"StopVote on {world} gloo ranks: {1e6 * (time.perf_counter() - started) / calls:.0f} us per step")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    from chattune.distributed import free_port

    mp.spawn(_rank, args=(args.ranks, free_port(), args.calls), nprocs=args.ranks)


if __name__ == "__main__":
    main()
