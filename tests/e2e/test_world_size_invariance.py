"""World-size-invariant steps (data.microbatches_per_step): a step's documents are fixed by the data and the
seed, not by the number of ranks. Runs of 4 microbatches a step on 1 rank × 4, 2 ranks × 2 and 4 ranks × 1
(each setting on two or three of them) follow the same loss curve for 20 steps (to float summation order), for SFT and DPO, with 0 and 2 loader
workers, with and without a static or an online mixture; a checkpoint written on 2 ranks resumes on 1 and on 4 ranks
with the uninterrupted run's remaining losses, and the ledger shows every document once per epoch across
the change, each step training the same documents as the uninterrupted run; an online mixture's state
moves with such a checkpoint."""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from pathlib import Path

import pytest
from test_resume import ledger_steps
from test_sft_recipe import read_metrics

import conftest
from chattune.config.paths import DEMO_ASSETS
from conftest import SMALL_MODEL, torchrun

pytestmark = pytest.mark.launch  # every test here starts processes

STEPS = 20
TOLERANCE = 1e-5  # relative, per step: the same documents, summed in another order
CHATS, PAIRS = 40, 24


def write_lines(path: Path, source: str, start: int, count: int) -> Path:
    path.write_text("".join((DEMO_ASSETS / source).read_text().splitlines(keepends=True)[start : start + count]))
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, list[str]]:
    """Small sources, so that 20 steps span several epochs: `data.train` overrides per recipe and mixing."""

    def make(root: Path) -> None:  # once, on one path for every xdist worker (the shared runs' fingerprints name it)
        write_lines(root / "chats.jsonl", "chat_train.jsonl", 0, CHATS)
        write_lines(root / "more_chats.jsonl", "chat_train.jsonl", CHATS, 16)
        write_lines(root / "pairs.jsonl", "preference_train.jsonl", 0, PAIRS)
        write_lines(root / "more_pairs.jsonl", "preference_train.jsonl", PAIRS, 12)

    root = conftest.made_once(tmp_path_factory, "invariance-data", make)
    chats, more_chats, pairs, more_pairs = (
        root / f"{name}.jsonl" for name in ("chats", "more_chats", "pairs", "more_pairs")
    )
    mixed = "data.mixing.mode=static"
    return {
        "sft": [f"data.train=[{chats}]"],
        "sft-mixed": [f"data.train=[{{path:{chats},weight:2}},{{path:{more_chats},weight:1}}]", mixed],
        # Online: every rank samples the one stream alike, so the bandit's updates do not depend on the ranks
        # either (for a given number of loader workers: the update takes effect from the furthest draw read).
        "sft-online": [
            f"data.train=[{{path:{chats},weight:2}},{{path:{more_chats},weight:1}}]",
            "data.mixing.mode=online",
            "data.mixing.update_every=3",
            "data.mixing.eta=1.0",
        ],
        "dpo": [f"data.train=[{{path:{pairs},format:preference}}]"],
        "dpo-mixed": [
            f"data.train=[{{path:{pairs},format:preference,weight:2}},"
            f"{{path:{more_pairs},format:preference,weight:1}}]",
            mixed,
        ],
    }


def launch(out: Path, nproc: int, recipe: str, *overrides: str) -> None:
    conftest.launch(
        torchrun(
            f"recipes/{recipe}.py",
            *SMALL_MODEL,
            f"output_dir={out}",
            f"max_steps={STEPS}",
            "log_every=1",
            "eval_every=0",
            "save_every=0",
            "data.eval=[]",
            "data.microbatches_per_step=4",
            "data.max_tokens_per_microbatch=512",
            "data.buffer_records=8",
            "data.report_records=0",
            *overrides,
            nproc=nproc,
        )
    )


def losses(out: Path) -> list[float]:
    return [m["loss"] for m in read_metrics(out)]


def assert_same_curve(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want), what
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
    assert worst <= TOLERANCE, f"{what}: relative difference {worst:.2e}"


# Every run costs a launch (CI has 2 cores), so loader workers are not crossed with the rest: each setting
# runs on 1 rank × 4, 2 × 2 and 4 × 1, some with 0 loader workers and some with 2, and all must agree. The
# (ranks, loader workers) of each setting's runs (SFT's 2 × 2 is the `two_ranks` run, with 2 workers):
# Four ranks on CI's 2 cores cost the most: SFT and online mixing run on 4 (and the resume below), DPO and the
# static mixtures on 1 and 2.
SPLITS = {
    "sft": [(1, 0), (4, 0)],
    "sft-mixed": [(1, 2), (2, 0)],
    "sft-online": [(1, 2), (4, 2)],
    "dpo": [(1, 0), (2, 2)],
    "dpo-mixed": [(1, 2), (2, 0)],
}
RANDOM_INIT = ["model.path=null"]  # DPO from the tiny random-init model (policy and reference alike)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, data) -> Path:
    """SFT on 2 ranks × 2, checkpointed at step 10, with the document ledger."""

    def make(out: Path) -> None:
        from chattune.data.token_cache import CACHE_DIR_ENV

        launch(out, 2, "sft", *data["sft"], "data.num_workers=2", "save_every=10", "ledger=true")
        # the token caches of the worker that made it: another worker's test reads them there
        (out / "token_cache_dir").write_text(os.environ[CACHE_DIR_ENV])

    return conftest.made_once(tmp_path_factory, "invariance-two-ranks", make)


