"""Record formats: every supported layout becomes one `Conversation` (OpenAI-style messages + tools).

| format | default columns | notes |
|---|---|---|
| `messages` | `messages`, `tools` | roles system/user/assistant/tool; assistant `tool_calls` |
| `sharegpt` | `conversations` (turns of `from`/`value`), `system`, `tools` | role names mapped by `roles` |
| `prompt_completion` | `prompt`, `completion` | each a string or a list of messages |
| `alpaca` | `instruction`, `input`, `output`, `system` | user turn = instruction, blank line, input |
| `preference` | `prompt` (or `messages`), `chosen`, `rejected`, `tools` | DPO pairs; each a string or a list of messages |
| `sharegpt_preference` | `conversations`, `chosen`, `rejected` (turns of `from`/`value`), `system`, `tools` | DPO pairs |
| `unpaired` | `prompt` (or `messages`), `completion`, `label`, `tools` | KTO examples; label true/false |
| `prompt` | `prompt` (or `messages`), `tools`; every other field kept | prompts to sample (GRPO), e.g. with an `answer` |

The two preference formats give a `PreferencePair` (`to_preference_pair`), the unpaired format an
`UnpairedExample` (`to_unpaired_example`), the prompt format a `PromptRecord` (`to_prompt_record`), not a
`Conversation`.

A source may rename any column (`columns: {messages: chat}`) and, for ShareGPT, map more role names
(`roles: {bot: assistant}`). Problems are `DataError`s that name the record and what is wrong.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from chattune.errors import UserError


class DataError(UserError, ValueError):
    """A record that cannot be trained on, named by source file and record number."""


ROLES = {"system", "user", "assistant", "tool"}

DEFAULT_COLUMNS: dict[str, dict[str, str]] = {
    "messages": {"messages": "messages", "tools": "tools"},
    "sharegpt": {
        "conversations": "conversations",
        "system": "system",
        "tools": "tools",
        "role": "from",
        "content": "value",
    },
    "prompt_completion": {"prompt": "prompt", "completion": "completion"},
    "alpaca": {"instruction": "instruction", "input": "input", "output": "output", "system": "system"},
    "preference": {
        "prompt": "prompt",
        "messages": "messages",
        "chosen": "chosen",
        "rejected": "rejected",
        "tools": "tools",
    },
    "sharegpt_preference": {
        "conversations": "conversations",
        "chosen": "chosen",
        "rejected": "rejected",
        "system": "system",
        "tools": "tools",
        "role": "from",
        "content": "value",
    },
    "unpaired": {
        "prompt": "prompt",
        "messages": "messages",
        "completion": "completion",
        "label": "label",
        "tools": "tools",
    },
    "prompt": {"prompt": "prompt", "messages": "messages", "tools": "tools"},
}

# Formats of preference pairs (DPO), read with `to_preference_pair` rather than `to_conversation`.
PREFERENCE_FORMATS = ("preference", "sharegpt_preference")
# Formats of labelled single replies (KTO), read with `to_unpaired_example`.
UNPAIRED_FORMATS = ("unpaired",)
# Formats of prompts for a policy to answer, each with the fields its rewards read (GRPO), read with `to_prompt_record`.
PROMPT_FORMATS = ("prompt",)

# ShareGPT role names -> chat roles. `tool_call` marks a turn whose value is a JSON call {name, arguments},
# which becomes an assistant message with `tool_calls`.
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "function_call": "tool_call",
    "observation": "tool",
    "tool": "tool",
}


@dataclass(frozen=True)
class Conversation:
    messages: list[dict]
    tools: list[dict] | None = None
    prompt_replies: int = 0  # leading assistant replies that are context, not targets (prompt/completion)


@dataclass(frozen=True)
class SourceSpec:
    """One data source: a file (or a dataset directory or hub id, with its `split`), its format, and
    optional column renames and role names."""

    path: str
    format: str = "messages"
    columns: dict[str, str] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)
    split: str = "train"
    # Mixtures (data.mixing): the source's name in logs, its sampling weight, and its own masking mode
    # (null: data.train_on).
    name: str | None = None
    weight: float = 1.0
    train_on: str | None = None

    @property
    def display_name(self) -> str:
        return self.name or Path(self.path).stem

    def __post_init__(self) -> None:
        if not (isinstance(self.weight, (int, float)) and self.weight >= 0):
            raise DataError(f"{self.path}: weight must be a number >= 0, got {self.weight!r}")
        if self.format not in DEFAULT_COLUMNS:
            raise DataError(f"{self.path}: unknown format {self.format!r}; expected one of {sorted(DEFAULT_COLUMNS)}")
        unknown = set(self.columns) - set(DEFAULT_COLUMNS[self.format])
        if unknown:
            raise DataError(
                f"{self.path}: format {self.format!r} has no column(s) {sorted(unknown)}; "
                f"its columns are {sorted(DEFAULT_COLUMNS[self.format])}"
            )
        if self.roles and self.format not in ("sharegpt", "sharegpt_preference"):
            raise DataError(
                f"{self.path}: `roles` applies to the sharegpt format only "
                "(and to its preference form, sharegpt_preference)"
            )
        bad = {r for r in self.roles.values() if r not in ROLES | {"tool_call"}}
        if bad:
            raise DataError(f"{self.path}: roles map to {sorted(bad)}; allowed: {sorted(ROLES | {'tool_call'})}")

    @classmethod
    def from_config(cls, entry: str | Mapping) -> SourceSpec:
        """A path (messages format) or a mapping {path, format, columns, roles, split}."""
        if isinstance(entry, str):
            return cls(path=entry)
        if not isinstance(entry, Mapping):
            raise DataError(f"a data source is a path or a mapping, got {entry!r}")
        entry = dict(entry)
        for key in ("columns", "roles"):
            value = entry.get(key)
            if value is not None and (
                not isinstance(value, Mapping) or not all(isinstance(v, str) for v in value.values())
            ):
                raise DataError(f"{entry.get('path')}: `{key}` must map names to names, got {value!r}")
        optional = ("format", "columns", "roles", "split", "name", "weight", "train_on")
        unknown = set(entry) - {"path", *optional}
        if unknown or "path" not in entry:
            raise DataError(f"a data source needs `path` and may have {'/'.join(optional)}; got keys {sorted(entry)}")
        return cls(
            path=str(entry["path"]),
            format=str(entry.get("format", "messages")),
            columns=dict(entry.get("columns") or {}),
            roles=dict(entry.get("roles") or {}),
            split=str(entry.get("split", "train")),
            name=entry.get("name"),
            weight=entry.get("weight", 1.0),
            train_on=entry.get("train_on"),
        )

    def column(self, name: str) -> str:
        return self.columns.get(name, DEFAULT_COLUMNS[self.format][name])


def to_conversation(record: dict, spec: SourceSpec, where: str) -> Conversation:
    """Convert and validate one record."""
    if spec.format in PREFERENCE_FORMATS:
        raise DataError(f"{where}: the {spec.format} format holds preference pairs (for DPO), not conversations")
    if spec.format in UNPAIRED_FORMATS:
        raise DataError(f"{where}: the {spec.format} format holds labelled replies (for KTO), not conversations")
    converter = {
        "messages": _from_messages,
        "sharegpt": _from_sharegpt,
        "prompt_completion": _from_prompt_completion,
        "alpaca": _from_alpaca,
    }[spec.format]
    conversation = converter(record, spec, where)
    return Conversation(
        validate_messages(conversation.messages, where), conversation.tools, conversation.prompt_replies
    )


def _required(record: dict, spec: SourceSpec, name: str, where: str):
    column = spec.column(name)
    if record.get(column) is None:
        raise DataError(
            f"{where}: no {column!r} field for the {spec.format} format (fields: {sorted(record)}); "
            f"rename columns with `columns: {{{name}: ...}}`"
        )
    return record[column]


def _tools(record: dict, spec: SourceSpec, where: str) -> list[dict] | None:
    tools = record.get(spec.column("tools"))
    if tools in (None, "", []):
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as error:
            raise DataError(f"{where}: tools is not valid JSON ({error})") from error
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise DataError(f"{where}: tools must be a list of objects")
    if not tools:
        return None
    # OpenAI's schema wraps each function; bare function schemas (name, parameters) get wrapped.
    return [t if "type" in t else {"type": "function", "function": t} for t in tools]


def _from_messages(record: dict, spec: SourceSpec, where: str) -> Conversation:
    return Conversation(_required(record, spec, "messages", where), _tools(record, spec, where))


def _from_sharegpt(record: dict, spec: SourceSpec, where: str) -> Conversation:
    turns = _required(record, spec, "conversations", where)
    if not isinstance(turns, list):
        raise DataError(f"{where}: {spec.column('conversations')!r} must be a list of turns")
    messages = []
    system = _optional_string(record, spec, "system", where)
    if system.strip():
        messages.append({"role": "system", "content": system})
    messages += _sharegpt_messages(turns, spec, where)
    return Conversation(messages, _tools(record, spec, where))


def _sharegpt_messages(turns: list, spec: SourceSpec, where: str, label: str = "turn") -> list[dict]:
    """ShareGPT turns ({from, value}, names as the source's `columns` say) as chat messages."""
    role_map = {**SHAREGPT_ROLES, **spec.roles}
    role_key, content_key = spec.column("role"), spec.column("content")
    messages = []
    for turn_index, turn in enumerate(turns):
        name = turn.get(role_key) if isinstance(turn, dict) else None
        if not isinstance(name, str) or name not in role_map:
            raise DataError(
                f"{where}: {label} {turn_index} has role {name!r}; known: {sorted(role_map)} "
                "(map more with `roles: {name: user|assistant|system|tool|tool_call}`)"
            )
        value = turn.get(content_key)
        if role_map[name] == "tool_call":
            messages.append(
                {"role": "assistant", "content": "", "tool_calls": [_parse_call(value, where, turn_index, label)]}
            )
        else:
            messages.append({"role": role_map[name], "content": value})
    return messages


def _parse_call(value: object, where: str, turn_index: int, label: str = "turn") -> dict:
    try:
        call = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as error:
        raise DataError(f"{where}: {label} {turn_index} is a function call that is not valid JSON ({error})") from error
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise DataError(f"{where}: {label} {turn_index} is a function call without a name")
    return {"type": "function", "function": {"name": call["name"], "arguments": call.get("arguments", {})}}


def _from_prompt_completion(record: dict, spec: SourceSpec, where: str) -> Conversation:
    prompt = _required(record, spec, "prompt", where)
    completion = _required(record, spec, "completion", where)
    prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    completion = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else completion
    if not isinstance(prompt, list) or not isinstance(completion, list):
        raise DataError(f"{where}: prompt and completion must each be a string or a list of messages")
    # Assistant turns inside the prompt are context: only the completion is trained.
    replies_in_prompt = sum(isinstance(m, dict) and m.get("role") == "assistant" for m in prompt)
    return Conversation(prompt + completion, prompt_replies=replies_in_prompt)


def _optional_string(record: dict, spec: SourceSpec, name: str, where: str) -> str:
    value = record.get(spec.column(name))
    if value is not None and not isinstance(value, str):
        raise DataError(f"{where}: {spec.column(name)!r} must be a string, got {type(value).__name__}")
    return value or ""


def _from_alpaca(record: dict, spec: SourceSpec, where: str) -> Conversation:
    instruction = _required(record, spec, "instruction", where)
    output = _required(record, spec, "output", where)
    if not isinstance(instruction, str):
        raise DataError(f"{where}: {spec.column('instruction')!r} must be a string, got {type(instruction).__name__}")
    extra = _optional_string(record, spec, "input", where)
    user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
    system = _optional_string(record, spec, "system", where)
    if system.strip():
        messages.insert(0, {"role": "system", "content": system})
    return Conversation(messages)


def validate_messages(messages: object, where: str, require_reply: bool = True) -> list[dict]:
    """Check roles and contents; returns clean copies (None-valued fields from columnar files dropped).
    `require_reply`: an assistant message must be among them (a prompt, `chattune.data.templates.prompts`, needs none)."""
    if not isinstance(messages, list) or not messages:
        raise DataError(
            f"{where}: the conversation must be a non-empty list of messages, got {type(messages).__name__}"
        )
    clean = []
    for turn, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DataError(f"{where}: message {turn} must be an object with a role and content, got {message!r}")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise DataError(f"{where}: message {turn} has role {role!r}; expected one of {sorted(ROLES)}")
        message = {k: v for k, v in message.items() if v is not None}
        content = message.get("content", "")
        calls = message.get("tool_calls")
        if not isinstance(content, str):
            raise DataError(f"{where}: message {turn} content must be a string, got {type(content).__name__}")
        if calls is not None and (message["role"] != "assistant" or not isinstance(calls, list) or not calls):
            raise DataError(f"{where}: message {turn}: tool_calls must be a non-empty list on an assistant message")
        for call in calls or []:
            function = call.get("function") if isinstance(call, dict) else None
            if (
                not isinstance(function, dict)
                or not isinstance(function.get("name"), str)
                or not isinstance(function.get("arguments", {}), (str, dict))
            ):
                raise DataError(
                    f"{where}: message {turn}: a tool call must be "
                    f"{{'function': {{'name': str, 'arguments': str or object}}}}, got {call!r}"
                )
        if message["role"] == "assistant" and not content.strip() and not calls:
            raise DataError(f"{where}: message {turn} is an empty assistant reply")
        clean.append({**message, "content": content})
    if require_reply and not any(m["role"] == "assistant" for m in clean):
        raise DataError(f"{where}: no assistant message, nothing to train")
    return clean


# --------------------------------------------------------------------------------------------------------------
# Preference pairs (DPO)
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PreferencePair:
    """One preference pair: the shared context (system/user/assistant/tool messages, ending with a user or
    tool turn) and the two assistant replies to it, chosen and rejected."""

    context: list[dict]
    chosen: dict
    rejected: dict
    tools: list[dict] | None = None


def to_preference_pair(record: dict, spec: SourceSpec, where: str) -> PreferencePair:
    """Convert and validate one record of a preference format.

    `preference`: the context is `prompt` (or, in its place, `messages`): a string (one user turn) or a list
    of messages; `chosen` and `rejected` are each a string (one assistant reply), one message, or a list of
    messages whose last one is the reply and whose earlier ones extend the context. Each side's context
    (prompt + all but its last message) must be the same for both sides.
    `sharegpt_preference`: the context is `system` and the `conversations` turns; `chosen` and `rejected`
    are each one turn (or a list of turns, read as above).

    Each side, context + reply, is checked as `validate_messages` checks a conversation; the reply must be
    an assistant message with non-empty content (or tool calls), and the context must end with a user or
    tool turn. Identical replies are not an error here: the reader counts them as skipped."""
    if spec.format == "preference":
        context, chosen, rejected = _preference_sides(record, spec, where)
    elif spec.format == "sharegpt_preference":
        context, chosen, rejected = _sharegpt_preference_sides(record, spec, where)
    else:
        held = "labelled replies (for KTO)" if spec.format in UNPAIRED_FORMATS else "conversations"
        raise DataError(
            f"{where}: the {spec.format} format holds {held}, not preference pairs "
            f"(preference formats: {list(PREFERENCE_FORMATS)})"
        )
    sides = {
        name: _checked_side(context, side, spec, name, where)
        for name, side in (("chosen", chosen), ("rejected", rejected))
    }
    if sides["chosen"][:-1] != sides["rejected"][:-1]:
        raise DataError(
            f"{where}: the chosen and rejected replies have different contexts (prompt + all but "
            "the last message of each side must be the same)"
        )
    return PreferencePair(sides["chosen"][:-1], sides["chosen"][-1], sides["rejected"][-1], _tools(record, spec, where))


def _checked_side(context: list, side: list, spec: SourceSpec, name: str, where: str) -> list[dict]:
    """One side, context + reply messages, validated: the reply is an assistant message with content (or tool
    calls) and the context ends with a user or tool turn. `name`: the side's field ("chosen", "completion")."""
    if not side:
        raise DataError(f"{where}: {spec.column(name)!r} holds no message")
    reply = side[-1]
    role = reply.get("role") if isinstance(reply, dict) else None
    if role != "assistant":
        raise DataError(
            f"{where}: the last message of {spec.column(name)!r} must be the assistant reply, got role {role!r}"
        )
    for turn, message in enumerate(context + side):
        if not isinstance(message, dict):
            raise DataError(f"{where}: {name}: message {turn} must be an object, got {type(message).__name__}")
    messages = validate_messages(context + side, f"{where}: {name}")
    if not messages[:-1] or messages[-2]["role"] not in ("user", "tool"):
        last = messages[-2]["role"] if len(messages) > 1 else None
        raise DataError(
            f"{where}: the context of the {name} reply must end with a user or tool turn, "
            f"got {'no context' if last is None else f'a last turn of role {last!r}'}"
        )
    return messages


def _prompt_context(record: dict, spec: SourceSpec, where: str) -> list:
    """The context of a `preference` or `unpaired` record: `prompt` or, in its place, `messages`."""
    prompt_column, messages_column = spec.column("prompt"), spec.column("messages")
    has_prompt, has_messages = record.get(prompt_column) is not None, record.get(messages_column) is not None
    if has_prompt and has_messages:
        raise DataError(f"{where}: both {prompt_column!r} and {messages_column!r} given for the context; keep one")
    if not has_prompt and not has_messages:
        raise DataError(
            f"{where}: no {prompt_column!r} (or {messages_column!r}) field for the {spec.format} format "
            f"(fields: {sorted(record)}); rename columns with `columns: {{prompt: ...}}`"
        )
    context_column = prompt_column if has_prompt else messages_column
    return _message_list(record[context_column], "user", context_column, where)


def _preference_sides(record: dict, spec: SourceSpec, where: str) -> tuple[list, list, list]:
    context = _prompt_context(record, spec, where)
    chosen, rejected = (
        _message_list(_required(record, spec, name, where), "assistant", spec.column(name), where)
        for name in ("chosen", "rejected")
    )
    return context, chosen, rejected


def _message_list(value: object, role: str, column: str, where: str) -> list:
    """A field holding a string (one `role` message), one message, or a list of messages, as a list."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, dict):
        return [value]
    if not isinstance(value, list):
        raise DataError(
            f"{where}: {column!r} must be a string, a message or a list of messages, got {type(value).__name__}"
        )
    return list(value)


def _sharegpt_preference_sides(record: dict, spec: SourceSpec, where: str) -> tuple[list, list, list]:
    context = _from_sharegpt(record, spec, where).messages
    sides = []
    for name in ("chosen", "rejected"):
        side = _required(record, spec, name, where)
        if isinstance(side, dict):
            side = [side]
        if not isinstance(side, list):
            raise DataError(
                f"{where}: {spec.column(name)!r} must be a turn or a list of turns, got {type(side).__name__}"
            )
        sides.append(_sharegpt_messages(side, spec, where, label=f"{spec.column(name)} turn"))
    return context, sides[0], sides[1]


# --------------------------------------------------------------------------------------------------------------
# Unpaired examples (KTO)
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class UnpairedExample:
    """One labelled reply: the context (ending with a user or tool turn), the assistant reply to it, and
    whether that reply is desirable (KTO's label)."""

    context: list[dict]
    completion: dict
    desirable: bool
    tools: list[dict] | None = None


def to_unpaired_example(record: dict, spec: SourceSpec, where: str) -> UnpairedExample:
    """Convert and validate one record of the `unpaired` format: {prompt, completion, label}.

    `prompt` (or, in its place, `messages`) and `completion` are read as the `preference` format reads the
    context and one side: a string (one user turn / one assistant reply), one message, or a list of messages,
    the completion's last one being the reply and its earlier ones extending the context. `label` must be a
    JSON boolean: true for a desirable reply, false for an undesirable one (no 1, "true" or null, whose
    meaning would be a guess)."""
    if spec.format not in UNPAIRED_FORMATS:
        raise DataError(
            f"{where}: the {spec.format} format holds no labelled replies (unpaired formats: {list(UNPAIRED_FORMATS)})"
        )
    label_column = spec.column("label")
    if label_column not in record:
        raise DataError(
            f"{where}: no {label_column!r} field (fields: {sorted(record)}): KTO reads {{prompt, completion, label}} "
            "records, label true (desirable) or false (undesirable); rename columns with `columns: {label: ...}`"
        )
    label = record[label_column]
    if not isinstance(label, bool):
        got = "null" if label is None else f"{type(label).__name__} {label!r}"
        raise DataError(
            f"{where}: {label_column!r} must be a JSON boolean, true (desirable) or false (undesirable), got {got}"
        )
    context = _prompt_context(record, spec, where)
    completion = _message_list(
        _required(record, spec, "completion", where), "assistant", spec.column("completion"), where
    )
    messages = _checked_side(context, completion, spec, "completion", where)
    return UnpairedExample(messages[:-1], messages[-1], label, _tools(record, spec, where))


# --------------------------------------------------------------------------------------------------------------
# Prompts to sample (GRPO)
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptRecord:
    """A prompt for the policy to answer: the conversation so far (ending with a user or tool turn), its tools, and
    the record's other fields as they are (its answer, its tests), which the reward functions read."""

    messages: list[dict]
    tools: list[dict] | None = None
    fields: dict = field(default_factory=dict)


def to_prompt_record(record: dict, spec: SourceSpec, where: str) -> PromptRecord:
    """Convert and validate one record of the `prompt` format: `prompt` (or, in its place, `messages`) as the
    `preference` format reads a context, a string (one user turn) or a list of messages ending with a user or tool
    turn; `tools` where given; every other field kept for the rewards."""
    if spec.format not in PROMPT_FORMATS:
        raise DataError(f"{where}: the {spec.format} format holds no prompts (prompt formats: {list(PROMPT_FORMATS)})")
    context = _prompt_context(record, spec, where)
    for turn, message in enumerate(context):
        if not isinstance(message, dict):
            raise DataError(f"{where}: message {turn} must be an object, got {type(message).__name__}")
    messages = validate_messages(context, where, require_reply=False)
    if messages[-1]["role"] not in ("user", "tool"):
        raise DataError(
            f"{where}: a prompt must end with a user or tool turn (the policy writes the next assistant turn), "
            f"got a last turn of role {messages[-1]['role']!r}"
        )
    own = {spec.column(name) for name in ("prompt", "messages", "tools")}
    return PromptRecord(messages, _tools(record, spec, where), {k: v for k, v in record.items() if k not in own})
