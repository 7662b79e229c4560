"""The run's one named device mesh (`chattune.distributed.ParallelDims`), on real gloo process groups: for worlds of
1, 2 and 4 ranks and every context size that divides them, each rank's derived values (the members of each purpose's
group, the process groups made, its data rank and the number of data ranks, whether it reports its rows, its
coordinates as torch's DeviceMesh has them), and the gradient norm of a step of a context-parallel model, reduced
over the mesh's group, equal to the full gradient's and to stock transformers' on the same documents unpacked."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from chattune.config.schema import ParallelConfig
from chattune.data.documents import IGNORE_INDEX, Document
from chattune.data.feed import StepBatches
from chattune.data.packing import collate_packed
from chattune.distributed import ParallelDims, exit_process, init_distributed, shutdown_distributed
from chattune.model.causal_lm import PackedCausalLM
from chattune.model.cost.memory import MemoryInputs, estimate
from chattune.objectives.cross_entropy import TokenCrossEntropy
from chattune.parallel import tensor_parallel
from chattune.parallel.fsdp import shard_model
from chattune.train.step import accumulate_gradients, clip_gradients
from conftest import free_port, init_worker_process_group, spawn, tiny_model

# 8 query heads: every context size here divides them (4 repeats the 2 kv heads).
HEADS = {"model_type": "qwen3", "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16}
PURPOSES = ("dp", "cp", "dp_replicate", "dp_shard_cp", "tp")
# (parallel.replicate, parallel.context, parallel.tensor) of the layouts of a world of 1, 2 or 4 ranks (tensor 4
# would split the 2 kv heads 4 ways)
LAYOUTS = ((1, 1, 1), (1, 2, 1), (1, 4, 1), (2, 1, 1), (2, 2, 1), (4, 1, 1), (1, 1, 2), (2, 1, 2), (1, 2, 2))


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


def plain_gradients(data_ranks: int, model=None) -> dict[str, torch.Tensor]:
    """The independent reference: stock transformers (`model`; None: the tiny Qwen3 of HEADS), unsharded and
    unpacked, run on every data rank's documents one by one; loss = their summed cross-entropy / their trained
    tokens; its gradient by parameter name."""
    model = model if model is not None else tiny_model(seed=0, **HEADS)
    total, tokens = 0.0, 0
    for data_rank in range(data_ranks):
        for doc in documents(data_rank, model.config.vocab_size):
            logits = model(input_ids=torch.tensor([doc.input_ids.tolist()]), use_cache=False).logits[0]
            labels = torch.tensor(doc.labels.tolist())
            total = total + F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
            tokens += int((labels != IGNORE_INDEX).sum())
    (total / tokens).backward()
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def grad_norms(mesh: ParallelDims) -> tuple[float, float, float, float, int]:
    """One step of a tiny model sharded, replicated and its rows split as the mesh says: (the norm
    `clip_gradients` reduces over the mesh's group, the full gradient's norm gathered from the shards, the plain
    reference's, the full gradient's largest relative difference from the plain reference's, the bytes of this
    rank's parameter shards)."""
    hf_model = tiny_model(seed=0, **HEADS)
    policy = PackedCausalLM(hf_model, loss_chunk_size=64, context_group=mesh.cp_group)
    placement = shard_model(policy, mesh)
    policy.train()
    row = collate_packed(documents(mesh.data_rank, hf_model.config.vocab_size))
    accumulate_gradients(policy, TokenCrossEntropy(), StepBatches([row]), placement)
    grads = {name.removeprefix("hf_model."): p.grad for name, p in policy.named_parameters() if p.grad is not None}
    assert all(isinstance(g, DTensor) for g in grads.values())
    whole = {name: g.full_tensor() for name, g in grads.items()}
    full = torch.nn.utils.get_total_norm(list(whole.values()), foreach=True)
    norm, finite = clip_gradients(policy, placement, None)
    assert finite and placement.dims is mesh
    plain = plain_gradients(mesh.data_ranks)
    plain_norm = float(torch.nn.utils.get_total_norm(list(plain.values())))
    worst = max(float((whole[name] - g).norm() / g.norm()) for name, g in plain.items())
    held = sum(p.to_local().numel() * p.element_size() for p in policy.parameters())
    return norm, float(full), plain_norm, worst, held


def process_groups() -> int:
    """The process groups this rank is a member of (torch's registry; the default group included)."""
    return len(dist.distributed_c10d._world.pg_map)


def _worker(rank: int, world_size: int, port: int, out_path: str) -> None:
    init_worker_process_group(rank, world_size, port)
    found = {}
    for replicate, cp, tp in (layout for layout in LAYOUTS if world_size % math.prod(layout) == 0):
        before = process_groups()
        mesh = init_distributed("cpu", ParallelConfig(replicate=replicate, context=cp, tensor=tp))
        meshes = {purpose: m for purpose in PURPOSES if (m := mesh.mesh(purpose)) is not None}
        found[replicate, cp, tp] = {
            "new_groups": process_groups() - before,
            "groups": {purpose: members(mesh.group(purpose)) for purpose in PURPOSES},
            "fsdp_mesh": mesh.fsdp_mesh.mesh.tolist(),
            "local_ranks": {purpose: m.get_local_rank() for purpose, m in meshes.items()},
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


def expected(rank: int, world_size: int, replicate: int, cp: int, tp: int) -> dict:
    """What rank `rank` of a world laid out as (replicate, dp_shard, cp, tp), row-major, must find, derived from
    its coordinates alone."""
    shards = world_size // (replicate * tp)  # dp_shard x cp
    dp_shard = shards // cp
    coordinates = {
        "dp_replicate": rank // (shards * tp),
        "dp_shard": rank // (cp * tp) % dp_shard,
        "cp": rank // tp % cp,
        "tp": rank % tp,
    }
    r, c, t = coordinates["dp_replicate"], coordinates["cp"], coordinates["tp"]
    block = r * shards * tp  # the first rank of this replica group

    def line(ranks: list[int]) -> list[int] | None:  # a group of one rank has none
        return ranks if len(ranks) > 1 else None

    groups = {
        "dp": line([(d * cp + c) * tp + t for d in range(replicate * dp_shard)]),
        "cp": line([rank + (j - c) * tp for j in range(cp)]),
        "dp_replicate": line([g * shards * tp + rank % (shards * tp) for g in range(replicate)]),
        "dp_shard_cp": line([block + k * tp + t for k in range(shards)]),
        "tp": line([rank - t + j for j in range(tp)]),
    }
    local = {
        "dp": rank // (cp * tp),
        "cp": c,
        "dp_replicate": r,
        "dp_shard_cp": (rank - block) // tp,
        "tp": t,
    }
    if replicate > 1:
        fsdp = [[g * shards * tp + k * tp + t for k in range(shards)] for g in range(replicate)]
    else:
        fsdp = [block + k * tp + t for k in range(shards)]
    # Process groups beyond the world's: the data view's axes (dp, cp, tp) where two or more are above 1, and the
    # FSDP view (dp_replicate, dp_shard_cp even at 1, tp) under HSDP or tp; an axis over every rank reuses the world's.
    data_axes = [d for d in (replicate * dp_shard, cp, tp) if d > 1]
    made = len(data_axes) if len(data_axes) > 1 else 0
    if replicate > 1 or tp > 1:
        view = [d for d in (replicate, tp) if d > 1] + [shards]
        made += sum(1 for d in view if d < world_size)
    return {
        "coordinates": coordinates,
        "groups": groups,
        "local_ranks": {p: local[p] for p, ranks in groups.items() if ranks is not None},
        "fsdp_mesh": fsdp,
        "new_groups": made,
        "data": (rank // (cp * tp), replicate * dp_shard, c),
        "reports_rows": c == 0 and t == 0,
        "degrees": {"dp_replicate": replicate, "dp_shard": dp_shard, "cp": cp, "tp": tp},
        "shards": shards,
    }


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.launch
def test_the_mesh_derives_groups_ranks_and_the_gradient_norm_for_every_layout(tmp_path, world_size):
    out_path = str(tmp_path / "mesh")
    spawn(_worker, args=(world_size, free_port(), out_path), nprocs=world_size)
    layouts = [layout for layout in LAYOUTS if world_size % math.prod(layout) == 0]
    for rank in range(world_size):
        found = torch.load(f"{out_path}.rank{rank}")
        assert sorted(found) == sorted(layouts)
        for (replicate, cp, tp), got in found.items():
            where = (rank, replicate, cp, tp)
            want = expected(rank, world_size, replicate, cp, tp)
            assert got["groups"] == want["groups"], where
            assert got["fsdp_mesh"] == want["fsdp_mesh"], where
            assert got["local_ranks"] == want["local_ranks"], where  # each purpose's mesh places the rank as derived
            assert got["new_groups"] == want["new_groups"], (*where, got["new_groups"])
            assert (got["shard_ranks"], got["replicas"]) == (want["shards"], replicate), where
            assert (got["data_rank"], got["data_ranks"], got["cp_rank"]) == want["data"], where
            assert got["reports_rows"] == want["reports_rows"] and got["is_main"] == (rank == 0), where
            assert got["degrees"] == want["degrees"] and got["coordinates"] == want["coordinates"], where
            norm, full, plain, worst, held = got["norms"]
            assert abs(norm - full) <= 1e-5 * full, (*where, norm, full)  # the shards' norm is the whole's
            assert abs(norm - plain) <= 1e-5 * plain, (*where, norm, plain)  # ... and the plain model's
            assert worst <= 1e-5, (*where, worst)  # every gradient the plain model's
            # the memory estimate's parameter shards (`chattune.model.cost.memory`): this rank's, FSDP2's padding aside
            config = tiny_model(seed=0, **HEADS).config
            estimated = estimate(MemoryInputs(config, ranks=want["shards"], tokens=75, tensor=tp))
            assert abs(estimated.rows["parameters (fp32 shards)"] - held) <= 0.02 * held, (*where, held)


def _controls_worker(rank: int, world_size: int, port: int, out_path: str) -> None:
    """Deliberately wrong reductions, each on its own layout of 4 ranks: (HSDP's norm summing every replica's
    squares, a tp norm summing the squares of the parameters whole on every tp rank T times, tp without summing
    the per-head norms' gradients over the group), each after the right one."""
    init_worker_process_group(rank, world_size, port)
    found = {}
    hsdp = init_distributed("cpu", ParallelConfig(replicate=2))
    found["hsdp"] = grad_norms(hsdp)
    object.__setattr__(hsdp, "dp_replicate", 1)  # grad_norm_replicas reads it; the meshes stay HSDP's
    found["hsdp, replicas counted"] = grad_norms(hsdp)
    split = init_distributed("cpu", ParallelConfig(tensor=2))
    found["tp"] = grad_norms(split)
    object.__setattr__(split, "tp", 1)  # the norm reads it; the meshes stay tp's
    found["tp, whole parameters counted"] = grad_norms(split)
    object.__setattr__(split, "tp", 2)
    tensor_parallel._sum_gradients_over = lambda norm, group: None
    found["tp, head norms' gradients not summed"] = grad_norms(split)
    torch.save(found, f"{out_path}.rank{rank}")
    shutdown_distributed()
    exit_process()


@pytest.mark.launch
def test_wrong_reductions_are_caught(tmp_path):
    """The checks above fail each control: under HSDP every replica group holds the same reduced shards, so a norm
    summed over the world without dividing by the replicas is sqrt(2) times the plain model's on 2 groups; under
    tp the norms and embeddings are whole on both ranks of a group; and without summing Qwen3's q/k norm
    gradients over the group each rank keeps only its heads' part."""
    out_path = str(tmp_path / "controls")
    spawn(_controls_worker, args=(4, free_port(), out_path), nprocs=4)
    found = torch.load(f"{out_path}.rank0")
    for right in ("hsdp", "tp"):
        norm, _, plain, worst, _ = found[right]
        assert abs(norm - plain) <= 1e-5 * plain and worst <= 1e-5, right
    norm, _, plain, _, _ = found["hsdp, replicas counted"]
    assert abs(norm - 2**0.5 * plain) <= 1e-5 * plain
    norm, _, plain, _, _ = found["tp, whole parameters counted"]
    assert (
        norm - plain > 1e-4 * plain
    )  # the norms' and the (tied) embeddings' squares twice: ten times the check's limit
    _, _, _, worst, _ = found["tp, head norms' gradients not summed"]
    assert worst > 0.1


def test_a_layout_made_by_hand_or_without_a_group():
    """ParallelDims made by hand or from a config: its counts, no groups; a model never sharded: one rank."""
    one = ParallelDims.one_rank()
    assert one == ParallelDims(0, 1, 0, torch.device("cpu"), cp=1) == ParallelDims.from_config(None, 1)
    assert (one.data_rank, one.data_ranks, one.reports_rows, one.cp_group, one.group("tp")) == (0, 1, True, None, None)
    hand = ParallelDims.from_config(ParallelConfig(context=2), 8, rank=5, local_rank=1)
    assert (hand.data_rank, hand.data_ranks, hand.cp_rank, hand.reports_rows, hand.shard_ranks) == (2, 4, 1, False, 8)
    with pytest.raises(ValueError, match="no device mesh"):
        _ = hand.cp_group
    with pytest.raises(ValueError, match="no device mesh"):
        _ = hand.fsdp_mesh
    with pytest.raises(ValueError, match="no mesh for 'pp'"):
        hand.mesh("pp")
    with pytest.raises(ValueError, match=r"parallel.context=3 must divide the number of ranks, 8"):
        ParallelDims(0, 8, 0, torch.device("cpu"), cp=3)
    # expert parallelism borrows ranks from those FSDP2 shards over: no axis of its own, the data layout unchanged
    experts = ParallelDims.from_config(ParallelConfig(expert=2, replicate=2), 8, rank=5)
    assert (experts.data_rank, experts.data_ranks, experts.shard_ranks, experts.ep) == (5, 8, 4, 2)
    assert experts.describe() == (
        "8 ranks: dp_replicate 2 x dp_shard 4, parameters sharded over 4; experts split over ep 2 (sharded over 2)"
    )
    with pytest.raises(ValueError, match="no expert mesh"):
        _ = experts.expert_fsdp_mesh
    with pytest.raises(ValueError, match=r"parallel.expert=3: 3 does not divide the 4 ranks each parameter"):
        ParallelDims(0, 8, 0, torch.device("cpu"), dp_replicate=2, ep=3)
    with pytest.raises(ValueError, match=r"parallel.expert=2: expert parallelism is not composed with parallel.tensor"):
        ParallelDims(0, 8, 0, torch.device("cpu"), tp=2, ep=2)
    assert not dist.is_initialized()


def _kept_tp_worker(rank: int, port: int, out_path: str) -> None:
    init_worker_process_group(rank, 1, port)
    plain = init_distributed("cpu")
    kept = ParallelDims.build(torch.device("cpu"), None, keep=frozenset({"tp"}))
    tp_mesh = kept.mesh("tp")
    hf_model = tiny_model(seed=0, **HEADS)
    split = PackedCausalLM(hf_model, loss_chunk_size=64)
    shard_model(split, kept)
    found = {
        "plain": (plain.splits_layers, plain.mesh("tp")),
        "kept": (kept.splits_layers, tp_mesh.size(), kept.tp, kept.fsdp_mesh.mesh_dim_names),
        "split": (split.stream is not None, {p.device_mesh.mesh_dim_names for p in split.parameters()}),
        "norms": grad_norms(kept),
    }
    try:
        ParallelDims.build(torch.device("cpu"), None, keep=frozenset({"cp"}))
    except ValueError as error:
        found["refused"] = str(error)
    torch.save(found, out_path)
    shutdown_distributed()
    exit_process()


@pytest.mark.launch
def test_a_tp_mesh_kept_at_degree_one_splits_the_model_and_trains_as_the_plain_one(tmp_path):
    """`ParallelDims.build(keep={"tp"})` on one rank (the GPU check's tensor parallelism on one GPU): a tp mesh of
    size 1 that `shard_model` splits the decoder layers and the vocabulary over (the parameters on the 2-D
    (dp_shard_cp, tp) mesh), whose gradients equal stock transformers' on the documents unpacked; without `keep`
    no tp mesh; another purpose refused."""
    out = tmp_path / "found.pt"
    spawn(_kept_tp_worker, (free_port(), str(out)))
    found = torch.load(out, weights_only=False)
    assert found["plain"] == (False, None)
    assert found["kept"] == (True, 1, 1, ("dp_shard_cp",))
    # the linear layers and the vocabulary split over tp; the norms (whole on every rank of a tp group) over FSDP's
    assert found["split"] == (True, {("dp_shard_cp", "tp"), ("dp_shard_cp",)})
    norm, full, plain_norm, worst, _ = found["norms"]
    assert worst < 1e-5 and abs(norm - plain_norm) < 1e-5 * plain_norm and abs(full - plain_norm) < 1e-5 * plain_norm
    assert "only the tp and ep purposes" in found["refused"]
