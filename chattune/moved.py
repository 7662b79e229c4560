"""Modules that moved in a reshaping of the package, and where to: a recipe copied before the move imports the old
name and gets one error naming the new import (`MovedModules`, installed by `chattune/__init__.py`), not a bare
"No module named". The table grows by one line per move; nothing is kept at the old place."""

from __future__ import annotations

import importlib.abc
import sys

# old module -> new module (2026-12: the parallelisms out of model/ into parallel/)
MOVED = {
    "chattune.model.fsdp": "chattune.parallel.fsdp",
    "chattune.model.tensor_parallel": "chattune.parallel.tensor_parallel",
    "chattune.model.sequence_parallel": "chattune.parallel.sequence_parallel",
    "chattune.model.vocab_parallel": "chattune.parallel.vocab_parallel",
    "chattune.model.context_parallel": "chattune.parallel.context_parallel",
    "chattune.model.offload": "chattune.parallel.offload",
    # (2026-12: the run's state on disk out of train/ into checkpoint/; the feed beside the data it assembles)
    "chattune.train.checkpoint": "chattune.checkpoint.checkpoint",
    "chattune.train.snapshot": "chattune.checkpoint.snapshot",
    "chattune.train.staging": "chattune.checkpoint.staging",
    "chattune.train.resume": "chattune.checkpoint.resume",
    "chattune.train.run_state": "chattune.checkpoint.run_state",
    "chattune.train.output_dir": "chattune.checkpoint.output_dir",
    "chattune.train.faults": "chattune.faults",
    "chattune.train.feed": "chattune.data.feed",
}


class MovedModules(importlib.abc.MetaPathFinder):
    """A finder that knows only the old names of MOVED and answers each with a ModuleNotFoundError naming the
    new one."""

    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        raise ModuleNotFoundError(
            f"{fullname} moved to {new}: import it from there (`from {new.rsplit('.', 1)[0]} import "
            f"{new.rsplit('.', 1)[1]}`); see docs/layout.md",
            name=fullname,
        )


def install() -> None:
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(MovedModules())
