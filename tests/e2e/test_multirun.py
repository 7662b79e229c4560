"""Hydra's multirun (`-m`): each job trains into a directory of its own, output_dir/<job number>, one after
another in one process (per rank), its process group and output-directory lock released and made again
between jobs. It used to run every job into the same output_dir, so the second was refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_run_safety import launch

from conftest import SMALL_MODEL

pytestmark = pytest.mark.launch  # every test here starts processes

SWEEP = [
    "max_steps=3",
    "optimizer.lr=1e-3,3e-3",
    "eval_every=0",
    "save_every=0",
    "data.report_records=0",
    "log_every=1",
]


@pytest.mark.parametrize("nproc", [None, 2], ids=["one process", "torchrun, 2 ranks"])
def test_each_multirun_job_trains_into_its_own_directory(tmp_path, nproc):
    out = tmp_path / "sweep"
    # Real torchrun: on the forked ranks (tests/warm_ranks.py) this 2-rank multirun hung in its second job (seen
    # once, its cause not looked into), and Hydra's multirun is a launcher feature: it runs as users run it.
    result = launch("recipes/sft.py", "-m", *SMALL_MODEL, f"output_dir={out}", *SWEEP, nproc=nproc, real_torchrun=True)
    assert result.returncode == 0, result.stderr[-3000:]
    for job, lr in ((0, 1e-3), (1, 3e-3)):
        directory = out / str(job)
        config = (directory / "config.yaml").read_text()
        assert f"lr: {lr}" in config and (directory / "hf" / "model.safetensors.index.json").is_file()
        assert [json.loads(line)["step"] for line in (directory / "metrics.jsonl").read_text().splitlines()] == [
            1,
            2,
            3,
        ]
        assert not (directory / ".chattune.lock").exists()
        assert result.stderr.count(f"chattune: multirun job {job} (") == 1
    assert sorted(p.name for p in out.iterdir()) == ["0", "1", "multirun.yaml"]
    assert not Path("multirun").exists() and not Path("outputs/sft-tiny/0").exists()  # where it was launched from


def test_a_refused_launch_leaves_no_empty_directory(tmp_path):
    """(A run that ends leaves no stale lock: the multirun jobs above.)"""
    fresh = tmp_path / "never_made"
    refused = launch("recipes/sft.py", *SMALL_MODEL, f"output_dir={fresh}", f"resume={tmp_path}", "max_steps=2")
    assert refused.returncode == 1 and "is not a complete chattune checkpoint" in refused.stderr
    assert not fresh.exists(), "a refused launch left its output_dir behind"
