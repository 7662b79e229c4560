"""The bad-input table: every kind of bad input a user can give gets one clear error that names the key,
file or record and the problem (or a counted skip), never a traceback, a silent drop or a hang.

Each row is checked through `chattune validate` (in-process, the same checks a recipe runs at its start,
plus the first records of every source), and the rows marked `launch` also through a real recipe launch,
whose stderr must hold the message exactly once and no traceback. Multi-rank failures (a bad record on
one rank, a busy output directory, a refused resume) are in tests/e2e/test_run_safety.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from chattune.config.paths import DEMO_ASSETS
from chattune.launch.validate import run_validate
from conftest import PROJECT_ROOT, SMALL_MODEL, launch

CONFIGS = PROJECT_ROOT / "configs"


@dataclass
class Case:
    overrides: list[str]  # {tmp} is the test's directory
    expected: str  # the problem line (formatted with {tmp}); it must appear exactly once
    launch: bool = False  # also check a recipe launch
    config: str = "sft/tiny"


def chat(content: str = "Hi.", reply: str | None = "Hello.") -> str:
    messages = [{"role": "user", "content": content}] + ([{"role": "assistant", "content": reply}] if reply else [])
    return json.dumps({"messages": messages})


def prepare(tmp: Path) -> None:
    """The files the cases point at."""
    (tmp / "empty.jsonl").write_text("")
    (tmp / "broken.jsonl").write_text(chat() + "\n{not json\n")
    (tmp / "control.jsonl").write_text(chat() + "\n" + chat("a\tb").replace("\\t", "\t") + "\n" + chat() + "\n")
    (tmp / "broken.json").write_text("[\n" + chat() + ",\n" + chat("a\tb").replace("\\t", "\t") + "\n]")
    (tmp / "no_reply.jsonl").write_text(chat() + "\n\n" + chat(reply=None) + "\n")
    (tmp / "wrong_column.jsonl").write_text(json.dumps({"conversation": []}) + "\n")
    (tmp / "list.json").write_text(json.dumps({"not": "a list"}))
    (tmp / "data.txt").write_text("hello\n")
    (tmp / "pairs.jsonl").write_text(json.dumps({"prompt": "2+2?", "chosen": "4", "rejected": "4"}) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(DEMO_ASSETS / "tokenizer")
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp / "no_template")
    (tmp / "file").write_text("")


CASES = {
    "typo'd key": Case(["optimizer.lrr=1e-3"], "optimizer.lrr: unknown key; did you mean optimizer.lr?", launch=True),
    "typo'd nested key": Case(
        ["data.max_token_per_microbatch=8"],
        "data.max_token_per_microbatch: unknown key; did you mean data.max_tokens_per_microbatch?",
    ),
    "wrong type": Case(["max_steps=ten"], "max_steps: expected an integer, got 'ten'"),
    "quoted number": Case(
        ["optimizer.lr='3e-3'"],
        "optimizer.lr: expected a number, got '3e-3' (a quoted number: write it without quotes)",
    ),
    "bad enum": Case(["data.on_bad_record=ignore"], "data.on_bad_record: 'ignore' is not one of error, skip"),
    "bad resume_allow_changes": Case(["resume_allow_changes=3"], "resume_allow_changes: expected true or false, got 3"),
    "unparseable override": Case(["data.train=[a,"], "override 'data.train=[a,'"),
    "number that cannot work": Case(["grad_accum_steps=0"], "grad_accum_steps: must be at least 1, got 0"),
    "unknown config": Case([], "config: sft/tinny from", config="sft/tinny"),
    "missing data file": Case(
        ["data.train=[{tmp}/missing.jsonl]"],
        "data.train[0]: data file '{tmp}/missing.jsonl' does not exist",
        launch=True,
    ),
    "missing relative path, not a hub id": Case(
        ["data.train=[my/chats]"],
        "data.train[0]: data file 'my/chats' does not exist (a hub dataset is written hf:my/chats)",
    ),
    "not a data file": Case(
        ["data.train=[{tmp}/data.txt]"], "data.train[0]: data file '{tmp}/data.txt': expected .jsonl, .json or .parquet"
    ),
    "empty data file": Case(
        ["data.train=[{tmp}/empty.jsonl]"], "data.train[0]: data source '{tmp}/empty.jsonl' holds no records"
    ),
    "json that is not a list": Case(
        ["data.train=[{tmp}/list.json]"],
        "data.train[0]: {tmp}/list.json: a .json data file must hold a list of records, got dict",
    ),
    "unparseable line": Case(
        ["data.train=[{tmp}/broken.jsonl]"],
        "data.train[0]: {tmp}/broken.jsonl record 2 (line 2): unparseable JSON at column 2: "
        "Expecting property name enclosed in double quotes; with data.on_bad_record=skip such "
        "records are skipped (counted and logged)",
    ),
    "raw tab inside a JSONL string": Case(
        ["data.train=[{tmp}/control.jsonl]"],
        "data.train[0]: {tmp}/control.jsonl record 2 (line 2): unparseable JSON at column 45: Invalid control character "
        "'\\t' in a string (JSON writes a tab as \\t, a newline as \\n); with data.on_bad_record=skip such records are "
        "skipped (counted and logged)",
        launch=True,
    ),
    "unparseable .json file": Case(
        ["data.train=[{tmp}/broken.json]"],
        "data.train[0]: {tmp}/broken.json: unparseable JSON at line 3, column 45: Invalid control character '\\t' in a "
        "string (JSON writes a tab as \\t, a newline as \\n); a .json file is parsed whole, so data.on_bad_record "
        "cannot skip a part of it (in a .jsonl file, one record a line, data.on_bad_record=skip skips the lines that "
        "do not parse)",
    ),
    "no assistant reply (after a blank line)": Case(
        ["data.train=[{tmp}/no_reply.jsonl]"],
        "data.train[0]: {tmp}/no_reply.jsonl record 2 (line 3): no assistant message, nothing to train",
    ),
    "wrong column": Case(
        ["data.train=[{tmp}/wrong_column.jsonl]"],
        "data.train[0]: {tmp}/wrong_column.jsonl record 1 (line 1): no 'messages' field for the messages format",
    ),
    "unknown source key": Case(
        ["data.train=[{{path: {tmp}/x.jsonl, fromat: sharegpt}}]"],
        "data.train[0].fromat: unknown key; did you mean data.train[0].format?",
    ),
    "missing tokenizer": Case(
        ["tokenizer.path={tmp}/no_such_tokenizer"], "tokenizer.path: '{tmp}/no_such_tokenizer' does not exist"
    ),
    "tokenizer without a chat template": Case(
        ["tokenizer.path={tmp}/no_template"],
        "tokenizer.path '{tmp}/no_template': the tokenizer has no chat template. chattune renders every record with a "
        "chat template. Use the tokenizer of a chat (instruct) model, or give one with tokenizer.chat_template: a "
        "template chattune ships (chatml, llama3), a file, or inline Jinja",
        launch=True,
    ),
    "unknown chat template name": Case(
        ["tokenizer.chat_template=chatm"],
        "tokenizer.chat_template: 'chatm' is not a template chattune ships; did you "
        "mean chatml? (shipped: chatml, llama3;",
        launch=True,
    ),
    "missing chat template file": Case(
        ["tokenizer.chat_template={tmp}/missing.jinja"],
        "tokenizer.chat_template: template file '{tmp}/missing.jinja' does not exist (shipped: chatml, llama3;",
    ),
    "a chat template whose special tokens the tokenizer lacks": Case(
        ["tokenizer.chat_template=llama3"],
        "tokenizer.chat_template: 'llama3' writes <|begin_of_text|>, <|start_header_id|>, <|end_header_id|>, "
        "<|eot_id|>, which the tokenizer at tokenizer.path",
        launch=True,
    ),
    "missing model directory": Case(
        ["model.path={tmp}/no_model"], "model.path: '{tmp}/no_model' is not a local directory"
    ),
    "output_dir under a file": Case(
        ["output_dir={tmp}/file/run"], "output_dir: {tmp}/file is not a directory", launch=True
    ),
    "resume from something that is not a checkpoint": Case(
        ["resume={tmp}"], "resume: resume={tmp}: {tmp} is not a complete chattune checkpoint (no chattune.json)"
    ),
    "stop_after_step after max_steps": Case(
        ["stop_after_step=300"], "stop_after_step: 300 is after max_steps 200: the run ends first"
    ),
    "the update in the backward with clipping": Case(
        ["optimizer.in_backward=true"],
        "max_grad_norm: 1.0: clipping scales every gradient by the whole model's norm, and optimizer.in_backward "
        "updates each parameter before the whole model's gradient exists: set max_grad_norm=null (the norm is still "
        "logged), or optimizer.in_backward=false",
    ),
    "the update in the backward with accumulation": Case(
        ["optimizer.in_backward=true", "max_grad_norm=null", "grad_accum_steps=2"],
        "grad_accum_steps: 2 microbatches per rank per step sum their gradients before the update, and "
        "optimizer.in_backward updates each parameter before the whole model's gradient exists: set "
        "grad_accum_steps=1 (a larger data.max_tokens_per_microbatch keeps a step's tokens), or "
        "optimizer.in_backward=false",
    ),
    "the update in the backward under CPU offload": Case(
        ["optimizer.in_backward=true", "max_grad_norm=null", "model.fsdp.cpu_offload=true"],
        "model.fsdp.cpu_offload: the host's copy of each gradient is complete only when the whole backward is, and "
        "optimizer.in_backward updates each parameter before the whole model's gradient exists: choose one, "
        "model.fsdp.cpu_offload=false or optimizer.in_backward=false (the gradients already live on the host under "
        "CPU offload)",
    ),
    "float8 on the CPU": Case(
        ["model.fp8=tensorwise", "device=cpu"],
        "model.fp8: tensorwise needs a GPU with float8 matmuls; on the CPU, model.fp8=emulate checks the numerics",
    ),
    "float8 with LoRA": Case(
        ["model.fp8=emulate", "peft=lora"],
        "model.fp8: emulate with peft: LoRA wraps the decoder's linear layers that float8 would replace (not "
        "supported yet); set model.fp8=null, or train without peft",
    ),
    "preference data for SFT": Case(
        ["data.train=[{{path: {tmp}/pairs.jsonl, format: preference}}]"],
        "data.train[0].format: 'preference' is not one of messages, sharegpt",
    ),
    "DPO overlong split": Case(
        ["data.overlong=split", "model.path=null"],
        "data.overlong: 'split' is not one of drop, error",
        config="dpo/tiny",
    ),
    "device=cuda without CUDA": Case(["device=cuda"], "device: cuda, but torch finds no CUDA device on this machine"),
    "one beta": Case(["optimizer.betas=[0.9]"], "optimizer.betas: must be two numbers in [0, 1), got [0.9]"),
    "an adapter key without adapters": Case(
        ["peft.rank=8"],
        "peft.rank: peft is null in this config: choose one first, peft=lora or peft=qlora "
        "(e.g. peft=lora peft.rank=8)",
        launch=True,
    ),
    "peft's own name for a key": Case(["peft=lora", "peft.r=8"], "peft.r: unknown key; did you mean peft.rank?"),
    "a config the group does not have": Case(
        ["peft=lorra"],
        "peft: no config peft/lorra; did you mean peft=lora? (the configs of peft: lora, qlora)",
        launch=True,
    ),
    "Hydra's run directory": Case(
        ["hydra.run.dir={tmp}/elsewhere"],
        "hydra.run.dir: a run's directory is output_dir: set output_dir=DIR instead",
        launch=True,
    ),
    "Hydra's change of directory": Case(
        ["hydra.job.chdir=true"], "hydra.job.chdir: chattune writes into output_dir itself"
    ),
}


def recipe_launch(command: list[str]) -> subprocess.CompletedProcess:
    """`python RECIPE ...`, expected to fail, through the tests' one launch helper."""
    return launch(command, check=False)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("bad_input")
    prepare(directory)
    return directory


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.launch
def test_bad_input_gets_one_clear_error(name, tmp):
    case = CASES[name]
    overrides = [o.format(tmp=tmp) for o in case.overrides]
    if not any(o.startswith("output_dir=") for o in overrides):
        overrides.append(f"output_dir={tmp / 'out' / ''.join(c if c.isalnum() else '_' for c in name)}")
    expected = case.expected.format(tmp=tmp)
    report, ok = run_validate(case.config, overrides, CONFIGS, read_data=True)
    assert not ok
    assert sum(line.startswith(expected) for line in report.splitlines()) == 1, report
    if not case.launch:
        return
    recipe = "recipes/dpo.py" if case.config.startswith("dpo") else "recipes/sft.py"
    result = recipe_launch([sys.executable, recipe, *SMALL_MODEL, *overrides, "max_steps=2", "data.report_records=0"])
    assert result.returncode == 1
    assert result.stderr.count("chattune: error: ") == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert expected.split(": ", 1)[1] in result.stderr


