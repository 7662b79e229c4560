"""Per rank, epochs in lockstep: every rank's steps belong to the same epoch, no step mixes two epochs, every
document is trained once per epoch, and a finite run ends on the same step on every rank. World-size-
invariant: every number of ranks trains the same microbatches per step, steps run on across an epoch's end,
and a saved position resumes on another number of ranks."""

from __future__ import annotations

import json
import re

import pytest
from test_sft_recipe import read_metrics

from chattune.data.documents import Document
from chattune.data.feed import InvariantSlots, StepFeed, merge_states
from chattune.data.stream import PackedStream, PackingBudget, StreamLayout
from chattune.errors import UserError
from conftest import SMALL_MODEL, ListSource, launch, torchrun


def uneven_documents(count: int = 61) -> list[Document]:
    # Lengths that make the ranks' shares pack into different numbers of microbatches.
    return [Document(i, [1] * (4 + (i * 7) % 29), [2] * (4 + (i * 7) % 29)) for i in range(count)]


def make_feeds(docs, world_size, num_epochs, grad_accum_steps=2):
    return [
        StepFeed(
            PackedStream(
                ListSource(docs),
                StreamLayout(rank, world_size, num_epochs=num_epochs),
                5,
                PackingBudget(48, 0, buffer_records=8),
            ),
            grad_accum_steps,
            0,
            num_epochs,
            num_ranks=world_size,
        )
        for rank in range(world_size)
    ]


def run_steps(feeds, max_steps=10_000):
    """Drive the feeds as the ranks of one job would, the all-reduce done by hand: per step, each rank's
    (epoch, doc ids of each microbatch), and each closed epoch's summed counts."""
    steps, closed = [], []
    for _ in range(max_steps):
        if feeds[0].finished:
            break
        taken = [feed.next_step() for feed in feeds]
        steps.append(
            [
                (t.epoch, [b.doc_ids for b in t.microbatches], [b.epoch for b in t.microbatches if b.doc_ids])
                for t in taken
            ]
        )
        ranks_at_epoch_end = sum(t.epoch_end_reached for t in taken)
        per_rank = [feed.close_step(ranks_at_epoch_end) for feed in feeds]
        assert all([e for e, _ in c] == [e for e, _ in per_rank[0]] for c in per_rank), "ranks closed other epochs"
        for at in range(len(per_rank[0])):
            closed.append({k: sum(c[at][1][k] for c in per_rank) for k in per_rank[0][at][1]})
    return steps, closed


def test_ranks_agree_on_epochs_and_finish_together():
    docs = uneven_documents()
    for world_size in (1, 2, 3):
        feeds = make_feeds(docs, world_size, num_epochs=3)
        steps, closed = run_steps(feeds)
        assert all(feed.finished for feed in feeds)
        per_epoch = {0: [], 1: [], 2: []}
        waited = 0
        for step in steps:
            epochs = {epoch for epoch, _, _ in step}
            assert len(epochs) == 1, f"ranks disagree on the epoch: {epochs}"
            epoch = epochs.pop()
            for _, microbatches, batch_epochs in step:
                assert set(batch_epochs) <= {epoch}, "a step mixed two epochs"
                waited += sum(not ids for ids in microbatches)
                per_epoch[epoch] += [i for ids in microbatches for i in ids]
        for epoch, ids in per_epoch.items():
            assert sorted(ids) == list(range(len(docs))), f"world {world_size}, epoch {epoch}"
        assert len(closed) == 3
        assert all(c["documents"] == len(docs) and c["tokens"] == sum(map(len, docs)) for c in closed)
        if world_size > 1:
            assert waited > 0, "the test data should make some rank wait for the others"


def test_feed_state_resumes_the_same_steps_while_a_rank_waits():
    docs = uneven_documents()
    expected, _ = run_steps(make_feeds(docs, 3, num_epochs=2))
    for stop in range(1, len(expected)):
        feeds = make_feeds(docs, 3, num_epochs=2)
        got, _ = run_steps(feeds, max_steps=stop)
        states = [feed.state_dict() for feed in feeds]
        resumed = make_feeds(docs, 3, num_epochs=2)
        for feed, state in zip(resumed, states):
            feed.load_state_dict(state)
        rest, _ = run_steps(resumed)
        assert got + rest == expected, f"resuming after step {stop} diverged"


@pytest.mark.launch
def test_two_rank_run_stops_after_num_epochs_and_reports_each_epoch(tmp_path):
    data = tmp_path / "chats.jsonl"
    with data.open("w") as f:
        for i in range(37):
            reply = " ".join(["word"] * (1 + (i * 13) % 40))
            f.write(
                json.dumps(
                    {"messages": [{"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": reply}]}
                )
                + "\n"
            )
    out = tmp_path / "run"
    result = launch(
        torchrun(
            "recipes/sft.py",
            *SMALL_MODEL,
            f"output_dir={out}",
            "max_steps=1000",
            "data.num_epochs=2",
            f"data.train=[{data}]",
            "data.eval=[]",
            "data.max_tokens_per_microbatch=256",
            "data.buffer_records=8",
            "grad_accum_steps=2",
            "log_every=1",
            "save_every=0",
            "data.report_records=null",
            nproc=2,
        )
    )
    log = result.stdout + result.stderr
    assert "training data (37 of 37 records sampled): records read: 37; skipped: 0" in log
    done = re.findall(r"epoch (\d) done at step (\d+): (\d+) documents", log)
    assert [(e, n) for e, _, n in done] == [("0", "37"), ("1", "37")]
    metrics = read_metrics(out)
    last_step = int(done[-1][1])
    assert metrics[-1]["step"] == last_step < 1000
    assert {m["epoch"] for m in metrics if m["step"] <= int(done[0][1])} == {0}
    assert {m["epoch"] for m in metrics if m["step"] > int(done[0][1])} == {1}
    assert (out / "hf").is_dir()


