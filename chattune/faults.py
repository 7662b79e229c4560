"""Fault injection for the crash-safety and preemption tests; no-ops unless their variable is set.

- `CHATTUNE_CRASH_AT=point:step[:rank]` makes that rank (every rank when none is given) SIGKILL itself when it
  reaches `point` ("step": in the middle of that step, its microbatches taken and not yet trained on; "save":
  with its checkpoint files written but not committed) at that step. A SIGKILL cannot be caught or cleaned up
  after, which is exactly what preemption and OOM-killers do.
- `CHATTUNE_SLOW_AT=step:N:SECONDS` makes every rank sleep that long in the middle of step N: a step longer
  than a launcher's grace period (torchrun kills its workers 30 s after passing a signal on), without a
  model that slow. `after_step:N:SECONDS` sleeps after step N instead (its metrics logged, before a save),
  where a long save or evaluation would take the time. Several, comma-separated: `step:2:2,step:3:60`.
"""

from __future__ import annotations

import os
import signal
import time

from chattune.distributed import world_rank

ENV = "CHATTUNE_CRASH_AT"
SLOW_ENV = "CHATTUNE_SLOW_AT"


def maybe_crash(point: str, step: int) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    target_point, target_step, *target_rank = spec.split(":")
    rank = world_rank()
    if target_point == point and int(target_step) == step and (not target_rank or int(target_rank[0]) == rank):
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_slow(point: str, step: int) -> None:
    for spec in filter(None, os.environ.get(SLOW_ENV, "").split(",")):
        target_point, target_step, seconds = spec.split(":")
        if target_point == point and int(target_step) == step:
            time.sleep(float(seconds))  # a signal does not cut it short (PEP 475): the step really is this long
