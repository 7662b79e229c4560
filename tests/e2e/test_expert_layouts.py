"""Expert parallelism (parallel.expert) in the recipes, against plain FSDP over the same 4 ranks with
world-size-invariant steps (the same documents in every step): a tiny Qwen3-MoE (4 experts per layer, top 2) trained
with SFT for 4 steps with its experts split over 4 ranks, over 2 under HSDP (the experts' groups replicated; with
activation checkpointing), and over 2 with context parallelism (the rows split over the 2 ranks of each context
group). Each follows plain FSDP's losses to float summation order and logs the same routing; a checkpoint resumes across layouts (ep 4 to no ep on 2 ranks, no ep to ep 2);
the run's HF export, the experts gathered into the stock stacked layout, equals its last checkpoint exported by one
process; DPO with its reference and sample replies (synced generation: every forward exchanges tokens) follows DPO
over data ranks. That the split layer equals stock transformers per family, gradients included, is
tests/distributed/test_expert_parallel.py."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from test_export_command import same_files
from test_mesh_layouts import TOLERANCE, assert_same_curve, losses
from test_sft_recipe import read_metrics

import conftest
from conftest import SMALL_MODEL, made_once, torchrun

pytestmark = pytest.mark.launch  # every test here starts processes

MOE = (
    "model.config._target_=transformers.Qwen3MoeConfig",
    "+model.config.num_experts=4",
    "+model.config.num_experts_per_tok=2",
    "+model.config.moe_intermediate_size=32",
    "+model.config.head_dim=16",
)
KEYS = (
    *SMALL_MODEL,
    *MOE,
    "max_steps=4",
    "log_every=1",
    "eval_every=0",
    "save_every=2",
    "data.eval=[]",
    "data.microbatches_per_step=4",
    "data.max_tokens_per_microbatch=512",
    "data.num_workers=0",
)
# Each layout's overrides beyond KEYS and the mesh its start-up line names
LAYOUTS = {
    "fsdp": ((), "mesh: 4 ranks: dp_shard 4, parameters sharded over 4;"),
    "ep 4": (("parallel.expert=4",), "parameters sharded over 4; experts split over ep 4 (sharded over 1)"),
    "ep 2 x hsdp": (  # with activation checkpointing: the recomputed forwards exchange again, and are not counted
        ("parallel.expert=2", "parallel.replicate=2", "model.fsdp.activation_checkpointing=true"),
        "dp_replicate 2 x dp_shard 2, parameters sharded over 2; experts split over ep 2 (sharded over 1)",
    ),
    "ep 2 x cp": (  # rows of 2 x 256 tokens: the same rows as plain FSDP's 512
        ("parallel.expert=2", "parallel.context=2", "data.max_tokens_per_microbatch=256"),
        "dp_shard 2 x cp 2, parameters sharded over 4; experts split over ep 2 (sharded over 2)",
    ),
}


def launch(out: Path, nproc: int, *overrides: str) -> str:
    result = conftest.launch(torchrun("recipes/sft.py", *KEYS, f"output_dir={out}", *overrides, nproc=nproc))
    return result.stdout + result.stderr


def run(tmp_path_factory, layout: str) -> Path:
    """LAYOUTS[layout]'s run on 4 ranks (made once per session), its log checked for the mesh."""
    overrides, mesh = LAYOUTS[layout]

    def make(directory: Path) -> None:
        log = launch(directory / "run", 4, *overrides)
        assert mesh in log, log[-3000:]

    name = "experts-" + layout.replace(" ", "")
    return made_once(tmp_path_factory, name, make) / "run"


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "fsdp"])
def test_each_expert_layout_follows_plain_fsdp(tmp_path_factory, layout):
    want = losses(run(tmp_path_factory, "fsdp"))
    assert len(set(want)) == 4, "the loss should move"
    assert_same_curve(losses(run(tmp_path_factory, layout)), want, f"{layout} against FSDP over 4 ranks")


def test_the_routing_is_logged_the_same_on_every_expert_layout(tmp_path_factory):
    """experts_routed: every token's top 2 choices, once per step (all_tokens x 2: the recomputed forwards of
    activation checkpointing left out; under context parallelism a row's padding to a multiple of its 2 slices too,
    at most a token per microbatch); experts_imbalance: the busiest expert's pairs over the mean, the same routing
    on every layout of the same rows."""
    logged = {layout: read_metrics(run(tmp_path_factory, layout)) for layout in LAYOUTS}
    assert "experts_imbalance" not in logged.pop("fsdp")[0]  # (without split experts: not counted yet)
    for layout, rows in logged.items():
        for row in rows:
            padding = row["experts_routed"] - 2 * round(row["all_tokens_per_sec"] * row["step_time_s"])
            assert padding == 0 or (layout == "ep 2 x cp" and 0 < padding <= 2 * 4), (layout, padding, row)
            assert 1 < row["experts_imbalance_mean"] <= row["experts_imbalance"] <= 4, (layout, row)
    for row, want in zip(logged["ep 2 x hsdp"], logged["ep 4"]):
        assert abs(row["experts_imbalance"] - want["experts_imbalance"]) <= 1e-12, (row, want)
        assert row["experts_imbalance_mean"] == pytest.approx(want["experts_imbalance_mean"], abs=1e-12)


