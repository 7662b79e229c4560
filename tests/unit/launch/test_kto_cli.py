"""The KTO recipe in the command-line tools (ls, cp, validate, inspect), and its sample prompts from unpaired data."""

from __future__ import annotations

import json

import pytest
from hydra.utils import instantiate
from test_validate import CONFIGS, compose_config, problems

from chattune.cli.main import main
from chattune.data.ingest.formats import SourceSpec
from chattune.data.templates.prompts import held_out_prompts
from chattune.launch.recipe_kinds import RECIPE_KINDS, kind_of_config
from chattune.launch.validate import run_validate
from conftest import PROJECT_ROOT

EXAMPLES = [
    {"prompt": "What is 2 + 2?", "completion": "4.", "label": True},
    {"prompt": "Reverse 'ab'.", "completion": "ab", "label": False},
]


def write_examples(path, examples) -> str:
    path.write_text("".join(json.dumps(e) + "\n" for e in examples))
    return str(path)


@pytest.fixture
def sft_export(tmp_path, monkeypatch):
    """sft/tiny's export where kto/tiny looks for it (outputs/sft-tiny/hf): its config, its weights only named."""
    monkeypatch.chdir(tmp_path)
    export = tmp_path / "outputs" / "sft-tiny" / "hf"
    instantiate(compose_config("sft/tiny", []).model.config).save_pretrained(export)
    (export / "model.safetensors").touch()
    return export


def test_ls_lists_the_kto_recipe_and_its_configs(capsys):
    assert main(["ls"]) == 0
    names = {line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("  ")}
    assert {"kto", "kto/tiny", "kto/local_model"} <= names
    assert kind_of_config("kto/tiny").kind is RECIPE_KINDS["kto"]


def test_validate_kto_tiny_is_clean_and_refuses_what_kto_cannot_do(sft_export, tmp_path, capsys):
    assert main(["validate", "kto/tiny"]) == 0
    assert capsys.readouterr().out.strip() == "config OK"
    report, ok = run_validate(
        "kto/tiny",
        ["parallel.context=2", "loss.desirable_weight=0", "loss.type=sigmoid", "data.overlong=split"],
        CONFIGS,
    )
    assert not ok and sorted(problems(report)) == sorted(
        [
            "loss.type: unknown key: this recipe's loss has no type (its keys: beta, chunk_size, desirable_weight, "
            "implementation, router_aux_coef, undesirable_weight)",  # DPO's: KTO has one loss
            "parallel.context: must be 1: this recipe does not split packed rows across ranks, got 2",
            "loss.desirable_weight: must be positive, got 0",
            "data.overlong: 'split' is not one of drop, error",
        ]
    ), report
    data = write_examples(tmp_path / "chats.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    report, ok = run_validate("kto/tiny", [f"data.train=[{{path: {data}, format: messages}}]"], CONFIGS)
    assert not ok and "(KTO reads unpaired examples or preference pairs)" in report, report


def test_cp_copies_the_kto_recipe_and_config_and_its_check_line_validates(sft_export, tmp_path, capsys):
    assert main(["cp", "kto", str(tmp_path / "my_kto.py")]) == 0
    assert (tmp_path / "my_kto.py").read_bytes() == (PROJECT_ROOT / "recipes" / "kto.py").read_bytes()
    capsys.readouterr()
    assert main(["cp", "kto/tiny", str(tmp_path / "my_configs" / "my_kto.yaml")]) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("check it: ")]
    assert len(printed) == 1 and "recipes/kto.py" in printed[0], printed
    assert main(printed[0].removeprefix("check it: chattune ").split()) == 0


def test_inspect_shows_each_example_and_its_mismatched_sequence(tmp_path, capsys):
    data = write_examples(tmp_path / "examples.jsonl", EXAMPLES)
    args = ["inspect", "kto/tiny", "--num-docs", "2", "--no-color", "model.path=null"]
    assert main([*args, f"data.train=[{{path: {data}, format: unpaired}}]"]) == 0
    out = capsys.readouterr().out
    assert "records read: 2" in out and "documents: 2" in out, out
    assert "desirable example" in out and "undesirable example" in out and "mismatched" in out
    # each scores its completion and end-of-turn token; the mismatched sequence scores the next record's completion
    assert out.count("[[4.<|im_end|>]]") == 2 and out.count("[[ab<|im_end|>]]") == 2, out


def test_sample_prompts_come_from_unpaired_examples(tmp_path):
    data = write_examples(tmp_path / "examples.jsonl", EXAMPLES)
    prompts = held_out_prompts([SourceSpec(path=data, format="unpaired")], 2)
    assert [p.messages for p in prompts] == [[{"role": "user", "content": e["prompt"]}] for e in EXAMPLES]
