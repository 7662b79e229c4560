"""Prompts for a model to answer: the context before a reply, as chat messages (and the tools it may call).

From a held-out set (`held_out_prompts`: a conversation's messages before its last assistant reply, a
preference pair's shared prompt), or from a prompts file (`read_prompts_file`, the format `chattune chat
--prompts` and `eval.sample_prompts` read):

- `.jsonl`: one JSON object per line, `{"messages": [...], "tools": [...]}` (a last message that is an assistant
  reply is left out: a held-out conversation is a prompt as it is) or `{"prompt": "text"}` (one user turn);
- any other file: one user prompt per non-blank line.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from chattune.data.ingest.formats import (
    PREFERENCE_FORMATS,
    PROMPT_FORMATS,
    UNPAIRED_FORMATS,
    DataError,
    SourceSpec,
    to_conversation,
    to_preference_pair,
    to_prompt_record,
    to_unpaired_example,
    validate_messages,
)
from chattune.data.ingest.records import RecordSource, json_problem

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prompt:
    messages: list[dict]  # the conversation so far: the model writes the next assistant turn
    tools: list[dict] | None = None

    def with_system(self, system: str | None) -> Prompt:
        """This prompt opened by a system message `system`, unless it has one of its own."""
        if not system or (self.messages and self.messages[0].get("role") == "system"):
            return self
        return Prompt([{"role": "system", "content": system}, *self.messages], self.tools)

    def as_text(self) -> str:
        """The messages as `role: content` lines, for people (a wandb table, a terminal)."""
        return "\n".join(f"{m['role']}: {m.get('content') or ''}" for m in self.messages)


def before_last_reply(messages: list[dict]) -> list[dict]:
    """The messages before the last assistant message (all of them where there is none)."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=len(messages))
    return messages[:last]


def held_out_prompts(
    specs: list[SourceSpec], count: int, records: Sequence[int] | np.ndarray | None = None
) -> list[Prompt]:
    """The prompts of the first `count` records of `specs` (in order, across sources; only `records`, numbered
    across them, where given): a conversation's messages before its last assistant reply, a preference pair's
    prompt, an unpaired example's prompt. A record that cannot be read is passed over (logged; the held-out set's own reading reports it)
    for the next one."""
    if count <= 0 or not specs:
        return []
    source, prompts = RecordSource(specs), []
    for spec, where, record in source.locate_many(range(len(source)) if records is None else records):
        if len(prompts) == count:
            break
        try:
            if isinstance(record, DataError):
                raise record
            if spec.format in PREFERENCE_FORMATS:
                pair = to_preference_pair(record, spec, where)
                prompt = Prompt(pair.context, pair.tools)
            elif spec.format in UNPAIRED_FORMATS:  # KTO's examples: the prompt its completion answers
                example = to_unpaired_example(record, spec, where)
                prompt = Prompt(example.context, example.tools)
            elif spec.format in PROMPT_FORMATS:  # GRPO's prompts
                record_prompt = to_prompt_record(record, spec, where)
                prompt = Prompt(record_prompt.messages, record_prompt.tools)
            else:
                conversation = to_conversation(record, spec, where)
                prompt = Prompt(before_last_reply(conversation.messages), conversation.tools)
        except DataError as error:
            logger.info("sample prompts: passed over %s", error)
            continue
        if prompt.messages:
            prompts.append(prompt)
    return prompts


def prompts_file_problem(path: str | Path) -> str | None:
    """Why `path` is no prompts file to read (a missing path, a directory), or None; `chattune validate` asks too."""
    if Path(path).is_file():
        return None
    return f"prompts file {str(path)!r} " + ("is not a file" if Path(path).exists() else "does not exist")


def read_prompts_file(path: str | Path) -> list[Prompt]:
    """The prompts of a prompts file (see the module docstring); a DataError naming the line otherwise."""
    problem = prompts_file_problem(path)
    if problem is not None:
        raise DataError(problem)
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise DataError(f"prompts file {path}: not UTF-8 text ({error.reason})") from error
    numbered = [(number, line) for number, line in enumerate(lines, 1) if line.strip()]
    if not numbered:
        raise DataError(f"prompts file {path} holds no prompt")
    if path.suffix != ".jsonl":
        return [Prompt([{"role": "user", "content": line.strip()}]) for _, line in numbered]
    return [_json_prompt(line, f"{path} line {number}") for number, line in numbered]


def _json_prompt(line: str, where: str) -> Prompt:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise DataError(f"{where}: unparseable JSON at column {error.colno}: {json_problem(error)}") from None
    if isinstance(record, dict) and isinstance(record.get("prompt"), str) and "messages" not in record:
        return Prompt([{"role": "user", "content": record["prompt"]}])
    if not isinstance(record, dict) or "messages" not in record:
        raise DataError(f'{where}: a prompt is {{"messages": [...]}} (with "tools" if any) or {{"prompt": "text"}}')
    messages = validate_messages(record["messages"], where, require_reply=False)
    if messages[-1]["role"] == "assistant":  # a whole conversation: its last reply is what the model writes
        messages = messages[:-1]
    if not messages:
        raise DataError(f"{where}: no message before the assistant reply")
    tools = record.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise DataError(f"{where}: tools must be a list, got {type(tools).__name__}")
    return Prompt(messages, tools or None)
