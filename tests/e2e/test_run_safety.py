"""Nothing lost, nothing silent, no run damaging another: recipe-level checks with real processes (torchrun
and 2 gloo ranks where ranks matter) for the data-loss and crash bugs a new user hit, each reproduced
first, and for the resume policy (README, "What chattune promises")."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from test_sft_recipe import read_metrics

import conftest
from chattune.config.paths import DEMO_ASSETS
from conftest import PROJECT_ROOT, SMALL_MODEL

pytestmark = pytest.mark.launch  # every test here starts processes

DEMO_CHATS = (DEMO_ASSETS / "chat_train.jsonl").read_text().splitlines(keepends=True)
SMALL = [
    "max_steps=6",
    "save_every=2",
    "log_every=1",
    "eval_every=0",
    "data.eval=[]",
    "data.report_records=0",
    "data.max_tokens_per_microbatch=512",
    "data.buffer_records=16",
]


def torchrun(nproc: int, recipe: str, *overrides: str, **kwargs):
    return conftest.launch(
        conftest.torchrun(
            recipe,
            *overrides,
            nproc=nproc,
        ),
        **kwargs,
    )


def launch(
    *args: str, nproc: int | None = None, env: dict | None = None, real_torchrun: bool = False
) -> subprocess.CompletedProcess:
    """A recipe launch that may fail: `python RECIPE ARGS...`, or torchrun with `nproc` ranks (`conftest.launch`;
    `real_torchrun` where the test reads torchrun's own report)."""
    command = [sys.executable, *args] if nproc is None else conftest.torchrun(args[0], *args[1:], nproc=nproc)
    return conftest.launch(command, env_extra=env, check=False, real_torchrun=real_torchrun)


def chats(tmp_path: Path, count: int = 40, name: str = "chats.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(DEMO_CHATS[:count]))
    return path


def steps(out: Path) -> list[int]:
    return [m["step"] for m in read_metrics(out)]


def our_traceback_lines(stderr: str) -> list[str]:
    """Traceback lines from chattune's or a recipe's code (torchrun's own report of a failed worker is a
    traceback of torch/distributed/run.py, which is not ours to remove)."""
    return [
        line
        for line in stderr.splitlines()
        if line.strip().startswith("File ") and ("chattune" in line or "recipes/" in line)
    ]


def worker_logs(log_dir: Path) -> str:
    """Every worker's stdout and stderr that torchrun's `--log-dir DIR --tee 3` kept apart from its agent's words."""
    return "".join(path.read_text() for path in sorted(log_dir.rglob("*.log")))


def test_dpo_on_two_ranks_counts_a_pair_with_identical_replies_on_one_rank(tmp_path):
    """The skip counters of both ranks are all-reduced: a reason seen on one rank only used to give the
    ranks different keys, and gloo aborted the whole run (SIGABRT) at the data report."""
    pairs = [json.loads(line) for line in (DEMO_ASSETS / "preference_train.jsonl").read_text().splitlines()[:30]]
    pairs[7]["rejected"] = pairs[7]["chosen"]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    out = tmp_path / "dpo"
    result = torchrun(
        2,
        "recipes/dpo.py",
        *SMALL_MODEL,
        f"output_dir={out}",
        "model.path=null",
        "max_steps=3",
        "save_every=0",
        "eval_every=0",
        f"data.train=[{{path: {data}, format: preference}}]",
        "data.eval=[]",
        "data.report_records=null",
        "data.max_tokens_per_microbatch=1024",
    )
    log = result.stdout + result.stderr
    assert "training data (30 of 30 records sampled): records read: 30; skipped: 1 (identical_replies 1)" in log
    assert (
        log.count(
            f"] skipped (identical_replies): {data} record 8 (line 8): the chosen and the rejected reply are "
            "the same, nothing to prefer\n"
        )
        == 1
    )  # a reason, as every skip's line gives
    assert "skipped {'overlong': 0, 'no_trainable_tokens': 0, 'identical_replies': 1, 'bad_record': 0}" in log


def test_split_records_are_all_trained_on_two_ranks(tmp_path):
    """data.overlong=split: the records after a split one in the same read were lost (7 of 61 never
    trained while the report said all were read). The ledger shows every record trained, in one epoch."""
    data = chats(tmp_path, 30)
    out = tmp_path / "run"
    result = torchrun(
        2,
        "recipes/sft.py",
        *SMALL_MODEL,
        f"output_dir={out}",
        f"data.train=[{data}]",
        "data.overlong=split",
        "data.max_tokens_per_microbatch=64",
        "data.num_epochs=1",
        "max_steps=100",
        "ledger=true",
        "save_every=0",
        "eval_every=0",
        "data.eval=[]",
        "data.report_records=null",
        "data.buffer_records=8",
    )
    log = result.stdout + result.stderr
    assert "training data (30 of 30 records sampled): records read: 30;" in log
    trained = Counter(
        i
        for path in (out / "ledger").glob("rank*.jsonl")
        for line in path.read_text().splitlines()
        for i in json.loads(line)["doc_ids"]
    )
    assert sorted(trained) == list(range(30)), "records never trained"
    assert sum(trained.values()) > 30, "the 64-token budget should have split some records into several pieces"


def test_a_second_run_into_a_busy_output_dir_is_refused_and_a_killed_launcher_stops_its_workers(tmp_path):
    """Two runs into one output_dir used to interleave their checkpoints and metrics (steps 1,2,3,4,10,5,...)."""
    data = chats(tmp_path)
    out = tmp_path / "run"
    args = [
        "recipes/sft.py",
        *SMALL_MODEL,
        f"output_dir={out}",
        f"data.train=[{data}]",
        *SMALL,
        "max_steps=400",
        "save_every=1",
    ]
    first = subprocess.Popen(
        conftest.torchrun(*args, nproc=2),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    try:
        deadline = time.time() + 300
        while not ((out / "metrics.jsonl").is_file() and len(read_metrics(out)) >= 2):
            assert first.poll() is None and time.time() < deadline, "the first run did not get going"
            time.sleep(0.5)
        holder = json.loads((out / ".chattune.lock").read_text())
        second = launch(*args, nproc=2)
        assert second.returncode != 0
        assert (
            second.stderr.count(
                f"chattune: error: output_dir {out} is in use by another run: pid {holder['pid']} on "
                f"host {holder['host']}"
            )
            == 1
        ), second.stderr[-3000:]
        assert not our_traceback_lines(second.stderr)

        # kill -9 of torchrun alone (its workers run in sessions of their own): the workers stop with it.
        first.send_signal(signal.SIGKILL)
        first.wait()
        deadline = time.time() + 60
        while OutputDirLockHeld(out) and time.time() < deadline:
            time.sleep(0.5)
        assert not OutputDirLockHeld(out), "the workers outlived their launcher"
    finally:
        first.kill()
    before = steps(out)
    assert before == list(range(1, len(before) + 1))
    resumed = launch(*args[:-2], f"max_steps={len(before) + 3}", nproc=2)  # resume=auto from its last checkpoint
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert steps(out) == list(range(1, len(before) + 4))


def OutputDirLockHeld(out: Path) -> bool:
    from chattune.checkpoint.output_dir import OutputDirLock

    return OutputDirLock(out).is_held()


def test_an_earlier_run_is_never_overwritten_nor_resumed_by_accident(tmp_path):
    data = chats(tmp_path)
    out = tmp_path / "run"
    base = ["recipes/sft.py", *SMALL_MODEL, f"output_dir={out}", f"data.train=[{data}]", *SMALL]
    assert launch(*base).returncode == 0  # steps 1..6, checkpoints step_2, 4, 6, hf/
    first_metrics, first_config = (out / "metrics.jsonl").read_text(), (out / "config.yaml").read_text()

    # resume=null into a used directory (the remedy the resume error used to suggest) is refused, untouched.
    refused = launch(*base, "resume=null")
    assert refused.returncode != 0 and refused.stderr.count("chattune: error: ") == 1
    assert f"output_dir {out} holds an earlier run's results (checkpoints, metrics.jsonl, hf)" in refused.stderr
    assert "overwrite=true" in refused.stderr and (out / "metrics.jsonl").read_text() == first_metrics

    # overwrite=true starts over; the earlier files are moved aside, never deleted, never resumed.
    fresh = launch(*base, "resume=null", "overwrite=true", "max_steps=4", "keep_last_n=1")
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert (out / "metrics.jsonl.abandoned").read_text() == first_metrics
    # its config too (it used to be replaced in place)
    assert (out / "config.yaml.abandoned").read_text() == first_config
    assert "max_steps: 4" in (out / "config.yaml").read_text()
    assert sorted(p.name for p in (out / "checkpoints.abandoned").iterdir()) == ["step_2", "step_4", "step_6"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_4"]  # keep_last_n prunes its own only
    assert (out / "hf.abandoned" / "model.safetensors.index.json").is_file() and steps(out) == [1, 2, 3, 4]

    # resume=PATH to an older checkpoint: the newer ones (another trajectory now) are set aside, so neither
    # keep_last_n nor a later resume=auto prefers them.
    longer = launch(*base, "max_steps=8", "keep_last_n=null")
    assert longer.returncode == 0 and sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step_4",
        "step_6",
        "step_8",
    ]
    older = launch(
        *base,
        f"resume={out}/checkpoints/step_4",
        "max_steps=8",
        "keep_last_n=2",
        "optimizer.lr=1e-3",
        "resume_allow_changes=[optimizer.lr]",
    )
    assert older.returncode == 0, older.stderr[-3000:]
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["step_6", "step_6.abandoned", "step_8", "step_8.abandoned"], names
    assert steps(out) == list(range(1, 9)) and (out / "hf.abandoned.2").is_dir()
    abandoned_curve = [
        json.loads(line)["step"] for line in (out / "metrics.jsonl.abandoned.2").read_text().splitlines()
    ]
    assert abandoned_curve == list(range(1, 9))
    # That run relaunched is complete (on any number of ranks): nothing to do, nothing touched, said once (it used to
    # resume at step 8, export again and set the identical hf/ aside, a full copy per relaunch).
    before = files_of(out)
    again = launch(*base, "max_steps=8", "optimizer.lr=1e-3", "resume_allow_changes=[optimizer.lr]", nproc=2)
    assert again.returncode == 0, again.stderr[-3000:]
    complete = (
        f"chattune: output_dir {out} holds this run, complete: trained to step 8 and exported to {out}/hf. Nothing to "
        f"do. To train further raise max_steps (the run continues from {out}/checkpoints/step_8); to train it again, "
        "start over with overwrite=true (its files are moved aside as *.abandoned, not deleted)."
    )
    assert again.stderr.splitlines()[-1] == complete and again.stderr.count(complete) == 1
    assert files_of(out) == before and "resumed from" not in again.stdout  # (its remedies: tests/e2e/test_relaunch.py)


def files_of(directory: Path) -> list[tuple[str, int, int]]:
    """Every file under `directory`: its path, size and modification time."""
    return sorted(
        (str(p.relative_to(directory)), p.stat().st_size, p.stat().st_mtime_ns)
        for p in directory.rglob("*")
        if p.is_file()
    )


def test_a_typo_at_launch_is_reported_as_validate_reports_it():
    result = launch("recipes/sft.py", *SMALL_MODEL, "optimizer.lrr=1e-3", "max_stepz=3", "data.overlong=trim")
    assert result.returncode != 0
    assert result.stderr.splitlines() == [
        "chattune: sft with sft/tiny on 1 rank(s): checking the config, then reading the data and loading the model",
        "chattune: error: optimizer.lrr: unknown key; did you mean optimizer.lr?",
        "max_stepz: unknown key; did you mean max_steps?",
        "data.overlong: 'trim' is not one of drop, truncate, split, error",
        "3 problem(s)",
    ]
    relative = launch("recipes/sft.py", "--config-path", "no_such_configs", "--config-name", "mine")
    assert relative.returncode != 0 and relative.stderr.count("chattune: error: ") == 1
    assert (
        f"--config-path: {PROJECT_ROOT / 'recipes' / 'no_such_configs'} is not a directory (a relative --config-path "
        "is resolved from the recipe's directory" in relative.stderr
    )


def test_a_user_error_on_one_rank_is_printed_once_without_a_traceback(tmp_path):
    """It used to drown in 66-124 lines: a traceback per rank and another rank's "Connection closed by peer". What
    chattune prints is checked: the workers' own output (torchrun's --log-dir keeps it apart) and chattune's code in
    any traceback. torchrun's agent may add its own words under load (a peer's closed connection, after the failing
    rank exits, with the agent's traceback): those are torchrun's, not the run's."""
    lines = DEMO_CHATS[:40]
    lines[17] = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}]}) + "\n"
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(lines))
    command = conftest.torchrun(
        "recipes/sft.py",
        *SMALL_MODEL,
        f"output_dir={tmp_path / 'run'}",
        f"data.train=[{data}]",
        "max_steps=50",
        "data.eval=[]",
        "save_every=0",
        "data.max_tokens_per_microbatch=512",
        "data.report_records=0",
    )
    recipe = command.index("recipes/sft.py")
    command[recipe:recipe] = ["--log-dir", str(tmp_path / "logs"), "--tee", "3"]  # each worker's output in a file too
    # real torchrun: its report of the failed rank is part of what the user reads
    result = conftest.launch(command, check=False, real_torchrun=True)
    assert result.returncode != 0
    message = f"chattune: error: {data} record 18 (line 18): message 1 has role 'wizard'"
    assert (result.stdout + result.stderr).count(message) == 1
    workers = worker_logs(tmp_path / "logs")
    assert workers.count(message) == 1, workers[-3000:]  # one rank reports; the other stays silent
    assert "Traceback" not in workers and "Connection closed by peer" not in workers, workers[-3000:]
    assert not our_traceback_lines(result.stdout + result.stderr)
    assert "the chattune error printed above (a user error, not a bug: no traceback)" in result.stderr
    # torchrun's agent ends the other rank with SIGTERM: not a stop to announce, nothing had trained
    assert "stopping after the current step" not in workers, workers[-3000:]


