"""The recipe kinds' table (`chattune.launch.recipe_kinds`) and the preference losses' table
(`chattune.objectives.pair_losses`): what each entry declares, that a config's kind comes from its name and
never from its keys, and that a new loss is one function and one row."""

from __future__ import annotations

import ast
import dataclasses
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from test_validate import CONFIGS, compose_config, problems

from chattune.cli import catalog
from chattune.config import losses as catalogue
from chattune.config.schema import LOSS_TYPES, SCHEMAS
from chattune.data.ingest.formats import PREFERENCE_FORMATS
from chattune.data.ingest.sources import RECIPE_DATA
from chattune.launch import recipe_kinds
from chattune.launch.findings import ConfigError
from chattune.launch.recipe_kinds import DPO, GRPO, KTO, RECIPE_KINDS, REWARD, SFT, RecipeKindError, kind_of_config
from chattune.launch.validate import check_config, run_validate
from chattune.objectives import pair_losses
from chattune.objectives.cross_entropy import TokenCrossEntropy
from chattune.objectives.dpo import PreferenceObjective
from chattune.objectives.kto import KTOObjective
from chattune.objectives.pair_losses import PAIR_LOSSES, PairLossRow, PairRewards, PreferenceLoss, register_pair_loss
from chattune.objectives.policy_gradient import PolicyGradientObjective
from chattune.objectives.reward import RewardObjective
from conftest import PROJECT_ROOT

# --- the recipe kinds ---


def test_each_kind_declares_its_schema_documents_formats_objective_and_reference():
    assert list(RECIPE_KINDS) == ["sft", "dpo", "reward", "kto", "grpo"]
    assert RECIPE_KINDS["sft"] is SFT and RECIPE_KINDS["dpo"] is DPO
    assert RECIPE_KINDS["reward"] is REWARD and REWARD.schema is SCHEMAS["reward"] and REWARD.pairs
    assert REWARD.objective_class() is RewardObjective and not REWARD.needs_reference
    assert RECIPE_KINDS["kto"] is KTO and KTO.schema is SCHEMAS["kto"] and KTO.pairs  # an example: two segments
    assert KTO.objective_class() is KTOObjective and KTO.needs_reference
    assert set(KTO.formats) == {"unpaired", *PREFERENCE_FORMATS} and "unpaired" not in SFT.formats + DPO.formats
    assert (SFT.schema, DPO.schema) == (SCHEMAS["sft"], SCHEMAS["dpo"])  # the schema checks' own table agrees
    assert (SFT.objective_class(), DPO.objective_class()) == (TokenCrossEntropy, PreferenceObjective)
    assert (SFT.pairs, DPO.pairs) == (False, True) and (SFT.needs_reference, DPO.needs_reference) == (False, True)
    assert set(DPO.formats) == set(PREFERENCE_FORMATS) and not set(SFT.formats) & set(PREFERENCE_FORMATS)
    assert RECIPE_KINDS["grpo"] is GRPO and GRPO.schema is SCHEMAS["grpo"] and GRPO.formats == ("prompt",)
    assert GRPO.objective_class() is PolicyGradientObjective and GRPO.needs_reference  # its KL penalty's
    assert "prompt" not in SFT.formats + DPO.formats + KTO.formats
    for name, kind in RECIPE_KINDS.items():
        assert kind.data is RECIPE_DATA[name] and kind.data.name == name  # the token caches' key is the kind's name
        assert ("reference" in kind.schema.__dataclass_fields__) is kind.needs_reference  # its section


@pytest.mark.parametrize("name", list(RECIPE_KINDS))
def test_each_shipped_recipe_passes_its_own_kind_and_runs_configs_of_its_group(name):
    tree = ast.parse((PROJECT_ROOT / "recipes" / RECIPE_KINDS[name].recipe_file).read_text())
    imported = [
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "chattune.launch.recipe_kinds"
        for alias in node.names
    ]
    assert [getattr(recipe_kinds, n) for n in imported] == [RECIPE_KINDS[name]]
    default = next(
        k.value.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "recipe_main"
        for k in node.keywords
        if k.arg == "config_name"
    )
    assert kind_of_config(default).kind is RECIPE_KINDS[name]


