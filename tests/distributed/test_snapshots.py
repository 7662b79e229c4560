"""A step's snapshot in host memory, written by each rank without collectives, is an ordinary checkpoint of that
step: it loads exactly on the ranks that wrote it and reshards to another number (`chattune.checkpoint.snapshot`)."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
from test_checkpoint import full_optimizer_state, full_state, run_state, sharded

from chattune import interrupts
from chattune.checkpoint import snapshot
from chattune.checkpoint.checkpoint import damage, load_checkpoint, read_manifest
from chattune.checkpoint.layout import MANIFEST_FILE, committed_checkpoints
from chattune.checkpoint.snapshot import Snapshots, advise, complete_snapshots, killing_grace_s
from chattune.checkpoint.staging import HostBuffers
from chattune.data.feed import StepBatches
from chattune.data.packing import collate_packed
from chattune.distributed import exit_process, shutdown_distributed
from chattune.objectives.cross_entropy import TokenCrossEntropy
from chattune.parallel.fsdp import Placement
from chattune.train.step import UpdateRule, train_step
from conftest import demo_documents, free_port, init_worker_process_group, mesh_dims, spawn


def _step(model, optimizer, rank: int, seed: int) -> None:
    batch = collate_packed(demo_documents(4, start=4 * rank + seed))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    train_step(
        model, TokenCrossEntropy(), StepBatches([batch]), UpdateRule(optimizer, scheduler, 1.0), Placement(mesh_dims())
    )


def _write_snapshot(
    rank: int, world_size: int, port: int, tmp: str, committer_killed: bool, optimizer_class: str = "AdamW"
) -> None:
    """Train a step, stage it, train another (the state moves on), then write the staged step as a signal
    would: each rank alone, no collective. `committer_killed`: the last rank dies before its commit."""
    init_worker_process_group(rank, world_size, port)
    if committer_killed:

        def killed(directory, world_size):
            raise RuntimeError("killed before the commit (the test's)")

        snapshot._commit_directory = killed
    tmp_path = Path(tmp)
    model, optimizer = sharded(seed=0, world_size=world_size, optimizer=optimizer_class)
    _step(model, optimizer, rank, seed=0)
    snapshots = Snapshots(
        tmp_path / "checkpoints",
        run_state(model, optimizer, {"rank": rank}),
        {"world_size": world_size, "fingerprint": "f", "wandb_id": "w" if rank == 0 else None},  # (rank 0's alone)
        {"extra.bin": b"rank 0's"} if rank == 0 else {},
        torch.device("cpu"),
    )
    snapshots.stage(1)
    weights, moments = full_state(model), full_optimizer_state(model, optimizer)
    _step(model, optimizer, rank, seed=1)
    assert any(not torch.equal(weights[k], v) for k, v in full_state(model).items())
    if rank == 0:
        torch.save({"weights": weights, "moments": moments}, tmp_path / "expected.pt")
    torch.distributed.barrier()  # (the test's, so both ranks' expected states are taken before the writes)
    interrupts.install()
    snapshots.watch()
    os.kill(os.getpid(), signal.SIGUSR1)  # the watcher writes step 1, this rank alone, no collective
    deadline = time.monotonic() + 60
    while snapshots._written != 1:
        assert time.monotonic() < deadline, "the snapshot was not written"
        time.sleep(0.05)
    assert snapshots.settle() == (None if committer_killed else 1)  # every rank wrote it and one committed it
    snapshots.close()
    assert signal.set_wakeup_fd(-1) == -1  # the wake-up descriptor as it was before watch()
    shutdown_distributed()
    exit_process()


def _load_snapshot(rank: int, world_size: int, port: int, tmp: str, optimizer_class: str = "AdamW") -> None:
    init_worker_process_group(rank, world_size, port)
    tmp_path = Path(tmp)
    expected = torch.load(tmp_path / "expected.pt")
    model, optimizer = sharded(seed=1, world_size=world_size, optimizer=optimizer_class)
    _step(model, optimizer, rank, seed=2)  # other weights and moments, to be replaced
    state = run_state(model, optimizer, {})
    assert load_checkpoint(tmp_path / "checkpoints" / "step_1", state) == 1
    assert state["saved"].value == {"rank": rank}
    restored = full_state(model)
    for name, value in expected["weights"].items():
        assert torch.equal(restored[name], value), name
    for a, b in zip(expected["moments"], full_optimizer_state(model, optimizer), strict=True):
        assert torch.equal(a, b)
    shutdown_distributed()
    exit_process()


@pytest.mark.launch
@pytest.mark.parametrize("committer_killed", [False, True])
def test_a_snapshot_written_per_rank_is_a_checkpoint_that_loads_and_reshards(tmp_path, committer_killed):
    """Committed by the last rank to finish; or, where that rank was killed before its commit, by the next
    launch (`complete_snapshots`, before it decides what to resume)."""
    root = tmp_path / "checkpoints"
    earlier = root / "step_1"  # an earlier run's step 1 (this run resumed from an older checkpoint)
    earlier.mkdir(parents=True)
    (earlier / MANIFEST_FILE).write_text('{"step": 1, "note": "earlier run"}')
    spawn(_write_snapshot, args=(2, free_port(), str(tmp_path), committer_killed), nprocs=2)
    if committer_killed:
        assert committed_checkpoints(root) == [earlier]
        (line,) = complete_snapshots(root)
        assert line.endswith("committed as " + str(earlier) + " (its ranks all wrote it)")
    assert committed_checkpoints(root) == [root / "step_1"]  # committed by whichever rank finished last
    assert [p.name for p in root.glob("step_1.abandoned*")] and "earlier run" in next(
        root.glob("step_1.abandoned*")
    ).joinpath(MANIFEST_FILE).read_text()
    checkpoint = root / "step_1"
    assert damage(checkpoint) == []
    assert read_manifest(checkpoint) == {
        "world_size": 2,
        "fingerprint": "f",
        "wandb_id": "w",
        "step": 1,
        "written_by": "snapshot",
    }
    assert (checkpoint / "extra.bin").read_bytes() == b"rank 0's"
    spawn(_load_snapshot, args=(2, free_port(), str(tmp_path)), nprocs=2)
    spawn(_load_snapshot, args=(1, free_port(), str(tmp_path)), nprocs=1)


@pytest.mark.launch
def test_a_snapshot_keeps_torchaos_quantized_states_as_they_are_and_resumes_them_exactly(tmp_path):
    """torchao's 8-bit moments are copied as their codes and scales (their own copy_ into a plain host buffer
    would dequantize them: 4 bytes an element where they hold 1), written, and loaded back to the same values."""
    optim = pytest.importorskip("torchao.optim.subclass_8bit")
    moment = optim.OptimState8bit.zeros((4096,), signed=True, block_size=256)
    moment.copy_(torch.linspace(-1, 1, 4096))
    copied = HostBuffers(pinned=False)({"m": moment, "w": torch.ones(3)})
    assert type(copied["m"]) is type(moment) and torch.equal(copied["m"].codes, moment.codes)
    assert sum(buffer.nbytes for buffer in copied_buffers(copied)) < 4096 * 2  # codes, scales and qmap: not fp32
    spawn(_write_snapshot, args=(2, free_port(), str(tmp_path), False, "AdamW8bit"), nprocs=2)
    spawn(_load_snapshot, args=(2, free_port(), str(tmp_path), "AdamW8bit"), nprocs=2)


def copied_buffers(copied: dict) -> list[torch.Tensor]:
    moment = copied["m"]
    return [getattr(moment, name) for name in moment.__tensor_flatten__()[0]]


def test_a_snapshot_missing_a_rank_is_never_committed(tmp_path):
    """One rank's write alone (its peer killed first) leaves a .snapshot directory that nothing resumes from,
    removed when the next run starts."""
    root = tmp_path / "checkpoints"
    partial = root / "step_3.snapshot"
    (partial / "rank_0").mkdir(parents=True)
    (partial / "done_rank_0").write_bytes(b"2")  # of 2 ranks: rank 1 never finished
    assert committed_checkpoints(root) == []
    assert complete_snapshots(root) == [f"{partial} removed: a rank never finished writing it"]
    assert not partial.exists() and not (root / "step_3" / MANIFEST_FILE).exists()


def test_steps_longer_than_half_of_plain_torchruns_grace_are_told_of_the_remedies(monkeypatch, caplog):
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert killing_grace_s(snapshots_on=False) is None  # one process: nothing kills it
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv(interrupts.LAUNCHER_DIR_ENV, "/tmp/x")
    assert killing_grace_s(snapshots_on=False) is None  # chattune run: waits however long the stop takes
    monkeypatch.delenv(interrupts.LAUNCHER_DIR_ENV)
    assert killing_grace_s(snapshots_on=True) is None  # the snapshot is written within the grace
    grace = killing_grace_s(snapshots_on=False)
    assert grace == 30 and not advise(14.0, grace) and not advise(40.0, None)
    with caplog.at_level(logging.WARNING, logger="chattune.checkpoint.snapshot"):
        assert advise(16.0, grace)
    (message,) = caplog.messages
    assert "a step takes 16 s and torchrun kills its workers 30 s after" in message
    assert "`chattune run`" in message and "snapshot_steps=true" in message


def test_on_cuda_the_copies_run_on_a_side_stream_and_only_the_next_optimizer_step_waits_for_them(tmp_path):
    """The staged copies were queued on the compute stream, so the next step's kernels waited behind them (about
    doubling a 0.6B step on a GPU). Now (CUDA's stream calls stood in for, in the order they are made): the side
    stream waits for the step's kernels, the copies are made on it and its event recorded there; the next optimizer
    step's stream waits for that event, once, before the update overwrites what the copies read; a step with
    nothing staged since waits for nothing; after close() no step waits, and the copies are finished first."""
    from torch.distributed.checkpoint.stateful import Stateful

    calls: list[str] = []

    class Stream:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait_stream(self, other) -> None:
            calls.append(f"{self.name} waits for {other.name}")

        def wait_event(self, event) -> None:
            calls.append(f"{self.name} waits for {event.name}")

        def synchronize(self) -> None:
            calls.append(f"{self.name} synchronized")

    class Event:
        count = 0

        def __init__(self) -> None:
            Event.count += 1
            self.name = f"copies {Event.count}"

        def record(self, stream) -> None:
            calls.append(f"{self.name} recorded on {stream.name}")

    compute, current = Stream("compute"), {"stream": None}
    current["stream"] = compute

    class On:  # torch.cuda.stream(s)
        def __init__(self, stream) -> None:
            self.stream = stream

        def __enter__(self):
            current["stream"] = self.stream

        def __exit__(self, *_):
            current["stream"] = compute

    copy = HostBuffers.__call__

    def logged_copy(self, state, stream=None):
        calls.append(f"copies on {current['stream'].name} (given {stream.name if stream else None})")
        return copy(self, state, stream)

    class Weights(Stateful):
        def __init__(self, model) -> None:
            self.model = model

        def state_dict(self):
            return self.model.state_dict()

        def load_state_dict(self, state) -> None:
            self.model.load_state_dict(state)

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = snapshot.RunState()
    state.add("model", Weights(model), sharded=True)
    with (
        mock.patch("torch.cuda.Stream", lambda device: Stream("side")),
        mock.patch("torch.cuda.Event", Event),
        mock.patch("torch.cuda.current_stream", lambda device=None: current["stream"]),
        mock.patch("torch.cuda.stream", On),
        mock.patch.object(HostBuffers, "__call__", logged_copy),
    ):
        snapshots = Snapshots(tmp_path, state, {}, {}, torch.device("cuda"), optimizer)
        snapshots.stage(1)
        model.weight.grad = torch.ones_like(model.weight)
        optimizer.step()
        optimizer.step()  # nothing staged since: no wait
        snapshots.stage(2)
        optimizer.step()
        snapshots.close()
        optimizer.step()
    assert calls == [
        "side waits for compute",
        "copies on side (given side)",
        "copies 1 recorded on side",
        "compute waits for copies 1",
        "side waits for compute",
        "copies on side (given side)",
        "copies 2 recorded on side",
        "compute waits for copies 2",
        "side synchronized",
    ], calls


def _when_slow_worker(rank: int, world_size: int, port: int, out: str) -> None:
    init_worker_process_group(rank, world_size, port)
    started = []
    when_slow = snapshot.SnapshotsWhenSlow(grace=4, start=lambda: started.append(True) or "snapshots")
    # step 1: both ranks short; step 2: rank 1 alone takes 3 s (> 4 / 2): both start them, at the same step
    early = [when_slow.after_step(step, 3.0 if (step, rank) == (2, 1) else 0.5) for step in (1, 2)]
    # past the first 10 steps the ranks agree every 10th step, on the longest step since: 15's, at 20
    later = snapshot.SnapshotsWhenSlow(grace=4, start=lambda: started.append(True) or "snapshots")
    late = [later.after_step(step, 3.0 if (step, rank) == (15, 1) else 0.5) for step in range(11, 21)]
    torch.save({"early": early, "late": late, "started": len(started)}, f"{out}.{rank}")
    shutdown_distributed()
    exit_process()


@pytest.mark.launch
def test_auto_snapshots_start_on_every_rank_after_the_first_step_that_was_long_on_any(tmp_path):
    """snapshot_steps=auto: every rank must stage the same steps (a snapshot is committed when all ranks wrote the
    same one), so the ranks agree: a step that took more than half of torchrun's grace on one rank starts them
    on all, after that step (past the first 10 steps, at the next 10th: the check costs an all-reduce); shorter
    steps start nothing."""
    out = str(tmp_path / "decisions")
    spawn(_when_slow_worker, args=(2, free_port(), out), nprocs=2)
    for rank in (0, 1):
        assert torch.load(f"{out}.{rank}") == {
            "early": [None, "snapshots"],
            "late": [None] * 9 + ["snapshots"],
            "started": 2,
        }
