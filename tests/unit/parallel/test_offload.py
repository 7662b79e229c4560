"""Activation offloading (`model.fsdp.offload_activations`, chattune.parallel.offload) and CPU offload
(`model.fsdp.cpu_offload`, FSDP2's CPUOffloadPolicy): what the hooks move and leave, gradients equal to the plain
forward's (eager and compiled, with and without activation checkpointing), the estimate's offloaded bytes against
the hooks' count, and on 2 real ranks the losses, gradient norms and export of the plain run, resumed across the
settings. On the CPU the host is the device: these check the mechanics and the numbers, not a saving."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from test_sft_recipe import read_metrics

from conftest import (
    SMALL_MODEL,
    demo_documents,
    exported_weights,
    launch,
    mesh_dims,
    relative_error,
    tiny_model,
    torchrun,
)

RUN = ("max_steps=4", "log_every=1", "eval_every=0", "eval.samples=0", "save_every=0")


def test_the_hooks_move_activations_and_leave_weights_and_small_tensors():
    """A linear layer saves its input and its weight: only the input moves (a copy, the same values), and a
    tensor under the threshold stays."""
    from chattune.parallel.offload import ActivationOffload

    layer = torch.nn.Linear(64, 32)
    inputs = torch.randn(16, 64, requires_grad=True)
    offload = ActivationOffload(torch.device("cpu"))
    with offload.hooks():
        output = layer(inputs).tanh()  # tanh saves its output: 16 x 32 fp32, 2048 bytes
    assert offload.offloaded_bytes == inputs.numel() * 4 + output.numel() * 4
    output.sum().backward()
    want_input, want_weight = inputs.grad.clone(), layer.weight.grad.clone()
    inputs.grad, layer.weight.grad = None, None
    layer(inputs).tanh().sum().backward()
    assert torch.equal(inputs.grad, want_input) and torch.equal(layer.weight.grad, want_weight)

    small = ActivationOffload(torch.device("cpu"), min_bytes=4096)  # the input (4096 bytes) moves, tanh's stays
    with small.hooks():
        layer(inputs).tanh()
    assert small.offloaded_bytes == inputs.numel() * 4


class _SavesItsInput(torch.autograd.Function):
    """y = x * w, saving x (and nothing else) for w's gradient."""

    @staticmethod
    def forward(ctx, inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inputs)
        return inputs * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inputs,) = ctx.saved_tensors
        return None, (grad * inputs).sum()


def test_a_tensor_saved_again_moves_once_and_a_freed_storage_is_never_taken_for_it(monkeypatch):
    """q, k and v save the same normed input, gate and up theirs: it moved once per save (1.32x the bytes of each
    tensor once on the tiny 3-layer Llama). Saved again unchanged, it now moves once and serves every use. A tensor
    whose storage was freed is never taken for a later one (the allocator hands the memory out again): with every
    key made equal, a second tensor saved after the first one's storage died still gets its own copy."""
    from chattune.parallel import offload as offload_module

    layers = [torch.nn.Linear(64, 32) for _ in range(3)]
    inputs = torch.randn(16, 64, requires_grad=True)
    hooks = offload_module.ActivationOffload(torch.device("cpu"))
    with hooks.hooks():
        normed = inputs.tanh()  # saves its output, which each layer saves again as its input
        total = sum(layer(normed).sum() for layer in layers)
    assert hooks.offloaded_bytes == normed.numel() * 4  # once, not four times
    total.backward()
    want = [layer.weight.grad.clone() for layer in layers] + [inputs.grad.clone()]
    for tensor in [*[layer.weight for layer in layers], inputs]:
        tensor.grad = None
    normed = inputs.tanh()  # the same graph without the hooks
    sum(layer(normed).sum() for layer in layers).backward()
    assert all(torch.equal(got.grad, w) for got, w in zip([*[layer.weight for layer in layers], inputs], want))

    monkeypatch.setattr(offload_module, "_saved_key", lambda tensor: ("every tensor alike",))
    weight = torch.ones((), requires_grad=True)
    with hooks.hooks():
        first = torch.full((32, 32), 1.0)
        out_first = _SavesItsInput.apply(first, weight)
        del first  # its storage is freed: only its host copy is left
        out_second = _SavesItsInput.apply(torch.full((32, 32), 2.0), weight)
    (out_first.sum() + out_second.sum()).backward()
    assert weight.grad.item() == 32 * 32 * (1.0 + 2.0)  # each its own values


