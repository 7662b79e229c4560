"""`tokenizer.chat_template`: the chat template that renders every record, in place of the tokenizer's own.

The value is read by its text alone, in this order:

- inline Jinja: it holds `{{` or `{%`;
- a template chattune ships: a bare word (letters, digits, `_`, `-`), e.g. `chatml` or `llama3`, one of the
  files in chattune/assets/chat_templates (a file in the working directory with such a name is written `./NAME`);
- otherwise the path of a template file, which must exist (relative: to where you launch).

`null` keeps the tokenizer's own template. No transformers import here: `chattune validate` checks the value
without loading a tokenizer; the checks that need one (`missing_markers`) take it as an argument.
"""

from __future__ import annotations

import difflib
import hashlib
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from chattune.errors import UserError

KEY = "tokenizer.chat_template"
SHIPPED_DIR = Path(__file__).resolve().parents[2] / "assets" / "chat_templates"
_BARE_WORD = re.compile(r"[A-Za-z0-9_-]+")
# The special-token markers a template writes (`<|im_end|>`, `<|eot_id|>`): each must be one token of the
# tokenizer, or the model would learn its turn boundaries as pieces of ordinary text.
_MARKER = re.compile(r"<\|[^<>|\s]+\|>")


class ChatTemplateSettingError(UserError, ValueError):
    """A tokenizer.chat_template that names no template, or one the tokenizer cannot write."""


@dataclass(frozen=True)
class ChosenTemplate:
    """A tokenizer.chat_template resolved: its kind ("shipped", "inline" or "file") and its Jinja text."""

    setting: str
    kind: str
    text: str

    @property
    def label(self) -> str:
        """How messages name it: the key, and the value (an inline template is not repeated)."""
        return f"{KEY}: the inline template" if self.kind == "inline" else f"{KEY}: {self.setting!r}"

    @property
    def fingerprint(self) -> str:
        """What a resume and the reference cache compare: the setting and a hash of the text it gave (a file or a
        shipped template edited under the same name is another template)."""
        digest = hashlib.sha256(self.text.encode()).hexdigest()[:16]
        shown = "inline Jinja" if self.kind == "inline" else self.setting
        return f"{shown} (sha256 {digest})"


@cache
def shipped_names() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in SHIPPED_DIR.glob("*.jinja")))


def template_kind(value: str) -> str:
    """ "inline", "shipped" or "file", decided as the module docstring says."""
    if "{{" in value or "{%" in value:
        return "inline"
    return "shipped" if _BARE_WORD.fullmatch(value) else "file"


def _forms() -> str:
    return (
        f"shipped: {', '.join(shipped_names())}; otherwise the path of a template file (./NAME for one in the "
        "working directory) or inline Jinja, holding {{ or {%"
    )


def read_chat_template(value: str) -> ChosenTemplate:
    """The template a tokenizer.chat_template value names; a ChatTemplateSettingError naming the key, the value
    and the forms it may take otherwise."""
    if not isinstance(value, str) or not value.strip():
        raise ChatTemplateSettingError(f"{KEY}: {value!r} is not a template ({_forms()}; null: the tokenizer's own)")
    kind = template_kind(value)
    if kind == "inline":
        return ChosenTemplate(value, kind, value)
    if kind == "shipped":
        if value not in shipped_names():
            close = difflib.get_close_matches(value, shipped_names(), n=1)
            raise ChatTemplateSettingError(
                f"{KEY}: {value!r} is not a template chattune ships"
                f"{f'; did you mean {close[0]}?' if close else ''} ({_forms()})"
            )
        return ChosenTemplate(value, kind, (SHIPPED_DIR / f"{value}.jinja").read_text(encoding="utf-8"))
    path = Path(value).expanduser()
    if not path.is_file():
        state = "is not a file" if path.exists() else "does not exist"
        raise ChatTemplateSettingError(f"{KEY}: template file {value!r} {state} ({_forms()})")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ChatTemplateSettingError(f"{KEY}: template file {value!r} cannot be read: {error}") from error
    if not text.strip():
        raise ChatTemplateSettingError(f"{KEY}: template file {value!r} is empty")
    return ChosenTemplate(value, kind, text)


def template_problem(value) -> str | None:
    """For `chattune validate`: why a tokenizer.chat_template value names no template (without the key), or None."""
    if value is None:
        return None
    try:
        read_chat_template(value)
    except ChatTemplateSettingError as error:
        return str(error).removeprefix(f"{KEY}: ")
    return None


def template_fingerprint(value: str | None) -> str | None:
    """`ChosenTemplate.fingerprint` of a setting (None for null: the tokenizer's files are fingerprinted);
    one that cannot be read is named as such (its error is reported where the template is loaded)."""
    if value is None:
        return None
    try:
        return read_chat_template(value).fingerprint
    except ChatTemplateSettingError:
        return f"{value} (unreadable)"


def missing_markers(tokenizer, text: str) -> list[str]:
    """The `<|...|>` markers of a template text that the tokenizer does not encode as one token: neither one of its
    added tokens (which text is always split at) nor a text that it encodes as one id."""
    added = {token.content for token in tokenizer.added_tokens_decoder.values()}
    markers = sorted(set(_MARKER.findall(text)), key=text.index)
    return [m for m in markers if m not in added and len(tokenizer(m, add_special_tokens=False)["input_ids"]) != 1]


def fitting_shipped_templates(tokenizer) -> list[str]:
    """The shipped templates whose markers are all tokens of `tokenizer`."""
    return [name for name in shipped_names() if not missing_markers(tokenizer, read_chat_template(name).text)]
