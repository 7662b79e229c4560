"""Reading records: local JSON/JSONL/Parquet files, dataset directories and `hf:org/name` hub datasets,
behind one global record index; a config's list of sources as `SourceSpec`s.

Errors name the file, the record (1-based, with the JSONL line) and the problem.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np

from chattune.config.typed import config_dict
from chattune.data.ingest.formats import DataError, SourceSpec
from chattune.hub import HUB_LIKE, HUB_PREFIX, hub_id

if (
    TYPE_CHECKING
):  # datasets (with pandas) is imported only to read Parquet and dataset directories: a second per process
    import datasets


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
                raise DataError(
                    f"data file {path!r} does not exist"
                    + (
                        f" (a hub dataset is written {HUB_PREFIX}{path})"
                        if HUB_LIKE.fullmatch(path) and "." not in Path(path).name
                        else ""
                    )
                )
            if path.endswith(".jsonl"):
                self._sources.append(_JsonlIndex(path))
            elif path.endswith(".json"):
                self._sources.append(_json_records(path))
            elif path.endswith(".parquet"):
                # Parquet stores its schema, so no type is inferred across records (unlike JSON in Arrow).
                import datasets

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
                    yield (
                        spec,
                        where,
                        entry
                        if isinstance(entry, dict)
                        else DataError(f"{where}: a record must be a JSON object, got {type(entry).__name__}"),
                    )

    def _position(self, index: int) -> tuple[int, int]:
        """(file number, index within that file) of a global record index."""
        for file, source in enumerate(self._sources):
            if index < len(source):
                return file, index
            index -= len(source)
        raise IndexError(index)


def _load_dataset(spec: SourceSpec) -> datasets.Dataset:
    """A dataset directory or hub dataset (`hf:org/name`), read with `datasets` (a hub id needs the machine online)."""
    import datasets

    name = hub_id(spec.path) or spec.path
    try:
        return datasets.load_dataset(name, split=spec.split)
    except Exception as error:  # datasets raises many types: missing repo, offline mode, bad split
        where = "hub dataset" if hub_id(spec.path) else "dataset directory"
        raise DataError(
            f"{where} {name!r} (split {spec.split!r}) could not be loaded: {type(error).__name__}: {error}"
        ) from error


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
    except json.JSONDecodeError as error:  # the file is one JSON value: no record can be skipped on its own
        line, column, cut_short = json_error_position(error)
        where = f"line {line}, column {column}" + (" (the end of the file: it ends before its JSON does)" * cut_short)
        raise DataError(
            f"{path}: unparseable JSON at {where}: {json_problem(error)}; "
            "a .json file is parsed whole, so data.on_bad_record cannot skip a part of it (in a .jsonl "
            "file, one record a line, data.on_bad_record=skip skips the lines that do not parse)"
        ) from error
    except UnicodeDecodeError as error:
        raise DataError(f"{path}: not UTF-8 text (byte {error.start + 1}: {error.reason})") from error
    if not isinstance(records, list):
        raise DataError(f"{path}: a .json data file must hold a list of records, got {type(records).__name__}")
    return records


def _parse_jsonl_record(where: str, file: BinaryIO, offset: int) -> dict | DataError:
    file.seek(offset)
    line = file.readline().rstrip(b"\r\n")  # without its end: json would place an error there on a line 2, column 1
    try:
        entry = json.loads(line.decode("utf-8"))
    except json.JSONDecodeError as error:  # its own "line 1 column N" counts within this one line: say the column
        _, column, cut_short = json_error_position(error)
        end = " (the end of the line: a record of a .jsonl file is one whole line)" if cut_short else ""
        return DataError(f"{where}: unparseable JSON at column {column}{end}: {json_problem(error)}")
    except UnicodeDecodeError as error:
        return DataError(f"{where}: not UTF-8 text (byte {error.start + 1} of the line: {error.reason})")
    if not isinstance(entry, dict):
        return DataError(f"{where}: a record must be a JSON object, got {type(entry).__name__}")
    return entry


def json_error_position(error: json.JSONDecodeError) -> tuple[int, int, bool]:
    """(line, column, whether the text ended first) of a JSON error, 1-based. Where the text ends before its value
    does (a record broken over lines, a file cut short), json places the error past the last character, after any
    trailing blank lines; the position given is then just after the last character that is not blank, where the
    text stopped."""
    text = error.doc
    content = len(text.rstrip())
    if error.pos < content:
        return error.lineno, error.colno, False
    line = text.count("\n", 0, content) + 1
    return line, content - (text.rfind("\n", 0, content) + 1) + 1, True


def json_problem(error: json.JSONDecodeError) -> str:
    """What the json module found, without the word that leads to its position ("Invalid control character at"),
    and for a raw control character in a string, how JSON writes it."""
    problem = error.msg.removesuffix(" at")
    if problem == "Invalid control character":
        problem += f" {error.doc[error.pos]!r} in a string (JSON writes a tab as \\t, a newline as \\n)"
    return problem


def source_specs(sources) -> list[SourceSpec]:
    """The data sources of a config list (`data.train`, `data.eval`): paths or {path, format, ...} mappings;
    none for null or an empty list."""
    if sources is None:
        return []
    entries = config_dict(sources)
    return [SourceSpec.from_config(entry) for entry in entries]