def base_run(tmp_path: Path, data: Path, *extra: str) -> list[str]:
    return ["recipes/sft.py", *SMALL_MODEL, f"output_dir={tmp_path / 'run'}", f"data.train=[{data}]", *SMALL, *extra]


def test_resume_policy_horizon_numerics_and_refusals(tmp_path):
    data = chats(tmp_path)
    straight = launch(
        *base_run(tmp_path, data)[:1],
        *[a.replace("/run", "/straight") for a in base_run(tmp_path, data)[1:]],
        "data.num_workers=2",
    )
    assert straight.returncode == 0
    args = base_run(tmp_path, data)
    out = tmp_path / "run"
    assert launch(*args, "stop_after_step=3").returncode == 0

    # stop_after_step at or before the resumed step: said, not silently run on.
    stop = launch(*args, "stop_after_step=2")
    assert stop.returncode != 0 and "stop_after_step=2, but this run continues from" in stop.stderr

    # Refused: data, tokenizer, seed and model changes; the message names the exact override that accepts them.
    seed = launch(*args, "seed=7", "model.config.hidden_size=96")  # a valid model (6 heads of 16), another one
    assert seed.returncode != 0 and "config seed: 42 -> 7" in seed.stderr
    assert "resume_allow_changes=[model.config.hidden_size,seed]" in seed.stderr

    # Numerics-only (loader workers, loss chunks): accepted with a note, and the run continues exactly.
    resumed = launch(*args, "data.num_workers=2", "loss.chunk_size=100")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "config data.num_workers: 0 -> 2 (the same documents and updates, computed differently)" in resumed.stdout
    straight_losses = [m["loss"] for m in read_metrics(tmp_path / "straight")]
    assert [m["loss"] for m in read_metrics(out)] == pytest.approx(straight_losses, rel=1e-5)

    # The horizon: accepted with a warning that gives the learning rate at the resume step, old and new.
    longer = launch(*args, "max_steps=40", "data.num_workers=2", "loss.chunk_size=100")
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert (
        "resuming with another learning-rate schedule (max_steps: 6 -> 40): the LR at step 7 is 0.0021 (it was "
        "0.0021 under the checkpoint's schedule)" in longer.stdout
    )  # the first step it trains, 7 of sft/tiny's 10 warmup steps: 7/10 x 3e-3 under either horizon
    assert steps(out)[-1] == 40


