"""README's main command and the short tour (docs/tour.md), run in order in one directory as a new user runs them
(each launch with fewer steps); the real-model launches name the tests that run them."""

from __future__ import annotations

import importlib
import io
import shlex

import pytest

from chattune.cli.main import main
from conftest import PROJECT_ROOT, launch, torchrun

MAIN = "torchrun --nproc_per_node 2 recipes/sft.py"  # README's main job, run before the tour
FEWER_STEPS = [
    "max_steps=4",
    "save_every=2",
    "eval_every=4",
    "log_every=1",
    "data.report_records=0",
]  # appended: the last word wins
IN_ORDER = "test_readme_tour::test_the_main_command_and_the_tour_run_in_order_in_one_directory"
# The tour's real-model launches (paths of the user's) and the tests that run them with small ones.
REAL_MODELS = {
    "torchrun --nproc_per_node 8 recipes/sft.py --config-name sft/local_model model.path=/models/Qwen3-0.6B "
    "'data.train=[/data/chats.jsonl]' data.eval=[]": "test_sft_recipe::test_local_model_directory_with_activation_checkpointing",
    "torchrun --nproc_per_node 8 recipes/dpo.py --config-name dpo/local_model model.path=outputs/sft-local/hf "
    "'data.train=[{path: /data/prefs.jsonl, format: preference}]'": "test_dpo_recipe::test_dpo_local_model_config_on_a_qwen3_directory_and_real_preference_pairs",
}


def tour_commands() -> list[str]:
    """The commands of docs/tour.md's first block, in order."""
    tour = (PROJECT_ROOT / "docs" / "tour.md").read_text()
    block = tour.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_the_real_model_launches_name_tests_that_exist():
    assert MAIN in (PROJECT_ROOT / "README.md").read_text()
    assert set(REAL_MODELS) <= set(tour_commands()), "update REAL_MODELS with the tour's real-model lines"
    for node in {*REAL_MODELS.values(), IN_ORDER}:
        module, name = node.split("::")
        assert callable(getattr(importlib.import_module(module), name, None)), f"{node} does not exist"


@pytest.mark.launch
def test_the_main_command_and_the_tour_run_in_order_in_one_directory(tmp_path, monkeypatch, capsys):
    """It used to fail in its own order after the main command: validate refused the resume of the main run's
    checkpoint, stop_after_step=50 found no step left, and the copied recipe resumed the main run's last step
    and trained nothing."""
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.stdin", io.StringIO("What is 12 + 7?\n/quit\n"))  # what `chattune chat` is told
    (tmp_path / "recipes").symlink_to(PROJECT_ROOT / "recipes")
    for line in [MAIN, *tour_commands()]:
        if line in REAL_MODELS:
            continue
        words = shlex.split(line.replace("$PWD", str(tmp_path)))
        if words[0] == "chattune":
            assert main(words[1:]) == 0, line
            continue
        assert words[:2] == ["torchrun", "--nproc_per_node"], line
        fewer = FEWER_STEPS + (["stop_after_step=2"] if "stop_after_step=" in line else [])
        # Ranks forked with the imports done (conftest.launch); test_sft_recipe runs README's launch under torchrun.
        command = torchrun(words[3], *words[4:], *fewer, nproc=int(words[2]))
        result = launch(command, check=False, cwd=tmp_path, default_model=True)  # as the page says
        assert result.returncode == 0, f"{line}\n{result.stderr[-3000:]}"
        last = 2 if "stop_after_step=" in line else 4  # it trained, to the end or to its stop (a relaunch: again)
        assert f"step {last} |" in result.stdout, f"{line}\n{result.stdout[-3000:]}"
    out = capsys.readouterr().out
    assert "config OK" in out and "documents:" in out and "sft/tiny" in out
    assert (tmp_path / "outputs" / "sft-lr1e-3" / "metrics.png").is_file() or (tmp_path / "metrics.png").is_file()
    for run in ("sft-tiny", "sft-lr1e-3", "my-sft", "sft-slices"):
        assert (tmp_path / "outputs" / run / "hf" / "model.safetensors.index.json").is_file(), run
