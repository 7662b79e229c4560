"""The recipe runs (torchrun, one process each): throughput and its steady steps, the longest row, TRL beside
it, the CUDA-only tests, resume and export."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import bench_gpu
import torch
from bench_gpu import run_bounded

from chattune.launch.torchrun import torchrun_command

from . import ROOT
from .context import Context, model_dir

# --- recipe runs (torchrun, one process each) ---


def recipe_environment() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {
        **os.environ,
        "PYTHONPATH": path,
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }


def run_recipe(
    ctx: Context, name: str, overrides: list[str], recipe: str = "sft", env: dict[str, str] | None = None
) -> tuple[Path, str]:
    """Launch a recipe into work/<name> (a fresh directory unless a launch continues it); (output dir, log: its
    standard output and error as one stream, in the order the ranks wrote them). `env`: variables added to the
    launch's environment. The launch is stopped when the budget runs out (OutOfBudget)."""
    output_dir = ctx.work / name
    command = [
        *torchrun_command(str(ROOT / "recipes" / f"{recipe}.py"), nproc=1),
        "--config-name",
        f"{recipe}/local_model",
        f"output_dir={output_dir}",
        f"device={ctx.device.type}",
        "progress=lines",
        "data.report_records=0",
        *overrides,
    ]
    done = run_bounded(
        command, ctx.budget.timeout(), stderr=subprocess.STDOUT, env={**recipe_environment(), **(env or {})}, cwd=ROOT
    )
    log = done.stdout
    (ctx.out / f"{name}.log").write_text(log)
    if done.returncode:
        raise RuntimeError(f"{name} failed ({done.returncode}): {log[-1200:]}")
    return output_dir, log


def metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def throughput_run(ctx: Context, shape: str, mode: str, steps: int, warmup: int) -> None:
    """One SFT (mode sft), LoRA or QLoRA launch of recipes/sft.py: its tokens/s, MFU and peak memory; after
    the 1.7B SFT run the MFU target."""
    name = f"throughput_{shape}_{mode}"
    if mode == "qlora" and not ctx.cuda:
        ctx.add(name, None, "a 4-bit base is CUDA only")
        return
    if mode == "qlora" and importlib.util.find_spec("bitsandbytes") is None:
        ctx.add(name, None, "bitsandbytes is not importable")
        return
    if mode == "fp8" and importlib.util.find_spec("torchao") is None:
        ctx.add(name, None, "torchao is not importable")
        return
    budget, accum = (16384, 2) if ctx.cuda else (2048, 1)
    extra = {
        "sft": [],
        "lora": ["peft=lora"],
        "qlora": ["peft=qlora"],
        "fp8": ["model.fp8=tensorwise"],  # against the sft row's tokens/s: float8's speed-up
        "offload": ["model.fsdp.offload_activations=true"],  # against the sft row's peak and tokens/s
    }[mode]
    directory = model_dir(ctx, shape)
    try:
        output_dir, log = run_recipe(
            ctx,
            name,
            [
                f"model.path={directory}",
                f"data.train=[{ctx.chats}]",
                "data.eval=[]",
                "overwrite=true",
                f"max_steps={steps}",
                "log_every=1",
                "save_every=0",
                "eval_every=0",
                f"data.max_tokens_per_microbatch={budget}",
                f"grad_accum_steps={accum}",
                "data.num_workers=2",
                f"model.fsdp.activation_checkpointing={'true' if shape == '1.7b' or mode == 'offload' else 'false'}",
                *extra,
            ],
            env={"TORCH_LOGS": "recompiles"},  # what compiled again, for steady_steps
        )
    except RuntimeError as error:
        ctx.add(name, False, str(error).splitlines()[0][:200])
        return
    rows = [m for m in metrics(output_dir) if warmup < m["step"] <= steps]
    seconds = sum(m["step_time_s"] for m in rows)
    tokens = sum(m["all_tokens_per_sec_per_device"] * m["step_time_s"] for m in rows) / seconds
    mfu = sum(m.get("mfu", 0.0) * m["step_time_s"] for m in rows) / seconds if "mfu" in rows[-1] else None
    peak = max(m.get("peak_memory_allocated_gib", 0.0) for m in rows) or None
    compute = next((line.split("] ", 1)[-1] for line in log.splitlines() if "] compute:" in line), "")
    # rank 0's start-up estimate (chattune.model.cost.memory), beside the measured peak
    estimated = re.search(r"peak per rank \(the rows at once\)\s+([0-9.]+) GiB", log)
    estimate = float(estimated.group(1)) if estimated else None
    ctx.figures[shape, mode] = {"tokens_per_s": tokens, "mfu": mfu, "peak_gib": peak, "estimated_gib": estimate}
    ctx.add(
        name,
        True,
        f"{tokens:,.0f} tokens/s per device, MFU {mfu:.1%}"
        if mfu is not None
        else f"{tokens:,.0f} tokens/s per device",
        ", ".join(([f"peak {peak:.1f} GiB"] if peak else []) + ([f"estimated {estimate:.2f} GiB"] if estimate else [])),
        compute,
    )
    if ctx.cuda and shape == "1.7b" and mode == "sft" and mfu is not None:
        ctx.add("target_mfu_1.7b", mfu >= 0.45, f"MFU {mfu:.1%}", "≥ 45%")
    check_steady_steps(ctx, f"steady_steps_{shape}_{mode}", metrics(output_dir), log)