@pytest.mark.parametrize(
    "config",
    sorted(
        p.relative_to(CONFIGS).with_suffix("").as_posix()
        for group in RECIPE_KINDS
        for p in (CONFIGS / group).glob("*.yaml")
    ),
)
def test_each_shipped_config_has_the_kind_of_its_group(config):
    assert kind_of_config(config) == recipe_kinds.ConfigKind(RECIPE_KINDS[config.split("/")[0]], config)


def test_a_config_of_no_kind_group_has_the_kind_of_the_nearest_config_it_builds_on(tmp_path):
    (tmp_path / "mine").mkdir()
    # dpo/tiny builds on sft/tiny: the nearest is dpo/tiny.
    (tmp_path / "mine" / "run.yaml").write_text("# @package _global_\ndefaults:\n  - /dpo/tiny\n  - _self_\n")
    (tmp_path / "mine" / "chat.yaml").write_text("# @package _global_\ndefaults:\n  - /sft/local_model\n  - _self_\n")
    assert kind_of_config("mine/run", tmp_path) == recipe_kinds.ConfigKind(DPO, "dpo/tiny")
    assert kind_of_config("mine/chat", tmp_path) == recipe_kinds.ConfigKind(SFT, "sft/local_model")
    report, ok = run_validate("mine/run", [f"output_dir={tmp_path / 'out'}", "model.path=null"], tmp_path)
    assert (report, ok) == ("note: config: mine/run is checked as a dpo config: it builds on dpo/tiny\nconfig OK", True)


def test_an_unknown_group_is_one_clear_error_naming_the_config(tmp_path):
    (tmp_path / "nope").mkdir()
    (tmp_path / "nope" / "run.yaml").write_text("# @package _global_\nmax_steps: 3\n")  # builds on nothing
    with pytest.raises(
        RecipeKindError,
        match=r"^nope/run: no recipe kind: .* group \(sft/ or dpo/ or reward/ or kto/ or grpo/\).* nope/run is in "
        r"group nope/ and builds on none",
    ):
        kind_of_config("nope/run", tmp_path)
    report, ok = run_validate("nope/run", [], tmp_path)
    assert not ok and len(problems(report)) == 1 and problems(report)[0].startswith("config: nope/run: no recipe kind")
    (tmp_path / "bare.yaml").write_text("max_steps: 3\n")
    with pytest.raises(RecipeKindError, match=r"^bare: no recipe kind: .* bare is in no group"):
        kind_of_config("bare", tmp_path)


def test_the_kind_is_never_inferred_from_the_keys(tmp_path):
    # A DPO config without its `reference` section stays DPO (named so, or building on dpo/tiny): the DPO schema
    # reports the section missing.
    report, _ = run_validate("dpo/tiny", [f"output_dir={tmp_path / 'out'}", "model.path=null", "~reference"], CONFIGS)
    assert problems(report) == ["reference: missing: the recipe reads it (removed with ~?)"]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "run.yaml").write_text("# @package _global_\ndefaults:\n  - /dpo/tiny\n  - _self_\n")
    report, _ = run_validate("mine/run", [f"output_dir={tmp_path / 'out'}", "model.path=null", "~reference"], tmp_path)
    assert problems(report) == ["reference: missing: the recipe reads it (removed with ~?)"]
    # An SFT config with a stray `reference` stays SFT: its schema reports the key, and its chats are still SFT data.
    report, _ = run_validate("sft/tiny", [f"output_dir={tmp_path / 'out'}", "+reference.path=/models/ref"], CONFIGS)
    assert problems(report) == ["reference: unknown key"]
    with pytest.raises(ConfigError) as raised:
        check_config(compose_config("sft/tiny", ["+reference.path=/models/ref"]), SFT, world_size=1)
    assert raised.value.problems == ["reference: unknown key"]


