"""scripts/gpu_check.py, the one command that verifies the GPU path, run as a smoke test in its CPU mode: a
tiny model, chattune's demo tokenizer and chats. Every check that can run on the CPU runs and passes; the
CUDA-only ones say SKIP; the JSON and the markdown table are written."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import PROJECT_ROOT

CPU_CHECKS = {"packed_vs_hf", "leak_control", "cce_vs_chunked", "tf32_scope", "compile_vs_eager", "recompiles",
              "dpo_reference_memory", "throughput_tiny_sft", "resume_exact", "export_masters",
              "export_after_eval"}
CUDA_ONLY = {"host_syncs", "throughput_tiny_qlora"}


def test_the_gpu_check_runs_its_cpu_parts(tmp_path):
    done = subprocess.run([sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--out", str(tmp_path)],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    status = {row["check"]: row["status"] for row in report["rows"]}
    assert {name for name, result in status.items() if result == "PASS"} == CPU_CHECKS, status
    assert {name for name, result in status.items() if result == "SKIP"} == CUDA_ONLY, status
    table = (tmp_path / "gpu_check.md").read_text()
    assert all(f"| {name} | PASS |" in table for name in CPU_CHECKS)
    assert report["environment"]["device"] == "cpu"