def grpo_run(ctx: Context, shape: str, steps: int, warmup: int) -> None:
    """One launch of recipes/grpo.py (grpo/local_model) on the shape's random-init model and the demo's sorting
    prompts: the rollout's and the training's tokens/s, the rollout's share of a step, the peak memory against the
    start-up estimate (the higher of a training step's and a rollout's peak), and the sampler's mismatch. Random
    weights never stop early: every completion runs to rollout.max_new_tokens, the rollout's worst case."""
    name = f"grpo_{shape}"
    new_tokens = 256 if ctx.cuda else 16
    prompts = "${demo_asset:sort_prompts.jsonl}"
    try:
        output_dir, log = run_recipe(
            ctx,
            name,
            [
                f"model.path={model_dir(ctx, shape)}",
                f"data.train=[{{path: '{prompts}', format: prompt}}]",
                "overwrite=true",
                f"max_steps={steps}",
                "log_every=1",
                "save_every=0",
                f"rollout.prompts_per_step={32 if ctx.cuda else 4}",
                "rollout.completions_per_prompt=8",
                f"rollout.max_new_tokens={new_tokens}",
                "data.max_tokens_per_microbatch=8192" if ctx.cuda else "data.max_tokens_per_microbatch=1024",
                "reward.functions=[{_target_: chattune.rl.demo_task.sorted_numbers, weight: 1.0}]",
            ],
            recipe="grpo",
        )
    except RuntimeError as error:
        ctx.add(name, False, str(error).splitlines()[0][:200])
        return
    rows = [m for m in metrics(output_dir) if warmup < m["step"] <= steps] or metrics(output_dir)[-1:]
    rollout_s = sum(m["rollout_s"] for m in rows)
    step_s = sum(m["step_time_s"] for m in rows)
    sampled = sum(m["rollout_tokens_per_sec"] * m["rollout_s"] for m in rows if m["rollout_s"] > 0)
    trained = sum(m["num_tokens"] for m in rows)
    peak = max(m.get("peak_memory_allocated_gib", 0.0) for m in rows) or None
    estimated = re.search(r"peak per rank \(the higher\)\s+([0-9.]+) GiB", log)
    mismatch = max(abs(m["mismatch_kl"]) for m in rows)
    ctx.figures[shape, "grpo"] = {
        "rollout_tokens_per_s": sampled / rollout_s if rollout_s else None,
        "train_tokens_per_s": trained / (step_s - rollout_s) if step_s > rollout_s else None,
        "rollout_share": rollout_s / step_s if step_s else None,
        "peak_gib": peak,
        "estimated_gib": float(estimated.group(1)) if estimated else None,
        "mismatch_kl": mismatch,
    }
    ctx.add(
        name,
        mismatch < 1e-2,
        f"rollout {sampled / max(rollout_s, 1e-9):,.0f} tokens/s, training {trained / max(step_s - rollout_s, 1e-9):,.0f}"
        f" completion tokens/s, the rollout {rollout_s / max(step_s, 1e-9):.0%} of a step",
        ", ".join(
            ([f"peak {peak:.1f} GiB"] if peak else [])
            + ([f"estimated {estimated.group(1)} GiB"] if estimated else [])
            + [f"mismatch_kl {mismatch:.1e}"]
        ),
    )


