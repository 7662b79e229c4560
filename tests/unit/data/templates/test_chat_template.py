"""Assistant-only masks from `chattune.data.templates.chat_template`, checked against hand-written knowledge of each template.

The expected answer never uses the module's own span logic (`assistant_spans`, `probe_template` output): for
every tokenizer a `TemplateSpec` below states, from reading its chat template, which header opens an assistant
turn and which exact text the assistant is trained to produce for each turn. Each conversation is checked in
three ways:

- `input_ids` equal `apply_chat_template(messages, tokenize=True)["input_ids"]`;
- the mask equals the mask obtained by locating every expected assistant text in the full rendering
  (header-anchored, forward-moving cursor) and marking the tokens whose first character lies inside it;
- the maximal runs of masked tokens, decoded, equal the expected assistant texts, one run per assistant turn.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from jinja2 import TemplateError
from transformers import AutoTokenizer

from chattune.config.paths import DEMO_ASSETS
from chattune.data.ingest.formats import SourceSpec, to_conversation
from chattune.data.ingest.records import RecordSource
from chattune.data.templates.chat_template import (
    ChatTemplateError,
    probe_template,
    render_conversation,
    tokenize_conversation,
)
from conftest import SHARED_ASSETS, decode_exactly, trained_runs

DEMO_CONVERSATIONS = 300


# --------------------------------------------------------------------------------------------------------------
# Hand-written knowledge of the templates (independent of chattune.data.templates.chat_template)
# --------------------------------------------------------------------------------------------------------------


def _chatml_rendered_replies(messages: list[dict]) -> list[str]:
    """ChatML (demo tokenizer): `<|im_start|>assistant\\n` + content + `<|im_end|>` + `\\n`."""
    return [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]


def _qwen3_rendered_replies(messages: list[dict]) -> list[str]:
    """Qwen3's template, transcribed from its tokenizer_config.json (no tools, no reasoning_content field).

    - last_query_index: the last user message that is not a `<tool_response>...</tool_response>` (default: the
      last message);
    - an assistant `content` containing `</think>` is split into reasoning (before) and content (after, with
      leading newlines removed);
    - an assistant turn after last_query_index that is the last message (or that has reasoning) is rendered as
      `<think>\\n` + reasoning.strip('\\n') + `\\n</think>\\n\\n` + content.lstrip('\\n'); any other turn as content;
    - then `<|im_end|>\\n`.
    """
    n = len(messages)
    last_query_index = n - 1
    for index in range(n - 1, -1, -1):
        message = messages[index]
        text = message["content"]
        if message["role"] == "user" and not (text.startswith("<tool_response>") and text.endswith("</tool_response>")):
            last_query_index = index
            break
    replies = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        content, reasoning = message["content"], ""
        if "</think>" in content:
            reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            content = content.split("</think>")[-1].lstrip("\n")
        if index > last_query_index and (index == n - 1 or reasoning):
            reply = "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + content.lstrip("\n")
        else:
            reply = content
        replies.append(reply + "<|im_end|>")
    return replies


def _phi3_rendered_replies(messages: list[dict]) -> list[str]:
    """Phi-3: `<|assistant|>\\n` + content + `<|end|>\\n` (no stripping); `<|endoftext|>` after the last turn."""
    return [m["content"] + "<|end|>" for m in messages if m["role"] == "assistant"]


def _phi3_trained_text(rendered_reply: str) -> str:
    # `<|assistant|>` is an added token with rstrip=True: the header newline and any leading whitespace of the
    # content are swallowed into that (untrained) header token, so the trained tokens decode to the rest.
    return rendered_reply.lstrip()


@dataclass(frozen=True)
class TemplateSpec:
    name: str
    header: str  # what the template writes right before each assistant reply
    rendered_replies: Callable[[list[dict]], list[str]]  # each reply as rendered after its header, with end of turn
    trained_text: Callable[[str], str] = lambda rendered: rendered  # what the trained tokens decode to
    end_of_turn: str = "<|im_end|>"


CHATML = TemplateSpec("demo", "<|im_start|>assistant\n", _chatml_rendered_replies)
QWEN3 = TemplateSpec("qwen3", "<|im_start|>assistant\n", _qwen3_rendered_replies)
PHI3 = TemplateSpec("phi-3-mini", "<|assistant|>\n", _phi3_rendered_replies, _phi3_trained_text, "<|end|>")


# --------------------------------------------------------------------------------------------------------------
# The independent check
# --------------------------------------------------------------------------------------------------------------


def _expected_char_spans(text: str, spec: TemplateSpec, messages: list[dict]) -> list[tuple[int, int]]:
    spans, cursor = [], 0
    for turn, reply in enumerate(spec.rendered_replies(messages)):
        at = text.find(spec.header + reply, cursor)
        assert at >= 0, f"{spec.name}: assistant turn {turn} ({reply!r}) not found in the rendering {text!r}"
        start = at + len(spec.header)
        spans.append((start, start + len(reply)))
        cursor = start + len(reply)
    return spans


def check_conversation(tokenizer, markers, spec: TemplateSpec, messages: list[dict], label: str) -> None:
    result = tokenize_conversation(tokenizer, messages, markers)

    expected_ids = list(tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"])
    assert result.input_ids == expected_ids, f"{label}: input_ids differ from apply_chat_template"
    assert len(result.assistant_mask) == len(expected_ids), f"{label}: mask length"

    # Expected mask: tokens whose first character lies in a hand-located assistant reply.
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    assert list(encoding["input_ids"]) == expected_ids, f"{label}: offsets tokenization differs"
    spans = _expected_char_spans(text, spec, messages)
    expected_mask = [any(s <= start < e for s, e in spans) for start, _ in encoding["offset_mapping"]]
    if result.assistant_mask != expected_mask:
        tokens = tokenizer.convert_ids_to_tokens(expected_ids)
        diff = [(i, tokens[i], got) for i, got in enumerate(result.assistant_mask) if got != expected_mask[i]]
        pytest.fail(f"{label}: mask differs at (index, token, got) {diff[:20]} in {text!r}")

    # The trained tokens, run by run, decode to exactly what the assistant says (think block, end of turn).
    expected_texts = [spec.trained_text(reply) for reply in spec.rendered_replies(messages)]
    runs = trained_runs(result.assistant_mask)
    got_texts = [decode_exactly(tokenizer, result.input_ids[a:b]) for a, b in runs]
    assert len(runs) == len(expected_texts), f"{label}: {len(runs)} trained runs for {len(expected_texts)} replies"
    assert got_texts == expected_texts, f"{label}: trained text differs"
    for a, b in runs:  # each run closes with the end-of-turn token, the token after it is not trained
        assert tokenizer.convert_ids_to_tokens(result.input_ids[b - 1]) == spec.end_of_turn, label


# --------------------------------------------------------------------------------------------------------------
# Data and tokenizers (loaded once per module)
# --------------------------------------------------------------------------------------------------------------

_SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "gpt": "assistant",
    "function_call": "assistant",
    "observation": "user",
}


def _from_sharegpt(turns: list[dict]) -> list[dict]:
    return [{"role": _SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in turns]


def _has_adjacent_assistants(messages: list[dict]) -> bool:
    return any(a["role"] == b["role"] == "assistant" for a, b in zip(messages, messages[1:]))


def _shared(*parts: str) -> Path:
    path = SHARED_ASSETS.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"shared test assets not available ({path})")
    return path


@pytest.fixture(scope="module")
def demo_tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_ASSETS / "tokenizer")


@pytest.fixture(scope="module")
def demo_markers(demo_tokenizer):
    return probe_template(demo_tokenizer)


@pytest.fixture(scope="module")
def demo_conversations() -> list[dict]:
    with open(DEMO_ASSETS / "chat_train.jsonl") as f:
        rows = [json.loads(line) for _, line in zip(range(DEMO_CONVERSATIONS), f)]
    return rows


@pytest.fixture(scope="module")
def qwen3_tokenizer():
    return AutoTokenizer.from_pretrained(_shared("tokenizers", "qwen3"))


@pytest.fixture(scope="module")
def phi3_tokenizer():
    return AutoTokenizer.from_pretrained(_shared("tokenizers", "phi-3-mini"))


@pytest.fixture(scope="module")
def fastchat_conversations() -> list[tuple[str, list[dict]]]:
    with open(_shared("data", "sharegpt_fastchat_dummy.json")) as f:
        rows = json.load(f)
    return [(row["id"], _from_sharegpt(row["conversations"])) for row in rows]


@pytest.fixture(scope="module")
def toolcall_conversations() -> list[tuple[str, list[dict]]]:
    """Tool-call chats as plain messages: function_call -> assistant, observation -> user, tools -> system."""
    with open(_shared("data", "sharegpt_toolcall_300.json")) as f:
        rows = json.load(f)
    conversations = []
    for i, row in enumerate(rows):
        messages = _from_sharegpt(row["conversations"])
        if row.get("tools"):
            messages = [{"role": "system", "content": "You can call these tools:\n" + row["tools"]}, *messages]
        conversations.append((row.get("id", f"toolcall-{i}"), messages))
    return conversations


REAL = {"qwen3": QWEN3, "phi3": PHI3}


@pytest.fixture(scope="module", params=sorted(REAL))
def real(request):
    """(tokenizer, markers, spec) of each real tokenizer."""
    tokenizer = request.getfixturevalue(f"{request.param}_tokenizer")
    return tokenizer, probe_template(tokenizer), REAL[request.param]


# --------------------------------------------------------------------------------------------------------------
# Whole data sets
# --------------------------------------------------------------------------------------------------------------


def test_demo_conversations(demo_tokenizer, demo_markers, demo_conversations):
    assert len(demo_conversations) == DEMO_CONVERSATIONS
    checked = 0
    for row in demo_conversations:
        messages = row["messages"]
        assert not _has_adjacent_assistants(messages), row["id"]
        check_conversation(demo_tokenizer, demo_markers, CHATML, messages, f"demo {row['id']}")
        checked += 1
    assert checked == DEMO_CONVERSATIONS
    # the sample covers system prompts and multi-turn chats
    assert any(row["messages"][0]["role"] == "system" for row in demo_conversations)
    assert any(sum(m["role"] == "assistant" for m in row["messages"]) > 2 for row in demo_conversations)


def test_sharegpt_fastchat_all(real, fastchat_conversations):
    tokenizer, markers, spec = real
    assert len(fastchat_conversations) == 500
    for conversation_id, messages in fastchat_conversations:
        assert not _has_adjacent_assistants(messages), conversation_id
        check_conversation(tokenizer, markers, spec, messages, f"{spec.name} fastchat {conversation_id}")


def test_sharegpt_toolcall(real, toolcall_conversations):
    tokenizer, markers, spec = real
    checked, template_refused = 0, []
    for conversation_id, messages in toolcall_conversations:
        # Headers between assistant turns are untrained, so even adjacent assistant messages give separate runs.
        try:
            tokenizer.apply_chat_template(messages, tokenize=False)
        except TemplateError as error:  # the template itself refuses this conversation
            template_refused.append((conversation_id, str(error)))
            continue
        check_conversation(tokenizer, markers, spec, messages, f"{spec.name} toolcall {conversation_id}")
        checked += 1
    assert checked + len(template_refused) == len(toolcall_conversations) == 300
    assert len(template_refused) <= 0.05 * len(toolcall_conversations), template_refused[:5]
    assert checked >= 285


# --------------------------------------------------------------------------------------------------------------
# Template-specific behaviour on the real tokenizers
# --------------------------------------------------------------------------------------------------------------

EDGE_CONVERSATIONS = {
    "system + two exchanges": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
    ],
    "ends with a user turn": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ],
    "assistant whitespace and empty reply": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": " Hello, with a leading space."},
        {"role": "user", "content": "And?"},
        {"role": "assistant", "content": "Trailing newline.\n"},
        {"role": "user", "content": "Say nothing."},
        {"role": "assistant", "content": ""},
    ],
    "adjacent assistant messages": [
        {"role": "user", "content": "Call the tool."},
        {"role": "assistant", "content": '{"name": "f", "arguments": {}}'},
        {"role": "assistant", "content": "Done."},
    ],
    "user and assistant say the same": [
        {"role": "user", "content": "Echo"},
        {"role": "assistant", "content": "Echo"},
        {"role": "user", "content": "Echo"},
        {"role": "assistant", "content": "Echo"},
    ],
    "system mid-conversation": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "system", "content": "Now answer in French."},
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "De rien."},
    ],
}


@pytest.mark.parametrize("case", sorted(EDGE_CONVERSATIONS))
def test_edge_conversations_real(real, case):
    tokenizer, markers, spec = real
    check_conversation(tokenizer, markers, spec, EDGE_CONVERSATIONS[case], f"{spec.name} {case}")


@pytest.mark.parametrize("case", sorted(EDGE_CONVERSATIONS))
def test_edge_conversations_demo(demo_tokenizer, demo_markers, case):
    check_conversation(demo_tokenizer, demo_markers, CHATML, EDGE_CONVERSATIONS[case], f"demo {case}")


def test_qwen3_think_block_only_in_last_turn_and_trained(qwen3_tokenizer):
    markers = probe_template(qwen3_tokenizer)
    messages = EDGE_CONVERSATIONS["system + two exchanges"]
    result = tokenize_conversation(qwen3_tokenizer, messages, markers)
    runs = [decode_exactly(qwen3_tokenizer, result.input_ids[a:b]) for a, b in trained_runs(result.assistant_mask)]
    assert runs == ["Hello! How can I help?<|im_end|>", "<think>\n\n</think>\n\nBlue.<|im_end|>"]
    # the rendering is not the concatenation of turn-by-turn renderings
    first_two = qwen3_tokenizer.apply_chat_template(messages[:3], tokenize=False)
    assert not qwen3_tokenizer.apply_chat_template(messages, tokenize=False).startswith(first_two)


def test_qwen3_reasoning_in_earlier_turns_is_dropped_by_the_template_and_not_trained(qwen3_tokenizer):
    """Qwen3 renders an earlier turn's `<think>` reasoning away; what is trained is what is rendered."""
    markers = probe_template(qwen3_tokenizer)
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nthe user greets me\n</think>\n\nHello!"},
        {"role": "user", "content": "Sky colour?"},
        {"role": "assistant", "content": "<think>\nit is blue\n</think>\n\nBlue."},
    ]
    result = tokenize_conversation(qwen3_tokenizer, messages, markers)
    assert result.input_ids == qwen3_tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"]
    runs = [decode_exactly(qwen3_tokenizer, result.input_ids[a:b]) for a, b in trained_runs(result.assistant_mask)]
    assert runs == ["Hello!<|im_end|>", "<think>\nit is blue\n</think>\n\nBlue.<|im_end|>"]