@pytest.mark.parametrize(
    "overrides",
    [
        ["data.eval=[]"],
        ["data.eval=null"],
        ["peft=lora", "peft.rank=8"],
        ["optimizer.in_backward=true", "max_grad_norm=null", "model.fsdp.cpu_offload=false"],
        ["optimizer.in_backward=false", "max_grad_norm=null", "model.fsdp.cpu_offload=true"],
    ],
    ids=[
        "no eval list",
        "null eval",
        "the remedy for an adapter key without adapters",
        "the first remedy for the update in the backward under CPU offload",
        "the second remedy for the update in the backward under CPU offload",
    ],
)
def test_what_validate_and_inspect_accept(overrides, tmp, capsys):
    """No held-out data (the README's real-model command passes data.eval=[]) is a valid config; and the remedy
    the adapter-key message gives works as written."""
    from chattune.cli.main import main

    report, ok = run_validate(
        "sft/tiny", [*overrides, f"output_dir={tmp / 'out' / 'accepted'}"], CONFIGS, read_data=True
    )
    assert ok, report
    assert main(["inspect", "sft/tiny", *overrides, "--limit", "20", "--no-color"]) == 0
    assert "records read: 20" in capsys.readouterr().out


def test_a_pair_with_identical_replies_is_a_counted_skip_not_an_error(tmp):
    report, ok = run_validate(
        "dpo/tiny",
        [
            "model.path=null",
            f"data.train=[{{path: {tmp}/pairs.jsonl, format: preference}}]",
            f"output_dir={tmp / 'out' / 'pairs'}",
        ],
        CONFIGS,
        read_data=True,
    )
    assert ok and "note: data.train[0]: 1 of its first 1 records would be skipped, e.g. identical_replies" in report


