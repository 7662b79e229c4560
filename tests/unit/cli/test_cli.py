"""The `chattune` command: ls, cp (copied recipes and configs still run), plot, and the validate entry."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from test_sft_recipe import read_metrics

from chattune.cli import catalog
from chattune.cli.main import main
from chattune.config.paths import CONFIG_DIR, DEMO_ASSETS
from conftest import PROJECT_ROOT, demo_tokenizer, launch, tiny_model

RECIPES = sorted(p.stem for p in (PROJECT_ROOT / "recipes").glob("*.py"))
SHIPPED_CONFIGS = sorted(p.relative_to(CONFIG_DIR).with_suffix("").as_posix() for p in CONFIG_DIR.rglob("*.yaml"))
QUICK_RUN = [
    "max_steps=2",
    "log_every=1",
    "save_every=0",
    "eval_every=0",
    "data.report_records=0",
    "data.max_tokens_per_microbatch=512",
]


def first_comment_words(path: Path, count: int = 5) -> str:
    comments = [line.lstrip("#").strip() for line in path.read_text().splitlines() if line.startswith("#")]
    return " ".join(next(c for c in comments if not c.startswith("@package")).split()[:count])


def listed(out: str) -> dict[str, str]:
    """`chattune ls` lines as name -> description."""
    return dict(line.strip().split(None, 1) for line in out.splitlines() if line.startswith("  "))


def test_ls_lists_every_recipe_and_config_with_its_own_description(capsys):
    assert main(["ls"]) == 0
    lines = listed(capsys.readouterr().out)
    assert set(lines) == {*RECIPES, *SHIPPED_CONFIGS}
    assert {"sft", "dpo", "sft/tiny", "sft/local_model", "dpo/tiny"} <= set(lines)
    for name in RECIPES:
        docstring = ast.get_docstring(ast.parse((PROJECT_ROOT / "recipes" / f"{name}.py").read_text()))
        assert lines[name] == docstring.splitlines()[0]
    for name in SHIPPED_CONFIGS:
        assert lines[name].startswith(first_comment_words(CONFIG_DIR / f"{name}.yaml")), name


def test_ls_discovers_new_configs_and_takes_the_first_sentence(tmp_path, monkeypatch, capsys):
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "mine.yaml").write_text(
        "# @package _global_\n# My run: e.g. a larger budget\n# for long chats. More words here.\n#   python x.py\nx: 1\n"
    )
    (tmp_path / "bare.yaml").write_text("x: 1\n")
    monkeypatch.setattr(catalog, "CONFIG_DIR", tmp_path)
    assert main(["ls"]) == 0
    lines = listed(capsys.readouterr().out)
    assert lines["sft/mine"] == "My run: e.g. a larger budget for long chats."
    assert lines["bare"] == catalog.NO_DESCRIPTION


def test_cp_copies_refuses_to_overwrite_and_overwrites_with_force(tmp_path, capsys):
    source = CONFIG_DIR / "sft" / "tiny.yaml"
    assert main(["cp", "sft/tiny", str(tmp_path)]) == 0
    copied = tmp_path / "tiny.yaml"
    assert copied.read_bytes() == source.read_bytes()

    copied.write_text("edited: true\n")
    assert main(["cp", "sft/tiny", str(tmp_path)]) == 1
    assert "already exists" in capsys.readouterr().err and copied.read_text() == "edited: true\n"
    assert main(["cp", "sft/tiny", str(copied), "--force"]) == 0
    assert copied.read_bytes() == source.read_bytes()

    assert main(["cp", "dpo", str(tmp_path / "new_dir") + "/"]) == 0
    assert (tmp_path / "new_dir" / "dpo.py").read_bytes() == (PROJECT_ROOT / "recipes" / "dpo.py").read_bytes()
    assert main(["cp", "nope", str(tmp_path)]) == 1
    assert "no recipe or config named 'nope'" in capsys.readouterr().err


def test_a_dpo_config_copied_out_of_its_group_is_checked_by_the_command_cp_prints(tmp_path, capsys):
    # dpo/tiny builds on sft/tiny: a copy outside a dpo/ directory takes the SFT kind from its base, so its DPO
    # keys are refused; the validate line `cp` prints (and the note validate adds) names the DPO recipe instead.
    assert main(["cp", "dpo/tiny", str(tmp_path / "my_configs" / "my_dpo.yaml")]) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("check it: chattune validate")]
    assert len(printed) == 1 and "recipes/dpo.py" in printed[0]

    def validate(words: list[str]) -> tuple[int, str]:
        code = main(words)
        return code, capsys.readouterr().out

    code, as_sft = validate(["validate", "--config-dir", str(tmp_path / "my_configs"), "my_dpo"])
    assert code == 1 and "reference: unknown key" in as_sft
    assert "check it with that recipe: chattune validate --recipe " in as_sft and "recipes/dpo.py" in as_sft
    code, as_dpo = validate(printed[0].removeprefix("check it: chattune ").split())
    problems = [line for line in as_dpo.splitlines() if ": " in line and not line.startswith(("note", "chattune"))]
    # Only the model it builds on (the SFT run's export) is missing here; every DPO key and format is accepted.
    assert problems == ["model.path: 'outputs/sft-tiny/hf' is not a local directory"], as_dpo


@pytest.mark.parametrize("name", SHIPPED_CONFIGS)
def test_a_copied_config_composes_like_the_shipped_one_from_its_own_directory(name, tmp_path):
    target, _ = catalog.copy(name, tmp_path / "mine" / "my_config.yaml")
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        shipped = compose(name)
    with initialize_config_dir(str(target.parent), version_base=None):
        copied = compose("my_config", return_hydra_config=True)
    assert "chattune" in [source.provider for source in copied.hydra.runtime.config_sources]  # the search-path plugin
    copied_values = OmegaConf.to_container(copied)
    del copied_values["hydra"]
    assert copied_values == OmegaConf.to_container(shipped)


def test_copied_relative_defaults_become_absolute():
    text, notes = catalog.absolute_defaults("defaults:\n  - tiny  # base\n  - _self_\nx: 1\n", "sft")
    assert text == "defaults:\n  - /sft/tiny  # base\n  - _self_\nx: 1\n" and len(notes) == 1
    _, notes = catalog.absolute_defaults("defaults: [tiny, _self_]\n", "sft")
    assert notes and notes[0].startswith("warning: defaults entry 'tiny'")


@pytest.mark.launch
def test_a_copied_recipe_runs_from_another_directory(tmp_path):
    recipe = tmp_path / "mine" / "my_sft.py"
    assert main(["cp", "sft", str(recipe)]) == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, str(recipe), f"output_dir={out}", *QUICK_RUN],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert [m["step"] for m in read_metrics(out)] == [1, 2]


@pytest.mark.launch
def test_a_copied_config_that_builds_on_a_shipped_one_runs_with_the_builtin_recipe(tmp_path):
    """sft/local_model starts from sft/tiny: the copy in the user's directory still finds it."""
    model_dir = tmp_path / "base_model"
    tiny_model(seed=1).save_pretrained(model_dir)
    demo_tokenizer().save_pretrained(model_dir)
    assert main(["cp", "sft/local_model", str(tmp_path / "my_configs" / "my_model.yaml")]) == 0
    out = tmp_path / "run"
    launch(
        [
            sys.executable,
            "recipes/sft.py",
            "--config-path",
            str(tmp_path / "my_configs"),
            "--config-name",
            "my_model",
            f"model.path={model_dir}",
            f"output_dir={out}",
            f"data.train=[{DEMO_ASSETS / 'chat_train.jsonl'}]",  # (sft/local_model has no data of its own)
            *QUICK_RUN,
        ]
    )
    assert [m["step"] for m in read_metrics(out)] == [1, 2]
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["grad_norm"] > 0


