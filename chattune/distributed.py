"""Process-group set-up shared by all recipes. A plain `python recipes/sft.py` becomes a one-rank group,
so single-process runs take exactly the code path of torchrun runs (FSDP2 included)."""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from chattune.config.layout_rules import context_ranks_problem

# The mesh's axes, outermost first: a rank's place along each is its coordinate (row-major, as `init_device_mesh`
# lays ranks out), so the ranks of one context group are consecutive (the same machine first: the attention's
# all-to-all is the busiest traffic of a step).
MESH_AXES = ("dp_shard", "cp")


@dataclass(frozen=True)
class ParallelDims:
    """This rank's place in the run's one named device mesh (torchtitan's `ParallelDims`): every degree of
    parallelism is an axis named here once, and everything that depends on the layout derives from it: the
    process groups, which rank reports the figures of the rows it trains, the data rank and the counts.

    Axes today (`MESH_AXES`, outermost first; world = dp_shard x cp):
    - `dp_shard`: data parallelism with FSDP2 sharding. Each coordinate reads its own stream of microbatches
      (`data_rank`, `data_ranks`).
    - `cp`: context parallelism (parallel.context): the `cp` consecutive ranks of a context group share each packed
      row, each holding a contiguous slice (`chattune.model.context_parallel`). They read the same microbatches,
      and only the group's first rank reports them (`reports_rows`).
    FSDP2 shards the parameters over dp_shard x cp, the whole world (torchtitan's flattened `dp_shard_cp`):
    `shard_ranks`; the gradient norm's squares sum over the same ranks (`grad_norm_group`).

    The mesh (`mesh`, a torch `DeviceMesh` made by `init_distributed`) holds only the axes of degree above 1 (one
    `dp_shard` axis of 1 on one rank), so a run without context parallelism makes no process group besides
    the world, and an axis over every rank reuses the world's. A degree-1 axis has no group (`group` returns
    None): a collective over it would be the identity. Never hand such a None to torch.distributed, which
    reads None as the whole world.

    How the next axes plug in, each as one more entry of MESH_AXES and its degree, not a rewrite:
    - HSDP: a `dp_replicate` axis outermost, (dp_replicate, dp_shard, cp). The data rank becomes
      replicate x dp_shard + shard coordinate (`data_ranks` = dp_replicate x dp_shard); `shard_ranks` stays
      dp_shard x cp, and `chattune.model.fsdp.shard_model` passes `fully_shard` the 2-D mesh
      (dp_replicate, dp_shard_cp) (torchtitan's `_flatten` of dp_shard and cp), so FSDP2 all-reduces each
      shard's gradient over the replicas. The gradient norm then sums its squares over the shard group
      (dp_shard x cp) only: every replica holds the same reduced shards, and a sum over the whole world would
      count each of them dp_replicate times. `grad_norm_group` becomes that group, and the finiteness and
      stop flags that `chattune.train.step` sends in the same all-reduce need the world's sum (a second
      all-reduce, or the world's sum with the squares divided by dp_replicate).
    - Tensor parallelism: a `tp` axis innermost, (..., cp, tp). The model is parallelised with torch's
      row-/column-wise plans (`parallelize_module` on `mesh["tp"]`) before `fully_shard` shards over
      dp_shard_cp; the output layer is sharded over the vocabulary, so the chunked loss reduces its
      log-sum-exp and target logit over `group("tp")`. The ranks of a tp group read the same microbatches and
      compute the same row (the data rank ignores tp, `reports_rows` also asks tp coordinate 0). In the gradient
      norm a parameter sharded over tp sums its squares over dp_shard x cp x tp, one replicated over tp (the
      norms' weights) over dp_shard x cp only: the norm is then taken of the DTensors by their placements
      (`get_total_norm` on them) rather than of the local shards.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    cp: int = 1  # context parallelism (parallel.context): ranks per context group
    mesh: DeviceMesh | None = field(
        default=None, repr=False, compare=False
    )  # None: no groups (built by hand, one rank)

    def __post_init__(self) -> None:
        if self.cp < 1 or self.world_size % self.cp:  # the words of chattune.config.layout_rules, with the old ones
            problem = context_ranks_problem(self.cp, self.world_size) or f"{self.cp} is not a context size"
            raise ValueError(
                f"parallel.context={self.cp} must divide the number of ranks, {self.world_size}: {problem}"
            )

    # --- the axes ---

    @property
    def dp_shard(self) -> int:
        """Data-parallel (FSDP-sharded) degree: the number of context groups."""
        return self.world_size // self.cp

    @property
    def degrees(self) -> dict[str, int]:
        """Each axis of MESH_AXES with its degree."""
        return {"dp_shard": self.dp_shard, "cp": self.cp}

    @property
    def coordinates(self) -> dict[str, int]:
        """This rank's coordinate along each axis (row-major over MESH_AXES)."""
        return {"dp_shard": self.rank // self.cp, "cp": self.rank % self.cp}

    @property
    def context_size(self) -> int:
        """`cp`, under its older name."""
        return self.cp

    # --- derived ---

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes shared files and logs."""
        return self.rank == 0

    @property
    def cp_rank(self) -> int:
        """This rank's place in its context group (which slice of a row it holds)."""
        return self.coordinates["cp"]

    @property
    def data_rank(self) -> int:
        """Which data-parallel rank this is: the ranks of one context group read the same microbatches."""
        return self.coordinates["dp_shard"]

    @property
    def data_ranks(self) -> int:
        """Data-parallel ranks: the streams of microbatches a step trains on."""
        return self.dp_shard

    @property
    def reports_rows(self) -> bool:
        """Whether this rank reports the figures of the rows it trains (loss units, losses, data counts, the
        ledger). Every rank of a context group computes the same row, and only its first one reports it, so
        that sums over all ranks count every row once."""
        return self.cp_rank == 0

    @property
    def shard_ranks(self) -> int:
        """The ranks FSDP2 shards each parameter over: dp_shard x cp."""
        return self.dp_shard * self.cp

    # --- process groups ---

    def group(self, axis: str) -> dist.ProcessGroup | None:
        """The process group of this rank's line along `axis` (one of MESH_AXES); None where its degree is 1."""
        if self.degrees[axis] == 1:
            return None
        if self.mesh is None:
            raise ValueError(f"{self} has no device mesh (made without init_distributed): no {axis} group")
        return self.mesh.get_group(axis)

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        """This rank's context group (the ranks that share each packed row); None without context parallelism.
        The builder sets it on the model (`chattune.model.context_parallel.set_context_group`)."""
        return self.group("cp")

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The data-parallel ranks with this rank's cp coordinate (one per context group); None on one group."""
        return self.group("dp_shard")

    @property
    def world_group(self) -> dist.ProcessGroup | None:
        """Every rank (torch's default group); None without a process group."""
        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None

    @property
    def grad_norm_group(self) -> dist.ProcessGroup | None:
        """The ranks over which the squares of the gradient norm are summed: those whose shards together hold
        every parameter once (`shard_ranks`, dp_shard x cp), today the whole world."""
        return self.world_group


DistInfo = ParallelDims  # the name the recipes and the training loop knew it by


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
_mesh: ParallelDims | None = None  # init_distributed's (`current_mesh`) ...
_mesh_world: dist.ProcessGroup | None = None  # ... made on this default group (a later group is another run's)
_groups_made = 0  # process groups this process has made (one per multirun job)
ALLOCATOR_SETTINGS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # torch's name, and its older one


def default_cuda_allocator(environ: dict[str, str] = os.environ) -> None:
    """Expandable segments for the CUDA caching allocator, unless the user configured it: packed
    microbatches change length from step to step, and fixed-size segments then fragment (memory reserved
    and not usable). Read by torch when CUDA first allocates, so set before any CUDA work."""
    if not any(environ.get(name) for name in ALLOCATOR_SETTINGS):
        environ[ALLOCATOR_SETTINGS[0]] = "expandable_segments:True"


def init_distributed(device: str = "auto", context_size: int = 1) -> ParallelDims:
    """Initialise torch.distributed (nccl on CUDA, gloo on CPU) from torchrun's environment, or as a
    one-rank group when launched without torchrun, and this run's device mesh (`ParallelDims`).
    `context_size` (parallel.context): ranks r*C .. r*C+C-1 form a context group; it must divide the number
    of ranks."""
    global _one_rank_group, _groups_made, _mesh, _mesh_world
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
            agent_store = dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
            )
            store = {
                "store": dist.PrefixStore(f"chattune/group{_groups_made}", agent_store),
                "rank": int(os.environ["RANK"]),
                "world_size": int(os.environ["WORLD_SIZE"]),
            }
        dist.init_process_group(
            backend="nccl" if device == "cuda" else "gloo",
            device_id=torch_device if device == "cuda" else None,
            timeout=timeout,
            **store,
        )
        _groups_made += 1
    _mesh = None
    unmeshed = ParallelDims(dist.get_rank(), dist.get_world_size(), local_rank, torch_device, context_size)  # checks C
    _mesh = replace(unmeshed, mesh=device_mesh(torch_device.type, unmeshed.degrees))
    _mesh_world = dist.group.WORLD
    return _mesh


