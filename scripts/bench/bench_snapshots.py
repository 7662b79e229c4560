"""The cost of `snapshot_steps` (`chattune.checkpoint.snapshot`): the copy of a rank's state into host memory after
every step, and the write of that copy on a stop signal, against an ordinary checkpoint's save.

    python scripts/bench/bench_snapshots.py [--hidden 768] [--layers 12] [--steps 10] [--device cpu|cuda]

One process (a one-rank gloo or nccl group), a Llama-shaped model of random weights with AdamW's states
filled in: the host copy holds the weights and both moments in fp32. Prints the median copy per step, the
snapshot's write, and `save_checkpoint`'s time for the same state, with the state's size.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    from chattune.checkpoint.checkpoint import save_checkpoint
    from chattune.checkpoint.run_state import model_and_optimizer
    from chattune.checkpoint.snapshot import Snapshots
    from chattune.distributed import ParallelDims, free_port
    from chattune.model.causal_lm import PackedCausalLM
    from chattune.parallel.fsdp import shard_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    device = torch.device(args.device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 64),
    )
    model = PackedCausalLM(LlamaForCausalLM(config))
    shard_model(model, ParallelDims.build(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()  # the moments exist, as after a first step
    state = model_and_optimizer(model, optimizer)
    params = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "checkpoints"
        snapshots = Snapshots(root, state, {"world_size": 1}, {}, device, optimizer)
        copies = []
        for step in range(1, args.steps + 1):
            started = time.perf_counter()
            snapshots.stage(step)
            if device.type == "cuda":
                torch.cuda.synchronize()
            copies.append(time.perf_counter() - started)
        started = time.perf_counter()
        snapshots._write(snapshots._staged)
        written = time.perf_counter() - started
        started = time.perf_counter()
        save_checkpoint(root, args.steps + 1, state, {"world_size": 1})
        saved = time.perf_counter() - started
    print(
        f"{params / 1e6:.0f}M parameters, {3 * 4 * params / 2**30:.2f} GiB of fp32 state (weights, 2 moments) on "
        f"{args.device}: host copy per step {1000 * statistics.median(copies):.0f} ms (median of {args.steps}); "
        f"the snapshot's write {written:.2f} s; an ordinary checkpoint's save {saved:.2f} s"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