@pytest.mark.parametrize("setting", list(SPLITS))
def test_the_loss_curve_does_not_depend_on_the_number_of_ranks(tmp_path, data, two_ranks, setting):
    recipe = setting.split("-")[0]
    curves = {}
    for nproc, workers in SPLITS[setting]:
        out = tmp_path / f"w{nproc}"
        launch(
            out, nproc, recipe, *data[setting], *(RANDOM_INIT if recipe == "dpo" else []), f"data.num_workers={workers}"
        )
        curves[nproc] = losses(out)
        assert max(m["epoch"] for m in read_metrics(out)) >= 2, "the run should span several epochs"
        if setting == "sft-online":
            moved = {round(m["mix/chats/probability"], 6) for m in read_metrics(out) if "mix/chats/probability" in m}
            assert len(moved) > 2, "the bandit should have updated the probabilities"
    if setting == "sft":
        curves[2] = losses(two_ranks)
    first, *others = curves
    assert len(set(curves[first])) > 5, "the loss should move"
    for nproc in others:
        assert_same_curve(curves[nproc], curves[first], f"{setting}: {nproc} ranks against {first}")


def test_a_checkpoint_resumes_on_another_number_of_ranks(tmp_path, data, two_ranks):
    want = losses(two_ranks)
    before = ledger_steps(two_ranks)["from_step0.jsonl"]
    for nproc, workers in ((1, 2), (4, 0)):
        out = tmp_path / f"resumed_on_{nproc}"
        out.mkdir()
        shutil.copytree(two_ranks / "checkpoints" / "step_10", out / "checkpoints" / "step_10")
        launch(out, nproc, "sft", *data["sft"], "ledger=true", f"data.num_workers={workers}")
        got = [(m["step"], m["loss"]) for m in read_metrics(out)]
        assert [s for s, _ in got] == list(range(11, STEPS + 1))
        assert_same_curve([loss for _, loss in got], want[10:], f"resumed on {nproc} ranks")

        # Every document once per epoch: steps 1-10 on 2 ranks, 11-20 on the new number (each document counted
        # in its own epoch: a step may cross from one epoch into the next).
        after = ledger_steps(out)["from_step10.jsonl"]
        per_epoch: dict[int, Counter] = {}
        for path in [
            *sorted((two_ranks / "ledger").glob("rank*.from_step0.jsonl")),
            *sorted((out / "ledger").glob("rank*.from_step10.jsonl")),
        ]:
            for line in path.read_text().splitlines():
                entry = json.loads(line)
                if path.parent == out / "ledger" or entry["step"] <= 10:
                    for doc, epoch in zip(entry["doc_ids"], entry["doc_epochs"], strict=True):
                        per_epoch.setdefault(epoch, Counter())[doc] += 1
        for epoch, counts in per_epoch.items():
            assert max(counts.values()) == 1, f"epoch {epoch}: a document trained twice"
            if epoch < max(per_epoch):
                assert sorted(counts) == list(range(CHATS)), f"epoch {epoch}: documents missing"
        # The same documents in the same steps as the uninterrupted run, whoever trains them.
        for step in range(11, STEPS + 1):
            assert sorted(i for ids in after[step][1].values() for i in ids) == sorted(
                i for ids in before[step][1].values() for i in ids
            ), f"step {step}"


def test_the_token_cache_changes_no_document_and_no_loss(tmp_path, data, two_ranks):
    """`two_ranks` read its documents from the token cache (data.cache=auto, the default; built by its 2 ranks
    together, or by an earlier launch on the same file) of the xdist worker that made it; the same run tokenizing as
    it reads (data.cache=off) trains the same documents in every step, with the same losses to 1e-6."""
    from chattune.data.token_cache import MANIFEST

    chats = data["sft"][0].removeprefix("data.train=[").removesuffix("]")
    caches = Path((two_ranks / "token_cache_dir").read_text()) / "tokens"
    manifests = [json.loads(m.read_text()) for m in caches.glob(f"*/{MANIFEST}")]
    assert any(m["source"] == chats for m in manifests), "two_ranks should have read a token cache"
    out = tmp_path / "off"
    launch(out, 2, "sft", *data["sft"], "data.num_workers=2", "ledger=true", "data.cache=off")
    got, want = losses(out), losses(two_ranks)
    assert len(got) == STEPS and max(abs(g - w) / abs(w) for g, w in zip(got, want)) <= 1e-6
    assert ledger_steps(out)["from_step0.jsonl"] == ledger_steps(two_ranks)["from_step0.jsonl"]


def test_an_online_mixture_resumes_on_another_number_of_ranks(tmp_path, data):
    """The mixture's state moves with the checkpoint: the bandit's weights and reward sums, its per-source
    totals (summed over the old ranks, held by the new rank 0) and the sampler's position."""
    whole = tmp_path / "two_ranks"
    launch(whole, 2, "sft", *data["sft-online"], "data.num_workers=2", "save_every=10")
    want = read_metrics(whole)
    for nproc in (1, 4):
        out = tmp_path / f"resumed_on_{nproc}"
        out.mkdir()
        shutil.copytree(whole / "checkpoints" / "step_10", out / "checkpoints" / "step_10")
        launch(out, nproc, "sft", *data["sft-online"], "data.num_workers=2")
        got = read_metrics(out)
        assert [m["step"] for m in got] == list(range(11, STEPS + 1))
        assert_same_curve([m["loss"] for m in got], [m["loss"] for m in want[10:]], f"resumed on {nproc} ranks")
        for mine, theirs in zip(got, want[10:]):
            mixture = {k: v for k, v in theirs.items() if k.startswith("mix/")}
            assert mixture and {k for k in mine if k.startswith("mix/")} == set(mixture), mine["step"]
            for key, value in mixture.items():
                assert abs(mine[key] - value) <= TOLERANCE * max(abs(value), 1), (mine["step"], key, mine[key], value)
