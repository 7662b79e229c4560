"""tokenizer.chat_template: a shipped template, a file or inline Jinja in place of the tokenizer's own. How a
value is read; the shipped templates against chattune's own template checks (assistant replies verbatim, their
spans found) with tools, tool calls, tool results and think blocks, against replies written out by hand; a
template whose special tokens the tokenizer lacks is refused; the remedy the tool error names works as written;
a template (file) edit means another token cache and a refused resume; and the export writes the template
training used."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from transformers import AutoTokenizer

import conftest
from chattune.config.paths import DEMO_ASSETS
from chattune.data.ingest.formats import DataError, SourceSpec
from chattune.data.ingest.records import RecordSource
from chattune.data.templates.chat_template import probe_template, render_conversation
from chattune.data.templates.sft_documents import SFTDocuments
from chattune.data.templates.template_choice import (
    SHIPPED_DIR,
    ChatTemplateSettingError,
    read_chat_template,
    shipped_names,
    template_kind,
)
from chattune.data.templates.tokenizer import load_tokenizer
from chattune.data.token_cache import tokenizer_digest
from conftest import SHARED_ASSETS, SMALL_MODEL, decode_exactly, demo_tokenizer, trained_runs

DEMO_TOKENIZER = str(DEMO_ASSETS / "tokenizer")
LLAMA3_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
TOOLCALL_DATA = SHARED_ASSETS / "data" / "sharegpt_toolcall_300.json"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def call(city: str, arguments_as_text: bool = False) -> dict:
    arguments = json.dumps({"city": city}) if arguments_as_text else {"city": city}
    return {"type": "function", "function": {"name": "get_weather", "arguments": arguments}}


# A conversation with every kind of turn: a system prompt, tools, a reply that reasons then calls a tool, a tool
# result, a reply with text and a call whose arguments are a JSON string, another result, a final answer.
CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Two cities: one call each.",
        "tool_calls": [call("Paris")],
    },
    {"role": "tool", "content": '{"celsius": 20}'},
    {"role": "assistant", "content": "Now Rome.", "tool_calls": [call("Rome", arguments_as_text=True)]},
    {"role": "tool", "content": '{"celsius": 25}'},
    {"role": "assistant", "content": "Paris: 20 C. Rome: 25 C."},
]

# What each template must train of CONVERSATION, written out by hand from the formats the templates document.
CHATML_REPLIES = [
    '<think>\nTwo cities: one call each.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
    "\n</tool_call><|im_end|>",
    'Now Rome.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>',
    "Paris: 20 C. Rome: 25 C.<|im_end|>",
]
LLAMA3_REPLIES = [  # (Llama 3 has no think blocks: the template leaves reasoning out)
    '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
    'Now Rome.\n{"name": "get_weather", "parameters": {"city": "Rome"}}<|eot_id|>',
    "Paris: 20 C. Rome: 25 C.<|eot_id|>",
]


def settings(chat_template: str | None, path: str | Path = DEMO_TOKENIZER):
    return OmegaConf.create({"path": str(path), "chat_template": chat_template})


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def llama3_tokenizer_dir(tmp_path_factory) -> Path:
    """The demo tokenizer with Llama 3's special tokens added (no Llama tokenizer ships with the tests)."""
    tokenizer = demo_tokenizer()
    tokenizer.add_tokens(LLAMA3_TOKENS, special_tokens=True)
    directory = tmp_path_factory.mktemp("llama3_tokenizer")
    tokenizer.save_pretrained(directory)
    return directory


def trained_texts(tokenizer, document) -> list[str]:
    """Each trained run of a document's tokens as text (labels are shifted: label i is token i + 1)."""
    ids = document.input_ids.tolist()
    mask = [False] + [int(label) >= 0 for label in document.labels[:-1]]
    return [decode_exactly(tokenizer, ids[a:b]) for a, b in trained_runs(mask)]


# --- reading the value ---


@pytest.mark.parametrize(
    "value, kind",
    [
        ("chatml", "shipped"),
        ("llama3", "shipped"),
        ("my_template-2", "shipped"),
        ("./chatml", "file"),
        ("templates/chat.jinja", "file"),
        ("t.jinja", "file"),
        ("{{ messages }}", "inline"),
        ("{% for m in messages %}x{% endfor %}", "inline"),
    ],
)
def test_a_value_is_inline_jinja_a_shipped_name_or_a_path_by_its_text_alone(value, kind):
    assert template_kind(value) == kind


