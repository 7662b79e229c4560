"""The run's one named device mesh (`chattune.distributed.ParallelDims`), on real gloo process groups: for worlds of
1, 2 and 4 ranks and every context size that divides them, each rank's derived values (the members of each purpose's
group, the process groups made, its data rank and the number of data ranks, whether it reports its rows, its
coordinates as torch's DeviceMesh has them), and the gradient norm of a step of a context-parallel model, reduced
over the mesh's group, equal to the full gradient's and to stock transformers' on the same documents unpacked."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from chattune.config.schema import ParallelConfig
from chattune.data.documents import IGNORE_INDEX, Document
from chattune.data.packing import collate_packed
from chattune.distributed import ParallelDims, exit_process, init_distributed, shutdown_distributed
from chattune.model.causal_lm import PackedCausalLM
from chattune.model.fsdp import parallel_dims_of, shard_model
from chattune.objectives.cross_entropy import TokenCrossEntropy
from chattune.train.feed import StepBatches
from chattune.train.step import accumulate_gradients, clip_gradients
from conftest import free_port, init_worker_process_group, spawn, tiny_model

# 8 query heads: every context size here divides them (4 repeats the 2 kv heads).
HEADS = {"model_type": "qwen3", "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16}
PURPOSES = ("dp", "cp", "dp_replicate", "dp_shard_cp", "dp_cp")
# (parallel.replicate, parallel.context) of every layout of a world of 1, 2 or 4 ranks
LAYOUTS = ((1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (4, 1))


def members(group) -> list[int] | None:
    return None if group is None else dist.get_process_group_ranks(group)


def documents(data_rank: int, vocab: int) -> list[Document]:
    """Two documents, their own for each data rank (the ranks of a context group share them)."""
    generator = np.random.default_rng(data_rank)
    docs = []
    for doc_id, length in enumerate((45, 30)):
        ids = generator.integers(16, vocab, size=length)
        labels = np.full(length, IGNORE_INDEX)
        labels[5 : length - 1] = ids[6:]
        docs.append(Document(doc_id, ids, labels))
    return docs


def plain_gradients(data_ranks: int) -> dict[str, torch.Tensor]:
    """The independent reference: stock transformers, unsharded and unpacked, run on every data rank's documents
    one by one; loss = their summed cross-entropy / their trained tokens; its gradient by parameter name."""
    model = tiny_model(seed=0, **HEADS)
    total, tokens = 0.0, 0
    for data_rank in range(data_ranks):
        for doc in documents(data_rank, model.config.vocab_size):
            logits = model(input_ids=torch.tensor([doc.input_ids.tolist()]), use_cache=False).logits[0]
            labels = torch.tensor(doc.labels.tolist())
            total = total + F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
            tokens += int((labels != IGNORE_INDEX).sum())
    (total / tokens).backward()
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def grad_norms(mesh: ParallelDims) -> tuple[float, float, float, float]:
    """One step of a tiny model sharded, replicated and its rows split as the mesh says: (the norm
    `clip_gradients` reduces over the mesh's group, the full gradient's norm gathered from the shards, the plain
    reference's, the full gradient's largest relative difference from the plain reference's)."""
    hf_model = tiny_model(seed=0, **HEADS)
    policy = shard_model(PackedCausalLM(hf_model, loss_chunk_size=64, context_group=mesh.cp_group), mesh)
    policy.train()
    row = collate_packed(documents(mesh.data_rank, hf_model.config.vocab_size))
    accumulate_gradients(policy, TokenCrossEntropy(), StepBatches([row]), torch.device("cpu"))
    grads = {name.removeprefix("hf_model."): p.grad for name, p in policy.named_parameters() if p.grad is not None}
    assert all(isinstance(g, DTensor) for g in grads.values())
    whole = {name: g.full_tensor() for name, g in grads.items()}
    full = torch.nn.utils.get_total_norm(list(whole.values()), foreach=True)
    norm, finite = clip_gradients(policy, None)
    assert finite and parallel_dims_of(policy) is mesh
    plain = plain_gradients(mesh.data_ranks)
    plain_norm = float(torch.nn.utils.get_total_norm(list(plain.values())))
    worst = max(float((whole[name] - g).norm() / g.norm()) for name, g in plain.items())
    return norm, float(full), plain_norm, worst


def process_groups() -> int:
    """The process groups this rank is a member of (torch's registry; the default group included)."""
    return len(dist.distributed_c10d._world.pg_map)


def _worker(rank: int, world_size: int, port: int, out_path: str) -> None:
    init_worker_process_group(rank, world_size, port)
    found = {}
    for replicate, cp in (layout for layout in LAYOUTS if world_size % (layout[0] * layout[1]) == 0):
        before = process_groups()
        mesh = init_distributed("cpu", ParallelConfig(replicate=replicate, context=cp))
        local_ranks = {purpose: m.get_local_rank() for purpose in PURPOSES if (m := mesh.mesh(purpose)) is not None}
        found[replicate, cp] = {
            "new_groups": process_groups() - before,
            "groups": {purpose: members(mesh.group(purpose)) for purpose in PURPOSES},
            "cp_group": members(mesh.cp_group),
            "loss_group": members(mesh.loss_group),
            "fsdp_mesh": mesh.fsdp_mesh.mesh.tolist(),
            "local_ranks": local_ranks,
            "data_rank": mesh.data_rank,
            "data_ranks": mesh.data_ranks,
            "cp_rank": mesh.cp_rank,
            "reports_rows": mesh.reports_rows,
            "is_main": mesh.is_main,
            "degrees": mesh.degrees,
            "shard_ranks": mesh.shard_ranks,
            "replicas": mesh.grad_norm_replicas,
            "coordinates": mesh.coordinates,
            "norms": grad_norms(mesh),
        }
    torch.save(found, f"{out_path}.rank{rank}")
    shutdown_distributed()
    exit_process()


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.launch
def test_the_mesh_derives_groups_ranks_and_the_gradient_norm_for_every_layout(tmp_path, world_size):
    out_path = str(tmp_path / "mesh")
    spawn(_worker, args=(world_size, free_port(), out_path), nprocs=world_size)
    world = list(range(world_size))
    layouts = [layout for layout in LAYOUTS if world_size % (layout[0] * layout[1]) == 0]
    for rank in range(world_size):
        found = torch.load(f"{out_path}.rank{rank}")
        assert sorted(found) == sorted(layouts)
        for (replicate, cp), got in found.items():
            shards = world_size // replicate  # the ranks of a replica group: dp_shard x cp
            dp_shard = shards // cp
            first = rank - rank % cp
            context = list(range(first, first + cp)) if cp > 1 else None
            data = list(range(rank % cp, world_size, cp)) if world_size > cp else None
            replicas = list(range(rank % shards, world_size, shards)) if replicate > 1 else None
            shard_first = rank - rank % shards
            shard_group = list(range(shard_first, shard_first + shards)) if shards > 1 else None
            everyone = world if world_size > 1 else None
            want = {"dp": data, "cp": context, "dp_replicate": replicas, "dp_shard_cp": shard_group, "dp_cp": everyone}
            assert got["groups"] == want, (rank, replicate, cp)
            assert got["cp_group"] == context and got["loss_group"] == everyone, (rank, replicate, cp)
            fsdp = [list(range(r * shards, (r + 1) * shards)) for r in range(replicate)] if replicate > 1 else world
            assert got["fsdp_mesh"] == fsdp and got["shard_ranks"] == shards and got["replicas"] == replicate
            # each purpose's mesh places this rank where the derived values say
            want_local = {
                "dp": rank // cp,
                "cp": rank % cp,
                "dp_replicate": rank // shards,
                "dp_shard_cp": rank % shards,
                "dp_cp": rank,
            }
            assert got["local_ranks"] == {p: want_local[p] for p, ranks in want.items() if ranks is not None}
            # groups beyond the world's only where they are not the world: the data and context groups, and
            # HSDP's shard group and its replica group (the world's on 2 replicas of 1 rank)
            made = (2 if 1 < cp < world_size else 0) + ((replicate < world_size) + 1 if replicate > 1 else 0)
            assert got["new_groups"] == made, (rank, replicate, cp, got["new_groups"])
            data_ranks = replicate * dp_shard
            assert (got["data_rank"], got["data_ranks"], got["cp_rank"]) == (rank // cp, data_ranks, rank % cp)
            assert got["reports_rows"] == (rank % cp == 0)
            assert got["is_main"] == (rank == 0)
            assert got["degrees"] == {"dp_replicate": replicate, "dp_shard": dp_shard, "cp": cp}
            assert got["coordinates"] == {
                "dp_replicate": rank // shards,
                "dp_shard": rank // cp % dp_shard,
                "cp": rank % cp,
            }
            norm, full, plain, worst = got["norms"]
            assert abs(norm - full) <= 1e-5 * full, (rank, replicate, cp, norm, full)  # the shards' norm is the whole's
            assert abs(norm - plain) <= 1e-5 * plain, (rank, replicate, cp, norm, plain)  # ... and the plain model's
            assert worst <= 1e-5, (rank, replicate, cp, worst)  # every gradient the plain model's


def _counted_replicas_worker(rank: int, world_size: int, port: int, out_path: str) -> None:
    """The control: HSDP's gradient norm with each replica's squares counted (the sum over the world, undivided)."""
    init_worker_process_group(rank, world_size, port)
    mesh = init_distributed("cpu", ParallelConfig(replicate=2))
    once = grad_norms(mesh)
    object.__setattr__(mesh, "dp_replicate", 1)  # grad_norm_replicas reads it; the meshes stay HSDP's
    torch.save((once, grad_norms(mesh)), f"{out_path}.rank{rank}")
    shutdown_distributed()
    exit_process()


@pytest.mark.launch
def test_a_norm_that_counts_every_replica_is_caught(tmp_path):
    """Under HSDP every replica group holds the same reduced shards: a norm summed over the world without dividing
    by the replicas is sqrt(2) times the plain model's on 2 replicas, and the comparison above fails it."""
    out_path = str(tmp_path / "replicas")
    spawn(_counted_replicas_worker, args=(4, free_port(), out_path), nprocs=4)
    once, counted = torch.load(f"{out_path}.rank0")
    assert abs(once[0] - once[2]) <= 1e-5 * once[2]
    assert abs(counted[0] - 2**0.5 * counted[2]) <= 1e-5 * counted[2]


def test_a_layout_made_by_hand_or_without_a_group():
    """ParallelDims made by hand or from a config: its counts, no groups; a model never sharded: one rank."""
    one = ParallelDims.one_rank()
    assert one == ParallelDims(0, 1, 0, torch.device("cpu"), cp=1) == ParallelDims.from_config(None, 1)
    assert (one.data_rank, one.data_ranks, one.reports_rows, one.cp_group, one.loss_group) == (0, 1, True, None, None)
    hand = ParallelDims.from_config(ParallelConfig(context=2), 8, rank=5, local_rank=1)
    assert (hand.data_rank, hand.data_ranks, hand.cp_rank, hand.reports_rows, hand.shard_ranks) == (2, 4, 1, False, 8)
    with pytest.raises(ValueError, match="no device mesh"):
        _ = hand.cp_group
    with pytest.raises(ValueError, match="no device mesh"):
        _ = hand.fsdp_mesh
    with pytest.raises(ValueError, match="no mesh for 'tp'"):
        hand.mesh("tp")
    with pytest.raises(ValueError, match=r"parallel.context=3 must divide the number of ranks, 8"):
        ParallelDims(0, 8, 0, torch.device("cpu"), cp=3)
    assert not dist.is_initialized()
    assert parallel_dims_of(tiny_model()) == one