def test_on_bad_record_skip_turns_a_bad_record_into_a_counted_skip(tmp):
    report, ok = run_validate(
        "sft/tiny",
        [f"data.train=[{tmp}/broken.jsonl]", "data.on_bad_record=skip", f"output_dir={tmp / 'out' / 'skip'}"],
        CONFIGS,
        read_data=True,
    )
    assert (
        ok
        and f"1 of its first 2 records would be skipped, e.g. bad_record: {tmp}/broken.jsonl record 2 (line 2)"
        in report
    )


@pytest.mark.parametrize("data", ["broken.jsonl", "control.jsonl"])
def test_the_remedy_an_unparseable_line_names_works_as_written(data, tmp, capsys):
    """The error names data.on_bad_record=skip; with it the line is counted, logged and skipped, the others train."""
    from chattune.cli.main import main

    source = f"data.train=[{tmp / data}]"
    assert main(["inspect", "sft/tiny", source, "--num-docs", "0", "--no-color"]) == 1
    remedy = capsys.readouterr().err.split("; with ", 1)[1].split(" ", 1)[0]
    assert remedy == "data.on_bad_record=skip"
    assert main(["inspect", "sft/tiny", source, remedy, "--num-docs", "0", "--no-color"]) == 0
    out = capsys.readouterr().out
    lines = len((tmp / data).read_text().splitlines())
    assert f"records read: {lines}" in out and "skipped: 1 (bad_record 1)" in out and f"documents: {lines - 1}" in out


