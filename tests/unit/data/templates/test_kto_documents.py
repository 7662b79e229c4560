"""KTO examples (`chattune.data.templates.kto_documents`): one document per example, the example then its KL sequence (its own
context with the reply of its partner, the same side of the next record, cyclically), each exactly
`apply_chat_template(context + [reply])` with only the final reply and end-of-turn token trained; the label travels
on the document, through the packed batch and the token cache.

The references are computed independently of `KTODocuments`: token ids by `apply_chat_template`, labels by DPO's
`PairDocuments` on a pair holding the same context and reply (its chosen side), trained text by decoding.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from chattune.data.documents import IGNORE_INDEX, Document, Skipped
from chattune.data.ingest.formats import (
    DEFAULT_COLUMNS,
    DataError,
    SourceSpec,
    UnpairedExample,
    to_conversation,
    to_preference_pair,
    to_unpaired_example,
)
from chattune.data.ingest.records import RecordSource
from chattune.data.ingest.sources import KTO_DATA, PAIR_DATA, RECIPE_DATA, SFT_DATA, document_settings
from chattune.data.packing import collate_packed
from chattune.data.templates.kto_documents import KTODocuments
from chattune.data.templates.pair_documents import PairDocuments
from chattune.data.token_cache import CachedDocuments, build_source_cache, cache_name, source_key, tokenizer_digest
from conftest import decode_exactly, kto_label


def write_jsonl(path: Path, records: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def kto_documents(tmp_path, tokenizer, records, format="unpaired", max_tokens=2048, **settings) -> KTODocuments:
    path = write_jsonl(tmp_path / "data.jsonl", records)
    return KTODocuments(RecordSource([SourceSpec(path, format=format)]), tokenizer, max_tokens, **settings)


def reference_side(tmp_path, tokenizer, context: list[dict], reply: dict) -> Document:
    """DPO's chosen side for `context` + `reply`: the tokens and labels one KTO segment must have."""
    other = {"role": "assistant", "content": reply.get("content", "") + " (not this)"}
    path = write_jsonl(tmp_path / "reference.jsonl", [{"prompt": context, "chosen": [reply], "rejected": [other]}])
    pair = PairDocuments(RecordSource([SourceSpec(path, format="preference")]), tokenizer, 1 << 20).get(0)
    cut = pair.segments[0]
    return Document(0, pair.input_ids[:cut], pair.labels[:cut])


def segments_of(document: Document) -> list[tuple[list[int], list[int]]]:
    cut = document.segments[0]
    assert sum(document.segments) == len(document.input_ids) == len(document.labels)
    return [
        (document.input_ids[:cut].tolist(), document.labels[:cut].tolist()),
        (document.input_ids[cut:].tolist(), document.labels[cut:].tolist()),
    ]


def trained_text(tokenizer, labels: list[int]) -> str:
    return decode_exactly(tokenizer, [t for t in labels if t != IGNORE_INDEX])


def check_segment(tmp_path, tokenizer, segment, context: list[dict], reply: dict, label: str) -> None:
    """One segment against apply_chat_template (ids), DPO's chosen side (labels) and the reply's text."""
    ids, labels = segment
    expected = list(tokenizer.apply_chat_template([*context, reply], tokenize=True)["input_ids"])
    assert ids == expected, f"{label}: ids differ from apply_chat_template"
    reference = reference_side(tmp_path, tokenizer, context, reply)
    assert ids == reference.input_ids.tolist() and labels == reference.labels.tolist(), f"{label}: labels"
    assert labels[-1] == IGNORE_INDEX, f"{label}: the segment's last position must predict nothing"
    assert trained_text(tokenizer, labels) == reply["content"] + "<|im_end|>", f"{label}: trained text"


# --------------------------------------------------------------------------------------------------------------
# The unpaired format
# --------------------------------------------------------------------------------------------------------------

CONTEXTS = ["What is 1 + 1?", "Name a colour.", "Say hi."]
REPLIES = ["2", "Blue, I think.", "Hello there!"]
LABELS = [True, False, True]


def as_messages(text: str, role: str) -> list[dict]:
    return [{"role": role, "content": text}]


