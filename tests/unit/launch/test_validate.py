"""`chattune validate` / `check_config`: the shipped configs are clean, and every problem of a bad config
is reported at once, one line each, the same way by the command and by the recipes' start-up check."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shlex
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from chattune.config.paths import DEMO_ASSETS
from chattune.config.schema import SCHEMAS
from chattune.launch.recipe_kinds import RECIPE_KINDS, SFT
from chattune.launch.validate import ConfigError, check_config, run_validate
from conftest import PROJECT_ROOT

CONFIGS = PROJECT_ROOT / "configs"


def compose_config(name: str, overrides: list[str]) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        return compose(name, overrides=overrides)


def problems(report: str) -> list[str]:
    """The problem lines of a report (not its notes, not its summary line)."""
    return [line for line in report.splitlines()[:-1] if not line.startswith("note: ")]


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A stand-in for a local Hugging Face model directory: its config.json is read, its weights only found."""
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 32768}))
    (directory / "model.safetensors").touch()
    return directory


def test_sft_tiny_is_clean(tmp_path):
    report, ok = run_validate("sft/tiny", [f"output_dir={tmp_path}"], CONFIGS)
    assert (report, ok) == ("config OK", True)


CHATS = f"data.train=[{DEMO_ASSETS / 'chat_train.jsonl'}]"  # the user's own chats, for sft/local_model


def test_local_model_needs_a_model_directory(tmp_path, model_dir):
    # model.path: ??? does not replace sft/tiny's null when merged: the composed config holds null.
    report, ok = run_validate("sft/local_model", [f"output_dir={tmp_path}", CHATS], CONFIGS)
    assert not ok
    assert problems(report) == [
        "model.path: required by sft/local_model (???), not set",
        "tokenizer.path: null is not allowed; expected a string",
        "model: neither model.path nor model.config is set",
    ]

    report, ok = run_validate("sft/local_model", [f"output_dir={tmp_path}", f"model.path={model_dir}", CHATS], CONFIGS)
    assert (report, ok) == ("config OK", True)
    report, ok = run_validate(
        "sft/local_model",
        [f"output_dir={tmp_path}", f"model.path={model_dir}", CHATS, "data.max_tokens_per_microbatch=65536"],
        CONFIGS,
    )
    assert ok and report.splitlines()[0] == (
        "note: data.max_tokens_per_microbatch: 65536 is more than model.path's max_position_embeddings 32768: "
        "a document longer than 32768 tokens gets positions the model was not trained on"
    )

    # model.config's keys say nothing when model.path is loaded: said (here and at a launch), not ignored in silence
    report, ok = run_validate(
        "sft/tiny", [f"output_dir={tmp_path}", f"model.path={model_dir}", "model.config.hidden_size=128"], CONFIGS
    )
    assert ok and report.splitlines() == [
        f"note: model.config: model.config.hidden_size ignored: model.path {model_dir} is loaded with its own "
        "config.json (model.config builds a random-init model only with model.path=null)",
        "config OK",
    ]

    (model_dir / "config.json").unlink()
    report, ok = run_validate("sft/local_model", [f"output_dir={tmp_path}", f"model.path={model_dir}", CHATS], CONFIGS)
    assert problems(report) == [f"model.path: '{model_dir}' has no config.json: not a Hugging Face model directory"]


def test_a_model_directory_without_all_its_weights_is_a_problem_before_a_launch(tmp_path, model_dir):
    """A config.json is not a model: a directory whose weights never arrived, or whose index names shards that
    are missing (a download cut short), is named by validate, not by an OSError from deep in the loading."""
    run = [f"output_dir={tmp_path / 'run'}", f"model.path={model_dir}", CHATS]
    (model_dir / "model.safetensors").unlink()
    report, ok = run_validate("sft/local_model", run, CONFIGS)
    assert not ok and problems(report) == [
        f"model.path: '{model_dir}': it holds no model weights (model.safetensors, model.safetensors.index.json, "
        "pytorch_model.bin, pytorch_model.bin.index.json): a directory that save_pretrained wrote, or a complete "
        "download, has them"
    ]
    shards = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    (model_dir / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {f"w{i}": s for i, s in enumerate(shards)}})
    )
    (model_dir / shards[0]).touch()
    report, ok = run_validate("sft/local_model", run, CONFIGS)
    assert not ok and problems(report) == [
        f"model.path: '{model_dir}': 2 of the 3 weight files its model.safetensors.index.json names are missing "
        f"({shards[1]}, {shards[2]})"
    ]
    for shard in shards[1:]:
        (model_dir / shard).touch()
    assert run_validate("sft/local_model", run, CONFIGS) == ("config OK", True)
    (model_dir / "model.safetensors.index.json").unlink()
    (model_dir / "pytorch_model.bin").touch()  # what from_pretrained also reads
    assert run_validate("sft/local_model", run, CONFIGS) == ("config OK", True)


