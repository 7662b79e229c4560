"""Float8 linear layers (`model.fp8`, chattune.model.float8) on 2 real ranks, emulated on the CPU: 3 steps within the
documented tolerance of the bf16 step, the decoder's linear layers (and only those) converted, the output layer and
loss left in bf16/fp32; the refusals that name their remedy."""

from __future__ import annotations

import pytest
import torch
from test_resume import read_metrics

from conftest import exported_weights, launch, mesh_dims, torchrun

pytest.importorskip("torchao.float8")

RUN = (
    "max_steps=3",
    "log_every=1",
    "eval_every=0",
    "eval.samples=0",
    "save_every=0",
    "model.fsdp.param_dtype=bfloat16",
)
# The documented tolerance (docs/memory.md, "Float8 linear layers"): each step's loss within 0.5% of the bf16 step's, its
# gradient norm within 5%. Measured (tiny model, 2 ranks, weights gathered in float8): 0.05% and 1.4% at most.
LOSS_TOLERANCE, NORM_TOLERANCE = 0.005, 0.05


@pytest.mark.launch
def test_emulated_float8_follows_the_bf16_step_within_the_documented_tolerance(tmp_path):
    # sft/tiny's own model: the documented figures were measured on it
    bf16 = launch(torchrun("sft", f"output_dir={tmp_path / 'bf16'}", *RUN), small_model=False)
    fp8 = launch(torchrun("sft", f"output_dir={tmp_path / 'fp8'}", *RUN, "model.fp8=emulate"), small_model=False)
    # the tiny model's 4 decoder layers, 7 linear layers each; the output layer is not among them
    assert "model.fp8=emulate: 28 linear layers of the decoder in float8 (torchao)" in fp8.stdout
    assert "; levers: float8 linear layers (emulate)" in fp8.stdout and "levers" not in bf16.stdout
    want, got = read_metrics(tmp_path / "bf16"), read_metrics(tmp_path / "fp8")
    assert [m["step"] for m in got] == [m["step"] for m in want] == [1, 2, 3]
    for g, w in zip(got, want):
        print(
            f"step {w['step']}: loss {g['loss']:.5f} vs {w['loss']:.5f}, norm {g['grad_norm']:.4f} vs {w['grad_norm']:.4f}"
        )
        assert g["loss"] == pytest.approx(w["loss"], rel=LOSS_TOLERANCE)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=NORM_TOLERANCE)
        assert g["loss"] != w["loss"]  # float8 rounding did run
    # the export: the same tensor names as a bf16 run's (Float8Linear keeps nn.Linear's parameters)
    assert exported_weights(tmp_path / "fp8" / "hf").keys() == exported_weights(tmp_path / "bf16" / "hf").keys()


def test_tensorwise_weights_are_gathered_in_float8(one_rank_group):
    """FSDP2 gathers each converted weight's shard already cast to float8 (torchao's `fsdp_pre_all_gather`), one
    byte per element instead of bf16's two; the output layer's stays in the compute dtype."""
    from unittest import mock

    import torch
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from chattune.data.packing import collate_packed
    from chattune.model.causal_lm import PackedCausalLM
    from chattune.model.float8 import convert_linear_layers
    from chattune.model.fsdp import decoder_layers, shard_model
    from conftest import demo_documents, tiny_model

    model = PackedCausalLM(tiny_model(hidden_size=64, intermediate_size=128))
    converted = convert_linear_layers(decoder_layers(model), "emulate")
    model = shard_model(model, mesh_dims(), param_dtype="bfloat16")
    gathered = []
    original = WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather

    def recording(self, mesh):  # (torchao's signature: FSDP2 reads it)
        inputs, metadata = original(self, mesh)
        gathered.extend(t.dtype for t in inputs)
        return inputs, metadata

    with mock.patch.object(WeightWithDynamicFloat8CastTensor, "fsdp_pre_all_gather", recording):
        model(collate_packed(demo_documents(2)))
    assert len(gathered) == converted and set(gathered) == {torch.float8_e4m3fn}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA plans the GPU")
def test_float8_is_checked_as_on_a_planned_gpu_and_refused_on_the_cpu():
    """`chattune validate sft/tiny model.fp8=rowwise --device-memory 24GiB` on a machine without CUDA plans a GPU: the
    setting is accepted (the GPU's compute capability is checked at launch, on it) and the plan printed, where torch
    without CUDA raised "Torch not compiled with CUDA enabled"; a CPU run (device=cpu) is refused with the remedy."""
    from chattune.launch.memory_plan import MemoryPlan
    from chattune.launch.validate import run_validate
    from chattune.model.memory import parse_size
    from conftest import PROJECT_ROOT

    configs, planned = PROJECT_ROOT / "configs", MemoryPlan(parse_size("24GiB"))
    report, ok = run_validate("sft/tiny", ["model.fp8=rowwise"], configs, memory=planned)
    assert ok and "memory per rank, estimated on a GPU" in report, report
    report, ok = run_validate("sft/tiny", ["model.fp8=rowwise", "device=cpu"], configs, memory=planned)
    assert not ok
    assert (
        "model.fp8: rowwise needs a GPU with float8 matmuls; on the CPU, model.fp8=emulate checks the numerics"
        in report
    )
