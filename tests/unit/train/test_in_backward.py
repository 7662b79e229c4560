"""The optimizer step in the backward (`optimizer.in_backward=true`, chattune.train.in_backward) on 2 real ranks: the
losses, gradient norms and exported weights of the ordinary step without clipping; a checkpoint of the ordinary
step resumes with it (one optimizer, one state dict); and, in the process, whole-model gradients never exist."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_resume import read_metrics

from chattune.parallel.fsdp import Placement
from conftest import SMALL_MODEL, exported_weights, launch, mesh_dims, relative_error, torchrun

RUN = ("max_steps=4", "log_every=1", "eval_every=0", "eval.samples=0", "save_every=0", "max_grad_norm=null")


def _train(out: Path, *overrides: str) -> list[dict]:
    result = launch(torchrun("sft", *SMALL_MODEL, f"output_dir={out}", *RUN, *overrides))
    in_backward = "optimizer.in_backward=true" in overrides
    assert ("; levers: optimizer step in the backward" in result.stdout) == in_backward  # the compute: line
    return read_metrics(out)


@pytest.mark.launch
def test_the_update_in_the_backward_equals_the_ordinary_step_and_resumes_across_the_setting(tmp_path):
    ordinary = _train(tmp_path / "ordinary")
    in_backward = _train(tmp_path / "in_backward", "optimizer.in_backward=true")
    assert [m["step"] for m in in_backward] == [m["step"] for m in ordinary] == [1, 2, 3, 4]
    for got, want in zip(in_backward, ordinary):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    got, want = exported_weights(tmp_path / "in_backward" / "hf"), exported_weights(tmp_path / "ordinary" / "hf")
    assert relative_error(got, want) <= 1e-6
    # The ordinary step's checkpoint of step 2, resumed with the update in the backward: the same steps 3 and 4.
    _train(tmp_path / "switched", "stop_after_step=2")
    switched = _train(tmp_path / "switched", "optimizer.in_backward=true")
    assert [m["step"] for m in switched] == [1, 2, 3, 4]
    for got, want in zip(switched[2:], ordinary[2:]):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)


def test_no_whole_model_gradient_exists_and_the_step_is_the_optimizers_own():
    """In the backward, each trained parameter's gradient is gone once it has stepped (the next one's hook sees only
    its own), and the weights equal the ordinary step's (one rank, a plain model)."""
    from chattune.train.in_backward import UpdateInBackward

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    reference.load_state_dict(model.state_dict())
    inputs = torch.randn(5, 8)
    ordinary = torch.optim.AdamW(reference.parameters(), lr=0.1)
    reference(inputs).square().sum().backward()
    ordinary.step()

    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    updater = UpdateInBackward(model, optimizer, Placement.one_rank())
    holding: list[int] = []
    for parameter in model.parameters():  # record, at each hook, how many parameters hold a gradient
        parameter.register_post_accumulate_grad_hook(
            lambda p: holding.append(sum(q.grad is not None for q in model.parameters()))
        )
    model(inputs).square().sum().backward()
    assert holding == [0] * 4  # each hook ran after UpdateInBackward's own, which stepped and freed the gradient
    assert all(p.grad is None for p in model.parameters())
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    updater.remove()