def test_a_fixed_record_is_named_and_can_be_accepted_alone(tmp_path):
    data = chats(tmp_path)
    args = base_run(tmp_path, data)
    assert launch(*args, "stop_after_step=2").returncode == 0
    lines = data.read_text().splitlines(keepends=True)
    fixed = json.loads(lines[11])
    fixed["messages"][-1]["content"] += " (fixed)"
    lines[11] = json.dumps(fixed) + "\n"
    data.write_text("".join(lines))
    refused = launch(*args)
    assert refused.returncode != 0
    assert f"data file {data}: record 12 (line 12) changed" in refused.stderr
    assert f"resume_allow_changes=[{data}:12]" in refused.stderr
    accepted = launch(*args, f"resume_allow_changes=[{data}:12]")
    assert accepted.returncode == 0, accepted.stderr[-3000:]
    assert f"data file {data}: record 12 (line 12) changed (accepted by resume_allow_changes)" in accepted.stdout
    lines[3] = lines[3].replace('"content": "', '"content": "x', 1)  # another record: accepting 12 is not enough
    data.write_text("".join(lines))
    assert launch(*args, "max_steps=8", f"resume_allow_changes=[{data}:12]").returncode != 0


def test_bad_records_are_skipped_counted_and_logged_alike_by_whichever_rank_reads_them(tmp_path):
    """Per rank each rank reads, counts and logs its own share (here each meets bad records); world-size-invariant
    every rank reads every record, and each skip is still counted and logged once, by rank 0. Every line names the
    file, the record and the reason, and a record's line is the same whichever rank logs it."""
    lines = DEMO_CHATS[:40]
    # (epoch 0's shares, seed 42: rank 0 reads 12, 22 and 30 of these, rank 1 reads 3, 9 and 33)
    for index in (3, 22, 30, 33):
        lines[index] = json.dumps({"messages": [{"role": "user", "content": "no reply"}]}) + "\n"
    lines[9] = "{not json\n"
    lines[12] = '{"messages": [{"role": "user", "content": "a\tb"}]}\n'  # a control character in a string
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(lines))
    reasons = {index + 1: "no assistant message, nothing to train" for index in (3, 22, 30, 33)}
    reasons |= {10: "unparseable JSON at column 2: ", 13: "unparseable JSON at column 45: "}  # and json's words
    logged = {}
    for invariant in (False, True):
        result = torchrun(
            2,
            "recipes/sft.py",
            *SMALL_MODEL,
            f"output_dir={tmp_path / str(invariant)}",
            f"data.train=[{data}]",
            "data.on_bad_record=skip",
            "data.num_epochs=1",
            "max_steps=50",
            "save_every=0",
            "eval_every=0",
            "data.eval=[]",
            "data.report_records=0",
            "data.max_tokens_per_microbatch=512",
            *(["data.microbatches_per_step=2"] if invariant else []),
        )
        log = result.stdout + result.stderr
        assert "'bad_record': 6" in log
        assert "34 documents" in log  # the epoch's figures: every other record trained
        skips = [line.split(" [", 1)[1] for line in log.splitlines() if "] skipped (" in line]
        # "rankR] skipped (bad_record): FILE record N (line N): reason"
        by_record = {}
        for line in skips:
            rank, detail = line.split("] skipped (bad_record): ")
            record = int(detail.removeprefix(f"{data} record ").split(" ", 1)[0])
            assert detail.startswith(f"{data} record {record} (line {record}): {reasons[record]}"), line
            assert record not in by_record, f"record {record} logged twice"
            by_record[record] = (rank, detail)
        assert sorted(by_record) == sorted(reasons)
        logged[invariant] = by_record
    assert {rank for rank, _ in logged[False].values()} == {"rank0", "rank1"}  # each rank met its own
    assert {rank for rank, _ in logged[True].values()} == {"rank0"}
    assert {r: d for r, (_, d) in logged[False].items()} == {r: d for r, (_, d) in logged[True].items()}


