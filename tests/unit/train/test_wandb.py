"""logger=wandb, offline: what wandb really records, read back from its own run file (the installed wandb
writes config, history and summary only into `run-<id>.wandb` when offline, no files/*.json)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_sft_recipe import read_metrics

from chattune.train.metrics import MetricLogger
from conftest import PROJECT_ROOT, SMALL_MODEL, launch

_BLOCK = 32 * 1024  # the .wandb file is a LevelDB-style log: 32 KiB blocks of chunks
_CHUNK_HEADER = 7  # CRC32C (4 bytes), length (2, little-endian), type (1: full, 2: first, 3: middle, 4: last)


def wandb_records(run_file: Path) -> list:
    """The protobuf records (wandb_internal_pb2.Record) of a .wandb run file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", f"{run_file} is not a wandb run file"
    records, pending, pos = [], b"", 7  # the file header: ":W&B", a 2-byte magic, a version byte
    while pos + _CHUNK_HEADER <= len(data):
        if _BLOCK - pos % _BLOCK < _CHUNK_HEADER:  # a block's tail too short for a chunk is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        pending += data[pos + _CHUNK_HEADER : pos + _CHUNK_HEADER + length]
        pos += _CHUNK_HEADER + length
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return records


def _name(item) -> str:
    return item.key or ".".join(item.nested_key)


def read_offline_run(run_dir: Path) -> tuple[dict, list[dict], dict]:
    """(config, history rows, final summary) of one offline run directory."""
    (run_file,) = run_dir.glob("run-*.wandb")
    config, history, summary = {}, [], {}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind in ("run", "config"):
            updates = record.run.config.update if kind == "run" else record.config.update
            config.update({_name(item): json.loads(item.value_json) for item in updates})
        elif kind == "history":
            history.append({_name(item): json.loads(item.value_json) for item in record.history.item})
        elif kind == "summary":
            summary.update({_name(item): json.loads(item.value_json) for item in record.summary.update})
    return config, history, summary


