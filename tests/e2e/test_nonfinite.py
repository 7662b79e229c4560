"""A non-finite loss on ONE rank stops the update on EVERY rank, with no extra collective and no hang."""

from __future__ import annotations

import math

import pytest
import torch

from chattune.data.feed import StepBatches
from chattune.data.packing import collate_packed
from chattune.distributed import exit_process, shutdown_distributed
from chattune.model.causal_lm import PackedCausalLM
from chattune.objectives.cross_entropy import TokenCrossEntropy
from chattune.parallel.fsdp import shard_model
from chattune.train.step import UpdateRule, train_step
from conftest import demo_documents, free_port, init_worker_process_group, mesh_dims, spawn, tiny_model

pytestmark = pytest.mark.launch  # every test here starts processes


class PoisonedOnRank(TokenCrossEntropy):
    """The SFT loss, made NaN on one rank (as an overflow in one microbatch would)."""

    def __init__(self, rank: int, poisoned_rank: int):
        super().__init__()
        self.poison = rank == poisoned_rank

    def loss_sum(self, model, batch):
        loss, figures = super().loss_sum(model, batch)
        return (loss * float("nan") if self.poison else loss), figures


def full_weights(model) -> list[torch.Tensor]:
    return [p.full_tensor().clone() for p in model.parameters()]


def _worker(rank: int, world_size: int, port: int, out: str) -> None:
    init_worker_process_group(rank, world_size, port)
    model = PackedCausalLM(tiny_model(seed=0))
    placement = shard_model(model, mesh_dims())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    batch = collate_packed(demo_documents(3, start=3 * rank))
    before = full_weights(model)

    _, poisoned_norm = train_step(
        model,
        PoisonedOnRank(rank, poisoned_rank=1),
        StepBatches([batch]),
        UpdateRule(optimizer, scheduler, 1.0),
        placement,
    )
    unchanged = all(torch.equal(a, b) for a, b in zip(before, full_weights(model)))
    no_optimizer_state = len(optimizer.state) == 0
    grads_cleared = all(p.grad is None for p in model.parameters())

    _, clean_norm = train_step(
        model, TokenCrossEntropy(), StepBatches([batch]), UpdateRule(optimizer, scheduler, 1.0), placement
    )
    updated = not all(torch.equal(a, b) for a, b in zip(before, full_weights(model)))
    torch.save(
        {
            "poisoned_norm": poisoned_norm,
            "unchanged": unchanged,
            "no_optimizer_state": no_optimizer_state,
            "grads_cleared": grads_cleared,
            "clean_norm": clean_norm,
            "updated": updated,
        },
        f"{out}.rank{rank}",
    )
    shutdown_distributed()
    exit_process()


def test_nan_on_one_rank_skips_the_update_on_all_ranks(tmp_path):
    out = str(tmp_path / "result")
    spawn(_worker, args=(2, free_port(), out), nprocs=2)
    for rank in (0, 1):
        result = torch.load(f"{out}.rank{rank}")
        assert math.isnan(result["poisoned_norm"]), f"rank {rank} did not see the other rank's NaN"
        assert result["unchanged"] and result["no_optimizer_state"] and result["grads_cleared"], f"rank {rank} stepped"
        assert math.isfinite(result["clean_norm"]) and result["updated"], (
            f"rank {rank}: the next clean step must update"
        )


def test_recipe_skips_or_stops_on_a_diverged_run_without_hanging(tmp_path):
    """An absurd learning rate makes the weights overflow by step 3: `skip` counts the skipped updates and
    finishes; `stop` ends every rank with the error, the checkpoints before it intact."""
    from test_resume import launch
    from test_sft_recipe import read_metrics

    data = tmp_path / "chats.jsonl"
    from chattune.config.paths import DEMO_ASSETS

    data.write_text("".join((DEMO_ASSETS / "chat_train.jsonl").read_text().splitlines(keepends=True)[:40]))
    diverge = ["optimizer.lr=1e30", "scheduler.num_warmup_steps=2", "max_steps=6", "save_every=1"]
    launch(tmp_path / "skip", data, 2, *diverge)
    metrics = read_metrics(tmp_path / "skip")
    assert metrics[-1]["step"] == 6 and metrics[-1]["nonfinite_skipped_steps"] >= 1
    assert any(math.isnan(m["grad_norm"]) for m in metrics)

    stopped = launch(tmp_path / "stop", data, 2, *diverge, "nonfinite_loss=stop", check=False)
    assert stopped.returncode != 0
    log = stopped.stdout + stopped.stderr
    assert "non-finite loss or gradients; the optimizer did not step" in log
    last_good = max(m["step"] for m in read_metrics(tmp_path / "stop"))
    committed = sorted(
        int(p.name.split("_")[1])
        for p in (tmp_path / "stop" / "checkpoints").glob("step_*")
        if not p.name.endswith(".partial")
    )
    assert committed and committed[-1] == last_good  # every completed step saved; the failed one not
