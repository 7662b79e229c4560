"""The manual: README short enough for one screen or two, every page of docs/ linked from it, every relative link and
anchor of README and docs/ pointing at something that exists, and the generated layout table current."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

from conftest import PROJECT_ROOT

PAGES = [PROJECT_ROOT / "README.md", *sorted((PROJECT_ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of the headings of `path` (outside code blocks)."""
    found, in_code = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and re.match(r"#{1,6} ", line):
            title = line.lstrip("#").strip().lower().replace("`", "")
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def test_readme_fits_a_screen_or_two_and_links_every_page():
    readme = (PROJECT_ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    linked = {target.split("#")[0] for target in LINK.findall(readme)}
    assert {f"docs/{page.name}" for page in PAGES[1:]} <= linked


@pytest.mark.parametrize("page", PAGES, ids=[page.name for page in PAGES])
def test_every_relative_link_and_anchor_exists(page):
    for target in LINK.findall(page.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name}: {target} (no such file)"
        if anchor:
            assert anchor in anchors(linked), f"{page.name}: {target} (no such heading)"


def test_the_layout_table_is_the_real_tree():
    # Regenerate with `python scripts/docs/readme_layout.py --write` after adding, moving or renaming a module.
    layout = runpy.run_path(str(PROJECT_ROOT / "scripts" / "docs" / "readme_layout.py"))
    page = (PROJECT_ROOT / "docs" / "layout.md").read_text()
    assert layout["layout_table"]() in page
    assert layout["replace_table"](page, layout["layout_table"]()) == page
