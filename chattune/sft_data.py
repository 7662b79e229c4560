"""SFT data: records of local JSON/JSONL/Parquet files (any format of `chattune.formats`), into
shifted-label documents.

Errors name the file, the record index and the problem. What is skipped rather than fatal is counted
and logged: a conversation with no trainable token, and one longer than the microbatch budget.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import datasets
import numpy as np
from transformers import PreTrainedTokenizerBase

from chattune.chat_template import ChatTemplateError, TemplateMarkers, probe_template, render_conversation, trained_spans
from chattune.formats import DataError, SourceSpec, to_conversation
from chattune.loss import IGNORE_INDEX
from chattune.packing import Document, shifted_label_array
from chattune.text_encoder import TextBatchEncoder

class RecordSource:
    """Records of several sources, addressed by one global index.

    JSON/JSONL files are read with the standard json module, not `datasets`: Arrow infers one type per
    column across records, so a reply "2" next to a malformed reply 7 silently becomes the integer 2.
    JSONL files are indexed by line offsets and each record is parsed when it is asked for, so memory does
    not grow with the data. Parquet files, dataset directories and hub datasets (written `hf:org/name`:
    a missing local path is never taken for a hub id) go through `datasets.load_dataset` with the
    source's `split`.

    Records are named in messages by their 1-based number in their file (and, for JSONL, their line).
    """

    def __init__(self, specs: list[SourceSpec]):
        if not specs:
            raise DataError("no data sources given")
        self.specs = list(specs)
        self._sources: list = []  # per file: a _JsonlIndex, JSON records, or a datasets table
        for spec in self.specs:
            path = spec.path
            if hub_id(path) is not None or Path(path).is_dir():
                self._sources.append(_load_dataset(spec))
                continue
            if not Path(path).is_file():
                raise DataError(f"data file {path!r} does not exist" + (
                    f" (a hub dataset is written {HUB_PREFIX}{path})" if HUB_LIKE.fullmatch(path) and "." not in Path(path).name else ""))
            if path.endswith(".jsonl"):
                self._sources.append(_JsonlIndex(path))
            elif path.endswith(".json"):
                self._sources.append(_json_records(path))
            elif path.endswith(".parquet"):
                # Parquet stores its schema, so no type is inferred across records (unlike JSON in Arrow).
                self._sources.append(datasets.load_dataset("parquet", data_files=path, split="train"))
            else:
                raise DataError(f"data file {path!r}: expected .jsonl, .json or .parquet")
        for spec, source in zip(self.specs, self._sources):
            if len(source) == 0:
                raise DataError(f"data source {spec.path!r} holds no records")

    def __len__(self) -> int:
        return sum(len(s) for s in self._sources)

    def locate(self, index: int) -> tuple[SourceSpec, str, dict | DataError]:
        return next(self.locate_many([index]))

    def locate_many(self, indices: Iterable[int]) -> Iterator[tuple[SourceSpec, str, dict | DataError]]:
        """(source, the record's name for messages, the record or why it cannot be read) of each global
        index in turn, opening each JSONL file once rather than once per record."""
        with ExitStack() as stack:
            files: dict[str, BinaryIO] = {}
            for index in indices:
                file, local = self._position(index)
                spec, source = self.specs[file], self._sources[file]
                if isinstance(source, _JsonlIndex):
                    if spec.path not in files:
                        files[spec.path] = stack.enter_context(open(spec.path, "rb"))
                    where = f"{spec.path} record {local + 1} (line {source.lines[local]})"
                    yield spec, where, _parse_jsonl_record(where, files[spec.path], int(source.offsets[local]))
                else:
                    where = f"{spec.path} record {local + 1}"
                    entry = source[local]
                    yield spec, where, entry if isinstance(entry, dict) else DataError(
                        f"{where}: a record must be a JSON object, got {type(entry).__name__}")

    def _position(self, index: int) -> tuple[int, int]:
        """(file number, index within that file) of a global record index."""
        for file, source in enumerate(self._sources):
            if index < len(source):
                return file, index
            index -= len(source)
        raise IndexError(index)


HUB_PREFIX = "hf:"
HUB_LIKE = re.compile(r"[\w.-]+/[\w.-]+")  # a missing path that may have meant a hub id (for the hint)


def hub_id(path: str) -> str | None:
    """The hub id of a path written `hf:org/name`; None for a local path."""
    return path[len(HUB_PREFIX):] if path.startswith(HUB_PREFIX) else None


def _load_dataset(spec: SourceSpec) -> datasets.Dataset:
    """A dataset directory or hub dataset (`hf:org/name`), read with `datasets` (a hub id needs the machine online)."""
    name = hub_id(spec.path) or spec.path
    try:
        return datasets.load_dataset(name, split=spec.split)
    except Exception as error:  # datasets raises many types: missing repo, offline mode, bad split
        where = "hub dataset" if hub_id(spec.path) else "dataset directory"
        raise DataError(f"{where} {name!r} (split {spec.split!r}) could not be loaded: "
                        f"{type(error).__name__}: {error}") from error


class _JsonlIndex:
    """Where each record (non-blank line) of a JSONL file starts, and its line number."""

    def __init__(self, path: str):
        offsets, lines, position = [], [], 0
        with open(path, "rb") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    offsets.append(position)
                    lines.append(number)
                position += len(line)
        self.offsets, self.lines = np.array(offsets, dtype=np.int64), np.array(lines, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.offsets)


def _json_records(path: str) -> list:
    try:
        records = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise DataError(f"{path}: not valid UTF-8 JSON ({error})") from error
    if not isinstance(records, list):
        raise DataError(f"{path}: a .json data file must hold a list of records, got {type(records).__name__}")
    return records


def _parse_jsonl_record(where: str, file: BinaryIO, offset: int) -> dict | DataError:
    file.seek(offset)
    line = file.readline()
    try:
        entry = json.loads(line.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        return DataError(f"{where}: unparseable JSON line ({error})")
    if not isinstance(entry, dict):
        return DataError(f"{where}: a record must be a JSON object, got {type(entry).__name__}")
    return entry


# Every reason a record can be left out, for SFT and preference data alike. The skip counters are
# `dict.fromkeys(SKIP_REASONS, 0)` on every rank, so ranks all-reduce the same keys whatever their
# share of the data skipped (a counter that grew a key on one rank only aborted the collective).
SKIP_REASONS = ("overlong", "no_trainable_tokens", "identical_replies", "bad_record")
OVERLONG = ("drop", "truncate", "split", "error")


@dataclass(frozen=True)
class Skipped:
    """A record left out on purpose; counted and logged by whoever consumes the documents (a loader
    worker's counters would never reach the trainer)."""

    reason: str  # one of SKIP_REASONS
    detail: str

    def __post_init__(self) -> None:
        if self.reason not in SKIP_REASONS:
            raise ValueError(f"unknown skip reason {self.reason!r}: add it to SKIP_REASONS")


def outcomes_by_record(outcomes: list[Document | Skipped], num_records: int) -> list[list[Document | Skipped]]:
    """The flat outcomes of `num_records` records (as `get_many` gives them), one list per record: a
    record's outcomes start with a `Skipped` or with its first piece (piece 0), and its later pieces
    (`overlong=split`) follow in order."""
    records: list[list[Document | Skipped]] = []
    for outcome in outcomes:
        if isinstance(outcome, Skipped) or outcome.piece == 0:
            records.append([])
        elif not records:
            raise RuntimeError(f"a later piece of record {outcome.doc_id} came without its first piece")
        records[-1].append(outcome)
    if len(records) != num_records:  # a source broke the contract: fail loudly rather than lose records
        raise RuntimeError(f"{num_records} records gave the outcomes of {len(records)}")
    return records


ON_BAD_RECORD = ("error", "skip")


TRAIN_ON = ("assistant", "last_assistant", "all")


class TemplateDocuments:
    """What SFT documents and preference pairs share: records of a source, rendered with the tokenizer's
    chat template (`_render`, one record) and tokenized in one batch (`_tokenize`), by global record index.

    A record that cannot be read, converted, rendered or trained on is a DataError, or with
    `on_bad_record="skip"` a counted `Skipped("bad_record")` naming the record and the problem. Reading
    stops at the first error, which is raised after the records before it are tokenized: the error is the
    one reading one by one would report (a record before it may itself be refused when tokenized, e.g. an
    overlong one under `overlong="error"`, which `on_bad_record` does not turn into a skip)."""

    def __init__(self, source: RecordSource, tokenizer: PreTrainedTokenizerBase, max_tokens: int, overlong: str,
                 on_bad_record: str = "error"):
        if on_bad_record not in ON_BAD_RECORD:
            raise ValueError(f"data.on_bad_record must be one of {ON_BAD_RECORD}, got {on_bad_record!r}")
        self.source = source
        self.tokenizer = tokenizer
        try:
            self.markers: TemplateMarkers = probe_template(tokenizer)
        except ChatTemplateError as error:
            raise ChatTemplateError(f"tokenizer {tokenizer.name_or_path}: {error}") from error
        self._encode = TextBatchEncoder(tokenizer, cut_after=self.markers.end_of_turn)
        self.max_tokens = max_tokens
        self.overlong = overlong
        self.on_bad_record = on_bad_record

    def __len__(self) -> int:
        return len(self.source)

    def get(self, index: int) -> Document | Skipped:
        return self.get_many([index])[0]

    def get_many(self, indices: Sequence[int]) -> list[Document | Skipped]:
        """The outcomes of the records at `indices`, flat and in order: a record gives one `Skipped` or
        its documents (several pieces of a record that `overlong="split"` cuts)."""
        outcomes: list = []  # per record: what _render prepared for tokenizing, or why it is skipped
        failure: DataError | None = None
        for index, (spec, where, record) in zip(indices, self.source.locate_many(indices)):
            try:
                if isinstance(record, DataError):
                    raise record
                outcomes.append(self._render(index, where, spec, record))
            except DataError as error:
                if self.on_bad_record != "skip":
                    failure = error
                    break
                outcomes.append(Skipped("bad_record", str(error)))
        rendered = [o for o in outcomes if not isinstance(o, Skipped)]
        tokenized = iter(outcomes_by_record(self._tokenize(rendered), len(rendered)) if rendered else [])
        documents = [item for o in outcomes for item in ([o] if isinstance(o, Skipped) else next(tokenized))]
        if failure is not None:
            raise failure
        return documents

    def _bad_record(self, error: DataError) -> Skipped:
        """A record found unusable while tokenizing: raised, or skipped under on_bad_record="skip"."""
        if self.on_bad_record != "skip":
            raise error
        return Skipped("bad_record", str(error))

    def _render(self, index: int, where: str, spec: SourceSpec, record: dict):
        raise NotImplementedError

    def _tokenize(self, rendered: list) -> list[Document | Skipped]:
        raise NotImplementedError


def check_tools_rendered(markers: TemplateMarkers, tools: list | None, messages: list[dict], where: str) -> None:
    """Refuse tools or tool calls that the chat template would silently leave out of the text."""
    uses_calls = any("tool_calls" in m for m in messages)
    if (tools and not markers.renders_tools) or (uses_calls and not markers.renders_tool_calls):
        raise DataError(f"{where}: the record has tools or tool calls, but the tokenizer's chat template does not "
                        "render them (training would silently leave them out)")


class SFTDocuments(TemplateDocuments):
    """Tokenized, label-masked documents by global record index.

    train_on: `assistant` (every assistant reply and its end-of-turn token), `last_assistant` (only the
    final reply), or `all` (every token, prompts included).

    overlong, for a record of more tokens than the budget: `drop` (a counted skip), `truncate` (keep its
    first max_tokens tokens), `split` (cut it into pieces of up to max_tokens tokens, each its own
    document: a piece does not attend to the pieces before it, and the first token of each later piece is
    not trained, as nothing before it in the piece predicts it), or `error`. Truncated and split records are
    marked on their first document (`Document.overlong`) so the stream can count them; pieces with
    nothing to train are left out (counted with the split). `get` gives the first piece of a split record,
    `get_many` all its pieces in order."""

    def __init__(self, source: RecordSource, tokenizer: PreTrainedTokenizerBase, max_tokens: int,
                 overlong: str = "drop", train_on: str = "assistant", on_bad_record: str = "error"):
        if overlong not in OVERLONG:
            raise ValueError(f"data.overlong must be one of {OVERLONG}, got {overlong!r}")
        if train_on not in TRAIN_ON:
            raise ValueError(f"data.train_on must be one of {TRAIN_ON}, got {train_on!r}")
        super().__init__(source, tokenizer, max_tokens, overlong, on_bad_record)
        self.train_on = train_on

    def _render(self, index: int, where: str, spec: SourceSpec, record: dict) -> "_Rendered":
        """Convert, check and render one record, and locate the assistant replies it trains."""
        conversation = to_conversation(record, spec, where)
        check_tools_rendered(self.markers, conversation.tools, conversation.messages, where)
        try:
            text = render_conversation(self.tokenizer, conversation.messages, conversation.tools)
            spans = trained_spans(text, conversation.messages, self.markers,
                                  last_turn_only=self.train_on == "last_assistant", skip_turns=conversation.prompt_replies)
        except Exception as error:  # the template's own checks (raise_exception) and its failures on odd data
            raise DataError(f"{where}: {type(error).__name__}: {error}") from error
        return _Rendered(index, where, text, spans)

    def _tokenize(self, rendered: list["_Rendered"]) -> list[Document | Skipped]:
        """Tokenize the rendered texts together; label and check each document."""
        # Dropped records need only their token count: converting their tokens would be wasted work. And when
        # they are dropped or truncated, a record's tokens past the budget are never used: a long one need
        # not be tokenized whole (its count is then a lower bound; an error reports the exact one).
        keep_at_most = self.max_tokens if self.overlong in ("drop", "error") else None
        needed = self.max_tokens if self.overlong in ("drop", "truncate") else None
        everything = self.train_on == "all"
        encoded = self._encode([r.text for r in rendered], None if everything else [r.spans for r in rendered],
                               keep_at_most=keep_at_most, needed=needed)
        trainable = np.ones(len(encoded.ids), dtype=bool) if everything else encoded.trainable
        labels = shifted_label_array(encoded.ids, trainable, encoded.ends)
        ends = encoded.ends.tolist()
        documents: list[Document | Skipped] = []
        for r, count, cut, start, end in zip(rendered, encoded.counts.tolist(), encoded.cut.tolist(), [0, *ends[:-1]], ends):
            documents += self._documents(r, count, cut, encoded.ids[start:end], labels[start:end])
        return documents

    def _documents(self, rendered: "_Rendered", count: int, cut: bool, ids: np.ndarray,
                   labels: np.ndarray) -> list[Document | Skipped]:
        """The document(s) of a record of `count` tokens (at least, if `cut`: only its beginning was
        tokenized; `ids`, `labels`: empty when it will be dropped), or why it is skipped."""
        message = (f"{rendered.where}: {'at least ' if cut else ''}{count} tokens exceed "
                   f"data.max_tokens_per_microbatch={self.max_tokens}")
        if count > self.max_tokens and self.overlong == "error":
            raise DataError(message)
        if count > self.max_tokens and self.overlong == "drop":
            return [Skipped("overlong", message)]
        if not (labels >= 0).any():
            return [Skipped("no_trainable_tokens", rendered.where)]
        if count <= self.max_tokens:
            return [Document(doc_id=rendered.index, input_ids=ids, labels=labels)]
        cuts = range(0, count if self.overlong == "split" else 1, self.max_tokens)
        pieces = []
        for start in cuts:
            piece_labels = labels[start : start + self.max_tokens].copy()
            piece_labels[-1] = IGNORE_INDEX  # its target is the first token of the next piece, not in this one
            if (piece_labels >= 0).any():
                pieces.append(Document(doc_id=rendered.index, input_ids=ids[start : start + self.max_tokens],
                                       labels=piece_labels, piece=len(pieces)))
        if not pieces:
            return [Skipped("no_trainable_tokens", f"{message}, and its first {self.max_tokens} tokens train nothing")]
        pieces[0].overlong = "truncated" if self.overlong == "truncate" else "split"
        return pieces


@dataclass(frozen=True)
class _Rendered:
    """A record rendered by the chat template, waiting to be tokenized with the others of its batch."""

    index: int  # global record index
    where: str  # "file record i", for messages
    text: str
    spans: list[tuple[int, int]]  # character spans of the assistant replies to train
