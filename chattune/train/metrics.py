"""Step metrics: reduced over ranks once, written by rank 0 to stdout, metrics.jsonl and optionally wandb,
every log_every steps and at the end (`MetricLogger.due`).

Every recipe reports through here, so the same name always means the same computation.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from chattune.distributed import all_reduce_largest, reduce_sums, world_size
from chattune.files import write_atomically
from chattune.objectives.base import Objective
from chattune.train.step import StepResult

if TYPE_CHECKING:
    from chattune.checkpoint.run_state import Every

logger = logging.getLogger(__name__)


class _GcClock:
    """The seconds Python's garbage collector has spent since it was installed (`gc.callbacks`): a collection of
    the oldest generation walks every tracked object (hundreds of thousands after tokenizing a corpus), so a step
    it lands in is slower for reasons no profile of the step shows."""

    def __init__(self) -> None:
        self.total = 0.0
        self._started: float | None = None
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.total += time.perf_counter() - self._started
            self._started = None


_gc_clock: _GcClock | None = None


def gc_seconds_so_far() -> float:
    """The garbage collector's seconds since the first call (which installs the clock)."""
    global _gc_clock
    if _gc_clock is None:
        _gc_clock = _GcClock()
    return _gc_clock.total


class StepTimer:
    """A step's time as the device runs it. On CUDA, events recorded at the step's start and end: reading
    their interval waits only for the step's own last kernel, and only on the steps that log it (a
    `torch.cuda.synchronize()` after every step stalled the host on every step, logged or not). Elsewhere
    the host's clock, the device being the host. Within the step, on the host's clock: how long it waited for its
    microbatches (`data_ready`) and how long the garbage collector ran, where a slow step's time went when
    nothing in it compiled."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._start: torch.cuda.Event | None = None
        self._end: torch.cuda.Event | None = None
        self._host: list[float] = []
        self._data_ready: float | None = None
        self._gc: list[float] = []

    def start(self) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        self._host = [time.perf_counter()]
        self._data_ready = None
        self._gc = [gc_seconds_so_far()]

    def data_ready(self) -> None:
        """The step's microbatches are here."""
        self._data_ready = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self._end = torch.cuda.Event(enable_timing=True)
            self._end.record()
        self._host.append(time.perf_counter())
        self._gc.append(gc_seconds_so_far())

    def data_wait_seconds(self) -> float:
        """The last step's wait for its microbatches (0 where the step never said they were ready)."""
        return self._data_ready - self._host[0] if self._data_ready is not None else 0.0

    def gc_seconds(self) -> float:
        """The garbage collector's time during the last step."""
        return self._gc[1] - self._gc[0]

    def host_seconds(self) -> float:
        """The last step's time on the host's clock (no wait for the device)."""
        return self._host[1] - self._host[0]

    def seconds(self) -> float:
        """The last step's time (waits for its last kernel on CUDA)."""
        if self._start is not None and self._end is not None:  # CUDA
            self._end.synchronize()
            return self._start.elapsed_time(self._end) / 1000.0
        return self._host[1] - self._host[0]


@dataclass(frozen=True)
class StepSeconds:
    """A step's time (`StepTimer.seconds`) and its parts on the host's clock by metric name (`data_wait_s`,
    `gc_s`)."""

    total: float
    host: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class StepFlops:
    """What a step's MFU is computed from: this rank's model FLOPs of the step (`chattune.model.cost.flops`) and the
    device's peak FLOP/s (None: unknown, no MFU)."""

    model_flops: float = 0.0
    peak_flops: float | None = None


