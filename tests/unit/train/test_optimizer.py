"""`build_optimizer`: fused on CUDA where the optimizer has a fused implementation, the default elsewhere.
`build_scheduler`: step k of a run trains at the schedule's value at k (the first step updates)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from omegaconf import OmegaConf

from chattune.train.optimizer import build_optimizer, build_scheduler


def _config(**extra):
    return OmegaConf.create({"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 1e-3, **extra})


def test_fused_on_cuda_unless_the_config_says_otherwise():
    params = [torch.nn.Parameter(torch.zeros(3))]  # fused AdamW also runs on CPU tensors, so this runs anywhere
    assert build_optimizer(_config(), params, torch.device("cuda")).defaults["fused"] is True
    assert not build_optimizer(_config(), params, torch.device("cpu")).defaults["fused"]
    assert not build_optimizer(_config(fused=False), params, torch.device("cuda")).defaults["fused"]
    assert not build_optimizer(_config(foreach=True), params, torch.device("cuda")).defaults["fused"]  # not both
    without_fused = OmegaConf.create({"_target_": "torch.optim.LBFGS", "_partial_": True, "lr": 1e-3})
    assert "fused" not in build_optimizer(without_fused, params, torch.device("cuda")).defaults  # not passed


def warmup_cosine_rates(lr: float, warmup: int, steps: int) -> list[float]:
    """By hand: the learning rate of steps 1..`steps` under the recipes' default schedule (transformers' cosine after
    a linear warm-up of `warmup` steps), step k read at k: lr * k / warmup during the warm-up, then half a cosine
    from lr at step `warmup` to 0 at the last step. The recipe tests compare their logged rates with it."""
    return [
        lr * k / warmup if k <= warmup else lr * 0.5 * (1 + math.cos(math.pi * (k - warmup) / (steps - warmup)))
        for k in range(1, steps + 1)
    ]


def _rates_taken(optimizer, scheduler, steps: int) -> list[float]:
    """The learning rate each of `steps` training steps takes (as the training loop steps them)."""
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def test_warmup_step_k_of_w_trains_at_k_over_w_and_the_last_step_at_the_schedules_end():
    """sft/tiny's schedule (cosine after a linear warm-up) over 8 steps with 3 of warm-up, by hand: step k takes
    lr * k / 3 for k = 1..3, then the cosine from its top (step 3) to 0 at the last step (8)."""
    lr, warmup, steps = 3e-3, 3, 8
    cosine = OmegaConf.create(
        {"_target_": "transformers.get_cosine_schedule_with_warmup", "_partial_": True, "num_warmup_steps": warmup}
    )
    want = warmup_cosine_rates(lr, warmup, steps)
    assert want[0] == pytest.approx(1e-3) and want[-1] == pytest.approx(0, abs=1e-18)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)
    optimizer.param_groups[0]["params"][0].grad = torch.ones(2)
    scheduler = build_scheduler(cosine, optimizer, steps)
    assert scheduler.get_last_lr()[0] == pytest.approx(want[0])  # what the loop logs as step 1's lr
    assert _rates_taken(optimizer, scheduler, steps) == pytest.approx(want, abs=1e-15)

    # A resume after step 5: a fresh scheduler given the saved state takes step 6 at the uninterrupted run's rate.
    first = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)
    first.param_groups[0]["params"][0].grad = torch.ones(2)
    interrupted = build_scheduler(cosine, first, steps)
    _rates_taken(first, interrupted, 5)
    resumed = build_scheduler(cosine, first, steps)
    resumed.load_state_dict(interrupted.state_dict())
    first.param_groups[0]["lr"] = resumed.get_last_lr()[0]  # as the checkpoint's optimizer state brings it back
    assert _rates_taken(first, resumed, 3) == pytest.approx(want[5:], abs=1e-15)


def test_every_schedule_is_read_at_the_step_it_trains():
    """Any `_partial_` schedule, not only transformers' warm-ups: a linear decay over 4 steps takes 3/4, 2/4, 1/4, 0
    of lr (read from 0 it would take 1, 3/4, 2/4, 1/4), and no warning about the scheduler's order is given."""
    linear = OmegaConf.create(
        {"_target_": "transformers.get_linear_schedule_with_warmup", "_partial_": True, "num_warmup_steps": 0}
    )
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scheduler = build_scheduler(linear, optimizer, 4)
    assert _rates_taken(optimizer, scheduler, 4) == pytest.approx([0.75, 0.5, 0.25, 0.0])


@pytest.mark.parametrize(
    "warmup, steps, cycles", [(0, 8, 0.5), (3, 8, 0.5), (10, 100, 0.5), (4, 50, 2.0), (20, 10, 0.5)]
)
def test_the_default_schedule_equals_transformers_cosine_with_warmup_at_every_step(warmup, steps, cycles):
    from transformers import get_cosine_schedule_with_warmup

    from chattune.train.schedule import cosine_with_warmup

    rates = []
    for make in (cosine_with_warmup, get_cosine_schedule_with_warmup):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.3)
        scheduler = make(optimizer, num_warmup_steps=warmup, num_training_steps=steps, num_cycles=cycles)
        rates.append(
            [scheduler.get_last_lr()[0]] + [(scheduler.step(), scheduler.get_last_lr()[0])[1] for _ in range(steps + 2)]
        )
    assert rates[0] == rates[1]  # exact: the same arithmetic


@pytest.mark.launch
def test_the_default_schedule_imports_neither_peft_nor_bitsandbytes_and_resumes_transformers_name():
    """transformers' schedules module imports peft and bitsandbytes (1.4 s of each rank's start-up): a run without
    adapters builds the default schedule without them. A checkpoint whose config names transformers' function is
    the same schedule to a resume; another schedule is a change."""
    script = """
import sys, torch
from omegaconf import OmegaConf
from chattune.config.schema import SchedulerConfig
from chattune.train.optimizer import build_scheduler
optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
build_scheduler(OmegaConf.structured(SchedulerConfig), optimizer, 20)
print(sorted(name for name in ("peft", "bitsandbytes", "transformers.optimization") if name in sys.modules))
"""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr[-3000:]

    from chattune.checkpoint.resume import differences

    def fingerprint(target: str) -> dict:
        return {"config": {"scheduler._target_": target, "scheduler.num_warmup_steps": 10}}

    ours, theirs = (
        fingerprint("chattune.train.schedule.cosine_with_warmup"),
        fingerprint("transformers.get_cosine_schedule_with_warmup"),
    )
    assert differences(theirs, ours) == [] and differences(ours, theirs) == []
    changed = differences(theirs, fingerprint("transformers.get_linear_schedule_with_warmup"))
    assert [difference.key for difference in changed] == ["scheduler._target_"]