@pytest.mark.parametrize(
    ("source", "nproc", "overrides"),
    [("ep 4", 2, ()), ("fsdp", 4, ("parallel.expert=2",))],
    ids=["ep 4 to fsdp on 2 ranks", "fsdp to ep 2"],
)
def test_a_checkpoint_resumes_across_expert_layouts(tmp_path, tmp_path_factory, source, nproc, overrides):
    out = tmp_path / "resumed"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(run(tmp_path_factory, source) / "checkpoints" / "step_2", out / "checkpoints" / "step_2")
    log = launch(out, nproc, *overrides)
    assert "resuming despite a change: config parallel.expert" in log
    assert [m["step"] for m in read_metrics(out)] == [3, 4]
    want = losses(run(tmp_path_factory, "fsdp"))[2:]
    assert_same_curve(losses(out), want, f"{source}'s step 2 resumed with {list(overrides)} on {nproc} ranks")


def test_the_export_gathers_the_experts_into_the_stock_layout(tmp_path, tmp_path_factory):
    """The ep 4 run's HF export (each rank's experts gathered into the stacked (num_experts, ...) tensors) equals,
    byte for byte, its last checkpoint exported by one process (DCP reading the expert shards)."""
    written = run(tmp_path_factory, "ep 4")
    command = [sys.executable, "-m", "chattune.cli.main", "export", str(written / "checkpoints" / "step_4")]
    exported = conftest.launch([*command, "--to", str(tmp_path)], check=False)
    assert exported.returncode == 0, exported.stderr[-3000:]
    same_files(tmp_path / "hf", written / "hf")


def test_dpo_with_split_experts_follows_dpo_over_data_ranks(tmp_path):
    """DPO on 2 ranks, the policy's and the live reference's experts split over both, against DPO over 2 data ranks:
    the same losses, held-out figures and sample replies (the replies generated with every forward exchanging
    tokens between the ranks, in step)."""
    runs = {}
    for expert in (1, 2):
        runs[expert] = out = tmp_path / f"expert{expert}"
        command = torchrun(
            "recipes/dpo.py",
            *SMALL_MODEL,
            *MOE,
            f"output_dir={out}",
            "model.path=null",
            "max_steps=2",
            "log_every=1",
            "eval_every=2",
            "data.num_workers=0",
            "data.microbatches_per_step=4",
            "eval.max_new_tokens=16",
            f"parallel.expert={expert}",
            nproc=2,
        )
        conftest.launch(command)
    assert_same_curve(losses(runs[2]), losses(runs[1]), "DPO with split experts against 2 data ranks")
    held_out = [
        [{k: v for k, v in row.items() if k.startswith("eval")} for row in read_metrics(out, include_start=True)]
        for out in runs.values()
    ]
    assert sum(1 for row in held_out[0] if row) == 2  # at steps 0 and 2
    for split, whole in zip(*held_out):
        assert split.keys() == whole.keys(), (split, whole)
        for key, value in whole.items():
            assert abs(split[key] - value) <= TOLERANCE * max(abs(value), 1.0), (key, split[key], value)
    samples = [(out / "samples.jsonl").read_text() for out in runs.values()]
    assert samples[0] == samples[1] and samples[0].count("\n") == 8  # 4 replies at steps 0 and 2


def test_a_loaded_model_trains_with_split_experts_as_whole(tmp_path, tmp_path_factory):
    """model.path: an HF directory's stacked experts loaded into the split (each rank reads its experts' rows of
    its FSDP2 shard), on 2 ranks with and without parallel.expert=2."""
    loaded = [f"model.path={run(tmp_path_factory, 'fsdp') / 'hf'}", "max_steps=2", "save_every=0"]
    curves = {}
    for expert in (1, 2):
        out = tmp_path / f"expert{expert}"
        command = torchrun("recipes/sft.py", *KEYS[len(SMALL_MODEL) + len(MOE) :], *loaded, f"output_dir={out}")
        conftest.launch([*command, f"parallel.expert={expert}"])
        curves[expert] = losses(out)
    assert_same_curve(curves[2], curves[1], "split experts from model.path against FSDP")
