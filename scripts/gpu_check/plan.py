"""The items in priority order within a budget: their estimates, the plan, running them (each stopped when the
budget runs out), the watchdog."""

from __future__ import annotations

import math
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import bench_gpu
import torch
from bench_gpu import BUDGET_MARGIN_S, OutOfBudget, stop_process_group

from .context import Context, one_rank_group
from .experts import check_expert_parallel
from .memory import (
    ESTIMATE_BOUND_LAYERS,
    check_cpu_offload,
    check_estimate_bound,
    check_low_bit,
    check_offload_races,
    check_snapshots,
)
from .numerics import (
    check_cce,
    check_cce_anchor,
    check_compile,
    check_float8,
    check_host_syncs,
    check_in_backward,
    check_packed_vs_hf,
    check_tensor_parallel,
    check_tf32_scope,
)
from .objectives import check_dpo_reference, check_objectives_bf16
from .runs import compare_with_trl, cuda_tests, grpo_run, longest_row, resume_and_export, throughput_run
from .shared_prompts import check_shared_prompt_attention

# --- the items, in priority order, within a budget ---

# Estimated seconds of each item: (one H100/H200, the CPU smoke test's tiny shape on two cores). The CUDA column
# is each item's work (docs/gpu-check.md, "The 8-minute call") priced at what the first GPU run measured
# (2026-11-26, one H200, torch 2.11; BENCHMARKS.md), times GPU_MARGIN: a recipe build of the 0.6B shape (random
# weights made on the host, sharded, moved: packed_vs_hf's two 28-layer builds and a step took 26 s) by its layers
# (the tokenizer's 151,669-row embedding is 155M of a 4-layer model's 215M parameters), the first compile of a
# decoder layer's graphs in the process (compile_vs_eager: 28 s for two 4-layer builds, the compile and 23 small
# steps; later builds of the same layer reuse them), a forward and backward of 16,384 tokens by layers (the 0.6B
# launch's steady steps: 0.29-0.36 s for 2 x 16,384 tokens over 28 layers), and what an item does besides. A
# launch is start-up (torchrun, tokenizing, building, compiling, the two slow first steps) plus its steps: 0.6B
# SFT 71 s for 12 steps, 1.7B 98 s, 0.6B LoRA 83 s; QLoRA and TRL are not measured yet (guesses from the
# ../shared/gpu/README.md baseline). The CPU column is the smoke test's own time on two cores. The first GPU run of
# an item replaces its pricing with its measured seconds (gpu_check.json's `seconds`); --estimate-scale adjusts
# them all.
BUILD_SECONDS = {4: 4.5, 8: 6.0, 28: 12.0}  # a recipe build of the 0.6B shape by its decoder layers
FIRST_COMPILE_SECONDS = 15.0  # a decoder layer's graphs, the first time in the process, per checkpointing setting
STEP_SECONDS = {4: 0.04, 8: 0.06, 28: 0.16}  # a forward and backward of 16,384 tokens by decoder layers
GPU_MARGIN = 1.25  # the pricing's error: a margin, not a measurement


def gpu_seconds(
    builds: dict[int, int], compiles: int = 0, steps: dict[int, float] | None = None, other: float = 0.0
) -> int:
    """An item's CUDA estimate: `builds` (decoder layers: how many recipe builds), `compiles` (first compiles of a
    layer's graphs), `steps` (decoder layers: forwards and backwards, in 16,384-token rows), `other` seconds."""
    work = sum(BUILD_SECONDS[layers] * count for layers, count in builds.items())
    work += FIRST_COMPILE_SECONDS * compiles + other
    work += sum(STEP_SECONDS[layers] * rows for layers, rows in (steps or {}).items())
    return math.ceil(GPU_MARGIN * work)


ESTIMATES = {
    # issue 68's ten items first (the 24-step launch is plan()'s)
    "float8": (gpu_seconds({4: 2}, steps={4: 1.5}, other=5), 4),  # + torchao's conversion, three float8 layers
    "offload_races": (gpu_seconds({4: 8}, compiles=2, steps={4: 28}), 6),  # 4 x (1 warm + 2 or 3) backwards each
    "cce_anchor": (gpu_seconds({}, other=4), 0),  # one CCE and one chunked backward of 8192 tokens; CUDA only
    "tensor_parallel": (gpu_seconds({4: 4}, steps={4: 2}), 8),
    "in_backward": (gpu_seconds({4: 2}, steps={4: 1}), 3),
    # + torchao compiling its step per parameter shape (about 8 shapes, 2 s each, for each of the 3 classes)
    "low_bit": (gpu_seconds({4: 5}, steps={4: 9}, other=48), 6),
    "cpu_offload": (gpu_seconds({4: 2}, steps={4: 1}, other=6), 3),  # + AdamW on the host over 215M parameters
    "snapshots": (gpu_seconds({8: 2}, steps={8: 11}, other=15), 4),  # + the bandwidth probe, a write and a load
    "estimate_bound": (gpu_seconds({ESTIMATE_BOUND_LAYERS: 8}, steps={ESTIMATE_BOUND_LAYERS: 16}), 3),
    # measured in the first GPU run: packed_vs_hf 26 s, cce 9, compile 28, dpo 38, cuda_tests 15 (x 1.5)
    "packed_vs_hf": (40, 6),
    "cce_vs_chunked": (15, 8),
    "tf32_scope": (5, 2),
    "compile_vs_eager": (45, 25),
    "host_syncs": (30, 3),
    "dpo_reference_memory": (60, 3),
    "objectives_bf16": (90, 6),  # (a guess: six 0.6B builds, eight small steps; never run on a GPU yet)
    "shared_prompt_attention": (45, 2),  # (a guess: FlexAttention's compile ~20 s, 4 x 11 steps of one layer)
    "expert_parallel": (gpu_seconds({4: 2}, compiles=2, steps={4: 10}), 6),  # (a guess: never run on a GPU)
    "resume_and_export": (240, 75),  # (one resume launch took 84 s)
    "cuda_tests": (30, 0),
}
# issue 68's order for the one call: items 1-9 in process, then the first shape's 24-step SFT launch (item 10)
FIRST_ITEMS = (
    "float8",
    "offload_races",
    "cce_anchor",
    "tensor_parallel",
    "in_backward",
    "low_bit",
    "cpu_offload",
    "snapshots",
    "estimate_bound",
)
ONE_CALL_SECONDS = 480  # issue 68: the first ten items within 8 minutes of one GPU
# A throughput launch: (start-up, per step) on one H100 by shape and mode; tiny on the CPU: (15, 1.5).
LAUNCH_ESTIMATES = {
    ("0.6b", "sft"): (65, 0.6),  # (71 s for 12 steps: start-up ~63 s, steps 0.3 s, two of 2.3-2.6 s)
    ("0.6b", "lora"): (75, 1.5),
    ("0.6b", "qlora"): (110, 2.0),
    ("0.6b", "fp8"): (90, 1.5),  # (guesses until measured: torchao's float8 conversion and compile at start-up)
    ("0.6b", "offload"): (75, 2.0),
    ("0.6b", "trl"): (150, 4.0),
    ("1.7b", "sft"): (90, 2.5),
    ("1.7b", "lora"): (95, 2.5),
    ("1.7b", "qlora"): (140, 3.0),
    ("1.7b", "trl"): (180, 6.0),
    ("0.6b", "grpo"): (80, 8.0),  # (a guess until measured: 32 prompts x 8 completions of 256 tokens a step)
}
IN_PROCESS = {
    "float8": check_float8,
    "offload_races": check_offload_races,
    "cce_anchor": check_cce_anchor,
    "tensor_parallel": check_tensor_parallel,
    "in_backward": check_in_backward,
    "low_bit": check_low_bit,
    "cpu_offload": check_cpu_offload,
    "snapshots": check_snapshots,
    "estimate_bound": check_estimate_bound,
    "packed_vs_hf": check_packed_vs_hf,
    "cce_vs_chunked": check_cce,
    "tf32_scope": check_tf32_scope,
    "compile_vs_eager": check_compile,
    "host_syncs": check_host_syncs,
    "dpo_reference_memory": check_dpo_reference,
    "objectives_bf16": check_objectives_bf16,
    "shared_prompt_attention": check_shared_prompt_attention,
    "expert_parallel": check_expert_parallel,
}


