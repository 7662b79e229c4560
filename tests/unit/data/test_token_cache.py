"""The token cache (data.cache): documents read from a cache are the documents tokenizing gives (splits,
truncations, skips with their messages, preference pairs), whatever the number of shards and workers that built
it; any change to a record, the chat template or a setting makes a new cache; a build killed mid-way (SIGKILL)
leaves nothing a later run trusts; two builds at once leave one good cache; a bad record's error is the one
tokenizing raises and leaves no cache. (A world-size-invariant run with and without the cache:
tests/e2e/test_world_size_invariance.py.)"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from test_sft_documents import chat_with_a_long_question

from chattune.config.paths import DEMO_ASSETS
from chattune.data.documents import Document
from chattune.data.ingest.cached_sources import open_documents
from chattune.data.ingest.formats import DataError, SourceSpec
from chattune.data.ingest.sources import RECIPE_DATA, document_settings
from chattune.data.token_cache import (
    MANIFEST,
    BuildShard,
    CachedDocuments,
    build_source_cache,
    cache_name,
    source_key,
    tokenizer_digest,
)
from conftest import demo_tokenizer

CHATS = (DEMO_ASSETS / "chat_train.jsonl").read_text().splitlines(keepends=True)
PAIRS = (DEMO_ASSETS / "preference_train.jsonl").read_text().splitlines(keepends=True)


def data_section(cache: Path | str, **settings) -> OmegaConf:
    return OmegaConf.create(
        {
            "cache": str(cache),
            "train_on": "assistant",
            "overlong": "drop",
            "on_bad_record": "error",
            "max_tokens_per_microbatch": 256,
            "num_workers": 0,
            "share_prompts": False,
            **settings,
        }
    )


def assert_same_outcomes(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert type(g) is type(w)
        if isinstance(w, Document):
            assert g == w and g.key == w.key and g.overlong == w.overlong and g.segments == w.segments
            assert g.shared_prefix == w.shared_prefix
            assert g.input_ids.dtype.kind == "i" and len(g) == len(w)
        else:
            assert (g.reason, g.detail) == (w.reason, w.detail)


def committed(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if (p / MANIFEST).is_file()) if root.is_dir() else []


def staging(root: Path) -> list[Path]:
    return sorted(root.glob(".building-*")) if root.is_dir() else []


@pytest.mark.parametrize(
    "kind, overlong, train_on, share_prompts",
    [
        ("sft", "split", "assistant", False),
        ("sft", "truncate", "last_assistant", False),
        ("sft", "drop", "assistant", False),
        ("dpo", "drop", "assistant", False),
        ("dpo", "drop", "assistant", True),
    ],
)
@pytest.mark.launch
def test_cached_documents_are_the_tokenized_ones(tmp_path, kind, overlong, train_on, share_prompts):
    """Against the source tokenized as read: every record's outcomes, in one batch and one by one, built in 3 shards
    (one with 2 loader workers). The data has records over the budget (split, one leaves pieces out), a pair with
    identical replies, and bad records (skipped under on_bad_record=skip, with their messages)."""
    lines = (CHATS if kind == "sft" else PAIRS)[:300]
    bad = ['{"messages": [{"role": "user", "content": "hi"}]}\n', "not json\n"]
    if kind == "dpo":
        record = json.loads(lines[0])
        bad.append(json.dumps({**record, "rejected": record["chosen"]}) + "\n")  # identical replies: skipped
    else:  # a chat with a long question: split, a piece of the question alone trains nothing (left out, counted)
        bad.append(json.dumps(chat_with_a_long_question()) + "\n")
    path = tmp_path / "data.jsonl"
    path.write_text("".join(lines[:100] + bad + lines[100:]))
    spec = SourceSpec(path=str(path), format="messages" if kind == "sft" else "preference")
    data = data_section(
        tmp_path / "cache",
        overlong=overlong,
        train_on=train_on,
        on_bad_record="skip",
        max_tokens_per_microbatch=96 if kind == "sft" else 200,
        share_prompts=share_prompts,
    )
    tokenizer = demo_tokenizer()
    plain = RECIPE_DATA[kind].source(spec, tokenizer, data)
    key = source_key(kind, spec, document_settings(spec, data), tokenizer_digest(tokenizer))
    final = tmp_path / "cache" / cache_name(kind, spec, key)
    (tmp_path / "cache").mkdir()
    staged = tmp_path / "cache" / ".building-test"
    staged.mkdir()
    for shard in (1, 2, 0):  # the first shard commits, after the others are written
        build_source_cache(
            plain,
            final,
            kind,
            spec,
            key,
            num_workers=2 if shard == 1 else 0,
            part=BuildShard(shard, num_shards=3, staging=staged, agree=lambda error: None),
        )
    cached = open_documents(kind, [spec], tokenizer, data).sources[0]
    assert isinstance(cached, CachedDocuments) and cached.directory == final
    assert cached.manifest["shards"] == 3 and not staging(tmp_path / "cache")
    every = list(range(len(plain)))
    want = plain.get_many(every)
    skipped = [w for w in want if not isinstance(w, Document)]
    assert len(skipped) >= 2 and {w.reason for w in skipped} >= {"bad_record"}
    if overlong == "split":
        assert any(w.piece > 0 for w in want if isinstance(w, Document)), "the data should have split records"
        left_out = [w for w in want if isinstance(w, Document) and w.pieces_left_out]
        assert left_out, "the data should have a split record with pieces that train nothing"
        assert all(cached.get(w.doc_id).left_out_detail == w.left_out_detail for w in left_out)
    if overlong == "drop":
        assert "overlong" in {w.reason for w in skipped}
    if kind == "dpo":  # every kept pair shares its prompt, or none does
        assert all(bool(w.shared_prefix) == share_prompts for w in want if isinstance(w, Document))
    assert_same_outcomes(cached.get_many(every), want)
    assert_same_outcomes(cached.get_many([201, 5, 102, 0]), plain.get_many([201, 5, 102, 0]))
    assert_same_outcomes([cached.get(101)], [plain.get(101)])


def test_a_change_to_a_record_the_template_or_a_setting_makes_a_new_cache(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(CHATS[:50]))
    spec = SourceSpec(path=str(path))
    root = tmp_path / "cache"
    data = data_section(root)
    tokenizer = demo_tokenizer()

    def documents(tokenizer=tokenizer, data=data) -> CachedDocuments:
        return open_documents("sft", [spec], tokenizer, data).sources[0]

    first = documents()
    built = (first.directory / MANIFEST).stat().st_mtime_ns
    assert documents().directory == first.directory and (first.directory / MANIFEST).stat().st_mtime_ns == built
    assert len(committed(root)) == 1

    record = json.loads(CHATS[7])
    record["messages"][-1]["content"] += " (edited)"
    path.write_text("".join(CHATS[:7] + [json.dumps(record) + "\n"] + CHATS[8:50]))
    edited = documents()
    assert edited.directory != first.directory and len(committed(root)) == 2
    want = RECIPE_DATA["sft"].source(spec, tokenizer, data).get(7)
    assert edited.get(7) == want and first.get(7) != want  # the edit is in the new cache only

    templated = demo_tokenizer()
    templated.chat_template += "{# another revision of the template #}"
    assert tokenizer_digest(templated) != tokenizer_digest(tokenizer)
    assert documents(tokenizer=templated).directory not in (first.directory, edited.directory)
    assert documents(data=data_section(root, overlong="truncate")).directory not in (first.directory, edited.directory)
    assert len(committed(root)) == 4 and not staging(root)


def test_a_bad_record_fails_the_build_with_its_own_message_and_leaves_no_cache(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(CHATS[:30] + ["not json\n"] + CHATS[30:40]))
    spec = SourceSpec(path=str(path))
    data = data_section(tmp_path / "cache")
    with pytest.raises(DataError) as read:
        RECIPE_DATA["sft"].source(spec, demo_tokenizer(), data).get_many(list(range(41)))
    with pytest.raises(DataError) as built:
        open_documents("sft", [spec], demo_tokenizer(), data)
    assert str(built.value) == str(read.value) and "record 31 (line 31)" in str(built.value)
    assert not committed(tmp_path / "cache") and not staging(tmp_path / "cache")


def prepare(cache: Path, data: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "chattune.cli.main",
            "prepare",
            "sft/tiny",
            f"data.train=[{data}]",
            "data.eval=[]",
            f"data.cache={cache}",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def big_data(tmp_path: Path, records: int) -> Path:
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(CHATS[i % len(CHATS)] for i in range(records)))
    return path


def check_cache(cache: Path, data: Path) -> None:
    """One committed cache of `data`, nothing half-built, and its documents those tokenizing gives."""
    (directory,) = committed(cache)
    assert not staging(cache)
    spec = SourceSpec(path=str(data))
    cached = CachedDocuments(directory)
    plain = RECIPE_DATA["sft"].source(spec, demo_tokenizer(), data_section(cache, max_tokens_per_microbatch=2048))
    assert len(cached) == len(plain)
    sample = [0, 1, len(plain) // 2, len(plain) - 1]
    assert_same_outcomes(cached.get_many(sample), plain.get_many(sample))


@pytest.mark.launch
def test_a_build_killed_midway_leaves_no_cache_and_the_next_launch_rebuilds(tmp_path):
    data, cache = big_data(tmp_path, 20_000), tmp_path / "cache"
    build = prepare(cache, data)
    deadline = time.time() + 120
    while not any(p.stat().st_size > 0 for p in cache.glob(".building-*/shard-*/ids.bin")):  # mid-build: tokens written
        assert build.poll() is None and time.time() < deadline, build.communicate()[0]
        time.sleep(0.05)
    build.send_signal(signal.SIGKILL)
    build.wait()
    assert not committed(cache) and len(staging(cache)) == 1, "a killed build leaves only its staging directory"
    found = open_documents(
        "sft",
        [SourceSpec(path=str(data))],
        demo_tokenizer(),
        data_section(cache, max_tokens_per_microbatch=2048),
        build=False,
    )
    assert not found.cached, "a half-built cache must not be read"
    rebuild = prepare(cache, data)
    out = rebuild.communicate()[0]
    assert rebuild.returncode == 0, out
    assert "20000 records -> 20000 documents" in out
    check_cache(cache, data)  # and the killed build's leftovers are gone


@pytest.mark.launch
def test_two_launches_building_one_cache_at_once_leave_one_good_cache(tmp_path):
    """Two `chattune prepare` at once: both finish and say what the cache holds; one cache is committed, whole."""
    data, cache = big_data(tmp_path, 4_000), tmp_path / "cache"
    builds = [prepare(cache, data) for _ in range(2)]
    outs = [b.communicate()[0] for b in builds]
    assert [b.returncode for b in builds] == [0, 0], outs
    assert all(f"data.train {data}: 4000 records -> 4000 documents" in out for out in outs), outs
    check_cache(cache, data)


def test_prepare_with_the_cache_off_says_there_is_nothing_to_prepare(capsys):
    from chattune.cli.main import main

    assert main(["prepare", "sft/tiny", "data.cache=off"]) == 1
    err = capsys.readouterr().err
    first, *block = err.splitlines()  # what it is doing, said at once; then the error
    assert first.startswith("chattune prepare: tokenizing the data of sft/tiny")
    assert block[0].startswith("chattune prepare: error: data.cache=off") and err.count("error") == 1, err


def test_a_cache_directory_that_cannot_be_made_is_one_clear_error(tmp_path):
    """The remedy it names, data.cache=off, is what the other tests here compare against."""
    from chattune.errors import UserError

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(UserError, match=r"data.cache: cannot make the token cache directory .*a_file.*data.cache=off"):
        open_documents(
            "sft",
            [SourceSpec(path=str(DEMO_ASSETS / "chat_eval.jsonl"))],
            demo_tokenizer(),
            data_section(blocker / "cache"),
        )