def test_the_remedy_for_a_tokenizer_without_a_chat_template_works_as_written(tmp):
    """A base model's tokenizer (no template) trains with a template chattune ships, named in the error."""
    report, ok = run_validate(
        "sft/tiny",
        [
            f"tokenizer.path={tmp}/no_template",
            "tokenizer.chat_template=chatml",
            f"output_dir={tmp / 'out' / 'no_template'}",
        ],
        CONFIGS,
        read_data=True,
    )
    assert ok, report


@pytest.mark.launch
def test_a_read_only_output_dir_is_one_clear_error(tmp, monkeypatch):
    """Hydra creates output_dir before the recipe runs, and its OSError (or the lock's) was what a launch gave."""
    from chattune.checkpoint.output_dir import OutputDirInUse, OutputDirLock
    from chattune.launch.run_rules import output_dir_problem

    with pytest.raises(OutputDirInUse, match=f"output_dir {tmp / 'file' / 'run'}: cannot create its lock file"):
        OutputDirLock(tmp / "file" / "run").acquire()
    read_only = tmp / "read_only"
    read_only.mkdir(exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro", "tmpfs", str(read_only)], capture_output=True).returncode:
        # Without the right to mount (root runs everywhere else unhindered), the check itself, on a denied access.
        monkeypatch.setattr(os, "access", lambda path, mode: False)
        assert (
            output_dir_problem(read_only / "run")
            == f"cannot write into {read_only} (permission denied, or a read-only file system)"
        )
        return
    try:
        result = recipe_launch(
            [sys.executable, "recipes/sft.py", *SMALL_MODEL, f"output_dir={read_only / 'run'}", "max_steps=2"]
        )
    finally:
        subprocess.run(["umount", str(read_only)])
    assert result.returncode == 1 and "Traceback" not in result.stderr and "HYDRA_FULL_ERROR" not in result.stderr
    assert (
        result.stderr.count(
            f"chattune: error: output_dir: cannot write into {read_only} (permission denied, or a "
            "read-only file system)"
        )
        == 1
    )


@pytest.mark.launch
def test_data_that_trains_nothing_is_refused_before_the_model_loads(tmp):
    """Every record over the budget: the data report said 0 documents, then the model was built and the run
    died with a RuntimeError at its first step."""
    result = recipe_launch(
        [
            sys.executable,
            "recipes/sft.py",
            *SMALL_MODEL,
            "data.max_tokens_per_microbatch=8",
            f"output_dir={tmp / 'out' / 'overlong'}",
            "max_steps=2",
        ]
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert (
        result.stderr.count(
            "chattune: error: data.train: none of its 4000 records gives a token to train (skipped: "
            "overlong 4000): 4000 are longer than data.max_tokens_per_microbatch=8 (data.overlong="
            "drop): raise the budget, or keep them with data.overlong=truncate or split"
        )
        == 1
    )
    assert "model: " not in result.stdout  # stopped before the model was built


@pytest.mark.launch
def test_an_adapter_module_name_the_model_lacks_is_refused_at_start(tmp):
    result = recipe_launch(
        [
            sys.executable,
            "recipes/sft.py",
            *SMALL_MODEL,
            "peft=lora",
            "peft.modules_to_save=[embed_tokenz]",
            f"output_dir={tmp / 'out' / 'modules_to_save'}",
            "max_steps=2",
            "data.report_records=0",
        ]
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert (
        result.stderr.count(
            "chattune: error: peft.modules_to_save: 'embed_tokenz' names no module of "
            "LlamaForCausalLM; did you mean embed_tokens?"
        )
        == 1
    )
    # the start says what the adapters of a random-init base (sft/tiny's) cannot be: loaded again
    output = result.stdout + result.stderr
    assert output.count("config note: peft: the adapters train on a random-init base built from model.config") == 1


@pytest.mark.launch
def test_a_model_that_cannot_keep_packed_documents_apart_is_refused_at_start(tmp):
    """A hybrid model whose mixer chattune does not keep per document (Zaya's CCA projection reads across document
    boundaries): the start-up probe refuses it once, clearly, before any step."""
    from test_packing_probe import UNHANDLED

    from conftest import demo_tokenizer, tiny_model

    model_dir = tmp / "zaya"
    tiny_model(**UNHANDLED["zaya"][0]).save_pretrained(model_dir)
    demo_tokenizer().save_pretrained(model_dir)
    result = recipe_launch(
        [
            sys.executable,
            "recipes/sft.py",
            "max_steps=2",  # before Hydra's flag, as users write it: Hydra's usage message on every rank used to stop it
            "--config-name",
            "sft/local_model",
            f"model.path={model_dir}",
            f"data.train=[{DEMO_ASSETS / 'chat_train.jsonl'}]",
            f"output_dir={tmp / 'out' / 'zaya'}",
            "data.report_records=0",
            "model.fsdp.activation_checkpointing=false",
        ]
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.count("chattune: error: ZayaForCausalLM does not keep packed documents apart") == 1
    assert "ZayaCCAProjection" in result.stderr and not (tmp / "out" / "zaya" / "metrics.jsonl").exists()