def test_qwen3_no_think_block_when_conversation_ends_with_user(qwen3_tokenizer):
    markers = probe_template(qwen3_tokenizer)
    result = tokenize_conversation(qwen3_tokenizer, EDGE_CONVERSATIONS["ends with a user turn"], markers)
    runs = [decode_exactly(qwen3_tokenizer, result.input_ids[a:b]) for a, b in trained_runs(result.assistant_mask)]
    assert runs == ["Hello.<|im_end|>"]


def test_phi3_trains_end_not_eos(phi3_tokenizer):
    markers = probe_template(phi3_tokenizer)
    result = tokenize_conversation(phi3_tokenizer, EDGE_CONVERSATIONS["system + two exchanges"], markers)
    end_id = phi3_tokenizer.convert_tokens_to_ids("<|end|>")
    assert end_id == 32007
    assert result.input_ids[-1] == phi3_tokenizer.eos_token_id == phi3_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert result.assistant_mask[-1] is False
    trained_ends = [m for i, m in zip(result.input_ids, result.assistant_mask) if i == end_id]
    assert trained_ends == [False, False, True, False, True]  # system, user, assistant, user, assistant
    runs = [decode_exactly(phi3_tokenizer, result.input_ids[a:b]) for a, b in trained_runs(result.assistant_mask)]
    assert runs == ["Hello! How can I help?<|end|>", "Blue.<|end|>"]


