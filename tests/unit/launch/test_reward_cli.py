"""The reward recipe in the command-line tools (ls, cp, validate, inspect), and its input: identical replies a counted
skip, a pair's margin read, a margin that is not a number one clear error (tests/unit/objectives/test_reward_margins.py has the
rest of margins: the token cache, the loss)."""

from __future__ import annotations

import json

import pytest
from hydra.utils import instantiate
from test_validate import CONFIGS, compose_config, problems

from chattune.cli.main import main
from chattune.config.paths import DEMO_ASSETS
from chattune.data.documents import Skipped
from chattune.data.ingest.formats import DataError, SourceSpec
from chattune.data.ingest.sources import REWARD_PAIR_DATA
from chattune.launch.recipe_kinds import RECIPE_KINDS, kind_of_config
from chattune.launch.validate import run_validate
from conftest import PROJECT_ROOT, demo_tokenizer, pair_margin_of, with_values

PAIRS = [
    {"prompt": "What is 2 + 2?", "chosen": "4.", "rejected": "5."},
    {"prompt": "Reverse 'ab'.", "chosen": "ba", "rejected": "ba"},  # identical replies: a counted skip
]


def write_pairs(path, pairs) -> str:
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return str(path)


@pytest.fixture
def sft_export(tmp_path, monkeypatch):
    """sft/tiny's export where reward/tiny looks for it (outputs/sft-tiny/hf): its config, its weights only named."""
    monkeypatch.chdir(tmp_path)
    export = tmp_path / "outputs" / "sft-tiny" / "hf"
    instantiate(compose_config("sft/tiny", []).model.config).save_pretrained(export)
    (export / "model.safetensors").touch()
    return export


def test_ls_lists_the_reward_recipe_and_its_configs(capsys):
    assert main(["ls"]) == 0
    names = {line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("  ")}
    assert {"reward", "reward/tiny", "reward/local_model"} <= names
    assert kind_of_config("reward/tiny").kind is RECIPE_KINDS["reward"]


def test_validate_reward_tiny_is_clean_and_refuses_what_a_reward_model_cannot_do(sft_export, capsys):
    assert main(["validate", "reward/tiny"]) == 0
    assert capsys.readouterr().out.strip() == "config OK"
    report, ok = run_validate(
        "reward/tiny",
        ["parallel.context=2", "eval.samples=2", "loss.center_rewards_coefficient=-1", "loss.beta=0.1"],
        CONFIGS,
    )
    assert not ok and problems(report) == [
        "loss.beta: unknown key: this recipe's loss has no beta (its keys: center_rewards_coefficient, chunk_size, "
        "implementation, router_aux_coef)",  # DPO's: a reward model has no reference to scale against
        "eval.samples: must be 0: a reward model scores replies and writes none, got 2",
        "parallel.context: must be 1: this recipe does not split packed rows across ranks, got 2",
        "loss.center_rewards_coefficient: must be >= 0, got -1",
    ], report
    report, ok = run_validate("reward/tiny", ["data.train=[data/chats.jsonl]"], CONFIGS)
    assert (
        not ok
        and "'messages' is not one of preference, sharegpt_preference (a reward model reads preference pairs)"
        in (report)
    ), report


def test_cp_copies_the_reward_recipe_and_config_and_its_check_line_validates(sft_export, tmp_path, capsys):
    assert main(["cp", "reward", str(tmp_path / "my_reward.py")]) == 0
    assert (tmp_path / "my_reward.py").read_bytes() == (PROJECT_ROOT / "recipes" / "reward.py").read_bytes()
    capsys.readouterr()
    assert main(["cp", "reward/tiny", str(tmp_path / "my_configs" / "my_reward.yaml")]) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("check it: ")]
    assert len(printed) == 1 and "recipes/reward.py" in printed[0], printed
    assert main(printed[0].removeprefix("check it: chattune ").split()) == 0


def test_inspect_reads_a_reward_config_as_pairs_and_counts_identical_replies(tmp_path, capsys):
    data = write_pairs(tmp_path / "pairs.jsonl", PAIRS)
    args = ["inspect", "reward/tiny", "--num-docs", "1", "--no-color", "model.path=null"]
    assert main([*args, f"data.train=[{{path: {data}, format: preference}}]"]) == 0
    out = capsys.readouterr().out
    assert "records read: 2" in out and "skipped: 1 (identical_replies 1)" in out and "documents: 1" in out
    # each side trains its reply and end-of-turn token; its reward is read at its last token (the newline after it)
    assert "[[4.<|im_end|>]]" in out and "[[5.<|im_end|>]]" in out


def reward_documents(path: str, on_bad_record: str = "error"):
    data = compose_config("reward/tiny", [f"data.on_bad_record={on_bad_record}"]).data
    return REWARD_PAIR_DATA.read([SourceSpec(path=path, format="preference")], demo_tokenizer(), data)


def test_reward_pairs_skip_identical_replies_read_a_margin_and_refuse_a_bad_one(tmp_path):
    documents = reward_documents(write_pairs(tmp_path / "pairs.jsonl", PAIRS))
    first, second = documents.get_many([0, 1])
    assert len(first.segments) == 2 and isinstance(second, Skipped) and second.reason == "identical_replies"
    assert pair_margin_of(first) == 0.0  # no margin field: trained at margin 0

    with_margin = write_pairs(tmp_path / "margins.jsonl", [{**PAIRS[0], "margin": 2.0}])
    read = reward_documents(with_margin).get(0)
    assert pair_margin_of(read) == 2.0 and read == with_values(first, margin=2.0)  # the same document, with its margin

    bad_margin = write_pairs(tmp_path / "bad.jsonl", [{**PAIRS[0], "margin": "2.0"}])
    with pytest.raises(DataError) as error:
        reward_documents(bad_margin).get(0)
    assert str(error.value).startswith(
        f"{bad_margin} record 1 (line 1): 'margin' must be a finite number (the pair's reward margin), got '2.0' (str)"
    )
    skipped = reward_documents(bad_margin, on_bad_record="skip").get(0)
    assert isinstance(skipped, Skipped) and skipped.reason == "bad_record" and "'margin'" in skipped.detail


def test_the_demo_preference_pairs_have_no_margin():
    """reward/tiny trains every pair at margin 0, as the README's measured run of it reads: its records carry no
    margin field."""
    for name in ("preference_train.jsonl", "preference_eval.jsonl"):
        assert not any("margin" in json.loads(line) for line in (DEMO_ASSETS / name).read_text().splitlines())