def test_shipped_names_files_inline_and_the_errors_that_name_the_key_the_value_and_the_choices(tmp_path, monkeypatch):
    assert set(shipped_names()) >= {"chatml", "llama3"}
    assert read_chat_template("chatml").text == (SHIPPED_DIR / "chatml.jinja").read_text()
    assert read_chat_template("{{ messages }}").text == "{{ messages }}"
    monkeypatch.chdir(tmp_path)
    Path("chatml").write_text("{{ 'mine' }}")  # a file named like a shipped template is written ./chatml
    assert read_chat_template("./chatml").text == "{{ 'mine' }}" and read_chat_template("chatml").text != "{{ 'mine' }}"
    shipped = ", ".join(shipped_names())
    with pytest.raises(ChatTemplateSettingError) as error:
        read_chat_template("chatm")
    assert str(error.value) == (
        f"tokenizer.chat_template: 'chatm' is not a template chattune ships; did you mean chatml? "
        f"(shipped: {shipped}; otherwise the path of a template file (./NAME for one in the "
        "working directory) or inline Jinja, holding {{ or {%)"
    )
    with pytest.raises(
        ChatTemplateSettingError,
        match=r"^tokenizer.chat_template: template file 'no/such\.jinja' does "
        rf"not exist \(shipped: {shipped};",
    ):
        read_chat_template("no/such.jinja")
    Path("empty.jinja").write_text("\n")
    with pytest.raises(ChatTemplateSettingError, match=r"template file 'empty\.jinja' is empty"):
        read_chat_template("empty.jinja")
    with pytest.raises(
        ChatTemplateSettingError,
        match=r"^tokenizer.chat_template: the inline template is not valid "
        r"Jinja \(line 1\)",
    ):
        load_tokenizer(settings("{% for m in messages %}"))


# --- the shipped templates pass chattune's template checks ---


@pytest.mark.parametrize("tokenizer_dir", ["demo", "qwen3"])
def test_chatml_trains_replies_tool_calls_and_think_blocks_verbatim(tmp_path, tokenizer_dir):
    directory = DEMO_TOKENIZER if tokenizer_dir == "demo" else SHARED_ASSETS / "tokenizers" / tokenizer_dir
    if not Path(directory).is_dir():
        pytest.skip(f"{directory} is absent")
    tokenizer = load_tokenizer(settings("chatml", directory))
    assert tokenizer.chat_template == (SHIPPED_DIR / "chatml.jinja").read_text()
    markers = probe_template(tokenizer)
    assert (markers.generation_prompt, markers.end_of_turn) == ("<|im_start|>assistant\n", "<|im_end|>")
    assert markers.renders_tools and markers.renders_tool_calls
    text = render_conversation(tokenizer, CONVERSATION, [WEATHER])
    assert text == tokenizer.apply_chat_template(CONVERSATION, tools=[WEATHER], tokenize=False)  # transformers' own
    assert text.startswith("<|im_start|>system\nAnswer briefly.\n\n# Tools\n")
    assert f"<tools>\n{json.dumps(WEATHER['function'])}\n</tools>" in text
    assert '<|im_start|>tool\n{"celsius": 20}<|im_end|>\n' in text
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION, "tools": [WEATHER]}])
    document = SFTDocuments(RecordSource([SourceSpec(str(data))]), tokenizer, max_tokens=4096).get(0)
    assert trained_texts(tokenizer, document) == CHATML_REPLIES


def test_llama3_trains_replies_and_tool_calls_verbatim(tmp_path, llama3_tokenizer_dir):
    tokenizer = load_tokenizer(settings("llama3", llama3_tokenizer_dir))
    markers = probe_template(tokenizer)
    assert (markers.generation_prompt, markers.end_of_turn) == (
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "<|eot_id|>",
    )
    assert markers.renders_tools and markers.renders_tool_calls
    text = render_conversation(tokenizer, CONVERSATION, [WEATHER])
    assert text == tokenizer.apply_chat_template(CONVERSATION, tools=[WEATHER], tokenize=False)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nAnswer briefly.\n\n")
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n{"celsius": 25}<|eot_id|>' in text
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION, "tools": [WEATHER]}])
    document = SFTDocuments(RecordSource([SourceSpec(str(data))]), tokenizer, max_tokens=4096).get(0)
    assert trained_texts(tokenizer, document) == LLAMA3_REPLIES
    assert document.input_ids.tolist()[0] == tokenizer.convert_tokens_to_ids("<|begin_of_text|>")  # one token


