"""The token cache: a data source's documents tokenized once, stored as memory-mapped arrays, and found again
by a fingerprint of everything that makes them.

Without it every launch renders and tokenizes every record it trains (`chattune.data.stream`), and with
world-size-invariant steps every rank tokenizes all the data. With it (`data.cache: auto | PATH`), a launch
reads documents from the arrays: packing needs only their lengths (a document's tokens are a view of the
memory map, read when its microbatch is collated), so a rank reads only the tokens it trains.

One source's cache, `<root>/<kind>-<file stem>-<key>/`:

    manifest.json    what it holds and what it was built from; written last: a directory is complete with it
    shard-00000/     records [start, stop) of the source, one shard per building rank, in record order
        ids.bin      every kept document's tokens back to back (int32)
        labels.bin   their shifted labels (int32; IGNORE_INDEX trains nothing)
        tokens-NAME.bin  each per-token value its data declares (`Document.token_values`), float32, one per
                     token of ids.bin (NaN under a document that declares none)
        index.npz    per document: its start in the shard, its first segment's length (a preference pair's
                     chosen side, a KTO example's own sequence), each value its data declares
                     (`Document.doc_values`: `value:NAME`, float64, NaN where a document declares none) and
                     which per-token values it declares (`tokens:NAME`, bool);
                     per record: its first document, its skip reason, its overlong mark and its pieces left
                     out (a split record's pieces that train nothing)
        skips.json   the message of each skipped record (logged as streaming logs it)
        left_out.json  the message of each split record that left pieces out (logged alike)

The key hashes the source file's whole content (a dataset directory's every file; a hub dataset's `datasets`
fingerprint), the tokenizer's full serialisation and chat template, the settings that change documents
(format mapping, `train_on`, the overlong policy, the budget and how messages name it, `on_bad_record`),
chattune's version and this layout's. Any change gives another key, so a cache is never stale: it is either
the one these settings would build, or not found.

Why raw arrays and not `datasets`' Arrow files: reading a random document is a slice of a memory map (no
copy, no Python object per token, no pyarrow conversion), the arrays are written as they are produced with
no second pass, and the format needs neither pyarrow nor pandas at start-up. BENCHMARKS.md has the measured
read speeds of both.

Atomic: a cache is written in a staging directory `<root>/.building-<name>-<host>-<pid>-<random>` and
renamed into place at once. A build killed mid-way leaves only a staging directory, which nothing reads (a
later build on the same host removes it once its process is gone). Of two launches building the same cache,
the first rename wins; the other finds the cache in place, deletes its own copy and reads the winner's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import shutil
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from importlib import metadata
from pathlib import Path

import numpy as np

from chattune.data.documents import SKIP_REASONS, Document, Skipped, outcomes_by_record
from chattune.data.ingest.formats import SourceSpec
from chattune.errors import UserError
from chattune.hub import hub_id

logger = logging.getLogger(__name__)

# Bump when the arrays, or the documents chattune makes from records, change. 3: a reward pair's margin is read
# (a reward cache of layout 2 holds a record with a margin as a skipped bad record). 4: a split record's pieces
# left out are counted (`Document.pieces_left_out`). 5: the documents' declared values by name (`value:NAME`), in
# place of a KTO label and a reward margin of their own. 6: the documents' per-token values (`tokens-NAME.bin`).
# 7: a pair's shared prompt (`doc_shared`, data.share_prompts).
LAYOUT_VERSION = 7
CACHE_DIR_ENV = "CHATTUNE_CACHE_DIR"  # where data.cache=auto keeps caches (default ~/.cache/chattune)
MANIFEST = "manifest.json"
CHUNK_RECORDS = 1024  # records tokenized in one batch (one loader item) while building
OVERLONG_MARKS = ("", "truncated", "split")
VALUE_PREFIX = "value:"  # a declared value's array in index.npz: `value:NAME`, NaN where a document has none
TOKENS_PREFIX = "tokens:"  # in index.npz: `tokens:NAME`, whether each document declares per-token value NAME
_HASH_BLOCK = 8 << 20


def cache_root(setting: str) -> Path | None:
    """Where data.cache keeps token caches: None for "off", the user's cache directory for "auto"
    ($CHATTUNE_CACHE_DIR, else $XDG_CACHE_HOME/chattune, else ~/.cache/chattune), else the directory given."""
    if setting == "off":
        return None
    if setting == "auto":
        base = (
            os.environ.get(CACHE_DIR_ENV)
            or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "chattune"
        )
        return Path(base) / "tokens"
    return Path(setting)


# ---------------------------------------------------------------------------------------------- the key


def content_digest(spec: SourceSpec) -> str:
    """A hash of everything the source's records come from: a file's bytes (read in blocks, never held
    whole), every file of a dataset directory, or a hub dataset's `datasets` fingerprint (its revision)."""
    path = Path(spec.path)
    digest = hashlib.sha256()
    if hub_id(spec.path) is not None:
        from chattune.data.ingest.records import RecordSource

        digest.update(f"hub {spec.path} {spec.split} {RecordSource([spec])._sources[0]._fingerprint}".encode())
        return digest.hexdigest()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        digest.update(f"{file.relative_to(path) if path.is_dir() else ''}\0".encode())
        with open(file, "rb") as f:
            while block := f.read(_HASH_BLOCK):
                digest.update(block)
    return digest.hexdigest()


def tokenizer_digest(tokenizer) -> str:
    """A hash of what tokenizes and renders: the tokenizer's full serialisation (vocabulary, merges,
    normalizer, added tokens, post-processor), its chat template and its settings (file paths left out, so a
    copied tokenizer finds the same caches)."""
    digest = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    digest.update(
        (backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)).encode()
    )
    settings = {k: v for k, v in tokenizer.init_kwargs.items() if not k.endswith("_file") and k != "name_or_path"}
    digest.update(json.dumps([tokenizer.chat_template, settings], sort_keys=True, default=str).encode())
    return digest.hexdigest()


def _chattune_version() -> str:
    try:
        return metadata.version("chattune")
    except metadata.PackageNotFoundError:
        from chattune import __version__

        return __version__


def source_key(kind: str, spec: SourceSpec, settings: dict, tokenizer_hash: str) -> str:
    """The fingerprint of one source's documents: `kind` ("sft", "dpo"), the spec (less its name and weight,
    which change no document), the settings that shape documents, the tokenizer's hash and the content."""
    described = {f.name: getattr(spec, f.name) for f in fields(spec) if f.name not in ("name", "weight")}
    text = json.dumps(
        {
            "layout": LAYOUT_VERSION,
            "chattune": _chattune_version(),
            "kind": kind,
            "spec": described,
            "settings": settings,
            "tokenizer": tokenizer_hash,
            "content": content_digest(spec),
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def cache_name(kind: str, spec: SourceSpec, key: str) -> str:
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(spec.path).name)[:40]
    return f"{kind}-{stem}-{key}"


# ------------------------------------------------------------------------------------------- writing


@dataclass
class TokenizedChunk:
    """The outcomes of consecutive records as arrays (cheap to send from a loader worker), or the error that
    stopped them."""

    ids: np.ndarray  # int32, every document back to back
    labels: np.ndarray  # int32
    doc_lengths: np.ndarray  # int64
    doc_chosen: np.ndarray  # int32: a pair's chosen side's tokens; 0 for a one-sequence document
    doc_shared: np.ndarray  # int32: a pair's shared prompt (`Document.shared_prefix`); 0 where none
    doc_values: dict[str, np.ndarray]  # float64 per name: each document's declared value (NaN: none)
    token_values: dict[str, np.ndarray]  # float32 per name, one per token of `ids` (NaN under a document without)
    token_declared: dict[str, np.ndarray]  # bool per name: whether each document declares it
    record_docs: np.ndarray  # int64: documents of each record (0: skipped)
    record_skip: np.ndarray  # int8: 1 + the index in SKIP_REASONS of a skipped record, 0 kept
    record_overlong: np.ndarray  # int8: index in OVERLONG_MARKS of the record's first document's mark
    record_left_out: np.ndarray  # int32: the record's pieces left out (`Document.pieces_left_out`)
    skip_details: list[str]  # one per skipped record, in order
    left_out_details: list[str]  # one per record with pieces left out, in order


def tokenize_chunk(documents, records: range) -> TokenizedChunk:
    """`records` of a document source (`SFTDocuments`, `PairDocuments`) as arrays."""
    outcomes = outcomes_by_record(documents.get_many(list(records)), len(records))
    kept = [d for outcome in outcomes for d in outcome if isinstance(d, Document)]
    if any(len(d.segment_lengths) > 2 for d in kept):
        raise ValueError("the token cache stores documents of one or two segments")
    names = sorted({name for d in kept for name in d.doc_values})
    token_names = sorted({name for d in kept for name in d.token_values})
    skipped = [outcome[0] for outcome in outcomes if isinstance(outcome[0], Skipped)]
    firsts = [None if isinstance(o[0], Skipped) else o[0] for o in outcomes]  # per record: its first document
    return TokenizedChunk(
        ids=np.concatenate([d.input_ids for d in kept]).astype(np.int32) if kept else np.zeros(0, np.int32),
        labels=np.concatenate([d.labels for d in kept]).astype(np.int32) if kept else np.zeros(0, np.int32),
        doc_lengths=np.array([len(d) for d in kept], dtype=np.int64),
        doc_chosen=np.array([d.segments[0] if d.segments else 0 for d in kept], dtype=np.int32),
        doc_shared=np.array([d.shared_prefix for d in kept], dtype=np.int32),
        doc_values={name: np.array([d.doc_values.get(name, np.nan) for d in kept], dtype=np.float64) for name in names},
        token_values={
            name: np.concatenate([d.token_values.get(name, np.full(len(d), np.nan)) for d in kept]).astype(np.float32)
            for name in token_names
        },
        token_declared={name: np.array([name in d.token_values for d in kept], dtype=bool) for name in token_names},
        record_docs=np.array([sum(isinstance(d, Document) for d in o) for o in outcomes], dtype=np.int64),
        record_skip=np.array(
            [1 + SKIP_REASONS.index(o[0].reason) if isinstance(o[0], Skipped) else 0 for o in outcomes], dtype=np.int8
        ),
        record_overlong=np.array(
            [0 if isinstance(o[0], Skipped) else OVERLONG_MARKS.index(o[0].overlong) for o in outcomes], dtype=np.int8
        ),
        record_left_out=np.array([d.pieces_left_out if d else 0 for d in firsts], dtype=np.int32),
        skip_details=[s.detail for s in skipped],
        left_out_details=[d.left_out_detail for d in firsts if d and d.pieces_left_out],
    )


class _Chunks:
    """Map-style view for a loader: a range of records -> its `TokenizedChunk`, or the UserError it raised
    (sent back as the item, so the builder raises it with its own message, not in a worker's traceback)."""

    def __init__(self, documents, chunks: list[range]):
        self.documents, self.chunks = documents, chunks

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, index: int) -> TokenizedChunk | UserError:
        try:
            return tokenize_chunk(self.documents, self.chunks[index])
        except UserError as error:
            return error


def _tokenized(documents, records: range, num_workers: int) -> Iterator[TokenizedChunk]:
    """The chunks of `records` in order: tokenized here, or by `num_workers` loader processes."""
    chunks = [
        range(start, min(start + CHUNK_RECORDS, records.stop))
        for start in range(records.start, records.stop, CHUNK_RECORDS)
    ]
    if num_workers == 0:
        yield from (tokenize_chunk(documents, chunk) for chunk in chunks)
        return
    import torch

    from chattune.data.stream import _as_is, _tokenize_on_one_thread

    loader = torch.utils.data.DataLoader(
        _Chunks(documents, chunks),
        batch_size=None,
        collate_fn=_as_is,
        num_workers=num_workers,
        worker_init_fn=_tokenize_on_one_thread,
    )
    for item in loader:
        if isinstance(item, UserError):
            raise item
        yield item


def write_shard(documents, records: range, directory: Path, num_workers: int = 0) -> dict:
    """Tokenize `records` of `documents` into the shard `directory` (appending each chunk's tokens to the files
    as it comes, so memory does not grow with the data). Returns the shard's counts; a UserError (a bad record
    under on_bad_record=error, an overlong one under overlong=error) propagates, leaving the shard incomplete."""
    directory.mkdir(parents=True)
    lengths, chosen, shared, record_docs, skip, overlong, details = [], [], [], [], [], [], []
    values: list[dict[str, np.ndarray]] = []
    left_out, left_out_details = [], []
    token_files: dict[str, object] = {}  # per-token value name: its open file
    token_declared: dict[str, list[np.ndarray]] = {}  # per-token value name: which documents declare it
    written, documents_written = 0, 0  # so far (a name first declared in a later chunk: NaN under the earlier ones)
    with open(directory / "ids.bin", "wb") as ids, open(directory / "labels.bin", "wb") as labels:
        for chunk in _tokenized(documents, records, num_workers):
            ids.write(chunk.ids.tobytes())
            labels.write(chunk.labels.tobytes())
            for name in chunk.token_values.keys() - token_files.keys():
                token_files[name] = open(directory / f"tokens-{name}.bin", "wb")  # noqa: SIM115 (closed below)
                token_files[name].write(np.full(written, np.nan, np.float32).tobytes())
                token_declared[name] = [np.zeros(documents_written, bool)]
            for name, file in token_files.items():
                file.write(chunk.token_values.get(name, np.full(len(chunk.ids), np.nan, np.float32)).tobytes())
                token_declared[name].append(chunk.token_declared.get(name, np.zeros(len(chunk.doc_lengths), bool)))
            written, documents_written = written + len(chunk.ids), documents_written + len(chunk.doc_lengths)
            lengths.append(chunk.doc_lengths)
            chosen.append(chunk.doc_chosen)
            shared.append(chunk.doc_shared)
            values.append(chunk.doc_values)
            record_docs.append(chunk.record_docs)
            skip.append(chunk.record_skip)
            overlong.append(chunk.record_overlong)
            left_out.append(chunk.record_left_out)
            details += chunk.skip_details
            left_out_details += chunk.left_out_details
        for f in (ids, labels, *token_files.values()):
            f.flush()
            os.fsync(f.fileno())
        for f in token_files.values():
            f.close()
    doc_lengths = np.concatenate([np.zeros(0, np.int64), *lengths])
    per_record = np.concatenate([np.zeros(0, np.int64), *record_docs])
    skip_codes = np.concatenate([np.zeros(0, np.int8), *skip])
    left_out_counts = np.concatenate([np.zeros(0, np.int32), *left_out])
    names = sorted({name for chunk_values in values for name in chunk_values})
    declared = {  # a chunk without a name the others declare: NaN for its documents
        f"{VALUE_PREFIX}{name}": np.concatenate(
            [np.zeros(0), *(v.get(name, np.full(len(n), np.nan)) for v, n in zip(values, lengths))]
        )
        for name in names
    }
    doc_starts = np.concatenate([[0], np.cumsum(doc_lengths)]).astype(np.int64)
    declared_tokens = {f"{TOKENS_PREFIX}{name}": np.concatenate(flags) for name, flags in token_declared.items()}
    np.savez(
        directory / "index.npz",
        doc_starts=doc_starts,
        doc_chosen=np.concatenate([np.zeros(0, np.int32), *chosen]),
        doc_shared=np.concatenate([np.zeros(0, np.int32), *shared]),
        **declared,
        **declared_tokens,
        record_first_doc=np.concatenate([[0], np.cumsum(per_record)]).astype(np.int64),
        record_skip=skip_codes,
        record_overlong=np.concatenate([np.zeros(0, np.int8), *overlong]),
        record_left_out=left_out_counts,
    )
    skipped_records = (np.flatnonzero(skip_codes) + records.start).tolist()
    (directory / "skips.json").write_text(json.dumps(dict(zip(map(str, skipped_records), details))))
    cut_records = (np.flatnonzero(left_out_counts) + records.start).tolist()
    (directory / "left_out.json").write_text(json.dumps(dict(zip(map(str, cut_records), left_out_details))))
    counts = {
        "start": records.start,
        "stop": records.stop,
        "documents": len(doc_lengths),
        "tokens": int(doc_lengths.sum()),
        "skipped": len(skipped_records),
    }
    (directory / "done.json").write_text(json.dumps(counts))  # the shard's last file: it is whole
    return counts


def staging_directory(root: Path, name: str) -> Path:
    """A new, empty directory to build cache `name` in, unique to this process; leftovers of builds on this
    host whose process is gone (killed mid-build) are removed first."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(
            f"data.cache: cannot make the token cache directory {root}: {error.strerror} (set data.cache "
            "to a writable directory, or data.cache=off)"
        ) from error
    host = socket.gethostname().replace("-", "_")
    for stale in root.glob(f".building-{name}-{host}-*"):
        pid = int(stale.name.rsplit("-", 2)[1])
        if not _alive(pid):
            logger.info("removing %s, left by a build whose process (%d) is gone", stale, pid)
            shutil.rmtree(stale, ignore_errors=True)
    staging = root / f".building-{name}-{host}-{os.getpid()}-{secrets.token_hex(4)}"
    staging.mkdir()
    return staging


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def commit(staging: Path, final: Path, manifest: dict) -> bool:
    """Write the manifest and rename `staging` to `final` in one step. False (and `staging` removed) when
    another build committed `final` first."""
    shards = sorted(staging.glob("shard-*"))
    if len(shards) != manifest["shards"] or not all((s / "done.json").is_file() for s in shards):
        raise UserError(
            f"data.cache: the token cache {final.name} was built by {manifest['shards']} ranks, but "
            f"{staging} holds {sum((s / 'done.json').is_file() for s in shards)} finished shard(s): the "
            "ranks do not share this directory (on several machines, set data.cache to a directory every "
            "machine sees, or data.cache=off)"
        )
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
    try:
        os.rename(staging, final)
        return True
    except OSError:
        if not (final / MANIFEST).is_file():
            raise
        shutil.rmtree(staging, ignore_errors=True)
        return False


def is_complete(directory: Path) -> bool:
    return (directory / MANIFEST).is_file()


@dataclass(frozen=True)
class BuildShard:
    """This rank's part of a collective build: shard `shard` of `num_shards` (records in order), written in the
    `staging` directory every building rank shares (None: one made here, for a build of one shard). `agree`
    (collective builds): told this shard's error or None; it raises the build's first error on every rank, and
    returns when every shard is written."""

    shard: int = 0
    num_shards: int = 1
    staging: Path | None = None
    agree: Callable[[Exception | None], None] | None = None


def build_source_cache(
    documents,
    final: Path,
    kind: str,
    spec: SourceSpec,
    key: str,
    num_workers: int = 0,
    part: BuildShard = BuildShard(),
) -> None:
    """Build `final` from `documents` (every record): this rank's `part` of it (`BuildShard`; the default: the
    whole build, here). The first shard commits."""
    shard, num_shards, agree = part.shard, part.num_shards, part.agree
    staging = part.staging or staging_directory(final.parent, final.name)
    started = time.perf_counter()
    n = len(documents)
    records = range(n * shard // num_shards, n * (shard + 1) // num_shards)
    try:
        write_shard(documents, records, staging / f"shard-{shard:05d}", num_workers)
        error = None
    except UserError as failure:
        error = failure
    if agree is not None:
        agree(error)
    elif error is not None:
        shutil.rmtree(staging, ignore_errors=True)
        raise error
    if shard != 0:
        return
    counts = [
        json.loads((s / "done.json").read_text())
        for s in sorted(staging.glob("shard-*/"))
        if (s / "done.json").is_file()
    ]
    manifest = {
        "layout": LAYOUT_VERSION,
        "key": key,
        "kind": kind,
        "source": spec.path,
        "records": n,
        "documents": sum(c["documents"] for c in counts),
        "tokens": sum(c["tokens"] for c in counts),
        "skipped": sum(c["skipped"] for c in counts),
        "shards": num_shards,
        "built_seconds": round(time.perf_counter() - started, 2),
        "built_at": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if commit(staging, final, manifest):
        logger.info(
            "token cache %s: %d records -> %d documents, %d tokens, built in %.1f s",
            final,
            n,
            manifest["documents"],
            manifest["tokens"],
            manifest["built_seconds"],
        )
    else:
        logger.info(
            "token cache %s: built at the same time by another launch, which committed first: using its copy", final
        )


# ------------------------------------------------------------------------------------------- reading


class CachedDocuments:
    """A source's documents from its token cache, by record index: the same outcomes (`Document`s, or the
    `Skipped` with its message) that tokenizing the records gives. A document's tokens and labels are views
    of the memory maps: nothing is read until they are used (collated into a microbatch)."""

    cached = True  # the stream reads it in the training process: loader workers would only copy the views

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.manifest = json.loads((self.directory / MANIFEST).read_text())
        if self.manifest.get("layout") != LAYOUT_VERSION:
            raise UserError(
                f"token cache {self.directory}: layout {self.manifest.get('layout')}, this chattune reads "
                f"{LAYOUT_VERSION}"
            )
        self._ids, self._labels, shard_of, starts, stops, chosen, shared, first, skip, overlong = (
            [] for _ in range(10)
        )
        shard_values: list[dict[str, np.ndarray]] = []
        shard_declared: list[dict[str, np.ndarray]] = []  # per shard: per-token value name: documents declaring it
        self._token_values: list[dict[str, np.ndarray]] = []  # per shard: name: its memory map
        left_out: list[np.ndarray] = []
        self._details: dict[int, str] = {}
        self._left_out_details: dict[int, str] = {}
        documents = 0
        for number, shard in enumerate(sorted(self.directory.glob("shard-*/"))):
            self._ids.append(_memmap(shard / "ids.bin"))
            self._labels.append(_memmap(shard / "labels.bin"))
            with np.load(shard / "index.npz") as index:
                doc_starts = index["doc_starts"]
                starts.append(doc_starts[:-1])
                stops.append(doc_starts[1:])
                shard_of.append(np.full(len(doc_starts) - 1, number, dtype=np.int32))
                chosen.append(index["doc_chosen"])
                shared.append(index["doc_shared"])
                shard_values.append(
                    {k.removeprefix(VALUE_PREFIX): index[k] for k in index.files if k.startswith(VALUE_PREFIX)}
                )
                shard_declared.append(
                    {k.removeprefix(TOKENS_PREFIX): index[k] for k in index.files if k.startswith(TOKENS_PREFIX)}
                )
                first.append(index["record_first_doc"][:-1] + documents)
                skip.append(index["record_skip"])
                overlong.append(index["record_overlong"])
                left_out.append(index["record_left_out"])
                documents += len(doc_starts) - 1
            self._token_values.append(
                {name: _memmap(shard / f"tokens-{name}.bin", np.float32) for name in shard_declared[-1]}
            )
            self._details.update({int(k): v for k, v in json.loads((shard / "skips.json").read_text()).items()})
            self._left_out_details.update(
                {int(k): v for k, v in json.loads((shard / "left_out.json").read_text()).items()}
            )
        self._shard, self._starts, self._stops = np.concatenate(shard_of), np.concatenate(starts), np.concatenate(stops)
        self._chosen, self._shared = np.concatenate(chosen), np.concatenate(shared)
        names = sorted({name for v in shard_values for name in v})
        self._values = {
            name: np.concatenate(
                [np.zeros(0), *(v.get(name, np.full(len(s), np.nan)) for v, s in zip(shard_values, starts))]
            )
            for name in names
        }
        token_names = sorted({name for declared in shard_declared for name in declared})
        self._token_declared = {
            name: np.concatenate(
                [np.zeros(0, bool), *(d.get(name, np.zeros(len(s), bool)) for d, s in zip(shard_declared, starts))]
            )
            for name in token_names
        }
        self._first = np.concatenate([*first, [documents]])
        self._skip, self._overlong = np.concatenate(skip), np.concatenate(overlong)
        self._left_out = np.concatenate(left_out)
        if len(self._skip) != self.manifest["records"]:
            raise UserError(
                f"token cache {self.directory}: {len(self._skip)} records in its shards, its manifest says "
                f"{self.manifest['records']}: delete the directory to rebuild it"
            )

    def __len__(self) -> int:
        return len(self._skip)

    @property
    def num_tokens(self) -> int:
        return int(self.manifest["tokens"])

    def get(self, index: int) -> Document | Skipped:
        return self.get_many([index])[0]

    def get_many(self, indices: Sequence[int]) -> list[Document | Skipped]:
        out: list[Document | Skipped] = []
        for index in indices:
            code = int(self._skip[index])
            if code:
                out.append(Skipped(SKIP_REASONS[code - 1], self._details[int(index)]))
                continue
            first, stop = int(self._first[index]), int(self._first[index + 1])
            for d in range(first, stop):
                shard, start, end, chosen = (
                    int(self._shard[d]),
                    int(self._starts[d]),
                    int(self._stops[d]),
                    int(self._chosen[d]),
                )
                out.append(
                    Document(
                        doc_id=int(index),
                        input_ids=self._ids[shard][start:end],
                        labels=self._labels[shard][start:end],
                        piece=d - first,
                        overlong=OVERLONG_MARKS[self._overlong[index]] if d == first else "",
                        pieces_left_out=int(self._left_out[index]) if d == first else 0,
                        left_out_detail=self._left_out_details.get(int(index), "") if d == first else "",
                        segments=(chosen, end - start - chosen) if chosen else (),
                        shared_prefix=int(self._shared[d]),
                        doc_values={n: float(v[d]) for n, v in self._values.items() if not np.isnan(v[d])},
                        token_values={
                            n: self._token_values[shard][n][start:end]
                            for n, declared in self._token_declared.items()
                            if declared[d]
                        },
                    )
                )
        return out


def _memmap(path: Path, dtype: type = np.int32) -> np.ndarray:
    if path.stat().st_size == 0:  # numpy cannot map an empty file
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")
