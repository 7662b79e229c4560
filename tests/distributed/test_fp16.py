"""fp16 compute with loss scaling: gradients already divided by a large global token count underflow in
fp16 without it (silently, which is why fp16 used to be a trap); with it they match the fp32 gradients,
and an overflow skips the update on every rank and lowers the scale."""

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
from chattune.train.step import LossScale, UpdateRule, accumulate_gradients, clip_gradients, train_step
from conftest import demo_documents, free_port, init_worker_process_group, mesh_dims, relative_error, spawn, tiny_model

# A real step holds millions of trainable tokens (64 microbatches of 16k tokens on 8 ranks): each token's
# gradient is divided by all of them. This objective counts each token as that many.
TOKENS_PER_TOKEN = 4096


class LargeStep(TokenCrossEntropy):
    def count_units(self, batch):
        return super().count_units(batch) * TOKENS_PER_TOKEN


def gradients(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.full_tensor().float().clone() for name, p in model.named_parameters()}


def _worker(rank: int, world_size: int, port: int, out: str) -> None:
    init_worker_process_group(rank, world_size, port)
    batch = collate_packed(demo_documents(4, start=4 * rank))
    torch.device("cpu")
    results = {}
    for name, dtype, scale in (("fp32", "float32", 1.0), ("fp16", "float16", 1.0), ("fp16_scaled", "float16", 2.0**16)):
        model = PackedCausalLM(tiny_model(seed=0))
        placement = shard_model(model, mesh_dims(), param_dtype=dtype)
        accumulate_gradients(model, LargeStep(), StepBatches([batch]), placement, loss_scale=scale)
        norm, _ = clip_gradients(model, placement, None, loss_scale=scale)
        results[name] = (gradients(model), norm)

    # An overflow: finite losses, infinite gradients. Every rank skips the update and halves the scale.
    model = PackedCausalLM(tiny_model(seed=0))
    placement = shard_model(model, mesh_dims(), param_dtype="float16")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    before = [p.full_tensor().clone() for p in model.parameters()]
    loss_scale = LossScale(enabled=True, init_scale=2.0**100)
    overflowed, norm = train_step(
        model,
        LargeStep(),
        StepBatches([batch]),
        UpdateRule(optimizer, scheduler, 1.0, loss_scale=loss_scale),
        placement,
    )
    unchanged = all(torch.equal(a, p.full_tensor()) for a, p in zip(before, model.parameters()))
    after_overflow = loss_scale.scale
    loss_scale.scale = 2.0**16
    stepped, _ = train_step(
        model,
        LargeStep(),
        StepBatches([batch]),
        UpdateRule(optimizer, scheduler, 1.0, loss_scale=loss_scale),
        placement,
    )
    changed = not all(torch.equal(a, p.full_tensor()) for a, p in zip(before, model.parameters()))
    if rank == 0:
        torch.save(
            {
                "results": results,
                "overflow": overflowed.overflow,
                "overflow_norm": norm,
                "unchanged": unchanged,
                "after_overflow": after_overflow,
                "stepped": not stepped.overflow and changed,
            },
            out,
        )
    shutdown_distributed()
    exit_process()


@pytest.mark.launch
def test_fp16_gradients_underflow_without_loss_scaling_and_match_fp32_with_it(tmp_path):
    out = str(tmp_path / "fp16.pt")
    spawn(_worker, args=(2, free_port(), out), nprocs=2)
    saved = torch.load(out)
    reference, reference_norm = saved["results"]["fp32"]
    unscaled, _ = saved["results"]["fp16"]
    scaled, scaled_norm = saved["results"]["fp16_scaled"]
    zeros = sum(int((g == 0).sum()) for g in unscaled.values()) / sum(g.numel() for g in unscaled.values())
    assert zeros > 0.2 and relative_error(unscaled, reference) > 0.5, (zeros, relative_error(unscaled, reference))
    # fp16 rounding of activations remains (~1e-3 relative); the underflow is gone.
    assert relative_error(scaled, reference) < 2e-2, relative_error(scaled, reference)
    assert abs(scaled_norm - reference_norm) < 2e-2 * reference_norm

    assert saved["overflow"] and not math.isfinite(saved["overflow_norm"])
    assert saved["unchanged"] and saved["after_overflow"] == 2.0**99
    assert saved["stepped"]


def test_the_loss_scale_grows_after_finite_steps_and_resumes_where_it_was():
    scale = LossScale(enabled=True, init_scale=8.0, growth_interval=2)
    scale.update(overflow=False)
    assert scale.scale == 8.0
    scale.update(overflow=False)
    assert scale.scale == 16.0
    scale.update(overflow=False)
    scale.update(overflow=True)
    assert scale.scale == 8.0 and scale.good_steps == 0
    scale.update(overflow=False)
    restored = LossScale(enabled=True)
    restored.load_state_dict(scale.state_dict())
    assert (restored.scale, restored.good_steps) == (8.0, 1)
    off = LossScale(enabled=False)
    off.update(overflow=True)
    assert off.scale == 1.0  # bf16 and fp32 run unscaled
