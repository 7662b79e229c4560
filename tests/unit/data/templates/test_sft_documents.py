"""Reading `messages` records: errors name the file, the record and the problem; skips are counted."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from chattune.data.documents import Document, Skipped
from chattune.data.ingest.formats import DataError, SourceSpec, to_conversation
from chattune.data.ingest.records import RecordSource
from chattune.data.templates.sft_documents import SFTDocuments
from conftest import SHARED_ASSETS


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def good(question: str = "What is 1 + 1?", answer: str = "2") -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


@pytest.mark.parametrize(
    ("bad_record", "problem"),
    [
        ({"messages": []}, "non-empty list of messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "role 'robot'"),
        ({"messages": ["user", "hi"]}, "message 0 must be an object with a role and content, got 'user'"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 7}]}, "must be a string"),
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]},
            "empty assistant reply",
        ),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a<|im_end|>b"}]},
            "end of its content is not inside",
        ),
    ],
)
def test_bad_records_raise_with_file_and_index(tmp_path, tokenizer, bad_record, problem):
    path = write_jsonl(tmp_path / "chats.jsonl", [good(), good(), bad_record])
    documents = SFTDocuments(RecordSource([SourceSpec(path)]), tokenizer, max_tokens=512)
    assert documents.get(0) is not None
    with pytest.raises(DataError, match=rf"chats\.jsonl record 3 \(line 3\): .*{problem}"):
        documents.get(2)


def test_record_index_is_per_file_across_several_files(tmp_path, tokenizer):
    first = write_jsonl(tmp_path / "a.jsonl", [good(), good()])
    second = write_jsonl(tmp_path / "b.jsonl", [good(), {"messages": [{"role": "user", "content": "x"}]}])
    documents = SFTDocuments(RecordSource([SourceSpec(first), SourceSpec(second)]), tokenizer, max_tokens=512)
    assert len(documents) == 4
    assert documents.get(2).doc_id == 2
    with pytest.raises(DataError, match=r"b\.jsonl record 2 \(line 2\): no assistant message"):
        documents.get(3)


def test_missing_file_wrong_field_and_unparseable_line(tmp_path, tokenizer):
    with pytest.raises(DataError, match="does not exist"):
        RecordSource([SourceSpec(str(tmp_path / "missing.jsonl"))])
    path = write_jsonl(tmp_path / "wrong.jsonl", [good(), {"conversation": []}])
    documents = SFTDocuments(RecordSource([SourceSpec(path)]), tokenizer, max_tokens=512)
    with pytest.raises(
        DataError,
        match=r"wrong\.jsonl record 2 \(line 2\): no 'messages' field for the messages format \(fields: \['conversation'\]\)",
    ):
        documents.get(1)
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(good()) + "\n{not json\n")
    _, where, error = RecordSource([SourceSpec(str(broken))]).locate(1)
    assert where.endswith("broken.jsonl record 2 (line 2)") and isinstance(error, DataError)
    # The column within the file's line 2, not json's own "line 1 column 2" (it parsed the line alone).
    assert str(error) == f"{where}: unparseable JSON at column 2: Expecting property name enclosed in double quotes"


def test_json_list_files_are_read_too(tmp_path, tokenizer):
    path = tmp_path / "chats.json"
    path.write_text(json.dumps([good(), good("What is 2 + 2?", "4")]))
    documents = SFTDocuments(RecordSource([SourceSpec(str(path))]), tokenizer, max_tokens=512)
    assert len(documents) == 2 and documents.get(1).doc_id == 1
    path.write_text(json.dumps({"messages": []}))
    with pytest.raises(DataError, match="must hold a list of records"):
        RecordSource([SourceSpec(str(path))])


def test_overlong_records_are_dropped_and_counted_or_raise(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "long.jsonl", [good(), good(answer="word " * 300)])
    documents = SFTDocuments(RecordSource([SourceSpec(path)]), tokenizer, max_tokens=128, overlong="drop")
    assert isinstance(documents.get(0), Document)
    skipped = documents.get(1)
    assert (
        isinstance(skipped, Skipped)
        and skipped.reason == "overlong"
        and "long.jsonl record 2 (line 2)" in skipped.detail
    )
    strict = SFTDocuments(RecordSource([SourceSpec(path)]), tokenizer, max_tokens=128, overlong="error")
    with pytest.raises(
        DataError, match=r"long\.jsonl record 2 \(line 2\): \d+ tokens exceed data.max_tokens_per_microbatch=128"
    ):
        strict.get(1)


def test_errors_raised_by_the_template_name_the_record(tmp_path, tokenizer):
    """Templates enforce their own rules with raise_exception (e.g. roles must alternate)."""
    tokenizer = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'user' and loop.index0 % 2 == 1 %}"
        "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
        "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    bad = {
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "user", "content": "b"},
            {"role": "assistant", "content": "c"},
        ]
    }
    path = write_jsonl(tmp_path / "chats.jsonl", [good(), bad])
    documents = SFTDocuments(RecordSource([SourceSpec(path)]), tokenizer, max_tokens=512)
    assert documents.get(0) is not None
    with pytest.raises(DataError, match=r"chats\.jsonl record 2 \(line 2\): .*Conversation roles must alternate"):
        documents.get(1)


def test_get_many_reports_the_first_bad_record_as_get_would(tmp_path, tokenizer):
    """A batch raises what reading its records one by one would raise first: an overlong record before a
    broken one is refused first, and a broken one before an overlong one."""
    overlong, broken = good(answer="word " * 300), {"messages": [{"role": "user", "content": "x"}]}
    path = write_jsonl(tmp_path / "chats.jsonl", [good(), overlong, broken, good(), broken, overlong])
    documents = SFTDocuments(RecordSource([SourceSpec(path)]), tokenizer, max_tokens=128, overlong="error")
    with pytest.raises(DataError, match=r"chats\.jsonl record 2 \(line 2\): \d+ tokens exceed"):
        documents.get_many([0, 1, 2])
    with pytest.raises(DataError, match=r"chats\.jsonl record 5 \(line 5\): no assistant message"):
        documents.get_many([3, 4, 5])
    dropping = SFTDocuments(RecordSource([SourceSpec(path)]), tokenizer, max_tokens=128)
    first, second = dropping.get_many([0, 1])
    assert isinstance(first, Document) and isinstance(second, Skipped) and second.reason == "overlong"


def _shared_sources():
    data = SHARED_ASSETS / "data"
    if not data.exists():
        pytest.skip(f"shared test assets not available ({data})")
    return {
        "fastchat": SourceSpec(str(data / "sharegpt_fastchat_dummy.json"), format="sharegpt"),
        "toolcall": SourceSpec(str(data / "sharegpt_toolcall_300.json"), format="sharegpt"),
        "deita": SourceSpec(str(data / "messages_deita_long.parquet")),
    }


@pytest.mark.parametrize(
    ("tokenizer_name", "source_names"),
    [("qwen3", ("fastchat", "toolcall", "deita")), ("phi-3-mini", ("fastchat", "deita"))],
)
@pytest.mark.parametrize("train_on", ["assistant", "last_assistant"])
def test_batches_equal_one_by_one_on_real_chats(tokenizer_name, source_names, train_on):
    """Batched tokenization and masking never mixes documents: each document of a batch is the document
    of its record alone, and its tokens are `apply_chat_template`'s."""
    sources = _shared_sources()
    tokenizer = AutoTokenizer.from_pretrained(SHARED_ASSETS / "tokenizers" / tokenizer_name)
    records = RecordSource([sources[name] for name in source_names])
    documents = SFTDocuments(records, tokenizer, max_tokens=2048, train_on=train_on)
    batched = [
        d
        for start in range(0, len(documents), 97)
        for d in documents.get_many(range(start, min(start + 97, len(documents))))
    ]
    assert sum(isinstance(d, Skipped) for d in batched) > 0  # some long conversations are over the budget
    for index, document in enumerate(batched):
        assert document == documents.get(index), index
        if isinstance(document, Document):
            spec, _, record = records.locate(index)
            conversation = to_conversation(record, spec, "")
            expected = tokenizer.apply_chat_template(conversation.messages, tools=conversation.tools)["input_ids"]
            assert document.input_ids.tolist() == list(expected), index


