"""The layouts of the mesh, each against plain FSDP over the same 4 ranks with world-size-invariant steps (the
same documents in every step), SFT for 6 steps: HSDP (parallel.replicate=2: each parameter sharded within 2 groups
of 2 and its gradients summed across them), tensor parallelism (parallel.tensor=2, under FSDP over the other 2),
and tensor x context parallelism (2 x 2). Each follows plain FSDP's losses to float summation order; a checkpoint
written under one layout resumes under another (and on another number of ranks) with the uninterrupted run's
remaining losses; a run's HF export equals, byte for byte, its last checkpoint exported by one process (DCP
gathering the shards); a model loaded from an HF directory trains split as it trains whole; DPO split over tp
follows DPO over data ranks, its held-out figures and sample replies included, and so does the reward model; LoRA
split over tp follows LoRA over data ranks. The gradients of one
step against stock transformers, and the controls (wrong reductions caught), are in test_device_mesh."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file
from test_export_command import same_files
from test_sft_recipe import read_metrics

import conftest
from conftest import SMALL_MODEL, torchrun
from reference_runs import MESH_KEYS, MESH_STEPS, RUNS, reference_run

pytestmark = pytest.mark.launch  # every test here starts processes

STEPS = MESH_STEPS
TOLERANCE = 1e-5  # relative, per step: the same documents, summed in another order


def launch(out: Path, nproc: int, *overrides: str, model: tuple[str, ...] = SMALL_MODEL) -> str:
    """The layouts' runs' keys (`reference_runs.MESH_KEYS`: SFT for STEPS steps of 4 microbatches, checkpointed at step
    3 and 6) of `model` (a model directory's run: `model=()` and model.path among the overrides) on `nproc` ranks:
    its log."""
    keys = [key for key in MESH_KEYS if key not in SMALL_MODEL]
    result = conftest.launch(torchrun("recipes/sft.py", *model, *keys, f"output_dir={out}", *overrides, nproc=nproc))
    return result.stdout + result.stderr


def assert_same_curve(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want), what
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
    assert worst <= TOLERANCE, f"{what}: relative difference {worst:.2e}"


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    """Plain FSDP over 4 ranks (tests/reference_runs.py, made once per session)."""
    return reference_run(tmp_path_factory, "mesh-fsdp")


# Each layout's reference run (tests/reference_runs.py): its overrides beyond MESH_KEYS, and the mesh its log names
REFERENCE = {"hsdp": "mesh-hsdp", "tp": "mesh-tp", "tp x cp": "mesh-tp-cp"}
LAYOUTS = {layout: list(RUNS[name].overrides[len(MESH_KEYS) :]) for layout, name in REFERENCE.items()}
MESHES = {layout: RUNS[name].log_holds[0] for layout, name in REFERENCE.items()}


class _Runs(dict):
    """Each layout's run on 4 ranks (its log names the mesh it ran on), launched when a test first reads it."""

    def __init__(self, tmp_path_factory):
        super().__init__()
        self.tmp_path_factory = tmp_path_factory

    def __missing__(self, layout: str) -> Path:
        self[layout] = reference_run(self.tmp_path_factory, REFERENCE[layout])
        return self[layout]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    return _Runs(tmp_path_factory)


def losses(out: Path) -> list[float]:
    return [m["loss"] for m in read_metrics(out)]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_layout_follows_plain_fsdp(plain, runs, layout):
    want = losses(plain)
    assert len(set(want)) == STEPS, "the loss should move"
    assert_same_curve(losses(runs[layout]), want, f"{layout} against FSDP over 4 ranks")


@pytest.mark.parametrize(
    ("source", "nproc", "overrides"),
    [
        ("plain", 4, ["parallel.replicate=2"]),
        ("hsdp", 2, []),
        ("tp", 2, []),
        ("plain", 4, LAYOUTS["tp x cp"]),
    ],
    ids=["fsdp to hsdp", "hsdp to fsdp on 2 ranks", "tp to fsdp on 2 ranks", "fsdp to tp x cp"],
)
def test_a_checkpoint_resumes_under_another_layout(tmp_path, plain, runs, source, nproc, overrides):
    written = plain if source == "plain" else runs[source]
    out = tmp_path / "resumed"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(written / "checkpoints" / "step_3", out / "checkpoints" / "step_3")
    launch(out, nproc, *overrides)
    assert [m["step"] for m in read_metrics(out)] == list(range(4, STEPS + 1))
    assert_same_curve(losses(out), losses(plain)[3:], f"{source}'s step 3 resumed with {overrides} on {nproc} ranks")


@pytest.mark.parametrize("layout", ["hsdp", "tp"])
def test_the_export_equals_the_checkpoint_gathered_on_one_process(tmp_path, runs, layout):
    """HSDP: rank 0 writes each tensor from the first replica group's shards (the other groups send nothing); tp:
    each split tensor gathered whole."""
    exported = conftest.launch(
        [
            sys.executable,
            "-m",
            "chattune.cli.main",
            "export",
            str(runs[layout] / "checkpoints" / "step_6"),
            "--to",
            str(tmp_path),
        ],
        check=False,
    )
    assert exported.returncode == 0, exported.stderr[-3000:]
    same_files(tmp_path / "hf", runs[layout] / "hf")


def test_a_loaded_model_trains_split_as_whole(tmp_path, plain):
    """model.path: the weights of an HF directory loaded into the tp split (each rank reads its slices)."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    loaded = [f"model.path={plain / 'hf'}", "max_steps=2", "save_every=0"]
    launch(whole, 4, *loaded, model=())
    assert MESHES["tp"] in launch(split, 4, *loaded, "parallel.tensor=2", model=())
    assert_same_curve(losses(split), losses(whole), "tp from model.path against FSDP")


@pytest.mark.parametrize("recipe", ["dpo", "reward"])
def test_preference_recipes_train_split_over_tp_as_over_data_ranks(tmp_path, recipe):
    """DPO and the reward model on 2 ranks as one tp group against the same recipe on 2 data ranks: the same
    losses, held-out figures and (DPO) sample replies. DPO's policy and live reference are split, and the ranks of
    a tp group generate the replies together (they split every layer); the reward model's score head is whole on
    every rank, reading the row's gathered tokens."""
    runs = {}
    for tensor in (1, 2):
        runs[tensor] = out = tmp_path / f"tensor{tensor}"
        command = torchrun(
            f"recipes/{recipe}.py",
            *SMALL_MODEL,
            f"output_dir={out}",
            "model.path=null",
            "max_steps=4",
            "log_every=1",
            "eval_every=2",
            "data.num_workers=0",
            "data.microbatches_per_step=4",
            "eval.max_new_tokens=16",  # the tp group's generation: a gloo collective per layer and token, slow on CPU
            f"parallel.tensor={tensor}",
            nproc=2,
        )
        conftest.launch(command)
    assert_same_curve(losses(runs[2]), losses(runs[1]), f"{recipe} split over tp against 2 data ranks")
    held_out = [
        [{k: v for k, v in row.items() if k.startswith("eval")} for row in read_metrics(out, include_start=True)]
        for out in runs.values()
    ]
    assert sum(1 for row in held_out[1] if row) == 3  # at steps 0, 2 and 4
    for split, whole in zip(*held_out):
        assert split.keys() == whole.keys(), (split, whole)
        for key, value in whole.items():
            assert abs(split[key] - value) <= TOLERANCE * max(abs(value), 1.0), (key, split[key], value)
    if recipe == "dpo":  # (a reward model generates nothing)
        samples = [(out / "samples.jsonl").read_text() for out in runs.values()]
        assert samples[0] == samples[1] and samples[0].count("\n") == 12  # 4 replies at steps 0, 2 and 4


def test_lora_trains_split_over_tp_as_over_data_ranks(tmp_path):
    """LoRA (peft=lora) on 2 ranks as one tp group, the adapters split with their base layers, against 2 data ranks:
    the same losses and gradient norms, and the same exported adapter (up to Adam's amplification of float
    rounding over 4 steps, largest where a gradient element is near 0: measured 1.7e-5 of each tensor's norm, an
    element up to 6.6e-4 of the tensor's largest; the schedule's step 1 trains, so lora_B leaves 0 at once)."""
    runs = {}
    for tensor in (1, 2):
        runs[tensor] = out = tmp_path / f"tensor{tensor}"
        command = torchrun(
            "recipes/sft.py",
            *SMALL_MODEL,
            "peft=lora",
            f"output_dir={out}",
            "max_steps=4",
            "log_every=1",
            "eval_every=0",
            "data.num_workers=0",
            "data.microbatches_per_step=4",
            "eval.max_new_tokens=16",  # the tp group's generation: a gloo collective per layer and token, slow on CPU
            f"parallel.tensor={tensor}",
            nproc=2,
        )
        conftest.launch(command)
    split, whole = (read_metrics(out) for out in (runs[2], runs[1]))
    assert_same_curve([m["loss"] for m in split], [m["loss"] for m in whole], "LoRA split over tp")
    assert_same_curve([m["grad_norm"] for m in split], [m["grad_norm"] for m in whole], "its gradient norms")
    adapters = [load_file(out / "adapter" / "adapter_model.safetensors") for out in (runs[2], runs[1])]
    assert sorted(adapters[0]) == sorted(adapters[1]) and adapters[0]
    worst = max((adapters[0][name] - want).norm() / want.norm() for name, want in adapters[1].items())
    print(f"LoRA over tp: the adapters' largest relative difference {worst:.2e}")
    assert worst <= 1e-4, worst
