"""scripts/gpu_check, the one command that verifies the GPU path, run as a smoke test in its CPU mode: a
tiny model, chattune's demo tokenizer and chats. Every check that can run on the CPU runs and passes; the
CUDA-only ones say SKIP; the JSON and the markdown table are written. With --budget (one call on a lent GPU
machine has a few minutes): what does not fit is a NOT RUN row, a launch running when the budget ends is
stopped with all it started, the script returns within the budget and its margin, and it prints the command
of a second call for the rest. scripts/bench/bench_gpu.py's --budget likewise."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest

pytestmark = pytest.mark.launch  # every test here starts processes

MARGIN = 20  # scripts/bench/bench_gpu.py's BUDGET_MARGIN_S

OBJECTIVE_ROWS = [f"objectives_bf16_{name}" for name in ("dpo_sigmoid", "orpo", "kto", "reward")]  # one item's rows

CPU_CHECKS = {
    "float8",
    "expert_parallel_one_rank",
    "tensor_parallel_chunked",
    "tensor_parallel_cut_cross_entropy",
    "in_backward",
    "packed_vs_hf",
    "leak_control",
    "cce_vs_chunked",
    "tf32_scope",
    "compile_vs_eager",
    "recompiles",
    "dpo_reference_memory",
    *OBJECTIVE_ROWS,
    "offload_eager_noac",
    "offload_eager_ac",
    "cpu_offload",
    "snapshot_exact",
    "snapshot_resume",
    "throughput_tiny_sft",
    "steady_steps_tiny_sft",
    "resume_exact",
    "export_masters",
    "export_after_eval",
}
# the low_bit item's rows, where torchao is installed (the dev extra installs it)
LOW_BIT_ROWS = (
    {"low_bit_AdamW8bit", "low_bit_AdamW4bit", "low_bit_AdamWFp8", "low_bit_resume"}
    if importlib.util.find_spec("torchao") is not None
    else set()
)
CPU_CHECKS |= LOW_BIT_ROWS
CUDA_ONLY = {
    "cce_anchor",
    "shared_prompt_attention",
    "tensor_parallel_padded_slice",
    "host_syncs",
    "estimate_bound",
    "snapshot_overhead",
    "throughput_tiny_qlora",
    "cuda_tests",
}


# Issue 68's order for the one call: its in-process items 1-9 (then the first shape's SFT launch, item 10)
ISSUE_68_ORDER = [
    "float8",
    "offload_races",
    "cce_anchor",
    "tensor_parallel",
    "in_backward",
    "low_bit",
    "cpu_offload",
    "snapshots",
    "estimate_bound",
]
# The CPU smoke test in two calls that xdist runs side by side (one call took 104 s of one worker): the launches and
# what they check, and the in-process items (--only takes either list)
LAUNCH_ITEMS = ["throughput_tiny_sft", "resume_and_export", "cuda_tests", "throughput_tiny_qlora"]
LAUNCH_ROWS = {
    "throughput_tiny_sft",
    "steady_steps_tiny_sft",
    "resume_exact",
    "export_masters",
    "export_after_eval",
    "cuda_tests",
    "throughput_tiny_qlora",
}


@pytest.mark.parametrize("part", ["in_process", "launches"])
def test_the_gpu_check_runs_its_cpu_parts(tmp_path, part):
    sys.path.insert(0, str(Path("scripts").resolve()))
    from gpu_check.plan import IN_PROCESS

    items = [name for name in (*IN_PROCESS, *LAUNCH_ITEMS) if (name in LAUNCH_ITEMS) == (part == "launches")]
    done = subprocess.run(
        [sys.executable, "scripts/gpu_check", "--device", "cpu", "--out", str(tmp_path), "--only", *items],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    status = {row["check"]: row["status"] for row in report["rows"]}
    mine = (lambda row: row in LAUNCH_ROWS) if part == "launches" else (lambda row: row not in LAUNCH_ROWS)
    assert {name for name, result in status.items() if result == "PASS"} == set(filter(mine, CPU_CHECKS)), status
    assert {name for name, result in status.items() if result == "SKIP"} == set(filter(mine, CUDA_ONLY)), status
    table = (tmp_path / "gpu_check.md").read_text()
    assert all(f"| {name} | PASS |" in table for name in filter(mine, CPU_CHECKS))
    assert report["environment"]["device"] == "cpu"
    assert report["environment"]["varlen_gqa"].split()[0] in {"flag", "native", "repeat"}
    assert report["not_run"] == [] and report["rerun"] is None


def _run(arguments: list[str], cwd: Path | None = None) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, *arguments], cwd=cwd, capture_output=True, text=True, timeout=300)
    return done, time.monotonic() - started


def _second_call(stdout: str) -> list[str]:
    """The command printed for what did not run."""
    lines = stdout.splitlines()
    return shlex.split(
        lines[lines.index(next(line for line in lines if "the second call" in line and "[gpu_check]" in line)) + 1]
    )


def test_with_no_budget_left_every_item_is_a_not_run_row_and_the_second_call_is_printed(tmp_path):
    done, _ = _run(["scripts/gpu_check", "--device", "cpu", "--out", str(tmp_path / "first"), "--budget", "1"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "first" / "gpu_check.json").read_text())
    items = [row["check"] for row in report["rows"]]
    assert items[:10] == [*ISSUE_68_ORDER, "throughput_tiny_sft"]  # the priority order: issue 68's ten first
    assert "throughput_tiny_sft" in items
    assert items.index("throughput_tiny_sft") < items.index("resume_and_export")
    # The CUDA-only items cost nothing (estimate 0): they say SKIP where a moment is left, else NOT RUN.
    not_run = [row["check"] for row in report["rows"] if row["check"] not in CUDA_ONLY or row["status"] != "SKIP"]
    assert set(not_run) >= CPU_CHECKS - {
        "leak_control",
        "recompiles",
        "resume_exact",
        "export_masters",
        "export_after_eval",
        "steady_steps_tiny_sft",
        *OBJECTIVE_ROWS,
        *LOW_BIT_ROWS,
        "snapshot_exact",
        "snapshot_resume",
        "offload_eager_noac",
        "offload_eager_ac",
        "tensor_parallel_chunked",
        "tensor_parallel_cut_cross_entropy",
        "expert_parallel_one_rank",
    } | {
        "tensor_parallel",
        "expert_parallel",
        "resume_and_export",
        "objectives_bf16",
        "snapshots",
        "offload_races",
        *(["low_bit"] if LOW_BIT_ROWS else []),
    }, report["rows"]
    assert items.index("dpo_reference_memory") + 1 == items.index("objectives_bf16")
    assert all(
        row["status"] == "NOT RUN" and row["figure"].startswith("not run (budget: needs ~")
        for row in report["rows"]
        if row["check"] in not_run
    ), report["rows"]
    assert report["not_run"] == not_run
    table = (tmp_path / "first" / "gpu_check.md").read_text()
    assert all(f"| {item} | NOT RUN | not run (budget: needs ~" in table for item in not_run)
    second = _second_call(done.stdout)
    assert second[second.index("--only") + 1 :][: len(not_run)] == not_run and second[0] == sys.executable
    assert report["rerun"] == shlex.join(second)
    # The printed command runs as it is (the same budget: nothing again), into a folder of its own.
    again, _ = _run(second[1:])
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert (
        set(json.loads((tmp_path / "first-rest" / "gpu_check.json").read_text())["not_run"]) >= set(not_run) - CUDA_ONLY
    )


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
        if text in command and entry.name != str(os.getpid()):
            found.append(command)
    return found


def test_the_plan_fits_issue_68s_ten_items_in_eight_minutes_on_cuda(tmp_path):
    """`--plan --device cuda` (no GPU needed: nothing runs): the ten items first, in issue 68's order, ending within
    the one call's 480 s as priced (docs/gpu-check.md); the estimates are the ones --budget uses."""
    done, _ = _run(["scripts/gpu_check", "--device", "cuda", "--plan", "--out", str(tmp_path)])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    items = [line.split() for line in lines[1:] if line.split()[1:2] == ["~"]]  # name ~ N s at M s
    names = [item[0] for item in items]
    assert names[:10] == [*ISSUE_68_ORDER, "throughput_0.6b_sft"], names
    ends = {item[0]: float(item[-2]) for item in items}
    assert ends["throughput_0.6b_sft"] <= 480 < ends[names[-1]]  # the rest are past it: the budget decides
    assert lines[-1].startswith("issue 68's ten items end at") and "within 480 s" in lines[-1], lines[-1]
    assert "NOT within" not in lines[-1]
    assert not (tmp_path / "gpu_check.json").exists()  # nothing ran


