"""chattune.train.staging: an async save's staging of a state holding torchao's quantized optimizer states
(tensor subclasses DCP's stager cannot copy: it makes each copy with `new_empty`)."""

from __future__ import annotations

import pytest
import torch

from chattune.train.checkpoint import plain_stager
from chattune.train.staging import SubclassSafeStager, subclass_leaves

subclass_8bit = pytest.importorskip("torchao.optim.subclass_8bit")


def _state() -> dict:
    moment = subclass_8bit.OptimState8bit.zeros((4096,), signed=True, block_size=256)
    moment.copy_(torch.linspace(-1, 1, 4096))  # quantized on the way in
    return {
        "model": {"weight": torch.arange(6.0)},
        "optimizer": {
            "state": {"weight": {"exp_avg": moment, "step": torch.tensor(3.0)}},
            "param_groups": [{"lr": 1e-3}],
        },
    }


def test_dcps_own_stager_cannot_copy_a_quantized_state():
    """The control: what `dcp.async_save` does with this state when given no stager of ours."""
    with pytest.raises(NotImplementedError, match="new_empty"):
        plain_stager().stage(_state())


@pytest.mark.parametrize("inner", ["dcp", "none"])
def test_the_staged_copy_holds_the_same_codes_and_is_the_states_no_longer(inner):
    state = _state()
    assert [path for path, _ in subclass_leaves(state)] == [("optimizer", "state", "weight", "exp_avg")]
    staged = SubclassSafeStager(plain_stager() if inner == "dcp" else None).stage(state)
    moment, copied = state["optimizer"]["state"]["weight"]["exp_avg"], staged["optimizer"]["state"]["weight"]["exp_avg"]
    assert type(copied) is type(moment) and torch.equal(copied.codes, moment.codes)
    assert torch.equal(copied.scale, moment.scale)
    assert torch.equal(staged["model"]["weight"], torch.arange(6.0)) and staged["optimizer"]["param_groups"] == [
        {"lr": 1e-3}
    ]
    moment.copy_(torch.zeros(4096))  # the optimizer steps on while the copy is written
    state["model"]["weight"].add_(1)
    assert not torch.equal(copied.codes, moment.codes) and torch.equal(staged["model"]["weight"], torch.arange(6.0))
