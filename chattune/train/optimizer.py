"""The optimizer a recipe instantiates from `optimizer` (any torch optimizer class, `_partial_: true`).

On CUDA an optimizer that has a fused implementation (AdamW, Adam, SGD) gets `fused=True` unless the
config sets `fused` (or `foreach`) itself: one kernel per step over all parameters instead of a few per tensor group.
On the CPU the default stays (`foreach`), which is the reference the exactness tests compare against.
A resume restores the optimizer's settings with its state, `fused` included: a run started on the CPU
stays unfused when resumed on CUDA (same numbers, slower).

The learning-rate schedule a recipe instantiates from `scheduler` (`build_scheduler`) gives step k (1, 2, ...,
max_steps) the schedule's value at k: warm-up step k of W trains at lr * k / W, so the first step updates (a
schedule read from 0, as transformers' are by default, trains the first step at lr 0), and the last step is
the schedule's end.
"""

from __future__ import annotations

import inspect
import os
import re
import warnings
from collections.abc import Iterable

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig


def build_optimizer(
    optimizer_cfg: DictConfig, parameters: Iterable[torch.nn.Parameter], device: torch.device
) -> torch.optim.Optimizer:
    # a functools.partial of the optimizer class; `in_backward` is chattune's (chattune.train.in_backward)
    make = instantiate({k: v for k, v in optimizer_cfg.items() if k != "in_backward"})
    if make.func.__module__.startswith("torchao.optim"):
        cache_low_bit_steps_apart(make.func.__name__)
    accepts_fused = "fused" in inspect.signature(make.func).parameters
    if device.type == "cuda" and accepts_fused and not {"fused", "foreach"} & set(make.keywords):
        return make(parameters, fused=True)
    return make(parameters)


def build_scheduler(
    scheduler_cfg: DictConfig, optimizer: torch.optim.Optimizer, max_steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """The `scheduler` of the config (a `_partial_` schedule taking the optimizer and `num_training_steps`) over
    `max_steps`, advanced once before the first step: step k trains at the schedule's value at k. The scheduler's
    `last_epoch` is then the next step's number, in the checkpoints too, so a resume continues the same rates (a
    checkpoint written before this shift holds its step instead, and continues its own rates)."""
    scheduler = instantiate(scheduler_cfg)(optimizer, num_training_steps=max_steps)
    with warnings.catch_warnings():  # torch warns of a scheduler step before any optimizer step: that is the point
        warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()` before"))
        scheduler.step()
    return scheduler


def cache_low_bit_steps_apart(optimizer_name: str) -> None:
    """torchao's low-bit optimizers compile one step per parameter shape, over their quantized state subclasses.
    torch's AOTAutograd cache (on disk, shared by every process on the machine) keys such a subclass by its
    inner tensors, not its class (torch 2.13): a run with AdamWFp8 after one with AdamW8bit of the same shapes
    reused the 8-bit step and crashed (`OptimStateFp8 has no attribute qmap`). So each optimizer class compiles
    into a cache of its own, a subdirectory of inductor's (TORCHINDUCTOR_CACHE_DIR's, or torch's default): its
    steps are found again by its next launch (sft/tiny's AdamW8bit launch on 2 CPU cores: 18 s, against 38 s with
    the cache turned off), and never by another class's. Set before anything compiles, for this process and the
    processes it starts."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    base = os.environ.get(BASE_CACHE_DIR_ENV) or cache_dir()
    os.environ[BASE_CACHE_DIR_ENV] = base  # (a second optimizer in this process: a sibling, not a child)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, f"chattune-{optimizer_name}")


BASE_CACHE_DIR_ENV = "CHATTUNE_INDUCTOR_BASE_CACHE_DIR"  # the inductor cache that held before the first class's