@pytest.mark.launch
def test_a_launch_on_a_model_directory_without_weights_says_so_in_one_block(tmp_path, model_dir):
    (model_dir / "model.safetensors").unlink()
    result = subprocess.run(
        [
            sys.executable,
            "recipes/sft.py",
            "--config-name",
            "sft/local_model",
            f"model.path={model_dir}",
            CHATS,
            f"tokenizer.path={DEMO_ASSETS / 'tokenizer'}",
            f"output_dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1 and "Traceback" not in output and "OSError" not in output
    assert output.count("chattune: error:") == 1 and f"'{model_dir}': it holds no model weights" in output


@pytest.mark.parametrize("config", ["sft/local_model", "dpo/local_model", "kto/local_model", "reward/local_model"])
def test_a_local_model_config_has_no_data_of_its_own_and_says_how_to_give_it(tmp_path, config):
    """sft/local_model used to train a real model on sft/tiny's demo chats when data.train was left out ("config
    OK"); like the other local_model configs it holds none, and the override its problem gives, with the example
    path replaced by the user's file, is the config a run takes."""
    from conftest import demo_tokenizer, tiny_config

    model = tmp_path / "model"
    tiny_config(max_position_embeddings=32768).save_pretrained(model)
    demo_tokenizer().save_pretrained(model)
    (model / "model.safetensors").touch()
    run = [f"model.path={model}", f"output_dir={tmp_path / 'out'}"]
    report, ok = run_validate(config, run, CONFIGS)
    (line,) = problems(report)
    given = "data.train: no data sources: training needs at least one; give your files, e.g. "
    assert not ok and line.startswith(given)
    (remedy,) = shlex.split(line.removeprefix(given))  # as a shell passes it
    if config.startswith("sft/"):
        assert remedy == "data.train=[/data/train.jsonl]"
        data = DEMO_ASSETS / "chat_train.jsonl"
    elif config.startswith("kto/"):
        assert remedy == "data.train=[{path: /data/train.jsonl, format: unpaired}]"
        data = tmp_path / "feedback.jsonl"
        data.write_text(
            "".join(
                json.dumps({"prompt": "What is 2 + 2?", "completion": reply, "label": label}) + "\n"
                for reply, label in (("4", True), ("5", False))
            )
        )
    else:
        assert remedy == "data.train=[{path: /data/train.jsonl, format: preference}]"
        data = DEMO_ASSETS / "preference_train.jsonl"
    report, ok = run_validate(config, [*run, remedy.replace("/data/train.jsonl", str(data))], CONFIGS, read_data=True)
    assert (report, ok) == ("config OK", True)


def test_an_architecture_the_launch_refuses_is_a_problem_before_it(tmp_path):
    """BLOOM (ALiBi: each token's attention depends on its place in the row) passed validate and was refused by the
    launch's start-up check; validate runs the same check, on the config alone."""
    from hydra.utils import instantiate

    from chattune.errors import UnsupportedModel
    from chattune.model.checks.architecture import check_architecture

    bloom = "{_target_: transformers.BloomConfig, hidden_size: 64, n_layer: 2, n_head: 4}"
    report, ok = run_validate("sft/tiny", [f"output_dir={tmp_path}", f"model.config={bloom}"], CONFIGS)
    with pytest.raises(UnsupportedModel) as refused:  # what the launch says (chattune.model.build)
        check_architecture(instantiate(OmegaConf.create(bloom)))
    assert not ok and report.splitlines() == [f"model.config: {refused.value}", "1 problem(s)"]
    assert str(refused.value).startswith("BloomForCausalLM does not keep packed documents apart.")

    # An 8B-shaped config's miniature (two of its layers, a 1024-token vocabulary) is left to the launch: said.
    width, inner, kv = 4096, 14336, 1024
    layer = 2 * width * width + 2 * width * kv + 3 * width * inner + 2 * width
    parameters = 2 * layer + 2 * 1024 * width + width  # untied input and output embeddings, the final norm
    eight_b = (
        "{_target_: transformers.LlamaConfig, hidden_size: 4096, intermediate_size: 14336, num_hidden_layers: 32, "
        "num_attention_heads: 32, num_key_value_heads: 8, tie_word_embeddings: false}"
    )
    report, ok = run_validate("sft/tiny", [f"output_dir={tmp_path}", f"model.config={eight_b}"], CONFIGS)
    assert ok and report.splitlines() == [
        f"note: model.config: its architecture is checked when the run starts: its miniature "
        f"({parameters / 1e6:.0f}M parameters) takes too long to build here",
        "config OK",
    ]


def test_a_typo_inside_model_config_gets_the_name_it_is_close_to(tmp_path):
    """`model.config.hiden_size=64` got "add it with +model.config.hiden_size=64" (a Hugging Face config takes any
    keyword: the typo would train in silence) and the right name only in a note. The override each problem
    gives, as written, is the config a run takes."""
    run = [f"output_dir={tmp_path}"]
    for typo, problem in (
        ("model.config.hiden_size=96", "did you mean model.config.hidden_size? (model.config.hidden_size=96)"),
        # a named parameter of LlamaConfig that sft/tiny's section does not hold: added with "+"
        (
            "model.config.rms_norm_epss=1e-5",
            "did you mean model.config.rms_norm_eps? (+model.config.rms_norm_eps=1e-5)",
        ),
    ):
        key = typo.split("=")[0]
        report, ok = run_validate("sft/tiny", [*run, typo], CONFIGS)
        assert not ok and report.splitlines() == [f"{key}: unknown key; {problem}", "1 problem(s)"]
        remedy = problem.rsplit("(", 1)[1].removesuffix(")")
        assert run_validate("sft/tiny", [*run, remedy], CONFIGS) == ("config OK", True)
    # A key close to no parameter is new: "+" adds it (passed on as an extra keyword, noted).
    report, ok = run_validate("sft/tiny", [*run, "model.config.my_flag=1"], CONFIGS)
    assert problems(report) == ["model.config.my_flag: not in the config; add it with +model.config.my_flag=1"]


def test_a_config_group_choice_that_does_not_exist_gets_the_nearest(tmp_path):
    """`peft=lorra` got Hydra's bare "Could not find 'peft/lorra'"; `peft=null`, a traceback (Hydra's ValueError)."""
    run = [f"output_dir={tmp_path}"]
    report, ok = run_validate("sft/tiny", [*run, "peft=lorra"], CONFIGS)
    assert not ok and report.splitlines() == [
        "peft: no config peft/lorra; did you mean peft=lora? (the configs of peft: lora, qlora)",
        "1 problem(s)",
    ]
    assert run_validate("sft/tiny", [*run, "peft=lora", "export.merge=true"], CONFIGS) == ("config OK", True)
    report, ok = run_validate("sft/tiny", [*run, "peft=null"], CONFIGS)
    assert not ok and problems(report) == [
        "peft: a config group is left out with ~peft, not peft=null (the configs of peft: lora, qlora)"
    ]
    assert run_validate("sft/tiny", [*run, "~peft"], CONFIGS) == ("config OK", True)


def test_adapters_on_a_random_init_base_are_said_to_load_nowhere(tmp_path, model_dir):
    """peft=lora with model.path null: the adapter names no base (saved nowhere) and the run's chat suggestion
    failed on it; a note in validate and at the launch's start says so, and its two ways out take it away."""
    note = (
        "peft: the adapters train on a random-init base built from model.config, saved nowhere: output_dir/adapter "
        "names no base, so neither chattune chat nor PeftModel.from_pretrained can load it. Start from a model "
        "directory (model.path=DIR), or set export.merge=true to also write the base with the adapters merged "
        "(output_dir/hf)"
    )
    run = [f"output_dir={tmp_path / 'out'}", "peft=lora"]
    assert run_validate("sft/tiny", run, CONFIGS) == (f"note: {note}\nconfig OK", True)
    assert check_config(compose_config("sft/tiny", run), SFT) == [note]  # what the recipe logs at its start
    assert run_validate("sft/tiny", [*run, "export.merge=true"], CONFIGS) == ("config OK", True)
    assert run_validate("sft/tiny", [*run, f"model.path={model_dir}"], CONFIGS) == ("config OK", True)


def test_hydra_flags_after_overrides_are_put_first():
    """`recipes/sft.py max_steps=3 --config-name sft/local_model data.eval=[]` stopped every rank with Hydra's usage
    message; the recipe's launch puts Hydra's flags first, which Hydra's own parser then reads as the user meant."""
    from hydra._internal.utils import get_args_parser

    from chattune.launch.app import hydra_flags_first

    words = ["max_steps=3", "--config-name", "sft/local_model", "data.eval=[]", "-m", "seed=1,2", "--cfg", "job"]
    with pytest.raises(SystemExit):
        get_args_parser().parse_args(words)
    args = get_args_parser().parse_args(hydra_flags_first(words))
    assert (args.config_name, args.multirun, args.cfg) == ("sft/local_model", True, "job")
    assert args.overrides == ["max_steps=3", "data.eval=[]", "seed=1,2"]
    assert hydra_flags_first(["--config-name=sft/tiny", "a=1", "-cp", "/configs", "b=2"]) == [
        "--config-name=sft/tiny",
        "-cp",
        "/configs",
        "a=1",
        "b=2",
    ]


def test_dpo_tiny_is_clean_given_its_sft_model(tmp_path, model_dir):
    report, ok = run_validate("dpo/tiny", [f"output_dir={tmp_path}", f"model.path={model_dir}"], CONFIGS)
    assert (report, ok) == ("config OK", True)
    # Positions restart with each side of a pair: the note names what may outgrow them
    (model_dir / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 1024}))
    report, ok = run_validate("dpo/tiny", [f"output_dir={tmp_path}", f"model.path={model_dir}"], CONFIGS)
    assert ok and report.splitlines()[0] == (
        "note: data.max_tokens_per_microbatch: 2048 is more than model.path's max_position_embeddings 1024: a pair's "
        "side (the prompt and one reply) longer than 1024 tokens gets positions the model was not trained on"
    )
    (model_dir / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 32768}))

    missing = tmp_path / "no-sft-run" / "hf"
    report, ok = run_validate("dpo/tiny", [f"output_dir={tmp_path}", f"model.path={missing}"], CONFIGS)
    assert report.splitlines() == [f"model.path: '{missing}' is not a local directory", "1 problem(s)"]


