"""What a config check finds: problems (the run cannot start) and notes, one line each ("key: message"),
and the helpers that word them and address keys."""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from typing import Any

from chattune.errors import UserError

UNSET = object()  # a value that could not be resolved (already reported)


class ConfigError(UserError, ValueError):
    """A config that cannot run; the message lists every problem, one per line."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join([*self.problems, summary_line(self.problems)]))


@dataclass
class Findings:
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    memory: str | None = (
        None  # the memory estimate's table (`chattune.model.cost.memory`), for a config without problems
    )
    # Keys passed on to a callable that takes any keyword (a Hugging Face config), noted for being close to one of its
    # named parameters: key -> the parameter's key (`model.config.hiden_size` -> `model.config.hidden_size`).
    near_misses: dict[str, str] = field(default_factory=dict)

    def problem(self, key: str, message: str) -> None:
        self.problems.append(f"{key}: {message}")

    def note(self, key: str, message: str) -> None:
        self.notes.append(f"{key}: {message}")

    def has_problem(self, key: str) -> bool:
        """Whether a problem is reported for `key` or a section that holds it."""
        parts = key.split(".")
        prefixes = tuple(".".join(parts[:n]) + ":" for n in range(1, len(parts) + 1))
        return any(line.startswith(prefixes) for line in self.problems)


def summary_line(problems: list[str]) -> str:
    return f"{len(problems)} problem(s)" if problems else "config OK"


def format_report(findings: Findings) -> str:
    memory = [findings.memory] if findings.memory else []
    return "\n".join(
        [*findings.problems, *(f"note: {n}" for n in findings.notes), *memory, summary_line(findings.problems)]
    )


# --- keys and values ---


def join_key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def get_value(values: dict, key: str) -> Any:
    """The value at a dotted key of plain nested dicts; UNSET if it is not there."""
    for name in key.split("."):
        if not isinstance(values, dict) or name not in values:
            return UNSET
        values = values[name]
    return values


def dotted_keys(tree: dict, prefix: str = ""):
    """Every key of nested dicts, dotted, sections included."""
    for name, value in tree.items():
        key = join_key(prefix, str(name))
        yield key
        if isinstance(value, dict):
            yield from dotted_keys(value, key)


# --- wording ---


def first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def show(value: Any) -> str:
    return json.dumps(value) if value is None or isinstance(value, bool) else repr(value)


def closest(name: str, candidates) -> str | None:
    match = difflib.get_close_matches(name, sorted(candidates), n=1, cutoff=0.6)
    return match[0] if match else None


def did_you_mean(name: str, candidates) -> str:
    match = closest(name, candidates)
    return f"; did you mean {match}?" if match else ""