def test_a_launch_running_when_the_budget_ends_is_stopped_with_its_workers(tmp_path):
    """Every estimate 0 (--estimate-scale 0): the recipe launches start and the budget stops the one running."""
    budget = 15
    done, seconds = _run(
        [
            "scripts/gpu_check",
            "--device",
            "cpu",
            "--out",
            str(tmp_path),
            "--budget",
            str(budget),
            "--estimate-scale",
            "0",
            "--only",
            "throughput_tiny_sft",
            "resume_and_export",
        ]
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert seconds < budget + MARGIN, seconds
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    status = {row["check"]: (row["status"], row["figure"]) for row in report["rows"]}
    stopped = [
        name
        for name, (result, figure) in status.items()
        if result == "NOT RUN" and figure.startswith("not finished (stopped by the budget after")
    ]
    assert stopped, status
    assert set(report["not_run"]) == {name for name, (result, _) in status.items() if result == "NOT RUN"}
    assert set(report["not_run"]) | {
        "resume_exact",
        "export_masters",
        "export_after_eval",
        "throughput_tiny_sft",
        "steady_steps_tiny_sft",
    } >= set(status), status
    assert report["budget"]["elapsed"] <= budget + MARGIN
    assert _processes_mentioning(str(tmp_path)) == []  # torchrun and its worker stopped, not orphaned
    assert "--only " + " ".join(report["not_run"]) in done.stdout


def test_bench_gpu_budget(tmp_path):
    """bench_gpu.py --budget on the CPU: the runs in priority order, none fitting 2 s; every one a row in the
    table and results.json, and the command of the second call."""
    done, seconds = _run(
        [
            "scripts/bench/bench_gpu.py",
            "--device",
            "cpu",
            "--runs",
            "tiny_gemma4",
            "tiny",
            "--budget",
            "2",
            "--work",
            str(tmp_path),
            "--assets",
            str(tmp_path / "absent"),
        ]
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert seconds < 2 + MARGIN
    rows = json.loads((tmp_path / "results.json").read_text())
    assert [(row["run"], row["tool"]) for row in rows] == [("tiny", "chattune"), ("tiny_gemma4", "chattune")]
    assert all(row["status"].startswith("not run (budget: needs ~") for row in rows), rows
    assert "| tiny | chattune | not run (budget: needs ~" in done.stdout
    second = shlex.split(done.stdout.strip().splitlines()[-1])
    assert second[second.index("--runs") + 1 :] == ["tiny", "tiny_gemma4"] and "--budget" in second


def test_the_cuda_tests_command_runs_where_pytest_xdist_is_absent():
    """The carry folder holds pytest, not pytest-xdist; pyproject's `--dist worksteal` then stopped pytest with
    "unrecognized arguments". `-p no:xdist` stands in for the absent plugin; the command collects its tests, an
    xdist option in PYTEST_ADDOPTS (a CI's `--dist load`) left out of its environment."""
    sys.path.insert(0, str(Path("scripts").resolve()))
    from gpu_check.runs import cuda_tests_command, cuda_tests_environment

    with mock.patch.dict(os.environ, {"PYTEST_ADDOPTS": "--dist load"}):
        environment = cuda_tests_environment()
    done = subprocess.run(
        [*cuda_tests_command(), "-p", "no:xdist", "--collect-only"],
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"\d+ tests? collected|\d+/\d+ tests collected", done.stdout), done.stdout[-2000:]


def test_a_slow_step_is_named_with_the_recompile_logged_before_it(tmp_path):
    """steady_steps (issue 68, item 10): a step over twice the median after the first two is a FAIL that names
    it with the guard dynamo logged between the step before it and it; a slow step with nothing logged says so."""
    sys.path.insert(0, str(Path("scripts").resolve()))
    import torch
    from gpu_check.context import Context
    from gpu_check.runs import check_steady_steps

    ctx = Context(torch.device("cpu"), tmp_path, tmp_path, tmp_path, tmp_path, real_assets=False)
    times = {1: 9.0, 2: 3.0, 3: 0.3, 4: 0.31, 5: 0.29, 6: 2.4, 7: 0.3, 8: 1.9, 9: 0.3}
    lines = []
    for step in times:
        if step == 6:
            lines += [
                "V1202 12:00:00 [0/1] [__recompiles] Recompiling function forward in modeling_qwen3.py:250",
                "    triggered by the following guard failure(s):",
                "    - 0/0: tensor 'hidden_states' size mismatch at index 1. expected 1, actual 4093",
            ]
        lines.append(f"12:00:0{step} [rank0] step {step} | loss 1.0 | step_time_s {times[step]}")
    rows = [{"step": step, "step_time_s": t} for step, t in times.items()]
    rows[7] |= {"data_wait_s": 0.02, "gc_s": 1.5}  # step 8: the garbage collector's
    check_steady_steps(ctx, "steady_steps_x", rows, "\n".join(lines))
    (row,) = ctx.rows
    assert row.status == "FAIL", row
    assert "step 6 2.40 s: " in row.figure and "Recompiling function forward" in row.figure, row.figure
    assert "step 8 1.90 s (data_wait_s 0.02 s, gc_s 1.50 s): no recompile logged" in row.figure, row.figure
    assert "step 7" not in row.figure, row.figure
    assert row.detail == "steps that recompiled: [6]"
    ctx.rows.clear()
    steady = [{"step": step, "step_time_s": 0.3 if step > 2 else 5.0} for step in range(1, 10)]
    check_steady_steps(ctx, "steady_steps_x", steady, "")
    assert ctx.rows[0].status == "PASS", ctx.rows
