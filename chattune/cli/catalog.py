"""`chattune ls` and `chattune cp`: the shipped recipes and configs, each described by its own file.

A recipe's description is the first line of its module docstring, a config's the first sentence of the
comment at the top of the YAML, so the listing cannot drift from the files.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from chattune.config.paths import CONFIG_DIR, RECIPES_DIR
from chattune.errors import UserError

NO_DESCRIPTION = "(no description)"


class CatalogError(UserError):
    """A name that is not shipped, or a copy that would overwrite a file."""


@dataclass(frozen=True)
class Entry:
    kind: str  # "recipe" or "config"
    name: str  # "sft", "sft/tiny"
    path: Path
    description: str


def recipes() -> list[Entry]:
    return [Entry("recipe", path.stem, path, recipe_description(path)) for path in sorted(RECIPES_DIR.glob("*.py"))]


def configs() -> list[Entry]:
    return [
        Entry("config", path.relative_to(CONFIG_DIR).with_suffix("").as_posix(), path, config_description(path))
        for path in sorted(CONFIG_DIR.rglob("*.yaml"))
    ]


def recipe_description(path: Path) -> str:
    docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    return docstring.strip().splitlines()[0] if docstring and docstring.strip() else NO_DESCRIPTION


def config_description(path: Path) -> str:
    """The first sentence of the comment block that opens the file (`# @package` directives skipped); the
    block ends at a blank comment line or an indented one (a command example)."""
    words: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        text = line[1:]
        if text.strip().startswith("@package"):
            continue
        if not text.strip() or text.startswith("  "):
            break
        words.append(text.strip())
    paragraph = " ".join(words)
    # A sentence ends at a full stop followed by a capital or a backtick ("e.g. /models" does not end one).
    sentence = re.split(r"(?<=\.)\s+(?=[A-Z`])", paragraph, maxsplit=1)[0].rstrip(":")
    return sentence or NO_DESCRIPTION


def listing() -> str:
    """`chattune ls`: one line per recipe and per config."""
    entries = recipes() + configs()
    width = max((len(e.name) for e in entries), default=0) + 2
    lines = [f"recipes ({RECIPES_DIR}):"]
    lines += [f"  {e.name:<{width}}{e.description}" for e in entries if e.kind == "recipe"]
    lines += ["", f"configs ({CONFIG_DIR}; choose one with --config-name NAME):"]
    lines += [f"  {e.name:<{width}}{e.description}" for e in entries if e.kind == "config"]
    lines += ["", "copy one to edit it: chattune cp NAME DEST"]
    return "\n".join(lines)


def find(name: str) -> Entry:
    """A recipe or config by name; `sft.py` and `sft/tiny.yaml` are accepted too."""
    wanted = name.removesuffix(".py").removesuffix(".yaml").strip("/")
    entries = recipes() + configs()
    for entry in entries:
        if entry.name == wanted:
            return entry
    raise CatalogError(f"no recipe or config named {name!r}; shipped: {', '.join(e.name for e in entries)}")


def copy(name: str, dest: str | Path, force: bool = False) -> tuple[Path, list[str]]:
    """Copy a shipped recipe or config to `dest`: a file, or a directory (existing, or named with a trailing
    separator) to keep the file name in. Returns the written path and notes for the user."""
    entry = find(name)
    as_directory = Path(dest).is_dir() or str(dest).endswith(("/", os.sep))
    target = Path(dest) / entry.path.name if as_directory else Path(dest)
    if target.is_dir():
        raise CatalogError(f"{target} is a directory")
    if target.exists() and not force:
        raise CatalogError(f"{target} already exists (use --force to overwrite it)")
    target.parent.mkdir(parents=True, exist_ok=True)
    if entry.kind == "recipe":
        shutil.copyfile(entry.path, target)
        return target, [
            f"run it: torchrun --nproc_per_node N {target} [key=value ...]  (or python {target})",
            "  with your own configs: --config-path DIR --config-name NAME",
        ]
    text, notes = absolute_defaults(entry.path.read_text(encoding="utf-8"), entry.name.rpartition("/")[0])
    target.write_text(text, encoding="utf-8")
    recipe = recipe_of(entry.name)
    notes.append(
        f"use it: python {recipe if recipe is not None and recipe.exists() else 'RECIPE.py'} --config-path "
        f"{target.parent.resolve()} --config-name {target.stem} [key=value ...]"
    )
    group = entry.name.rpartition("/")[0]
    if recipe is not None and group and target.parent.name != group:
        # Out of its group's directory, `chattune validate` would take the kind of the config it builds on
        # (dpo/tiny builds on sft/tiny): the recipe says it instead.
        notes.append(
            f"check it: chattune validate --recipe {recipe} --config-dir {target.parent.resolve()} {target.stem}"
        )
    return target, notes


def recipe_of(config_name: str) -> Path | None:
    """The shipped recipe that runs a shipped config: its recipe kind's (`kind_of_config`); None for a config that
    is no recipe's (peft/lora: a choice for one)."""
    from chattune.launch.recipe_kinds import RecipeKindError, kind_of_config

    try:
        return RECIPES_DIR / kind_of_config(config_name).kind.recipe_file
    except RecipeKindError:
        return None


def absolute_defaults(text: str, group: str) -> tuple[str, list[str]]:
    """The config's text with relative defaults entries of its group made absolute (`- tiny` in sft/ becomes
    `- /sft/tiny`), so that it composes the same outside configs/sft/; and notes on what changed or could not."""
    if not group:
        return text, []
    lines = text.splitlines(keepends=True)
    notes: list[str] = []
    in_defaults = False
    for index, line in enumerate(lines):
        if re.match(r"defaults\s*:\s*(#.*)?$", line.rstrip("\n")):
            in_defaults = True
            continue
        if not in_defaults or not line.strip() or line.lstrip().startswith("#"):
            continue
        if not line[0].isspace() and not line.startswith("-"):
            break  # the next top-level key: the defaults list is over
        entry = re.match(r"(\s*-\s+)([\w.\-]+(?:/[\w.\-]+)*)(\s*(?:#.*)?)$", line.rstrip("\n"))
        if entry and entry.group(2) != "_self_":
            lines[index] = f"{entry.group(1)}/{group}/{entry.group(2)}{entry.group(3)}" + line[len(line.rstrip("\n")) :]
            notes.append(
                f"defaults entry {entry.group(2)!r} (relative to {group}/) written as '/{group}/{entry.group(2)}'"
            )
    result = "".join(lines)
    defaults = OmegaConf.create(result).get("defaults") or []
    for item in OmegaConf.to_container(defaults) if OmegaConf.is_list(defaults) else []:
        key = item if isinstance(item, str) else next(iter(item), "")
        if key != "_self_" and not key.startswith(("/", "override /", "optional /", "override optional /")):
            notes.append(
                f"warning: defaults entry {item!r} is relative to {group}/; make it absolute "
                f"(/{group}/...) for the copy to compose the same"
            )
    return result, notes
