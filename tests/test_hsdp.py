"""HSDP (parallel.replicate=R): each parameter sharded within groups of ranks / R and its gradients summed across
the R groups. On 4 ranks with world-size-invariant steps, SFT with 2 groups of 2 follows plain FSDP over the 4
ranks to float summation order; a checkpoint written under either layout resumes under the other (and on another
number of ranks) with the uninterrupted run's remaining losses; the run's streamed HF export equals, byte for byte,
its last checkpoint exported by one process (DCP gathering the shards). The gradients of one step against stock
transformers, and the control on the gradient norm, are in test_device_mesh."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from test_export_command import same_files
from test_sft_recipe import read_metrics

import conftest
from conftest import torchrun

pytestmark = pytest.mark.launch  # every test here starts processes

STEPS = 6
TOLERANCE = 1e-5  # relative, per step: the same documents, summed in another order


def launch(out: Path, nproc: int, *overrides: str) -> str:
    """SFT for STEPS steps of 4 microbatches on `nproc` ranks, checkpointed at step 3 and 6: its log."""
    result = conftest.launch(
        torchrun(
            "recipes/sft.py",
            f"output_dir={out}",
            f"max_steps={STEPS}",
            "log_every=1",
            "eval_every=0",
            "save_every=3",
            "data.eval=[]",
            "data.microbatches_per_step=4",
            "data.max_tokens_per_microbatch=512",
            "data.num_workers=0",
            *overrides,
            nproc=nproc,
        )
    )
    return result.stdout + result.stderr


def assert_same_curve(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want), what
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
    assert worst <= TOLERANCE, f"{what}: relative difference {worst:.2e}"


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp")
    assert "mesh: 4 ranks: dp_shard 4, parameters sharded over 4" in launch(out, 4)
    return out


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hsdp")
    assert "mesh: 4 ranks: dp_replicate 2 x dp_shard 2, parameters sharded over 2" in launch(
        out, 4, "parallel.replicate=2"
    )
    return out


def losses(out: Path) -> list[float]:
    return [m["loss"] for m in read_metrics(out)]


def test_two_replica_groups_follow_plain_fsdp(plain, hsdp):
    want = losses(plain)
    assert len(set(want)) == STEPS, "the loss should move"
    assert_same_curve(losses(hsdp), want, "parallel.replicate=2 against FSDP over 4 ranks")


@pytest.mark.parametrize(
    ("source", "nproc", "layout"),
    [("plain", 4, "parallel.replicate=2"), ("hsdp", 2, "parallel.replicate=1")],
    ids=["fsdp to hsdp", "hsdp to fsdp on 2 ranks"],
)
def test_a_checkpoint_resumes_under_the_other_layout(tmp_path, request, plain, source, nproc, layout):
    written = request.getfixturevalue(source)
    out = tmp_path / "resumed"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(written / "checkpoints" / "step_3", out / "checkpoints" / "step_3")
    launch(out, nproc, layout)
    assert [m["step"] for m in read_metrics(out)] == list(range(4, STEPS + 1))
    assert_same_curve(losses(out), losses(plain)[3:], f"{source}'s step 3 resumed with {layout} on {nproc} ranks")


def test_the_streamed_export_equals_the_checkpoint_gathered_on_one_process(tmp_path, hsdp):
    """Rank 0 writes each tensor from the first replica group's shards (the other groups send nothing)."""
    exported = conftest.launch(
        [
            sys.executable,
            "-m",
            "chattune.cli.main",
            "export",
            str(hsdp / "checkpoints" / "step_6"),
            "--to",
            str(tmp_path),
        ],
        check=False,
    )
    assert exported.returncode == 0, exported.stderr[-3000:]
    same_files(tmp_path / "hf", hsdp / "hf")