def step_metrics(
    step: int,
    result: StepResult,
    objective: Objective,
    grad_norm: float,
    lr: float,
    step_time_s: float | StepSeconds,
    device: torch.device,
    flops: StepFlops | None = None,
) -> dict[str, float]:
    """The metrics of one step, over all ranks (one stacked all-reduce). Collective: every rank must call it.

    The objective turns the summed figures into its metrics (loss, num_tokens, ...); tokens_per_sec is
    trainable tokens per second of step time (mean over ranks), all_tokens_per_sec every token's, and
    all_tokens_per_sec_per_device the same per rank. With the device's peak FLOP/s (`flops`), mfu is the
    step's model FLOPs' rate per device over the peak. `step_time_s` as `StepSeconds`: with the step's parts on
    the host's clock by name (`data_wait_s`, `gc_s`), each the mean over ranks. On CUDA, peak memory (allocated and reserved since the
    start, GiB) is the largest of any rank's. With shared prompts, shared_prompt_tokens: the prompt tokens the step
    computed once instead of once per reply (all ranks)."""
    model_flops, peak_flops = (flops.model_flops, flops.peak_flops) if flops is not None else (0.0, None)
    seconds = step_time_s if isinstance(step_time_s, StepSeconds) else StepSeconds(step_time_s)
    host_seconds = seconds.host
    sums = reduce_sums(
        {
            "loss_sum": result.loss_sum,
            "step_time_s": seconds.total,
            "all_tokens": result.local_tokens,
            "shared_prompt_tokens": result.shared_tokens,
            "model_flops": model_flops,
            **{f"host/{name}": seconds for name, seconds in host_seconds.items()},
            **result.figures,
        },
        device,
    )
    world = world_size()  # reduce_sums sums over every process
    step_time = sums["step_time_s"] / world
    metrics = {"step": step, **objective.metrics(sums, result.global_units)}
    metrics.update(
        tokens_per_sec=metrics["num_tokens"] / step_time,
        all_tokens_per_sec=sums["all_tokens"] / step_time,
        all_tokens_per_sec_per_device=sums["all_tokens"] / step_time / world,
        lr=lr,
        grad_norm=grad_norm,
        step_time_s=step_time,
        **{name: sums[f"host/{name}"] / world for name in host_seconds},
    )
    if sums["shared_prompt_tokens"]:  # data.share_prompts: the prompt tokens the step computed once, not again
        metrics["shared_prompt_tokens"] = int(sums["shared_prompt_tokens"])
    if peak_flops:
        metrics["mfu"] = sums["model_flops"] / step_time / world / peak_flops
    if device.type == "cuda":
        metrics.update(peak_memory(device))
    return metrics


def peak_memory(device: torch.device) -> dict[str, float]:
    """The largest peak allocated and reserved CUDA memory of any rank, GiB. Collective."""
    peaks = torch.tensor(
        [torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)],
        dtype=torch.float64,
        device=device,
    )
    allocated, reserved = (all_reduce_largest(peaks) / 2**30).tolist()
    return {"peak_memory_allocated_gib": allocated, "peak_memory_reserved_gib": reserved}


def format_line(metrics: dict[str, float]) -> str:
    parts = [f"step {int(metrics['step'])}"]
    for name, value in metrics.items():
        if name == "step":
            continue
        if isinstance(value, float) and name == "lr":
            parts.append(f"{name} {value:.2e}")
        elif isinstance(value, float):
            parts.append(f"{name} {value:.4g}")
        else:
            parts.append(f"{name} {value}")
    return " | ".join(parts)


def _drop_dead_wandb_service() -> None:
    """Forget a WANDB_SERVICE token inherited from a process that has died (its service died with it):
    wandb.init would try to connect to it and fail instead of starting a service of its own."""
    token = os.environ.get("WANDB_SERVICE", "")
    fields = token.split("-")  # "<version>-<pid of the process that started the service>-..."
    if len(fields) < 3 or not fields[1].isdigit():
        return
    try:
        os.kill(int(fields[1]), 0)
    except ProcessLookupError:
        logger.warning("ignoring WANDB_SERVICE=%s: the process that started that wandb service is gone", token)
        del os.environ["WANDB_SERVICE"]
    except PermissionError:  # alive, another user's
        return


