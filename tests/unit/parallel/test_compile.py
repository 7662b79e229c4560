"""`model.compile`: each decoder layer compiled (with FSDP2 around it) computes the same losses and gradients
as eager, within float reordering; a second packed length recompiles once, not every step."""

from __future__ import annotations

import pytest
import torch

from chattune.data.packing import collate_packed
from chattune.distributed import free_port
from chattune.model.causal_lm import PackedCausalLM
from chattune.parallel.fsdp import compile_enabled, compiled_graphs, shard_model
from conftest import demo_documents, mesh_dims, relative_error, tiny_model


def _sharded(model, dims, **settings):
    """`model` sharded by `shard_model` (its placement unused: these tests call the model alone)."""
    shard_model(model, dims, **settings)
    return model


def _losses_and_grads(model, batches):
    out = []
    for batch in batches:
        losses = model(batch)
        losses.sum().backward()
        grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        out.append((losses.detach(), grads))
    return out


@pytest.mark.parametrize("activation_checkpointing", [False, True])
@pytest.mark.launch
def test_compiled_layers_match_eager(activation_checkpointing, monkeypatch):
    torch._dynamo.reset()  # graphs compiled by an earlier test would be reused
    # A one-rank group in this process; monkeypatch takes its variables away again, so that recipes other
    # tests launch later do not inherit them.
    for name, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
    }.items():
        monkeypatch.setenv(name, value)
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    try:
        documents = demo_documents(20)
        batches = [collate_packed(documents[a:b]) for a, b in ((0, 5), (5, 12), (0, 3), (12, 20))]
        eager = _losses_and_grads(
            _sharded(
                PackedCausalLM(tiny_model(seed=0)), mesh_dims(), activation_checkpointing=activation_checkpointing
            ),
            batches,
        )
        model = _sharded(
            PackedCausalLM(tiny_model(seed=0)),
            mesh_dims(),
            compile=True,
            activation_checkpointing=activation_checkpointing,
        )
        graphs = [compiled_graphs()]
        compiled = []
        for batch in batches:
            compiled += _losses_and_grads(model, [batch])
            graphs.append(compiled_graphs())
    finally:
        torch.distributed.destroy_process_group()
    # Four packed lengths: the first compile, one recompile with dynamic shapes, then no more.
    assert graphs[1] > graphs[0] and graphs[2] > graphs[1] and graphs[2] == graphs[3] == graphs[4]
    for (eager_losses, eager_grads), (losses, grads) in zip(eager, compiled):
        assert relative_error(losses, eager_losses) < 1e-5
        assert relative_error(grads, eager_grads) < 1e-4


@pytest.mark.parametrize(
    "setting, device, expected",
    [("auto", "cuda", True), ("auto", "cpu", False), (True, "cpu", True), (False, "cuda", False)],
)
def test_auto_compiles_on_cuda_only(setting, device, expected):
    assert compile_enabled(setting, device) is expected


@pytest.mark.launch
def test_a_hybrid_models_compiled_layers_match_eager(monkeypatch):
    """A Qwen3.5-shaped model (gated delta rule + attention), its layers compiled and checkpointed: the mixers run
    per document outside the graphs (a graph break around each), and the step computes what eager computes."""
    from test_hybrid_models import FAMILIES

    torch._dynamo.reset()
    for name, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
    }.items():
        monkeypatch.setenv(name, value)
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    overrides = FAMILIES["qwen3_5"][0]
    try:
        batches = [collate_packed(demo_documents(5))]
        eager = _losses_and_grads(
            _sharded(PackedCausalLM(tiny_model(seed=0, **overrides)), mesh_dims(), activation_checkpointing=True),
            batches,
        )
        before = compiled_graphs()
        compiled = _losses_and_grads(
            _sharded(
                PackedCausalLM(tiny_model(seed=0, **overrides)),
                mesh_dims(),
                compile=True,
                activation_checkpointing=True,
            ),
            batches,
        )
        assert compiled_graphs() > before
    finally:
        torch.distributed.destroy_process_group()
    (eager_losses, eager_grads), (losses, grads) = eager[0], compiled[0]
    assert relative_error(losses, eager_losses) < 1e-5
    assert relative_error(grads, eager_grads) < 1e-4