@pytest.mark.parametrize("conversational", [False, True])
def test_unpaired_examples_and_their_kl_sequences(tmp_path, tokenizer, conversational):
    """Each document: the record's context + reply, then its context + the next record's reply (cyclically);
    string fields and message lists (with a multi-turn context) give the same documents for the same messages."""
    contexts = [as_messages(c, "user") for c in CONTEXTS]
    if conversational:
        contexts[1] = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": CONTEXTS[1]},
        ]
    replies = [{"role": "assistant", "content": r} for r in REPLIES]
    records = [
        {"prompt": contexts[i] if conversational else CONTEXTS[i], "label": LABELS[i]}
        | {"completion": [replies[i]] if conversational else REPLIES[i]}
        for i in range(3)
    ]
    documents = kto_documents(tmp_path, tokenizer, records)
    assert len(documents) == 3
    outcomes = documents.get_many([0, 1, 2])
    assert [documents.get(i) for i in (2, 0)] == [outcomes[2], outcomes[0]]  # one by one as in a batch
    for i, document in enumerate(outcomes):
        assert isinstance(document, Document) and document.doc_id == i
        assert kto_label(document) is LABELS[i] and document.piece == 0
        example, kl = segments_of(document)
        check_segment(tmp_path, tokenizer, example, contexts[i], replies[i], f"example {i}")
        check_segment(tmp_path, tokenizer, kl, contexts[i], replies[(i + 1) % 3], f"example {i} KL")


def test_unpaired_format_columns_and_conversion():
    assert DEFAULT_COLUMNS["unpaired"] == {
        "prompt": "prompt",
        "messages": "messages",
        "completion": "completion",
        "label": "label",
        "tools": "tools",
    }
    where = "x record 1"
    spec = SourceSpec("x", format="unpaired")
    example = to_unpaired_example({"prompt": "Q", "completion": "A", "label": False}, spec, where)
    assert example == UnpairedExample(
        [{"role": "user", "content": "Q"}], {"role": "assistant", "content": "A"}, False, None
    )
    # renamed columns; `messages` in place of `prompt`; earlier completion messages extend the context; tools
    renamed = SourceSpec("x", format="unpaired", columns={"completion": "answer", "label": "good"})
    tool = {"name": "f", "parameters": {"type": "object", "properties": {}}}
    record = {
        "messages": [{"role": "user", "content": "Q"}],
        "answer": [{"role": "assistant", "content": "first"}, {"role": "user", "content": "again"}, "A"],
        "good": True,
        "tools": [tool],
    }
    record["answer"][-1] = {"role": "assistant", "content": "A"}
    example = to_unpaired_example(record, renamed, where)
    assert [m["content"] for m in example.context] == ["Q", "first", "again"] and example.completion["content"] == "A"
    assert example.desirable is True and example.tools == [{"type": "function", "function": tool}]
    # the other readers refuse the format, and the unpaired reader the others
    with pytest.raises(DataError, match="labelled replies"):
        to_conversation({"prompt": "Q", "completion": "A", "label": True}, spec, where)
    with pytest.raises(DataError, match="labelled replies"):
        to_preference_pair({"prompt": "Q", "completion": "A", "label": True}, spec, where)
    with pytest.raises(DataError, match="no labelled replies"):
        to_unpaired_example(
            {"prompt": "Q", "chosen": "A", "rejected": "B"}, SourceSpec("x", format="preference"), where
        )


def test_which_kinds_read_the_unpaired_format():
    assert "unpaired" not in SFT_DATA.formats and "unpaired" not in PAIR_DATA.formats
    assert set(KTO_DATA.formats) == {"unpaired", "preference", "sharegpt_preference"} and KTO_DATA.pairs
    assert RECIPE_DATA["kto"] is KTO_DATA and KTO_DATA.name == "kto"
    assert set(SFT_DATA.formats) == {"messages", "sharegpt", "prompt_completion", "alpaca"}


def test_kto_documents_refuse_conversations_and_cut_policies(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "chats.jsonl", [{"messages": [{"role": "user", "content": "Q"}]}])
    with pytest.raises(DataError, match=r"chats\.jsonl: KTO needs unpaired examples or preference pairs"):
        KTODocuments(RecordSource([SourceSpec(path)]), tokenizer, 256)
    good = write_jsonl(tmp_path / "good.jsonl", [{"prompt": "Q", "completion": "A", "label": True}])
    with pytest.raises(ValueError, match="data.overlong must be one of"):
        KTODocuments(RecordSource([SourceSpec(good, format="unpaired")]), tokenizer, 256, overlong="split")