def long_chat(turns: int = 6) -> dict:
    messages = [{"role": "system", "content": "You are a tutor."}]
    for i in range(turns):
        messages += [
            {"role": "user", "content": f"Question {i}: " + "why " * 10},
            {"role": "assistant", "content": f"Answer {i}: " + "because " * 12},
        ]
    return {"messages": messages}


@pytest.mark.parametrize("policy", ["truncate", "split"])
def test_overlong_records_truncated_or_split_keep_the_labels_of_the_whole(tmp_path, tokenizer, policy):
    path = write_jsonl(tmp_path / "chats.jsonl", [good(), long_chat()])
    whole = SFTDocuments(RecordSource([SourceSpec(path)]), tokenizer, max_tokens=10_000).get(1)
    assert whole.input_ids.tolist() == tokenizer.apply_chat_template(long_chat()["messages"])["input_ids"]
    budget = 64
    assert len(whole) > 3 * budget
    outcomes = SFTDocuments(RecordSource([SourceSpec(path)]), tokenizer, budget, overlong=policy).get_many([0, 1])
    assert outcomes[0].doc_id == 0 and not outcomes[0].overlong
    pieces = outcomes[1:]
    assert all(isinstance(p, Document) and p.doc_id == 1 and len(p) <= budget for p in pieces)
    assert [p.piece for p in pieces] == list(range(len(pieces)))
    assert pieces[0].overlong == ("truncated" if policy == "truncate" else "split")
    assert all(not p.overlong for p in pieces[1:])
    if policy == "truncate":
        assert len(pieces) == 1 and pieces[0].input_ids.tolist() == whole.input_ids[:budget].tolist()
    # Every piece is a slice of the whole conversation at a multiple of the budget, labelled as the whole is,
    # except that its last position predicts nothing (the next token is in the next piece).
    cuts = range(0, len(whole), budget)
    by_start = {
        start: (
            whole.input_ids[start : start + budget].tolist(),
            whole.labels[start : min(start + budget, len(whole)) - 1].tolist() + [-100],
        )
        for start in cuts
    }
    kept = [start for start in cuts if any(label >= 0 for label in by_start[start][1])]
    if policy == "truncate":
        kept = kept[:1]
    assert [(p.input_ids.tolist(), p.labels.tolist()) for p in pieces] == [by_start[start] for start in kept]
    if policy == "split":
        assert len(kept) < len(cuts) or len(pieces) == len(cuts)  # untrained pieces left out