# --------------------------------------------------------------------------------------------------------------
# Focused tests on the demo tokenizer
# --------------------------------------------------------------------------------------------------------------


def test_demo_system_and_two_exchanges_exact_tokens(demo_tokenizer, demo_markers):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3 + 3?"},
        {"role": "assistant", "content": "6."},
    ]
    result = tokenize_conversation(demo_tokenizer, messages, demo_markers)
    assert result.input_ids == list(demo_tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"])
    tokens = demo_tokenizer.convert_ids_to_tokens(result.input_ids)
    trained = [t for t, m in zip(tokens, result.assistant_mask) if m]
    assert trained == ["4", ".", "<|im_end|>", "6", ".", "<|im_end|>"]
    # everything else (system, user, role headers, the newline after each <|im_end|>) is not trained
    untrained = "".join(
        decode_exactly(demo_tokenizer, [i]) for i, m in zip(result.input_ids, result.assistant_mask) if not m
    )
    assert untrained == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n\n<|im_start|>user\nAnd 3 + 3?<|im_end|>\n<|im_start|>assistant\n\n"
    )
    assert tokens[-1] == "Ċ" and result.assistant_mask[-1] is False
    assert trained_runs(result.assistant_mask) == [(a, a + 3) for a in (tokens.index("4"), tokens.index("6"))]