def test_a_source_of_one_record_is_its_own_partner(tmp_path, tokenizer):
    document = kto_documents(tmp_path, tokenizer, [{"prompt": "Q", "completion": "A", "label": False}]).get(0)
    example, kl = segments_of(document)
    assert example == kl and kto_label(document) is False


# --------------------------------------------------------------------------------------------------------------
# Preference pairs, unpaired
# --------------------------------------------------------------------------------------------------------------


def test_preference_pairs_give_two_examples_each(tmp_path, tokenizer):
    pairs = [
        {"prompt": "What is 1 + 1?", "chosen": "2", "rejected": "3"},
        {"prompt": [{"role": "user", "content": "Colour?"}], "chosen": "Blue.", "rejected": "Plaid, obviously."},
    ]
    documents = kto_documents(tmp_path, tokenizer, pairs, format="preference")
    assert len(documents) == 4
    outcomes = documents.get_many(range(4))
    assert [kto_label(d) for d in outcomes] == [True, False, True, False]
    assert [d.doc_id for d in outcomes] == [0, 1, 2, 3]
    for index, document in enumerate(outcomes):
        record, side = divmod(index, 2)
        context = to_preference_pair(pairs[record], SourceSpec("x", format="preference"), "x").context
        reply = {"role": "assistant", "content": pairs[record][("chosen", "rejected")[side]]}
        partner = {"role": "assistant", "content": pairs[1 - record][("chosen", "rejected")[side]]}
        example, kl = segments_of(document)
        check_segment(tmp_path, tokenizer, example, context, reply, f"example {index}")
        check_segment(tmp_path, tokenizer, kl, context, partner, f"example {index} KL")


def test_sharegpt_preference_pairs_read_as_examples(tmp_path, tokenizer):
    record = {
        "system": "Be kind.",
        "conversations": [{"from": "human", "value": "Colour?"}],
        "chosen": {"from": "gpt", "value": "Blue."},
        "rejected": {"from": "gpt", "value": "Red."},
    }
    documents = kto_documents(tmp_path, tokenizer, [record], format="sharegpt_preference")
    chosen, rejected = documents.get_many([0, 1])
    assert (kto_label(chosen), kto_label(rejected)) == (True, False)
    assert trained_text(tokenizer, segments_of(chosen)[0][1]) == "Blue.<|im_end|>"
    assert trained_text(tokenizer, segments_of(rejected)[1][1]) == "Red.<|im_end|>"  # its own partner's rejected


def test_a_pair_of_identical_replies_gives_two_counted_skips(tmp_path, tokenizer):
    pairs = [
        {"prompt": "A?", "chosen": "yes", "rejected": "no"},
        {"prompt": "B?", "chosen": "same", "rejected": "same"},
        {"prompt": "C?", "chosen": "up", "rejected": "down"},
    ]
    documents = kto_documents(tmp_path, tokenizer, pairs, format="preference")
    outcomes = documents.get_many(range(6))
    assert [type(o).__name__ for o in outcomes] == [
        "Document",
        "Document",
        "Skipped",
        "Skipped",
        "Document",
        "Document",
    ]
    path = tmp_path / "data.jsonl"
    for side, skipped in zip(("chosen", "rejected"), outcomes[2:4]):
        assert skipped.reason == "identical_replies"
        assert skipped.detail.startswith(
            f"{path} record 2 (line 2), {side}: the chosen and the rejected reply are the same"
        )
    # the pair before it still takes its replies as KL partners
    assert trained_text(tokenizer, segments_of(outcomes[0])[1][1]) == "same<|im_end|>"


# --------------------------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------------------------

GOOD = {"prompt": "Q", "completion": "A", "label": True}


