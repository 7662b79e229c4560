"""Replacing a run's files without losing what they held: what a launch would overwrite is set aside as
`*.abandoned` (never picked up by resume=auto, never pruned by keep_last_n), and a file rewritten in full
goes through a temporary file and one rename, so a crash leaves the old or the new content, never half."""

from __future__ import annotations

import os
from pathlib import Path

ABANDONED = ".abandoned"


def aside_name(path: Path) -> Path:
    """`path.abandoned`, or `.abandoned.2`, ... if taken."""
    target, number = path.with_name(path.name + ABANDONED), 1
    while target.exists():
        number += 1
        target = path.with_name(f"{path.name}{ABANDONED}.{number}")
    return target


def set_aside(path: Path) -> Path:
    """Rename `path` to `*.abandoned`: kept, but never resumed, pruned or overwritten."""
    target = aside_name(path)
    os.rename(path, target)
    return target


def write_atomically(path: Path, data: bytes) -> None:
    """Replace `path`'s content with `data` through a temporary file in the same directory and one rename."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    with open(partial, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)
