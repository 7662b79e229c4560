"""README's short tour: every `chattune` command in it runs here as written; every launch names the test
that runs it (so a tour line nobody tests fails this test)."""

from __future__ import annotations

import importlib
import json
import runpy
import shlex

import pytest
from conftest import PROJECT_ROOT

from chattune.cli.main import main

# The launches of the tour and the tests that run them (with smaller step counts and models).
LAUNCHES = {
    "torchrun --nproc_per_node 2 recipes/sft.py max_steps=100 optimizer.lr=1e-3 output_dir=outputs/sft-lr1e-3":
        "test_sft_recipe::test_two_rank_torchrun_trains_and_writes_a_loadable_hf_model",
    "torchrun --nproc_per_node 2 my_sft.py --config-path $PWD/my_configs --config-name my_tiny":
        "test_sft_recipe::test_copied_recipe_runs_with_config_path",
    "torchrun --nproc_per_node 2 recipes/sft.py stop_after_step=50":
        "test_resume::test_stop_and_resume_reproduces_the_uninterrupted_run",
    "torchrun --nproc_per_node 2 recipes/sft.py":
        "test_resume::test_stop_and_resume_reproduces_the_uninterrupted_run",
    "torchrun --nproc_per_node 8 recipes/sft.py --config-name sft/local_model model.path=/models/Qwen3-0.6B "
    "'data.train=[/data/chats.jsonl]' data.eval=[]":
        "test_sft_recipe::test_local_model_directory_with_activation_checkpointing",
    "torchrun --nproc_per_node 8 recipes/dpo.py --config-name dpo/local_model model.path=outputs/sft-local/hf "
    "'data.train=[{path: /data/prefs.jsonl, format: preference}]'":
        "test_dpo_recipe::test_dpo_local_model_config_on_a_qwen3_directory_and_real_preference_pairs",
}


def tour_commands() -> list[str]:
    readme = (PROJECT_ROOT / "README.md").read_text()
    section = readme.split("## A short tour", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_every_launch_in_the_tour_names_a_test_that_exists():
    launches = [c for c in tour_commands() if not c.startswith("chattune ")]
    assert launches and set(launches) == set(LAUNCHES), "update LAUNCHES with the tour's launch lines"
    for node in set(LAUNCHES.values()):
        module, name = node.split("::")
        assert callable(getattr(importlib.import_module(module), name, None)), f"{node} does not exist"


def test_the_chattune_commands_of_the_tour_run_as_written(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "outputs" / "sft-lr1e-3"  # what the tour's first launch leaves for `chattune plot`
    run_dir.mkdir(parents=True)
    run_dir.joinpath("metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": 5.0 / s, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_sec": 1e3}) + "\n"
        for s in range(1, 6)))
    commands = [c for c in tour_commands() if c.startswith("chattune ")]
    assert {c.split()[1] for c in commands} == {"ls", "validate", "inspect", "cp", "plot"}
    for command in commands:
        assert main(shlex.split(command)[1:]) == 0, command
    out = capsys.readouterr().out
    assert "config OK" in out and "documents:" in out and "sft/tiny" in out
    assert (tmp_path / "my_sft.py").is_file() and (tmp_path / "my_configs" / "my_tiny.yaml").is_file()
    assert (run_dir / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_layout_table_is_the_real_tree():
    # Regenerate with `python scripts/readme_layout.py --write` after adding, moving or renaming a module.
    layout = runpy.run_path(str(PROJECT_ROOT / "scripts" / "readme_layout.py"))
    readme = (PROJECT_ROOT / "README.md").read_text()
    assert layout["layout_table"]() in readme
    assert layout["replace_in_readme"](readme, layout["layout_table"]()) == readme