@pytest.fixture
def wandb_env(tmp_path, monkeypatch) -> Iterator[dict]:
    """Offline wandb with every directory it writes to in tmp_path, no API key, no service of another test."""
    env = {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DIR": str(tmp_path / "wandb_dir"),
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb_cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb_data"),
        "WANDB_SERVICE": "",
        "NETRC": str(tmp_path / "no_netrc"),
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    yield env
    import wandb

    wandb.teardown()  # this process's wandb service, if a test started one


def killed_wandb_run(wandb_dir: Path, env: dict) -> str:
    """Start a wandb run in a process that is then SIGKILLed; return the WANDB_SERVICE token it left."""
    script = (
        "import os, signal, wandb\n"
        f"run = wandb.init(project='chattune', dir={str(wandb_dir)!r})\n"
        "run.log({'loss': 1.0}, step=1)\n"
        "print(os.environ['WANDB_SERVICE'], flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    killed = subprocess.run(
        [sys.executable, "-c", script], env={**os.environ, **env}, capture_output=True, text=True, timeout=60
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    return killed.stdout.strip()


@pytest.mark.launch
def test_sft_run_records_config_every_metric_and_the_hf_directory(tmp_path, wandb_env):
    out = tmp_path / "run"
    eval_records = (PROJECT_ROOT / "chattune" / "assets" / "demo" / "chat_eval.jsonl").read_text().splitlines()[:4]
    (tmp_path / "eval.jsonl").write_text("\n".join(eval_records) + "\n")  # a few: held-out names, not minutes
    # A run killed with its wandb run open, and its service token still in the environment (as a
    # launcher that ran it would pass on): the next run neither hangs nor fails on it.
    stale_token = killed_wandb_run(out, wandb_env)
    result = launch(
        [
            sys.executable,
            "recipes/sft.py",
            *SMALL_MODEL,
            f"output_dir={out}",
            "max_steps=3",
            "log_every=1",
            "save_every=0",
            "eval_every=3",
            f"data.eval=[{tmp_path / 'eval.jsonl'}]",
            "logger=wandb",
            "data.max_tokens_per_microbatch=512",
            "data.report_records=0",
        ],
        env_extra={**wandb_env, "WANDB_SERVICE": stale_token},
        timeout=180,
    )
    assert "ignoring WANDB_SERVICE" in result.stdout

    run_dirs = sorted((out / "wandb").glob("offline-run-*"), key=lambda d: d.stat().st_mtime)
    assert len(run_dirs) == 2, run_dirs  # the killed run's and this one's
    config, history, summary = read_offline_run(run_dirs[-1])
    assert config["max_steps"] == 3 and config["logger"] == "wandb"  # the resolved config, nested as in YAML
    assert config["data"]["max_tokens_per_microbatch"] == 512 and config["output_dir"] == str(out)
    assert summary["hf_dir"] == str((out / "hf").resolve())

    metrics = read_metrics(out, include_start=True)
    assert [m["step"] for m in metrics] == [0, 1, 2, 3] and "eval_loss" in metrics[-1]
    assert [row["_step"] for row in history] == [0, 1, 2, 3]
    tables = {}
    for logged, row in zip(metrics, history):  # every metric, with the value of metrics.jsonl
        assert {k: v for k, v in row.items() if not k.startswith(("_", "samples."))} == {
            k: v for k, v in logged.items() if k != "step"
        }
        if "samples.path" in row:  # the evaluation's sample replies, a table file of the run
            tables[row["_step"]] = json.loads((run_dirs[-1] / "files" / row["samples.path"]).read_text())
    assert summary["loss"] == metrics[-1]["loss"] and summary["eval_loss"] == metrics[-1]["eval_loss"]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert sorted(tables) == [0, 3] and [s["step"] for s in samples] == [0] * 4 + [3] * 4  # eval.samples=4
    for step, table in tables.items():  # the lines of samples.jsonl, each prompt as "role: content" lines
        assert table == {
            "columns": ["step", "prompt", "reply"],
            "data": [
                [step, "\n".join(f"{m['role']}: {m['content']}" for m in s["prompt"]), s["reply"]]
                for s in samples
                if s["step"] == step
            ],
        }


@pytest.mark.launch
def test_metric_names_with_slashes_reach_wandb_as_they_are(tmp_path, wandb_env):
    """DPO's names (rewards/chosen, eval_rewards/accuracies, ...) are wandb keys unchanged."""
    dpo_step = {
        "step": 1,
        "loss": 0.69,
        "rewards/chosen": 0.25,
        "rewards/margins": -0.5,
        "logps/rejected": -40.0,
        "eval_loss": 0.7,
        "eval_rewards/accuracies": 0.5,
    }
    metric_logger = MetricLogger(str(tmp_path), True, "wandb", run_config={"max_steps": 1, "loss": {"beta": 0.1}})
    metric_logger.log(dpo_step)
    metric_logger.log_summary({"hf_dir": "/somewhere/hf"})
    metric_logger.close()

    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    # finish() can return before wandb's service process has written the whole file (seen twice in full-suite
    # runs on 2 loaded cores, the config missing, with "abandoning 1 handles" as the service closed): read again
    # until the run's records are there, for at most a minute.
    deadline = time.monotonic() + 60
    while True:
        config, history, summary = read_offline_run(run_dir)
        if ("loss" in config and history and "hf_dir" in summary) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert config["loss"] == {"beta": 0.1}
    assert {k: v for k, v in history[0].items() if not k.startswith("_")} == {
        k: v for k, v in dpo_step.items() if k != "step"
    }
    assert history[0]["_step"] == 1 and summary["hf_dir"] == "/somewhere/hf"


def test_a_failing_wandb_init_says_what_to_do(tmp_path, wandb_env):
    with pytest.raises(RuntimeError, match=r"wandb.init failed: .*(?s:.*)wandb.mode=offline.*logger=stdout"):
        MetricLogger(str(tmp_path), True, "wandb", wandb_kwargs={"mode": "online"})  # no API key anywhere
    assert not MetricLogger(str(tmp_path), False, "wandb").wandb_run  # other ranks never start wandb


@pytest.mark.launch
def test_a_resumed_run_logs_into_the_wandb_run_it_started(tmp_path, wandb_env):
    out = tmp_path / "run"
    command = [
        sys.executable,
        "recipes/sft.py",
        *SMALL_MODEL,
        f"output_dir={out}",
        "max_steps=4",
        "log_every=1",
        "save_every=2",
        "eval_every=0",
        "data.eval=[]",
        "logger=wandb",
        "data.max_tokens_per_microbatch=512",
        "data.report_records=0",
    ]
    launch([*command, "stop_after_step=2"], env_extra=wandb_env, timeout=180)
    run_id = json.loads((out / "checkpoints" / "step_2" / "chattune.json").read_text())["wandb_id"]
    assert run_id
    launch(command, env_extra=wandb_env, timeout=180)
    run_dirs = sorted((out / "wandb").glob("offline-run-*"), key=lambda d: d.stat().st_mtime)
    assert len(run_dirs) == 2 and all(d.name.endswith(f"-{run_id}") for d in run_dirs), run_dirs
    assert [row["_step"] for row in read_offline_run(run_dirs[-1])[1]] == [3, 4]