@pytest.mark.parametrize(
    "template, tokenizer_dir, missing",
    [
        ("llama3", "demo", "<|begin_of_text|>, <|start_header_id|>, <|end_header_id|>, <|eot_id|>"),
        ("chatml", "phi-3-mini", "<|im_start|>, <|im_end|>"),
        ("{{ '<|turn|>' }}{% for m in messages %}{{ m.content + '<|im_end|>' }}{% endfor %}", "demo", "<|turn|>"),
    ],
)
def test_a_template_whose_special_tokens_the_tokenizer_lacks_is_refused(template, tokenizer_dir, missing):
    """Its markers would be split into ordinary text pieces: the model would learn its turns as text."""
    directory = DEMO_TOKENIZER if tokenizer_dir == "demo" else SHARED_ASSETS / "tokenizers" / tokenizer_dir
    if not Path(directory).is_dir():
        pytest.skip(f"{directory} is absent")
    with pytest.raises(ChatTemplateSettingError) as error:
        load_tokenizer(settings(template, directory))
    named = "the inline template" if "{{" in template else repr(template)
    assert str(error.value).startswith(
        f"tokenizer.chat_template: {named} writes {missing}, which the tokenizer at "
        f"tokenizer.path {str(directory)!r} does not have as tokens"
    )
    fits = "tokenizer.chat_template=chatml, or " if tokenizer_dir == "demo" and template != "chatml" else ""
    assert str(error.value).endswith(
        f"special tokens this tokenizer has: {fits}the tokenizer's own (tokenizer.chat_template=null)"
    )


# --- the remedy of the tool error, as written ---


def test_the_tool_error_names_the_template_that_renders_them_and_it_works_as_written(tmp_path):
    """The demo template renders no tools; the error names tokenizer.chat_template=chatml, and that override makes
    the records train, their calls and results included."""
    data = write_jsonl(tmp_path / "tools.jsonl", [{"messages": CONVERSATION, "tools": [WEATHER]}])
    documents = SFTDocuments(RecordSource([SourceSpec(str(data))]), load_tokenizer(settings(None)), max_tokens=4096)
    with pytest.raises(DataError) as error:
        documents.get_many([0])
    assert str(error.value) == (
        f"{data} record 1 (line 1): the record has tools or tool calls, but the tokenizer's chat template does not "
        "render them (training would silently leave them out): set tokenizer.chat_template=chatml (a template "
        "chattune ships that renders them, with special tokens this tokenizer has); with data.on_bad_record=skip such "
        "records are skipped (counted and logged)"
    )
    remedy = str(error.value).split("leave them out): set ", 1)[1].split(" ", 1)[0]
    key, value = remedy.split("=")
    assert key == "tokenizer.chat_template"
    tokenizer = load_tokenizer(settings(value))
    document = SFTDocuments(RecordSource([SourceSpec(str(data))]), tokenizer, max_tokens=4096).get(0)
    assert trained_texts(tokenizer, document) == CHATML_REPLIES