def invariant_feeds(docs, world_size, num_epochs, microbatches_per_step=4):
    """World-size-invariant steps: every rank packs all of `docs` and trains its slots of each step."""
    per_rank = microbatches_per_step // world_size
    return [
        StepFeed(
            PackedStream(
                ListSource(docs), StreamLayout(num_epochs=num_epochs), 5, PackingBudget(48, 0, buffer_records=8)
            ),
            microbatches_per_step,
            0,
            num_epochs,
            num_ranks=world_size,
            invariant=InvariantSlots(range(rank * per_rank, (rank + 1) * per_rank), seed=3),
        )
        for rank in range(world_size)
    ]


def test_invariant_steps_train_the_same_documents_on_any_number_of_ranks():
    docs = uneven_documents(59)  # epochs of 23 microbatches: not a whole number of 4-microbatch steps
    # Independent of the feed: two epochs' packing, as a one-rank stream of all the data gives it.
    packed = [
        b.doc_ids
        for b in PackedStream(ListSource(docs), StreamLayout(num_epochs=2), 5, PackingBudget(48, 0, buffer_records=8))
    ]
    by_step = None
    for world_size in (1, 2, 4):
        feeds = invariant_feeds(docs, world_size, num_epochs=2)
        steps, closed = run_steps(feeds)
        # A step's microbatches, in slot order over the ranks, are the next four of the one stream, across
        # the end of the first epoch: only the run's last step has empty ones.
        flat = [[ids for _, microbatches, _ in step for ids in microbatches] for step in steps]
        assert [ids for step in flat for ids in step if ids] == packed
        assert all(ids for step in flat[:-1] for ids in step), "a step before the last one has an empty microbatch"
        crossing = [i for i, step in enumerate(steps) if len({e for _, _, epochs in step for e in epochs}) == 2]
        assert len(crossing) == 1 and steps[crossing[0] + 1][0][0] == 1, "one step should cross into epoch 1"
        assert [c["documents"] for c in closed] == [len(docs), len(docs)]
        assert all(c["tokens"] == sum(map(len, docs)) for c in closed)
        assert by_step is None or flat == by_step, f"{world_size} ranks train other documents per step"
        by_step = flat
        # Each microbatch is seeded by its place in the step, not by its rank.
        seeds = [s for feed in invariant_feeds(docs, world_size, 1) for s in feed.next_step(7).seeds]
        assert seeds == invariant_feeds(docs, 1, 1)[0].next_step(7).seeds and len(set(seeds)) == 4


def test_invariant_state_resumes_on_another_number_of_ranks():
    docs = uneven_documents(59)
    expected, _ = run_steps(invariant_feeds(docs, 2, num_epochs=2))
    flat = [[ids for _, microbatches, _ in step for ids in microbatches] for step in expected]
    for stop in range(1, len(expected)):  # the step that crosses into epoch 1 and those around it included
        feeds = invariant_feeds(docs, 2, num_epochs=2)
        run_steps(feeds, max_steps=stop)
        states = [feed.state_dict() for feed in feeds]
        for world_size in (1, 4):
            resumed = invariant_feeds(docs, world_size, num_epochs=2)
            for rank, feed in enumerate(resumed):
                feed.load_state_dict(merge_states(states, rank))
            rest, closed = run_steps(resumed)
            assert [[ids for _, mbs, _ in step for ids in mbs] for step in rest] == flat[stop:], (stop, world_size)
            # The epoch's counts so far move whole to the new rank 0: each closed epoch still counts every document.
            assert closed and all(c["documents"] == len(docs) for c in closed), (stop, world_size)


def test_a_position_of_another_step_layout_is_refused():
    """A run cannot switch between per-rank and world-size-invariant steps, change M, or continue the
    per-stream positions of the earlier invariant design: each would train other documents."""
    docs = uneven_documents(59)
    per_rank = make_feeds(docs, 1, num_epochs=1)[0].state_dict()
    invariant = invariant_feeds(docs, 2, num_epochs=1)[0].state_dict()
    for feed, state, says in (
        (invariant_feeds(docs, 2, 1)[0], per_rank, "data.microbatches_per_step=None"),
        (make_feeds(docs, 1, 1)[0], invariant, "data.microbatches_per_step=4"),
        (invariant_feeds(docs, 1, 1, microbatches_per_step=2)[0], invariant, "has 2"),
        (invariant_feeds(docs, 2, 1)[0], {"streams": {}}, "one stream per microbatch"),
    ):
        with pytest.raises(UserError, match=re.escape(says)):
            feed.load_state_dict(state)