def test_overwrite_starts_over_and_every_remedy_of_a_resume_refusal_works_as_written(tmp_path):
    """overwrite=true used to resume (resume=auto found the checkpoint), accept max_steps below its step as a
    horizon change, train nothing, cut metrics.jsonl and replace hf/ with no copy. And each remedy that a
    refusal offers (a horizon behind the checkpoint, a stop_after_step with no step left) works as written."""
    data = chats(tmp_path)
    out = tmp_path / "run"
    base = ["recipes/sft.py", *SMALL_MODEL, f"output_dir={out}", f"data.train=[{data}]", *SMALL]
    assert launch(*base, "max_steps=5").returncode == 0  # checkpoints step_2, step_4; hf/ at step 5
    first_metrics = (out / "metrics.jsonl").read_text()
    first_export = (out / "hf" / "model.safetensors.index.json").read_text()

    behind = launch(*base, "max_steps=3")  # resume=auto: step 4
    assert behind.returncode != 0 and behind.stderr.count("chattune: error: ") == 1
    assert f"max_steps=3, but this run continues from {out}/checkpoints/step_4 at step 4" in behind.stderr
    assert (out / "metrics.jsonl").read_text() == first_metrics  # refused before anything was touched
    # Its remedies, as written: an earlier checkpoint with resume=PATH ...
    earlier = launch(*base, "max_steps=3", f"resume={out}/checkpoints/step_2")
    assert earlier.returncode == 0, earlier.stderr[-3000:]
    assert steps(out) == [1, 2, 3] and (out / "checkpoints" / "step_4.abandoned").is_dir()
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl.abandoned").read_text().splitlines()] == [
        1,
        2,
        3,
        4,
        5,
    ]
    # ... a horizon raised past the checkpoint (here with a stop after step 4: a job's time slice) ...
    raised = launch(*base, "max_steps=6", "stop_after_step=4")
    assert (
        raised.returncode == 0 and f"resumed from {out}/checkpoints/step_2 at step 2" in raised.stdout + raised.stderr
    )

    # stop_after_step with no step left: raised, or an earlier checkpoint, or dropped.
    no_step_left = launch(*base, "max_steps=6", "stop_after_step=4")
    assert (
        no_step_left.returncode == 1
        and no_step_left.stderr.count(
            f"chattune: error: stop_after_step=4, but this run continues from {out}/checkpoints/step_4 at step 4: there is "
            "no step left to stop after. Raise stop_after_step or drop it, or resume an earlier checkpoint with "
            "resume=PATH."
        )
        == 1
    )
    assert launch(*base, "max_steps=6", "stop_after_step=5").returncode == 0 and steps(out) == [1, 2, 3, 4, 5]
    earlier = launch(*base, "max_steps=6", "stop_after_step=5", f"resume={out}/checkpoints/step_4")
    assert (
        earlier.returncode == 0
        and f"resumed from {out}/checkpoints/step_4 at step 4" in earlier.stdout + earlier.stderr
    )
    assert launch(*base, "max_steps=6").returncode == 0 and steps(out) == [1, 2, 3, 4, 5, 6]

    # ... and overwrite=true, which now starts over: everything set aside, nothing resumed.
    mixed = launch(*base, "max_steps=2", "overwrite=true", f"resume={out}/checkpoints/step_2")
    assert mixed.returncode != 0 and "overwrite=true starts over, and resume=" in mixed.stderr
    fresh = launch(*base, "max_steps=2", "overwrite=true")
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert "resumed from" not in fresh.stdout + fresh.stderr and steps(out) == [1, 2]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2"]
    assert "step_4.abandoned" in [p.name for p in (out / "checkpoints.abandoned").iterdir()]
    assert first_export in [(p / "model.safetensors.index.json").read_text() for p in out.glob("hf.abandoned*")]