def test_without_a_shipped_template_that_fits_the_tool_error_asks_for_a_file_and_one_works(tmp_path):
    """Phi-3's tokenizer has none of ChatML's or Llama 3's markers: the error asks for a template file, and a
    file in Phi-3's own format that renders tools trains the record."""
    directory = SHARED_ASSETS / "tokenizers" / "phi-3-mini"
    if not directory.is_dir():
        pytest.skip(f"{directory} is absent")
    data = write_jsonl(tmp_path / "tools.jsonl", [{"messages": CONVERSATION[1:], "tools": [WEATHER]}])
    documents = SFTDocuments(RecordSource([SourceSpec(str(data))]), load_tokenizer(settings(None, directory)), 4096)
    with pytest.raises(
        DataError,
        match=r"leave them out\): set tokenizer\.chat_template=PATH, a template file that "
        r"renders them \(chattune's own, chatml, llama3, write special tokens this "
        r"tokenizer does not have\); with data\.on_bad_record=skip",
    ):
        documents.get(0)
    template = tmp_path / "phi3_tools.jinja"
    template.write_text(
        "{% if tools %}<|system|>\nTools: {{ tools | tojson }}<|end|>\n{% endif %}"
        "{% for m in messages %}<|{{ 'user' if m.role == 'tool' else m.role }}|>\n{{ m.content }}"
        "{% for c in m.tool_calls or [] %}{{ c.function | tojson }}{% endfor %}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    tokenizer = load_tokenizer(settings(str(template), directory))
    document = SFTDocuments(RecordSource([SourceSpec(str(data))]), tokenizer, 4096).get(0)
    assert [text.strip() for text in trained_texts(tokenizer, document)] == [
        '{"name": "get_weather", "arguments": {"city": "Paris"}}<|end|>',
        'Now Rome.{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}<|end|>',
        "Paris: 20 C. Rome: 25 C.<|end|>",
    ]


def test_the_remedy_trains_the_shared_tool_call_data_through_chattune_inspect(capsys):
    """The issue's case: ShareGPT tool-call records on a template without tools, then the override the error names."""
    from chattune.cli.main import main

    if not TOOLCALL_DATA.is_file():
        pytest.skip(f"{TOOLCALL_DATA} is absent")
    source = f"data.train=[{{path: {TOOLCALL_DATA}, format: sharegpt}}]"
    assert main(["inspect", "sft/tiny", source, "--num-docs", "0", "--no-color"]) == 1
    err = capsys.readouterr().err
    assert "the record has tools or tool calls, but the tokenizer's chat template does not render them" in err
    remedy = err.split("leave them out): set ", 1)[1].split(" ", 1)[0]
    assert remedy == "tokenizer.chat_template=chatml"
    assert (
        main(
            [
                "inspect",
                "sft/tiny",
                source,
                remedy,
                "--num-docs",
                "1",
                "--no-color",
                "data.max_tokens_per_microbatch=16384",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "records read: 300" in out and "skipped: 0" in out, out
    assert '<tool_call>\n{"name": ' in out and "<|im_start|>tool\n" in out


# --- caches, resume and export follow the template ---


def test_a_template_file_edited_in_place_is_another_token_cache(tmp_path):
    template = tmp_path / "mine.jinja"
    template.write_text((SHIPPED_DIR / "chatml.jinja").read_text())
    first = tokenizer_digest(load_tokenizer(settings(str(template))))
    assert tokenizer_digest(load_tokenizer(settings(str(template)))) == first  # the same text: the same cache
    assert tokenizer_digest(load_tokenizer(settings("chatml"))) == first  # found by its text, wherever it lives
    assert tokenizer_digest(load_tokenizer(settings(None))) != first
    template.write_text(template.read_text().replace("# Tools", "# Functions"))
    assert tokenizer_digest(load_tokenizer(settings(str(template)))) != first


@pytest.mark.launch
def test_the_export_writes_the_template_training_used(tmp_path):
    """One LoRA run with a merged export writes both adapter/ and hf/: each tokenizer, loaded with plain
    transformers, renders and tokenizes the training conversation exactly as training did."""
    data = write_jsonl(tmp_path / "tools.jsonl", [{"messages": CONVERSATION, "tools": [WEATHER]}] * 8)
    out = tmp_path / "run"
    conftest.launch(
        [
            sys.executable,
            "recipes/sft.py",
            *SMALL_MODEL,
            f"output_dir={out}",
            f"data.train=[{data}]",
            "data.eval=[]",
            "tokenizer.chat_template=chatml",
            "peft=lora",
            "export.merge=true",
            "max_steps=2",
            "save_every=0",
            "data.report_records=0",
            "data.cache=off",
            "device=cpu",
        ]
    )
    training = load_tokenizer(settings("chatml"))
    trained_ids = (
        SFTDocuments(RecordSource([SourceSpec(str(data))]), training, max_tokens=4096).get(0).input_ids.tolist()
    )
    for directory in (out / "hf", out / "adapter"):
        exported = AutoTokenizer.from_pretrained(directory)
        assert exported.chat_template == (SHIPPED_DIR / "chatml.jinja").read_text()
        assert exported.apply_chat_template(CONVERSATION, tools=[WEATHER], tokenize=False) == render_conversation(
            training, CONVERSATION, [WEATHER]
        )
        ids = exported.apply_chat_template(CONVERSATION, tools=[WEATHER], tokenize=True)
        assert list(ids["input_ids"] if hasattr(ids, "keys") else ids) == trained_ids
