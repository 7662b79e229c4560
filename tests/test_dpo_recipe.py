"""End to end: SFT, then DPO from its output on the demo preference pairs, with torchrun on 2 ranks."""

from __future__ import annotations

import sys

from conftest import free_port
from test_sft_recipe import read_metrics, run

DPO_KEYS = {"loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
            "logps/rejected", "num_pairs", "num_tokens", "tokens_per_sec", "lr", "grad_norm"}


def test_sft_then_dpo_raises_held_out_preference_accuracy(tmp_path):
    sft = tmp_path / "sft"
    run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         "recipes/sft.py", f"output_dir={sft}", "max_steps=60", "save_every=0", "eval_every=0", "data.report_records=0"])
    dpo = tmp_path / "dpo"
    run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         "recipes/dpo.py", f"output_dir={dpo}", f"model.path={sft / 'hf'}", "max_steps=30", "eval_every=30",
         "save_every=15", "log_every=5", "data.report_records=0"])
    lines = read_metrics(dpo, include_start=True)
    start, metrics = lines[0], lines[1:]
    assert start["step"] == 0 and start["eval_num_pairs"] == 200
    # At the start the policy is its own reference: every implicit reward is 0, no pair is preferred.
    assert start["eval_rewards/accuracies"] == 0.0 and abs(start["eval_rewards/margins"]) < 1e-6
    assert all(DPO_KEYS <= m.keys() for m in metrics)
    assert metrics[-1]["eval_rewards/accuracies"] >= 0.6 and metrics[-1]["eval_rewards/margins"] > 0.1
    assert metrics[-1]["eval_loss"] < start["eval_loss"] - 0.05
    assert (dpo / "hf" / "model.safetensors").is_file() and (dpo / "checkpoints" / "step_30" / "chattune.json").is_file()
