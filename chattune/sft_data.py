"""SFT data: OpenAI-style `messages` records from local JSON/JSONL files, into shifted-label documents.

Errors name the file, the record index and the problem. What is skipped rather than fatal is counted
and logged: a conversation with no trainable token, and one longer than the microbatch budget.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import jinja2
from transformers import PreTrainedTokenizerBase

from chattune.chat_template import ChatTemplateError, TemplateMarkers, probe_template, tokenize_conversation
from chattune.packing import Document, shifted_labels

logger = logging.getLogger(__name__)

ROLES = {"system", "user", "assistant"}


class DataError(ValueError):
    """A record that cannot be trained on, named by source file and record index."""


class RecordSource:
    """Records of several JSON/JSONL files, addressed by one global index.

    Read with the standard json module, not `datasets`: Arrow infers one type per column across records,
    so a reply "2" next to a malformed reply 7 silently becomes the integer 2. JSONL files are indexed by
    line offsets and each record is parsed when it is asked for, so memory does not grow with the data.
    """

    def __init__(self, files: list[str]):
        if not files:
            raise DataError("no data files given (data.train_files is empty)")
        self.files = list(files)
        self._sources: list[list[int] | list[dict]] = []  # per file: JSONL line offsets, or JSON records
        for path in self.files:
            if not Path(path).is_file():
                raise DataError(f"data file {path!r} does not exist")
            self._sources.append(_jsonl_offsets(path) if path.endswith(".jsonl") else _json_records(path))
        if len(self) == 0:
            raise DataError(f"the data files {self.files} hold no records")

    def __len__(self) -> int:
        return sum(len(s) for s in self._sources)

    def locate(self, index: int) -> tuple[str, int, dict]:
        """(file, index within file, record) of a global record index."""
        for path, source in zip(self.files, self._sources):
            if index < len(source):
                return path, index, _read_record(path, index, source[index])
            index -= len(source)
        raise IndexError(index)


def _jsonl_offsets(path: str) -> list[int]:
    offsets, position = [], 0
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                offsets.append(position)
            position += len(line)
    return offsets


def _json_records(path: str) -> list[dict]:
    try:
        records = json.loads(Path(path).read_text())
    except json.JSONDecodeError as error:
        raise DataError(f"{path}: not valid JSON ({error})") from error
    if not isinstance(records, list):
        raise DataError(f"{path}: a .json data file must hold a list of records, got {type(records).__name__}")
    return records


def _read_record(path: str, index: int, entry: int | dict) -> dict:
    if isinstance(entry, int):  # a JSONL line offset
        with open(path, "rb") as f:
            f.seek(entry)
            line = f.readline()
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(f"{path} record {index}: unparseable JSON line ({error})") from error
    if not isinstance(entry, dict):
        raise DataError(f"{path} record {index}: a record must be a JSON object, got {type(entry).__name__}")
    if "messages" not in entry:
        raise DataError(f"{path} record {index}: no 'messages' field (fields: {sorted(entry)})")
    return entry


def validate_messages(messages: object, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list, got {type(messages).__name__}")
    clean = []
    for turn, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            role = message.get("role") if isinstance(message, dict) else message
            raise DataError(f"{where}: message {turn} has role {role!r}; expected one of {sorted(ROLES)}")
        if not isinstance(message.get("content"), str):
            raise DataError(f"{where}: message {turn} content must be a string, got {type(message.get('content')).__name__}")
        if message["role"] == "assistant" and not message["content"].strip():
            raise DataError(f"{where}: message {turn} is an empty assistant reply")
        clean.append({"role": message["role"], "content": message["content"]})
    if not any(m["role"] == "assistant" for m in clean):
        raise DataError(f"{where}: no assistant message, nothing to train")
    return clean


@dataclass
class SkipCounts:
    no_trainable_tokens: int = 0
    overlong: int = 0


class SFTDocuments:
    """Tokenized, label-masked documents by global record index."""

    def __init__(self, source: RecordSource, tokenizer: PreTrainedTokenizerBase, max_tokens: int, overlong: str = "drop"):
        if overlong not in ("drop", "error"):
            raise ValueError(f"data.overlong must be 'drop' or 'error', got {overlong!r}")
        self.source = source
        self.tokenizer = tokenizer
        self.markers: TemplateMarkers = probe_template(tokenizer)
        self.max_tokens = max_tokens
        self.overlong = overlong
        self.skipped = SkipCounts()

    def __len__(self) -> int:
        return len(self.source)

    def get(self, index: int) -> Document | None:
        """The document of a record, or None for a counted skip."""
        path, local_index, record = self.source.locate(index)
        where = f"{path} record {local_index}"
        messages = validate_messages(record["messages"], where)
        try:
            tokenized = tokenize_conversation(self.tokenizer, messages, self.markers)
        except (ChatTemplateError, jinja2.TemplateError) as error:  # templates raise their own checks too
            raise DataError(f"{where}: {error}") from error
        if len(tokenized.input_ids) > self.max_tokens:
            message = f"{where}: {len(tokenized.input_ids)} tokens exceed data.max_tokens_per_microbatch={self.max_tokens}"
            if self.overlong == "error":
                raise DataError(message)
            self.skipped.overlong += 1
            logger.warning("skipped (overlong): %s", message)
            return None
        labels = shifted_labels(tokenized.input_ids, tokenized.assistant_mask)
        if all(label < 0 for label in labels):
            self.skipped.no_trainable_tokens += 1
            logger.warning("skipped (no trainable tokens): %s", where)
            return None
        return Document(doc_id=index, input_ids=tokenized.input_ids, labels=labels)