def _layers_and_gradients(offload=None, forwards: int = 1):
    """Four chained linear layers (each saves its input, each input a distinct tensor of 8 KiB) and the gradients of
    `forwards` forwards under `offload`'s hooks (None: plain), then one backward of their sum."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 64) for _ in range(4)]
    inputs = [torch.randn(32, 64, requires_grad=True) for _ in range(forwards)]
    total = 0
    for x in inputs:
        with offload.hooks() if offload is not None else contextlib.nullcontext():
            for layer in layers:
                x = layer(x).tanh()
        total = total + x.sum()
    total.backward()
    return [layer.weight.grad for layer in layers] + [x.grad for x in inputs]


def test_the_copies_come_back_ahead_of_their_use_within_the_prefetch_budget():
    """The backward's first use of a tensor starts the copies back of those saved before it (the backward runs in
    about the reverse order): gradients bit for bit the plain ones; with no prefetch budget every tensor comes back
    when autograd asks for it, none ahead."""
    from chattune.parallel.offload import ActivationOffload

    plain = _layers_and_gradients()
    for budget, ahead in ((2**30, True), (0, False)):
        offload = ActivationOffload(torch.device("cpu"), prefetch_bytes=budget)
        got = _layers_and_gradients(offload)
        assert all(torch.equal(g, w) for g, w in zip(got, plain))
        assert (offload.brought_ahead > 0) == ahead, (budget, offload.brought_ahead)
    assert offload.offloaded_bytes > 0


def test_the_copies_share_one_slab_reused_forward_after_forward(monkeypatch):
    """Host memory is one flat slab cut into the copies: a first forward that outgrew its slabs leaves one slab of
    what it needed (the bytes moved, each copy's start aligned), which the next forwards reuse instead of allocating;
    not the up to 2x of a power-of-two pinned allocator. Two forwards before one backward each keep their own
    copies (a reused slab would have the second overwrite the first's): gradients bit for bit."""
    from chattune.parallel import offload as offload_module

    monkeypatch.setattr(offload_module, "MIN_SLAB_BYTES", 4096)  # the first forward outgrows several slabs
    offload = offload_module.ActivationOffload(torch.device("cpu"))
    plain = _layers_and_gradients()
    assert all(torch.equal(g, w) for g, w in zip(_layers_and_gradients(offload), plain))
    moved = offload.offloaded_bytes
    assert offload.host_bytes >= moved and len(offload._arena._slabs) > 1
    _layers_and_gradients(offload)
    slabs = list(offload._arena._slabs)
    assert len(slabs) == 1 and moved <= offload.host_bytes <= moved + 4 * offload_module.SLAB_ALIGNMENT
    assert all(torch.equal(g, w) for g, w in zip(_layers_and_gradients(offload), plain))
    assert offload._arena._slabs == slabs  # the same slab, reused
    two = _layers_and_gradients(forwards=2)
    assert all(torch.equal(g, w) for g, w in zip(_layers_and_gradients(offload, forwards=2), two))


@pytest.mark.parametrize(
    "compile", [False, pytest.param(True, marks=pytest.mark.launch)], ids=["eager", "compiled"]
)  # (inductor compiles in worker processes)
@pytest.mark.parametrize("checkpointing", [False, True], ids=["saved", "recomputed"])
def test_offloaded_gradients_equal_the_plain_forwards(one_rank_group, compile, checkpointing):
    """The packed model on one rank, bit for bit; with checkpointing, what moves is at least every layer's input."""
    from chattune.data.packing import collate_packed
    from chattune.model.causal_lm import PackedCausalLM
    from chattune.objectives.cross_entropy import TokenCrossEntropy
    from chattune.parallel.fsdp import shard_model

    batch = collate_packed(demo_documents(4))

    def gradients(offload: bool):
        model = PackedCausalLM(tiny_model())
        placement = shard_model(
            model, mesh_dims(), activation_checkpointing=checkpointing, compile=compile, offload_activations=offload
        )
        with placement.training_forward():
            loss, _ = TokenCrossEntropy().loss_sum(model, batch)
        loss.backward()
        moved = placement.activation_offload.offloaded_bytes if placement.activation_offload else 0
        return loss.detach(), [p.grad.to_local().clone() for p in model.parameters()], moved, model

    plain_loss, plain_grads, _, _ = gradients(False)
    loss, grads, moved, model = gradients(True)
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(got, want) for got, want in zip(grads, plain_grads))
    layer_input = batch.num_tokens * model.hf_model.config.hidden_size * 4
    assert moved >= model.hf_model.config.num_hidden_layers * layer_input


@pytest.mark.parametrize("checkpointing", [False, True], ids=["saved", "recomputed"])
def test_the_estimates_offloaded_bytes_are_what_the_hooks_move(one_rank_group, checkpointing):
    """The estimate's host row against the bytes the hooks moved in a real packed forward, within 10%."""
    from chattune.data.packing import collate_packed
    from chattune.model.causal_lm import PackedCausalLM
    from chattune.model.cost.memory import MemoryInputs, estimate
    from chattune.objectives.cross_entropy import TokenCrossEntropy
    from chattune.parallel.fsdp import shard_model

    batch = collate_packed(demo_documents(6))
    hf_model = tiny_model(num_hidden_layers=3)
    inputs = MemoryInputs(
        hf_model.config,
        ranks=1,
        tokens=batch.num_tokens,
        activation_checkpointing=checkpointing,
        offload_activations=True,
        loss_chunk=16,
    )
    estimated = estimate(inputs).host_rows["activations (offloaded)"]
    model = PackedCausalLM(hf_model, loss_chunk_size=16)
    placement = shard_model(model, mesh_dims(), activation_checkpointing=checkpointing, offload_activations=True)
    assert placement.activation_offload is not None
    with placement.training_forward():
        TokenCrossEntropy().loss_sum(model, batch)
    moved = placement.activation_offload.offloaded_bytes
    assert abs(estimated - moved) <= 0.1 * moved, (estimated, moved)


def _train(out: Path, *overrides: str) -> list[dict]:
    result = launch(torchrun("sft", *SMALL_MODEL, f"output_dir={out}", *RUN, *overrides))
    compute = next(line for line in result.stdout.splitlines() if "] compute: " in line)
    for name, key in (("activation offloading", "offload_activations"), ("CPU offload", "cpu_offload")):
        assert (name in compute) == (f"model.fsdp.{key}=true" in overrides), compute  # the line names each lever
    return read_metrics(out)


@pytest.mark.launch
def test_offloaded_runs_equal_the_plain_run_and_resume_across_the_settings(tmp_path):
    """2 ranks, 4 steps: both offloads at once give the plain run's losses, gradient norms (clipped at the default
    max_grad_norm) and export; a run with offloaded, recomputed activations stopped after step 2 and resumed under CPU
    offload continues the plain run's losses."""
    plain = _train(tmp_path / "plain")
    both = _train(tmp_path / "both", "model.fsdp.offload_activations=true", "model.fsdp.cpu_offload=true")
    assert [m["step"] for m in both] == [m["step"] for m in plain] == [1, 2, 3, 4]
    for got, want in zip(both, plain):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-6)
    assert (
        relative_error(exported_weights(tmp_path / "both" / "hf"), exported_weights(tmp_path / "plain" / "hf")) <= 1e-6
    )
    recomputed = ("model.fsdp.offload_activations=true", "model.fsdp.activation_checkpointing=true")
    _train(tmp_path / "switched", *recomputed, "stop_after_step=2")
    switched = _train(tmp_path / "switched", "model.fsdp.cpu_offload=true")
    assert [m["step"] for m in switched] == [1, 2, 3, 4]
    for got, want in zip(switched, plain):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)


