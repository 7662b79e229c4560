"""data.eval_split: the held-out records are the documented deterministic set (checked against a plain-Python
implementation of the rule), the same with and without the token cache, for conversations and preference pairs;
training reads only the others (concatenated or mixed); a split that leaves a source nothing to train is one
error naming the key. And one run, on 1 rank then resumed on 2: no held-out record in any step, the held-out
loss at step 0 and at the end equal to plain forwards over exactly those records, a changed split refused."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_sft_recipe import read_metrics
from test_token_cache import CHATS, PAIRS, data_section
from test_validate import CONFIGS
from transformers import AutoModelForCausalLM

import conftest
from chattune.config.schema import MixingConfig
from chattune.data.documents import IGNORE_INDEX, Document
from chattune.data.ingest.cached_sources import open_documents
from chattune.data.ingest.formats import SourceSpec
from chattune.data.ingest.held_out import held_out_counts, held_out_records, hold_out, split_problem
from chattune.data.ingest.mixing_policy import mixture_sampling
from chattune.errors import UserError
from chattune.launch.validate import run_validate
from conftest import SMALL_MODEL, demo_documents, kto_label, torchrun

MASK = 2**64 - 1


def splitmix(x: int) -> int:
    """SplitMix64's output function, in plain Python integers."""
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def expected_held_out(num_records: int, count: int, seed: int, source: int) -> list[int]:
    """README's rule: the `count` records with the smallest key mix(mix(mix(seed) + source) + record)."""
    base = splitmix((splitmix(seed & MASK) + source) & MASK)
    keys = [splitmix((base + record) & MASK) for record in range(num_records)]
    return sorted(sorted(range(num_records), key=lambda record: (keys[record], record))[:count])


def test_how_many_records_are_held_out():
    assert held_out_counts([1000, 10, 3], None) == [0, 0, 0]
    # a fraction of each source, rounded half up, at least one record
    assert held_out_counts([1000, 10, 3, 25], 0.02) == [20, 1, 1, 1]
    assert held_out_counts([25, 35], 0.1) == [3, 4]
    # a count over all sources, in proportion to their sizes: largest remainder, a tie to the earlier source
    assert held_out_counts([300, 100], 10) == [8, 2]  # 7.5 and 2.5
    assert held_out_counts([1, 1, 1000], 5) == [0, 0, 5]  # 0.005, 0.005, 4.99
    assert held_out_counts([40], 6) == [6]


def test_the_held_out_records_follow_the_documented_rule():
    assert splitmix(0) == 0xE220A8397B1DCDAF  # SplitMix64's first output from state 0: the rule is the published one
    for num_records, count, seed, source in [(1000, 20, 42, 0), (37, 5, 7, 2), (300, 299, 0, 1), (50, 3, -1, 0)]:
        assert held_out_records(num_records, count, seed, source).tolist() == expected_held_out(
            num_records, count, seed, source
        )
    # a larger split holds out a superset; another seed or source another set
    assert set(held_out_records(500, 10, 42, 0).tolist()) < set(held_out_records(500, 25, 42, 0).tolist())
    assert held_out_records(500, 10, 42, 0).tolist() != held_out_records(500, 10, 43, 0).tolist()
    assert held_out_records(500, 10, 42, 0).tolist() != held_out_records(500, 10, 42, 1).tolist()


def chats_file(tmp_path: Path, name: str, start: int, count: int) -> Path:
    path = tmp_path / name
    path.write_text("".join(CHATS[start : start + count]))
    return path


@pytest.mark.parametrize("cache", ["off", "on"])
def test_training_reads_the_kept_records_and_eval_the_held_out_ones(tmp_path, tokenizer, cache):
    """Two sources split 0.2 each: the split's documents are the sources' own documents of the expected records,
    in record order, addressed from 0 (what packing, a data position and the ledger index), each naming its
    record in its file; with or without the token cache alike."""
    specs = [
        SourceSpec(path=str(chats_file(tmp_path, "a.jsonl", 0, 30))),
        SourceSpec(path=str(chats_file(tmp_path, "b.jsonl", 30, 25))),
    ]
    data = data_section(tmp_path / "cache" if cache == "on" else "off")
    full = open_documents("sft", specs, tokenizer, data)
    assert full.cached == (cache == "on")
    split = hold_out(full, 0.2, seed=5)
    held = [expected_held_out(30, 6, 5, 0), expected_held_out(25, 5, 5, 1)]
    kept = [[r for r in range(size) if r not in out] for size, out in zip((30, 25), held)]
    assert split.counts == [6, 5] and split.sizes == [30, 25] and split.train.sizes == [24, 20]
    assert split.train.cached == (cache == "on")
    plain = [open_documents("sft", [spec], tokenizer, data_section("off")) for spec in specs]

    def assert_documents(documents, records_of_sources):
        origins = [(k, r) for k, records in enumerate(records_of_sources) for r in records]
        assert len(documents) == len(origins)
        got = documents.get_many(range(len(documents)))
        assert [documents.origin(i) for i in range(len(documents))] == origins
        for index, ((k, record), document) in enumerate(zip(origins, got)):
            want = plain[k].get(record)
            assert isinstance(document, Document) and document.doc_id == index
            assert document.input_ids.tolist() == want.input_ids.tolist()
            assert document.labels.tolist() == want.labels.tolist()

    assert_documents(split.train, kept)
    assert split.held_out.names == ["a (held out)", "b (held out)"]
    assert_documents(split.held_out, held)
    # out of order and one by one, as a resumed data position reads them
    assert [d.doc_id for d in split.train.get_many([30, 2, 17])] == [30, 2, 17]
    assert split.train.get(30).input_ids.tolist() == plain[1].get(kept[1][6]).input_ids.tolist()