def device_mesh(device_type: str, degrees: dict[str, int]) -> DeviceMesh:
    """The named device mesh of the axes of `degrees` (MESH_AXES order) whose degree is above 1, or a one-axis
    mesh of one rank. Collective: every rank creates every group, in the same order (an axis over every rank
    reuses the world's group)."""
    axes = {axis: degree for axis, degree in degrees.items() if degree > 1} or {MESH_AXES[0]: 1}
    return init_device_mesh(device_type, tuple(axes.values()), mesh_dim_names=tuple(axes))


def current_mesh() -> ParallelDims:
    """This process's mesh: the one `init_distributed` made, while its process group lives; for a group made
    without it (tests' own gloo groups) its ranks with no context parallelism, on the CPU unless the group is
    nccl's; without any group, one rank. For code that has no mesh in hand (a step, an objective's figures)."""
    if not (dist.is_available() and dist.is_initialized()):
        return ParallelDims(0, 1, 0, torch.device("cpu"))
    if _mesh is not None and _mesh_world is dist.group.WORLD:
        return _mesh
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    return ParallelDims(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), device)


def counts_rows() -> bool:
    """Whether this rank reports the figures of the rows it trains (`ParallelDims.reports_rows` of
    `current_mesh()`), for code that has no mesh in hand."""
    return current_mesh().reports_rows