@pytest.mark.launch
def test_reading_the_table_imports_neither_torch_nor_hydra_for_a_kind_group():
    """`chattune cp` asks it which recipe runs a config: no torch, transformers or Hydra for that."""
    code = (
        "import sys; from chattune.launch.recipe_kinds import kind_of_config; kind_of_config('dpo/tiny'); "
        "print(sorted(m for m in ('torch', 'transformers', 'hydra') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.stdout.strip() == "[]", result.stderr


def test_a_copied_config_names_the_recipe_of_its_kind(tmp_path):
    _, notes = catalog.copy("dpo/local_model", tmp_path / "my_dpo.yaml")
    use_it = next(note for note in notes if note.startswith("use it:"))
    assert f"use it: python {PROJECT_ROOT / 'recipes' / 'dpo.py'} --config-path" in use_it
    _, notes = catalog.copy("peft/lora", tmp_path / "my_lora.yaml")  # a choice for a recipe, no recipe's own
    assert notes[-1].startswith("use it: python RECIPE.py --config-path")


# --- the preference losses ---


def test_the_needs_of_each_builtin_loss():
    needs = {name: (row.needs_reference, row.per_token, row.reads) for name, row in PAIR_LOSSES.items()}
    assert needs == {
        "sigmoid": (True, False, ("label_smoothing",)),
        "robust": (True, False, ("label_smoothing",)),
        "hinge": (True, False, ()),
        "ipo": (True, True, ("beta",)),
        "sigmoid_norm": (True, True, ("label_smoothing",)),
        "simpo": (False, True, ("label_smoothing", "simpo_gamma")),
        "orpo": (False, True, ("orpo_lambda",)),
    }
    assert [name for name, row in PAIR_LOSSES.items() if row.chosen_nll] == ["orpo"]
    # One catalogue: the config's choices are its rows, and each function's row is the catalogue's own.
    assert tuple(PAIR_LOSSES) == tuple(LOSS_TYPES) == tuple(catalogue.PREFERENCE_LOSSES)
    assert all(row.spec == catalogue.PREFERENCE_LOSSES[name] for name, row in PAIR_LOSSES.items())
    assert [name for name in LOSS_TYPES if not catalogue.needs_reference(name)] == ["simpo", "orpo"]


def test_a_loss_is_built_from_keywords_or_a_config_section_never_positionally():
    section = compose_config("dpo/tiny", ["loss.type=simpo", "loss.beta=2.0", "loss.simpo_gamma=0.3"]).loss
    assert PreferenceLoss.from_config(section) == PreferenceLoss(loss_type="simpo", beta=2.0, simpo_gamma=0.3)
    assert PreferenceLoss.from_config(OmegaConf.create({"type": "ipo"})) == PreferenceLoss(loss_type="ipo")
    with pytest.raises(TypeError):
        PreferenceLoss("sigmoid", 0.1)  # type: ignore[misc]
    with pytest.raises(ValueError, match=r"loss.type must be one of \('sigmoid', .*'orpo'\), got 'kto'"):
        PreferenceLoss(loss_type="kto")


def test_each_loss_setting_is_declared_once_and_held_alike_by_the_config_and_the_loss():
    """The catalogue's settings (default, meaning, bound) are the schema's keys and PreferenceLoss's fields; a value
    out of bounds is refused by both, with the same words: the config through its checks, the loss itself."""
    from chattune.config.schema import DPOLossConfig
    from chattune.launch.findings import ConfigError
    from chattune.launch.recipe_kinds import DPO
    from chattune.launch.validate import check_config

    fields = {f.name: f for f in dataclasses.fields(DPOLossConfig)}
    loss_fields = {f.name: f.default for f in dataclasses.fields(PreferenceLoss)}
    for name, setting in catalogue.LOSS_SETTINGS.items():
        assert fields[name].default == setting.default == loss_fields[name], name
        assert fields[name].metadata["help"].startswith(setting.meaning), name
        assert fields[name].metadata["bound"] is setting.bound, name
    assert "read by sigmoid, robust, sigmoid_norm, simpo" in fields["label_smoothing"].metadata["help"]
    for name, bad in (("beta", 0.0), ("label_smoothing", 0.5), ("orpo_lambda", -1.0)):
        with pytest.raises(ValueError) as refused:
            PreferenceLoss(**{name: bad})
        assert str(refused.value) == catalogue.LOSS_SETTINGS[name].problem(bad), name
        with pytest.raises(ConfigError) as config_refused:
            check_config(compose_config("dpo/tiny", [f"loss.{name}={bad}"]), DPO, world_size=1)
        said = str(config_refused.value)
        assert f"loss.{name}" in said and catalogue.LOSS_SETTINGS[name].bound[1] in said, said


def odds_ratio(pairs: PairRewards, *, beta: float) -> torch.Tensor:
    """An example new loss (ORPO's odds-ratio term, with its NLL as loss.sft_weight's per-pair term); the built-in
    `orpo` row normalises its NLL per chosen token instead."""
    chosen, rejected = pairs.policy_chosen / pairs.chosen_tokens, pairs.policy_rejected / pairs.rejected_tokens
    log_odds = (chosen - torch.log1p(-torch.exp(chosen))) - (rejected - torch.log1p(-torch.exp(rejected)))
    return -beta * F.logsigmoid(log_odds)


def test_a_new_loss_is_one_function_and_one_row(monkeypatch, request):
    monkeypatch.setattr(pair_losses, "PAIR_LOSSES", dict(PAIR_LOSSES))  # the row is gone after the test
    request.addfinalizer(lambda: catalogue.PREFERENCE_LOSSES.pop("odds_ratio_demo", None))  # and its catalogue row
    row = register_pair_loss(
        PairLossRow("odds_ratio_demo", odds_ratio, needs_reference=False, per_token=True, reads=("beta",))
    )
    assert pair_losses.PAIR_LOSSES["odds_ratio_demo"] is row and "odds_ratio_demo" not in PAIR_LOSSES
    # the catalogue has its needs: a choice of the config's loss.type from now on, and reference-free
    assert "odds_ratio_demo" in LOSS_TYPES and not catalogue.needs_reference("odds_ratio_demo")
    loss = PreferenceLoss.from_config({"type": "odds_ratio_demo", "beta": 0.25, "sft_weight": 1.0})
    assert loss == PreferenceLoss(loss_type="odds_ratio_demo", beta=0.25, sft_weight=1.0) and loss.row is row
    assert not loss.needs_reference and loss.loss_without_preference() is None
    PreferenceObjective(loss, reference=None)  # reference-free: no reference model asked for

    columns = ([-6.0, -30.0], [-9.0, -11.0], [4.0, 10.0], [3.0, 11.0])  # policy chosen, rejected; their tokens
    policy_chosen, policy_rejected, chosen_tokens, rejected_tokens = (
        torch.tensor(c, dtype=torch.float64) for c in columns
    )
    losses, chosen_reward, rejected_reward = loss(
        policy_chosen, policy_rejected, None, None, chosen_tokens, rejected_tokens
    )
    for i in range(2):
        mean_chosen = float(policy_chosen[i] / chosen_tokens[i])
        mean_rejected = float(policy_rejected[i] / rejected_tokens[i])
        log_odds = (mean_chosen - math.log1p(-math.exp(mean_chosen))) - (
            mean_rejected - math.log1p(-math.exp(mean_rejected))
        )
        want = 0.25 * math.log1p(math.exp(-log_odds)) - mean_chosen  # the odds-ratio term and the chosen reply's NLL
        assert math.isclose(float(losses[i]), want, rel_tol=1e-12)
        assert math.isclose(float(chosen_reward[i]), 0.25 * mean_chosen, rel_tol=1e-12)  # per_token, reference-free
        assert math.isclose(float(rejected_reward[i]), 0.25 * mean_rejected, rel_tol=1e-12)


def test_a_row_must_be_new_and_declare_what_its_function_reads(monkeypatch):
    monkeypatch.setattr(pair_losses, "PAIR_LOSSES", dict(PAIR_LOSSES))
    monkeypatch.setattr(catalogue, "PREFERENCE_LOSSES", dict(catalogue.PREFERENCE_LOSSES))
    with pytest.raises(ValueError, match="'sigmoid' is registered already"):
        register_pair_loss(PairLossRow("sigmoid", odds_ratio, needs_reference=True, per_token=False, reads=("beta",)))
    with pytest.raises(ValueError, match=r"declares reads=\(\) but its function takes \['beta'\]"):
        register_pair_loss(PairLossRow("odds_ratio_demo", odds_ratio, needs_reference=False, per_token=True))
    with pytest.raises(ValueError, match=r"reads \['lambda'\], which are not loss settings"):
        register_pair_loss(
            PairLossRow("odds_ratio_demo", odds_ratio, needs_reference=False, per_token=True, reads=("lambda",))
        )
    assert "odds_ratio_demo" not in pair_losses.PAIR_LOSSES