STEP_LINE = re.compile(r"\] step (\d+) \|")
SLOW_STEP = 2.0  # a step over this many times the median step time is named
STEADY_AFTER = 2  # the first steps compile (and a 1-token empty microbatch's graphs may come later: named too)


def check_steady_steps(ctx: Context, name: str, rows: list[dict], log: str) -> None:
    """The launch's steps after the first STEADY_AFTER: none over SLOW_STEP times the median step time, and each
    that is, named with what dynamo logged between the step before it and it (`TORCH_LOGS=recompiles`: the
    guard that failed), and with its own wait for data and Python's garbage collection (the step's `data_wait_s`,
    `gc_s`); a slow step with none of these is one that neither recompiled, waited for data nor collected (a
    Triton kernel specialised anew, an allocator's growth, the host)."""
    times = {m["step"]: m["step_time_s"] for m in rows if "step_time_s" in m}
    parts = {m["step"]: ", ".join(f"{key} {m[key]:.2f} s" for key in ("data_wait_s", "gc_s") if key in m) for m in rows}
    steady = sorted(t for step, t in times.items() if step > STEADY_AFTER)
    if not steady:
        ctx.add(name, None, "no steps after the first to compare")
        return
    median = steady[len(steady) // 2]
    said: dict[int, list[str]] = {}  # the recompile lines printed before each step's own line
    pending: list[str] = []
    for line in log.splitlines():
        found = STEP_LINE.search(line)
        if found:
            said[int(found.group(1))], pending = pending, []
        elif "recompil" in line.lower() or "guard" in line.lower():
            pending.append(line.split("] ", 1)[-1].strip()[:160])
    slow = {step: t for step, t in sorted(times.items()) if step > STEADY_AFTER and t > SLOW_STEP * median}
    named = "; ".join(
        f"step {step} {t:.2f} s"
        + (f" ({parts[step]})" if parts.get(step) else "")
        + ": "
        + (" / ".join(said.get(step, [])[:3]) or "no recompile logged")
        for step, t in slow.items()
    )
    recompiled = [step for step, lines in said.items() if step > STEADY_AFTER and lines]
    ctx.add(
        name,
        not slow,
        f"median step {median:.3f} s; " + (named or "none slower than 2x"),
        f"no step after the first {STEADY_AFTER} over {SLOW_STEP:g}x the median",
        f"steps that recompiled: {recompiled or 'none'}",
    )


LONG_ROWS = (32768, 65536, 131072)  # tokens a microbatch, tried in turn until one does not run


def longest_row(ctx: Context, shape: str) -> None:
    """The longest packed row one GPU trains (one step, activation checkpointing), without and with activations
    offloaded to host memory (`model.fsdp.offload_activations`): each setting tries LONG_ROWS in turn until a launch
    fails (out of memory) and reports the longest that ran with its peak. CUDA only."""
    name = f"longest_row_{shape}"
    if not ctx.cuda:
        ctx.add(name, None, "CUDA only")
        return
    longest = {}
    for offload in (False, True):
        for tokens in LONG_ROWS:
            try:
                output_dir, _ = run_recipe(
                    ctx,
                    f"{name}_{tokens}{'_offload' if offload else ''}",
                    [
                        f"model.path={model_dir(ctx, shape)}",
                        f"data.train=[{ctx.chats}]",
                        "data.eval=[]",
                        "overwrite=true",
                        "max_steps=1",
                        "save_every=0",
                        "eval_every=0",
                        f"data.max_tokens_per_microbatch={tokens}",
                        "model.fsdp.activation_checkpointing=true",
                        f"model.fsdp.offload_activations={'true' if offload else 'false'}",
                    ],
                )
            except RuntimeError:  # out of memory, most likely: the log is in the output folder
                break
            peak = max(m.get("peak_memory_allocated_gib", 0.0) for m in metrics(output_dir))
            longest[offload] = (tokens, peak)
    described = "; ".join(
        f"{'offloaded' if offload else 'plain'}: "
        + (f"{longest[offload][0]:,} tokens ({longest[offload][1]:.1f} GiB)" if offload in longest else "none ran")
        for offload in (False, True)
    )
    plain, offloaded = longest.get(False, (0, 0.0))[0], longest.get(True, (0, 0.0))[0]
    ctx.add(name, offloaded >= plain and offloaded > 0, described, "offloaded ≥ plain", f"tried {LONG_ROWS}")


def compare_with_trl(ctx: Context, shape: str, steps: int, warmup: int) -> None:
    """TRL's SFTTrainer on the throughput run's model, chats and token budget (bench_gpu.run_trl): the targets
    ≥ 3× its tokens/s and peak memory ≤ its."""
    if importlib.util.find_spec("trl") is None:
        ctx.add(f"trl_{shape}", None, "trl is not importable: no comparison")
        return
    if (shape, "sft") not in ctx.figures:
        ctx.add(f"trl_{shape}", None, f"throughput_{shape}_sft has no figure to compare with")
        return
    run = {"0.6b": "short06", "1.7b": "short17"}[shape]
    arguments = argparse.Namespace(work=ctx.work / "trl", steps=steps, warmup=warmup)
    arguments.work.mkdir(parents=True, exist_ok=True)
    try:
        theirs = bench_gpu.run_trl(run, model_dir(ctx, shape), ctx.chats, arguments, ctx.budget.timeout())
    except SystemExit as error:
        ctx.add(f"trl_{shape}", False, str(error))
        return
    ours = ctx.figures[shape, "sft"]
    ratio = ours["tokens_per_s"] / theirs["tokens_per_s"]
    ctx.add(
        f"target_vs_trl_{shape}", ratio >= 3.0, f"{ratio:.2f}× TRL's {theirs['tokens_per_s']:,.0f} tokens/s", "≥ 3×"
    )
    if ours["peak_gib"] is not None:
        ctx.add(
            f"target_memory_vs_trl_{shape}",
            ours["peak_gib"] <= theirs["peak_memory_gib"],
            f"{ours['peak_gib']:.1f} GiB vs TRL's {theirs['peak_memory_gib']:.1f} GiB",
            "≤ TRL's",
        )


def cuda_test_files() -> list[str]:
    """The test files with CUDA-only tests (a `torch.cuda.is_available()` skip), and
    tests/unit/model/packed/test_varlen_fallback.py (torch's varlen_attn as the GPU machine's torch has it)."""
    files = {
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "tests").rglob("test_*.py"))
        if "cuda.is_available()" in path.read_text()
    }
    return sorted(files | {"tests/unit/model/packed/test_varlen_fallback.py"})