# How a user runs each shipped config (`chattune ls`), with what it needs besides: "{model}" is a local model
# directory like a real one (32768 positions, the demo tokenizer); dpo/tiny finds sft/tiny's own export where it
# looks for it (outputs/sft-tiny/hf).
SHIPPED_USES = {
    "sft/tiny": [("sft/tiny", [])],
    "dpo/tiny": [("dpo/tiny", [])],
    "sft/local_model": [("sft/local_model", ["model.path={model}", "data.train=[${{demo_asset:chat_train.jsonl}}]"])],
    "dpo/local_model": [
        (
            "dpo/local_model",
            ["model.path={model}", "data.train=[{{path:${{demo_asset:preference_train.jsonl}},format:preference}}]"],
        )
    ],
    "reward/tiny": [("reward/tiny", [])],
    "reward/local_model": [
        (
            "reward/local_model",
            ["model.path={model}", "data.train=[{{path:${{demo_asset:preference_train.jsonl}},format:preference}}]"],
        )
    ],
    "kto/tiny": [("kto/tiny", [])],
    "kto/local_model": [
        (
            "kto/local_model",
            ["model.path={model}", "data.train=[{{path:${{demo_asset:preference_train.jsonl}},format:preference}}]"],
        )
    ],
    "grpo/tiny": [("grpo/tiny", [])],
    "grpo/local_model": [
        (
            "grpo/local_model",
            ["model.path={model}", "data.train=[{{path:${{demo_asset:sort_prompts.jsonl}},format:prompt}}]"],
        )
    ],
    "peft/lora": [
        ("sft/tiny", ["peft=lora", "export.merge=true"]),  # (a random-init base: its merged export is what loads)
        ("dpo/tiny", ["peft=lora"]),
        ("reward/tiny", ["peft=lora"]),
        ("kto/tiny", ["peft=lora"]),
        ("grpo/tiny", ["peft=lora"]),
    ],
    "peft/qlora": [  # CUDA with bitsandbytes only
        ("sft/local_model", ["model.path={model}", "data.train=[${{demo_asset:chat_train.jsonl}}]", "peft=qlora"])
    ],
}


def test_the_uses_cover_every_shipped_config():
    from chattune.cli.catalog import configs

    assert sorted(SHIPPED_USES) == sorted(entry.name for entry in configs())


@pytest.mark.parametrize("config, overrides", [use for uses in SHIPPED_USES.values() for use in uses])
def test_every_shipped_config_validates_without_a_note(tmp_path, monkeypatch, config, overrides):
    """As `chattune validate` runs it (the data read too), from a fresh directory: "config OK" and nothing else.
    dpo/tiny used to note its own budget against the 1024 positions sft/tiny's model said it was built for."""
    from hydra.utils import instantiate

    from chattune.launch.run_rules import _cuda_available
    from conftest import demo_tokenizer, tiny_config

    if "peft=qlora" in overrides and not (_cuda_available() and importlib.util.find_spec("bitsandbytes")):
        pytest.skip("QLoRA validates on CUDA with bitsandbytes only (test_qlora_is_refused_on_the_cpu)")
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "model"
    tiny_config(max_position_embeddings=32768).save_pretrained(model)
    demo_tokenizer().save_pretrained(model)
    (model / "model.safetensors").touch()  # its weights are only looked for
    if config in (
        "dpo/tiny",
        "reward/tiny",
        "kto/tiny",
        "grpo/tiny",
    ):  # sft/tiny's export: its model.config, as the run writes it into hf/
        sft_export = tmp_path / "outputs" / "sft-tiny" / "hf"
        instantiate(compose_config("sft/tiny", []).model.config).save_pretrained(sft_export)
        (sft_export / "model.safetensors").touch()
    report, ok = run_validate(config, [o.format(model=model) for o in overrides], CONFIGS, read_data=True)
    assert (report, ok) == ("config OK", True)


def test_a_users_config_dir_building_on_dpo_tiny_and_its_required_keys(tmp_path, model_dir):
    # Merged over dpo/tiny, a ??? keeps dpo/tiny's value: only the config file itself shows the key required.
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "run.yaml").write_text(
        "# @package _global_\ndefaults:\n  - /dpo/tiny\n  - _self_\n\nmodel:\n  path: ???\n"
    )
    report, ok = run_validate("mine/run", [f"output_dir={tmp_path}"], tmp_path)
    assert problems(report) == ["model.path: required by mine/run (???), not set"]

    report, ok = run_validate(
        "mine/run",
        [f"output_dir={tmp_path}", f"model.path={model_dir}", "data.train=[]", "data.overlong=split"],
        tmp_path,
    )
    assert problems(report) == [
        "data.overlong: 'split' is not one of drop, error",  # a DPO config: DPO's choices
        "data.train: no data sources: training needs at least one; give your files, e.g. "
        "'data.train=[{path: /data/train.jsonl, format: preference}]'",
    ]


def test_every_problem_is_reported_in_one_run(tmp_path):
    missing = tmp_path / "missing.jsonl"
    report, ok = run_validate(
        "sft/tiny",
        [
            f"output_dir={tmp_path}",
            "optimizer.lrr=0.1",
            "max_steps=ten",
            "data.overlong=trim",
            f"data.train=[{missing},org/chats,hf:org/chats]",
            "grad_accum_steps=0",
            "ledger=1",
            "optimizer.lr='3e-3'",
            "+data.max_token_per_microbatch=8",
            "data.train_on=assistants",
            "progress=bars",
        ],
        CONFIGS,
    )
    assert not ok
    assert sorted(problems(report)) == sorted(
        [
            "optimizer.lrr: unknown key; did you mean optimizer.lr?",
            "max_steps: expected an integer, got 'ten'",
            "data.overlong: 'trim' is not one of drop, truncate, split, error",
            f"data.train[0]: data file '{missing}' does not exist",
            "data.train[1]: data file 'org/chats' does not exist (a hub dataset is written hf:org/chats)",
            "grad_accum_steps: must be at least 1, got 0",
            "ledger: expected true or false, got 1",
            "optimizer.lr: expected a number, got '3e-3' (a quoted number: write it without quotes)",
            "data.max_token_per_microbatch: unknown key; did you mean data.max_tokens_per_microbatch?",
            "data.train_on: 'assistants' is not one of assistant, last_assistant, all; did you mean assistant?",
            "progress: 'bars' is not one of auto, bar, lines; did you mean bar?",
        ]
    )
    assert "note: data.train[2]: 'hf:org/chats': a hub dataset (needs the machine online)" in report
    assert report.splitlines()[-1] == "11 problem(s)"


def test_check_config_raises_the_same_lines(tmp_path):
    overrides = [
        f"output_dir={tmp_path}",
        "max_steps=ten",
        "data.overlong=trim",
        "grad_accum_steps=0",
        "data.num_workers=-1",
        "+optimizer.lrr=0.1",
    ]
    report, _ = run_validate("sft/tiny", overrides, CONFIGS)
    with pytest.raises(ConfigError) as raised:
        check_config(compose_config("sft/tiny", overrides), SFT, world_size=2)
    assert isinstance(raised.value, ValueError)
    assert raised.value.problems == problems(report) and len(raised.value.problems) == 5
    assert str(raised.value).splitlines() == [*problems(report), "5 problem(s)"]

    assert check_config(compose_config("sft/tiny", [f"output_dir={tmp_path}"]), SFT, world_size=2) == []


def test_composition_errors_are_problems_not_tracebacks(tmp_path):
    report, ok = run_validate("sft/tinny", [], CONFIGS)
    assert not ok and report.startswith(f"config: sft/tinny from {CONFIGS}: Cannot find primary config")
    assert report.splitlines()[0].endswith("; did you mean sft/tiny?") and report.splitlines()[1] == "1 problem(s)"

    report, ok = run_validate(
        "sft/tiny",
        [
            f"output_dir={tmp_path}",
            "data.train=[a,",
            "max_steps=0",
            "optimizer.eps=1e-6",
            "wandb.entity=me",
            "nosuch.key=1",
        ],
        CONFIGS,
    )
    assert problems(report) == [
        "override 'data.train=[a,': no viable alternative at input '[a,'",
        "nosuch: unknown key",
        "max_steps: must be at least 1, got 0",
        # valid keys, but Hydra adds a key that is not in the config only with "+"
        "optimizer.eps: not in the config; add it with +optimizer.eps=1e-6",
        "wandb.entity: not in the config; add it with +wandb.entity=me",
    ]