def host_values_on(device: torch.device, values: list, dtype: torch.dtype) -> torch.Tensor:
    """Host values as a tensor on `device`, queued without waiting for the device. `torch.tensor(values,
    device=cuda)` copies from pageable memory, which synchronises the stream: the host would wait for every
    kernel queued before (the previous step's optimizer, the previous microbatch's backward). A copy from
    pinned memory is queued like a kernel."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def all_reduce_sum(values: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum a tensor over the ranks of `group` (None: all ranks) in one collective (returns a new tensor)."""
    values = values.clone()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=group)
    return values


def reduce_sums(values: Mapping[str, float], device: torch.device) -> dict[str, float]:
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
    global _mesh, _mesh_world
    _mesh = _mesh_world = None
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


def on_mesh_device(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, or where FSDP2's CPU offload keeps it on the host, a copy on its mesh's device: a collective over
    the shards (a gather, a send) runs there, and NCCL takes no host tensors."""
    if isinstance(tensor, DTensor) and tensor.device.type != tensor.device_mesh.device_type:
        return tensor.to(tensor.device_mesh.device_type)
    return tensor


def whole_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Collective for a DTensor: `tensor` whole, gathered from its shards on its mesh's device (`on_mesh_device`);
    a plain tensor as it is."""
    return on_mesh_device(tensor).full_tensor() if isinstance(tensor, DTensor) else tensor
