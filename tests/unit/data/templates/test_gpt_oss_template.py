"""Assistant-only labels with gpt-oss's real chat template (OpenAI's harmony format).

The template is OpenAI's, byte for byte (tests/fixtures/gpt_oss_chat_template.jinja; its source is in
tests/fixtures/README.md). o200k cannot be downloaded here, so the tokenizer is the demo tokenizer with harmony's
special tokens added and that template set: which pieces the plain text splits into does not matter, only
where the trained spans lie and which special tokens they hold.

The expected labels are written by hand from the harmony docs (github.com/openai/harmony, docs/format.md):
the model, prompted with `<|start|>assistant`, writes its messages (reasoning on the analysis channel, then
the answer on the final channel or a tool call) and stops with `<|return|>`. `<|return|>` is "a decode-time
stop token only": history stores the reply closed by `<|end|>`, which the template writes for every reply
but the one that ends the conversation. So:

- the last reply is trained whole, reasoning included, through `<|return|>`;
- an earlier reply is trained as history renders it (the template drops its reasoning) but without its
  closing `<|end|>`, which the model never writes to end a reply (`<|end|>` is not a stop token: trained
  after answers, it would teach the model not to stop);
- a tool call is trained through `<|call|>`, the model's other stop token, which history keeps (the template
  drops the call's reasoning once an answer follows it).
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from pathlib import Path

import jinja2
import pytest
from transformers import AutoTokenizer
from transformers.utils import chat_template_utils

from chattune.config.paths import DEMO_ASSETS
from chattune.data.documents import Document
from chattune.data.ingest.formats import DataError, SourceSpec
from chattune.data.ingest.records import RecordSource
from chattune.data.templates.chat_template import (
    ChatTemplateError,
    probe_template,
    render_conversation,
    tokenize_conversation,
)
from chattune.data.templates.sft_documents import SFTDocuments
from conftest import PROJECT_ROOT, decode_exactly, trained_runs

TEMPLATE = PROJECT_ROOT / "tests" / "fixtures" / "gpt_oss_chat_template.jinja"
TEMPLATE_SHA256 = "a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146"
HARMONY_TOKENS = [
    "<|startoftext|>",
    "<|endoftext|>",
    "<|return|>",
    "<|constrain|>",
    "<|channel|>",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|call|>",
]

# The system message the template writes on its own, on the frozen date (`frozen_date`).
SYSTEM = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\nCurrent date: 2025-08-05\n\nReasoning: medium\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
)
FINAL = "<|channel|>final<|message|>"
ANALYSIS = "<|channel|>analysis<|message|>"


class _August5(datetime):
    @classmethod
    def now(cls, tz=None):
        return cls(2025, 8, 5, 12, 0, tzinfo=tz)


@pytest.fixture(autouse=True)
def frozen_date(monkeypatch):
    """The template writes `strftime_now("%Y-%m-%d")`: transformers' `strftime_now` reads the clock through
    its module's `datetime`, for apply_chat_template and chattune's rendering alike."""
    monkeypatch.setattr(chat_template_utils, "datetime", _August5)


@pytest.fixture(scope="module")
def harmony():
    tokenizer = AutoTokenizer.from_pretrained(DEMO_ASSETS / "tokenizer")
    tokenizer.add_special_tokens(
        {
            "bos_token": "<|startoftext|>",
            "eos_token": "<|return|>",
            "pad_token": "<|endoftext|>",  # the demo tokenizer's own already
            "additional_special_tokens": [t for t in HARMONY_TOKENS if "text" not in t],
        }
    )
    tokenizer.chat_template = TEMPLATE.read_text()
    return tokenizer


def trained(
    tokenizer, messages: list[dict], tools: list[dict] | None = None, last_turn_only: bool = False
) -> list[str]:
    """The trained tokens, run by run, decoded; the tokens are apply_chat_template's."""
    result = tokenize_conversation(tokenizer, messages, probe_template(tokenizer), tools, last_turn_only=last_turn_only)
    assert result.input_ids == list(tokenizer.apply_chat_template(messages, tools=tools, tokenize=True)["input_ids"])
    return [decode_exactly(tokenizer, result.input_ids[a:b]) for a, b in trained_runs(result.assistant_mask)]


def untrained(tokenizer, messages: list[dict]) -> str:
    result = tokenize_conversation(tokenizer, messages, probe_template(tokenizer))
    return "".join(decode_exactly(tokenizer, [i]) for i, m in zip(result.input_ids, result.assistant_mask) if not m)


def test_the_template_is_openais_and_harmonys_tokens_are_single_tokens(harmony):
    assert hashlib.sha256(TEMPLATE.read_bytes()).hexdigest() == TEMPLATE_SHA256
    for token in HARMONY_TOKENS:
        assert len(harmony(token, add_special_tokens=False)["input_ids"]) == 1, token


