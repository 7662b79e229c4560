"""Fault injection for the crash-safety tests: `CHATTUNE_CRASH_AT=point:step[:rank]` makes that rank
(every rank when none is given) SIGKILL itself when it reaches `point` ("step": in the middle of that
step, its microbatches taken and not yet trained on; "save": with its checkpoint files written but not
committed) at that step.

A SIGKILL cannot be caught or cleaned up after, which is exactly what preemption and OOM-killers do.
"""

from __future__ import annotations

import os
import signal

import torch.distributed as dist

ENV = "CHATTUNE_CRASH_AT"


def maybe_crash(point: str, step: int) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    target_point, target_step, *target_rank = spec.split(":")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if target_point == point and int(target_step) == step and (not target_rank or int(target_rank[0]) == rank):
        os.kill(os.getpid(), signal.SIGKILL)