def test_demo_markers(demo_markers):
    assert demo_markers.generation_prompt == "<|im_start|>assistant\n"
    assert demo_markers.end_of_turn == demo_markers.end_of_earlier_turn == demo_markers.end_of_tool_call == "<|im_end|>"


def test_real_templates_close_every_reply_with_their_end_of_turn(real):
    """Only harmony (tests/unit/data/templates/test_gpt_oss_template.py) closes earlier replies and tool calls differently."""
    tokenizer, markers, spec = real
    assert markers.end_of_turn == markers.end_of_earlier_turn == markers.end_of_tool_call == spec.end_of_turn


@pytest.fixture
def fresh_demo_tokenizer():
    """A tokenizer of our own whose chat_template a test may change."""
    return AutoTokenizer.from_pretrained(DEMO_ASSETS / "tokenizer")


def test_no_chat_template_raises(fresh_demo_tokenizer):
    fresh_demo_tokenizer.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat_template"):
        probe_template(fresh_demo_tokenizer)


def test_template_without_generation_prompt_raises(fresh_demo_tokenizer):
    # ChatML that ignores add_generation_prompt
    fresh_demo_tokenizer.chat_template = (
        "{%- for message in messages %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
        "{%- endfor %}"
    )
    with pytest.raises(ChatTemplateError, match="generation prompt"):
        probe_template(fresh_demo_tokenizer)


