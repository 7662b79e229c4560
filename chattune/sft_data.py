"""SFT data: OpenAI-style `messages` records from local JSON/JSONL files, into shifted-label documents.

Errors name the file, the record index and the problem. What is skipped rather than fatal is counted
and logged: a conversation with no trainable token, and one longer than the microbatch budget.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import datasets
from transformers import PreTrainedTokenizerBase

from chattune.chat_template import ChatTemplateError, TemplateMarkers, probe_template, tokenize_conversation
from chattune.packing import Document, shifted_labels

logger = logging.getLogger(__name__)

ROLES = {"system", "user", "assistant"}


class DataError(ValueError):
    """A record that cannot be trained on, named by source file and record index."""


@dataclass
class RecordSource:
    """Several files read with `datasets`, addressed by one global record index."""

    files: list[str]
    tables: list[datasets.Dataset] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.files:
            raise DataError("no data files given (data.train_files is empty)")
        for path in self.files:
            if not Path(path).is_file():
                raise DataError(f"data file {path!r} does not exist")
            table = datasets.load_dataset("json", data_files=path, split="train")
            if "messages" not in table.column_names:
                raise DataError(f"{path}: no 'messages' column (columns: {table.column_names})")
            self.tables.append(table)

    def __len__(self) -> int:
        return sum(len(t) for t in self.tables)

    def locate(self, index: int) -> tuple[str, int, dict]:
        """(file, index within file, record) of a global record index."""
        for path, table in zip(self.files, self.tables):
            if index < len(table):
                return path, index, table[index]
            index -= len(table)
        raise IndexError(index)


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
        except ChatTemplateError as error:
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