@pytest.mark.parametrize(
    ("bad", "problem"),
    [
        (
            {"prompt": "Q", "completion": "A"},
            r"no 'label' field \(fields: \['completion', 'prompt'\]\): KTO reads \{prompt, completion, label\} "
            r"records, label true \(desirable\) or false \(undesirable\)",
        ),
        (
            {**GOOD, "label": 1},
            r"'label' must be a JSON boolean, true \(desirable\) or false \(undesirable\), got int 1",
        ),
        ({**GOOD, "label": "true"}, r"'label' must be a JSON boolean, .*, got str 'true'"),
        ({**GOOD, "label": None}, r"'label' must be a JSON boolean, .*, got null"),
        ({**GOOD, "completion": ""}, r"completion: message 1 is an empty assistant reply"),
        (
            {**GOOD, "completion": [{"role": "user", "content": "A"}]},
            r"the last message of 'completion' must be the assistant reply, got role 'user'",
        ),
        ({"completion": "A", "label": True}, r"no 'prompt' \(or 'messages'\) field for the unpaired format"),
        (
            {**GOOD, "prompt": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]},
            "the context of the completion reply must end with a user or tool turn, got a last turn of role .assistant.",
        ),
    ],
)
def test_bad_records_raise_naming_file_record_and_field_or_are_skipped(tmp_path, tokenizer, bad, problem):
    records = [GOOD, GOOD, bad, GOOD]
    documents = kto_documents(tmp_path, tokenizer, records)
    where = rf"{tmp_path / 'data.jsonl'} record 3 \(line 3\): "
    with pytest.raises(DataError, match=where + problem) as raised:
        documents.get(2)
    assert "data.on_bad_record=skip" in str(raised.value)
    skipping = kto_documents(tmp_path, tokenizer, records, on_bad_record="skip")
    outcomes = skipping.get_many(range(4))
    assert isinstance(outcomes[2], Skipped) and outcomes[2].reason == "bad_record"
    assert outcomes[2].detail.startswith(f"{tmp_path / 'data.jsonl'} record 3 (line 3): ")
    # its neighbour before it still trains (its KL partner is the next readable record)
    assert [isinstance(o, Document) for o in outcomes] == [True, True, False, True]


def test_a_bad_record_is_named_as_itself_and_its_neighbour_takes_the_next_readable_partner(tmp_path, tokenizer):
    """A bad label in record 5 used to be reported as record 4's ("its KL partner, record 5 ..."), and skipped,
    it took the good record 4 with it."""
    records = [
        {"prompt": "Q", "completion": "first", "label": True},
        {"prompt": "Q", "completion": "second", "label": False},
        "not json",
    ]
    documents = kto_documents(tmp_path, tokenizer, records)
    path = tmp_path / "data.jsonl"
    with pytest.raises(DataError, match=rf"^{path} record 3 \(line 3\): unparseable JSON"):
        documents.get(1)
    assert isinstance(documents.get(0), Document)
    # a batch stops at the first error, raised after the examples before it
    with pytest.raises(DataError, match=rf"^{path} record 3 \(line 3\)"):
        documents.get_many([0, 1, 2])
    skipping = kto_documents(tmp_path, tokenizer, records, on_bad_record="skip").get_many(range(3))
    assert [o.reason if isinstance(o, Skipped) else "kept" for o in skipping] == ["kept", "kept", "bad_record"]
    assert trained_text(tokenizer, segments_of(skipping[1])[1][1]) == "first<|im_end|>"  # record 1: next readable
    assert trained_text(tokenizer, segments_of(skipping[0])[1][1]) == "second<|im_end|>"  # its own partner, as ever
    # a pair's partner: the same side of the next pair; past a bad pair, the next readable one (here itself)
    pairs = [{"prompt": "A?", "chosen": "yes", "rejected": "no"}, {"prompt": "B?", "chosen": "ok"}]
    outcomes = kto_documents(tmp_path, tokenizer, pairs, format="preference", on_bad_record="skip").get_many(range(4))
    assert [o.reason if isinstance(o, Skipped) else "kept" for o in outcomes] == ["kept", "kept"] + ["bad_record"] * 2
    assert trained_text(tokenizer, segments_of(outcomes[1])[1][1]) == "no<|im_end|>"
    assert "no 'rejected' field" in outcomes[3].detail


def test_overlong_examples_are_dropped_or_an_error(tmp_path, tokenizer):
    """Both segments count: the long reply makes its own example overlong and the one whose KL partner it is."""
    long = " ".join(["word"] * 200)
    records = [GOOD, {**GOOD, "completion": long, "label": False}, GOOD, GOOD]
    documents = kto_documents(tmp_path, tokenizer, records, max_tokens=100)
    outcomes = documents.get_many(range(4))
    assert [o.reason if isinstance(o, Skipped) else "kept" for o in outcomes] == [
        "overlong",
        "overlong",
        "kept",
        "kept",
    ]
    assert "exceed data.max_tokens_per_microbatch=100" in outcomes[1].detail
    assert all(len(o) <= 100 for o in outcomes[2:])
    strict = kto_documents(tmp_path, tokenizer, records, max_tokens=100, overlong="error")
    with pytest.raises(DataError, match=r"record 1 \(line 1\): \d+ tokens \(the example \d+ \+ its KL sequence \d+\)"):
        strict.get(0)
    assert isinstance(strict.get(2), Document)


