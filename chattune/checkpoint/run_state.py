"""The run's state: named parts, each with `state_dict()` and `load_state_dict()`, and where the run ends.

An exact resume needs everything that decides the next steps: the weights and the optimizer's moments, the
schedule, the data position, the random generators, the skip counters, fp16's loss scale. Listing them in
one place (`training_state`), each under its name, lets a checkpoint save and restore them without knowing
what they are (`chattune.checkpoint.checkpoint`), and a new piece of state is one more `state.add(name, part)`:
any object with torch's `Stateful` protocol. A checkpoint written before a part existed has no entry for it:
`add(..., missing_ok=True)` lets such a part start afresh, otherwise loading it is an error that names the part.

Two kinds of part: *sharded* ones (the model and the optimizer) are saved through torch.distributed.checkpoint,
each rank its shards, resharded when another number of ranks loads them; the others are each rank's own,
saved whole by each rank.

`Horizon` is where the run ends (max_steps, the data's last epoch, stop_after_step, a stop signal): the
components of the loop read it to decide their own timing (`due(step)`).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from chattune.log import EACH_RANK
from chattune.model.quantization.quantize import has_quantized_weight

if TYPE_CHECKING:
    from chattune.data.feed import StepSource

logger = logging.getLogger(__name__)


class LossScaleState(Protocol):
    """fp16's loss scale as a checkpoint holds it (`chattune.train.step.LossScale`): a Stateful, saved where enabled.
    (Not a subclass of torch's runtime-checkable Stateful: a protocol with a data member beneath it breaks every
    `isinstance(x, Stateful)`, which DCP asks of each part.)"""

    enabled: bool

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state_dict: dict) -> None: ...


# Frozen parameters (a LoRA run's base) are not saved: they are the model directory's, reloaded at resume.
TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True)


class RunState:
    """The run's stateful parts by name. `state_dict()` / `load_state_dict()` cover each rank's own parts;
    `sharded_state_dict()` / `load_sharded_state_dict()` the sharded ones (what DCP saves and reshards)."""

    def __init__(self) -> None:
        self._parts: dict[str, Stateful] = {}
        self._sharded: set[str] = set()
        self._missing_ok: set[str] = set()

    def add(self, name: str, part: Stateful, *, sharded: bool = False, missing_ok: bool = False) -> None:
        """Keep `part` under `name`. `sharded`: a sharded part (saved through DCP); `missing_ok`: a checkpoint
        written without it leaves it as it is (a part added later than the checkpoints it must resume)."""
        if name in self._parts:
            raise ValueError(f"the run state already has a part named {name!r}")
        if not isinstance(part, Stateful):
            raise TypeError(f"{name!r}: {type(part).__name__} has no state_dict() and load_state_dict()")
        self._parts[name] = part
        if sharded:
            self._sharded.add(name)
        if missing_ok:
            self._missing_ok.add(name)

    def __getitem__(self, name: str) -> Stateful:
        return self._parts[name]

    def __contains__(self, name: str) -> bool:
        return name in self._parts

    def __iter__(self) -> Iterator[str]:
        return iter(self._parts)

    def sharded_state_dict(self) -> dict:
        return {name: part.state_dict() for name, part in self._parts.items() if name in self._sharded}

    def load_sharded_state_dict(self, state: dict) -> None:
        """Load the sharded parts from `state` (`sharded_state_dict()` filled in by DCP), in the order they were added."""
        for name, part in self._parts.items():
            if name in self._sharded:
                part.load_state_dict(state[name])

    def state_dict(self) -> dict:
        """Each rank's own parts' states, by name."""
        return {name: part.state_dict() for name, part in self._parts.items() if name not in self._sharded}

    def load_state_dict(self, state: dict, skip: tuple[str, ...] = ()) -> None:
        """Load each rank's own parts from `state`, by name, but those in `skip`. Entries of no part here are
        ignored (another run's parts: fp16's loss scale in a bf16 run, the step the checkpoint stores beside them)."""
        own = [name for name in self._parts if name not in self._sharded and name not in skip]
        missing = [name for name in own if state.get(name) is None and name not in self._missing_ok]
        if missing:
            raise KeyError(f"the checkpoint holds no state for {', '.join(missing)}")
        for name in own:
            if state.get(name) is not None:
                self._parts[name].load_state_dict(state[name])
            else:
                logger.info("the checkpoint holds no %s: it starts afresh", name)


class ModelWeights:
    """The model's trained weights as DCP saves them (sharded): frozen parameters and a 4-bit layer's
    quantization state left out."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def state_dict(self) -> dict:
        # ignore_frozen_params still lists a frozen output layer tied to the embedding, and a 4-bit layer adds its
        # quantization state to the state dict as entries of their own: only trained parameters and buffers stay.
        model = self.model
        frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
        quantization_state = tuple(
            f"{name}.weight." for name, module in model.named_modules() if has_quantized_weight(module)
        )  # weight.absmax, weight.quant_map..
        return {
            k: v
            for k, v in get_model_state_dict(model, options=TRAINED_ONLY).items()
            if k not in frozen and not k.startswith(quantization_state)
        }

    def load_state_dict(self, state: dict) -> None:
        # Not strict: the frozen keys are absent by design; every trained key is present (DCP fills exactly the
        # keys `state_dict` lists, and raises when the checkpoint lacks one).
        set_model_state_dict(self.model, state, options=StateDictOptions(ignore_frozen_params=True, strict=False))


