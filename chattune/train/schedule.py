"""The default learning-rate schedule: a linear warm-up, then a half cosine down to 0. It equals transformers'
`get_cosine_schedule_with_warmup` at every step (tests/unit/train/test_optimizer.py checks it against that function).

Why it is written here: importing `transformers.optimization`, where transformers' schedules live, imports
`transformers.trainer_utils`, which imports peft and, through it, bitsandbytes. That adds 1.4 s to every rank's
start-up (measured on 2 CPU cores), in runs that train no adapter and quantize nothing; chattune otherwise
imports peft only where adapters are used. Any other `_partial_` schedule function, transformers' own included,
still works as `scheduler._target_`, and a checkpoint written under transformers' name resumes under this one.
"""

from __future__ import annotations

import functools
import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def _cosine_with_warmup_factor(
    step: int, *, num_warmup_steps: int, num_training_steps: int, num_cycles: float
) -> float:
    if step < num_warmup_steps:
        return float(step) / float(max(1, num_warmup_steps))
    progress = float(step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress)))


def cosine_with_warmup(
    optimizer: torch.optim.Optimizer,
    num_warmup_steps: int,
    num_training_steps: int,
    num_cycles: float = 0.5,
    last_epoch: int = -1,
) -> LambdaLR:
    """The rate rises linearly from 0 to the optimizer's over `num_warmup_steps`, then follows `num_cycles` waves
    of a cosine (0.5: down to 0 once) until `num_training_steps`."""
    factor = functools.partial(
        _cosine_with_warmup_factor,
        num_warmup_steps=num_warmup_steps,
        num_training_steps=num_training_steps,
        num_cycles=num_cycles,
    )
    return LambdaLR(optimizer, factor, last_epoch)
