"""Assistant-only label masks for any Hugging Face chat template, without `{% generation %}` markers.

The trained token ids are exactly `apply_chat_template(messages, tokenize=True)`: we render the whole
conversation once and tokenize it the way transformers does (`add_special_tokens=False`).

To find what to train, we do not re-render the conversation turn by turn: templates such as Qwen3's
render the last assistant turn differently (an empty think block), so turn-by-turn renderings are not
prefixes of the full one. Instead we probe the template once for these strings:

- the generation prompt (what `add_generation_prompt=True` appends, e.g. `<|im_start|>assistant\\n`),
  which opens every assistant turn and is the prompt the model sees at inference time;
- the end-of-turn token (the first special token the template writes after the reply that ends a
  conversation, e.g. `<|im_end|>`, or Phi-3's `<|end|>`, which is not its eos): what the model emits to stop;
- the token that closes a reply that another turn follows: the same for most templates, but harmony (gpt-oss)
  ends the last reply with `<|return|>` and an earlier one, which is history, with `<|end|>`;
- the token that closes a tool call: the end-of-turn token where the template writes it after the call,
  else the first special token after the call (harmony's `<|call|>`).

Each assistant reply is then the text from the end of its generation prompt to the end of its
end-of-turn token: everything the model must produce at inference (think block and tool calls included),
and nothing of the system/user/tool turns. A reply may hold several messages that the model opens itself
(harmony's reasoning, then its answer or tool call: `...<|end|><|start|>assistant...`). A reply closed by
the history token instead of the end-of-turn token is trained without that token: it is how history records
the reply, not what the model writes to end it (gpt-oss stops with `<|return|>` or `<|call|>`; trained on
`<|end|>` after its answers, it would learn not to stop).
Tokens whose first character lies in such a span are trained.

For throughput, many rendered conversations are tokenized and masked in one call
(`chattune.data.templates.text_encoder.TextBatchEncoder`); `tokenize_conversation` is the same path for one conversation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from transformers import PreTrainedTokenizerBase

from chattune.data.templates.text_encoder import TextBatchEncoder
from chattune.errors import UserError

try:  # how transformers renders chat templates (private: checked against apply_chat_template by the tests)
    from transformers.utils.chat_template_utils import (
        _alias_reasoning_fields,
        _compile_jinja_template,
        _plain_template_data,
    )
except ImportError:
    _compile_jinja_template = None

_PROBE_USER = "chattune probe question"
_PROBE_REPLY = "chattune probe reply"
_PROBE_FOLLOW_UP = "chattune probe follow-up"


class ChatTemplateError(UserError, ValueError):
    """The template cannot be used to locate assistant replies, or a conversation does not fit it."""


@dataclass(frozen=True)
class TemplateMarkers:
    generation_prompt: str
    end_of_turn: str  # closes the reply that ends a conversation
    end_of_earlier_turn: str  # closes a reply that another turn follows (usually end_of_turn)
    end_of_tool_call: str  # closes a reply that calls a tool (usually end_of_turn)
    renders_tools: bool = False  # does the template write a `tools` list into the prompt?
    renders_tool_calls: bool = False  # does it write an assistant message's `tool_calls`?


@dataclass(frozen=True)
class TokenizedConversation:
    input_ids: list[int]
    assistant_mask: list[bool]  # True where the token belongs to an assistant reply (incl. end of turn)


def probe_template(tokenizer: PreTrainedTokenizerBase) -> TemplateMarkers:
    """Find the generation prompt and the end-of-turn tokens of a tokenizer's chat template."""
    if tokenizer.chat_template is None:
        raise ChatTemplateError("the tokenizer has no chat_template")
    user = [{"role": "user", "content": _PROBE_USER}]
    without_prompt = tokenizer.apply_chat_template(user, tokenize=False)
    with_prompt = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    rendered = tokenizer.apply_chat_template(user + [{"role": "assistant", "content": _PROBE_REPLY}], tokenize=False)
    # Some templates end a conversation with eos unless a generation prompt follows (Phi-3), so the prompt
    # is what follows the common prefix of the two renderings, and a reply must follow the prompt.
    common = 0
    while common < min(len(with_prompt), len(without_prompt)) and with_prompt[common] == without_prompt[common]:
        common += 1
    special = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special and t.content]
    common = _back_off_to_token_boundary(with_prompt, common, special)
    generation_prompt = with_prompt[common:]
    if not generation_prompt.strip() or not rendered.startswith(with_prompt):
        raise ChatTemplateError(
            "the chat template has no generation prompt that an assistant reply follows "
            f"(generation prompt {generation_prompt!r}), so assistant turns cannot be located"
        )

    reply_at = rendered.rfind(_PROBE_REPLY)
    if reply_at < 0:
        raise ChatTemplateError("the chat template does not render the assistant content verbatim")
    after_reply = rendered[reply_at + len(_PROBE_REPLY) :]
    found = [(after_reply.find(s), -len(s), s) for s in special if after_reply.find(s) >= 0]
    if not found:
        raise ChatTemplateError(
            f"no special token follows an assistant reply in the chat template (text after the reply: {after_reply!r}); "
            "cannot tell which end-of-turn token to train"
        )
    end_of_turn = min(found)[2]  # the earliest, longest at a tie
    tool = {
        "type": "function",
        "function": {
            "name": "chattune_probe_tool",
            "description": "probe",
            "parameters": {"type": "object", "properties": {}},
        },
    }
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "chattune_probe_call", "arguments": {}}}],
    }
    return TemplateMarkers(
        generation_prompt=generation_prompt,
        end_of_turn=end_of_turn,
        end_of_earlier_turn=_end_of_earlier_turn(tokenizer, user, special) or end_of_turn,
        end_of_tool_call=_end_of_tool_call(tokenizer, user, special, end_of_turn) or end_of_turn,
        renders_tools=_renders(tokenizer, user, [tool], "chattune_probe_tool"),
        renders_tool_calls=_renders(tokenizer, user + [call], None, "chattune_probe_call"),
    )


