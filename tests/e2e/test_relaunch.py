"""What a launch does with an output_dir an earlier launch of a run left (`chattune.checkpoint.output_dir.decide_launch`),
decided in-process on the files such a launch leaves: the same run relaunched after a stop that committed no
checkpoint starts again (and only that run), a complete run relaunched has nothing to do, overwrite=true sets the
earlier config aside too, and a resume path that does not exist is said to be missing. (The launches themselves:
tests/e2e/test_run_safety.py and tests/e2e/test_resume.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hydra import compose, initialize_config_dir

from chattune.checkpoint.output_dir import OutputDirInUse, decide_launch, write_completion
from chattune.checkpoint.resume import ResumeError, run_fingerprint, run_identity
from chattune.config.paths import save_resolved_config
from chattune.config.schema import SFTConfig
from chattune.config.typed import typed_config
from chattune.launch.validate import run_validate
from conftest import PROJECT_ROOT

CONFIGS = PROJECT_ROOT / "configs"


def sft_config(out: Path, *overrides: str) -> SFTConfig:
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        return typed_config(compose("sft/tiny", overrides=[f"output_dir={out}", *overrides]), SFTConfig)


def identity(cfg: SFTConfig) -> dict:
    return run_identity(2, run_fingerprint(cfg))


def left_by_a_stop_that_saved_nothing(cfg: SFTConfig) -> None:
    """What a launch killed during its first steps leaves: its config.yaml, its metrics lines, a checkpoint whose
    save never finished (never committed)."""
    out = Path(cfg.output_dir)
    save_resolved_config(cfg, out)
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 6.9}\n{"step": 2, "loss": 6.8}\n')
    (out / "checkpoints" / "step_3.partial").mkdir(parents=True)


def names(paths: list[Path]) -> list[str]:
    return sorted(p.name for p in paths)


def test_the_same_run_relaunched_after_a_stop_that_saved_nothing_starts_again_and_says_so(tmp_path):
    """It used to be refused with "Continue that run with resume=auto" (in effect, and with nothing to continue)."""
    out = tmp_path / "run"
    cfg = sft_config(out)
    left_by_a_stop_that_saved_nothing(cfg)
    decision = decide_launch(cfg, identity(cfg))
    assert decision.start.resume_from is None and decision.complete is None
    assert names(decision.move_aside) == ["checkpoints", "config.yaml", "metrics.jsonl"]  # as overwrite=true would
    assert decision.notes == [
        f"output_dir {out}: this run's earlier launch (the same config) committed no checkpoint: starting it again "
        "from step 0, its files (checkpoints, metrics.jsonl) moved aside as *.abandoned"
    ]
    report, ok = run_validate("sft/tiny", [f"output_dir={out}"], CONFIGS)  # validate tells what the launch does
    assert ok and f"note: output_dir: {decision.notes[0]}" in report, report
    # Where and how often it logs, saves and evaluates are not the run: a requeue that changes them starts again too.
    relaunched = sft_config(out, "log_every=1", "save_every=7")
    assert decide_launch(relaunched, identity(relaunched)).notes


def test_only_that_run_starts_again_and_the_refusal_names_why_with_remedies_that_work(tmp_path):
    out = tmp_path / "run"
    left_by_a_stop_that_saved_nothing(sft_config(out))
    other = sft_config(out, "seed=7", "max_steps=50")
    with pytest.raises(OutputDirInUse) as refused:
        decide_launch(other, identity(other))
    assert str(refused.value) == (
        f"output_dir {out} holds an earlier run's results (checkpoints, metrics.jsonl) and no checkpoint to continue "
        "from (resume=auto), and that run's config.yaml is another config (config max_steps: 200 -> 50; config seed: "
        "42 -> 7): start over here with overwrite=true (its files are moved aside as *.abandoned, not deleted), or "
        "choose another output_dir."
    )
    over = sft_config(out, "seed=7", "max_steps=50", "overwrite=true")
    assert names(decide_launch(over, identity(over)).move_aside) == ["checkpoints", "config.yaml", "metrics.jsonl"]

    (out / "hf").mkdir()  # a run that ended (an export) without a record that it is complete: not started again
    (out / "hf" / "config.json").write_text("{}")
    same = sft_config(out)
    with pytest.raises(OutputDirInUse, match=r"and that run ended: its export \(hf\) is there: start over here with"):
        decide_launch(same, identity(same))
    (out / "config.yaml").unlink()
    with pytest.raises(OutputDirInUse, match="and no config.yaml says which run left them: start over here with"):
        decide_launch(same, identity(same))

    # resume=null in a used directory without a checkpoint: no "continue that run" remedy (there is none).
    null = sft_config(out, "resume=null")
    with pytest.raises(OutputDirInUse) as refused:
        decide_launch(null, identity(null))
    assert "Continue that run" not in str(refused.value) and "start over here with overwrite=true" in str(refused.value)


def committed_checkpoint(cfg: SFTConfig, step: int) -> Path:
    """A committed checkpoint of `cfg`'s run at `step`, as its manifest and DCP metadata say (no real weights)."""
    directory = Path(cfg.output_dir) / "checkpoints" / f"step_{step}"
    directory.mkdir(parents=True)
    dcp.save({"x": torch.zeros(2)}, checkpoint_id=str(directory), no_dist=True)
    for rank in range(2):
        (directory / f"train_state_rank{rank}.pt").write_bytes(b"")
    (directory / "chattune.json").write_text(json.dumps({**identity(cfg), "step": step}))
    return directory


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # (DCP's single-process save, on purpose)
def test_a_complete_run_relaunched_has_nothing_to_do_and_another_horizon_continues_it(tmp_path):
    """It used to resume at its last step, export again and set the identical hf/ aside: a full copy per relaunch."""
    out = tmp_path / "run"
    cfg = sft_config(out, "max_steps=6", "save_every=3")
    save_resolved_config(cfg, out)
    (out / "metrics.jsonl").write_text('{"step": 6, "loss": 1.0}\n')
    latest = committed_checkpoint(cfg, 6)
    (out / "hf").mkdir()
    (out / "hf" / "config.json").write_text("{}")
    write_completion(cfg, identity(cfg), 6, ["hf"])
    decision = decide_launch(cfg, identity(cfg))
    assert decision.complete == (
        f"output_dir {out} holds this run, complete: trained to step 6 and exported to {out / 'hf'}. Nothing to do. "
        f"To train further raise max_steps (the run continues from {latest}); to train it again, start over with "
        "overwrite=true (its files are moved aside as *.abandoned, not deleted)."
    )
    assert decision.move_aside == decision.copy_aside == [] and decision.start.resume_from is None
    report, ok = run_validate("sft/tiny", [f"output_dir={out}", "max_steps=6", "save_every=3"], CONFIGS)
    assert ok and f"note: output_dir: output_dir {out} holds this run, complete" in report, report

    # The remedies as written: a raised max_steps continues from that checkpoint, overwrite=true starts over.
    longer = sft_config(out, "max_steps=8", "save_every=3")
    decision = decide_launch(longer, identity(longer))
    assert decision.complete is None and decision.start.resume_from == latest
    assert decision.start.accepted.horizon == ["max_steps: 6 -> 8"]
    over = sft_config(out, "max_steps=6", "save_every=3", "overwrite=true")
    assert names(decide_launch(over, identity(over)).move_aside) == [
        "checkpoints",
        "complete.json",
        "config.yaml",
        "hf",
        "metrics.jsonl",
    ]
    # Another export of the same training is not the same complete run: resumed at its end, it exports again.
    other_export = sft_config(out, "max_steps=6", "save_every=3", "export.dtype=float32")
    assert decide_launch(other_export, identity(other_export)).start.resume_from == latest
    # No export left (deleted): not complete.
    shutil.rmtree(out / "hf")
    assert decide_launch(cfg, identity(cfg)).complete is None


def test_a_resume_path_that_does_not_exist_is_said_to_be_missing(tmp_path):
    missing = tmp_path / "run" / "checkpoints" / "step_5"
    expected = (
        f"resume={missing}: {missing} does not exist. Give a checkpoint directory (OUTPUT_DIR/checkpoints/step_N), "
        "or resume=auto for the newest checkpoint of output_dir"
    )
    cfg = sft_config(tmp_path / "run", f"resume={missing}")
    with pytest.raises(ResumeError) as refused:
        decide_launch(cfg, identity(cfg))
    assert str(refused.value) == expected
    report, ok = run_validate("sft/tiny", [f"output_dir={tmp_path / 'run'}", f"resume={missing}"], CONFIGS)
    assert not ok and f"resume: {expected}" in report.splitlines()
