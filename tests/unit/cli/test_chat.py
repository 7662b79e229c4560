"""`chattune chat DIR`: a trained model's replies, greedy or sampled, are transformers' own generate from the
chat template's generation prompt, cut at the end-of-turn token; a prompts file gives one answer per prompt;
a conversation keeps its history until /reset; an adapter directory over its base answers as the merged
model; bad input is one clear error."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from chattune.cli.chat import Chat, converse, load_chat_model
from chattune.cli.main import main
from chattune.model.generate import Sampling, stop_token_ids
from conftest import PROJECT_ROOT, demo_chat_prompts, demo_tokenizer

END_OF_TURN = "<|im_end|>"  # the demo tokenizer's ChatML end of turn


def plain_reply(model, tokenizer, messages: list[dict], max_new_tokens: int = 40, **sampling) -> tuple[str, bool]:
    """transformers alone: the template's generation prompt, generate, the text before <|im_end|>."""
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    end = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    with torch.no_grad():
        output = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            eos_token_id=end,
            pad_token_id=end,
            **(sampling or {"do_sample": False}),
        )
    new = output[0, inputs["input_ids"].shape[1] :].tolist()
    finished = end in new
    return tokenizer.decode(new[: new.index(end)] if finished else new, skip_special_tokens=False), finished


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_prompts_file_greedy_replies_are_plain_generate_cut_at_the_end_of_turn(chat_model_dir, tmp_path, capsys):
    prompts = demo_chat_prompts()
    single = [p for p in prompts if len(p) == 1 and p[0]["role"] == "user"][:2]
    text_file = tmp_path / "prompts.txt"  # one user prompt a line (and a blank line, skipped)
    text_file.write_text("\n".join(p[0]["content"] for p in single) + "\n\n")
    jsonl_file = tmp_path / "prompts.jsonl"  # whole chats: the reply after the context is left out
    chats = [
        json.loads(line)
        for line in (PROJECT_ROOT / "chattune/assets/demo/chat_train.jsonl").read_text().splitlines()[:6]
    ]
    jsonl_file.write_text(
        "".join(json.dumps({"messages": c["messages"]}) + "\n" for c in chats)
        + json.dumps({"prompt": single[0][0]["content"]})
        + "\n"
    )

    model = AutoModelForCausalLM.from_pretrained(chat_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    out = tmp_path / "replies.jsonl"
    assert (
        main(["chat", str(chat_model_dir), "--prompts", str(jsonl_file), "--out", str(out), "--max-new-tokens", "40"])
        == 0
    )
    assert capsys.readouterr().out == f"wrote 7 replies to {out}\n"
    rows = read_jsonl(out)
    assert [r["prompt"] for r in rows] == [*prompts, single[0]]  # one answer per prompt, in order
    for row, messages in zip(rows, [*prompts, single[0]]):
        assert (row["reply"], row["finished"]) == plain_reply(model, tokenizer, messages)
    assert all(r["finished"] and END_OF_TURN not in r["reply"] and r["reply"] for r in rows)  # replies that end
    # The model learned these chats: some of its replies are the chats' own (not just any text that stops).
    learned = sum(r["reply"] == c["messages"][-1]["content"] for r, c in zip(rows, chats))
    assert learned >= 3, [r["reply"] for r in rows]

    assert (
        main(
            [
                "chat",
                str(chat_model_dir),
                "--prompts",
                str(text_file),
                "--max-new-tokens",
                "40",
                "--system",
                "Be brief.",
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    expected = [[{"role": "system", "content": "Be brief."}, *p] for p in single]
    assert [r["prompt"] for r in rows] == expected
    for row, messages in zip(rows, expected):
        assert (row["reply"], row["finished"]) == plain_reply(model, tokenizer, messages)

    assert main(["chat", str(chat_model_dir), "--prompts", str(text_file), "--max-new-tokens", "3"]) == 0
    cut = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["finished"] for r in cut] == [False, False]
    assert [r["reply"] for r in cut] == [plain_reply(model, tokenizer, m, max_new_tokens=3)[0] for m in single]


@pytest.mark.parametrize(
    "flags, settings",
    [
        # only what is asked truncates: no top-k (transformers' default of 50 is not applied unasked)
        (["--top-p", "0.9"], {"top_p": 0.9, "top_k": 0}),
        (["--top-k", "5", "--min-p", "0.1"], {"top_k": 5, "min_p": 0.1}),
    ],
    ids=["top-p", "top-k and min-p"],
)
def test_sampled_replies_follow_the_seed_as_transformers_samples(chat_model_dir, tmp_path, capsys, flags, settings):
    prompt_file = tmp_path / "prompts.txt"
    question = demo_chat_prompts()[0][-1]["content"]
    prompt_file.write_text(question + "\n")
    args = [
        "chat",
        str(chat_model_dir),
        "--prompts",
        str(prompt_file),
        "--temperature",
        "1.5",
        *flags,
        "--max-new-tokens",
        "24",
    ]
    replies = {}
    for seed in (1, 2):
        assert main([*args, "--seed", str(seed)]) == 0
        replies[seed] = json.loads(capsys.readouterr().out)["reply"]
    model = AutoModelForCausalLM.from_pretrained(chat_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    for seed, reply in replies.items():
        torch.manual_seed(seed)
        assert (
            reply
            == plain_reply(
                model,
                tokenizer,
                [{"role": "user", "content": question}],
                24,
                do_sample=True,
                temperature=1.5,
                **settings,
            )[0]
        )
    assert replies[1] != replies[2]  # sampled, not greedy


def test_a_conversation_keeps_its_history_until_reset(chat_model_dir):
    model, tokenizer = load_chat_model(chat_model_dir, None, "cpu")
    chat = Chat(model, tokenizer, Sampling(max_new_tokens=40), stop_token_ids(tokenizer))
    first, second = demo_chat_prompts()[0][-1]["content"], demo_chat_prompts()[1][-1]["content"]
    stdout = io.StringIO()
    lines = f"{first}\n\n{second}\n/reset\n{second}\n/quit\nnever read\n"
    assert converse(chat, None, io.StringIO(lines), stdout, interactive=False, name="x") == 0
    printed = stdout.getvalue().splitlines()

    plain = AutoModelForCausalLM.from_pretrained(chat_model_dir).eval()
    history = [{"role": "user", "content": first}]
    reply_1 = plain_reply(plain, tokenizer, history)[0]
    history += [{"role": "assistant", "content": reply_1}, {"role": "user", "content": second}]
    reply_2 = plain_reply(plain, tokenizer, history)[0]  # with the first exchange before it
    fresh = plain_reply(plain, tokenizer, [{"role": "user", "content": second}])[0]
    assert printed == [reply_1.strip(), reply_2.strip(), "(a new conversation)", fresh.strip()]
    assert reply_2 != fresh  # the history changed the reply: the test can tell the two apart


def lora_adapter(base_dir: Path, adapter_dir: Path) -> None:
    """A peft LoRA adapter over `base_dir` with non-zero B (peft starts B at zero: no change), saved with the
    tokenizer as a run's adapter/ export is."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base_dir),
        LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    torch.manual_seed(5)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.2)
    model.save_pretrained(adapter_dir)
    demo_tokenizer().save_pretrained(adapter_dir)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base_dir)


def test_an_adapter_directory_answers_as_its_base_with_the_adapter_merged(
    chat_model_dir, tmp_path, capsys, monkeypatch
):
    from peft import PeftModel

    adapter = tmp_path / "adapter"
    lora_adapter(chat_model_dir, adapter)
    prompt_file = tmp_path / "prompts.txt"
    questions = [p[-1]["content"] for p in demo_chat_prompts()[:4]]
    prompt_file.write_text("\n".join(questions) + "\n")
    assert main(["chat", str(adapter), "--prompts", str(prompt_file), "--max-new-tokens", "24"]) == 0
    replies = [json.loads(line)["reply"] for line in capsys.readouterr().out.splitlines()]

    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(chat_model_dir), adapter).merge_and_unload()
    base = AutoModelForCausalLM.from_pretrained(chat_model_dir).eval()
    want = [plain_reply(merged.eval(), tokenizer, [{"role": "user", "content": q}], 24)[0] for q in questions]
    assert replies == want
    assert replies != [plain_reply(base, tokenizer, [{"role": "user", "content": q}], 24)[0] for q in questions]

    # An adapter whose base cannot be found: the error says so, and --base (its remedy) works as written.
    moved = tmp_path / "moved_adapter"
    shutil.copytree(adapter, moved)
    config = json.loads((moved / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "gone")
    (moved / "adapter_config.json").write_text(json.dumps(config))
    assert main(["chat", str(moved), "--prompts", str(prompt_file), "--max-new-tokens", "24"]) == 1
    error = capsys.readouterr().err
    assert error.count("chattune chat: error: ") == 1 and f"the base model {tmp_path / 'gone'}" in error
    assert "does not exist" in error and "--base DIR" in error
    assert (
        main(
            ["chat", str(moved), "--base", str(chat_model_dir), "--prompts", str(prompt_file), "--max-new-tokens", "24"]
        )
        == 0
    )
    assert [json.loads(line)["reply"] for line in capsys.readouterr().out.splitlines()] == want
    # A relative base (a run's model.path as written) is read from where the command runs.
    config["base_model_name_or_path"] = os.path.relpath(chat_model_dir, tmp_path)
    (moved / "adapter_config.json").write_text(json.dumps(config))
    monkeypatch.chdir(tmp_path)
    assert main(["chat", "moved_adapter", "--prompts", str(prompt_file), "--max-new-tokens", "24"]) == 0
    assert [json.loads(line)["reply"] for line in capsys.readouterr().out.splitlines()] == want


@pytest.mark.launch
def test_bad_input_is_one_clear_error(chat_model_dir, tmp_path, capsys):
    def error_of(*args: str) -> str:
        assert main(["chat", *args]) == 1
        captured = capsys.readouterr()
        assert captured.err.count("chattune chat: error: ") == 1 and "Traceback" not in captured.err
        return captured.err

    assert f"{tmp_path / 'nothing'} does not exist" in error_of(str(tmp_path / "nothing"))
    assert "holds neither config.json" in error_of(str(tmp_path))
    for flags in (["--top-k", "-1"], ["--min-p", "1.0"]):
        shown = "-1 and 0.0" if flags[0] == "--top-k" else "0 and 1.0"
        assert f"--top-k must be >= 0 and --min-p in [0, 1), got {shown}" in error_of(str(chat_model_dir), *flags)
    no_template = tmp_path / "no_template"
    shutil.copytree(chat_model_dir, no_template)
    tokenizer = AutoTokenizer.from_pretrained(no_template)
    tokenizer.chat_template = None
    for name in ("chat_template.jinja", "tokenizer_config.json"):
        (no_template / name).unlink(missing_ok=True)
    tokenizer.save_pretrained(no_template)
    assert "the tokenizer has no chat template" in error_of(str(no_template))
    assert "prompts file" in error_of(str(chat_model_dir), "--prompts", str(tmp_path / "missing.txt"))
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"text": "hi"}\n')
    assert f"{bad_json} line 2" in error_of(str(chat_model_dir), "--prompts", str(bad_json))
    random_base = tmp_path / "adapter_without_base"
    lora_adapter(chat_model_dir, random_base)
    config = json.loads((random_base / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = None  # as chattune writes it for a base built from model.config
    (random_base / "adapter_config.json").write_text(json.dumps(config))
    assert "names no base model" in error_of(str(random_base))

    # As a command: the message alone, status 1, and no torch imported to parse the command line.
    result = subprocess.run(
        [sys.executable, "-m", "chattune.cli.main", "chat", str(tmp_path / "nothing")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1 and result.stderr.strip().splitlines() == [
        f"chattune chat: error: {tmp_path / 'nothing'} does not exist: give an exported model directory "
        "(output_dir/hf) or adapter directory (output_dir/adapter)"
    ]
    imported = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from chattune.cli.main import build_parser; "
            "build_parser(); print(sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules))",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert imported.stdout.strip() == "[]"


def test_a_runs_output_dir_answers_as_its_hf_export_and_the_version_is_printed(chat_model_dir, tmp_path, capsys):
    import shutil

    import pytest

    from chattune import __version__

    run = tmp_path / "run"
    shutil.copytree(chat_model_dir, run / "hf")
    prompt_file = tmp_path / "prompts.txt"
    prompt_file.write_text("What is 2 + 3?\n")
    assert main(["chat", str(chat_model_dir), "--prompts", str(prompt_file), "--max-new-tokens", "8"]) == 0
    want = capsys.readouterr().out
    assert main(["chat", str(run), "--prompts", str(prompt_file), "--max-new-tokens", "8"]) == 0
    got = capsys.readouterr()
    assert got.out == want and f"{run} is a run's output directory: its hf/" in got.err
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"chattune {__version__}"


def test_a_reward_model_is_refused_with_what_scores_with_it_and_its_run_suggests_no_chat(tmp_path, capsys):
    """A reward run's last line suggested `chattune chat`, which then loaded the classifier as a causal LM (its
    decoder under a fresh output layer) and answered."""
    from transformers import LlamaForSequenceClassification

    from chattune.train.loop import done_line
    from conftest import tiny_config

    run = tmp_path / "reward-run"
    LlamaForSequenceClassification(tiny_config(num_labels=1, pad_token_id=0)).save_pretrained(run / "hf")
    demo_tokenizer().save_pretrained(run / "hf")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is 2 + 3?\n")
    for directory in (run / "hf", run):  # the export, or the run's output_dir that stands for it
        assert main(["chat", str(directory), "--prompts", str(prompts)]) == 1
        assert capsys.readouterr().err.splitlines()[-1] == (
            f"chattune chat: error: {run / 'hf'} is a reward model (LlamaForSequenceClassification: a score head): it "
            "scores a conversation and writes no reply, so there is nothing to chat with. Score conversations with "
            "AutoModelForSequenceClassification.from_pretrained(DIR) (docs/reward.md); chat with an SFT, DPO or KTO "
            "run's export"
        )
    adapter = tmp_path / "reward-run-lora" / "adapter"  # peft=lora: task type SEQ_CLS
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text(json.dumps({"task_type": "SEQ_CLS", "base_model_name_or_path": None}))
    assert main(["chat", str(adapter)]) == 1
    assert f"{adapter} is a reward model's adapter (adapter_config.json: task_type SEQ_CLS)" in capsys.readouterr().err

    assert done_line(run, {"hf": run / "hf"}, scores=True) == (
        f"done: {run / 'hf'} (a reward model: it scores conversations, with "
        f"AutoModelForSequenceClassification.from_pretrained('{run / 'hf'}'), docs/reward.md; its curves: chattune "
        f"plot {run})"
    )
    assert done_line(run, {"hf": run / "hf"}, scores=False) == (
        f"done: {run / 'hf'} (talk to it: chattune chat {run}; its curves: chattune plot {run})"
    )


def test_the_last_line_says_the_plot_needs_matplotlib_where_it_is_not_installed(tmp_path, monkeypatch):
    """README's first command installs chattune without matplotlib: the plot the last line suggests says how."""
    import importlib.util

    from chattune.train import loop

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else find_spec(name))
    assert loop.done_line(tmp_path, {"hf": tmp_path / "hf"}, scores=False).endswith(
        f"its curves: chattune plot {tmp_path}, after pip install matplotlib)"
    )
    # adapters on a random-init base (peft=lora, model.path null): nothing can load them, so no chat is suggested
    unloadable = loop.done_line(tmp_path, {"adapter": tmp_path / "adapter"}, scores=False, base_saved=False)
    assert "chattune chat" not in unloadable and "so nothing can load this adapter: train with export.merge=true" in (
        unloadable
    )
    merged = loop.done_line(tmp_path, {"adapter": tmp_path / "adapter", "hf": tmp_path / "hf"}, False, base_saved=False)
    assert merged.startswith(f"done: {tmp_path / 'hf'} (talk to it: chattune chat {tmp_path};")
    # chattune export says the same of what it wrote
    from chattune.cli.export import Exported

    assert Exported({"hf": tmp_path / "hf"}, scores=False, base_saved=True).next_step() == (
        f"talk to it: chattune chat {tmp_path / 'hf'}"
    )
    assert "chattune chat" not in Exported({"hf": tmp_path / "hf"}, scores=True, base_saved=True).next_step()
    assert "nothing can load this adapter" in Exported({"adapter": tmp_path}, False, base_saved=False).next_step()
    from chattune.cli.plot import PlotError, plot_runs

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import matplotlib.figure raises ImportError
    with pytest.raises(PlotError, match="chattune plot needs matplotlib, which chattune does not install itself: pip"):
        plot_runs([tmp_path], tmp_path / "curves.png")