# --------------------------------------------------------------------------------------------------------------
# The label travels: packed batches and the token cache
# --------------------------------------------------------------------------------------------------------------


def test_packed_batches_carry_the_label(tmp_path, tokenizer):
    records = [{**GOOD, "label": label} for label in (True, False, True)]
    documents = kto_documents(tmp_path, tokenizer, records).get_many(range(3))
    batch = collate_packed([documents[1], documents[2], documents[0]], pad_to_multiple_of=64)
    assert batch.padding > 0 and batch.doc_ids == [1, 2, 0]
    assert batch.doc_values == {"desirable": [0.0, 1.0, 1.0]}
    assert batch.to("cpu").doc_values == {"desirable": [0.0, 1.0, 1.0]}
    assert batch.cu_seqlens.tolist()[:3] == [0, documents[1].segments[0], len(documents[1])]
    sft_like = Document(9, np.arange(5), np.full(5, IGNORE_INDEX))  # a document without a label: not a KTO example
    with pytest.raises(ValueError, match=r"document 9 has no value \['desirable'\]"):
        collate_packed([documents[1], sft_like])


def data_section(cache: Path, **settings):
    return OmegaConf.create(
        {
            "cache": str(cache),
            "train_on": "assistant",
            "overlong": "drop",
            "on_bad_record": "skip",
            "max_tokens_per_microbatch": 120,
            "num_workers": 0,
            "share_prompts": False,
            **settings,
        }
    )


@pytest.mark.parametrize("format", ["unpaired", "preference"])
def test_the_token_cache_keeps_the_label(tmp_path, tokenizer, format):
    if format == "unpaired":
        records = [{"prompt": f"Q{i}?", "completion": f"A{i}", "label": i % 3 != 1} for i in range(20)]
        records[4] = {"prompt": "Q", "completion": " ".join(["word"] * 200), "label": True}  # overlong, with record 3
        records[9] = {"prompt": "Q", "completion": "A", "label": "yes"}  # bad, with record 8
    else:
        records = [{"prompt": f"Q{i}?", "chosen": f"A{i}", "rejected": f"B{i}"} for i in range(10)]
        records[5] = {"prompt": "Q", "chosen": "same", "rejected": "same"}
    path = write_jsonl(tmp_path / "data.jsonl", records)
    spec = SourceSpec(path, format=format)
    data = data_section(tmp_path / "cache")
    plain = KTO_DATA.source(spec, tokenizer, data)
    assert isinstance(plain, KTODocuments) and plain.max_tokens == 120 and plain.on_bad_record == "skip"
    key = source_key("kto", spec, document_settings(spec, data), tokenizer_digest(tokenizer))
    final = tmp_path / "cache" / cache_name("kto", spec, key)
    build_source_cache(plain, final, "kto", spec, key)
    cached = CachedDocuments(final)
    every = list(range(len(plain)))
    want, got = plain.get_many(every), cached.get_many(every)
    assert len(cached) == len(plain) == 20  # 20 unpaired records, or 10 pairs of two examples
    assert {o.reason for o in want if isinstance(o, Skipped)} == (
        {"overlong", "bad_record"} if format == "unpaired" else {"identical_replies"}
    )
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g == w  # Document equality includes the label, the segments and the skip messages
        if isinstance(w, Document):
            assert kto_label(g) is kto_label(w) and isinstance(kto_label(w), bool)
    assert [kto_label(w) for w in want if isinstance(w, Document)].count(False) > 0
    # a shard without the label's array reads as documents without a label
    index = final / "shard-00000" / "index.npz"
    with np.load(index) as arrays:
        older = {name: arrays[name] for name in arrays.files if name != "value:desirable"}
    np.savez(index, **older)
    assert all(kto_label(d) is None for d in CachedDocuments(final).get_many(every) if isinstance(d, Document))
