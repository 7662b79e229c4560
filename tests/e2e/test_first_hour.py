"""README's two commands in the order a newcomer runs them: the main job first (it leaves outputs/sft-tiny in the
checkout: checkpoints, hf/, metrics), then the test suite, which must not see any of it. Here the main job's config
trains (two steps) in a copy of the checkout, and the tests that validate and launch the shipped configs by name (the
ones that once read that state: dpo/tiny's model.path, sft/tiny's resume=auto) run from that copy, green; so does the
conftest's guard, both ways: a test that writes into the copy's outputs/, or starts a process in the checkout, fails."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

from conftest import PROJECT_ROOT, USER_STATE, launch, torchrun

pytestmark = pytest.mark.launch

# Tests a newcomer's suite failed on after the main job (issue 67), or that fail the same way: they validate dpo/tiny
# (whose model.path is the main job's outputs/sft-tiny/hf) and sft/tiny (whose resume=auto would find the main job's
# checkpoints and note the resume, or refuse it for another model: a probe below).
AFTER_THE_MAIN_JOB = (
    "tests/unit/cli/test_cli.py::test_a_dpo_config_copied_out_of_its_group_is_checked_by_the_command_cp_prints",
    "tests/unit/launch/test_validate.py::test_every_shipped_config_validates_without_a_note",
)

GUARD_PROBES = """
import subprocess, sys
from pathlib import Path
import pytest
from conftest import PROJECT_ROOT

def test_probe_writes_into_outputs():
    (PROJECT_ROOT / "outputs" / "sft-tiny" / "written_by_a_test.txt").write_text("x")

@pytest.mark.launch
def test_probe_starts_a_process_in_the_checkout():
    subprocess.run([sys.executable, "-c", "pass"], cwd=PROJECT_ROOT, check=True)

def test_probe_reads_its_own_outputs():
    assert not Path("outputs").exists()  # the checkout's outputs/ is not where a test runs
    assert (PROJECT_ROOT / "outputs" / "sft-tiny" / "hf").is_dir()

def test_probe_validates_sft_tiny_as_a_fresh_clone_would():
    from chattune.config.paths import CONFIG_DIR
    from chattune.launch.validate import run_validate

    report, ok = run_validate("sft/tiny", ["model.config.hidden_size=96"], CONFIG_DIR)
    assert ok and report.splitlines()[-1] == "config OK", report  # no resume of the main job's checkpoint

def test_probe_imports_the_clones_chattune():
    import chattune
    assert Path(chattune.__file__).resolve().is_relative_to(PROJECT_ROOT)
"""


def clone_of_the_checkout(directory: Path) -> Path:
    """A copy of the checkout as a newcomer's clone is, no outputs/ yet: its own tests/ (their conftest takes the
    checkout to be where they are) and chattune/ (imported from there: the shipped configs it finds are the clone's),
    the rest linked."""
    directory.mkdir()
    for entry in PROJECT_ROOT.iterdir():
        if entry.name in ("tests", "chattune"):
            shutil.copytree(entry, directory / entry.name, ignore=shutil.ignore_patterns("__pycache__"))
        elif entry.name not in USER_STATE:
            (directory / entry.name).symlink_to(entry)
    return directory


def outcomes(report: Path) -> dict[str, str]:
    """test name: passed, failed, error or skipped, from a JUnit XML report."""
    found = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        found[case.get("name")] = "error" if "error" in kinds else (kinds[0] if kinds else "passed")
    return found


def test_the_shipped_configs_tests_are_green_after_the_main_job(tmp_path):
    clone = clone_of_the_checkout(tmp_path / "clone")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "CHATTUNE_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(clone), *filter(None, [env.get("PYTHONPATH")])])
    # README's main job (sft/tiny as it ships, from the clone), short: a checkpoint and the hf/ export
    launch(torchrun("sft", "max_steps=2", "save_every=1", "eval_every=0"), cwd=clone, env_extra=env, default_model=True)
    assert (clone / "outputs/sft-tiny/hf/config.json").is_file()
    assert (clone / "outputs/sft-tiny/checkpoints/step_2").is_dir()
    (clone / "tests" / "test_guard_probes.py").write_text(GUARD_PROBES)
    report = tmp_path / "report.xml"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"]
        + [*AFTER_THE_MAIN_JOB, "tests/test_guard_probes.py"],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    found = outcomes(report)
    probes = {name: found.pop(name) for name in list(found) if name.startswith("test_probe_")}
    assert len(found) >= len(AFTER_THE_MAIN_JOB) and set(found.values()) <= {"passed", "skipped"}, done.stdout[-5000:]
    assert all(found[name.rsplit("::", 1)[1]] == "passed" for name in AFTER_THE_MAIN_JOB[:1]), done.stdout[-5000:]
    # the guard, both ways: a write into outputs/ is that test's error, a process started in the checkout fails its
    # test, and a test that keeps to its own directory passes
    assert probes == {
        "test_probe_writes_into_outputs": "error",
        "test_probe_starts_a_process_in_the_checkout": "failure",
        "test_probe_reads_its_own_outputs": "passed",
        "test_probe_validates_sft_tiny_as_a_fresh_clone_would": "passed",
        "test_probe_imports_the_clones_chattune": "passed",
    }, done.stdout[-3000:]
    said = report.read_text()  # (the failures' messages in full)
    assert (
        "this test wrote into the checkout's own state (tests never do): outputs/sft-tiny, outputs/sft-tiny/written"
        in said
    )
    assert "where a user's runs leave their state" in said
