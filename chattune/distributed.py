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

from chattune.config.layout_rules import (
    context_ranks_problem,
    expert_ranks_problem,
    replicate_ranks_problem,
    tensor_ranks_problem,
)
from chattune.errors import UserError

# The mesh's axes, outermost first: a rank's place along each is its coordinate (row-major, as `init_device_mesh`
# lays ranks out), so the ranks of one context group are consecutive (the same machine first: the attention's
# all-to-all is the busiest traffic of a step).
MESH_AXES = ("dp_replicate", "dp_shard", "cp", "tp")
HOST = torch.device("cpu")
# Each axis's key under `parallel.` (the schema's ParallelConfig): the axes a config sets; dp_shard is the rest.
CONFIG_AXES = {"replicate": "dp_replicate", "context": "cp", "tensor": "tp"}
# Degrees a config sets that are not axes of their own: expert parallelism borrows its ranks from dp_shard x cp.
CONFIG_BORROWED = {"expert": "ep"}


@dataclass(frozen=True)
class ParallelDims:
    """This rank's place in the run's one device mesh (torchtitan's `ParallelDims`): every degree of parallelism is
    an axis named here once, and everything that depends on the layout derives from it: the process groups, which
    rank reports the figures of the rows it trains, the data rank and the counts.

    Axes (`MESH_AXES`, outermost first; world = dp_replicate x dp_shard x cp x tp):
    - `dp_replicate`: HSDP (parallel.replicate): groups of ranks that each hold a whole sharded copy of the
      parameters; FSDP2 all-reduces each shard's gradient across the groups. Outermost, so a group is a block of
      consecutive ranks (a node, where it is the node's ranks).
    - `dp_shard`: data parallelism with FSDP2 sharding within a group. Each (dp_replicate, dp_shard) coordinate
      reads its own stream of microbatches (`data_rank`, `data_ranks`).
    - `cp`: context parallelism (parallel.context): the `cp` consecutive ranks of a context group share each packed
      row, each holding a contiguous slice (`chattune.parallel.context_parallel`). They read the same microbatches,
      and only the group's first rank reports them (`reports_rows`).
    - `tp`: tensor parallelism (parallel.tensor): the `tp` consecutive ranks of a tp group hold a split of each
      decoder layer's linear layers (`chattune.parallel.tensor_parallel`) and compute the same rows; only the
      group's first rank reports them. Innermost: the busiest links (an all-reduce per layer) within a machine.
    - `ep` (not an axis: borrowed, as torchtitan does): expert parallelism (parallel.expert) splits the
      dp_shard x cp ranks FSDP2 shards over into groups of `ep` consecutive ranks, each holding 1/ep of every MoE
      layer's experts whole and exchanging tokens with its group (`chattune.parallel.expert_parallel`); the
      experts are sharded by FSDP2 over the rest (`ep_shard`: the ranks holding the same experts, `ep_fsdp` what
      `fully_shard` takes, with dp_replicate under HSDP). Dense layers are sharded over all data ranks as before,
      and every rank still trains its own rows.

    Code asks for a mesh or group by its purpose, never by an axis (torchtitan's names):
    - `dp`: the data-loading ranks (`data_rank` is this rank's place on it);
    - `cp`: the context group;
    - `dp_replicate`: the replicas of this rank's shards;
    - `dp_shard_cp`: the ranks FSDP2 shards each parameter over (`shard_ranks`); `fsdp_mesh`, what `fully_shard`
      takes, is (dp_replicate, dp_shard_cp) under HSDP;
    - `tp`: the tensor-parallel group;
    - `ep`: the expert-parallel group, and `ep_fsdp` the mesh the experts' FSDP2 units shard over.
    A step's counts, the loss's figures and the gradient norm's squares are summed over every rank in one
    all-reduce (torchtitan's `dp_cp` are the ranks that matter): a rank that does not report its rows
    (`reports_rows`) adds zeros, and the squares of a gradient several ranks hold are divided by how many hold it
    (`grad_norm_replicas`; a parameter whole on every rank of a tp group by tp, `chattune.train.step`). So no
    group beyond the world is made for them, and the stop and finiteness flags, which every rank needs, ride along.
    A purpose of degree 1 has no group (`group` returns None): a collective over it is the identity. Never hand
    such a None to torch.distributed, which reads None as the whole world.

    The meshes are views of one 1-D world mesh (`_unflatten`), so each purpose's ranks come from one layout and
    a purpose over every rank reuses the world's group: a run without context parallelism makes no process group
    besides the world's. A new axis is an entry of MESH_AXES and CONFIG_AXES and its place in the views of
    `build`, not a rewrite.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    cp: int = 1  # context parallelism (parallel.context): ranks per context group
    dp_replicate: int = 1  # HSDP (parallel.replicate): groups holding a sharded copy of the parameters each
    tp: int = 1  # tensor parallelism (parallel.tensor): ranks that split each decoder layer
    ep: int = 1  # expert parallelism (parallel.expert): ranks of dp_shard x cp that split each MoE layer's experts
    # The purposes' meshes (`build`); empty for a layout made by hand (arithmetic only, no groups).
    meshes: Mapping[str, DeviceMesh] = field(default_factory=dict, repr=False, compare=False)
    # Purposes of degree 1 that still get a mesh (`build(keep=...)`): tensor or expert parallelism on one GPU, so that
    # the GPU check runs the tp and loss-parallel code (DTensor plans, NCCL collectives), or the experts' split and
    # exchange, where only one GPU is lent.
    kept: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.cp < 1 or self.world_size % self.cp:  # the words of chattune.config.layout_rules, with the old ones
            problem = context_ranks_problem(self.cp, self.world_size) or f"{self.cp} is not a context size"
            raise ValueError(
                f"parallel.context={self.cp} must divide the number of ranks, {self.world_size}: {problem}"
            )
        if self.tp < 1 or self.world_size % (self.cp * self.tp):
            problem = tensor_ranks_problem(self.tp, self.cp, self.world_size) or "not a tensor-parallel degree"
            raise ValueError(f"parallel.tensor={self.tp}: {problem}")
        if self.dp_replicate < 1 or self.world_size % (self.dp_replicate * self.cp * self.tp):
            problem = replicate_ranks_problem(self.dp_replicate, self.cp * self.tp, self.world_size)
            raise ValueError(f"parallel.replicate={self.dp_replicate}: {problem or 'not a group count'}")
        problem = expert_ranks_problem(self.ep, self.shard_ranks, self.tp)
        if self.ep < 1 or problem:
            raise ValueError(f"parallel.expert={self.ep}: {problem or 'not an expert-parallel degree'}")

    # --- construction ---

    @classmethod
    def from_config(
        cls, parallel: object | None, world_size: int, rank: int = 0, local_rank: int = 0, device: torch.device = HOST
    ) -> ParallelDims:
        """The layout `parallel` (the config's `parallel` section; None: every degree 1) gives `world_size` ranks,
        without meshes: arithmetic only (what a launch would do, `chattune validate`'s estimate)."""
        keys = {**CONFIG_AXES, **CONFIG_BORROWED}
        degrees = {axis: int(getattr(parallel, key, None) or 1) for key, axis in keys.items()}
        return cls(rank, world_size, local_rank, device, **degrees)

    @classmethod
    def one_rank(cls, device: torch.device = HOST) -> ParallelDims:
        """One process without a process group (a plain model, an export)."""
        return cls(0, 1, 0, device)

    @classmethod
    def build(
        cls, device: torch.device, parallel: object | None = None, keep: frozenset[str] = frozenset()
    ) -> ParallelDims:
        """This rank's layout on the live default process group, with its meshes. Collective: every rank
        builds the same views in the same order (a view's new process groups are made by all ranks).
        `keep`: purposes that get a mesh even at degree 1 ("tp": a tp mesh of one rank composed with FSDP2's, as a tp
        degree above 1 would be; "ep": the experts split over an expert group of one rank, all of them local; the
        GPU check's tensor and expert parallelism on one GPU)."""
        if not keep <= {"tp", "ep"}:
            raise ValueError(f"keep={sorted(keep)}: only the tp and ep purposes can keep a mesh of degree 1")
        layout = cls.from_config(
            parallel, dist.get_world_size(), dist.get_rank(), int(os.environ.get("LOCAL_RANK", "0")), device
        )
        layout = replace(layout, kept=frozenset(keep))
        world = init_device_mesh(device.type, (layout.world_size,), mesh_dim_names=("world",))
        R, T = layout.dp_replicate, layout.tp
        meshes = _views(world, {"dp": layout.data_ranks, "cp": layout.cp, "tp": T})
        if R == 1 and T == 1 and not keep:
            meshes.update(fsdp=world, dp_shard_cp=world)
        else:
            # FSDP2's mesh and the tp mesh it composes with come from one view (the shard axis kept at degree 1:
            # fully_shard needs a mesh even where nothing is left to shard)
            axes = {"dp_replicate": R, "dp_shard_cp": layout.shard_ranks, "tp": T}
            axes = {name: degree for name, degree in axes.items() if degree > 1 or name in {"dp_shard_cp", *keep}}
            view = world._unflatten(0, tuple(axes.values()), tuple(axes))
            meshes.update({name: view[name] for name in axes})
            meshes["fsdp"] = view[("dp_replicate", "dp_shard_cp")] if R > 1 else view["dp_shard_cp"]
        if layout.ep > 1 or "ep" in keep:
            # The experts' meshes come from one view, as fully_shard composes a DTensor's mesh (ep) with its own
            # (ep_fsdp) only where both share a root; the shard axis is kept at degree 1 (ep over every data rank).
            axes = {"ep_replicate": R, "ep_shard": layout.shard_ranks // layout.ep, "ep": layout.ep}
            axes = {name: degree for name, degree in axes.items() if degree > 1 or name != "ep_replicate"}
            view = world._unflatten(0, tuple(axes.values()), tuple(axes))
            meshes.update(ep=view["ep"], ep_shard=view["ep_shard"])
            meshes["ep_fsdp"] = view[("ep_replicate", "ep_shard")] if R > 1 else view["ep_shard"]
        return replace(layout, meshes=meshes)

    # --- the axes ---

    @property
    def dp_shard(self) -> int:
        """Data-parallel (FSDP-sharded) degree within a replica group: its number of context groups."""
        return self.world_size // (self.dp_replicate * self.cp * self.tp)

    @property
    def degrees(self) -> dict[str, int]:
        """Each axis of MESH_AXES with its degree."""
        return {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "cp": self.cp, "tp": self.tp}

    @property
    def coordinates(self) -> dict[str, int]:
        """This rank's coordinate along each axis (row-major over MESH_AXES)."""
        return {
            "dp_replicate": self.rank // (self.dp_shard * self.cp * self.tp),
            "dp_shard": self.rank // (self.cp * self.tp) % self.dp_shard,
            "cp": self.rank // self.tp % self.cp,
            "tp": self.rank % self.tp,
        }

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
        return self.coordinates["dp_replicate"] * self.dp_shard + self.coordinates["dp_shard"]

    @property
    def data_ranks(self) -> int:
        """Data-parallel ranks (the `dp` purpose): the streams of microbatches a step trains on."""
        return self.dp_replicate * self.dp_shard

    @property
    def reports_rows(self) -> bool:
        """Whether this rank reports the figures of the rows it trains (loss units, losses, data counts, the
        ledger). Every rank of a context group (and of a tp group) computes the same row, and only its first one
        reports it, so that sums over every rank count every row once."""
        return self.cp_rank == 0 and self.coordinates["tp"] == 0

    @property
    def shard_ranks(self) -> int:
        """The ranks FSDP2 shards each parameter over (the `dp_shard_cp` purpose): dp_shard x cp."""
        return self.dp_shard * self.cp

    @property
    def grad_norm_replicas(self) -> int:
        """How many ranks hold each gradient shard (`dp_replicate`): a sum of squares over every rank counts each
        shard that often."""
        return self.dp_replicate

    def describe(self) -> str:
        """The layout for the logs: its axes of degree above 1 and what FSDP2 shards over, e.g. "4 ranks:
        dp_replicate 2 x dp_shard 2, parameters sharded over 2"."""
        axes = " x ".join(f"{axis} {degree}" for axis, degree in self.degrees.items() if degree > 1)
        experts = (
            f"; experts split over ep {self.ep} (sharded over {self.shard_ranks // self.ep})"
            if self.ep > 1 or "ep" in self.kept
            else ""
        )
        if not axes:
            return f"1 rank{experts}"
        return f"{self.world_size} ranks: {axes}, parameters sharded over {self.shard_ranks}{experts}"

    # --- meshes and process groups ---

    def mesh(self, purpose: str) -> DeviceMesh | None:
        """The mesh of `purpose` (dp, cp, dp_replicate, dp_shard_cp, tp; see the class docstring); None where its
        degree is 1 (unless `kept`)."""
        degree = {
            "dp": self.data_ranks,
            "cp": self.cp,
            "dp_replicate": self.dp_replicate,
            "dp_shard_cp": self.shard_ranks,
            "tp": self.tp,
            "ep": self.ep,
        }
        if purpose not in degree:
            raise ValueError(f"no mesh for {purpose!r}: one of {', '.join(degree)}")
        if degree[purpose] == 1 and purpose not in self.kept:
            return None
        if purpose not in self.meshes:
            raise ValueError(f"{self} has no device mesh (made without ParallelDims.build): no {purpose} group")
        return self.meshes[purpose]

    def group(self, purpose: str) -> dist.ProcessGroup | None:
        """The process group of this rank's ranks for `purpose`; None where its degree is 1."""
        mesh = self.mesh(purpose)
        return None if mesh is None else mesh.get_group()

    @property
    def splits_layers(self) -> bool:
        """Whether the decoder layers and the vocabulary are split over a tp mesh (`chattune.parallel.tensor_parallel`):
        a tp degree above 1, or a tp mesh kept at degree 1."""
        return self.mesh("tp") is not None

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh `fully_shard` takes: `dp_shard_cp` (one rank's own on one rank); under HSDP the 2-D
        (dp_replicate, dp_shard_cp)."""
        if "fsdp" not in self.meshes:
            raise ValueError(f"{self} has no device mesh (made without ParallelDims.build): nothing to shard over")
        return self.meshes["fsdp"]

    @property
    def splits_experts(self) -> bool:
        """Whether MoE layers' experts are split over an ep mesh (`chattune.parallel.expert_parallel`): an ep degree
        above 1, or an ep mesh kept at degree 1."""
        return self.mesh("ep") is not None

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh:
        """The mesh the experts' `fully_shard` units take under expert parallelism: the ranks holding the same
        experts (dp_shard x cp / ep; kept at degree 1), with dp_replicate under HSDP."""
        if "ep_fsdp" not in self.meshes:
            raise ValueError(f"{self} has no expert mesh (parallel.expert=1, or made without ParallelDims.build)")
        return self.meshes["ep_fsdp"]

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        """This rank's context group (the ranks that share each packed row); None without context parallelism.
        The builder sets it on the model (`chattune.parallel.context_parallel.set_context_group`)."""
        return self.group("cp")


def _views(world: DeviceMesh, degrees: dict[str, int]) -> dict[str, DeviceMesh]:
    """The 1-D world mesh unflattened into `degrees` (outermost first, their product the world's size): each axis's
    1-D mesh by name. Degree-1 axes are left out (each would make one one-rank group per rank); an axis over
    every rank is the world itself. Collective."""
    axes = {name: degree for name, degree in degrees.items() if degree > 1}
    if len(axes) <= 1:
        return dict.fromkeys(axes, world)
    views = world._unflatten(0, tuple(axes.values()), tuple(axes))
    return {name: views[name] for name in axes}


def world_rank() -> int:
    """This process's rank among all processes (0 without a process group): for per-process files and work
    (checkpoint state files, token-cache shards, fault injection), not for a parallel degree."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """The number of processes (1 without a process group)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


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
_groups_made = 0  # process groups this process has made (one per multirun job)
ALLOCATOR_SETTINGS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # torch's name, and its older one


def default_cuda_allocator(environ: dict[str, str] = os.environ) -> None:
    """Expandable segments for the CUDA caching allocator, unless the user configured it: packed
    microbatches change length from step to step, and fixed-size segments then fragment (memory reserved
    and not usable). Read by torch when CUDA first allocates, so set before any CUDA work."""
    if not any(environ.get(name) for name in ALLOCATOR_SETTINGS):
        environ[ALLOCATOR_SETTINGS[0]] = "expandable_segments:True"


CPU_THREADS_ENV = "CHATTUNE_CPU_THREADS"


def cpu_threads(environ: Mapping[str, str] = os.environ) -> int:
    """Torch threads for a CPU rank: $CHATTUNE_CPU_THREADS where set (a machine shared with other jobs: threads
    beyond the cores left free spin against each other, a few times slower on small matmuls; torchrun's own
    OMP_NUM_THREADS=1 default is not taken as a choice), else this process's cores shared among the machine's
    ranks: more threads than cores slows everyone down."""
    value = environ.get(CPU_THREADS_ENV, "").strip()
    if not value:
        return max(1, len(os.sched_getaffinity(0)) // int(environ.get("LOCAL_WORLD_SIZE", "1")))
    if not value.isdigit() or int(value) < 1:
        raise UserError(f"{CPU_THREADS_ENV}={value!r}: the torch threads of each CPU rank, a positive whole number")
    return int(value)


def init_distributed(device: str = "auto", parallel: object | None = None) -> ParallelDims:
    """Initialise torch.distributed (nccl on CUDA, gloo on CPU) from torchrun's environment, or as a
    one-rank group when launched without torchrun, and this run's device mesh (`ParallelDims.build`).
    `parallel`: the config's `parallel` section (None: every degree 1); its degrees must divide the number of
    ranks."""
    global _one_rank_group, _groups_made
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
        torch.set_num_threads(cpu_threads())
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
    return ParallelDims.build(torch_device, parallel)


def usable_device_memory(device: torch.device) -> int:
    """What a run can allocate on `device`, measured: its free memory and what torch's allocator already holds.
    The GPU's total less what torch does not count (the CUDA context, NCCL's buffers, other processes): the
    verdict compared with `total_memory` left nothing for them."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device)


def spare_device_memory(device: torch.device) -> int:
    """What more a run can allocate on `device` now: the free memory and the allocator's cached, unused blocks
    (`mem_get_info` alone leaves those out, though torch reuses them first)."""
    return usable_device_memory(device) - torch.cuda.memory_allocated(device)


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
    return _all_reduce(values, dist.ReduceOp.SUM, group)


def all_reduce_largest(values: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The elementwise largest of a tensor over the ranks of `group` (None: all ranks), one collective (a new
    tensor)."""
    return _all_reduce(values, dist.ReduceOp.MAX, group)


def _all_reduce(values: torch.Tensor, op, group: dist.ProcessGroup | None) -> torch.Tensor:
    values = values.clone()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(values, op=op, group=group)
    return values


# A figure whose name starts with this is an extreme, not a sum: the largest over microbatches and ranks (a minimum
# travels negated). Its value where nothing was seen is -inf.
MAX_FIGURE = "max:"


def reduce_sums(values: Mapping[str, float], device: torch.device) -> dict[str, float]:
    """Sum named per-rank figures over all ranks with ONE stacked all-reduce; `MAX_FIGURE` ones take the largest
    (a second, only where there are some)."""
    names = sorted(name for name in values if not name.startswith(MAX_FIGURE))
    stacked = host_values_on(device, [float(values[n]) for n in names], torch.float64)
    reduced = dict(zip(names, all_reduce_sum(stacked).tolist()))
    extremes = sorted(name for name in values if name.startswith(MAX_FIGURE))
    if extremes:
        largest = all_reduce_largest(host_values_on(device, [float(values[n]) for n in extremes], torch.float64))
        reduced |= dict(zip(extremes, largest.tolist()))
    return reduced


def all_reduce_max(value: int, device: torch.device) -> int:
    """The largest of an integer over all ranks."""
    return int(all_reduce_largest(torch.tensor([value], dtype=torch.int64, device=device)).item())


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