def test_markers(harmony):
    markers = probe_template(harmony)
    assert (markers.generation_prompt, markers.end_of_turn, markers.end_of_earlier_turn, markers.end_of_tool_call) == (
        "<|start|>assistant",
        "<|return|>",
        "<|end|>",
        "<|call|>",
    )
    assert markers.renders_tools and markers.renders_tool_calls


def test_one_turn(harmony):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    assert harmony.apply_chat_template(messages, tokenize=False) == (
        SYSTEM + "<|start|>user<|message|>Hi<|end|><|start|>assistant" + FINAL + "Hello.<|return|>"
    )
    assert trained(harmony, messages) == [FINAL + "Hello.<|return|>"]


def test_multi_turn_earlier_replies_are_trained_without_their_history_end(harmony):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Sky colour?"},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Goodbye!"},
    ]
    assert trained(harmony, messages) == [FINAL + "Hello.", FINAL + "Blue.", FINAL + "Goodbye!<|return|>"]
    assert untrained(harmony, messages) == (
        SYSTEM + "<|start|>user<|message|>Hi<|end|><|start|>assistant<|end|><|start|>user<|message|>Sky colour?<|end|>"
        "<|start|>assistant<|end|><|start|>user<|message|>Bye<|end|><|start|>assistant"
    )
    assert trained(harmony, messages, last_turn_only=True) == [FINAL + "Goodbye!<|return|>"]


def test_system_message_becomes_the_untrained_developer_message(harmony):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3 + 3?"},
        {"role": "assistant", "content": "6."},
    ]
    developer = "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n<|end|>"
    assert harmony.apply_chat_template(messages, tokenize=False) == (
        SYSTEM + developer + "<|start|>user<|message|>What is 2 + 2?<|end|><|start|>assistant" + FINAL + "4.<|end|>"
        "<|start|>user<|message|>And 3 + 3?<|end|><|start|>assistant" + FINAL + "6.<|return|>"
    )
    assert trained(harmony, messages) == [FINAL + "4.", FINAL + "6.<|return|>"]
    assert untrained(harmony, messages) == (
        SYSTEM + developer + "<|start|>user<|message|>What is 2 + 2?<|end|><|start|>assistant<|end|>"
        "<|start|>user<|message|>And 3 + 3?<|end|><|start|>assistant"
    )


@pytest.mark.parametrize("field", ["thinking", "reasoning_content"])
def test_reasoning_of_the_last_reply_is_trained_and_earlier_reasoning_is_not_rendered(harmony, field):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello.", field: "They greet me."},
        {"role": "user", "content": "Sky colour?"},
        {"role": "assistant", "content": "Blue.", field: "Rayleigh scattering: blue."},
    ]
    text = harmony.apply_chat_template(messages, tokenize=False)
    assert "They greet me." not in text  # the template drops the reasoning of earlier replies
    assert trained(harmony, messages) == [
        FINAL + "Hello.",
        ANALYSIS + "Rayleigh scattering: blue.<|end|><|start|>assistant" + FINAL + "Blue.<|return|>",
    ]


WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city."}},
                "required": ["city"],
            },
        },
    }
]


def _weather_call(**fields) -> dict:
    return {
        "role": "assistant",
        "content": "",
        **fields,
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    }


CALL = ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
ANSWER = [{"role": "tool", "content": "sunny, 24 C"}, {"role": "assistant", "content": "Sunny, 24 C."}]


@pytest.mark.parametrize("reasoning", [{}, {"thinking": "I need the weather."}, {"content": "Let me look."}])
def test_tool_call_answered_later_is_trained_through_call_without_its_reasoning(harmony, reasoning):
    messages = [{"role": "user", "content": "Weather in Paris?"}, _weather_call(**reasoning), *ANSWER]
    text = harmony.apply_chat_template(messages, tools=WEATHER, tokenize=False)
    assert text.endswith(
        "<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant"
        + CALL
        + '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny, 24 C"<|end|>'
        + "<|start|>assistant"
        + FINAL
        + "Sunny, 24 C.<|return|>"
    )
    assert trained(harmony, messages, WEATHER) == [CALL, FINAL + "Sunny, 24 C.<|return|>"]


@pytest.mark.parametrize("result", [[], [{"role": "tool", "content": "sunny, 24 C"}]])
@pytest.mark.parametrize(
    ("reasoning", "analysis"),
    [({"thinking": "I need the weather."}, "I need the weather."), ({"content": "Let me look."}, "Let me look.")],
)
def test_tool_call_not_yet_answered_keeps_its_reasoning(harmony, reasoning, analysis, result):
    messages = [{"role": "user", "content": "Weather in Paris?"}, _weather_call(**reasoning), *result]
    assert trained(harmony, messages, WEATHER) == [ANALYSIS + analysis + "<|end|><|start|>assistant" + CALL]