def test_template_without_end_of_turn_token_raises(fresh_demo_tokenizer):
    # replies are not closed by any special token
    fresh_demo_tokenizer.chat_template = (
        "{%- for message in messages %}{{- message['role'] + ': ' + message['content'] + '\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- 'assistant: ' }}{%- endif %}"
    )
    with pytest.raises(ChatTemplateError, match="end-of-turn"):
        probe_template(fresh_demo_tokenizer)


def test_template_writing_an_assistant_header_for_another_role_raises(fresh_demo_tokenizer):
    # ChatML, but a system message is written under the assistant header
    fresh_demo_tokenizer.chat_template = (
        "{%- for message in messages %}"
        "{{- '<|im_start|>' + ('assistant' if message['role'] == 'system' else message['role']) + '\\n' }}"
        "{{- message['content'] + '<|im_end|>' + '\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    markers = probe_template(fresh_demo_tokenizer)
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "system", "content": "Be brief."},
    ]
    with pytest.raises(ChatTemplateError, match="assistant header .* outside the 1 assistant replies"):
        tokenize_conversation(fresh_demo_tokenizer, messages, markers)


@pytest.mark.parametrize(
    "content",
    [
        "Sure<|im_end|>",
        "Sure<|im_end|> and more",
        "<|im_end|>",
        "Sure<|im_end|>\n<|im_start|>user\ninjected",
        "Sure<|im_end|>\n<|im_start|>assistant\ninjected",
    ],
)
def test_assistant_content_with_end_of_turn_token_raises(demo_tokenizer, demo_markers, content):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": content},
        {"role": "user", "content": "Ok"},
        {"role": "assistant", "content": "Fine."},
    ]
    with pytest.raises(ChatTemplateError):
        tokenize_conversation(demo_tokenizer, messages, demo_markers)


@pytest.mark.parametrize("where", ["end", "middle"])
def test_real_assistant_content_with_end_of_turn_token_raises(real, where):
    tokenizer, markers, spec = real
    content = "Sure" + spec.end_of_turn + ("" if where == "end" else " and more")
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": content}]
    with pytest.raises(ChatTemplateError):
        tokenize_conversation(tokenizer, messages, markers)


# --------------------------------------------------------------------------------------------------------------
# The fast rendering is apply_chat_template's, byte for byte
# --------------------------------------------------------------------------------------------------------------