def _end_of_earlier_turn(tokenizer: PreTrainedTokenizerBase, user: list[dict], special: list[str]) -> str | None:
    """The first special token between a reply and the user turn after it (the earliest, longest at a tie).

    None where there is none, or the template refuses a second user turn: then no reply is ever followed
    by another turn that could be told apart from it, and the end-of-turn token serves."""
    try:
        followed = tokenizer.apply_chat_template(
            user + [{"role": "assistant", "content": _PROBE_REPLY}, {"role": "user", "content": _PROBE_FOLLOW_UP}],
            tokenize=False,
        )
    except (jinja2.TemplateError, TypeError, ValueError):
        return None
    reply_at, follow_up_at = followed.find(_PROBE_REPLY), followed.rfind(_PROBE_FOLLOW_UP)
    if reply_at < 0 or follow_up_at < reply_at:
        return None
    between = followed[reply_at + len(_PROBE_REPLY) : follow_up_at]
    found = [(between.find(s), -len(s), s) for s in special if between.find(s) >= 0]
    return min(found)[2] if found else None


def _end_of_tool_call(
    tokenizer: PreTrainedTokenizerBase, user: list[dict], special: list[str], end_of_turn: str
) -> str | None:
    """The first special token after the arguments of a tool call that ends a conversation, where the
    end-of-turn token is not written after them (harmony closes a call with `<|call|>`, not `<|return|>`).
    None where the end-of-turn token closes calls too, or the template does not render the call."""
    value = "chattune probe value"
    function = {"name": "chattune_probe_call", "arguments": {"chattune_probe_argument": value}}
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": function}]}
    try:
        rendered = tokenizer.apply_chat_template(user + [call], tokenize=False)
    except (jinja2.TemplateError, TypeError, ValueError):
        return None
    at = rendered.rfind(value)
    if at < 0:
        return None
    after = rendered[at + len(value) :]
    if end_of_turn in after:
        return None
    found = [(after.find(s), -len(s), s) for s in special if after.find(s) >= 0]
    return min(found)[2] if found else None


def _renders(tokenizer: PreTrainedTokenizerBase, messages: list[dict], tools: list[dict] | None, needle: str) -> bool:
    """Whether the template writes `needle` (a probe tool or call); a template that rejects them does not."""
    try:
        return needle in tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    except (jinja2.TemplateError, TypeError, ValueError):
        return False


def _back_off_to_token_boundary(text: str, position: int, special_tokens: list[str]) -> int:
    """Move `position` left until no special token of `text` straddles it."""
    moved = True
    while moved:
        moved = False
        for token in special_tokens:
            at = text.find(token, max(0, position - len(token) + 1))
            if 0 <= at < position < at + len(token):
                position, moved = at, True
    return position


