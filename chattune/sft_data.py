"""SFT data: records of local JSON/JSONL/Parquet files (any format of `chattune.formats`), into
shifted-label documents.

Errors name the file, the record index and the problem. What is skipped rather than fatal is counted
and logged: a conversation with no trainable token, and one longer than the microbatch budget.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import datasets
from transformers import PreTrainedTokenizerBase

from chattune.chat_template import TemplateMarkers, probe_template, tokenize_conversation
from chattune.formats import DataError, SourceSpec, to_conversation
from chattune.packing import Document, shifted_labels

class RecordSource:
    """Records of several JSON/JSONL files, addressed by one global index.

    Read with the standard json module, not `datasets`: Arrow infers one type per column across records,
    so a reply "2" next to a malformed reply 7 silently becomes the integer 2. JSONL files are indexed by
    line offsets and each record is parsed when it is asked for, so memory does not grow with the data.
    """

    def __init__(self, specs: list[SourceSpec]):
        if not specs:
            raise DataError("no data sources given")
        self.specs = list(specs)
        self._sources: list = []  # per file: JSONL line offsets, JSON records, or a Parquet table
        for spec in self.specs:
            path = spec.path
            if not Path(path).is_file():
                raise DataError(f"data file {path!r} does not exist")
            if path.endswith(".jsonl"):
                self._sources.append(_jsonl_offsets(path))
            elif path.endswith(".json"):
                self._sources.append(_json_records(path))
            elif path.endswith(".parquet"):
                # Parquet stores its schema, so no type is inferred across records (unlike JSON in Arrow).
                self._sources.append(datasets.load_dataset("parquet", data_files=path, split="train"))
            else:
                raise DataError(f"data file {path!r}: expected .jsonl, .json or .parquet")
        if len(self) == 0:
            raise DataError(f"the data files {[s.path for s in self.specs]} hold no records")

    def __len__(self) -> int:
        return sum(len(s) for s in self._sources)

    def locate(self, index: int) -> tuple[SourceSpec, int, dict]:
        """(source, index within its file, record) of a global record index."""
        for spec, source in zip(self.specs, self._sources):
            if index < len(source):
                return spec, index, _read_record(spec.path, index, source[index])
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
        records = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise DataError(f"{path}: not valid UTF-8 JSON ({error})") from error
    if not isinstance(records, list):
        raise DataError(f"{path}: a .json data file must hold a list of records, got {type(records).__name__}")
    return records


def _read_record(path: str, index: int, entry: int | dict) -> dict:
    if isinstance(entry, int):  # a JSONL line offset
        with open(path, "rb") as f:
            f.seek(entry)
            line = f.readline()
        try:
            entry = json.loads(line.decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise DataError(f"{path} record {index}: unparseable JSON line ({error})") from error
    if not isinstance(entry, dict):
        raise DataError(f"{path} record {index}: a record must be a JSON object, got {type(entry).__name__}")
    return entry


SKIP_REASONS = ("overlong", "no_trainable_tokens")


@dataclass(frozen=True)
class Skipped:
    """A record left out on purpose; counted and logged by whoever consumes the documents (a loader
    worker's counters would never reach the trainer)."""

    reason: str  # one of SKIP_REASONS
    detail: str


TRAIN_ON = ("assistant", "last_assistant", "all")


class SFTDocuments:
    """Tokenized, label-masked documents by global record index.

    train_on: `assistant` (every assistant reply and its end-of-turn token), `last_assistant` (only the
    final reply), or `all` (every token, prompts included)."""

    def __init__(self, source: RecordSource, tokenizer: PreTrainedTokenizerBase, max_tokens: int,
                 overlong: str = "drop", train_on: str = "assistant"):
        if overlong not in ("drop", "error"):
            raise ValueError(f"data.overlong must be 'drop' or 'error', got {overlong!r}")
        if train_on not in TRAIN_ON:
            raise ValueError(f"data.train_on must be one of {TRAIN_ON}, got {train_on!r}")
        self.source = source
        self.train_on = train_on
        self.tokenizer = tokenizer
        self.markers: TemplateMarkers = probe_template(tokenizer)
        self.max_tokens = max_tokens
        self.overlong = overlong

    def __len__(self) -> int:
        return len(self.source)

    def get(self, index: int) -> Document | Skipped:
        """The document of a record, or why it is skipped."""
        spec, local_index, record = self.source.locate(index)
        where = f"{spec.path} record {local_index}"
        conversation = to_conversation(record, spec, where)
        uses_calls = any("tool_calls" in m for m in conversation.messages)
        if (conversation.tools and not self.markers.renders_tools) or (uses_calls and not self.markers.renders_tool_calls):
            raise DataError(f"{where}: the record has tools or tool calls, but the tokenizer's chat template does not "
                            "render them (training would silently leave them out)")
        try:
            tokenized = tokenize_conversation(
                self.tokenizer, conversation.messages, self.markers, tools=conversation.tools,
                last_turn_only=self.train_on == "last_assistant", skip_turns=conversation.prompt_replies,
            )
        except Exception as error:  # the template's own checks (raise_exception) and its failures on odd data
            raise DataError(f"{where}: {type(error).__name__}: {error}") from error
        if len(tokenized.input_ids) > self.max_tokens:
            message = f"{where}: {len(tokenized.input_ids)} tokens exceed data.max_tokens_per_microbatch={self.max_tokens}"
            if self.overlong == "error":
                raise DataError(message)
            return Skipped("overlong", message)
        trainable = [True] * len(tokenized.input_ids) if self.train_on == "all" else tokenized.assistant_mask
        labels = shifted_labels(tokenized.input_ids, trainable)
        if all(label < 0 for label in labels):
            return Skipped("no_trainable_tokens", where)
        return Document(doc_id=index, input_ids=tokenized.input_ids, labels=labels)