def test_each_hook_steps_its_own_parameter_alone_with_its_groups_live_settings(monkeypatch):
    """A hook's step looks at its own parameter only (the whole step's work linear in the parameters: a plain
    `optimizer.step()` per hook scans every parameter of every group, P² a step), with its group's settings as the
    scheduler left them: two groups at different rates give the ordinary step's weights exactly."""
    from chattune.train.in_backward import UpdateInBackward

    torch.manual_seed(0)
    layers = [torch.nn.Linear(4, 4) for _ in range(20)]
    model, reference = torch.nn.Sequential(*layers), torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(20)])
    reference.load_state_dict(model.state_dict())

    def groups(module: torch.nn.Module) -> list[dict]:
        return [{"params": list(module[:10].parameters()), "lr": 0.1}, {"params": list(module[10:].parameters())}]

    inputs = torch.randn(3, 4)
    ordinary = torch.optim.AdamW(groups(reference), lr=0.01)
    optimizer = torch.optim.AdamW(groups(model), lr=0.01)
    for step_optimizer in (ordinary, optimizer):
        for group, rate in zip(step_optimizer.param_groups, (0.2, 0.03)):  # as a scheduler sets them
            group["lr"] = rate
    reference(inputs).square().sum().backward()
    ordinary.step()

    scanned: list[int] = []
    init_group = torch.optim.AdamW._init_group
    monkeypatch.setattr(
        torch.optim.AdamW,
        "_init_group",
        lambda self, group, *args: scanned.append(len(group["params"])) or init_group(self, group, *args),
    )
    updater = UpdateInBackward(model, optimizer, Placement.one_rank())
    model(inputs).square().sum().backward()
    assert scanned == [1] * 40  # each of the 40 parameters' steps saw one parameter
    assert [len(group["params"]) for group in optimizer.param_groups] == [20, 20]
    assert [group["lr"] for group in optimizer.param_groups] == [0.2, 0.03]
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert set(optimizer.state) == set(model.parameters())
    updater.remove()


def _one_rank_step(max_grad_norm, poison_gradients: bool = False):
    from chattune.data.feed import StepBatches
    from chattune.data.packing import collate_packed
    from chattune.model.causal_lm import PackedCausalLM
    from chattune.objectives.cross_entropy import TokenCrossEntropy
    from chattune.parallel.fsdp import shard_model
    from chattune.train.in_backward import UpdateInBackward
    from chattune.train.step import UpdateRule, train_step
    from conftest import demo_documents, tiny_model

    model = PackedCausalLM(tiny_model())
    placement = shard_model(model, mesh_dims())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    updater = UpdateInBackward(model, optimizer, placement)
    if poison_gradients:  # a finite loss whose gradients are not (registered first: runs before the update)
        for parameter in model.parameters():
            parameter._post_accumulate_grad_hooks = None
        embed = next(iter(model.parameters()))
        embed.register_post_accumulate_grad_hook(lambda p: p.grad.to_local().fill_(float("nan")))
        embed.register_post_accumulate_grad_hook(updater._update)
        for parameter in list(model.parameters())[1:]:
            parameter.register_post_accumulate_grad_hook(updater._update)
    rule = UpdateRule(optimizer, scheduler, max_grad_norm, in_backward=updater)
    batch = StepBatches([collate_packed(demo_documents(2))])
    return train_step(model, TokenCrossEntropy(), batch, rule, placement), model


def test_a_library_caller_that_clips_is_refused_at_the_step(one_rank_group):
    with pytest.raises(ValueError, match="optimizer.in_backward needs no clipping"):
        _one_rank_step(max_grad_norm=1.0)


def test_non_finite_gradients_from_a_finite_loss_stop_the_run_whatever_nonfinite_loss_says(one_rank_group):
    with pytest.raises(FloatingPointError, match="optimizer.in_backward applied them"):
        _one_rank_step(max_grad_norm=None, poison_gradients=True)


@pytest.mark.launch
def test_the_update_in_the_backward_under_tensor_parallelism_equals_the_ordinary_step(tmp_path):
    """2 ranks as one tp group: the gradient norm counts a parameter whole on both ranks once, as the ordinary
    step does, and the updates are the same."""
    ordinary = _train(tmp_path / "ordinary", "parallel.tensor=2")
    in_backward = _train(tmp_path / "in_backward", "parallel.tensor=2", "optimizer.in_backward=true")
    for got, want in zip(in_backward, ordinary, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    got, want = exported_weights(tmp_path / "in_backward" / "hf"), exported_weights(tmp_path / "ordinary" / "hf")
    assert relative_error(got, want) <= 1e-6
