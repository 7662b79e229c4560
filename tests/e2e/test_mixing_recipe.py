"""Mixtures in the SFT recipe: exact resume of a 3-source mixture (static and online, 1 and 2 ranks), the
logged per-source figures, and online mixing moving toward the source the model has not learned yet."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_resume import assert_same_weights
from test_sft_recipe import read_metrics

import conftest
from chattune.config.paths import DEMO_ASSETS
from conftest import SMALL_MODEL, TIMING_METRICS, torchrun

pytestmark = pytest.mark.launch  # every test here starts processes


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> str:
    """hard: real demo chats; easy: one constant reply; other: held-out demo chats. As a data.train list."""
    folder = tmp_path_factory.mktemp("mixture")
    chats = (DEMO_ASSETS / "chat_train.jsonl").read_text().splitlines(keepends=True)
    (folder / "hard.jsonl").write_text("".join(chats[:80]))
    easy = {"messages": [{"role": "user", "content": "Say ok."}, {"role": "assistant", "content": "ok " * 12}]}
    (folder / "easy.jsonl").write_text((json.dumps(easy) + "\n") * 40)
    held_out = (DEMO_ASSETS / "chat_eval.jsonl").read_text().splitlines(keepends=True)
    (folder / "other.jsonl").write_text("".join(held_out[:30]))
    return (
        f"data.train=[{{path: {folder / 'hard.jsonl'}, name: hard, weight: 2}}, "
        f"{{path: {folder / 'easy.jsonl'}, name: easy, weight: 1}}, {{path: {folder / 'other.jsonl'}, name: other, weight: 1}}]"
    )


def launch(out: Path, nproc: int, *overrides: str, default_model: bool = False):
    """SFT from the mixed sources on `nproc` ranks; SMALL_MODEL unless `default_model` (sft/tiny's own)."""
    return conftest.launch(
        torchrun(
            "recipes/sft.py",
            *(() if default_model else SMALL_MODEL),
            f"output_dir={out}",
            "log_every=1",
            "save_every=0",
            "data.eval=[]",
            "data.max_tokens_per_microbatch=512",
            "data.buffer_records=16",
            "data.report_records=0",
            *overrides,
            nproc=nproc,
        ),
        default_model=default_model,
    )


def untimed(out: Path) -> list[dict]:
    return [{k: v for k, v in m.items() if k not in TIMING_METRICS} for m in read_metrics(out)]


# (static on 1 rank is not run on its own: CI time; 2 ranks cover what one does, and the online runs cover 1 rank)
@pytest.mark.parametrize("mode,nproc,num_workers", [("static", 2, 0), ("online", 1, 2), ("online", 2, 0)])
def test_mixture_resumes_exactly(tmp_path, sources, mode, nproc, num_workers):
    settings = (
        sources,
        f"data.mixing.mode={mode}",
        "data.mixing.update_every=2",
        "data.mixing.eta=0.2",
        f"data.num_workers={num_workers}",
        "max_steps=8",
        "grad_accum_steps=2",
    )
    launch(tmp_path / "straight", nproc, *settings)
    launch(tmp_path / "resumed", nproc, *settings, "stop_after_step=3")  # between two online updates
    launch(tmp_path / "resumed", nproc, *settings)
    straight = untimed(tmp_path / "straight")
    assert untimed(tmp_path / "resumed") == straight  # losses, per-source counts, probabilities: all exact
    assert_same_weights(tmp_path / "resumed", tmp_path / "straight")
    last = straight[-1]
    assert sum(last[f"mix/{name}/documents"] for name in ("hard", "easy", "other")) > 0
    if mode == "static":
        assert [last[f"mix/{name}/target"] for name in ("hard", "easy", "other")] == [0.5, 0.25, 0.25]
    else:
        assert sum("mix/hard/probability" in m for m in straight) == 4  # updates at steps 2, 4, 6, 8


def test_online_mixing_moves_toward_the_hard_source(tmp_path, sources):
    out = tmp_path / "online"
    launch(
        out,
        1,
        sources,
        "data.mixing.mode=online",
        "data.mixing.update_every=3",
        "data.mixing.eta=0.1",
        "max_steps=30",
        "log_every=3",
        "optimizer.lr=3e-3",
        default_model=True,  # what sft/tiny's model learns of each source in 30 steps
    )
    updates = [m for m in read_metrics(out) if "mix/hard/probability" in m]
    first, last = updates[0], updates[-1]
    # The easy source's constant reply is learned within a few steps: its loss, and so its reward, collapses.
    assert last["mix/easy/reward"] < 0.5 * last["mix/hard/reward"]
    assert last["mix/hard/probability"] > first["mix/hard/probability"] + 0.05
    assert last["mix/easy/probability"] < first["mix/easy/probability"] - 0.05
