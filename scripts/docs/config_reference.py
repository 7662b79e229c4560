"""docs/configuration.md, generated from the config schema (`chattune.config.schema`): every key of every
recipe with its type, default, meaning, the values it may take and what a resumed run may do with it.

    python scripts/docs/config_reference.py           # print the page
    python scripts/docs/config_reference.py --write   # write docs/configuration.md

tests/docs/test_config_reference.py fails when the page is not this script's output: a key added, removed or
redescribed in the schema without running `--write`.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the project: scripts/docs/ is two below it
sys.path.insert(0, str(ROOT))

from chattune.config.schema import SCHEMAS, schema_fields, section_type, type_options  # noqa: E402

PAGE = ROOT / "docs" / "configuration.md"
RECIPE_FILES = {
    "sft": "recipes/sft.py",
    "dpo": "recipes/dpo.py",
    "reward": "recipes/reward.py",
    "kto": "recipes/kto.py",
    "grpo": "recipes/grpo.py",
}
RESUME = {
    None: "refused unless `resume_allow_changes` names it",
    "free": "accepted",
    "horizon": "accepted, with a warning (the schedule is recomputed)",
    "numerics": "accepted, with a note (the same updates)",
}


def type_name(hint: Any) -> str:
    options, nullable = type_options(hint)
    names = []
    for option in options:
        origin = typing.get_origin(option)
        if origin is not None:
            args = ", ".join(type_name(a) for a in typing.get_args(option))
            names.append(f"{getattr(origin, '__name__', str(origin))}[{args}]")
        else:
            names.append(getattr(option, "__name__", str(option)))
    return " \\| ".join(names + (["null"] if nullable else []))


def shown(value: Any) -> str:
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    return f"`{value}`".replace("|", "\\|")


def rows(section: type, instance: Any, prefix: str = "", resume_above: str | None = None):
    """(key, type, default, meaning) of every plain key under `section`, its nested sections flattened; a key
    without a `resume` rule of its own follows its section's."""
    for name, (hint, metadata) in schema_fields(section).items():
        key = f"{prefix}.{name}" if prefix else name
        value = getattr(instance, name)
        resume = metadata.get("resume") or resume_above
        nested = section_type(hint)
        if nested is not None and value is not None and not metadata.get("open_section"):
            yield from rows(nested, value, key, resume)
            continue
        if nested is not None and value is not None:  # an open section: any key, these named
            yield key, nested.__name__, "a section", metadata.get("help", "") + " (any key)", RESUME[resume]
            yield from rows(nested, value, key, resume)
            continue
        if nested is not None:  # a section that is off by default: its keys' defaults once it is set
            yield (
                key,
                f"{nested.__name__} \\| null",
                "`null`",
                metadata.get("help", "") + " (null: off)",
                RESUME[resume],
            )
            yield from rows(nested, nested(), key, resume)
            continue
        meaning = metadata.get("help", "")
        if metadata.get("choices"):
            meaning += " (one of " + ", ".join(f"`{c}`" for c in metadata["choices"]) + ")"
        if metadata.get("at_least") is not None:
            meaning += f" (at least {metadata['at_least']})"
        if nested is not None:
            default = "a section" if value is not None else "`null`"
            type_text = nested.__name__ + (" \\| null" if type_options(hint)[1] else "")
        else:
            default = shown(dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value)
            type_text = type_name(hint)
        yield key, type_text, default, meaning, RESUME[resume]


def escaped(text: str) -> str:
    """A table cell's text: its own | escaped."""
    return text.replace("|", "\\|")


def page() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from the config schema (`chattune/config/schema.py`) by `python scripts/docs/config_reference.py "
        "--write`; `tests/docs/test_config_reference.py` fails when it is stale. Set a key on the command line "
        "(`key=value`, a nested one as `section.key=value`) or in a config file; `chattune validate` checks both "
        "against this schema. *On resume*: what a resumed run does when the key changed since its checkpoint.",
        "",
    ]
    base = None
    for recipe, schema in SCHEMAS.items():
        table = list(rows(schema, schema()))
        if base is None:
            lines += [f"## {recipe}: `{RECIPE_FILES[recipe]}` (every recipe's keys)", ""]
            shown_rows = table
            base = {row[0]: row for row in table}
        else:
            shown_rows = [row for row in table if base.get(row[0]) != row]
            lines += [
                f"## {recipe}: `{RECIPE_FILES[recipe]}`",
                "",
                f"The keys of sft above, and these, which {recipe} adds or sets otherwise:",
                "",
            ]
        lines += ["| key | type | default | meaning | on resume |", "|---|---|---|---|---|"]
        lines += [
            f"| `{key}` | {type_text} | {default} | {escaped(meaning)} | {resume} |"
            for key, type_text, default, meaning, resume in shown_rows
        ]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    text = page()
    if "--write" in sys.argv[1:]:
        PAGE.parent.mkdir(exist_ok=True)
        PAGE.write_text(text)
    else:
        print(text)