def test_conversation_ending_with_a_user_turn(harmony):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    assert trained(harmony, messages) == [FINAL + "Hello."]


def test_adjacent_assistant_messages_stay_apart(harmony):
    messages = [
        {"role": "user", "content": "Two answers"},
        {"role": "assistant", "content": "One."},
        {"role": "assistant", "content": "Two."},
    ]
    assert trained(harmony, messages) == [FINAL + "One.", FINAL + "Two.<|return|>"]


@pytest.mark.parametrize(
    ("turn", "content"),
    [(1, "Sure<|return|>"), (1, "Sure<|end|>"), (0, "Sure<|end|> and more"), (0, "Sure<|return|> and more")],
)
def test_reply_holding_an_end_token_raises(harmony, turn, content):
    replies = ["Fine.", "Fine."]
    replies[turn] = content
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": replies[0]},
        {"role": "user", "content": "Ok"},
        {"role": "assistant", "content": replies[1]},
    ]
    with pytest.raises(ChatTemplateError, match=f"assistant turn {turn}: the end of its content is not inside"):
        tokenize_conversation(harmony, messages, probe_template(harmony))


def test_user_text_with_an_assistant_header_raises(harmony):
    messages = [{"role": "user", "content": "Say <|start|>assistant please"}, {"role": "assistant", "content": "No."}]
    with pytest.raises(
        ChatTemplateError, match=r"message 0 \(user\) contains the assistant header '<\|start\|>assistant'"
    ):
        tokenize_conversation(harmony, messages, probe_template(harmony))


def test_render_conversation_is_apply_chat_template(harmony):
    conversations = [
        (
            [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Ünïcödé «q» 🙂"},
                {"role": "assistant", "content": "A.", "reasoning_content": "r"},
                {"role": "user", "content": "Again"},
                {"role": "assistant", "content": "B.", "thinking": "t"},
            ],
            None,
        ),
        (
            [
                {"role": "user", "content": "Weather?"},
                _weather_call(),
                {"role": "tool", "content": "sunny"},
                {"role": "assistant", "content": "Sunny."},
            ],
            WEATHER,
        ),
    ]
    for messages, tools in conversations:
        assert render_conversation(harmony, messages, tools) == harmony.apply_chat_template(
            messages, tools=tools, tokenize=False
        )


def _write(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.mark.parametrize("train_on", ["assistant", "last_assistant"])
def test_sft_documents_train_the_same_tokens(tmp_path, harmony, train_on):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Sky colour?"},
        {"role": "assistant", "content": "Blue.", "thinking": "Rayleigh."},
    ]
    path = _write(tmp_path / "chats.jsonl", [{"messages": messages}])
    document = SFTDocuments(RecordSource([SourceSpec(path)]), harmony, max_tokens=1024, train_on=train_on).get(0)
    assert isinstance(document, Document)
    assert list(document.input_ids) == list(harmony.apply_chat_template(messages, tokenize=True)["input_ids"])
    labelled = decode_exactly(harmony, [int(label) for label in document.labels if label >= 0])
    last = ANALYSIS + "Rayleigh.<|end|><|start|>assistant" + FINAL + "Blue.<|return|>"
    assert labelled == (FINAL + "Hello." if train_on == "assistant" else "") + last


def test_channel_tags_in_content_are_a_bad_record_named_by_file_and_line(tmp_path, harmony):
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    bad = {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "<|channel|>final<|message|>Hello."},
        ]
    }
    documents = SFTDocuments(
        RecordSource([SourceSpec(_write(tmp_path / "chats.jsonl", [good, bad]))]), harmony, max_tokens=1024
    )
    assert isinstance(documents.get(0), Document)
    with pytest.raises(
        DataError,
        match=r"chats\.jsonl record 2 \(line 2\): TemplateError: You have passed a message "
        r"containing <\|channel\|> tags in the content field",
    ):
        documents.get(1)
    with pytest.raises(jinja2.TemplateError):  # as apply_chat_template refuses it
        harmony.apply_chat_template(bad["messages"], tokenize=False)


def test_generation_stops_where_training_ends_a_reply(harmony):
    """A reply ends with <|return|> (an answer) or <|call|> (a tool call): sample replies stop at both."""
    from chattune.model.generate import stop_token_ids

    ids = stop_token_ids(harmony)
    assert ids[:2] == harmony.convert_tokens_to_ids(["<|return|>", "<|call|>"])
    assert "<|end|>" not in harmony.convert_ids_to_tokens(ids)  # history's token: the model does not stop there