def chat_with_a_long_question() -> dict:
    """A chat whose second question is longer than two 64-token pieces: split, a piece of it alone trains nothing."""
    return {
        "messages": [
            {"role": "user", "content": "Question 0: why?"},
            {"role": "assistant", "content": "Answer 0: " + "because " * 12},
            {"role": "user", "content": "Question 1: " + "why " * 60},
            {"role": "assistant", "content": "Answer 1: " + "because " * 12},
        ]
    }


def untrained_cuts(path: str, tokenizer, index: int, budget: int) -> list[int]:
    """By hand, from record `index`'s whole conversation: the numbers (from 1) of its cuts at multiples of `budget`
    whose labels, but the last (it predicts the next piece's first token), are all untrained."""
    whole = SFTDocuments(RecordSource([SourceSpec(path)]), tokenizer, max_tokens=10_000).get(index)
    return [
        number
        for number, start in enumerate(range(0, len(whole), budget), 1)
        if not any(label >= 0 for label in whole.labels[start : min(start + budget, len(whole)) - 1])
    ]


def test_split_pieces_that_train_nothing_are_counted_and_logged_as_truncate_counts_its_drops(
    tmp_path, tokenizer, caplog
):
    """data.overlong=split leaves out the pieces with no token to train (a piece of a long question alone): each one
    is counted where the split records are (the data report, the stream's figures that end a run) and the record
    that lost them is logged with its file, record and pieces, as a skip is."""
    from chattune.data.ingest.report import count_lines, scan_documents
    from chattune.data.stream import PackedStream, PackingBudget, StreamLayout

    path = write_jsonl(tmp_path / "chats.jsonl", [good(), chat_with_a_long_question(), long_chat()])
    budget = 64
    expected = {index: untrained_cuts(path, tokenizer, index, budget) for index in (1, 2)}
    assert len(expected[1]) >= 1
    documents = SFTDocuments(RecordSource([SourceSpec(path)]), tokenizer, budget, overlong="split")
    first_pieces = [d for d in documents.get_many([0, 1, 2]) if d.piece == 0]
    assert [d.pieces_left_out for d in first_pieces] == [0, len(expected[1]), len(expected[2])]
    detail = first_pieces[1].left_out_detail
    assert detail.startswith(f"{path} record 2 (line 2): ") and all(f"{n} (tokens " in detail for n in expected[1])

    left_out = len(expected[1]) + len(expected[2])
    lines = count_lines(scan_documents(documents, [0, 1, 2]).counts())
    assert (
        f"over the budget and kept: truncated 0, split 2 ({left_out} of their pieces train nothing: left out)" in lines
    )
    stream = PackedStream(documents, StreamLayout(num_epochs=1), 0, PackingBudget(budget, 0))
    with caplog.at_level("WARNING", logger="chattune.data.stream"):
        assert sum(len(batch.doc_ids) for batch in stream) == len(documents.get_many([0, 1, 2]))
    assert stream.overlong == {"truncated": 0, "split": 2, "split_pieces_left_out": left_out}
    assert f"split pieces left out: {detail}" in caplog.messages


