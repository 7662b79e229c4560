"""The package tree's table (docs/layout.md), generated from the real tree: one line per package of chattune/,
with the first line of its `__init__` docstring and its modules.

    python scripts/docs/readme_layout.py           # print the table
    python scripts/docs/readme_layout.py --write   # replace the table in docs/layout.md

tests/docs/test_docs.py checks that docs/layout.md's table is this script's output.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the project: scripts/docs/ is two below it
PACKAGE = ROOT / "chattune"
FIXED_ROWS = {  # what is not a package of chattune/, before and after the packages
    "before": [
        (
            "`recipes/sft.py`, `recipes/dpo.py`, `recipes/reward.py`, `recipes/kto.py`, `recipes/grpo.py`",
            "the SFT, DPO, reward-model, KTO and GRPO recipes: flat, copyable Hydra apps",
        ),
        (
            "`configs/sft/`, `configs/dpo/`, `configs/kto/`, `configs/reward/`, `configs/grpo/`, `configs/peft/`",
            "each recipe's `tiny` (`sft/tiny`: the default) and `local_model` (a real local model) configs; "
            "`peft/lora`, `peft/qlora`",
        ),
    ],
    "after": [
        (
            "`hydra_plugins/chattune_searchpath/`",
            "puts the shipped configs on Hydra's search path, for users' own config directories",
        ),
        (
            "`scripts/bench/`",
            "benchmarks (BENCHMARKS.md gives each result with its command); `what_fits.py`, the memory estimate",
        ),
        (
            "`scripts/gpu_check/`",
            "the GPU check, a package by concern: `python scripts/gpu_check` (docs/gpu-check.md)",
        ),
        (
            "`scripts/gpu_carry.py`",
            "the folder that takes the GPU check to a GPU machine without internet, and its `run.sh` "
            "(`gpu_carry_run.sh`); `gpu_precision_resume.sh`, the precisions and exact resume on one GPU",
        ),
        (
            "`scripts/parity/`",
            "chattune against TRL (`compare_trl.py`), the oldest supported versions (`check_oldest_versions.sh`)",
        ),
        ("`scripts/demo/`", "the demo chats' generator, the demo accuracy, docs/demo.md's figures"),
        ("`scripts/docs/`", "the generators of docs/configuration.md and of this table"),
        ("`BENCHMARKS.md`", "measured throughput and the commands that produced it"),
        (
            "`docs/`",
            "the manual, a page per subject; the configuration reference (`configuration.md`) and this table are generated",
        ),
    ],
}
BEGIN, END = "| path | what |\n|---|---|\n", "\n\n"


def first_docstring_line(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return doc.split("\n\n")[0].replace("\n", " ").strip()


def modules(directory: Path) -> str:
    return ", ".join(f"`{p.stem}`" for p in sorted(directory.glob("*.py")) if p.name != "__init__.py")


def layout_table() -> str:
    rows = list(FIXED_ROWS["before"])
    top = sorted(p for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    rows.append(
        (
            "`chattune/`",
            "what every package uses: "
            + ", ".join(f"`{p.stem}` ({first_docstring_line(p).split(':')[0].split('.')[0].lower()})" for p in top),
        )
    )
    for package in sorted(p.parent for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE):
        rows.append(
            (
                f"`chattune/{package.relative_to(PACKAGE).as_posix()}/`",
                f"{first_docstring_line(package / '__init__.py')} Modules: {modules(package)}",
            )
        )
    rows += FIXED_ROWS["after"]
    return BEGIN + "\n".join(f"| {path} | {what} |" for path, what in rows)


LAYOUT = ROOT / "docs" / "layout.md"


def replace_table(text: str, table: str) -> str:
    """docs/layout.md's `text` with its (first) table replaced by `table`."""
    start = text.index(BEGIN)
    end = text.find(END, start)
    return text[:start] + table + (text[end:] if end != -1 else "\n")


if __name__ == "__main__":
    table = layout_table()
    if "--write" in sys.argv[1:]:
        LAYOUT.write_text(replace_table(LAYOUT.read_text(), table))
    else:
        print(table)
