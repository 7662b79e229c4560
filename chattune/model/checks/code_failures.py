"""What a model's own code failed on, in words, for a refusal.

The start-up checks run the model's own code (transformers') on a miniature, and some models fail there on a packed
row: they subscript an attention mask that packed rows do not carry, or look chattune's attention up in a table of
their own. The exception's text (`'NoneType' object is not subscriptable`) tells a user nothing about the model, so a
refusal names instead where the model's code failed (its function, file and line, and the line itself) and, where
the line says it, what the model needs that chattune does not give it. A refusal raised by chattune itself (an
`UnsupportedModel` from its attention function) already says so, and is passed on as it is; so is the first line of
one that the model's code raises on purpose (a `raise` statement, in transformers or in a module of the model's
own: a message written for its users).
"""

from __future__ import annotations

import linecache
import sysconfig
import traceback
from pathlib import Path

from chattune.errors import UnsupportedModel

_TRANSFORMERS = "transformers"
_STDLIB = sysconfig.get_paths()["stdlib"]


def _in_stdlib(filename: str) -> bool:
    return filename.startswith(_STDLIB) and "site-packages" not in Path(filename).parts


def model_frame(error: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of transformers' code (the model's) in `error`'s traceback."""
    frames = [
        frame for frame in traceback.extract_tb(error.__traceback__) if _TRANSFORMERS in Path(frame.filename).parts
    ]
    return frames[-1] if frames else None


def _raising_frame(error: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of `error`'s traceback outside torch and Python's own library: the model's code (its
    modules, transformers' or its own) or chattune's."""
    frames = [
        frame
        for frame in traceback.extract_tb(error.__traceback__)
        if "torch" not in Path(frame.filename).parts and not _in_stdlib(frame.filename)
    ]
    return frames[-1] if frames else None


def _statement(frame: traceback.FrameSummary) -> str:
    """The statement the failing line ends (a call spread over lines ends in `).to(...)`), joined on one line: the
    failing line and as many lines before it as close their parentheses (at most 12)."""
    lines = [(frame.line or "").strip()]
    number = frame.lineno or 0
    while (text := " ".join(lines)).count(")") > text.count("(") and number > 1 and len(lines) < 12:
        number -= 1
        lines.insert(0, linecache.getline(frame.filename, number).strip())
    return " ".join(lines)


def _needs(line: str, error: BaseException, attention_name: str) -> str:
    if "mask" in line:
        return (
            "it builds or reads an attention mask there, and chattune's packed rows carry none (the documents of a row "
            "are kept apart by their boundaries, cu_seqlens, not by a mask)"
        )
    if isinstance(error, KeyError) and attention_name in str(error):
        return (
            "it picks its attention from a table of its own implementations, which does not hold chattune's packed "
            "attention, so its layers cannot be kept to each document"
        )
    if isinstance(error, RuntimeError) and "dtype" in str(error):
        return f"it combines tensors of different dtypes there ({type(error).__name__})"
    return f"its code does not run on a packed row there ({type(error).__name__})"


def model_code_failure(error: BaseException, attention_name: str) -> str:
    """Where and why the model's own code failed, for a refusal (module docstring)."""
    if isinstance(error, UnsupportedModel):
        return str(error).rstrip(".")
    raised = _raising_frame(error)
    if raised is not None and (raised.line or "").strip().startswith("raise"):  # a refusal written for users
        where = "/".join(Path(raised.filename).parts[-2:])
        return f"refused in {raised.name} ({where}): {str(error).strip().splitlines()[0].rstrip('.')}"
    frame = model_frame(error)
    if frame is None:  # nothing of the model's in the traceback: torch or Python, named by the exception's type
        return f"its forward fails ({type(error).__name__})"
    file = "/".join(Path(frame.filename).parts[-2:])
    line = _statement(frame)
    return (
        f"its code fails in {frame.name} ({file}, line {frame.lineno}: `{line}`): {_needs(line, error, attention_name)}"
    )


def where_it_fails(error: BaseException) -> str:
    """Where the model's code raised `error` and what it said, in one line: for a failure of the model's own path
    (stock transformers), where the message is the model's to show."""
    frame = model_frame(error)
    message = (str(error).strip().splitlines() or [""])[0][:160]
    if frame is None:
        return f"{type(error).__name__}: {message}"
    file = "/".join(Path(frame.filename).parts[-2:])
    return f"in {frame.name} ({file}, line {frame.lineno}: `{_statement(frame)}`): {type(error).__name__}: {message}"
