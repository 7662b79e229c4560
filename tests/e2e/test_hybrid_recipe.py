"""A hybrid model end to end on 2 ranks: a tiny Qwen3.5-shaped model (gated delta rule + attention) trains with
SFT (activation checkpointing on, the mixers per document), resumes bit for bit after stop_after_step, exports a
directory stock transformers loads and generates from; DPO with LoRA on the mixers' projections starts from it."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_resume import assert_same_weights, losses
from test_sft_recipe import read_metrics
from transformers import AutoModelForCausalLM, AutoTokenizer

import conftest
from conftest import launch

pytestmark = pytest.mark.launch  # every test here starts processes

QWEN3_5 = [
    "model.config._target_=transformers.Qwen3_5TextConfig",
    "model.config.hidden_size=64",
    "model.config.intermediate_size=128",
    "model.config.num_hidden_layers=2",
    "model.config.num_attention_heads=4",
    "+model.config.head_dim=16",
    "+model.config.layer_types=[linear_attention,full_attention]",
    "+model.config.linear_key_head_dim=16",
    "+model.config.linear_value_head_dim=16",
    "+model.config.linear_num_key_heads=2",
    "+model.config.linear_num_value_heads=4",
]


def torchrun(recipe: str, out, *overrides: str):
    return launch(
        conftest.torchrun(
            recipe,
            f"output_dir={out}",
            "log_every=1",
            "eval.samples=0",
            *overrides,
            nproc=2,
        )
    )


def sft(out, *overrides: str):
    return torchrun(
        "recipes/sft.py",
        out,
        "max_steps=6",
        "save_every=3",
        "eval_every=0",
        "optimizer.lr=3e-3",
        "scheduler.num_warmup_steps=0",
        "data.max_tokens_per_microbatch=512",
        "data.buffer_records=16",
        "model.fsdp.activation_checkpointing=true",
        *QWEN3_5,
        *overrides,
    )


def test_a_qwen3_5_model_trains_resumes_exactly_exports_and_takes_dpo_with_lora(tmp_path):
    straight = tmp_path / "straight"
    result = sft(straight)
    assert "sequence mixers: gated delta rule: per document" in result.stdout + result.stderr
    metrics = read_metrics(straight)
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 0.2, [m["loss"] for m in metrics]

    resumed = tmp_path / "resumed"
    sft(resumed, "stop_after_step=3")
    sft(resumed)
    assert losses(resumed) == losses(straight)
    assert_same_weights(resumed, straight)

    model = AutoModelForCausalLM.from_pretrained(straight / "hf")  # stock transformers
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    tokenizer = AutoTokenizer.from_pretrained(straight / "hf")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12 + 7?"}], add_generation_prompt=True, return_tensors="pt"
    )
    with torch.no_grad():
        generated = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert generated.shape[1] > prompt["input_ids"].shape[1]

    dpo = tmp_path / "dpo"
    torchrun(
        "recipes/dpo.py",
        dpo,
        f"model.path={straight / 'hf'}",
        "peft=lora",
        "max_steps=3",
        "save_every=0",
        "eval_every=0",
        "data.max_tokens_per_microbatch=1024",
        "peft.target_modules=[in_proj_qkv,in_proj_z,out_proj,q_proj,v_proj]",
    )
    steps = read_metrics(dpo)
    assert [m["step"] for m in steps] == [1, 2, 3] and all(math.isfinite(m["loss"]) for m in steps)
    adapter = json.loads((dpo / "adapter" / "adapter_config.json").read_text())
    assert {"in_proj_qkv", "in_proj_z", "out_proj"} <= set(adapter["target_modules"])


def test_a_qwen3_5_models_steps_do_not_depend_on_the_number_of_ranks(tmp_path):
    """data.microbatches_per_step: 4 microbatches a step on 1 rank and on 2 give the same losses (to summation
    order): the mixers' per-document handling is a property of each row, whichever rank holds it."""
    curves = []
    for nproc in (1, 2):
        out = tmp_path / f"ranks{nproc}"
        launch(
            conftest.torchrun(
                "recipes/sft.py",
                f"output_dir={out}",
                "max_steps=5",
                "log_every=1",
                "eval_every=0",
                "save_every=0",
                "eval.samples=0",
                "data.eval=[]",
                "data.microbatches_per_step=4",
                "data.max_tokens_per_microbatch=512",
                "data.buffer_records=8",
                "data.report_records=0",
                *QWEN3_5,
                nproc=nproc,
            )
        )
        curves.append([m["loss"] for m in read_metrics(out)])
    assert len(curves[0]) == 5
    assert all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(*curves)), curves
