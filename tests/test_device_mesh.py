"""The run's one named device mesh (`chattune.distributed.ParallelDims`), on real gloo process groups: for worlds of
1, 2 and 4 ranks and every context size that divides them, each rank's derived values (its context group's and
data-parallel group's members, its data rank and the number of data ranks, whether it reports its rows, its
coordinates as torch's DeviceMesh has them), and the gradient norm of a step of a context-parallel model, reduced
over the mesh's group, equal to the full gradient's and to stock transformers' on the same documents unpacked."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from chattune.data.documents import IGNORE_INDEX, Document
from chattune.data.packing import collate_packed
from chattune.distributed import (
    DistInfo,
    ParallelDims,
    counts_rows,
    current_mesh,
    exit_process,
    init_distributed,
    shutdown_distributed,
)
from chattune.model.causal_lm import PackedCausalLM
from chattune.model.fsdp import shard_model
from chattune.objectives.cross_entropy import TokenCrossEntropy
from chattune.train.feed import StepBatches
from chattune.train.step import accumulate_gradients, clip_gradients
from conftest import free_port, init_worker_process_group, spawn, tiny_model

# 8 query heads: every context size here divides them (4 repeats the 2 kv heads).
HEADS = {"model_type": "qwen3", "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16}


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


def plain_gradient_norm(data_ranks: int) -> float:
    """The independent reference: stock transformers, unsharded and unpacked, run on every data rank's documents
    one by one; loss = their summed cross-entropy / their trained tokens; the norm of its gradient."""
    model = tiny_model(seed=0, **HEADS)
    total, tokens = 0.0, 0
    for data_rank in range(data_ranks):
        for doc in documents(data_rank, model.config.vocab_size):
            logits = model(input_ids=torch.tensor([doc.input_ids.tolist()]), use_cache=False).logits[0]
            labels = torch.tensor(doc.labels.tolist())
            total = total + F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
            tokens += int((labels != IGNORE_INDEX).sum())
    (total / tokens).backward()
    return float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]))


def grad_norms(mesh: ParallelDims) -> tuple[float, float, float]:
    """One step of a tiny model whose rows are split across the mesh's context group: (the norm `clip_gradients`
    reduces over the mesh's group, the full gradient's norm gathered from the shards, the plain reference's)."""
    hf_model = tiny_model(seed=0, **HEADS)
    policy = shard_model(
        PackedCausalLM(hf_model, loss_chunk_size=64, context_group=mesh.cp_group), "cpu", mesh.shard_ranks
    )
    policy.train()
    row = collate_packed(documents(mesh.data_rank, hf_model.config.vocab_size))
    accumulate_gradients(policy, TokenCrossEntropy(), StepBatches([row]), torch.device("cpu"))
    grads = [p.grad for p in policy.parameters() if p.grad is not None]
    assert all(isinstance(g, DTensor) for g in grads)
    full = torch.nn.utils.get_total_norm([g.full_tensor() for g in grads], foreach=True)
    norm, finite = clip_gradients(policy, None)
    assert finite
    return norm, float(full), plain_gradient_norm(mesh.data_ranks)


def _worker(rank: int, world_size: int, port: int, out_path: str) -> None:
    init_worker_process_group(rank, world_size, port)
    found = {}
    for cp in (c for c in (1, 2, 4) if world_size % c == 0):
        mesh = init_distributed("cpu", context_size=cp)
        torch_mesh = mesh.mesh
        found[cp] = {
            "cp_group": members(mesh.cp_group),
            "dp_group": members(mesh.dp_group),
            "world_group": members(mesh.world_group),
            "grad_norm_group": members(mesh.grad_norm_group),
            "data_rank": mesh.data_rank,
            "data_ranks": mesh.data_ranks,
            "cp_rank": mesh.cp_rank,
            "reports_rows": mesh.reports_rows,
            "counts_rows": counts_rows(),
            "is_main": mesh.is_main,
            "degrees": mesh.degrees,
            "shard_ranks": mesh.shard_ranks,
            "current": current_mesh() is mesh,
            "mesh_axes": tuple(torch_mesh.mesh_dim_names),
            "mesh_coordinates": {axis: torch_mesh.get_local_rank(axis) for axis in torch_mesh.mesh_dim_names},
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
    for rank in range(world_size):
        found = torch.load(f"{out_path}.rank{rank}")
        assert sorted(found) == [c for c in (1, 2, 4) if world_size % c == 0]
        for cp, got in found.items():
            dp_shard = world_size // cp
            first = rank - rank % cp
            assert got["cp_group"] == (list(range(first, first + cp)) if cp > 1 else None), (rank, cp)
            assert got["dp_group"] == (list(range(rank % cp, world_size, cp)) if dp_shard > 1 else None), (rank, cp)
            assert got["world_group"] == got["grad_norm_group"] == list(range(world_size))
            assert (got["data_rank"], got["data_ranks"], got["cp_rank"]) == (rank // cp, dp_shard, rank % cp)
            assert got["reports_rows"] == got["counts_rows"] == (rank % cp == 0)
            assert got["is_main"] == (rank == 0) and got["current"]
            assert got["degrees"] == {"dp_shard": dp_shard, "cp": cp} and got["shard_ranks"] == world_size
            # torch's mesh holds the axes of degree above 1 (one of 1 on one rank), at the coordinates derived
            want_axes = tuple(a for a, d in (("dp_shard", dp_shard), ("cp", cp)) if d > 1) or ("dp_shard",)
            assert got["mesh_axes"] == want_axes
            assert got["mesh_coordinates"] == {axis: got["coordinates"][axis] for axis in want_axes}
            assert got["coordinates"] == {"dp_shard": rank // cp, "cp": rank % cp}
            norm, full, plain = got["norms"]
            assert abs(norm - full) <= 1e-5 * full, (rank, cp, norm, full)  # the shards' norm is the whole's
            assert abs(norm - plain) <= 1e-5 * plain, (rank, cp, norm, plain)  # ... and the plain model's


def test_a_mesh_made_by_hand_or_without_a_group():
    """DistInfo (the older name) made by hand: its counts, no groups; without a process group, one rank."""
    one = DistInfo(0, 1, 0, torch.device("cpu"))
    assert one == ParallelDims(0, 1, 0, torch.device("cpu"), cp=1)
    assert (one.data_rank, one.data_ranks, one.reports_rows, one.cp_group, one.dp_group) == (0, 1, True, None, None)
    hand = ParallelDims(5, 8, 1, torch.device("cpu"), cp=2)
    assert (hand.data_rank, hand.data_ranks, hand.cp_rank, hand.reports_rows, hand.context_size) == (2, 4, 1, False, 2)
    with pytest.raises(ValueError, match="no device mesh"):
        _ = hand.cp_group
    with pytest.raises(ValueError, match=r"parallel.context=3 must divide the number of ranks, 8"):
        ParallelDims(0, 8, 0, torch.device("cpu"), cp=3)
    assert not dist.is_initialized()
    assert current_mesh() == one and counts_rows()