def test_preference_pairs_are_split_alike(tmp_path, tokenizer):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(PAIRS[:40]))
    spec = SourceSpec(path=str(path), format="preference")
    full = open_documents("dpo", [spec], tokenizer, data_section("off", max_tokens_per_microbatch=400))
    split = hold_out(full, 7, seed=42)
    held = expected_held_out(40, 7, 42, 0)
    assert [split.held_out.origin(i) for i in range(7)] == [(0, r) for r in held]
    for index, record in enumerate(held):
        document, want = split.held_out.get(index), full.get(record)
        assert document.segments == want.segments and document.input_ids.tolist() == want.input_ids.tolist()
    assert sorted(split.train.origin(i)[1] for i in range(len(split.train))) == sorted(set(range(40)) - set(held))


@pytest.mark.parametrize("cache", ["off", "on"])
def test_kto_holds_out_whole_pairs_not_single_examples(tmp_path, tokenizer, cache):
    """KTO reads a preference pair as two examples: the split holds out records (pairs), both examples of each, so no
    prompt is trained on and held out at once; the count and the sample prompts' record numbers are the pairs'."""
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(PAIRS[:40]))
    spec = SourceSpec(path=str(path), format="preference")
    data = data_section("off" if cache == "off" else str(tmp_path / "cache"), max_tokens_per_microbatch=800)
    full = open_documents("kto", [spec], tokenizer, data)
    assert len(full) == 80 and full.examples_per_record == [2]
    split = hold_out(full, 7, seed=42)
    held = expected_held_out(40, 7, 42, 0)  # the rule over the 40 pairs
    assert split.records[0].tolist() == held and split.counts == [7] and split.sizes == [40]
    assert [split.held_out.origin(i) for i in range(14)] == [(0, 2 * r + side) for r in held for side in (0, 1)]
    for index in range(14):
        document, want = split.held_out.get(index), full.get(split.held_out.origin(index)[1])
        assert kto_label(document) == kto_label(want) and document.input_ids.tolist() == want.input_ids.tolist()
    trained = {split.train.origin(i)[1] // 2 for i in range(len(split.train))}
    assert len(split.train) == 66 and trained == set(range(40)) - set(held)


def test_a_mixture_draws_only_kept_records(tmp_path, tokenizer):
    specs = [
        SourceSpec(path=str(chats_file(tmp_path, "a.jsonl", 0, 30)), weight=2.0),
        SourceSpec(path=str(chats_file(tmp_path, "b.jsonl", 30, 12)), weight=1.0),
    ]
    split = hold_out(open_documents("sft", specs, tokenizer, data_section("off")), 0.25, seed=3)
    held = {(0, r) for r in expected_held_out(30, 8, 3, 0)} | {(1, r) for r in expected_held_out(12, 3, 3, 1)}
    _, sampler = mixture_sampling(
        MixingConfig(mode="static", stopping="all_exhausted"),
        specs,
        split.train.sizes,
        0,
        1,
        seed=3,
        num_epochs=3,
        chunk_records=16,
    )
    drawn = [split.train.origin(i) for _, indices, _ in sampler for i in indices]
    assert len(drawn) > 60 and not set(drawn) & held
    assert set(drawn) == ({(0, r) for r in range(30)} | {(1, r) for r in range(12)}) - held


def test_a_split_that_leaves_nothing_to_train_is_one_error_naming_the_key(tmp_path, tokenizer):
    assert split_problem(["a", "b"], [30, 10], 0.2) is None
    assert split_problem(["a"], [40], 40) == (
        "data.eval_split: 40 records held out, but data.train holds 40: nothing "
        "would be left to train; hold out fewer (or a fraction, e.g. 0.02)"
    )
    assert split_problem(["a", "tiny"], [100, 1], 0.1) == (
        "data.eval_split: 0.1 holds out all 1 record(s) of training source tiny: nothing of it would be left to train; "
        "hold out a smaller fraction"
    )
    assert split_problem(["a"], [10], 1.0).startswith("data.eval_split: must be a fraction in (0, 1)")
    documents = open_documents(
        "sft", [SourceSpec(path=str(chats_file(tmp_path, "chats.jsonl", 0, 40)))], tokenizer, data_section("off")
    )
    with pytest.raises(
        UserError, match=r"^data\.eval_split: 0\.99 holds out all 40 record\(s\) of training source chats"
    ):
        hold_out(documents, 0.99, seed=42)

    data = tmp_path / "chats.jsonl"
    base = [f"data.train=[{data}]", f"output_dir={tmp_path / 'out'}"]
    for value, problem in [
        ("40", "data.eval_split: 40 records held out, but data.train holds 40"),
        ("0.99", "data.eval_split: 0.99 holds out all 40 record(s) of training source chats"),
        (
            "1.5",
            "data.eval_split: must be a fraction in (0, 1) or a whole number of records of at "
            "least 1 (null: none), got 1.5",
        ),
        ("0", "data.eval_split: must be a fraction in (0, 1)"),
    ]:
        report, ok = run_validate("sft/tiny", [*base, f"data.eval_split={value}"], CONFIGS, read_data=True)
        assert not ok and report.splitlines()[0].startswith(problem) and report.endswith("1 problem(s)"), report
    assert run_validate("sft/tiny", [*base, "data.eval_split=39"], CONFIGS, read_data=True) == ("config OK", True)


# --- one run: 1 rank, then resumed on 2 ---

RECORDS, SPLIT, HELD_OUT, SEED = 40, 0.15, 6, 42  # round(0.15 x 40) = 6 records held out


def plain_eval_loss(model_dir: Path, records: list[int]) -> float:
    """The mean token loss of a plain HF forward per held-out conversation, tokenized one by one."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for record in records:
            (document,) = demo_documents(1, start=record)
            logits = model(input_ids=torch.tensor([document.input_ids.tolist()]), use_cache=False).logits[0]
            labels = torch.tensor(document.labels.tolist())
            total += float(F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum"))
            tokens += int((labels != IGNORE_INDEX).sum())
    return total / tokens


def launch(out: Path, data: Path, model: Path, nproc: int | None, *extra: str) -> subprocess.CompletedProcess:
    """recipes/sft.py on `nproc` ranks under torchrun (None: `python recipes/sft.py`, one process)."""
    overrides = [
        f"output_dir={out}",
        f"data.train=[{data}]",
        "data.eval=[]",
        f"data.eval_split={SPLIT}",
        f"model.path={model}",
        "max_steps=10",
        "save_every=5",
        "eval_every=5",
        "log_every=1",
        "ledger=true",
        "data.microbatches_per_step=2",
        "data.max_tokens_per_microbatch=512",
        "data.buffer_records=8",
        *extra,
    ]
    command = (
        [sys.executable, "recipes/sft.py", *SMALL_MODEL, *overrides]
        if nproc is None
        else torchrun("sft", *SMALL_MODEL, *overrides, nproc=nproc)
    )
    return conftest.launch(command, check=False)


def ledger_records(out: Path) -> list[tuple[int, int]]:
    """(epoch, record number) of every document of every step of every launch, over all ranks."""
    trained = []
    for path in sorted((out / "ledger").glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            trained += [(epoch, record) for epoch, (source, record) in zip(entry["doc_epochs"], entry["records"])]
    return trained


@pytest.mark.launch
def test_held_out_records_are_never_trained_on_one_or_two_ranks_nor_across_a_resume(tmp_path, base_dir):
    data = chats_file(tmp_path, "chats.jsonl", 0, RECORDS)
    out = tmp_path / "run"
    held = expected_held_out(RECORDS, HELD_OUT, SEED, 0)
    line = f"held out for eval (data.eval_split={SPLIT}): chats {HELD_OUT} of {RECORDS} records"

    first = launch(out, data, base_dir, None, "stop_after_step=5")  # one rank
    assert first.returncode == 0, first.stderr[-3000:]
    assert line in first.stdout
    changed = launch(out, data, base_dir, None, "data.eval_split=0.2")
    assert changed.returncode != 0 and changed.stderr.count("chattune: error: ") == 1
    assert f"config data.eval_split: {SPLIT} -> 0.2" in changed.stderr
    assert "resume_allow_changes=[data.eval_split]" in changed.stderr
    resumed = launch(out, data, base_dir, 2)  # two ranks continue the one stream (world-size-invariant steps)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert line in resumed.stdout and "resumed from" in resumed.stdout

    trained = ledger_records(out)
    assert not {record for _, record in trained} & set(held), "a held-out record was trained"
    per_epoch = Counter(trained)
    kept = set(range(RECORDS)) - set(held)
    epochs = sorted({epoch for epoch, _ in trained})
    assert len(epochs) >= 3  # 10 steps go through the kept records more than twice
    for epoch in epochs[:-1]:  # every kept record once in each whole epoch
        assert {record for (e, record), n in per_epoch.items() if e == epoch and n == 1} == kept
    assert all(n == 1 for n in per_epoch.values())

    evals = {m["step"]: m["eval_loss"] for m in read_metrics(out, include_start=True) if "eval_loss" in m}
    assert sorted(evals) == [0, 5, 10]
    for step, model in ((0, base_dir), (10, out / "hf")):  # step 0 on 1 rank, step 10 on 2 ranks
        want = plain_eval_loss(model, held)
        assert abs(evals[step] - want) <= 1e-5 * want, (step, evals[step], want)
