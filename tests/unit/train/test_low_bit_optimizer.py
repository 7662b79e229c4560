"""torchao's low-bit AdamW (`optimizer._target_=torchao.optim.AdamW8bit`, `AdamW4bit`) on FSDP2's shards: 30 steps of
the tiny model within the documented tolerance of fp32 AdamW (8-bit on 2 real ranks, 4-bit on 1), and a stop and
resume that gives the uninterrupted 8-bit run's losses bit for bit (the quantized states round-trip through DCP),
on 1 rank too, and with torchao's compiled step as a user's run takes it.

The long runs step eagerly (TORCHDYNAMO_DISABLE: torchao's step uncompiled, the same arithmetic to ~1e-6): torchao
compiles its step once per shard shape, half of a compiled launch's time on CPU; one resumed launch compiles."""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import pytest
from test_resume import read_metrics

from conftest import launch, torchrun
from reference_runs import EAGER, LOW_BIT_KEYS, LOW_BIT_STEPS, reference_run

pytest.importorskip("torchao.optim")

# The documented tolerance (docs/memory.md, "Low-bit optimizer states"), against fp32 AdamW over these 30 steps: every step's
# loss within 0.02 nats (8-bit), 0.4 (4-bit); the mean of the last 10 within 0.5% (8-bit), 12% (4-bit). Measured
# over 50 steps (CPU, 2026-12-01; 4-bit on 1 rank 2026-12-02, the same figures as on 2): 8-bit 0.0046 nats at worst, last-10
# mean 2.4369 vs 2.4389; 4-bit 0.2953 nats, 2.6352 (8.1% above). Stepped eagerly (2026-12-02): 8-bit 0.0045, 2.4369;
# 4-bit 0.2944, 2.6354; the compiled 8-bit steps 6-10 within 6.3e-8 of the eager ones. Over 30 steps (2026-12-07): 8-bit
# 0.0010 nats, last-10 mean 3.2793 vs 3.2801; 4-bit 0.2304, 3.4888 (6.4% above).
MEAN_TOLERANCE = {"AdamW8bit": 0.005, "AdamW4bit": 0.12}
STEP_TOLERANCE = {"AdamW8bit": 0.02, "AdamW4bit": 0.4}


def _train(
    out: Path, optimizer: str, *overrides: str, nproc: int = 2, env: dict[str, str] | None = None
) -> dict[int, float]:
    """A run of the reference runs' keys (`reference_runs.LOW_BIT_KEYS`) with `optimizer`: its step losses."""
    result = launch(  # sft/tiny's own model: the documented tolerance was measured on it
        torchrun("sft", f"optimizer._target_={optimizer}", *LOW_BIT_KEYS, f"output_dir={out}", *overrides, nproc=nproc),
        default_model=True,
        env_extra=dict(EAGER) if env is None else env,
    )
    name = optimizer.rsplit(".", 1)[-1]
    assert (f"; levers: low-bit optimizer states ({name})" in result.stdout) == optimizer.startswith("torchao")
    return {m["step"]: m["loss"] for m in read_metrics(out)}


def _reference_run(tmp_path_factory, name: str) -> tuple[Path, dict[int, float]]:
    """(the output directory, the step losses) of the reference run `low-bit-NAME` (tests/reference_runs.py: made
    once for the whole session, so that the tests that read them run side by side)."""
    out = reference_run(tmp_path_factory, f"low-bit-{name}")
    return out, {m["step"]: m["loss"] for m in read_metrics(out)}


@pytest.mark.launch
@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW4bit"])
def test_low_bit_states_follow_fp32_adamw_within_the_documented_tolerance(tmp_path_factory, name):
    _, fp32_losses = _reference_run(tmp_path_factory, "fp32")
    _, low_bit = _reference_run(tmp_path_factory, name)
    assert sorted(low_bit) == sorted(fp32_losses) == list(range(1, LOW_BIT_STEPS + 1))
    worst = max(abs(low_bit[s] - fp32_losses[s]) for s in fp32_losses)
    tail = range(LOW_BIT_STEPS - 9, LOW_BIT_STEPS + 1)
    mean_low, mean_fp32 = (sum(run[s] for s in tail) / len(tail) for run in (low_bit, fp32_losses))
    print(f"{name}: worst step {worst:.4f} nats, last-10 mean {mean_low:.4f} vs {mean_fp32:.4f}")
    assert worst <= STEP_TOLERANCE[name], (name, worst, low_bit, fp32_losses)
    assert abs(mean_low - mean_fp32) <= MEAN_TOLERANCE[name] * mean_fp32, (name, mean_low, mean_fp32)
    assert low_bit[LOW_BIT_STEPS] < 0.6 * low_bit[1], name  # it learns, as fp32 does


