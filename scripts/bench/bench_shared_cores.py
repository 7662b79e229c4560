"""Torch threads on cores shared with other jobs (why CHATTUNE_CPU_THREADS exists and the test suite sets it to 1).

    python scripts/bench/bench_shared_cores.py [--busy N] [--steps 20] [--threads 1 2]

Runs forward and backward passes of a tiny Llama (4 layers, hidden 128, a 512-token row, fp32) with each thread
count, first on an idle machine, then beside N busy processes (default: one per core, as two pytest-xdist workers'
launches fill CI's two cores), and prints each run's wall and CPU seconds. OpenMP's threads wait for each other at
every parallel region; when the cores are taken they spin and are descheduled, so the extra threads cost more
than they give.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time


def _busy() -> None:
    while True:
        pass


def _steps(threads: int, steps: int) -> tuple[float, float]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 1024, (1, 512))
    for _ in range(3):  # warm-up
        model(ids, labels=ids).loss.backward()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        model(ids, labels=ids).loss.backward()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--busy", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    print(f"{len(os.sched_getaffinity(0))} cores; {args.steps} steps of a tiny Llama per run")
    for label, busy in (("idle", 0), (f"beside {args.busy} busy processes", args.busy)):
        workers = [multiprocessing.Process(target=_busy, daemon=True) for _ in range(busy)]
        for worker in workers:
            worker.start()
        try:
            for threads in args.threads:
                wall, cpu = _steps(threads, args.steps)
                print(f"{label:>28}: {threads} thread(s)  wall {wall:6.2f} s  cpu {cpu:6.2f} s")
        finally:
            for worker in workers:
                worker.terminate()


if __name__ == "__main__":
    main()