@pytest.mark.launch
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA only: the side stream, page-locked host memory, NCCL with host shards"
)
def test_on_cuda_offloaded_runs_equal_the_plain_run_and_use_less_device_memory(tmp_path):
    """One GPU, fp32 compute: both offloads give the plain run's losses, gradient norms and export, at a lower peak of
    allocated device memory."""
    common = ("device=cuda", "model.fsdp.param_dtype=float32", "model.compile=false", "output_dir={}", *RUN)

    def train(name: str, *overrides: str) -> list[dict]:
        arguments = [part.format(tmp_path / name) for part in common]
        launch(torchrun("sft", *SMALL_MODEL, *arguments, *overrides, nproc=1), real_torchrun=True)
        return read_metrics(tmp_path / name)

    plain = train("plain")
    both = train("both", "model.fsdp.offload_activations=true", "model.fsdp.cpu_offload=true")
    for got, want in zip(both, plain):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    assert (
        relative_error(exported_weights(tmp_path / "both" / "hf"), exported_weights(tmp_path / "plain" / "hf")) <= 1e-5
    )
    assert both[-1]["peak_memory_allocated_gib"] < plain[-1]["peak_memory_allocated_gib"]


def test_cpu_offload_puts_every_unit_under_fsdp2s_offload_policy(one_rank_group):
    from chattune.model.causal_lm import PackedCausalLM
    from chattune.parallel.fsdp import shard_model

    model = PackedCausalLM(tiny_model())
    placement = shard_model(model, mesh_dims(), cpu_offload=True)
    groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if hasattr(m, "_get_fsdp_state")]
    params = [p for group in groups if group is not None for p in group.fsdp_params]
    assert len(params) == len(list(model.parameters())) and all(p.offload_to_cpu for p in params)
    assert placement.cpu_offload and placement.device == torch.device("cpu")