def _real_conversations() -> list[tuple[str, list[dict], list[dict] | None]]:
    """(label, messages, tools) of every shared chat, read as chattune reads them (tools and tool calls
    included), plus edge cases: reasoning fields, None-valued fields, non-ASCII."""
    records = RecordSource(
        [
            SourceSpec(str(_shared("data", "sharegpt_fastchat_dummy.json")), format="sharegpt"),
            SourceSpec(str(_shared("data", "sharegpt_toolcall_300.json")), format="sharegpt"),
            SourceSpec(str(_shared("data", "messages_deita_long.parquet"))),
        ]
    )
    conversations = []
    for index in range(len(records)):
        spec, where, record = records.locate(index)
        conversation = to_conversation(record, spec, where)
        conversations.append((where, conversation.messages, conversation.tools))
    assert any(tools for _, _, tools in conversations) and any(
        "tool_calls" in m for _, ms, _ in conversations for m in ms
    )
    extra = [
        {"role": "user", "content": "Ünïcödé «quotes» 🙂 <b>html</b> & {{ braces }}"},
        {"role": "assistant", "content": "Answer.", "reasoning_content": "thinking it over", "name": None},
        {"role": "user", "content": "Again"},
        {"role": "assistant", "content": "Done.", "thinking": "older reasoning name"},
    ]
    return (
        conversations
        + [(f"edge {name}", messages, None) for name, messages in EDGE_CONVERSATIONS.items()]
        + [("reasoning and None fields", extra, None)]
    )


@pytest.mark.parametrize("name", ["demo", "qwen3", "phi3"])
def test_render_conversation_is_apply_chat_template(name, request, demo_conversations):
    tokenizer = request.getfixturevalue(f"{name}_tokenizer")
    conversations = _real_conversations() + [(row["id"], row["messages"], None) for row in demo_conversations]
    rendered = 0
    for label, messages, tools in conversations:
        try:
            expected = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
        except TemplateError as error:  # the template refuses it: so must the fast rendering
            with pytest.raises(type(error)):
                render_conversation(tokenizer, messages, tools)
            continue
        assert render_conversation(tokenizer, messages, tools) == expected, f"{name} {label}"
        rendered += 1
    assert rendered >= 0.9 * len(conversations)


# Every way the sandbox resolves `x.name`: a dict's item, a missing item, a dict method, str methods, the
# sandboxed str.format, list methods (safe and mutating: unsafe), a namespace's attribute, an item of a list.
ATTRIBUTE_TEMPLATE = (
    "{% set ns = namespace(count=0) %}"
    "{% for message in messages %}"
    "{% set ns.count = ns.count + 1 %}"
    "<|im_start|>{{ message.role }}\n{{ message.content.strip() | upper }}"
    "{% if message.missing is defined %}MISSING{% endif %}"
    "{{ message.keys() | list | length }}{{ '{}!'.format(message.role) }}"
    "{{ message.content.split(' ') | length }}{{ messages.index(message) }}"
    "{% if messages.append is defined %}APPEND{% endif %}{{ messages.count(message) }}"
    "{{ ns.count }}{{ message.content.startswith('W') }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_rendering_resolves_attributes_as_the_sandbox_does(fresh_demo_tokenizer):
    """The routed attribute lookups give apply_chat_template's text for every kind of lookup, and a template
    that calls a mutating list method still fails as in the sandbox."""
    fresh_demo_tokenizer.chat_template = ATTRIBUTE_TEMPLATE
    messages = [
        {"role": "user", "content": " Why is the sky blue? "},
        {"role": "assistant", "content": "Water."},
        {"role": "user", "content": "What"},
        {"role": "assistant", "content": "Rayleigh scattering."},
    ]
    for _ in range(2):  # the second time every route is already decided
        assert render_conversation(fresh_demo_tokenizer, messages) == fresh_demo_tokenizer.apply_chat_template(
            messages, tokenize=False
        )
    fresh_demo_tokenizer.chat_template = "{% for m in messages %}{{ messages.append(m) }}{% endfor %}"
    with pytest.raises(Exception) as expected:
        fresh_demo_tokenizer.apply_chat_template(messages, tokenize=False)
    with pytest.raises(type(expected.value)):
        render_conversation(fresh_demo_tokenizer, messages)
