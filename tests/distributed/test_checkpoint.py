"""Sharded checkpoints and the Hugging Face export, with two real ranks."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoModelForCausalLM

from chattune.checkpoint.checkpoint import find_latest, load_checkpoint, save_checkpoint
from chattune.checkpoint.layout import committed_checkpoints
from chattune.checkpoint.run_state import model_and_optimizer
from chattune.data.feed import StepBatches
from chattune.data.packing import collate_packed
from chattune.distributed import exit_process, shutdown_distributed
from chattune.model.causal_lm import PackedCausalLM
from chattune.model.io.export import export_hf
from chattune.objectives.cross_entropy import TokenCrossEntropy
from chattune.parallel.fsdp import Placement, shard_model
from chattune.train.step import UpdateRule, train_step
from conftest import demo_documents, demo_tokenizer, free_port, init_worker_process_group, mesh_dims, spawn, tiny_model


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k.removeprefix("hf_model."): v.full_tensor().clone() for k, v in model.state_dict().items()}


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every moment whole (a torchao quantized state as the values its codes and scales give)."""
    moments = [optimizer.state[p][key].full_tensor() for p in model.parameters() for key in ("exp_avg", "exp_avg_sq")]
    return [m.dequantize() if hasattr(m, "dequantize") else m.clone() for m in moments]


def sharded(seed: int, world_size: int, optimizer: str = "AdamW") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The tests' tiny model sharded, and its optimizer: torch's AdamW, or torchao's `AdamW8bit` (eager: no
    compile of its step for one or two steps)."""
    model = PackedCausalLM(tiny_model(seed=seed))
    shard_model(model, mesh_dims())
    if optimizer == "AdamW8bit":
        import torchao.optim

        os.environ["TORCHDYNAMO_DISABLE"] = "1"  # (a spawned worker's own environment)
        return model, torchao.optim.AdamW8bit(model.parameters(), lr=1e-2)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


class Saved:
    """A part of the run state that holds a plain dict (what a rank saves beside the shards)."""

    def __init__(self, value: dict):
        self.value = value

    def state_dict(self) -> dict:
        return dict(self.value)

    def load_state_dict(self, state: dict) -> None:
        self.value = dict(state)


def run_state(model, optimizer, saved: dict):
    state = model_and_optimizer(model, optimizer)
    state.add("saved", Saved(saved))
    return state


def _worker(rank: int, world_size: int, port: int, tmp: str) -> None:
    from pathlib import Path

    init_worker_process_group(rank, world_size, port)
    tmp_path = Path(tmp)
    model, optimizer = sharded(seed=0, world_size=world_size)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    batch = collate_packed(demo_documents(4, start=4 * rank))
    train_step(
        model, TokenCrossEntropy(), StepBatches([batch]), UpdateRule(optimizer, scheduler, 1.0), Placement(mesh_dims())
    )
    root = tmp_path / "checkpoints"
    save_checkpoint(root, 1, run_state(model, optimizer, {"rank": rank}), manifest={"world_size": world_size})
    export_hf(model, demo_tokenizer(), tmp_path / "hf", is_main=rank == 0)
    weights, moments = full_state(model), full_optimizer_state(model, optimizer)

    other, other_optimizer = sharded(seed=1, world_size=world_size)  # different weights, no optimizer state yet
    train_step(
        other,
        TokenCrossEntropy(),
        StepBatches([batch]),
        UpdateRule(other_optimizer, torch.optim.lr_scheduler.LambdaLR(other_optimizer, lambda s: 1.0), 1.0),
        Placement(mesh_dims()),
    )
    assert any(not torch.equal(weights[k], v) for k, v in full_state(other).items())
    restored_state = run_state(other, other_optimizer, {})
    step = load_checkpoint(root / "step_1", restored_state)
    assert {"step": step, **restored_state["saved"].value} == {"step": 1, "rank": rank}
    restored = full_state(other)
    assert all(torch.equal(weights[k], restored[k]) for k in weights)
    assert all(torch.equal(a, b) for a, b in zip(moments, full_optimizer_state(other, other_optimizer)))
    # Pruning keeps the newest; an uncommitted (.partial) directory is never a checkpoint.
    for step in (2, 3, 4):
        save_checkpoint(root, step, run_state(other, other_optimizer, {}), manifest={}, keep_last_n=2)
    if rank == 0:
        (root / "step_9.partial").mkdir()
        assert [p.name for p in committed_checkpoints(root)] == ["step_3", "step_4"]
        assert find_latest(root) == root / "step_4"
        torch.save(weights, tmp_path / "weights.pt")
    shutdown_distributed()
    exit_process()


@pytest.mark.launch
def test_checkpoint_round_trip_and_hf_export(tmp_path):
    spawn(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    weights = torch.load(tmp_path / "weights.pt")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert set(weights) <= set(exported)  # tied lm_head.weight may appear only in the loaded model
    for name, value in weights.items():
        assert torch.equal(exported[name], value), name
    assert torch.equal(exported["lm_head.weight"], exported["model.embed_tokens.weight"])


def test_async_saves_stage_through_one_reused_stager(monkeypatch, tmp_path):
    """Every save of a run hands DCP the same stager (chattune.checkpoint.staging.ReusedHostStager: its buffers made
    once; page-locked where CUDA is), closed at the end. Before, torch 2.11 and 2.12 got a fresh DCP stager, and a
    fresh pinned copy of the whole state, per save."""
    from concurrent.futures import Future

    from chattune.checkpoint import checkpoint

    passed = []

    def async_save(state, checkpoint_id, process_group, async_stager):
        passed.append(async_stager)
        done = Future()
        done.set_result(None)
        return done

    monkeypatch.setattr(checkpoint.dcp, "async_save", async_save)
    saves = checkpoint.BackgroundSaves(torch.device("cuda", 0))
    for name in ("a", "b"):
        saves.start({}, tmp_path / name, lambda: None)
        saves.wait()
    saves.close()
    assert passed == [saves.stager, saves.stager] and saves.stager.buffers.pinned == torch.cuda.is_available()
    assert not checkpoint.BackgroundSaves(torch.device("cpu")).stager.buffers.pinned


def test_three_async_saves_through_dcp_write_each_state_from_one_set_of_buffers(tmp_path):
    """Three saves through the real `dcp.async_save`, each of a different state, each read back equal, all staged
    into buffers allocated once. (DCP's own stager, kept for a run, raised `KeyError: <class 'type'>` at the second
    save on torch 2.11 and 2.12: the first GPU run's resume check.)"""
    from chattune.checkpoint import checkpoint

    saves = checkpoint.BackgroundSaves()
    states = [
        {"weights": {"w": torch.full((3, 4), float(k)), "b": torch.arange(5.0) * k}, "step": {"n": k}} for k in range(3)
    ]
    try:
        for k, state in enumerate(states):
            saves.start(state, tmp_path / f"step_{k}", lambda: None)
            saves.wait()
    finally:
        saves.close()
    for k, state in enumerate(states):
        loaded = {"weights": {"w": torch.zeros(3, 4), "b": torch.zeros(5)}, "step": {"n": -1}}
        dcp.load(loaded, checkpoint_id=str(tmp_path / f"step_{k}"))
        assert torch.equal(loaded["weights"]["w"], state["weights"]["w"]), k
        assert torch.equal(loaded["weights"]["b"], state["weights"]["b"]), k
        assert loaded["step"]["n"] == k
    assert saves.stager.buffers.allocations == 1
