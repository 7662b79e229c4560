"""What a CUDA run sets up and says at start-up, checked on the CPU (issue 26, items 7 and 8): the allocator's
expandable segments unless the user configured it, and one line naming the attention path, the loss and
whether the layers are compiled, with a warning for the slow fp32 path. scripts/gpu_check runs them on a GPU."""

from __future__ import annotations

import logging

import pytest
import torch

from chattune.distributed import ParallelDims, default_cuda_allocator
from chattune.model import build
from chattune.model.causal_lm import PackedCausalLM
from chattune.parallel.fsdp import Placement
from conftest import tiny_model


def test_expandable_segments_unless_the_user_configured_the_allocator():
    environ: dict[str, str] = {}
    default_cuda_allocator(environ)
    assert environ == {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):  # torch's name and the older one users set
        theirs = {name: "max_split_size_mb:512"}
        default_cuda_allocator(theirs)
        assert theirs == {name: "max_split_size_mb:512"}


def _model(compute_dtype: str, loss: str = "cut_cross_entropy") -> PackedCausalLM:
    return PackedCausalLM(
        tiny_model(), loss_implementation=loss, tf32_head=loss == "chunked" and compute_dtype != "float32"
    )


def _placement(compute_dtype: str, device: str = "cuda", compiled: bool = True) -> Placement:
    """What `shard_model` would record on `device` (the model is not sharded: describe_compute reads no shard)."""
    return Placement(ParallelDims.one_rank(torch.device(device)), compiled, compute_dtype)


@pytest.fixture(autouse=True)
def fresh_log(monkeypatch):
    monkeypatch.setattr(build, "_described", set())


def test_the_start_up_line_names_attention_loss_and_compile(caplog):
    with caplog.at_level(logging.INFO, logger="chattune.model.build"):
        build.describe_compute(_model("bfloat16"), _placement("bfloat16"))
        build.describe_compute(_model("bfloat16"), _placement("bfloat16"))  # a DPO reference built alike: said once
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert "attention: torch varlen_attn" in lines[0] or "attention: flash-attn varlen" in lines[0]
    assert "loss: cut-cross-entropy" in lines[0] and "decoder layers compiled" in lines[0]
    assert all(r.levelno == logging.INFO for r in caplog.records)

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="chattune.model.build"):
        build.describe_compute(_model("bfloat16", loss="chunked"), _placement("bfloat16", compiled=False))
    assert "loss: chunked fp32 head (its matmuls in TF32)" in caplog.text and "not compiled" in caplog.text


def test_fp32_compute_on_cuda_is_a_warning(caplog):
    with caplog.at_level(logging.INFO, logger="chattune.model.build"):
        build.describe_compute(_model("float32", loss="chunked"), _placement("float32", compiled=False))
        build.describe_compute(
            _model("float32", loss="chunked"), _placement("float32", "cpu", compiled=False)
        )  # the CPU's own path
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "param_dtype=float32 on CUDA" in warnings[0]
    assert "attention: per-document SDPA" in caplog.text


@pytest.mark.parametrize("agreed", [True, False])
def test_the_start_up_line_says_which_attention_rows_with_shared_prompts_take(agreed, caplog, monkeypatch):
    from chattune.model.packed import kernels

    monkeypatch.setattr(kernels, "_shared_varlen", agreed)  # what `probe_shared_varlen` settled on the device
    with caplog.at_level(logging.INFO, logger="chattune.model.build"):
        build.describe_compute(_model("bfloat16"), _placement("bfloat16"), shared_prompts=True)
    taken = "the varlen kernel with each segment's prompt keys" if agreed else "per-segment SDPA with each prompt's"
    assert f"(rows with shared prompts: {taken}" in caplog.text