def cuda_tests_command() -> list[str]:
    """The pytest command of `cuda_tests`: runs where pytest does but pytest-xdist is absent (the carry folder)."""
    return [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-rs",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",  # pyproject's `--dist worksteal` needs pytest-xdist, which the carry folder does not hold
        *cuda_test_files(),
        "-k",
        "cuda or varlen_fallback",  # -k matches module names too: every test of test_varlen_fallback.py
    ]


def cuda_tests_environment() -> dict[str, str]:
    """The recipes' environment without PYTEST_ADDOPTS: a shell's xdist options (`--dist load`) would stop the
    plugin-less pytest as pyproject's addopts did."""
    return {name: value for name, value in recipe_environment().items() if name != "PYTEST_ADDOPTS"}


def cuda_tests(ctx: Context) -> None:
    """The project's CUDA-only tests (`-k cuda` over cuda_test_files()) and the varlen stand-ins' tests (whose
    signature test then compares them with this machine's torch), a subprocess: CUDA only."""
    if not ctx.cuda:
        ctx.add("cuda_tests", None, "CUDA only")
        return
    importable = subprocess.run([sys.executable, "-c", "import pytest"], capture_output=True, text=True)
    if importable.returncode:  # absent, or a dependency of it missing (pygments for pytest 9)
        ctx.add("cuda_tests", None, "pytest does not import", detail=importable.stderr.strip()[-300:])
        return
    command = cuda_tests_command()
    done = run_bounded(command, ctx.budget.timeout(), env=cuda_tests_environment(), cwd=ROOT)
    log = done.stdout + done.stderr
    (ctx.out / "cuda_tests.log").write_text(log)
    counts = re.compile(r"\d+ (passed|failed|error|deselected|skipped)")
    summary = next(
        (line.strip("= ") for line in reversed(log.splitlines()) if counts.search(line)), f"exit {done.returncode}"
    )
    skipped = "; ".join(line.split("] ", 1)[-1] for line in log.splitlines() if line.startswith("SKIPPED"))
    ctx.add(
        "cuda_tests",
        done.returncode == 0 and "passed" in summary,
        summary,
        "all selected pass",
        f"{shlex.join(command[3:])}; {skipped}"[:300],
    )


