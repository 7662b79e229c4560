"""End to end: the SFT recipe under torchrun (2 ranks) and as a plain single process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from test_optimizer import warmup_cosine_rates
from transformers import AutoModelForCausalLM, AutoTokenizer

from chattune.config.paths import DEMO_ASSETS
from conftest import PROJECT_ROOT, SMALL_MODEL, free_port, launch, torchrun

pytestmark = pytest.mark.launch  # every test here starts processes

METRIC_KEYS = {"step", "loss", "num_tokens", "tokens_per_sec", "lr", "grad_norm", "step_time_s"}


def read_metrics(output_dir, include_start: bool = False) -> list[dict]:
    """metrics.jsonl; the step-0 line (held-out metrics before training) only when asked for."""
    lines = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if include_start or m["step"] > 0]


def test_two_rank_torchrun_trains_and_writes_a_loadable_hf_model(tmp_path):
    out = tmp_path / "run"
    launch(
        torchrun(
            "recipes/sft.py",
            *SMALL_MODEL,
            f"output_dir={out}",
            "max_steps=40",
            "seed=3",
            "grad_accum_steps=2",
            "data.max_tokens_per_microbatch=1024",
            "optimizer.lr=3e-3",
            "log_every=5",
            "save_every=20",
            "eval_every=40",
            nproc=2,
        ),
        real_torchrun=True,  # this test is the README's own torchrun launch
    )
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == list(range(5, 41, 5))
    assert all(METRIC_KEYS <= m.keys() for m in metrics)
    assert all(m["num_tokens"] > 0 and m["tokens_per_sec"] > 0 for m in metrics)
    # sft/tiny's schedule, step k at k: step 5 of 10 warm-up steps at half the rate, the last at the cosine's end
    assert [m["lr"] for m in metrics] == pytest.approx(warmup_cosine_rates(3e-3, 10, 40)[4::5], abs=1e-12)
    first, last = metrics[0]["loss"], metrics[-1]["loss"]
    assert last < 0.6 * first, f"loss did not fall clearly: {first:.3f} -> {last:.3f}"
    assert metrics[-1]["eval_loss"] < first
    start = read_metrics(out, include_start=True)[0]
    assert start["step"] == 0 and metrics[-1]["eval_loss"] < 0.6 * start["eval_loss"]

    for step in (20, 40):
        checkpoint = out / "checkpoints" / f"step_{step}"
        assert (checkpoint / ".metadata").is_file()
        assert {p.name for p in checkpoint.glob("train_state_rank*.pt")} == {
            "train_state_rank0.pt",
            "train_state_rank1.pt",
        }
    assert (out / "config.yaml").is_file()

    hf_dir = out / "hf"
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    assert tokenizer.chat_template and list(hf_dir.glob("*.safetensors"))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12 + 7?"}], add_generation_prompt=True, return_tensors="pt"
    )
    with torch.no_grad():
        generated = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    new_tokens = generated[0, prompt["input_ids"].shape[1] :]
    assert len(new_tokens) > 0 and tokenizer.decode(new_tokens, skip_special_tokens=True).strip()


def test_local_model_directory_with_activation_checkpointing(tmp_path):
    """The real-model path: a local HF directory (weights + tokenizer) fine-tuned via sft/local_model."""
    from conftest import demo_tokenizer, tiny_model

    model_dir = tmp_path / "base_model"
    base = tiny_model(seed=5)
    base.config._attn_implementation = "sdpa"  # as a downloaded model would carry
    base.save_pretrained(model_dir)
    demo_tokenizer().save_pretrained(model_dir)
    out = tmp_path / "finetuned"
    launch(
        [
            sys.executable,
            "recipes/sft.py",
            "--config-name",
            "sft/local_model",
            f"model.path={model_dir}",
            f"data.train=[{DEMO_ASSETS / 'chat_train.jsonl'}]",  # (sft/local_model trains only the data it is given)
            f"output_dir={out}",
            "max_steps=4",
            "log_every=1",
            "save_every=0",
            "optimizer.lr=1e-3",
            "model.fsdp.param_dtype=float32",
            "model.fsdp.activation_checkpointing=true",
            "data.max_tokens_per_microbatch=1024",
            "data.eval=[]",
        ]
    )
    metrics = read_metrics(out)
    assert len(metrics) == 4 and all(m["grad_norm"] > 0 for m in metrics)
    before = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    after = AutoModelForCausalLM.from_pretrained(out / "hf").state_dict()
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before), "fine-tuning changed no weight"


def test_copied_recipe_runs_with_config_path(tmp_path):
    """README's copy-and-edit flow: a recipe copied elsewhere finds the configs through --config-path."""
    import shutil

    copied = tmp_path / "my_sft.py"
    shutil.copy(PROJECT_ROOT / "recipes" / "sft.py", copied)
    out = tmp_path / "copied_run"
    launch(
        [
            sys.executable,
            str(copied),
            "--config-path",
            str(PROJECT_ROOT / "configs"),
            "--config-name",
            "sft/tiny",
            f"output_dir={out}",
            "max_steps=2",
            "log_every=1",
            "save_every=0",
            "eval_every=0",
        ]
    )
    assert [m["step"] for m in read_metrics(out)] == [1, 2]


def test_a_bad_record_on_one_rank_stops_the_whole_job_with_its_name(tmp_path):
    """Never a hang: the rank that meets the record fails with its name, and torchrun ends the others."""
    lines = (PROJECT_ROOT / "chattune" / "assets" / "demo" / "chat_train.jsonl").read_text().splitlines()[:40]
    lines[17] = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}]})
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(lines) + "\n")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        "recipes/sft.py",
        *SMALL_MODEL,
        f"output_dir={tmp_path / 'run'}",
        "max_steps=50",
        f"data.train=[{data}]",
        "data.eval=[]",
        "save_every=0",
        "data.max_tokens_per_microbatch=512",
    ]
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode != 0
    assert "chats.jsonl record 18 (line 18): message 1 has role 'wizard'" in result.stdout + result.stderr


def test_losses_do_not_depend_on_loader_workers_or_eval_data(tmp_path):
    """Tokenizing in worker processes, or configuring held-out data, changes nothing the model sees
    (a DataLoader drawing from the global RNG would change the model's random init)."""
    losses = []
    for name, extra in (("plain", ["data.num_workers=0"]), ("workers", ["data.num_workers=2", "data.eval=[]"])):
        out = tmp_path / name
        launch(
            [
                sys.executable,
                "recipes/sft.py",
                *SMALL_MODEL,
                f"output_dir={out}",
                "max_steps=3",
                "log_every=1",
                "save_every=0",
                "eval_every=0",
                "data.max_tokens_per_microbatch=512",
                *extra,
            ]
        )
        losses.append([m["loss"] for m in read_metrics(out)])
    assert losses[0] == losses[1]