def assistant_spans(text: str, messages: list[dict], markers: TemplateMarkers) -> list[tuple[int, int]]:
    """Character spans [start, end) of each assistant reply in `text`: from the end of its generation prompt
    to the end of the token that closes it, or to the start of that token where it closes the reply as
    history only (see the module docstring)."""
    prompt = markers.generation_prompt
    trained_ends = {markers.end_of_turn, markers.end_of_tool_call}
    ends = sorted(trained_ends | {markers.end_of_earlier_turn}, key=len, reverse=True)
    for index, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if role != "assistant" and isinstance(content, str) and prompt in content:
            raise ChatTemplateError(
                f"message {index} ({role}) contains the assistant header {prompt!r}: its text "
                "would be taken for an assistant turn"
            )
    replies = [(index, m) for index, m in enumerate(messages) if m.get("role") == "assistant"]
    spans, cursor = [], 0
    for turn, (index, message) in enumerate(replies):
        header = text.find(prompt, cursor)
        if header < 0:
            raise ChatTemplateError(
                f"assistant turn {turn}: the template rendered no assistant header {prompt!r} "
                "for it (after the previous turn)"
            )
        start = header + len(prompt)
        content = message.get("content")
        # Templates may rewrite the start of a reply (Qwen3 drops the reasoning of earlier turns), but a
        # reply cut short by an end-of-turn token inside it loses its end: check that its last line is there.
        # Not for a tool call: its content may be reasoning that the template leaves out (gpt-oss does once
        # an answer follows).
        ending = (
            content.strip().splitlines()[-1][-32:]
            if isinstance(content, str) and content.strip() and not message.get("tool_calls")
            else ""
        )
        then_assistant = index + 1 < len(messages) and messages[index + 1].get("role") == "assistant"
        position = start
        while True:
            end_at, token = _next_end(text, position, ends)
            if end_at < 0:
                raise ChatTemplateError(
                    f"assistant turn {turn} has no end-of-turn token {' or '.join(map(repr, ends))}"
                )
            closed = end_at + len(token)
            # The model ends a message and opens another assistant message itself: the reply goes on, unless
            # that message is the next assistant message of the conversation (then this reply holds its content).
            goes_on = text.startswith(prompt, closed) and not (then_assistant and ending in text[start:end_at])
            if not goes_on:
                break
            position = closed
        if ending and ending not in text[start:end_at]:
            raise ChatTemplateError(
                f"assistant turn {turn}: the end of its content is not inside the turn the template renders "
                f"(does the content contain {token!r}?)"
            )
        for field in _TEXT_FIELDS:
            inside = next((t for t in ends if isinstance(message.get(field), str) and t in message[field]), None)
            if inside is not None:
                raise ChatTemplateError(
                    f"assistant turn {turn}: its {field} contains {inside!r}, which closes a turn in this chat template"
                )
        spans.append((start, closed if token in trained_ends else end_at))
        cursor = closed
    _check_headers_in_replies(text, prompt, spans)
    return spans


_TEXT_FIELDS = ("content", "thinking", "reasoning_content", "reasoning")  # the reasoning names transformers reads


def _next_end(text: str, position: int, ends: list[str]) -> tuple[int, str]:
    """The first end token at or after `position` (the longest of those that start there), or (-1, "")."""
    found = [(at, -len(token), token) for token in ends if (at := text.find(token, position)) >= 0]
    if not found:
        return -1, ""
    at, _, token = min(found)
    return at, token


def _check_headers_in_replies(text: str, prompt: str, spans: list[tuple[int, int]]) -> None:
    """Every assistant header opens a reply or lies inside one: another (the template writes it for some
    other role) would be a turn the labels do not know of."""
    reply = 0  # spans are in order: the first one that ends after the header
    at = text.find(prompt)
    while at >= 0:
        while reply < len(spans) and spans[reply][1] <= at:
            reply += 1
        if reply == len(spans) or spans[reply][0] - len(prompt) > at:
            raise ChatTemplateError(
                f"the template rendered an assistant header {prompt!r} at character {at} outside the "
                f"{len(spans)} assistant replies (does the template write it for another role?)"
            )
        at = text.find(prompt, at + 1)


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict],
    markers: TemplateMarkers,
    tools: list[dict] | None = None,
    last_turn_only: bool = False,
    skip_turns: int = 0,
) -> TokenizedConversation:
    """Render (with `tools`, as `apply_chat_template` would) and tokenize a conversation, marking the
    tokens of assistant replies after the first `skip_turns` ones, or of the last one only.

    One conversation through the same path as the batched ones (`TextBatchEncoder`)."""
    text = render_conversation(tokenizer, messages, tools)
    spans = trained_spans(text, messages, markers, last_turn_only, skip_turns)
    encoded = TextBatchEncoder(tokenizer)([text], [spans])
    return TokenizedConversation(input_ids=encoded.ids.tolist(), assistant_mask=encoded.trainable.tolist())


