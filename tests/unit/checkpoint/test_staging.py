"""chattune.checkpoint.staging: the host copy of a run state that async saves and snapshots stage into: torchao's
quantized optimizer states (tensor subclasses DCP's stager cannot copy: it makes each copy with `new_empty`) kept
as their codes, DTensors kept as DTensors for DCP's planner, and one set of buffers for every save."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from chattune.checkpoint.staging import HostBuffers, ReusedHostStager, state_tensors

subclass_8bit = pytest.importorskip("torchao.optim.subclass_8bit")


def _state(value: float = 1.0) -> dict:
    moment = subclass_8bit.OptimState8bit.zeros((4096,), signed=True, block_size=256)
    moment.copy_(torch.linspace(-value, value, 4096))  # quantized on the way in
    return {
        "model": {"weight": torch.arange(6.0) * value},
        "optimizer": {
            "state": {"weight": {"exp_avg": moment, "step": torch.tensor(3.0)}},
            "param_groups": [{"lr": 1e-3}],
        },
    }


def test_dcps_own_stager_cannot_copy_a_quantized_state():
    """The control: what `dcp.async_save` does with this state when given no stager of ours."""
    with pytest.raises(NotImplementedError, match="new_empty"):
        DefaultStager(StagingOptions(False, False, False, False)).stage(_state())


def test_the_staged_copy_holds_the_same_codes_and_is_the_states_no_longer():
    state = _state()
    assert ("optimizer", "state", "weight", "exp_avg") in {path[:-1] for path in state_tensors(state)}
    staged = ReusedHostStager(pinned=False).stage(state)
    moment, copied = state["optimizer"]["state"]["weight"]["exp_avg"], staged["optimizer"]["state"]["weight"]["exp_avg"]
    assert type(copied) is type(moment) and torch.equal(copied.codes, moment.codes)
    assert copied.codes.dtype == torch.uint8  # the codes, not a dequantized fp32 copy
    assert torch.equal(copied.scale, moment.scale)
    assert torch.equal(staged["model"]["weight"], torch.arange(6.0)) and staged["optimizer"]["param_groups"] == [
        {"lr": 1e-3}
    ]
    moment.copy_(torch.zeros(4096))  # the optimizer steps on while the copy is written
    state["model"]["weight"].add_(1)
    assert not torch.equal(copied.codes, moment.codes) and torch.equal(staged["model"]["weight"], torch.arange(6.0))


def test_one_set_of_buffers_serves_every_save_while_the_shapes_stay():
    """Three states of the same shapes: one allocation, each staged copy the state of its own save (the buffers
    are overwritten by the next stage: a save is written before the next one stages); a new shape allocates anew."""
    stager = ReusedHostStager(pinned=False)
    for k in (1.0, 2.0, 3.0):
        staged = stager.stage(_state(k))
        assert torch.equal(staged["model"]["weight"], torch.arange(6.0) * k)
        assert torch.equal(
            staged["optimizer"]["state"]["weight"]["exp_avg"].codes,
            _state(k)["optimizer"]["state"]["weight"]["exp_avg"].codes,
        )
    assert stager.buffers.allocations == 1
    stager.stage({"model": {"weight": torch.zeros(7)}})
    assert stager.buffers.allocations == 2
    stager.close()


def test_host_buffers_keep_a_dtensor_a_dtensor_only_where_asked():
    """An async save's copy keeps each DTensor's placement (DCP's planner saves shards by it); a snapshot's is the
    local shard (it writes its own layout)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from chattune.distributed import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        weight = distribute_tensor(torch.arange(8.0).view(4, 2), mesh, [Shard(0)])
        buffers = HostBuffers(pinned=False)
        kept = buffers({"w": weight}, dtensors=True)["w"]
        assert (
            isinstance(kept, DTensor)
            and kept.placements == (Shard(0),)
            and torch.equal(kept.to_local(), weight.to_local())
        )
        local = buffers({"w": weight})["w"]
        assert not isinstance(local, DTensor) and torch.equal(local, weight.to_local())
    finally:
        dist.destroy_process_group()
