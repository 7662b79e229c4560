"""`chattune export CHECKPOINT [--to DIR]` (chattune.cli.export): a checkpoint's model written as the end of its run
writes it. Checked against the run's own end-of-run export, byte for byte, from a 2-rank checkpoint; it prints no
training memory table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_run_safety import SMALL, chats

import conftest

pytestmark = pytest.mark.launch


def export(*args: str) -> subprocess.CompletedProcess:
    return conftest.launch([sys.executable, "-m", "chattune.cli.main", "export", *map(str, args)], check=False)


def same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_a_checkpoint_exports_as_its_run_ended_and_loads_in_stock_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    overrides = [f"output_dir={out}", f"data.train=[{chats(tmp_path)}]", *SMALL]  # checkpoints at 2, 4, 6
    conftest.launch(conftest.torchrun("recipes/sft.py", *overrides, nproc=2))

    last = export(out / "checkpoints" / "step_6", "--to", tmp_path / "six")  # written by 2 ranks, read by one
    assert last.returncode == 0, last.stderr[-3000:]
    same_files(tmp_path / "six" / "hf", out / "hf")
    assert "memory per rank" not in last.stdout + last.stderr  # an export is no training run: no training table

    newest = export(out)  # a run's output_dir: its newest checkpoint, into OUTPUT_DIR/exports/step_N
    assert newest.returncode == 0, newest.stderr[-3000:]
    same_files(out / "exports" / "step_6" / "hf", out / "hf")
    assert f"chattune export: hf: {out}/exports/step_6/hf" in newest.stderr
    assert newest.stderr.splitlines()[-1] == f"talk to it: chattune chat {out}/exports/step_6/hf"

    (tmp_path / "chats.jsonl").unlink()  # the data, which an export does not read, may be gone
    earlier = export(out / "checkpoints" / "step_2", "--to", tmp_path / "two")
    assert earlier.returncode == 0, earlier.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "two" / "hf")
    final = AutoModelForCausalLM.from_pretrained(out / "hf")
    assert any(
        not (a == b).all() for a, b in zip(model.state_dict().values(), final.state_dict().values(), strict=True)
    ), "step 2's weights are step 6's"

    refused = export(tmp_path)  # neither a checkpoint nor an output_dir with checkpoints/
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert f"chattune export: error: {tmp_path} is neither a checkpoint" in refused.stderr
    (out / "config.yaml").rename(out / "moved.yaml")
    refused = export(out / "checkpoints" / "step_4")
    assert refused.returncode == 1 and f"chattune export: error: {out}/config.yaml is missing" in refused.stderr