def render_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], tools: list[dict] | None = None
) -> str:
    """The text `apply_chat_template(messages, tools=tools, tokenize=False)` renders, byte for byte.

    Rendered the way transformers renders it (the same compiled template and sandbox, the same plain copies
    of the messages and tools, the same variables), except that the sandbox's attribute lookups are decided
    once per type and name where the sandbox's own answer depends on nothing else (`_memoized_template`).
    Where transformers' internals are not there to reuse, `apply_chat_template` itself."""
    if _compile_jinja_template is None:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    template = _memoized_template(tokenizer.get_chat_template(None, tools))
    chat = _plain_template_data([{k: v for k, v in m.items() if v is not None} for m in messages])
    return template.render(
        messages=_alias_reasoning_fields(chat),
        tools=_plain_template_data(tools),
        documents=None,
        add_generation_prompt=False,
        **_plain_template_data(tokenizer.special_tokens_map),
    )


@functools.lru_cache(maxsize=16)
def _memoized_template(source: str) -> jinja2.Template:
    """transformers' compiled chat template, in an overlay of its sandboxed environment (same filters,
    globals, extensions) whose attribute lookups on plain dicts, strings and lists are routed once per
    (type, attribute name) (`_routed_getattr`), and whose verdicts on attribute safety are kept per (type,
    name) for other objects (the template's namespace): jinja's immutable sandbox decides from those two
    alone, yet re-decides on every lookup of every conversation."""
    environment = _compile_jinja_template(source).environment
    overlay = environment.overlay()
    stock = type(environment)
    if (
        stock.is_safe_attribute is ImmutableSandboxedEnvironment.is_safe_attribute
        and stock.getattr is ImmutableSandboxedEnvironment.getattr
    ):
        overlay.is_safe_attribute = _memoized_verdicts(overlay.is_safe_attribute)
        overlay.getattr = _routed_getattr(overlay)
    return overlay.from_string(source)


_ITEM, _ATTRIBUTE, _SANDBOX = "item", "attribute", "sandbox"


def _routed_getattr(environment: ImmutableSandboxedEnvironment) -> Callable[[object, str], object]:
    """The sandbox's `getattr` (what `message.content` or `content.strip` compiles to), its outcome decided
    once per (type, attribute name) for objects of exactly dict, str or list.

    For those types the sandbox's answer depends on nothing else: an instance has no attributes of its own,
    so either the type has the attribute, whose safety verdict depends on type and name alone, or the lookup
    falls back to the item `obj[name]` (`message.content` on a dict: an AttributeError raised and caught on
    every lookup, a quarter of the rendering). Format methods, unsafe attributes and every other type still
    go through the sandbox itself."""
    sandboxed = environment.getattr
    routes: dict[tuple[type, str], str] = {}

    def routed(obj: object, attribute: str) -> object:
        kind = type(obj)
        if kind is dict or kind is str or kind is list:
            route = routes.get((kind, attribute))
            if route is None:
                route = _route(environment, obj, attribute)
                if len(routes) < 10_000:  # attribute names come from the template: a few dozen
                    routes[kind, attribute] = route
            if route is _ITEM:
                try:
                    return obj[attribute]
                except (TypeError, LookupError):
                    return environment.undefined(obj=obj, name=attribute)
            if route is _ATTRIBUTE:
                return getattr(obj, attribute)
        return sandboxed(obj, attribute)

    return routed


def _route(environment: ImmutableSandboxedEnvironment, obj: object, attribute: str) -> str:
    """How the sandbox resolves `obj.attribute`, the same for every object of obj's (plain) type."""
    try:
        value = getattr(obj, attribute)
    except AttributeError:
        return _ITEM
    if environment.wrap_str_format(value) is None and environment.is_safe_attribute(obj, attribute, value):
        return _ATTRIBUTE
    return _SANDBOX


def _memoized_verdicts(
    is_safe_attribute: Callable[[object, str, object], bool],
) -> Callable[[object, str, object], bool]:
    verdicts: dict[tuple[type, str], bool] = {}

    def memoized(obj: object, attr: str, value: object) -> bool:
        key = (type(obj), attr)
        verdict = verdicts.get(key)
        if verdict is None:
            verdict = is_safe_attribute(obj, attr, value)
            if len(verdicts) < 10_000:  # attribute names come from the template: a few dozen
                verdicts[key] = verdict
        return verdict

    return memoized


def trained_spans(
    text: str, messages: list[dict], markers: TemplateMarkers, last_turn_only: bool = False, skip_turns: int = 0
) -> list[tuple[int, int]]:
    """The assistant spans to train: those after the first `skip_turns` replies, or the last one only."""
    spans = assistant_spans(text, messages, markers)[skip_turns:]
    return spans[-1:] if last_turn_only else spans