def test_targets_are_checked_against_their_signatures(tmp_path):
    report, _ = run_validate(
        "sft/tiny",
        [
            f"output_dir={tmp_path}",
            "optimizer._target_=torch.optim.SGD",
            "optimizer._partial_=false",
            "scheduler._target_=torch.optim.lr_scheduler.StepLR",
            "+scheduler.num_training_steps=5",
            "+model.config.hidden_sizee=64",
            "model.config._target_=transformers.NoSuchConfig",
        ],
        CONFIGS,
    )
    assert sorted(problems(report)) == sorted(
        [
            "optimizer._partial_: must be true: the recipe calls the result with its own arguments",
            "optimizer.betas: unknown key: not a parameter of torch.optim.SGD",
            "scheduler.num_warmup_steps: unknown key: not a parameter of torch.optim.lr_scheduler.StepLR",
            "scheduler.num_training_steps: passed by the recipe; remove it from the config",
            "scheduler.step_size: required by torch.optim.lr_scheduler.StepLR, not set",
        ]
        + [line for line in problems(report) if line.startswith("model.config._target_")]
    )
    assert [line for line in problems(report) if line.startswith("model.config._target_")][0].startswith(
        "model.config._target_: cannot import 'transformers.NoSuchConfig': transformers has no NoSuchConfig; did you "
        "mean transformers."
    )  # its close names: whatever this transformers holds

    # Hugging Face configs keep any extra keyword (and read old names such as rope_theta): a note, with the close name.
    report, ok = run_validate("sft/tiny", [f"output_dir={tmp_path}", "+model.config.hidden_sizee=64"], CONFIGS)
    assert (
        ok
        and (
            "note: model.config.hidden_sizee: not a named parameter of transformers.LlamaConfig "
            "(passed on as an extra keyword); did you mean model.config.hidden_size?"
        )
        in report
    )


def test_sources_formats_and_paths(tmp_path):
    text = tmp_path / "chats.txt"
    text.write_text("")
    report, _ = run_validate(
        "sft/tiny",
        [
            f"output_dir={tmp_path}",
            f"data.train=[{{path:{text}}},{{path:{tmp_path},formt:sharegpt}},{{path:{tmp_path},format:sharegtp}}]",
            f"data.eval=[{{path:{tmp_path},format:alpaca,columns:{{prompt:q}}}},{{path:{tmp_path},format:preference}}]",
            "tokenizer.path=/no/such/tokenizer",
        ],
        CONFIGS,
    )
    assert problems(report) == [
        f"data.train[0]: data file '{text}': expected .jsonl, .json or .parquet",
        "data.train[1].formt: unknown key; did you mean data.train[1].format?",
        "data.train[2].format: 'sharegtp' is not one of messages, sharegpt, prompt_completion, alpaca; did you mean sharegpt?",
        f"data.eval[0]: {tmp_path}: format 'alpaca' has no column(s) ['prompt']; its columns are "
        "['input', 'instruction', 'output', 'system']",
        "data.eval[1].format: 'preference' is not one of messages, sharegpt, prompt_completion, alpaca",
        "tokenizer.path: '/no/such/tokenizer' does not exist",
    ]

    report, _ = run_validate(
        "dpo/tiny",
        [
            f"output_dir={tmp_path}",
            f"model.path={tmp_path}",
            f"data.train=[{text}]",
            "data.overlong=truncate",
            "loss.type=dpo",
            "loss.beta=0",
        ],
        CONFIGS,
    )
    assert problems(report) == [
        "data.overlong: 'truncate' is not one of drop, error",
        "loss.type: 'dpo' is not one of sigmoid, robust, hinge, ipo, sigmoid_norm, simpo, orpo; did you mean ipo?",
        "data.train[0].format: 'messages' is not one of preference, sharegpt_preference (DPO reads preference pairs)",
        f"data.train[0]: data file '{text}': expected .jsonl, .json or .parquet",
        f"model.path: '{tmp_path}' has no config.json: not a Hugging Face model directory",
        "loss.beta: must be positive, got 0",
    ]


def test_numbers_that_cannot_work(tmp_path):
    report, _ = run_validate(
        "sft/tiny",
        [
            f"output_dir={tmp_path}",
            "stop_after_step=300",
            "data.pad_to_multiple_of=100",
            "keep_last_n=0",
            "log_every=0",
            "save_every=-1",
            "max_grad_norm=0",
            "max_steps=null",
            "data.num_epochs=1.5",
            "grad_accum_steps=true",
        ],
        CONFIGS,
    )
    assert problems(report) == [
        "max_steps: null is not allowed; expected an integer",
        "grad_accum_steps: expected an integer, got true",  # a bool is no int here
        "data.num_epochs: expected an integer, got 1.5",
        "log_every: must be at least 1, got 0",
        "save_every: must be at least 0, got -1 (0: never)",
        "keep_last_n: must be at least 1, got 0 (null keeps every checkpoint)",
        "max_grad_norm: must be positive (null: no clipping), got 0",
        "data.max_tokens_per_microbatch: 2048 is not a multiple of data.pad_to_multiple_of 100: padding could exceed the budget",
    ]
    report, _ = run_validate("sft/tiny", [f"output_dir={tmp_path}", "stop_after_step=300"], CONFIGS)
    assert problems(report) == ["stop_after_step: 300 is after max_steps 200: the run ends first"]


def fake_checkpoint(output_dir, meta: dict):
    """A committed checkpoint holding `meta` and a (tiny) intact DCP state: what validate reads of one."""
    import torch
    import torch.distributed.checkpoint as dcp

    checkpoint = output_dir / "checkpoints" / f"step_{meta['step']}"
    checkpoint.mkdir(parents=True)
    dcp.save({"x": torch.zeros(2)}, checkpoint_id=str(checkpoint), no_dist=True)
    for rank in range(meta["world_size"]):
        (checkpoint / f"train_state_rank{rank}.pt").write_bytes(b"")
    (checkpoint / "chattune.json").write_text(json.dumps(meta))
    return checkpoint


@pytest.mark.launch
def test_validate_decides_the_resume_and_the_output_dir_as_a_launch_would(tmp_path):
    from chattune.checkpoint.output_dir import OutputDirLock
    from chattune.checkpoint.resume import run_fingerprint

    checkpoint = fake_checkpoint(
        tmp_path,
        {
            "world_size": 2,
            "step": 5,
            "fingerprint": run_fingerprint(compose_config("sft/tiny", [f"output_dir={tmp_path}"])),
        },
    )
    # The recipes' own check leaves output_dir to the launch, which decides it holding the directory's lock.
    assert (
        check_config(compose_config("sft/tiny", [f"output_dir={tmp_path}", "optimizer.lr=1"]), SFT, world_size=4) == []
    )

    report, ok = run_validate("sft/tiny", [f"output_dir={tmp_path}"], CONFIGS)
    assert (
        ok
        and f"note: resume: continues from {checkpoint} at step 5, written by 2 rank(s): launch with --nproc_per_node 2"
        in report
    )
    invariant = tmp_path / "invariant"  # world-size-invariant steps: any divisor of M resumes the checkpoint
    fake_checkpoint(
        invariant,
        {
            "world_size": 2,
            "step": 3,
            "fingerprint": run_fingerprint(
                compose_config("sft/tiny", [f"output_dir={invariant}", "data.microbatches_per_step=4"])
            ),
        },
    )
    report, ok = run_validate("sft/tiny", [f"output_dir={invariant}", "data.microbatches_per_step=4"], CONFIGS)
    assert (
        ok
        and "written by 2 rank(s): launch with any --nproc_per_node that divides data.microbatches_per_step=4 (1, 2, 4)"
        in report
    ), report
    report, ok = run_validate("sft/tiny", [f"output_dir={tmp_path}"], CONFIGS, world_size=4)
    assert problems(report) == [
        f"resume: {checkpoint} was written by 2 rank(s), this run has 4: each rank's data "
        "position is a place in its own share of the epoch, which another number of ranks "
        "would split differently. Relaunch with --nproc_per_node 2 (runs with data.microbatches_per_step "
        "resume on any number of ranks that divides it)."
    ]
    report, ok = run_validate("sft/tiny", [f"output_dir={tmp_path}", "optimizer.lr=1e-3", "seed=1"], CONFIGS)
    assert not ok and "config optimizer.lr: 0.003 -> 0.001\n  config seed: 42 -> 1" in report
    assert "resume with resume_allow_changes=[optimizer.lr,seed] (accepts only these changes" in report
    report, ok = run_validate(
        "sft/tiny",
        [
            f"output_dir={tmp_path}",
            "optimizer.lr=1e-3",
            "resume_allow_changes=[optimizer]",
            "data.num_workers=2",
            "max_steps=300",
        ],
        CONFIGS,
    )
    assert ok, report
    assert "note: resume: config optimizer.lr: 0.003 -> 0.001 (accepted by resume_allow_changes)" in report
    assert (
        "note: resume: config data.num_workers: 0 -> 2 (the same documents and updates, computed differently)" in report
    )
    assert "note: resume: max_steps: 200 -> 300 (the schedule is recomputed for the new horizon)" in report
    report, ok = run_validate("sft/tiny", [f"output_dir={tmp_path}", "stop_after_step=5"], CONFIGS)
    assert not ok and "stop_after_step=5, but this run continues from" in report
    report, ok = run_validate("sft/tiny", [f"output_dir={tmp_path}", "resume=null"], CONFIGS)
    assert not ok and f"output_dir: output_dir {tmp_path} holds an earlier run's results (checkpoints)" in report
    report, ok = run_validate("sft/tiny", [f"output_dir={tmp_path}", "resume=null", "overwrite=true"], CONFIGS)
    assert ok and f"note: output_dir: {tmp_path / 'checkpoints'} would be set aside as checkpoints.abandoned" in report
    report, ok = run_validate("sft/tiny", [f"output_dir={tmp_path}", f"resume={tmp_path}"], CONFIGS)
    assert problems(report) == [
        f"resume: resume={tmp_path}: {tmp_path} is not a complete chattune checkpoint (no chattune.json)"
    ]
    # A live run's lock (held here by a child process, as another launch would hold it).
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; "
            "from chattune.checkpoint.output_dir import OutputDirLock; OutputDirLock(Path(sys.argv[1])).acquire(); "
            "print('locked', flush=True); time.sleep(60)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        report, ok = run_validate("sft/tiny", [f"output_dir={tmp_path}"], CONFIGS)
        assert not ok and f"output_dir: in use by another run: pid {holder.pid} on host " in report
    finally:
        holder.kill()
        holder.wait()
    assert not OutputDirLock(tmp_path).is_held()  # a dead holder's lock is free again
    assert run_validate("sft/tiny", [f"output_dir={tmp_path}"], CONFIGS)[1]
    (tmp_path / "file").write_text("")
    report, ok = run_validate("sft/tiny", [f"output_dir={tmp_path / 'file' / 'run'}"], CONFIGS)
    assert problems(report) == [f"output_dir: {tmp_path / 'file'} is not a directory"]