def test_a_resumed_run_sets_aside_the_export_and_metrics_it_replaces(tmp_path):
    """A 7-step run saved at step 5, relaunched with max_steps=12, resumed from step 5 and wrote its export over
    the step-7 one. Now the step-7 export (the adapter directory and the merged model) and the metrics lines
    after step 5 are kept aside."""
    from safetensors.torch import load_file

    data = chats(tmp_path)
    out = tmp_path / "run"
    base = [
        "recipes/sft.py",
        *SMALL_MODEL,
        f"output_dir={out}",
        f"data.train=[{data}]",
        *SMALL,
        "save_every=5",
        "peft=lora",
        "export.merge=true",
    ]
    assert launch(*base, "max_steps=7").returncode == 0
    adapter_at_7 = load_file(out / "adapter" / "adapter_model.safetensors")
    metrics_at_7 = (out / "metrics.jsonl").read_text()
    resumed = launch(*base, "max_steps=12")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {out}/checkpoints/step_5 at step 5" in resumed.stdout + resumed.stderr
    assert (out / "metrics.jsonl.abandoned").read_text() == metrics_at_7 and steps(out) == list(range(1, 13))
    kept = load_file(out / "adapter.abandoned" / "adapter_model.safetensors")
    assert kept.keys() == adapter_at_7.keys() and all((kept[k] == adapter_at_7[k]).all() for k in kept)
    assert (out / "hf.abandoned" / "model.safetensors.index.json").is_file() and (out / "hf").is_dir()
    assert "moved aside" in resumed.stdout + resumed.stderr