def test_truncation_that_keeps_nothing_to_train_is_a_counted_skip(tmp_path, tokenizer):
    record = {"messages": [{"role": "user", "content": "tell me " * 60}, {"role": "assistant", "content": "ok"}]}
    path = write_jsonl(tmp_path / "chats.jsonl", [record])
    outcome = SFTDocuments(RecordSource([SourceSpec(path)]), tokenizer, 32, overlong="truncate").get(0)
    assert (
        isinstance(outcome, Skipped)
        and outcome.reason == "no_trainable_tokens"
        and "record 1 (line 1)" in outcome.detail
    )


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.launch
def test_split_pieces_resume_exactly_and_are_counted(tmp_path, tokenizer, num_workers):
    from chattune.data.stream import PackedStream, PackingBudget, StreamLayout

    records = [long_chat(turns=1 + i % 5) if i % 3 == 0 else good(f"What is {i} + {i}?", str(2 * i)) for i in range(30)]
    path = write_jsonl(tmp_path / "chats.jsonl", records)

    def stream():
        documents = SFTDocuments(RecordSource([SourceSpec(path)]), tokenizer, 96, overlong="split")
        return PackedStream(
            documents,
            StreamLayout(num_epochs=2),
            1,
            PackingBudget(96, 0, buffer_records=8),
            num_workers=num_workers,
        )

    full = stream()
    expected = [(b.doc_ids, b.input_ids.tolist()) for b in full]
    split_records = sum(1 for r in records if len(tokenizer.apply_chat_template(r["messages"])["input_ids"]) > 96)
    left_out = sum(len(untrained_cuts(path, tokenizer, index, 96)) for index in range(len(records)))
    assert split_records > 3 and full.overlong == {
        "truncated": 0,
        "split": 2 * split_records,
        "split_pieces_left_out": 2 * left_out,  # (two epochs)
    }
    for stop in [3, 7, len(expected) - 2] if num_workers else range(1, len(expected)):
        first = stream()
        batches = iter(first)
        got = [(b.doc_ids, b.input_ids.tolist()) for b in (next(batches) for _ in range(stop))]
        resumed = stream()
        resumed.load_state_dict(first.state_dict())
        got += [(b.doc_ids, b.input_ids.tolist()) for b in resumed]
        assert got == expected, f"resuming after {stop} microbatches diverged"


def test_dataset_directories_and_hub_ids_go_through_datasets(tmp_path, tokenizer, monkeypatch):
    import datasets

    directory = tmp_path / "my_dataset"
    directory.mkdir()
    rows = [good(), good("What is 2 + 2?", "4"), good("Reverse 'ab'.", "ba")]
    datasets.Dataset.from_list(rows[:2]).to_parquet(str(directory / "train.parquet"))
    datasets.Dataset.from_list(rows[2:]).to_parquet(str(directory / "test.parquet"))
    spec = SourceSpec.from_config({"path": str(directory), "split": "test"})
    documents = SFTDocuments(RecordSource([spec]), tokenizer, max_tokens=512)
    assert len(documents) == 1
    assert documents.get(0).input_ids.tolist() == tokenizer.apply_chat_template(rows[2]["messages"])["input_ids"]
    assert len(RecordSource([SourceSpec(str(directory))])) == 2  # split train by default

    # Offline, as this machine is (the flags are read at import, so set the imported constants too).
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match=r"hub dataset 'someone/no-such-chats' \(split 'train'\) could not be loaded"):
        RecordSource([SourceSpec("hf:someone/no-such-chats")])
    # A missing relative path is never taken for a hub id (it used to try the network).
    with pytest.raises(
        DataError,
        match=r"data file 'someone/no-such-chats' does not exist \(a hub dataset is written hf:someone/no-such-chats\)",
    ):
        RecordSource([SourceSpec("someone/no-such-chats")])
    with pytest.raises(DataError, match=r"data file 'data/chats.jsonl' does not exist$"):
        RecordSource([SourceSpec("data/chats.jsonl")])
    with pytest.raises(DataError, match="does not exist"):
        RecordSource([SourceSpec(str(tmp_path / "missing.jsonl"))])
