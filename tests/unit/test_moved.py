"""chattune/moved.py: a recipe copied before a module moved imports the old name and gets one error that names the
new import; each new place exists and each old one is gone."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from chattune.moved import MOVED
from conftest import PROJECT_ROOT

ROOT = PROJECT_ROOT


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_name_says_where_it_went(old):
    new = MOVED[old]
    assert not (ROOT / (old.replace(".", "/") + ".py")).exists() and (ROOT / (new.replace(".", "/") + ".py")).is_file()
    importlib.import_module(new)
    with pytest.raises(ModuleNotFoundError, match=f"{old} moved to {new}"):
        importlib.import_module(old)


@pytest.mark.launch
def test_a_copied_recipes_old_import_fails_with_the_new_one_named(tmp_path):
    """As a user's script meets it: `from chattune.model.fsdp import shard_model` in a fresh process."""
    done = subprocess.run(
        [sys.executable, "-c", "from chattune.model.fsdp import shard_model"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode == 1
    assert "chattune.model.fsdp moved to chattune.parallel.fsdp" in done.stderr
    assert "from chattune.parallel import fsdp" in done.stderr