def test_the_schema_defaults_are_the_shipped_base_configs_and_its_nulls_have_types():
    # The schema in code and the YAML a recipe composes must not drift apart: same keys, same defaults.
    for recipe, name in (("sft", "sft/tiny"), ("dpo", "dpo/tiny"), ("reward", "reward/tiny")):
        schema = SCHEMAS[recipe]
        assert dataclasses.asdict(schema()) == OmegaConf.to_container(compose_config(name, []), resolve=False)
        null_by_default = [key for key, value in _leaves(dataclasses.asdict(schema())) if value is None]
        untyped = [key for key in null_by_default if not _nullable(schema, key)]
        assert null_by_default and untyped == [], "give these null-by-default keys an `X | None` type"


def _nullable(schema: type, key: str) -> bool:
    section = schema
    for name in key.split("."):
        hint = typing.get_type_hints(section)[name]
        section = next((a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)), hint)
    return type(None) in typing.get_args(hint)


def _leaves(tree: dict, prefix: str = ""):
    for name, value in tree.items():
        if isinstance(value, dict) and "_target_" not in value:
            yield from _leaves(value, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", value


def test_every_key_of_the_schema_has_a_meaning():
    def keys_without_help(section: type, prefix: str = ""):
        hints = typing.get_type_hints(section)
        for item in dataclasses.fields(section):
            nested = [
                a for a in (typing.get_args(hints[item.name]) or (hints[item.name],)) if dataclasses.is_dataclass(a)
            ]
            if nested:
                yield from keys_without_help(nested[0], f"{prefix}{item.name}.")
            elif not item.metadata.get("help"):
                yield prefix + item.name

    assert [key for schema in SCHEMAS.values() for key in keys_without_help(schema)] == []


def test_the_peft_group_and_its_keys(tmp_path):
    """peft=lora selects configs/peft/lora.yaml; its keys are checked like every other section's."""
    report, ok = run_validate("sft/tiny", [f"output_dir={tmp_path}", "peft=lora", "peft.rank=8"], CONFIGS)
    assert ok and problems(report) == []
    assert OmegaConf.to_container(compose_config("sft/tiny", ["peft=lora"]).peft) == dataclasses.asdict(
        typing.get_type_hints(SCHEMAS["sft"])["peft"].__args__[0]()
    )
    report, ok = run_validate(
        "sft/tiny", [f"output_dir={tmp_path}", "peft=lora", "peft.rnk=8", "peft.rank=0", "peft.dropout=1.5"], CONFIGS
    )
    assert not ok and problems(report) == [
        "peft.rnk: unknown key; did you mean peft.rank?",
        "peft.rank: must be at least 1, got 0",
        "peft.dropout: must be in [0, 1), got 1.5",
    ], report
    report, ok = run_validate(
        "sft/tiny",
        [f"output_dir={tmp_path}", "peft=lora", "peft.use_dora=true", "peft.modules_to_save=[embed_tokens]"],
        CONFIGS,
    )
    assert ok and problems(report) == []
    report, ok = run_validate(
        "sft/tiny", [f"output_dir={tmp_path}", "peft=lora", "peft.quantize_base=nf8", "peft.use_dora=maybe"], CONFIGS
    )
    assert not ok and problems(report) == [
        "peft.use_dora: expected true or false, got 'maybe'",
        "peft.quantize_base: 'nf8' is not one of nf4, fp4; did you mean nf4?",
    ], report


def test_qlora_is_refused_on_the_cpu(tmp_path):
    """peft=qlora composes lora.yaml with a 4-bit base; on a CPU it is one clear problem, not a crash later."""
    assert compose_config("sft/tiny", ["peft=qlora"]).peft.quantize_base == "nf4"
    report, ok = run_validate(
        "dpo/tiny",
        [
            f"output_dir={tmp_path}",
            "peft=qlora",
            "device=cpu",
            "model.path=null",
            "model.config._target_=transformers.Qwen3Config",
        ],
        CONFIGS,
    )
    assert not ok and problems(report) == [
        "peft.quantize_base: a 4-bit base (QLoRA) trains on CUDA only: it saves GPU memory with bitsandbytes' GPU "
        "kernels. On the CPU, set peft.quantize_base=null (LoRA on the full-precision base)"
    ], report


def test_notes_for_a_warmup_or_a_save_interval_longer_than_the_run(tmp_path):
    report, ok = run_validate("sft/tiny", [f"output_dir={tmp_path}", "max_steps=5"], CONFIGS)
    assert ok
    assert (
        "note: scheduler.num_warmup_steps: 10 is more than max_steps 5: the learning rate never reaches optimizer.lr"
        in report.splitlines()
    )
    assert (
        "note: save_every: 100 is more than max_steps 5: no checkpoint is written, so the run can be neither resumed "
        "nor extended (its export is still written)" in report.splitlines()
    )
    report, _ = run_validate("sft/tiny", [f"output_dir={tmp_path}"], CONFIGS)
    assert "num_warmup_steps" not in report and "save_every" not in report


def test_a_resume_is_refused_when_the_chat_template_changes_even_in_a_file_of_the_same_name(tmp_path):
    """The fingerprint holds the template's text (by hash): a file edited in place is a change, refused with the
    remedy that accepts it; a checkpoint written before tokenizer.chat_template existed resumes with null."""
    from chattune.checkpoint.resume import run_fingerprint

    template = tmp_path / "mine.jinja"
    template.write_text((PROJECT_ROOT / "chattune/assets/chat_templates/chatml.jinja").read_text())
    out = tmp_path / "run"
    overrides = [f"output_dir={out}", f"tokenizer.chat_template={template}"]
    fake_checkpoint(
        out, {"world_size": 1, "step": 5, "fingerprint": run_fingerprint(compose_config("sft/tiny", overrides))}
    )
    assert run_validate("sft/tiny", overrides, CONFIGS, world_size=1)[1]
    template.write_text(template.read_text().replace("# Tools", "# Functions"))
    report, ok = run_validate("sft/tiny", overrides, CONFIGS, world_size=1)
    assert not ok and f"\n  config tokenizer.chat_template: '{template} (sha256 " in report, report
    assert "resume with resume_allow_changes=[tokenizer.chat_template] (accepts only these changes" in report
    report, ok = run_validate(
        "sft/tiny", [*overrides, "resume_allow_changes=[tokenizer.chat_template]"], CONFIGS, world_size=1
    )
    assert ok and f"note: resume: config tokenizer.chat_template: '{template} (sha256 " in report, report
    report, ok = run_validate("sft/tiny", [f"output_dir={out}"], CONFIGS, world_size=1)  # back to the tokenizer's own
    assert not ok and f"config tokenizer.chat_template: '{template} (sha256 " in report and "' -> None" in report

    older = tmp_path / "older"  # written before the key: its fingerprint does not have it
    fingerprint = run_fingerprint(compose_config("sft/tiny", [f"output_dir={older}"]))
    del fingerprint["config"]["tokenizer.chat_template"]
    fake_checkpoint(older, {"world_size": 1, "step": 5, "fingerprint": fingerprint})
    assert run_validate("sft/tiny", [f"output_dir={older}"], CONFIGS, world_size=1)[1]
    report, ok = run_validate(
        "sft/tiny", [f"output_dir={older}", "tokenizer.chat_template=chatml"], CONFIGS, world_size=1
    )
    assert not ok and "config tokenizer.chat_template: None -> 'chatml (sha256 " in report, report


def test_a_bad_chat_template_is_reported_with_the_other_problems(tmp_path):
    report, ok = run_validate(
        "sft/tiny",
        [
            f"output_dir={tmp_path}",
            "tokenizer.chat_template=chatm",
            "max_steps=ten",
            f"data.train=[{tmp_path}/missing.jsonl]",
        ],
        CONFIGS,
    )
    assert problems(report) == [
        "max_steps: expected an integer, got 'ten'",
        f"data.train[0]: data file '{tmp_path}/missing.jsonl' does not exist",
        "tokenizer.chat_template: 'chatm' is not a template chattune ships; did you mean chatml? (shipped: chatml, "
        "llama3; otherwise the path of a template file (./NAME for one in the working directory) or inline Jinja, "
        "holding {{ or {%)",
    ]


@pytest.mark.launch
def test_a_schedule_target_is_checked_from_its_source_without_importing_its_module():
    """transformers' scheduler module imports peft and bitsandbytes (seconds): validate reads the function's
    parameters from its source instead, and they must be exactly what importing it gives."""
    script = """
import inspect, sys, transformers
from chattune.launch.schema_checks import target_parameters
names = ["get_cosine_schedule_with_warmup", "get_linear_schedule_with_warmup", "get_constant_schedule",
         "get_cosine_with_hard_restarts_schedule_with_warmup", "get_wsd_schedule"]
read = {n: target_parameters(f"transformers.{n}") for n in names}
assert all(target is None for target, _ in read.values()), "imported, not read"
assert "transformers.optimization" not in sys.modules
for n, (_, parameters) in read.items():
    real = inspect.signature(getattr(transformers, n)).parameters
    assert [(k, p.kind, p.default is p.empty) for k, p in parameters.items()] == \\
        [(k, p.kind, p.default is p.empty) for k, p in real.items()], n
print("same")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.stdout.strip() == "same", result.stderr[-3000:]
    report, ok = run_validate("sft/tiny", ["scheduler.num_cycle=0.5", "~scheduler.num_warmup_steps"], CONFIGS)
    assert problems(report) == [
        "scheduler.num_cycle: unknown key; did you mean scheduler.num_cycles?",
        "scheduler.num_warmup_steps: required by chattune.train.schedule.cosine_with_warmup, not set",
    ]


def test_a_sample_prompts_file_that_is_not_there_is_a_problem(tmp_path):
    missing = tmp_path / "prompts.jsonl"
    report, ok = run_validate("sft/tiny", [f"output_dir={tmp_path / 'out'}", f"eval.sample_prompts={missing}"], CONFIGS)
    assert not ok and problems(report) == [f"eval.sample_prompts: prompts file {str(missing)!r} does not exist"]
    missing.write_text('{"prompt": "Hi"}\n')
    report, ok = run_validate(
        "sft/tiny", [f"output_dir={tmp_path / 'out'}", f"eval.sample_prompts={missing}", "eval.samples=0"], CONFIGS
    )
    assert ok, report


def test_a_model_config_is_built_by_validate_and_a_misspelled_class_names_the_close_ones(tmp_path, capsys):
    """Values transformers rejects and a class that does not exist are one problem each, before any rank starts;
    nothing else is printed (Hydra logs its own import error otherwise)."""
    report, ok = run_validate(
        "sft/tiny",
        [f"output_dir={tmp_path}", "model.config.hidden_size=64", "model.config.num_attention_heads=6"],
        CONFIGS,
    )
    assert not ok and problems(report) == [
        "model.config: transformers.LlamaConfig rejects it: "
        "The hidden size (64) is not a multiple of the number of attention heads (6)."
    ]
    report, ok = run_validate(
        "sft/tiny", [f"output_dir={tmp_path}", "model.config._target_=transformers.Qwen35Config"], CONFIGS
    )
    assert not ok and len(problems(report)) == 1
    assert problems(report)[0].startswith(
        "model.config._target_: cannot import 'transformers.Qwen35Config': transformers has no Qwen35Config; did you "
        "mean transformers.Qwen3_5Config"
    )
    captured = capsys.readouterr()
    assert "Are you sure" not in captured.out + captured.err
    # The launch checks the composed config with the same rules (check_config): the same line.
    cfg = compose_config(
        "sft/tiny", [f"output_dir={tmp_path}", "model.config.hidden_size=64", "model.config.num_attention_heads=6"]
    )
    with pytest.raises(ConfigError, match=r"model.config: transformers.LlamaConfig rejects it: The hidden size"):
        check_config(cfg, SFT)


def test_a_held_out_split_that_is_never_evaluated_is_a_note(tmp_path):
    report, ok = run_validate("sft/tiny", [f"output_dir={tmp_path}", "data.eval_split=0.1", "eval_every=0"], CONFIGS)
    assert (
        ok
        and (
            "note: data.eval_split: 0.1 holds records out of training, and eval_every=0 never evaluates them: set "
            "eval_every, or data.eval_split=0 to train on every record"
        )
        in report.splitlines()
    )
    report, _ = run_validate("sft/tiny", [f"output_dir={tmp_path}", "data.eval_split=0.1"], CONFIGS)
    assert "eval_split" not in report


QWEN3_MOE = (
    "{_target_: transformers.Qwen3MoeConfig, hidden_size: 64, intermediate_size: 128, moe_intermediate_size: 32, "
    "num_experts: 4, num_experts_per_tok: 2, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2}"
)
# (override, the key it sets, what that key must then hold: the section given whole replaces the section;
# a dict without _target_ and single keys merge into it, as Hydra does)
SECTION_FORMS = [
    (f"model.config={QWEN3_MOE}", "model.config", OmegaConf.to_container(OmegaConf.create(QWEN3_MOE))),
    (f"+model.config={QWEN3_MOE}", "model.config", OmegaConf.to_container(OmegaConf.create(QWEN3_MOE))),
    (
        "optimizer={_target_: torch.optim.SGD, _partial_: true, lr: 0.1}",
        "optimizer",
        {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1},
    ),
    ("model.config.hidden_size=96", "model.config.hidden_size", 96),
    ("model.config={hidden_size: 96}", "model.config.num_hidden_layers", 4),  # merged: sft/tiny's other keys stay
]


@pytest.mark.launch
@pytest.mark.parametrize(
    "override,key,expected", SECTION_FORMS, ids=[f[0].split("=")[0] + str(i) for i, f in enumerate(SECTION_FORMS)]
)
def test_a_section_given_whole_replaces_it_in_validate_and_the_launch_alike(tmp_path, override, key, expected):
    """`model.config={_target_: transformers.Qwen3MoeConfig, ...}` used to be refused ("not in the config"), and
    the suggested `+model.config=` merged into sft/tiny's Llama keys (its num_experts_per_tok stayed 8)."""
    from chattune.launch.compose import compose_reporting
    from chattune.launch.findings import Findings

    findings = Findings()
    validated, _ = compose_reporting("sft/tiny", [override], CONFIGS, findings)
    assert not findings.problems, findings.problems
    value = OmegaConf.select(validated, key)
    assert (OmegaConf.to_container(value) if isinstance(value, DictConfig) else value) == expected
    # What the recipe's launch composes (Hydra's own --cfg job prints it), from the same command line.
    import conftest

    shown = conftest.launch([sys.executable, "recipes/sft.py", "--cfg", "job", override], default_model=True)
    launched = OmegaConf.create(shown.stdout)
    assert OmegaConf.to_container(launched, resolve=False) == OmegaConf.to_container(validated, resolve=False)
    report, ok = run_validate("sft/tiny", [override, f"output_dir={tmp_path}"], CONFIGS)
    assert ok, report


def test_the_replica_groups_must_split_the_ranks_evenly():
    """parallel.replicate (HSDP): equal groups of whole context groups, else one problem naming the key."""

    def layout_problems(world_size: int, *overrides: str) -> list[str]:
        try:
            return check_config(compose_config("sft/tiny", list(overrides)), SFT, world_size=world_size)
        except ConfigError as error:
            return error.problems

    assert layout_problems(4, "parallel.replicate=2") == []
    assert layout_problems(8, "parallel.replicate=2", "parallel.context=2") == []
    assert layout_problems(4, "parallel.replicate=3") == [
        "parallel.replicate: 3 does not divide the 4 ranks of this launch into equal groups: each group holds a "
        "sharded copy of the parameters; launch a multiple of 3 ranks or choose a divisor"
    ]
    assert layout_problems(6, "parallel.replicate=2", "parallel.context=2") == [
        "parallel.replicate: 2 does not divide the 6 ranks of this launch into equal groups of whole context groups "
        "of 2: each group holds a sharded copy of the parameters; launch a multiple of 4 ranks or choose a divisor"
    ]
    assert layout_problems(4, "parallel.replicate=0")[0].startswith("parallel.replicate: ")


def test_tensor_parallelism_is_checked_before_a_launch():
    """parallel.tensor: groups of tensor x context ranks, heads divisible by both, and what is not built for a split
    model refused with the key named."""

    def layout_problems(world_size: int, *overrides: str, config: str = "sft/tiny") -> list[str]:
        try:
            return check_config(compose_config(config, list(overrides)), SFT, world_size=world_size)
        except ConfigError as error:
            return error.problems

    assert layout_problems(4, "parallel.tensor=2") == []
    # sft/tiny's 6 heads do not split 4 ways
    four = ["model.config.hidden_size=64", "model.config.num_attention_heads=4", "model.config.num_key_value_heads=4"]
    assert layout_problems(8, "parallel.tensor=2", "parallel.context=2", "parallel.replicate=2", *four) == []
    assert layout_problems(6, "parallel.tensor=4", *four) == [
        "parallel.tensor: 4 does not divide the 6 ranks of this launch: each group of 4 ranks splits every layer; "
        "launch a multiple of 4 ranks or choose a divisor"
    ]
    assert layout_problems(8, "parallel.tensor=4", "parallel.context=2", "model.config.num_attention_heads=4") == [
        "parallel.tensor: 4 x parallel.context=2 does not divide the model's 4 attention heads: each rank attends "
        "with heads/(tensor x context) of them",
        "parallel.tensor: 4 does not divide the model's 2 key-value heads: each rank holds 1/4 of them",
    ]
    assert (
        layout_problems(4, "parallel.tensor=2", "peft=lora", "export.merge=true") == []
    )  # LoRA splits with its base layers
    assert layout_problems(4, "parallel.tensor=2", "peft=lora", "peft.use_dora=true") == [
        "peft.use_dora: DoRA's magnitudes need each output row's whole norm, which a row-wise split divides: set "
        "parallel.tensor=1 or drop peft.use_dora"
    ]
    assert layout_problems(4, "parallel.tensor=2", "peft=lora", "peft.modules_to_save=[embed_tokens]") == [
        "peft.modules_to_save: modules trained in full beside the adapters are not split over tp ranks: set "
        "parallel.tensor=1 or drop peft.modules_to_save"
    ]
    # the remedies as written: the key dropped, or no split
    assert layout_problems(4, "parallel.tensor=2", "peft=lora", "export.merge=true", "peft.use_dora=false") == []
    assert layout_problems(4, "parallel.tensor=1", "peft=lora", "export.merge=true", "peft.use_dora=true") == []
    reward = compose_config("reward/tiny", ["model.path=null", "parallel.tensor=2", *four])
    assert check_config(reward, RECIPE_KINDS["reward"], world_size=4) == []  # its score head whole on every rank
    assert layout_problems(4, "parallel.tensor=2", "optimizer.in_backward=true", "max_grad_norm=null") == []


def test_a_tensor_group_wider_than_a_machine_is_advised_against(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun's ranks per machine
    four = ["model.config.hidden_size=64", "model.config.num_attention_heads=4"]
    four += ["model.config.num_key_value_heads=4"]
    notes = check_config(compose_config("sft/tiny", ["parallel.tensor=4", *four]), SFT, world_size=8)
    assert (
        "parallel.tensor: 4 is more than the 2 ranks per machine of this launch: each layer's all-reduces would "
        "cross machines; keep it within one (at most 2)"
    ) in notes
    assert check_config(compose_config("sft/tiny", ["parallel.tensor=2", *four]), SFT, world_size=8) == []


def test_the_grpo_recipe_refuses_what_it_does_not_read_yet_and_checks_its_rewards_and_teacher(tmp_path, model_dir):
    """Held-out prompts, a mixture and vLLM are refused, not ignored; a reward function's typo'd argument and one that
    cannot be imported are problems; distillation needs a teacher directory, and a teacher or reference the loss does
    not use is said to be unused."""
    base = [f"output_dir={tmp_path / 'out'}", f"model.path={model_dir}"]
    report, ok = run_validate(
        "grpo/tiny",
        [
            *base,
            "data.eval_split=0.1",
            "data.mixing.mode=static",
            "rollout.engine=vllm",
            "reward.functions=[{_target_: chattune.rl.rewards.answer_check, mdoe: numeric}, {_target_: nowhere.fn}]",
        ],
        CONFIGS,
    )
    assert not ok
    found = problems(report)
    for key, words in (
        ("data.eval_split:", "the training prompts are not split yet: give held-out prompts as data.eval"),
        ("data.mixing.mode:", "prompts are not mixed by weight yet"),
        ("rollout.engine:", "vllm is not available"),
        ("reward.functions[0]:", "mdoe: not a parameter of chattune.rl.rewards.answer_check"),
        ("reward.functions[1]:", "cannot import 'nowhere.fn'"),
    ):
        assert any(line.startswith(key) and words in line for line in found), (key, found)
    report, ok = run_validate("grpo/tiny", [*base, "loss.type=reverse_kl", "reward.functions=[]"], CONFIGS)
    assert problems(report) == ["teacher.path: loss.type=reverse_kl distills from a teacher: name its directory"]
    # held-out prompts that would never be answered; the remedies as written
    report, ok = run_validate("grpo/tiny", [*base, "eval_every=0"], CONFIGS)
    assert problems(report) == [
        "eval_every: is 0, so data.eval's held-out prompts are never answered: set eval_every (steps between "
        "evaluations), or data.eval=null"
    ]
    for remedy in ("eval_every=5", "data.eval=null"):
        report, ok = run_validate("grpo/tiny", [*base, "eval_every=0", remedy], CONFIGS)
        assert ok, (remedy, report)
    report, ok = run_validate("grpo/tiny", [*base, "data.eval=[{path: nowhere.jsonl, format: prompt}]"], CONFIGS)
    assert problems(report) == ["data.eval[0]: data file 'nowhere.jsonl' does not exist"]
    report, ok = run_validate("grpo/tiny", [*base, "reward.functions=[]"], CONFIGS)
    assert problems(report) == ["reward.functions: no reward function: the policy would learn nothing"]
    report, ok = run_validate("grpo/tiny", [*base, f"teacher.path={model_dir}", f"reference.path={model_dir}"], CONFIGS)
    assert ok and "note: teacher.path: unused" in report and "note: reference.path: unused: loss.beta=0" in report
    report, ok = run_validate(
        "grpo/tiny",
        [*base, "loss.type=reverse_kl", f"teacher.path={model_dir}", "rollout.skip_uniform_groups=true"],
        CONFIGS,
    )
    assert problems(report) == [
        "rollout.skip_uniform_groups: must be false with a teacher: distillation learns from every completion, "
        "whatever its rewards"
    ]
    report, ok = run_validate(
        "grpo/tiny",
        [*base, "loss.type=gkd", f"teacher.path={model_dir}", "parallel.tensor=2", "loss.beta=0.1"],
        CONFIGS,
    )
    assert problems(report) == [
        "parallel.tensor: must be 1 with loss.type=gkd: its divergence compares whole vocabularies, which tensor "
        "parallelism splits over ranks (loss.type=reverse_kl compares sampled tokens only and may split)",
        "loss.beta: must be 0 with loss.type=gkd: its loss is the divergence to the teacher, with no reference",
    ]
    report, ok = run_validate("grpo/tiny", [*base, "loss.type=gkd", f"teacher.path={model_dir}"], CONFIGS)
    assert ok, report  # the remedies as written: parallel.tensor=1 and loss.beta=0 (the defaults)
    report, ok = run_validate("grpo/tiny", [*base, "rollout.on_policy_share=0.5"], CONFIGS)
    assert problems(report) == [
        "rollout.on_policy_share: must be 1 unless loss.type=gkd: the other losses learn from the policy's own "
        "samples (their log-probs, rewards or importance ratios); gkd's divergence also trains on the data's replies"
    ]


def test_shared_prompts_are_refused_where_there_are_no_pairs_or_groups_or_the_row_is_split():
    pairs = ["model.path=null", "data.share_prompts=true"]
    for config in ("dpo/tiny", "reward/tiny", "grpo/tiny"):
        report, ok = run_validate(config, pairs, CONFIGS)
        assert ok, report
    for config, why in (
        ("sft/tiny", "the sft recipe trains no pairs or groups: nothing to share"),
        ("kto/tiny", "KTO's records are unpaired: nothing to share"),
    ):
        report, _ = run_validate(config, pairs, CONFIGS)
        assert f"data.share_prompts: must be false: {why}" in problems(report), (config, report)
    report, _ = run_validate("dpo/tiny", [*pairs, "parallel.context=2", "parallel.tensor=2"], CONFIGS)
    for key in ("context", "tensor"):
        assert (
            f"parallel.{key}: must be 1 with data.share_prompts=true: a row whose replies continue a shared prompt is "
            "not split over ranks yet (or set data.share_prompts=false)"
        ) in problems(report), report
    report, ok = run_validate("dpo/tiny", ["model.path=null", "parallel.context=2", "parallel.tensor=2"], CONFIGS)
    assert not any("share_prompts" in line for line in problems(report)), report  # the remedy as written


MOE = [  # a tiny Qwen3-MoE as model.config: 4 experts per layer
    "model.config._target_=transformers.Qwen3MoeConfig",
    "+model.config.num_experts=4",
    "+model.config.num_experts_per_tok=2",
    "+model.config.moe_intermediate_size=32",
]


def test_expert_parallelism_is_checked_before_a_launch(model_dir):
    """parallel.expert: it divides the ranks FSDP2 shards over and the experts per layer, needs a MoE model, and what
    is not built with it (tensor parallelism, LoRA) is refused with the key named; the remedies work as written."""

    def layout_problems(world_size: int, *overrides: str) -> list[str]:
        try:
            return check_config(compose_config("sft/tiny", list(overrides)), SFT, world_size=world_size)
        except ConfigError as error:
            return error.problems

    assert layout_problems(4, "parallel.expert=2", *MOE) == []
    assert layout_problems(4, "parallel.expert=4", *MOE) == []
    assert layout_problems(8, "parallel.expert=2", "parallel.replicate=2", "parallel.context=2", *MOE) == []
    assert layout_problems(6, "parallel.expert=4", *MOE) == [
        "parallel.expert: 4 does not divide the 6 ranks each parameter is sharded over (the ranks / "
        "parallel.replicate): each group of that many ranks splits the experts; choose a divisor of 6 or launch a "
        "multiple of 4 ranks per replica"
    ]
    assert layout_problems(4, "parallel.expert=2", "parallel.replicate=4", *MOE)[0].startswith(
        "parallel.expert: 2 does not divide the 1 ranks"
    )
    assert layout_problems(6, "parallel.expert=3", *MOE) == [
        "parallel.expert: 3 does not divide the model's 4 experts per layer: each rank of an expert group holds "
        "num_experts / 3 whole ones; choose a divisor of 4"
    ]
    assert layout_problems(4, "parallel.expert=2") == [  # sft/tiny's Llama
        "parallel.expert: the model has no mixture-of-experts layers (no num_experts, num_local_experts or "
        "n_routed_experts in its config) whose experts it could split; set parallel.expert=1"
    ]
    assert layout_problems(4, "parallel.expert=2", "parallel.tensor=2", *MOE) == [
        "parallel.expert: expert parallelism is not composed with parallel.tensor=2 yet (the ranks of a tp group "
        "compute the same tokens, which each would dispatch to the experts again); set parallel.tensor=1 or "
        "parallel.expert=1"
    ]
    assert layout_problems(4, "parallel.expert=2", "peft=lora", "export.merge=true", *MOE) == [
        "peft: LoRA with parallel.expert>1 is not built yet (peft wraps the stacked experts, and each expert's "
        "adapters would have to be split with them); set parallel.expert=1 or drop peft"
    ]
    # the remedies as written
    assert layout_problems(4, "parallel.expert=1", "peft=lora", "export.merge=true", *MOE) == []
    assert layout_problems(4, "parallel.expert=2", "parallel.tensor=1", *MOE) == []
    assert layout_problems(4, "parallel.expert=1", "parallel.tensor=2", *MOE) == []
    # a config class's own default count where model.config leaves it unset (Qwen3MoeConfig: 128 experts)
    assert layout_problems(4, "parallel.expert=2", "model.config._target_=transformers.Qwen3MoeConfig") == []
    assert layout_problems(6, "parallel.expert=3", "model.config._target_=transformers.Qwen3MoeConfig") == [
        "parallel.expert: 3 does not divide the model's 128 experts per layer: each rank of an expert group holds "
        "num_experts / 3 whole ones; choose a divisor of 128"
    ]
    # planned without --ranks: the memory table says what it needs instead of failing
    from chattune.launch.memory_plan import MemoryPlan

    report, ok = run_validate("sft/tiny", ["parallel.expert=2", *MOE], CONFIGS, memory=MemoryPlan(24 * 2**30))
    assert ok and "memory per rank: not estimated on 1 rank(s): parallel.expert=2: 2 does not divide" in report
    assert report.rstrip().splitlines()[-2].endswith("pass --ranks N, the launch's ranks"), report
    report, ok = run_validate(
        "sft/tiny", ["parallel.expert=2", *MOE], CONFIGS, world_size=2, memory=MemoryPlan(24 * 2**30)
    )
    assert ok and "expert dispatch buffers" in report, report
    # a model directory's config.json names its experts
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "model_type": "mixtral", "num_local_experts": 8}))
    assert layout_problems(4, f"model.path={model_dir}", "parallel.expert=4") == []
    assert layout_problems(6, f"model.path={model_dir}", "parallel.expert=3")[-1].startswith(
        "parallel.expert: 3 does not divide the model's 8 experts per layer"
    )