@dataclass
class Item:
    name: str  # as --only takes it
    estimate: float  # seconds
    run: Callable[[Context], None]
    in_process: bool = False


def plan(ctx: Context, shapes: list[str], steps: int) -> list[Item]:
    """Every item, most valuable first: issue 68's ten (FIRST_ITEMS in process, then the first shape's SFT
    throughput over 24 steps on CUDA), the other in-process exactness checks, resume and export, the CUDA-only
    tests, TRL beside the first shape, the next shape's SFT throughput (the MFU target), then LoRA and QLoRA and
    the remaining TRL runs."""
    warmup = max(1, steps // 3)

    def estimate(shape: str, mode: str, steps: int = steps) -> float:
        start_up, per_step = LAUNCH_ESTIMATES.get((shape, mode), (150, 5.0)) if ctx.cuda else (15, 1.5)
        return start_up + per_step * steps

    def launch(shape: str, mode: str, steps: int = steps) -> Item:
        if mode == "trl":
            return Item(f"trl_{shape}", estimate(shape, mode), lambda c: compare_with_trl(c, shape, steps, warmup))
        needed = 0 if mode == "qlora" and not ctx.cuda else estimate(shape, mode, steps)
        return Item(f"throughput_{shape}_{mode}", needed, lambda c: throughput_run(c, shape, mode, steps, warmup))

    cost = 0 if ctx.cuda else 1  # the (CUDA, CPU) column of ESTIMATES
    checks = [Item(name, ESTIMATES[name][cost], check, in_process=True) for name, check in IN_PROCESS.items()]
    first, *others = shapes
    items = [item for item in checks if item.name in FIRST_ITEMS]
    # 24 steps on CUDA (issue 68, item 10): steady_steps sees past a slow step 11 or 12
    items.append(launch(first, "sft", max(steps, 24) if ctx.cuda else steps))
    items += [item for item in checks if item.name not in FIRST_ITEMS]
    items += [
        Item("resume_and_export", ESTIMATES["resume_and_export"][cost], resume_and_export),
        Item("cuda_tests", ESTIMATES["cuda_tests"][cost], cuda_tests),
    ]
    # the CPU smoke test: the SFT launch, no LoRA launch; float8 and offloading last (issue 53's GPU rows)
    modes = ["lora", "qlora", "fp8", "offload"] if ctx.cuda else ["qlora"]
    if ctx.cuda:
        items.append(launch(first, "trl"))
        # the GRPO recipe's rollout and training speed, its peak against the estimate (issue 70): after TRL's row
        items.append(Item(f"grpo_{first}", estimate(first, "grpo", 6), lambda c: grpo_run(c, first, 6, 2)))
    items += [launch(shape, "sft") for shape in others]
    items += [launch(first, mode) for mode in modes]
    for shape in others:
        items += [launch(shape, "trl")] if ctx.cuda else []
        items += [launch(shape, mode) for mode in modes]
    if ctx.cuda:  # six one-step launches at most: last
        items.append(Item(f"longest_row_{first}", 6 * estimate(first, "sft"), lambda c: longest_row(c, first)))
    return items


def plan_text(items: list[Item], started: float, scale: float, device: str) -> str:
    """The dry run (`--plan`): each item's estimate and where the call stands after it, counted as --budget
    counts (from the script's start), and whether issue 68's ten items (FIRST_ITEMS and the first SFT launch)
    end within ONE_CALL_SECONDS."""
    lines, elapsed = [f"start-up (imports, counted by --budget): {started:.0f} s"], started
    first_ten = {*FIRST_ITEMS, next((i.name for i in items if i.name.startswith("throughput_")), "")}
    ten_done = None
    for item in items:
        elapsed += item.estimate * scale
        lines.append(f"{item.name:<32} ~{item.estimate * scale:5.0f} s   at {elapsed:6.0f} s")
        if item.name in first_ten:
            ten_done = elapsed
    if ten_done is not None and first_ten <= {item.name for item in items}:
        verdict = "within" if ten_done <= ONE_CALL_SECONDS else "NOT within"
        lines.append(f"issue 68's ten items end at ~{ten_done:.0f} s on {device}: {verdict} {ONE_CALL_SECONDS} s")
    return "\n".join(lines)


def run_items(ctx: Context, items: list[Item], report: Callable[[], None]) -> None:
    """Each item in order where its estimate fits the budget left, else a NOT RUN row; the in-process ones in
    the one-rank group and stopped (SIGALRM) when the budget runs out, a launch stopped then by its timeout.
    The report is rewritten after every item."""
    pending = list(items)
    ctx.pending = pending
    group = None
    try:
        while pending:
            item = pending[0]
            if not ctx.budget.fits(item.estimate):
                ctx.add_not_run(item.name, ctx.budget.not_run(item.estimate))
                pending.pop(0)
                report()
                continue
            if item.in_process and group is None:
                group = one_rank_group(ctx)
                group.__enter__()
            elif not item.in_process and group is not None:
                group.__exit__(None, None, None)
                group = None
            ctx.current, started = item, time.perf_counter()
            report()  # the files list this item as not finished until it is
            try:
                with alarm(ctx.budget.left() if item.in_process else None):
                    item.run(ctx)
            except OutOfBudget as stopped:
                ctx.add_not_run(
                    item.name, f"not finished ({stopped}; estimate ~{item.estimate * ctx.budget.scale:.0f} s)"
                )
            except Exception as error:  # a broken check is a FAIL with its reason; the other checks still run
                ctx.add(
                    item.name, False, f"{type(error).__name__}: {error}"[:300], detail=traceback.format_exc()[-1500:]
                )
            ctx.seconds.setdefault(item.name, time.perf_counter() - started)
            ctx.current = None
            pending.pop(0)
            if ctx.cuda:
                torch.cuda.empty_cache()
            report()
    finally:
        if group is not None:
            group.__exit__(None, None, None)


@contextmanager
def alarm(seconds: float | None):
    """OutOfBudget raised in the main thread after `seconds` (None: no limit): an in-process check stopped
    when the budget runs out (at its next Python bytecode: a long kernel or compile finishes first)."""
    if seconds is None or seconds == float("inf"):
        yield
        return

    def expire(signum, frame):
        raise OutOfBudget(f"stopped by the budget after {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def watchdog(ctx: Context, report: Callable[[], None]) -> None:
    """The last resort when the budget's margin is spent too (the main thread stuck in a kernel, a collective
    or a child's shutdown): the item running and those pending are NOT RUN rows, the report is written, the
    children stopped, the process ends (exit 1)."""
    if ctx.budget.seconds is None:
        return

    def expire() -> None:
        for item in list(ctx.pending):
            if item is ctx.current:
                ctx.add_not_run(
                    item.name, f"not finished (stopped by the watchdog at the budget + {BUDGET_MARGIN_S // 2} s)"
                )
            else:
                ctx.add_not_run(item.name, ctx.budget.not_run(item.estimate))
        ctx.pending.clear()
        report()
        for child in list(bench_gpu.CHILDREN):
            stop_process_group(child)
        os._exit(1)

    timer = threading.Timer(max(0.0, ctx.budget.left()) + BUDGET_MARGIN_S // 2, expire)
    timer.daemon = True
    timer.start()
