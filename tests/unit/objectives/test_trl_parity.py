"""chattune's ORPO loss (and its parts), its reward model's loss and accuracy, and its KTO loss, reference point z,
rewards and training-step gradients equal TRL's to 1e-4 relative on the same tiny models and demo records, once both
score the same tokens: scripts/parity/compare_trl.py, run as a subprocess.

TRL is no dependency of chattune: the script imports it from its own folder (CHATTUNE_TRL_PATH, else
/work/trl-pkgs; see the script's docstring for the install). Where that folder holds no TRL, as in CI, the test
skips without starting anything."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PROJECT_ROOT

TRL_PATH = Path(os.environ.get("CHATTUNE_TRL_PATH", "/work/trl-pkgs"))
TRL_ABSENT = 77  # the script's exit status where TRL is there but cannot be imported


@pytest.mark.launch
def test_orpo_reward_and_kto_figures_equal_trls():
    if not (TRL_PATH / "trl" / "__init__.py").is_file():
        pytest.skip(f"no TRL at {TRL_PATH} (set CHATTUNE_TRL_PATH; pip install --target DIR trl --no-deps)")
    path = os.pathsep.join(p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    done = subprocess.run(
        [sys.executable, "scripts/parity/compare_trl.py", "--trl-path", str(TRL_PATH)],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode == TRL_ABSENT:
        pytest.skip(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all aligned figures agree" in done.stdout
    checked = [line for line in done.stdout.splitlines() if line.endswith("  ok")]
    assert len(checked) >= 40, done.stdout  # ORPO's two aligned variants, the reward model's and KTO's two
    assert "== KTO" in done.stdout, done.stdout
