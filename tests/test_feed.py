"""Epochs in lockstep: every rank's steps belong to the same epoch, no step mixes two epochs, every
document is trained once per epoch, and a finite run ends on the same step on every rank."""

from __future__ import annotations

import json
import re
import sys

from conftest import ListSource, free_port
from test_sft_recipe import read_metrics, run

from chattune.data.documents import Document
from chattune.data.stream import PackedStream
from chattune.train.feed import StepFeed


def uneven_documents(count: int = 61) -> list[Document]:
    # Lengths that make the ranks' shares pack into different numbers of microbatches.
    return [Document(i, [1] * (4 + (i * 7) % 29), [2] * (4 + (i * 7) % 29)) for i in range(count)]


def make_feeds(docs, world_size, num_epochs, grad_accum_steps=2):
    return [StepFeed({rank: PackedStream(ListSource(docs), rank, world_size, seed=5, max_tokens=48, pad_token_id=0,
                                         buffer_records=8, num_epochs=num_epochs)}, grad_accum_steps, 0, num_epochs,
                     num_streams=world_size)
            for rank in range(world_size)]


def run_steps(feeds, max_steps=10_000):
    """Drive the feeds as the ranks of one job would, the all-reduce done by hand: per step, each rank's
    (epoch, doc ids of each microbatch), and each closed epoch's summed counts."""
    steps, closed = [], []
    for _ in range(max_steps):
        if feeds[0].finished:
            break
        taken = [feed.next_step() for feed in feeds]
        steps.append([(t.epoch, [b.doc_ids for b in t.microbatches], [b.epoch for b in t.microbatches if b.doc_ids])
                      for t in taken])
        streams_done = sum(t.streams_done for t in taken)
        counts = [feed.close_step(streams_done) for feed in feeds]
        assert all(c is None for c in counts) or all(c is not None for c in counts)
        if counts[0] is not None:
            closed.append({k: sum(c[k] for c in counts) for k in counts[0]})
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


def test_two_rank_run_stops_after_num_epochs_and_reports_each_epoch(tmp_path):
    data = tmp_path / "chats.jsonl"
    with data.open("w") as f:
        for i in range(37):
            reply = " ".join(["word"] * (1 + (i * 13) % 40))
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Say {i}."},
                                             {"role": "assistant", "content": reply}]}) + "\n")
    out = tmp_path / "run"
    result = run([
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
        "recipes/sft.py", f"output_dir={out}", "max_steps=1000", "data.num_epochs=2", f"data.train=[{data}]",
        "data.eval=[]", "data.max_tokens_per_microbatch=256", "data.buffer_records=8", "grad_accum_steps=2",
        "log_every=1", "save_every=0", "data.report_records=null",
    ])
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