def write_run(directory: Path, dpo: bool) -> Path:
    lines = [{"step": 0, "eval_loss": 3.0}]
    for step in range(1, 6):
        line = {"step": step, "loss": 3.0 - step * 0.1, "lr": 1e-3 * step, "grad_norm": 1.0, "tokens_per_sec": 100.0}
        if dpo:
            line.update(
                {
                    "rewards/chosen": 0.1 * step,
                    "rewards/rejected": -0.1 * step,
                    "rewards/margins": 0.2 * step,
                    "rewards/accuracies": 0.5,
                    "eval_rewards/accuracies": 0.6,
                }
            )
        lines.append(line)
    lines[-1]["eval_loss"] = 2.0
    directory.mkdir(parents=True)
    (directory / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return directory


def test_plot_overlays_runs_with_one_panel_per_metric(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from chattune.cli.plot import plot_runs

    sft, dpo = write_run(tmp_path / "sft-run", dpo=False), write_run(tmp_path / "dpo-run", dpo=True)
    png = tmp_path / "plots" / "curves.png"
    assert main(["plot", str(sft), str(dpo), "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {png}" in capsys.readouterr().out

    figure = plot_runs([sft, dpo], tmp_path / "again.png")
    panels = {axes.get_title(): [t.get_text() for t in axes.get_legend().get_texts()] for axes in figure.axes}
    assert panels["loss"] == ["sft-run loss", "sft-run eval_loss", "dpo-run loss", "dpo-run eval_loss"]
    assert panels["learning rate"] == panels["grad norm"] == panels["tokens/s"] == ["sft-run", "dpo-run"]
    assert panels["reward margin"] == ["dpo-run"]
    assert panels["preference accuracy"] == ["dpo-run rewards/accuracies", "dpo-run eval_rewards/accuracies"]
    loss_lines = {line.get_label(): list(line.get_xdata()) for line in figure.axes[0].get_lines()}
    assert loss_lines["sft-run eval_loss"] == [0, 5] and loss_lines["sft-run loss"] == [1, 2, 3, 4, 5]

    only_sft = plot_runs([sft], tmp_path / "sft.png")
    assert [a.get_title() for a in only_sft.axes] == ["loss", "learning rate", "grad norm", "tokens/s"]


def test_plot_draws_a_grpo_runs_reward_curve_and_its_held_out_reward(tmp_path):
    pytest.importorskip("matplotlib")
    from chattune.cli.plot import plot_runs

    run = tmp_path / "grpo-run"
    run.mkdir()
    lines = [{"step": 0, "eval_reward": 0.05}]
    lines += [{"step": s, "loss": 0.0, "reward": 0.1 * s, "completion_length": 10 - s} for s in range(1, 4)]
    lines[-1]["eval_reward"] = 0.25
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    figure = plot_runs([run], tmp_path / "grpo.png")
    rewards = next(axes for axes in figure.axes if axes.get_title() == "rollout reward")
    drawn = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in rewards.get_lines()}
    assert drawn["grpo-run reward"] == ([1, 2, 3], [0.1, 0.2, 0.30000000000000004])
    assert drawn["grpo-run eval_reward"] == ([0, 3], [0.05, 0.25])
    assert "completion length" in [a.get_title() for a in figure.axes]


def test_plot_names_the_file_and_line_of_bad_input(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "missing")]) == 1
    assert f"{tmp_path / 'missing' / 'metrics.jsonl'}: not found" in capsys.readouterr().err
    run_dir = tmp_path / "broken"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": \n')
    assert main(["plot", str(run_dir)]) == 1
    assert f"{run_dir / 'metrics.jsonl'} line 2: not valid JSON" in capsys.readouterr().err
    (run_dir / "metrics.jsonl").write_text('{"loss": 2.0}\n')
    assert main(["plot", str(run_dir)]) == 1
    assert "line 1: expected a JSON object with an integer 'step'" in capsys.readouterr().err


def test_validate_passes_config_overrides_and_path_and_exits_by_the_verdict(tmp_path, monkeypatch, capsys):
    calls = []

    def run_validate(
        config_name: str,
        overrides: list[str],
        config_path: Path,
        config_dir: Path | None = None,
        read_data: bool = False,
        kind=None,
    ) -> tuple[str, bool]:
        calls.append((config_name, overrides, config_path, config_dir, read_data))
        kinds.append(kind)
        return f"report for {config_name}", "bad=1" not in overrides

    kinds = []
    # --recipe's kind, as recipe_main marks it (the real validate module, which recipes import, is stood in for here)
    (tmp_path / "my_sft.py").write_text(
        "from chattune.launch.recipe_kinds import SFT\n\n\ndef main():\n    pass\n\n\nmain.recipe_kind = SFT\n"
    )

    from chattune.launch.memory_plan import MemoryPlan

    stand_in = types.SimpleNamespace(run_validate=run_validate, MemoryPlan=MemoryPlan)
    monkeypatch.setitem(sys.modules, "chattune.launch.validate", stand_in)
    assert main(["validate", "dpo/tiny", "max_steps=3"]) == 0
    assert capsys.readouterr().out == "report for dpo/tiny\n"
    assert main(["validate", "--config-name", "sft/local_model", "--config-path", str(tmp_path), "bad=1"]) == 1
    assert main(["validate", "~wandb"]) == 0
    # A relative --config-path is resolved from the recipe's directory, as Hydra resolves the recipe's own
    # (the shipped recipe of the config's group, or --recipe); --config-dir is relative to where we are.
    assert main(["validate", "sft/mine", "--config-path", "my_configs", "max_steps=2"]) == 0
    assert main(["validate", "sft/mine", "--config-path", "my_configs", "--recipe", str(tmp_path / "my_sft.py")]) == 0
    assert main(["validate", "sft/mine", "--config-dir", "my_configs"]) == 0
    recipes = CONFIG_DIR.parent / "recipes"
    assert calls == [
        ("dpo/tiny", ["max_steps=3"], CONFIG_DIR, None, True),
        ("sft/local_model", ["bad=1"], tmp_path.resolve(), None, True),
        ("sft/tiny", ["~wandb"], CONFIG_DIR, None, True),
        ("sft/mine", ["max_steps=2"], recipes / "my_configs", None, True),
        ("sft/mine", [], tmp_path / "my_configs", None, True),
        ("sft/mine", [], CONFIG_DIR, Path("my_configs"), True),
    ]
    assert [kind and kind.name for kind in kinds] == [None, None, None, None, "sft", None]  # --recipe's kind
    with pytest.raises(SystemExit):
        main(["validate", "--config-name", "sft/tiny", "dpo/tiny"])


def test_commands_that_take_seconds_say_what_they_do_first(tmp_path, capsys):
    """Their imports and first records take seconds: the first line, on stderr, comes before any of it."""
    assert main(["validate", "sft/tiny", f"output_dir={tmp_path / 'run'}"]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines()[0] == (
        "chattune validate: checking sft/tiny: every key, the data's first records, "
        "the output directory and its checkpoints ..."
    )
    assert captured.out.strip() == "config OK"
    assert main(["inspect", "--config-name", "dpo/tiny", "--limit", "5", "model.path=nowhere"]) == 1
    assert capsys.readouterr().err.startswith("chattune inspect: reading the data of dpo/tiny ...\n")
