"""Process-group set-up shared by all recipes. A plain `python recipes/sft.py` becomes a one-rank group,
so single-process runs take exactly the code path of torchrun runs (FSDP2 included)."""

from __future__ import annotations

import logging
import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    # Context parallelism (parallel.context): groups of this many consecutive ranks share each packed row,
    # each holding a contiguous slice of it (`chattune.model.context_parallel`); 1: every rank its own rows.
    context_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def data_rank(self) -> int:
        """Which data-parallel rank this is: the ranks of one context group read the same microbatches."""
        return self.rank // self.context_size

    @property
    def data_ranks(self) -> int:
        """Data-parallel ranks: the streams of microbatches a step trains on."""
        return self.world_size // self.context_size


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_with_launcher() -> None:
    """Under torchrun, have the kernel stop this worker (SIGTERM) when the launcher dies. torchrun starts
    each worker in a session of its own, so killing torchrun's process group (or torchrun itself, kill
    -9) would otherwise leave the workers training on, orphaned, into an output directory a relaunch then
    finds in use. Linux only (prctl); elsewhere a no-op."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


_one_rank_group = False  # this process made its own one-rank group (launched without torchrun)
_context_group: "dist.ProcessGroup | None" = None  # this rank's context-parallel group (None: parallel.context=1)
_groups_made = 0  # process groups this process has made (one per multirun job)
ALLOCATOR_SETTINGS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # torch's name, and its older one


def default_cuda_allocator(environ: dict[str, str] = os.environ) -> None:
    """Expandable segments for the CUDA caching allocator, unless the user configured it: packed
    microbatches change length from step to step, and fixed-size segments then fragment (memory reserved
    and not usable). Read by torch when CUDA first allocates, so set before any CUDA work."""
    if not any(environ.get(name) for name in ALLOCATOR_SETTINGS):
        environ[ALLOCATOR_SETTINGS[0]] = "expandable_segments:True"


def init_distributed(device: str = "auto", context_size: int = 1) -> DistInfo:
    """Initialise torch.distributed (nccl on CUDA, gloo on CPU) from torchrun's environment, or as a
    one-rank group when launched without torchrun. `context_size` (parallel.context): ranks r*C .. r*C+C-1
    form a context group (`context_group()`); it must divide the number of ranks."""
    global _one_rank_group, _groups_made, _context_group
    stop_with_launcher()
    if "RANK" not in os.environ or _one_rank_group:
        # A group of its own: a fresh port for each (a multirun sweep makes one group per job, in one process).
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_PORT=str(free_port()))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        _one_rank_group = True
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    local_rank = int(os.environ["LOCAL_RANK"])
    if device == "cuda":
        default_cuda_allocator()
        torch.cuda.set_device(local_rank)
        torch_device = torch.device("cuda", local_rank)
    else:
        # Ranks on one machine share its cores; more threads than cores slows everyone down.
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_world))
        torch_device = torch.device("cpu")
    if not dist.is_initialized():
        # Generous timeout: ranks wait in a barrier while rank 0 writes the final HF directory.
        timeout = timedelta(minutes=60)
        store = {}
        if _groups_made and "TORCHELASTIC_RUN_ID" in os.environ:
            # torchrun's store outlives a group, with the keys of the last one (a multirun job's, in this same
            # process): a later group rendezvouses under keys of its own.
            agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                        timeout=timeout)
            store = {"store": dist.PrefixStore(f"chattune/group{_groups_made}", agent_store),
                     "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}
        dist.init_process_group(backend="nccl" if device == "cuda" else "gloo",
                                device_id=torch_device if device == "cuda" else None, timeout=timeout, **store)
        _groups_made += 1
    world_size = dist.get_world_size()
    if context_size < 1 or world_size % context_size:
        raise ValueError(f"parallel.context={context_size} must divide the number of ranks, {world_size}")
    _context_group = None
    if context_size > 1:
        # Consecutive ranks (the same machine first): the attention's all-to-all is the busiest traffic of a
        # step. Every rank creates every group, in the same order, as new_group requires.
        for first in range(0, world_size, context_size):
            group = dist.new_group(list(range(first, first + context_size)))
            if first <= dist.get_rank() < first + context_size:
                _context_group = group
    return DistInfo(dist.get_rank(), world_size, local_rank, torch_device, context_size)


def context_group() -> "dist.ProcessGroup | None":
    """This rank's context-parallel group (the ranks that share each packed row); None without context
    parallelism."""
    return _context_group


def counts_rows() -> bool:
    """Whether this rank reports the figures of the rows it trains (loss units, losses, data counts). Under
    context parallelism every rank of a group computes the same row, and only its first one reports it, so that
    sums over all ranks count every row once."""
    return _context_group is None or dist.get_rank(_context_group) == 0


def host_values_on(device: torch.device, values: list, dtype: torch.dtype) -> torch.Tensor:
    """Host values as a tensor on `device`, queued without waiting for the device. `torch.tensor(values,
    device=cuda)` copies from pageable memory, which synchronises the stream: the host would wait for every
    kernel queued before (the previous step's optimizer, the previous microbatch's backward). A copy from
    pinned memory is queued like a kernel."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over all ranks in one collective (returns a new tensor)."""
    values = values.clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def reduce_sums(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Sum named per-rank figures over all ranks with ONE stacked all-reduce."""
    names = sorted(values)
    stacked = host_values_on(device, [float(values[n]) for n in names], torch.float64)
    return dict(zip(names, all_reduce_sum(stacked).tolist()))


def all_reduce_max(value: int, device: torch.device) -> int:
    """The largest of an integer over all ranks."""
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def broadcast_from_main(obj):
    """Rank 0's `obj` (any picklable object) on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def shutdown_distributed() -> None:
    """Wait for every rank, then tear the group down. Without the barrier a rank that finishes first can
    destroy its gloo context while a peer still talks to it, which aborts the process."""
    global _context_group
    _context_group = None
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def exit_process(code: int = 0) -> None:
    """End the process now, skipping interpreter teardown. Call it last, after `shutdown_distributed()`.

    Under load, gloo's C++ state can be destroyed during interpreter finalization with a thread still
    joinable, which aborts the process (SIGABRT, "terminate called without an active exception") after
    all the work is done: a launcher would report a finished run as failed."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
