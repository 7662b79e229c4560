"""A checkpoint written by an earlier chattune still resumes: tests/fixtures/checkpoint_before_run_state (step 3 of 6,
1 rank, a tiny Llama; how it was made: tests/fixtures/README.md) continues as an uninterrupted run of this code does."""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
from test_resume import losses, read_metrics

from chattune.config.paths import DEMO_ASSETS
from conftest import PROJECT_ROOT, SMALL_MODEL, launch

FIXTURE = PROJECT_ROOT / "tests" / "fixtures" / "checkpoint_before_run_state"
# The settings the fixture was written with (but its output_dir, data path and stop_after_step).
SETTINGS = [
    "max_steps=6",
    "save_every=3",
    "log_every=1",
    "eval_every=0",
    "data.eval=[]",
    "grad_accum_steps=2",
    "data.max_tokens_per_microbatch=512",
    "data.buffer_records=16",
    "data.report_records=0",
    "data.cache=off",
    "scheduler.num_warmup_steps=2",
    "model.config.hidden_size=16",
    "model.config.intermediate_size=32",
    "model.config.num_hidden_layers=1",
    "model.config.num_attention_heads=2",
    "model.config.num_key_value_heads=1",
    "model.config.max_position_embeddings=512",
    "progress=lines",
]


def saved_losses() -> list[tuple[int, float]]:
    return losses(FIXTURE)  # its metrics.jsonl: steps 1-3 of the run that wrote it


# Steps 4-6 of the fixture's run uninterrupted, as the code that wrote it trained them (commit 8be2dcd~1, this
# machine's torch 2.13 CPU build): the schedule then gave step k the rate of its position k - 1, and a checkpoint of
# that code keeps its own rates when resumed (chattune.train.optimizer.build_scheduler).
CONTINUATION = [(4, 6.890326968802258), (5, 6.874462580276748), (6, 6.790752600569752)]


def old_rate(step: int, lr: float = 3e-3, warmup: int = 2, total: int = 6) -> float:
    """The cosine schedule with warmup at position step - 1 (the earlier code's rate of `step`), by hand."""
    position = step - 1
    if position < warmup:
        return lr * position / warmup
    return lr * 0.5 * (1 + math.cos(math.pi * (position - warmup) / (total - warmup)))


@pytest.mark.launch
def test_a_checkpoint_of_an_earlier_chattune_resumes_and_continues_as_an_uninterrupted_run(tmp_path):
    data = tmp_path / "chats.jsonl"  # the fixture's data: the first 60 demo chats
    data.write_text("".join((DEMO_ASSETS / "chat_train.jsonl").read_text().splitlines(keepends=True)[:60]))
    checkpoint = tmp_path / "old" / "step_3"
    shutil.copytree(FIXTURE / "step_3", checkpoint)
    recipe = [sys.executable, "recipes/sft.py", *SMALL_MODEL, f"data.train=[{data}]", *SETTINGS]
    resumed = tmp_path / "resumed"
    # The fingerprint names the paths of the machine that wrote it (its data file, the demo tokenizer's).
    output = launch([*recipe, f"output_dir={resumed}", f"resume={checkpoint}", "resume_allow_changes=true"])
    assert f"resumed from {checkpoint} at step 3" in output.stdout + output.stderr

    metrics = read_metrics(resumed)
    assert [m["step"] for m in metrics] == [4, 5, 6]
    assert [m["lr"] for m in metrics] == pytest.approx([old_rate(step) for step in (4, 5, 6)], rel=1e-9)
    # Bit for bit where this machine computes as the one that wrote the fixture; elsewhere up to rounding.
    assert [m["loss"] for m in metrics] == pytest.approx([loss for _, loss in CONTINUATION], rel=1e-4)


def same_saved_state(a: Path, b: Path) -> bool:
    """Whether two DCP checkpoints hold the same tensors, bit for bit."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    states = []
    for directory in (a, b):
        converted = directory.parent / f"{directory.name}.pt.tmp"
        dcp_to_torch_save(directory, converted)
        states.append(torch.load(converted, weights_only=False))
        converted.unlink()
    flat = [dict(flatten(state)) for state in states]
    return flat[0].keys() == flat[1].keys() and all(equal(flat[0][k], flat[1][k]) for k in flat[0])


def flatten(tree, prefix: str = ""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from flatten(value, f"{prefix}{key}.")
    else:
        yield prefix, tree


def equal(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) else a == b


class Stream:
    """A packed stream's stand-in for StepFeed: only its saved position."""

    position: dict | None = None

    def state_dict(self) -> dict:
        return self.position

    def load_state_dict(self, state: dict) -> None:
        self.position = state


def test_the_kept_checkpoint_holds_every_part_of_the_run_state_by_name():
    """Each part of this code's run state finds its entry in the checkpoint by name and loads the values saved."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    from chattune.checkpoint.checkpoint import rank_states, read_manifest
    from chattune.checkpoint.run_state import SkippedSteps, rng_state, set_rng_state, training_state
    from chattune.data.feed import StepFeed
    from chattune.train.step import LossScale

    checkpoint = FIXTURE / "step_3"
    saved = rank_states(checkpoint)
    assert len(saved) == 1 and saved[0]["step"] == 3 == read_manifest(checkpoint)["step"]
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    feed, skipped = StepFeed(Stream(), 2, 0), SkippedSteps()
    state = training_state(model, optimizer, scheduler, feed, skipped, LossScale(enabled=False))
    assert list(state) == ["model", "optimizer", "scheduler", "data", "rng", "counters"]
    # the sharded parts: DCP's entries under their names; the others: this rank's file's
    shards = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    assert {key.split(".")[0] for key in shards} == set(state.sharded_state_dict())
    assert set(state.state_dict()) <= set(saved[0])

    generators = rng_state()  # this process's, given back after the test
    try:
        state.load_state_dict(saved[0])
        assert torch.equal(torch.get_rng_state(), saved[0]["rng"]["torch"])
    finally:
        set_rng_state(generators)
    assert scheduler.last_epoch == saved[0]["scheduler"]["last_epoch"] == 3
    assert feed.stream.position == saved[0]["data"]["stream"] and feed.epoch == saved[0]["data"]["epoch"] == 0
    assert skipped.counts == saved[0]["counters"] == {"nonfinite_skipped_steps": 0}
