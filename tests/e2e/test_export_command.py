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
from chattune.cli.export import export_checkpoint
from chattune.errors import UserError

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
    conftest.launch(conftest.torchrun("recipes/sft.py", *conftest.SMALL_MODEL, *overrides, nproc=2))
    (tmp_path / "chats.jsonl").unlink()  # the data, which an export does not read, may be gone

    newest = export(out)  # a run's output_dir: its newest checkpoint (written by 2 ranks, read by one)
    assert newest.returncode == 0, newest.stderr[-3000:]
    same_files(out / "exports" / "step_6" / "hf", out / "hf")  # into OUTPUT_DIR/exports/step_N
    assert f"chattune export: hf: {out}/exports/step_6/hf" in newest.stderr
    assert newest.stderr.splitlines()[-1] == f"talk to it: chattune chat {out}/exports/step_6/hf"
    assert "memory per rank" not in newest.stdout + newest.stderr  # an export is no training run: no training table

    earlier = export(out / "checkpoints" / "step_2", "--to", tmp_path / "two")
    assert earlier.returncode == 0, earlier.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "two" / "hf")
    final = AutoModelForCausalLM.from_pretrained(out / "hf")
    assert any(
        not (a == b).all() for a, b in zip(model.state_dict().values(), final.state_dict().values(), strict=True)
    ), "step 2's weights are step 6's"

    # What cannot be exported is said before anything is built (the command prints it as its one error line).
    with pytest.raises(UserError, match=f"^{tmp_path} is neither a checkpoint"):
        export_checkpoint(tmp_path)  # neither a checkpoint nor an output_dir with checkpoints/
    (out / "config.yaml").rename(out / "moved.yaml")
    with pytest.raises(UserError, match=f"^{out}/config.yaml is missing"):
        export_checkpoint(out / "checkpoints" / "step_4")