def test_a_damaged_checkpoint_is_named_with_the_intact_one_to_resume_from(tmp_path):
    """A shard file lost after the commit: validate said OK, then both ranks tracebacked in the load. Now the
    checkpoint's files are checked against its metadata, at validate and at launch, and the remedy works."""
    from chattune.launch.validate import run_validate

    data = chats(tmp_path)
    out = tmp_path / "run"
    base = ["recipes/sft.py", *SMALL_MODEL, f"output_dir={out}", f"data.train=[{data}]", *SMALL]
    assert launch(*base, nproc=2).returncode == 0  # checkpoints step_2, 4, 6
    (out / "checkpoints" / "step_6" / "__1_0.distcp").unlink()
    expected = (
        f"the checkpoint {out}/checkpoints/step_6 is damaged: __1_0.distcp is missing. The newest intact "
        f"checkpoint before it is {out}/checkpoints/step_4 (step 4): continue from there with "
        f"resume={out}/checkpoints/step_4"
    )
    report, ok = run_validate(
        "sft/tiny", [a for a in base[1:]] + ["max_steps=8"], PROJECT_ROOT / "configs", world_size=2
    )
    assert not ok and f"resume: {expected}" in report.splitlines()
    refused = launch(*base, "max_steps=8", nproc=2)
    assert refused.returncode != 0 and refused.stderr.count("chattune: error: ") == 1
    assert f"chattune: error: {expected}" in refused.stderr and not our_traceback_lines(refused.stderr)
    resumed = launch(*base, "max_steps=8", f"resume={out}/checkpoints/step_4", nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {out}/checkpoints/step_4 at step 4" in resumed.stdout + resumed.stderr
    assert steps(out) == list(range(1, 9)) and (out / "checkpoints" / "step_6.abandoned").is_dir()


def test_cfg_job_is_a_dry_run(tmp_path):
    """README's dry run: Hydra's --cfg job prints the composed config, overrides applied, and trains nothing."""
    out = tmp_path / "run"
    result = launch("recipes/sft.py", "--cfg", "job", *SMALL_MODEL, "max_steps=3", f"output_dir={out}")
    assert result.returncode == 0, result.stderr
    from omegaconf import OmegaConf

    printed = OmegaConf.create(result.stdout)
    assert printed.max_steps == 3 and printed.output_dir == str(out) and printed.data.max_tokens_per_microbatch == 2048
    assert not out.exists() and result.stderr == ""