@pytest.mark.launch
@pytest.mark.parametrize("how", ["2 ranks", "1 rank", "compiled"])
def test_the_8bit_runs_step_5_checkpoint_continues_it(tmp_path_factory, tmp_path, how):
    """The 8-bit run's step-5 checkpoint (an async save) continued: on its 2 ranks bit for bit (the quantized
    states round-trip through DCP); on 1 rank (world-size-invariant steps: DCP reshards the quantized states)
    within 1e-5; with torchao's step compiled (a user's run: a class's own inductor cache, the rate a tensor), the
    same arithmetic fused, within 1e-5 of the eager steps (measured COMPILED_GAP)."""
    run, straight = _reference_run(tmp_path_factory, "AdamW8bit")
    checkpoint = run / "checkpoints" / "step_5"
    resume = ("torchao.optim.AdamW8bit", f"resume={checkpoint}", "stop_after_step=10")
    if how == "2 ranks":
        resumed = _train(tmp_path / "resumed", *resume)
        assert resumed == {s: straight[s] for s in range(6, 11)}  # exact, not close
    elif how == "1 rank":
        one = _train(tmp_path / "one", *resume, nproc=1)
        assert sorted(one) == list(range(6, 11))
        assert all(abs(one[s] - straight[s]) <= 1e-5 * straight[s] for s in one), (one, straight)
    else:
        compiled = _train(tmp_path / "compiled", *resume, env={})
        assert sorted(compiled) == list(range(6, 11))
        gap = max(abs(compiled[s] - straight[s]) / straight[s] for s in compiled)
        print(f"compiled against eager 8-bit steps 6-10: {gap:.2e} relative")
        assert gap <= 1e-5, (compiled, straight)


def test_a_resume_onto_a_new_horizon_keeps_the_rate_a_tensor_as_torchao_needs():
    """torchao's step refuses a rate that is no longer a tensor; a resume with a changed max_steps sets the new
    schedule's rate (`follow_new_schedule`, from the scheduler's base rates: tensors here), and the step takes it."""
    import torch
    import torchao.optim
    from transformers import get_cosine_schedule_with_warmup

    from chattune.checkpoint.resume import follow_new_schedule

    weight = torch.nn.Parameter(torch.ones(4096))
    optimizer = torchao.optim.AdamW8bit([weight], lr=1e-3)
    scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=100)
    for _ in range(5):
        scheduler.step()
    longer = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=400)
    longer.load_state_dict(scheduler.state_dict())
    old, new = follow_new_schedule(longer, optimizer)
    group_lr = optimizer.param_groups[0]["lr"]
    assert isinstance(group_lr, torch.Tensor) and group_lr.item() == pytest.approx(new[0]) and new[0] > old[0]
    weight.grad = torch.ones_like(weight)
    with mock.patch("torch.compile", lambda fn, **_: fn):  # eager: no compile for one step
        optimizer.step()
    assert not torch.equal(weight.detach(), torch.ones(4096))


def test_each_low_bit_class_compiles_into_a_cache_of_its_own(tmp_path, monkeypatch):
    """torch 2.13's AOTAutograd cache keys a quantized state by its inner tensors, not its class: a class's steps
    cached where another class's would be found crashed (AdamWFp8 after AdamW8bit). Each class gets a subdirectory
    of the inductor cache (kept on: a launch finds its own class's steps again); plain torch optimizers change none."""
    import torch
    from omegaconf import OmegaConf

    from chattune.train.optimizer import BASE_CACHE_DIR_ENV, build_optimizer

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.delenv(BASE_CACHE_DIR_ENV, raising=False)
    weight = torch.nn.Parameter(torch.ones(4096))

    def build(name: str) -> str:
        config = OmegaConf.create({"_target_": name, "_partial_": True, "lr": 1e-3})
        build_optimizer(config, [weight], torch.device("cpu"))
        return os.environ["TORCHINDUCTOR_CACHE_DIR"]

    assert build("torch.optim.AdamW") == str(tmp_path / "inductor")
    assert build("torchao.optim.AdamW8bit") == str(tmp_path / "inductor" / "chattune-AdamW8bit")
    assert build("torchao.optim.AdamWFp8") == str(tmp_path / "inductor" / "chattune-AdamWFp8")  # a sibling
    assert torch._functorch.config.enable_autograd_cache  # the cache stays on
