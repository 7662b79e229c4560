"""The run state of named parts, and the components of the loop that decide their own timing (`due(step)`)."""

from __future__ import annotations

import pytest
import torch

from chattune.checkpoint.checkpoint import Checkpointer, load_checkpoint, save_checkpoint
from chattune.checkpoint.run_state import Every, Horizon, RunState, model_and_optimizer
from chattune.parallel.fsdp import Placement
from chattune.train.evaluation import Evaluator
from chattune.train.metrics import MetricLogger


class RunningMean:
    """A piece of state a new objective might keep (e.g. a running estimate of a KL term)."""

    def __init__(self, value: float = 0.0, count: int = 0):
        self.value, self.count = value, count

    def state_dict(self) -> dict:
        return {"value": self.value, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.value, self.count = state["value"], state["count"]


class Feed:
    """StepFeed's `finished`, for a Horizon."""

    finished = False


def test_a_new_part_is_one_line_and_a_checkpoint_saves_and_restores_it_by_name(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    state = model_and_optimizer(model, optimizer)
    state.add("kto_kl", RunningMean(0.25, 7))
    directory = save_checkpoint(tmp_path, 5, state, {"world_size": 1})
    assert directory == tmp_path / "step_5"

    other = torch.nn.Linear(3, 2)
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=0.1)
    restored = model_and_optimizer(other, other_optimizer)
    restored.add("kto_kl", RunningMean())
    assert load_checkpoint(directory, restored) == 5
    assert restored["kto_kl"].state_dict() == {"value": 0.25, "count": 7}
    assert torch.equal(other.weight, model.weight) and torch.equal(other.bias, model.bias)
    assert torch.equal(other_optimizer.state[other.weight]["exp_avg"], optimizer.state[model.weight]["exp_avg"])


def test_a_part_the_checkpoint_lacks_is_named_unless_it_may_start_afresh():
    state = RunState()
    state.add("counters", RunningMean(1.0, 1))
    state.add("kto_kl", RunningMean(2.0, 2))
    with pytest.raises(KeyError, match="kto_kl"):
        state.load_state_dict({"step": 3, "counters": {"value": 5.0, "count": 5}})
    fresh = RunState()
    fresh.add("counters", RunningMean())
    fresh.add("kto_kl", RunningMean(2.0, 2), missing_ok=True)
    fresh.load_state_dict({"step": 3, "counters": {"value": 5.0, "count": 5}, "loss_scale": {"scale": 1.0}})
    assert fresh["counters"].state_dict() == {"value": 5.0, "count": 5}
    assert fresh["kto_kl"].state_dict() == {"value": 2.0, "count": 2}  # as it was
    fresh.load_state_dict({"kto_kl": {"value": 9.0, "count": 9}}, skip=("counters",))
    assert fresh["kto_kl"].state_dict() == {"value": 9.0, "count": 9}
    with pytest.raises(ValueError, match="already"):
        fresh.add("kto_kl", RunningMean())
    with pytest.raises(TypeError, match="state_dict"):
        fresh.add("step", 3)


def test_the_components_decide_their_timing_from_the_horizon(tmp_path):
    """As the loop always did: metrics every log_every steps and at the last step; evaluations every eval_every
    steps, at step 0 and at the last step, never after a stop signal; checkpoints every save_every steps and before
    every stop (stop_after_step, a signal), not at the last step."""
    feed = Feed()
    horizon = Horizon(max_steps=10, stop_after_step=None, feed=feed)
    metrics = MetricLogger(str(tmp_path), is_main=False, every=Every(4, horizon))
    evaluator = Evaluator(None, None, [], 0, Placement.one_rank(), None, Every(3, horizon))
    checkpointer = Checkpointer(tmp_path, RunState(), {}, 5, None, horizon)
    assert [s for s in range(11) if metrics.due(s)] == [0, 4, 8, 10]
    assert [s for s in range(11) if evaluator.due(s)] == [0, 3, 6, 9, 10]
    assert [s for s in range(1, 11) if checkpointer.due(s)] == [5, 10]
    assert not Evaluator(None, None, None, 0, Placement.one_rank(), None, Every(3, horizon)).due(
        3
    )  # nothing to evaluate
    assert not Evaluator(None, None, [], 0, Placement.one_rank(), None, Every(0, horizon)).due(10)  # eval_every=0

    feed.finished = True  # the data's last epoch ended at step 7
    assert metrics.due(7) and evaluator.due(7) and not checkpointer.due(7)

    feed.finished = False
    horizon = Horizon(max_steps=10, stop_after_step=7, feed=feed)
    checkpointer = Checkpointer(tmp_path, RunState(), {}, 0, None, horizon)  # save_every=0
    assert [s for s in range(1, 11) if checkpointer.due(s)] == [7] and horizon.stops_after(7)
    evaluator = Evaluator(None, None, [], 0, Placement.one_rank(), None, Every(3, horizon))
    horizon.hear(stop_ranks=1)  # a stop signal after step 6: saved, not evaluated (its grace is the checkpoint's)
    assert checkpointer.due(6) and horizon.stops_after(6) and not evaluator.due(6)
    horizon.hear(stop_ranks=0)
    assert evaluator.due(6) and not checkpointer.due(6)