def init_wandb(output_dir: str, run_config: dict | None, wandb_kwargs: dict | None, run_id: str | None = None):
    """A wandb run under `output_dir/wandb` (the run `run_id` continued, when given: a resumed training
    run logs into the wandb run it started), or a RuntimeError that says what to do instead."""
    import wandb  # imported lazily: only runs that ask for it need it configured

    _drop_dead_wandb_service()
    continued: dict[str, Any] = {"id": run_id, "resume": "allow"} if run_id else {}
    try:
        return wandb.init(config=run_config, dir=output_dir, **(wandb_kwargs or {}), **continued)
    except Exception as e:  # wandb raises many types (UsageError, CommError, connection errors, timeouts)
        raise RuntimeError(
            f"logger=wandb: wandb.init failed: {type(e).__name__}: {e}\n"
            "Log in (`wandb login` or WANDB_API_KEY), or log without network with wandb.mode=offline "
            "(or WANDB_MODE=offline; `wandb sync` uploads the run later), or use logger=stdout."
        ) from e


def start_step_log(path: Path, resume_step: int | None) -> None:
    """One run's lines per file (metrics.jsonl, samples.jsonl: JSON objects with a `step`): a fresh run starts it
    afresh; a resumed run keeps the lines up to its checkpoint's step and drops later ones (the steps lost in a
    crash are run and logged again; `chattune.checkpoint.output_dir` copied the dropped lines aside first)."""
    kept = ""
    if resume_step is not None and path.exists():
        lines = path.read_text().splitlines(keepends=True)
        kept = "".join(line for line in lines if line.strip() and json.loads(line).get("step", 0) <= resume_step)
    write_atomically(path, kept.encode())


class MetricLogger:
    """Rank 0 writes; other ranks' calls do nothing. `backend` is 'stdout' or 'wandb' (JSONL is always
    written). Each call prints a console line, unless `step_lines` is False (a progress bar shows the
    steps): then only lines with held-out (`eval_*`) metrics are printed. A step's metrics are due
    `every` log_every steps and at the end (None: every step)."""

    def __init__(
        self,
        output_dir: str,
        is_main: bool,
        backend: str = "stdout",
        run_config: dict | None = None,
        wandb_kwargs: dict | None = None,
        resume_step: int | None = None,
        wandb_id: str | None = None,
        every: Every | None = None,
    ):
        if backend not in ("stdout", "wandb"):
            raise ValueError(f"logger must be 'stdout' or 'wandb', got {backend!r}")
        self.is_main, self.every = is_main, every
        self.step_lines = True  # False while a progress bar shows the steps
        self.path = Path(output_dir) / "metrics.jsonl"
        self.wandb_run = None
        self.last: dict[str, float] | None = None  # the latest logged metrics (rank 0), for a progress bar
        if not is_main:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._start_file(resume_step)
        if backend == "wandb":
            self.wandb_run = init_wandb(output_dir, run_config, wandb_kwargs, wandb_id)

    @property
    def wandb_id(self) -> str | None:
        """The wandb run's id (rank 0 with logger=wandb), saved with checkpoints so a resume continues it."""
        return self.wandb_run.id if self.wandb_run is not None else None

    def due(self, step: int) -> bool:
        """Whether `step`'s metrics are logged (on every rank alike: computing them is collective)."""
        return self.every is None or self.every.due(step)

    def _start_file(self, resume_step: int | None) -> None:
        start_step_log(self.path, resume_step)

    def log(self, metrics: dict[str, float]) -> None:
        if not self.is_main:
            return
        self.last = metrics
        if self.step_lines or any(name.startswith("eval_") for name in metrics):
            logger.info(format_line(metrics))
        with self.path.open("a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in metrics.items() if k != "step"}, step=int(metrics["step"]))

    def log_summary(self, summary: dict) -> None:
        """Run-level facts (e.g. the final HF directory): the wandb run's summary."""
        if self.is_main and self.wandb_run is not None:
            self.wandb_run.summary.update(summary)

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
