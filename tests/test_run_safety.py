"""Nothing lost, nothing silent, no run damaging another: recipe-level checks with real torchrun processes
(2 ranks, gloo) for the data-loss and crash bugs a new user hit, each reproduced first."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from chattune.config import DEMO_ASSETS
from conftest import free_port
from test_sft_recipe import run


def torchrun(nproc: int, recipe: str, *overrides: str, **kwargs):
    return run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                "--master_port", str(free_port()), recipe, *overrides], **kwargs)


def test_dpo_on_two_ranks_counts_a_pair_with_identical_replies_on_one_rank(tmp_path):
    """The skip counters of both ranks are all-reduced: a reason seen on one rank only used to give the
    ranks different keys, and gloo aborted the whole run (SIGABRT) at the data report."""
    pairs = [json.loads(line) for line in (DEMO_ASSETS / "preference_train.jsonl").read_text().splitlines()[:30]]
    pairs[7]["rejected"] = pairs[7]["chosen"]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    out = tmp_path / "dpo"
    result = torchrun(2, "recipes/dpo.py", f"output_dir={out}", "model.path=null", "max_steps=3", "save_every=0",
                      "eval_every=0", f"data.train=[{{path: {data}, format: preference}}]", "data.eval=[]",
                      "data.report_records=null", "data.max_tokens_per_microbatch=1024")
    log = result.stdout + result.stderr
    assert "training data (30 of 30 records sampled): records read: 30; skipped: 1 (identical_replies 1)" in log
    assert "skipped {'overlong': 0, 'no_trainable_tokens': 0, 'identical_replies': 1, 'bad_record': 0}" in log
