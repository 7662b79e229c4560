"""The package's layers: each module imports only its own layer and those below it (lazy imports inside
functions included), so the architecture the tree shows is the one the code has."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import PROJECT_ROOT

PACKAGE = PROJECT_ROOT / "chattune"

# Lowest first. The base: what every layer may use (errors, logging, files, the hub, signals, collectives, and
# the config's schema and paths). A recipe sits above them all and is no module of the package.
LAYERS = [
    (
        "chattune",
        "chattune.errors",
        "chattune.log",
        "chattune.files",
        "chattune.faults",
        "chattune.hf_layout",
        "chattune.hub",
        "chattune.interrupts",
        "chattune.moved",
        "chattune.distributed",
        "chattune.config",
    ),
    ("chattune.data",),
    ("chattune.parallel",),
    ("chattune.model",),
    ("chattune.objectives",),
    ("chattune.rl",),  # a recipe's own steps: rollouts of the policy, scored (above the objectives it feeds)
    ("chattune.checkpoint",),
    ("chattune.train",),
    ("chattune.launch",),
    ("chattune.cli",),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    """The layer of a module: that of the longest prefix listed."""
    best = max(
        (
            (len(prefix), index)
            for index, prefixes in enumerate(LAYERS)
            for prefix in prefixes
            if module == prefix or module.startswith(prefix + ".")
        ),
        default=None,
    )
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best[1]


def chattune_imports(path: Path) -> list[str]:
    """Every chattune module `path` imports, anywhere in it (`from chattune import x` imports chattune.x)."""
    imported = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            imported += [alias.name for alias in node.names if alias.name.split(".")[0] == "chattune"]
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module
            and node.module.split(".")[0] == "chattune"
        ):
            if node.module == "chattune":
                imported += [f"chattune.{alias.name}" for alias in node.names]
            else:
                imported.append(node.module)
    return imported


def upward_imports() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = module_name(path)
        for imported in chattune_imports(path):
            if layer_of(imported) > layer_of(importer):
                found.append(f"{importer} (layer {layer_of(importer)}) imports {imported} (layer {layer_of(imported)})")
    return found


def test_no_module_imports_a_higher_layer():
    assert upward_imports() == []


def test_the_check_finds_an_upward_import(tmp_path, monkeypatch):
    """The check itself can fail: a data module that imports the training loop is reported."""
    package = tmp_path / "chattune"
    (package / "data").mkdir(parents=True)
    (package / "train").mkdir()
    (package / "__init__.py").write_text("")
    (package / "data" / "stream.py").write_text("def f():\n    from chattune.train.loop import train\n")
    (package / "train" / "loop.py").write_text("from chattune.data import stream\n")
    monkeypatch.setitem(globals(), "PACKAGE", package)
    assert upward_imports() == ["chattune.data.stream (layer 1) imports chattune.train.loop (layer 7)"]


# `chattune export` reads a checkpoint: its format and its run state's parts, never the loop.
READS_CHECKPOINTS = {"chattune.cli.export"}


def test_the_command_line_tools_do_not_import_the_training_loop():
    """`chattune validate` and `inspect` read the recipes' documents from the data layer, not from train/; only the
    export command reads the checkpoint modules."""
    cli = [
        (module_name(path), imported)
        for path in sorted((PACKAGE / "cli").rglob("*.py"))
        for imported in chattune_imports(path)
        if imported.startswith("chattune.train")
        or (imported.startswith("chattune.checkpoint") and module_name(path) not in READS_CHECKPOINTS)
    ]
    assert cli == []