def resume_and_export(ctx: Context) -> None:
    """8 steps straight against 4 + stop + resume + 4 (async checkpoints, evaluation on); the exports. On the CPU
    (the smoke test of this script) 4 steps against 2 + 2: the same launches, their code paths, at half the steps."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    eval_file = ctx.work / "eval.jsonl"
    eval_file.write_text("\n".join(ctx.chats.read_text().splitlines()[-48:]) + "\n")
    budget = 4096 if ctx.cuda else 1024
    steps = 8 if ctx.cuda else 4
    half = steps // 2
    common = [
        f"model.path={model_dir(ctx, ctx.shape)}",
        f"data.train=[{ctx.chats}]",
        f"data.eval=[{eval_file}]",
        f"max_steps={steps}",
        "log_every=1",
        f"eval_every={half}",
        "save_async=true",
        "export.dtype=float32",
        f"data.max_tokens_per_microbatch={budget}",
        "grad_accum_steps=2",
        # loader workers resumed with their stream; the CPU smoke test leaves them out (two more processes a
        # launch on 2 cores; tests/e2e/test_resume.py resumes them)
        f"data.num_workers={2 if ctx.cuda else 0}",
    ]
    started = time.perf_counter()
    straight, _ = run_recipe(ctx, "resume_straight", [*common, "save_every=3", "overwrite=true"])  # saves 3, 6
    resumed, _ = run_recipe(
        ctx, "resume_resumed", [*common, "save_every=3", "overwrite=true", f"stop_after_step={half}"]
    )
    resumed, log = run_recipe(
        ctx, "resume_resumed", [*common, f"save_every={half}"]
    )  # resumes at the stop, saves at the end
    ctx.seconds["resume_and_export"] = time.perf_counter() - started
    if "resumed from" not in log:
        ctx.add("resume_exact", False, "the second launch did not resume")
        return
    losses = {m["step"]: m["loss"] for m in metrics(straight) if "loss" in m}
    again = {m["step"]: m["loss"] for m in metrics(resumed) if "loss" in m}
    differing = [step for step in losses if losses[step] != again.get(step)]
    ctx.add(
        "resume_exact",
        not differing and sorted(losses) == list(range(1, steps + 1)),
        f"bitwise equal losses at steps 1-{steps}" if not differing else f"losses differ at steps {differing}",
        "bitwise",
        f"max rel diff {max(abs(losses[s] - again[s]) / abs(losses[s]) for s in losses):.2g}",
    )

    def exported(run: Path) -> dict[str, torch.Tensor]:
        index = json.loads((run / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
        weights = {}
        for file in sorted(set(index.values())):
            weights.update(load_file(run / "hf" / file))
        return weights

    checkpoint = ctx.work / "resume_masters.pt"
    dcp_to_torch_save(resumed / "checkpoints" / f"step_{steps}", checkpoint)
    masters = {name.removeprefix("hf_model."): value for name, value in torch.load(checkpoint)["model"].items()}
    weights = exported(resumed)
    mismatched = [name for name, value in weights.items() if not torch.equal(value, masters.get(name, value + 1))]
    # A tied output layer is one parameter, written once (under the embedding's name).
    unwritten = [
        name
        for name in masters
        if name not in weights and not any(torch.equal(masters[name], value) for value in weights.values())
    ]
    ctx.add(
        "export_masters",
        not mismatched and not unwritten,
        f"{len(weights) - len(mismatched)} of {len(weights)} exported tensors equal to the step-{steps} checkpoint's "
        f"fp32 masters; {len(unwritten)} masters not written",
        "all, bitwise",
        ", ".join((mismatched + unwritten)[:3]),
    )
    after_eval = exported(straight)
    shares = {
        name: float((after_eval[name].bfloat16().float() != after_eval[name]).float().mean())
        for name in ("model.embed_tokens.weight", "model.norm.weight")
    }
    ctx.add(
        "export_after_eval",
        min(shares.values()) > 0.5,
        "share of values that are not bf16 values: " + ", ".join(f"{k} {v:.2f}" for k, v in shares.items()),
        "> 0.5 (bf16 copies: 0)",
    )