class OptimizerState:
    """The optimizer's state (moments, step counts, hyperparameters) as DCP saves it (sharded)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        return get_optimizer_state_dict(self.model, self.optimizer, options=TRAINED_ONLY)

    def load_state_dict(self, state: dict) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state, options=TRAINED_ONLY)


def rng_state() -> dict:
    """The generators a resume restores. On CUDA only this rank's own device's (the current device, set at
    start-up): a relaunch may see fewer devices (another CUDA_VISIBLE_DEVICES, one GPU a process), and
    every visible device's state would not fit it."""
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cuda": torch.cuda.get_rng_state(torch.cuda.current_device()) if torch.cuda.is_initialized() else None,
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    cuda = state.get("cuda")
    if cuda is None or not torch.cuda.is_initialized():
        return
    device = torch.cuda.current_device()
    if isinstance(cuda, (list, tuple)):  # checkpoints written before: every visible device's generator
        if device >= len(cuda):
            logger.warning(
                "the checkpoint holds no CUDA generator state for device %d; it is not restored",
                device,
                extra=EACH_RANK,
            )
            return
        cuda = cuda[device]
    torch.cuda.set_rng_state(cuda, device)


class RandomGenerators:
    """This rank's random generators (torch, Python, numpy, its CUDA device's)."""

    def state_dict(self) -> dict:
        return rng_state()

    def load_state_dict(self, state: dict) -> None:
        set_rng_state(state)


class SkippedSteps:
    """The run's count of updates skipped: for non-finite losses or gradients (`nonfinite_skipped_steps`)
    and, with fp16's loss scaling, for overflows (`overflow_skipped_steps`). Logged with every step's metrics."""

    def __init__(self, overflow: bool = False):
        self.counts = {"nonfinite_skipped_steps": 0, **({"overflow_skipped_steps": 0} if overflow else {})}

    def count(self, name: str) -> int:
        """One more skipped update of kind `name`; the count so far."""
        self.counts[name] += 1
        return self.counts[name]

    def state_dict(self) -> dict:
        return dict(self.counts)

    def load_state_dict(self, state: dict) -> None:
        self.counts.update(state)


def training_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    feed: StepSource,
    skipped: SkippedSteps,
    loss_scale: LossScaleState,
) -> RunState:
    """What a training run's checkpoints hold, by the names they are saved under."""
    state = model_and_optimizer(model, optimizer)
    state.add("scheduler", scheduler)
    state.add("data", feed)  # the stream's position, the packer's pending documents, the epoch, a mixture's state
    state.add("rng", RandomGenerators())
    state.add("counters", skipped)
    if loss_scale.enabled:  # fp16 (a checkpoint of a bf16 or fp32 run holds none: the scale starts afresh)
        state.add("loss_scale", loss_scale, missing_ok=True)
    return state


def model_and_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> RunState:
    """A run state of the sharded parts alone: the trained weights and the optimizer's state."""
    state = RunState()
    state.add("model", ModelWeights(model), sharded=True)
    state.add("optimizer", OptimizerState(model, optimizer), sharded=True)
    return state


class Horizon:
    """Where the run ends, alike on every rank: `max_steps`, the data's last epoch (data.num_epochs, `feed`),
    or a stop after this step: `stop_after_step`, or a stop signal that any rank received (`hear`, from the
    step's all-reduce)."""

    def __init__(
        self,
        max_steps: int,
        stop_after_step: int | None,
        feed: StepSource,
        stop_vote: Callable[[], bool] | None = None,
    ):
        self.max_steps, self.stop_after_step, self.feed, self.stop_vote = max_steps, stop_after_step, feed, stop_vote
        self.signalled = False

    def hear(self, stop_ranks: int) -> None:
        """After a step: `stop_ranks` ranks received a stop signal (agreed in the step's all-reduce)."""
        self.signalled = stop_ranks > 0

    def stops_before(self, step: int) -> bool:
        """Collective: whether the run stops before starting `step`, after the one before: a stop signal that
        reached any rank since that step's all-reduce (`stop_vote`, `chattune.interrupts.StopVote`)."""
        if not self.signalled and self.stop_vote is not None:
            self.signalled = self.stop_vote()
        return self.signalled

    def is_last(self, step: int) -> bool:
        """Whether `step` is the run's last (max_steps, or the last epoch's end)."""
        return step == self.max_steps or self.feed.finished

    def stops_after(self, step: int) -> bool:
        """Whether the run stops after `step` to be continued later (stop_after_step, a stop signal)."""
        return step == self.stop_after_step or self.signalled


class Every:
    """A component's timing: every `steps` steps (0: never) and at the run's last step."""

    def __init__(self, steps: int, horizon: Horizon):
        self.steps, self.horizon = steps, horizon

    def due(self, step: int) -> bool:
        return self.steps > 0 and (step % self.steps == 0 or self.horizon.is_last(step))
