"""A copied recipe declares keys of its own (docs/recipes.md): a dataclass subclassing the kind's
schema, passed to `recipe_main` through `SFT.extended(...)`. `chattune validate --recipe FILE` and the launch
check them like the built-in ones, and the recipe reads them."""

from __future__ import annotations

import json
import sys

import pytest

from chattune.cli.main import main
from chattune.config.schema import SFTConfig, key
from chattune.launch.recipe_kinds import DPO, SFT, RecipeKindError, kind_of_recipe
from conftest import PROJECT_ROOT, SMALL_MODEL, launch

# What a user adds to their copy of recipes/sft.py: the schema, the kind, the decorator's and check's kind,
# and a line that uses the key (here: it writes the value where the test reads it).
ADDED_SCHEMA = """
from dataclasses import dataclass

from chattune.config.schema import SFTConfig, key


@dataclass
class MySFTConfig(SFTConfig):
    greet_every: int = key(1, "how often to greet, in steps", at_least=1)


MY_SFT = SFT.extended(MySFTConfig)
"""
USES_KEY = """    (Path(cfg.output_dir) / "greet_every.txt").write_text(f"{type(cfg).__name__} {cfg.greet_every!r}")
"""


def copied_recipe(tmp_path):
    """recipes/sft.py copied and edited as README shows; a config of its own with the new key's value."""
    text = (PROJECT_ROOT / "recipes" / "sft.py").read_text()
    decorator = '@recipe_main(config_name="sft/tiny", kind=SFT)'
    assert decorator in text and "checked_config(composed, SFT)" in text and "    train(" in text
    text = text.replace(decorator, ADDED_SCHEMA + "\n\n" + '@recipe_main(config_name="sft/mine", kind=MY_SFT)')
    text = text.replace("checked_config(composed, SFT)", "checked_config(composed, MY_SFT)")
    text = text.replace("    train(", USES_KEY + "    train(", 1)
    text = "from pathlib import Path\n" + text.replace("from __future__ import annotations\n", "", 1)
    text = "from __future__ import annotations\n" + text
    recipe = tmp_path / "my_sft.py"
    recipe.write_text(text)
    configs = tmp_path / "configs" / "sft"
    configs.mkdir(parents=True)
    (configs / "mine.yaml").write_text("# @package _global_\ndefaults:\n  - /sft/tiny\n  - _self_\n\ngreet_every: 3\n")
    return recipe, tmp_path / "configs"


def test_extended_kind_takes_only_a_subclass_of_its_schema():
    from dataclasses import dataclass

    @dataclass
    class Extra(SFTConfig):
        extra: int = key(0, "an extra key")

    assert SFT.extended(Extra).schema is Extra and SFT.extended(Extra).name == "sft" and SFT.schema is SFTConfig
    with pytest.raises(TypeError, match="subclassing DPOConfig"):
        DPO.extended(Extra)


def test_the_shipped_recipes_declare_their_kinds():
    assert kind_of_recipe(PROJECT_ROOT / "recipes" / "sft.py") is SFT
    assert kind_of_recipe(PROJECT_ROOT / "recipes" / "dpo.py") is DPO
    with pytest.raises(RecipeKindError, match="no such recipe file"):
        kind_of_recipe(PROJECT_ROOT / "recipes" / "missing.py")


@pytest.mark.launch
def test_a_copied_recipe_with_its_own_key_validates_refuses_bad_values_and_trains(tmp_path, capsys):
    recipe, config_dir = copied_recipe(tmp_path)
    assert kind_of_recipe(recipe).schema.__name__ == "MySFTConfig"

    def validate(*words: str) -> tuple[int, str]:  # `chattune validate ...`, in this process
        code = main(["validate", *words])
        return code, capsys.readouterr().out

    code, report = validate("--recipe", str(recipe), "--config-dir", str(config_dir), "sft/mine")
    assert code == 0, report
    # The shipped recipe's schema does not know the key: without --recipe it is refused, with the nearest key.
    code, report = validate("--config-dir", str(config_dir), "sft/mine")
    assert code == 1 and "greet_every" in report and "unknown key" in report
    # The new key's type and bound are checked like a built-in key's.
    code, report = validate("--recipe", str(recipe), "--config-dir", str(config_dir), "sft/mine", "greet_every=0")
    assert code == 1 and "greet_every" in report, report
    code, report = validate("--recipe", str(recipe), "--config-dir", str(config_dir), "sft/mine", "+greet_evry=2")
    assert code == 1 and "greet_every" in report, report  # the nearest valid key

    out = tmp_path / "run"
    python = [sys.executable, str(recipe), "--config-dir", str(config_dir), *SMALL_MODEL]
    launched = launch([*python, f"output_dir={out}", "greet_every=5", "max_steps=2", "log_every=1", "save_every=0"])
    assert (out / "greet_every.txt").read_text() == "MySFTConfig 5"  # the recipe reads its typed config
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s for s in steps if s > 0] == [1, 2], launched.stdout

    # The launch's own check (checked_config with the recipe's kind) refuses a bad value of the new key.
    refused = launch([*python, f"output_dir={tmp_path / 'bad'}", "greet_every=-1", "max_steps=1"], check=False)
    assert refused.returncode != 0 and "greet_every" in refused.stderr, refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr
