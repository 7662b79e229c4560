"""What a run's training data is, as a resume compares it: a cheap fingerprint of every data and
tokenizer file, and a hash of every record of the JSON/JSONL training files, so that a file edited in
place can be compared record by record (a fixed record is named, and can be accepted alone)."""

from __future__ import annotations

import hashlib
import io
import json
import logging
from pathlib import Path

import numpy as np

from chattune.config.typed import config_dict
from chattune.data.ingest.formats import SourceSpec

logger = logging.getLogger(__name__)

RECORD_HASHES = "record_hashes.npz"  # in a checkpoint: one hash per record of each JSON/JSONL training file
_EDGE_BYTES = 1 << 20


def file_fingerprint(path: Path) -> str:
    """Size and a hash of the first and last MiB: catches edits, appends and truncation without reading
    a large file whole (which would make start-up time grow with the data)."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(_EDGE_BYTES))
        if size > _EDGE_BYTES:
            f.seek(max(size - _EDGE_BYTES, _EDGE_BYTES))
            digest.update(f.read())
    return f"{size}:{digest.hexdigest()[:16]}"


def data_file_fingerprints(sources, tokenizer_path: str) -> dict[str, str]:
    """Fingerprints of the files behind data sources (config entries) and of the tokenizer's files."""
    files: dict[str, str] = {}
    for entry in config_dict(sources):
        path = Path(SourceSpec.from_config(entry).path)
        if path.is_file():
            files[str(path)] = file_fingerprint(path)
        elif path.is_dir():  # a dataset directory: every file in it
            files.update({str(p): file_fingerprint(p) for p in sorted(path.rglob("*")) if p.is_file()})
        else:  # a hub dataset id: its name only (its content is the hub's to version)
            files[str(path)] = "hub dataset"
    tokenizer_dir = Path(tokenizer_path)
    if tokenizer_dir.is_dir():
        files.update({str(p): file_fingerprint(p) for p in sorted(tokenizer_dir.iterdir()) if p.is_file()})
    return files


def record_files(sources) -> list[str]:
    """The training files compared record by record on resume: local JSON and JSONL files."""
    paths = (Path(SourceSpec.from_config(entry).path) for entry in config_dict(sources))
    return [str(path) for path in paths if path.suffix in (".jsonl", ".json") and path.is_file()]


def _hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def record_hashes(path: Path) -> tuple[np.ndarray, np.ndarray | None] | None:
    """A 64-bit hash of each record of a JSONL file (each non-blank line, as `RecordSource` reads them)
    or a JSON file (each element of its list), with each JSONL record's line number; None if the file
    cannot be read as records."""
    try:
        if path.suffix == ".jsonl":
            hashes, lines = [], []
            with open(path, "rb") as f:
                for number, line in enumerate(f, 1):
                    if line.strip():
                        hashes.append(_hash(line.rstrip(b"\r\n")))
                        lines.append(number)
            return np.array(hashes, dtype=np.uint64), np.array(lines, dtype=np.int64)
        records = json.loads(path.read_text(encoding="utf-8"))
        return np.array([_hash(json.dumps(r, sort_keys=True).encode()) for r in records], dtype=np.uint64), None
    except (OSError, ValueError, TypeError):
        return None


_record_hash_cache: dict[tuple[str, str], np.ndarray] = {}


def record_hashes_file(fingerprint: dict) -> bytes | None:
    """The per-record hashes of the run's JSON/JSONL training files, as the bytes of an .npz, for rank 0
    to write into each checkpoint. Hashed once per file (and again only if it changes); a file that
    changed since the run started is left out (its records are no longer those the run trained on)."""
    arrays = {}
    for number, name in enumerate(fingerprint.get("record_files", [])):
        path = Path(name)
        if not path.is_file() or file_fingerprint(path) != fingerprint["files"].get(name):
            logger.warning("%s changed since the run started: the checkpoint cannot name its changed records", name)
            continue
        key = (name, fingerprint["files"][name])
        if key not in _record_hash_cache:
            hashed = record_hashes(path)
            if hashed is None:
                continue
            _record_hash_cache[key] = hashed[0]
        arrays[f"hashes_{number}"] = _record_hash_cache[key]
        arrays[f"path_{number}"] = np.array(name)
    if not arrays:
        return None
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def saved_record_hashes(directory: Path) -> dict[str, np.ndarray]:
    """The per-record hashes a checkpoint holds, by file path ({} for none)."""
    path = directory / RECORD_HASHES
    if not path.is_file():
        return {}
    with np.load(path) as saved:
        return {
            str(saved[name]): saved[name.replace("path_", "hashes_")]
            for name in saved.files
            if name.startswith("path_")
        }
