"""The optimizer a recipe instantiates from `optimizer` (any torch optimizer class, `_partial_: true`).

On CUDA an optimizer that has a fused implementation (AdamW, Adam, SGD) gets `fused=True` unless the
config sets `fused` (or `foreach`) itself: one kernel per step over all parameters instead of a few per tensor group.
On the CPU the default stays (`foreach`), which is the reference the exactness tests compare against.
A resume restores the optimizer's settings with its state, `fused` included: a run started on the CPU
stays unfused when resumed on CUDA (same numbers, slower).
"""

from __future__ import annotations

import inspect
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
        _compile_low_bit_steps_afresh()
    accepts_fused = "fused" in inspect.signature(make.func).parameters
    if device.type == "cuda" and accepts_fused and not {"fused", "foreach"} & set(make.keywords):
        return make(parameters, fused=True)
    return make(parameters)


def _compile_low_bit_steps_afresh() -> None:
    """torchao's low-bit optimizers compile one step per parameter shape, over their quantized state subclasses.
    torch's AOTAutograd cache (on disk, shared by every process on the machine) keys such a subclass by its
    inner tensors, not its class (torch 2.13): a run with AdamWFp8 after one with AdamW8bit of the same shapes
    reused the 8-bit step and crashed (`OptimStateFp8 has no attribute qmap`). Those steps compile in seconds,
    so the cache is turned off in this process (the decoder layers' compile still finds inductor's own cache)."""
    torch._functorch.config.enable_autograd_cache = False
