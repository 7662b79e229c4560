"""Models and tokenizers by hub id (`model.path=hf:org/name`, `chattune.hub`): each node's local rank 0 fills the
Hugging Face cache, the other ranks wait, every rank reads the cached directory. The tests have no network:
the cache is filled beforehand, as a download would leave it, and read with HF_HUB_OFFLINE=1 (which is also
how a cached model trains offline)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_run_safety import launch

from chattune.launch.validate import run_validate
from conftest import PROJECT_ROOT, demo_tokenizer, tiny_model

REPO = "chattune-test/tiny-chat"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fill_cache(cache: Path) -> Path:
    """The cache layout huggingface_hub leaves after downloading REPO at `main`: the snapshot's files, and the
    ref that names its commit."""
    repo = cache / f"models--{REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    model = tiny_model(seed=7)
    model.config._attn_implementation = "sdpa"
    model.save_pretrained(snapshot)
    demo_tokenizer().save_pretrained(snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.mark.launch
def test_a_cached_hub_model_trains_offline_on_two_ranks_and_its_adapter_names_the_repository(tmp_path):
    cache = tmp_path / "hf_cache"
    fill_cache(cache)
    out = tmp_path / "run"
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    result = launch(
        "recipes/sft.py",
        "--config-name",
        "sft/local_model",
        f"model.path=hf:{REPO}",
        f"output_dir={out}",
        "data.train=[${demo_asset:chat_train.jsonl}]",
        "data.eval=[]",
        "max_steps=2",
        "save_every=0",
        "log_every=1",
        "data.report_records=0",
        "data.max_tokens_per_microbatch=1024",
        "peft=lora",
        "model.fsdp.activation_checkpointing=false",
        nproc=2,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == REPO  # what peft loads the base from, not chattune's hf: path
    assert sorted(p.name for p in cache.iterdir()) == [f"models--{REPO.replace('/', '--')}"]  # nothing else written


@pytest.mark.launch
def test_hub_paths_validate_and_fail_clearly(tmp_path, monkeypatch):
    configs = PROJECT_ROOT / "configs"
    data = "data.train=[${demo_asset:chat_train.jsonl}]"
    report, ok = run_validate(
        "sft/local_model", [f"model.path=hf:{REPO}", data, f"output_dir={tmp_path / 'out'}"], configs
    )
    assert ok and f"note: model.path: 'hf:{REPO}': a hub model (downloaded once per node" in report
    report, ok = run_validate(
        "sft/local_model", ["model.path=Qwen/Qwen3-0.6B", data, f"output_dir={tmp_path / 'out'}"], configs
    )
    assert (
        not ok
        and "model.path: 'Qwen/Qwen3-0.6B' is not a local directory (a hub model is written hf:Qwen/Qwen3-0.6B)"
        in report
    )
    # Not in the cache, offline: one clear error, before anything is trained.
    result = launch(
        "recipes/sft.py",
        "--config-name",
        "sft/local_model",
        "model.path=hf:chattune-test/absent",
        f"output_dir={tmp_path / 'absent'}",
        data,
        "data.eval=[]",
        "max_steps=2",
        env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "empty_cache")},
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert (
        result.stderr.count(
            "chattune: error: tokenizer.path 'hf:chattune-test/absent': neither downloaded nor in the "
            "Hugging Face cache"
        )
        == 1
    )


def test_only_a_nodes_local_rank_0_downloads(monkeypatch, tmp_path):
    """The other ranks of the node only read the cache, after the barrier (here one process plays each rank)."""
    import huggingface_hub

    from chattune.hub import MODEL_FILES, local_directory

    calls = []

    def snapshot_download(repo_id, revision=None, allow_patterns=None, local_files_only=False):
        calls.append((repo_id, revision, local_files_only))
        assert allow_patterns == MODEL_FILES
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    for local_rank, expected in (
        ("0", [("org/m", "v1", False), ("org/m", "v1", True)]),
        ("1", [("org/m", "v1", True)]),
    ):
        calls.clear()
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        assert local_directory("hf:org/m@v1", "model.path") == tmp_path
        assert calls == expected
    assert local_directory(str(tmp_path), "model.path") == tmp_path and len(calls) == 1  # a local path: no hub
