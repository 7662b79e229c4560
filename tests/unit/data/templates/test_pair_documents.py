"""Preference pairs (`chattune.data.templates.pair_documents`): one document per pair, chosen then rejected, each side exactly
`apply_chat_template(context + [reply])` with only its final reply and end-of-turn token trained.

The expected trained text is written by hand for each template (not from `chattune.data.templates.chat_template`'s span
logic): what follows the assistant header of the final turn in the rendering, up to the end-of-turn token.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from chattune.config.paths import DEMO_ASSETS
from chattune.data.documents import IGNORE_INDEX, Document, Skipped
from chattune.data.ingest.formats import (
    DEFAULT_COLUMNS,
    DataError,
    PreferencePair,
    SourceSpec,
    to_conversation,
    to_preference_pair,
)
from chattune.data.ingest.records import RecordSource
from chattune.data.packing import collate_packed
from chattune.data.templates.pair_documents import PairDocuments
from conftest import SHARED_ASSETS, decode_exactly, trained_runs

DEMO_PAIRS = DEMO_ASSETS / "preference_train.jsonl"
ULTRAFEEDBACK = "preference_ultrafeedback_200.jsonl"
SHAREGPT_MULTITURN = "preference_sharegpt_multiturn_300.json"


# --------------------------------------------------------------------------------------------------------------
# Hand-written knowledge of the templates: the final assistant turn as rendered, and what is trained of it
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FinalTurn:
    name: str
    header: str  # what the template writes right before the final assistant reply
    rendered: Callable[[str], str]  # the final reply's content -> the text after the header, end of turn included
    trained: Callable[[str], str]  # that text -> what the trained tokens decode to
    after: str  # what the template writes after the end-of-turn token of the final turn
    end_of_turn: str
    untrained_tail: str  # what the tokens after the trained reply decode to


# ChatML (demo): content verbatim, then `<|im_end|>\n`.
CHATML = FinalTurn("demo", "<|im_start|>assistant\n", lambda c: c + "<|im_end|>", lambda r: r, "\n", "<|im_end|>", "\n")
# Qwen3: the final assistant turn after the last user query gets an (empty) think block, which the model must
# generate, so it is trained; leading newlines of the content are dropped by the template (`content.lstrip('\n')`).
QWEN3 = FinalTurn(
    "qwen3",
    "<|im_start|>assistant\n",
    lambda c: "<think>\n\n</think>\n\n" + c.lstrip("\n") + "<|im_end|>",
    lambda r: r,
    "\n",
    "<|im_end|>",
    "\n",
)
# Phi-3: content verbatim, `<|end|>\n`, then `<|endoftext|>` closes the conversation (not trained). The header
# token `<|assistant|>` strips whitespace on its right: the newline and any leading whitespace of the reply go
# into that untrained token, so the trained tokens decode to the rendered reply without its leading whitespace.
# `<|end|>` strips on its right too: the newline after it is part of that (trained) token, and only
# `<|endoftext|>` follows the trained run.
PHI3 = FinalTurn(
    "phi-3-mini", "<|assistant|>\n", lambda c: c + "<|end|>", str.lstrip, "\n<|endoftext|>", "<|end|>", "<|endoftext|>"
)


def check_pair(tokenizer, turn: FinalTurn, document: Document, pair: PreferencePair, index: int, label: str) -> None:
    """The document of `pair` against apply_chat_template and the hand-written final turn of each side."""
    assert isinstance(document, Document), f"{label}: {document}"
    assert document.doc_id == index
    assert len(document.segments) == 2 and sum(document.segments) == len(document.input_ids) == len(document.labels)
    cut = document.segments[0]
    for name, reply, ids, labels in (
        ("chosen", pair.chosen, document.input_ids[:cut].tolist(), document.labels[:cut].tolist()),
        ("rejected", pair.rejected, document.input_ids[cut:].tolist(), document.labels[cut:].tolist()),
    ):
        messages = [*pair.context, reply]
        expected_ids = list(tokenizer.apply_chat_template(messages, tools=pair.tools, tokenize=True)["input_ids"])
        assert ids == expected_ids, f"{label} {name}: ids differ from apply_chat_template"
        # the rendering ends with the final reply as the template writes it
        text = tokenizer.apply_chat_template(messages, tools=pair.tools, tokenize=False)
        rendered = turn.rendered(reply["content"])
        assert text.endswith(turn.header + rendered + turn.after), f"{label} {name}: final turn {text[-300:]!r}"
        # labels shifted within the side: labels[i] is ids[i + 1] where that token is trained; last predicts nothing
        assert labels[-1] == IGNORE_INDEX, f"{label} {name}: the side's last position must predict nothing"
        trained = [False] + [label_ != IGNORE_INDEX for label_ in labels[:-1]]
        assert all(labels[i] in (IGNORE_INDEX, ids[i + 1]) for i in range(len(ids) - 1)), f"{label} {name}: shift"
        runs = trained_runs(trained)
        assert len(runs) == 1, f"{label} {name}: {len(runs)} trained runs, expected the final reply only"
        start, end = runs[0]
        assert decode_exactly(tokenizer, ids[start:end]) == turn.trained(rendered), f"{label} {name}: trained text"
        assert tokenizer.convert_ids_to_tokens(ids[end - 1]) == turn.end_of_turn, f"{label} {name}: end of turn"
        # what follows the end of turn is the template's closing text, untrained
        assert decode_exactly(tokenizer, ids[end:]) == turn.untrained_tail, f"{label} {name}: text after the reply"


def read_pairs(spec: SourceSpec) -> list[PreferencePair | None]:
    """Each record's pair by `to_preference_pair` (None where the replies are identical)."""
    source = RecordSource([spec])
    pairs = []
    for index, (_, where, record) in enumerate(source.locate_many(range(len(source)))):
        pair = to_preference_pair(record, spec, where)
        pairs.append(None if pair.chosen == pair.rejected else pair)
    return pairs


def write_jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def pair_record(prompt="What is 1 + 1?", chosen="2", rejected="3", **extra) -> dict:
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected, **extra}


def documents_of(
    tmp_path, tokenizer, records, max_tokens=2048, overlong="drop", format="preference", name="pairs.jsonl", **spec
) -> PairDocuments:
    path = write_jsonl(tmp_path / name, records)
    return PairDocuments(RecordSource([SourceSpec(path, format=format, **spec)]), tokenizer, max_tokens, overlong)


# --------------------------------------------------------------------------------------------------------------
# Demo tokenizer and demo pairs
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_pairs() -> tuple[SourceSpec, list[PreferencePair | None]]:
    spec = SourceSpec(str(DEMO_PAIRS), format="preference")
    return spec, read_pairs(spec)


def test_demo_pairs_match_apply_chat_template_and_train_only_the_final_reply(tokenizer, demo_pairs):
    spec, pairs = demo_pairs
    assert len(pairs) == 2000 and all(p is not None for p in pairs)
    documents = PairDocuments(RecordSource([spec]), tokenizer, max_tokens=4096)
    outcomes = documents.get_many(range(len(documents)))
    for index, (pair, document) in enumerate(zip(pairs, outcomes)):
        check_pair(tokenizer, CHATML, document, pair, index, f"demo pair {index}")
    # the demo covers system prompts and multi-turn contexts (earlier assistant turns: context, never trained)
    assert any(p.context[0]["role"] == "system" for p in pairs)
    assert any(sum(m["role"] == "assistant" for m in p.context) >= 2 for p in pairs)


def test_demo_pair_exact_layout(tmp_path, tokenizer):
    record = {
        "prompt": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Colour?"},
        ],
        "chosen": [{"role": "assistant", "content": "Blue."}],
        "rejected": [{"role": "assistant", "content": "Red, I think."}],
    }
    spec = SourceSpec("x.jsonl", format="preference")
    pair = to_preference_pair(record, spec, "x.jsonl record 0")
    assert pair.context == record["prompt"] and pair.chosen == record["chosen"][0] and pair.tools is None
    chosen_ids = tokenizer.apply_chat_template(record["prompt"] + record["chosen"], tokenize=True)["input_ids"]
    rejected_ids = tokenizer.apply_chat_template(record["prompt"] + record["rejected"], tokenize=True)["input_ids"]
    document = documents_of(tmp_path, tokenizer, [record]).get(0)
    assert document.input_ids.tolist() == list(chosen_ids) + list(rejected_ids)
    assert document.segments == (len(chosen_ids), len(rejected_ids))
    trained = [decode_exactly(tokenizer, [t]) for t in document.labels.tolist() if t != IGNORE_INDEX]
    assert "".join(trained) == "Blue.<|im_end|>" + "Red, I think.<|im_end|>"
    # per side: the label of the token before the reply is its first token; the side's last label is ignored
    assert document.labels[len(chosen_ids) - 1] == IGNORE_INDEX and document.labels[-1] == IGNORE_INDEX
    # packed as one unit, each side its own attention segment
    batch = collate_packed([document])
    assert batch.cu_seqlens.tolist() == [0, len(chosen_ids), len(chosen_ids) + len(rejected_ids)]
    assert batch.position_ids[0, len(chosen_ids)].item() == 0


# --------------------------------------------------------------------------------------------------------------
# Shared tokenizers (Qwen3, Phi-3) over all shared preference records
# --------------------------------------------------------------------------------------------------------------


def _shared(*parts: str) -> Path:
    path = SHARED_ASSETS.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"shared test assets not available ({path})")
    return path


REAL = {"qwen3": QWEN3, "phi-3-mini": PHI3}
SHARED_FILES = {ULTRAFEEDBACK: "preference", SHAREGPT_MULTITURN: "sharegpt_preference"}


@pytest.fixture(scope="module", params=sorted(REAL))
def real(request):
    return AutoTokenizer.from_pretrained(_shared("tokenizers", request.param)), REAL[request.param]


@pytest.mark.parametrize("file", sorted(SHARED_FILES))
def test_shared_preference_data_on_real_tokenizers(real, file):
    tokenizer, turn = real
    spec = SourceSpec(str(_shared("data", file)), format=SHARED_FILES[file])
    pairs = read_pairs(spec)
    assert len(pairs) == {ULTRAFEEDBACK: 200, SHAREGPT_MULTITURN: 300}[file]
    # Qwen3 splits a reply at `</think>`: the hand-written expectation assumes plain replies, as these are
    assert not any("</think>" in r["content"] for p in pairs if p for r in (p.chosen, p.rejected))
    documents = PairDocuments(RecordSource([spec]), tokenizer, max_tokens=1 << 20)
    outcomes = documents.get_many(range(len(documents)))
    identical = [i for i, p in enumerate(pairs) if p is None]
    assert [i for i, o in enumerate(outcomes) if isinstance(o, Skipped)] == identical
    line = " (line {})" if spec.path.endswith(".jsonl") else ""  # records are named 1-based, JSONL ones with their line
    assert all(
        outcomes[i]
        == Skipped(
            "identical_replies",
            f"{spec.path} record {i + 1}"
            + line.format(i + 1)
            + ": the chosen and the rejected reply are the same, nothing to prefer",
        )
        for i in identical
    )
    for index, (pair, document) in enumerate(zip(pairs, outcomes)):
        if pair is not None:
            check_pair(tokenizer, turn, document, pair, index, f"{turn.name} {file} record {index}")
    if file == ULTRAFEEDBACK:
        assert identical == [43]  # the one pair of the sample whose two replies are the same text
    else:
        assert identical == []
        assert any(len(p.context) > 2 for p in pairs) and any(p.context[0]["role"] == "system" for p in pairs)


def test_qwen3_trains_the_empty_think_block_of_each_side(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(_shared("tokenizers", "qwen3"))
    record = {
        "prompt": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Colour?"},
        ],
        "chosen": "Blue.",
        "rejected": "Red.",
    }
    document = documents_of(tmp_path, tokenizer, [record]).get(0)
    cut = document.segments[0]
    trained = [
        decode_exactly(
            tokenizer, [document.input_ids[i + 1] for i in range(lo, hi - 1) if document.labels[i] != IGNORE_INDEX]
        )
        for lo, hi in ((0, cut), (cut, len(document)))
    ]
    assert trained == ["<think>\n\n</think>\n\nBlue.<|im_end|>", "<think>\n\n</think>\n\nRed.<|im_end|>"]


# --------------------------------------------------------------------------------------------------------------
# Formats
# --------------------------------------------------------------------------------------------------------------


def test_preference_formats_and_their_columns():
    assert DEFAULT_COLUMNS["preference"] == {
        "prompt": "prompt",
        "messages": "messages",
        "chosen": "chosen",
        "rejected": "rejected",
        "tools": "tools",
    }
    assert set(DEFAULT_COLUMNS["sharegpt_preference"]) == {
        "conversations",
        "chosen",
        "rejected",
        "system",
        "tools",
        "role",
        "content",
    }
    with pytest.raises(DataError, match="preference pairs"):
        to_conversation(pair_record(), SourceSpec("x", format="preference"), "x record 0")
    with pytest.raises(DataError, match="not preference pairs"):
        to_preference_pair({"messages": []}, SourceSpec("x"), "x record 0")


def test_string_messages_column_and_renamed_columns():
    where = "x record 0"
    pair = to_preference_pair(pair_record(), SourceSpec("x", format="preference"), where)
    assert pair == PreferencePair(
        [{"role": "user", "content": "What is 1 + 1?"}],
        {"role": "assistant", "content": "2"},
        {"role": "assistant", "content": "3"},
    )
    context = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    record = {"messages": context, "chosen": [{"role": "assistant", "content": "A"}], "rejected": "B"}
    assert to_preference_pair(record, SourceSpec("x", format="preference"), where).context == context
    renamed = SourceSpec("x", format="preference", columns={"prompt": "question", "chosen": "good", "rejected": "bad"})
    pair = to_preference_pair({"question": "Q", "good": "A", "bad": "B"}, renamed, where)
    assert (pair.chosen["content"], pair.rejected["content"]) == ("A", "B")
    # earlier messages of a side extend the context (identical on both sides)
    side = lambda reply: [
        {"role": "assistant", "content": "first"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": reply},
    ]
    pair = to_preference_pair(
        {"prompt": "Q", "chosen": side("A"), "rejected": side("B")}, SourceSpec("x", format="preference"), where
    )
    assert [m["content"] for m in pair.context] == ["Q", "first", "again"]
    # tools, as for the other formats
    tool = {"name": "f", "parameters": {"type": "object", "properties": {}}}
    pair = to_preference_pair(pair_record(tools=[tool]), SourceSpec("x", format="preference"), where)
    assert pair.tools == [{"type": "function", "function": tool}]


def test_sharegpt_preference_with_system_and_roles():
    spec = SourceSpec("x", format="sharegpt_preference", roles={"bot": "assistant"})
    record = {
        "system": "Be kind.",
        "conversations": [
            {"from": "human", "value": "Hi"},
            {"from": "bot", "value": "Hey"},
            {"from": "human", "value": "Colour?"},
        ],
        "chosen": {"from": "gpt", "value": "Blue."},
        "rejected": {"from": "bot", "value": "Red."},
    }
    pair = to_preference_pair(record, spec, "x record 0")
    assert [m["role"] for m in pair.context] == ["system", "user", "assistant", "user"]
    assert pair.chosen == {"role": "assistant", "content": "Blue."} and pair.rejected["content"] == "Red."
    record["rejected"] = {"from": "robot", "value": "Red."}
    with pytest.raises(DataError, match=r"x record 0: rejected turn 0 has role 'robot'"):
        to_preference_pair(record, spec, "x record 0")


# --------------------------------------------------------------------------------------------------------------
# Bad input: each case and its documented outcome
# --------------------------------------------------------------------------------------------------------------

MESSAGE_CONTEXT = [{"role": "user", "content": "Q"}]


@pytest.mark.parametrize(
    ("bad_record", "problem"),
    [
        (pair_record(chosen=""), r"chosen: message 1 is an empty assistant reply"),
        (pair_record(rejected="   "), r"rejected: message 1 is an empty assistant reply"),
        (pair_record(chosen=[{"role": "assistant", "content": ""}]), r"chosen: message 1 is an empty assistant reply"),
        (
            {"prompt": "Q", "chosen": "A"},
            r"no 'rejected' field for the preference format \(fields: \['chosen', 'prompt'\]\)",
        ),
        ({"chosen": "A", "rejected": "B"}, r"no 'prompt' \(or 'messages'\) field"),
        ({"prompt": "Q", "messages": MESSAGE_CONTEXT, "chosen": "A", "rejected": "B"}, "both 'prompt' and 'messages'"),
        (
            {
                "prompt": MESSAGE_CONTEXT,
                "chosen": [
                    {"role": "assistant", "content": "x"},
                    {"role": "user", "content": "more"},
                    {"role": "assistant", "content": "A"},
                ],
                "rejected": [
                    {"role": "assistant", "content": "y"},
                    {"role": "user", "content": "more"},
                    {"role": "assistant", "content": "B"},
                ],
            },
            "different contexts",
        ),
        (
            {
                "prompt": MESSAGE_CONTEXT,
                "chosen": [{"role": "user", "content": "more"}, {"role": "assistant", "content": "A"}],
                "rejected": [{"role": "assistant", "content": "B"}],
            },
            "different contexts",
        ),
        (
            pair_record(chosen=[{"role": "user", "content": "A"}]),
            r"last message of 'chosen' must be the assistant reply",
        ),
        (pair_record(rejected=[]), r"'rejected' holds no message"),
        (pair_record(chosen=7), r"'chosen' must be a string, a message or a list of messages, got int"),
        (pair_record(rejected=[{"role": "assistant", "content": 7}]), r"rejected: message 1 content must be a string"),
        (
            pair_record(prompt=[{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]),
            "context of the chosen reply must end with a user or tool turn, got a last turn of role 'assistant'",
        ),
        (pair_record(prompt=[]), "context of the chosen reply must end with a user or tool turn, got no context"),
        (pair_record(prompt=[{"role": "robot", "content": "Q"}]), "chosen: message 0 has role 'robot'"),
        (pair_record(prompt=["user"]), "chosen: message 0 must be an object, got str"),
        (pair_record(chosen="a<|im_end|>b"), r"end of its content is not inside"),
    ],
)
def test_bad_pairs_raise_naming_the_record(tmp_path, tokenizer, bad_record, problem):
    documents = documents_of(tmp_path, tokenizer, [pair_record(), pair_record(), bad_record])
    assert isinstance(documents.get(1), Document)
    with pytest.raises(DataError, match=rf"pairs\.jsonl record 3 \(line 3\): .*{problem}"):
        documents.get(2)
    with pytest.raises(DataError, match=rf"pairs\.jsonl record 3 \(line 3\): .*{problem}"):
        documents.get_many([0, 1, 2])


def test_sharegpt_preference_missing_column(tmp_path, tokenizer):
    records = [
        {
            "conversations": [{"from": "human", "value": "Q"}],
            "chosen": {"from": "gpt", "value": "A"},
            "rejected": {"from": "gpt", "value": "B"},
        },
        {"conversations": [{"from": "human", "value": "Q"}], "chosen": {"from": "gpt", "value": "A"}},
    ]
    documents = documents_of(tmp_path, tokenizer, records, format="sharegpt_preference")
    assert isinstance(documents.get(0), Document)
    with pytest.raises(
        DataError, match=r"pairs\.jsonl record 2 \(line 2\): no 'rejected' field for the sharegpt_preference format"
    ):
        documents.get(1)


def test_identical_replies_are_a_counted_skip(tmp_path, tokenizer):
    same = [{"role": "assistant", "content": "2"}]
    documents = documents_of(
        tmp_path,
        tokenizer,
        [pair_record(), pair_record(rejected="2"), {"prompt": MESSAGE_CONTEXT, "chosen": same, "rejected": same}],
    )
    outcomes = documents.get_many([0, 1, 2])
    assert isinstance(outcomes[0], Document)
    assert outcomes[1:] == [
        Skipped(
            "identical_replies",
            f"{tmp_path / 'pairs.jsonl'} record {i} (line {i}): the chosen "
            "and the rejected reply are the same, nothing to prefer",
        )
        for i in (2, 3)
    ]
    # a batch of skips only still works
    assert documents.get_many([1, 2]) == outcomes[1:]


def test_overlong_pairs_are_dropped_or_raise(tmp_path, tokenizer):
    short, long = pair_record(), pair_record(chosen="word " * 60, rejected="other " * 60)
    fits = documents_of(tmp_path, tokenizer, [short], max_tokens=4096).get(0)
    budget = len(fits)
    # each side of the long pair fits alone, but not both together: still overlong
    probe = documents_of(tmp_path, tokenizer, [long], max_tokens=4096).get(0)
    chosen_len, rejected_len = probe.segments
    limit = max(chosen_len, rejected_len) + 1
    assert limit < chosen_len + rejected_len and budget <= limit
    dropped = documents_of(tmp_path, tokenizer, [short, long], max_tokens=limit, overlong="drop")
    outcomes = dropped.get_many([0, 1])
    assert isinstance(outcomes[0], Document) and outcomes[0].input_ids.tolist() == fits.input_ids.tolist()
    assert isinstance(outcomes[1], Skipped) and outcomes[1].reason == "overlong"
    assert f"{chosen_len + rejected_len} tokens (chosen {chosen_len} + rejected {rejected_len})" in outcomes[1].detail
    # exactly at the budget is not overlong
    assert isinstance(documents_of(tmp_path, tokenizer, [long], max_tokens=chosen_len + rejected_len).get(0), Document)
    # a side alone over the budget
    assert documents_of(tmp_path, tokenizer, [long], max_tokens=10).get(0).reason == "overlong"
    strict = documents_of(tmp_path, tokenizer, [short, long], max_tokens=limit, overlong="error")
    assert isinstance(strict.get(0), Document)
    with pytest.raises(
        DataError,
        match=rf"pairs\.jsonl record 2 \(line 2\): {chosen_len + rejected_len} tokens .* exceed "
        rf"data.max_tokens_per_microbatch={limit}",
    ):
        strict.get(1)
    with pytest.raises(DataError, match="pairs\\.jsonl record 2 \\(line 2\\)"):
        strict.get_many([0, 1])
    with pytest.raises(ValueError, match="data.overlong"):
        documents_of(tmp_path, tokenizer, [short], overlong="truncate")


def test_non_preference_sources_are_refused(tmp_path, tokenizer):
    path = write_jsonl(
        tmp_path / "chats.jsonl",
        [{"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}],
    )
    with pytest.raises(DataError, match="DPO needs preference data"):
        PairDocuments(RecordSource([SourceSpec(path)]), tokenizer, 2048)


# --------------------------------------------------------------------------------------------------------------
# Batched reading equals reading one by one
# --------------------------------------------------------------------------------------------------------------


def test_get_many_equals_get_one_by_one(tmp_path, tokenizer):
    demo = [json.loads(line) for line in DEMO_PAIRS.read_text().splitlines()[:40]]
    records = demo[:10] + [pair_record(rejected="2", chosen="2"), pair_record(chosen="word " * 400)] + demo[10:]
    other = write_jsonl(tmp_path / "more.jsonl", demo[20:30])
    documents = PairDocuments(
        RecordSource(
            [
                SourceSpec(write_jsonl(tmp_path / "pairs.jsonl", records), format="preference"),
                SourceSpec(other, format="preference"),
            ]
        ),
        tokenizer,
        max_tokens=400,
    )
    indices = [3, 0, 11, 10, 45, 2, 41, 3, 20, 49]
    batched = documents.get_many(indices)
    assert batched == [documents.get(i) for i in indices]
    assert [type(o).__name__ for o in batched].count("Skipped") == 2
    assert [o.doc_id for o in batched if isinstance(o, Document)] == [3, 0, 45, 2, 41, 3, 20, 49]
    everything = documents.get_many(range(len(documents)))
    assert everything == [documents.get(i) for i in range(len(documents))]


# --------------------------------------------------------------------------------------------------------------
# Shared prompts (data.share_prompts)
# --------------------------------------------------------------------------------------------------------------


def check_shared_pair(tokenizer, pair: PreferencePair, unshared: Document, shared: Document, label: str) -> int:
    """The shared document of a pair is the unshared one less the rejected side's copy of the prompt: the prompt as
    `apply_chat_template(..., add_generation_prompt=True)` writes it, less its last token (which predicts each
    reply's first token, so each side keeps it). Returns the tokens saved."""
    prompt = tokenizer.apply_chat_template(pair.context, tools=pair.tools, add_generation_prompt=True, tokenize=True)
    saved = len(prompt["input_ids"]) - 1
    assert shared.shared_prefix == saved, f"{label}: shared {shared.shared_prefix}, the prompt less one {saved}"
    chosen, rejected = unshared.segments
    assert shared.segments == (chosen, rejected - saved), label
    assert (
        shared.input_ids.tolist()
        == unshared.input_ids[:chosen].tolist() + unshared.input_ids[chosen + saved :].tolist()
    )
    assert shared.labels.tolist() == unshared.labels[:chosen].tolist() + unshared.labels[chosen + saved :].tolist()
    assert (unshared.labels[chosen : chosen + saved] == IGNORE_INDEX).all(), f"{label}: a dropped token was trained"
    return saved


def test_a_shared_pair_is_the_unshared_pair_less_the_second_copy_of_its_prompt(tokenizer, demo_pairs):
    spec, pairs = demo_pairs
    unshared = PairDocuments(RecordSource([spec]), tokenizer, max_tokens=4096).get_many(range(200))
    shared = PairDocuments(RecordSource([spec]), tokenizer, max_tokens=4096, share_prompts=True).get_many(range(200))
    for index, pair in enumerate(pairs[:200]):
        check_shared_pair(tokenizer, pair, unshared[index], shared[index], f"demo pair {index}")


@pytest.mark.parametrize("file", sorted(SHARED_FILES))
def test_shared_prompts_on_the_shared_preference_files_with_qwen3(file):
    tokenizer = AutoTokenizer.from_pretrained(_shared("tokenizers", "qwen3"))
    spec = SourceSpec(str(_shared("data", file)), format=SHARED_FILES[file])
    pairs = read_pairs(spec)
    unshared = PairDocuments(RecordSource([spec]), tokenizer, max_tokens=1 << 20).get_many(range(len(pairs)))
    shared = PairDocuments(RecordSource([spec]), tokenizer, 1 << 20, share_prompts=True).get_many(range(len(pairs)))
    saved = sum(
        check_shared_pair(tokenizer, pair, unshared[i], shared[i], f"{file} record {i}")
        for i, pair in enumerate(pairs)
        if pair is not None
    )
    assert saved > 0


def test_the_budget_counts_a_shared_prompt_once(tmp_path, tokenizer):
    prompt = "Tell me about the weather in a long sentence " * 6
    records = [pair_record(prompt=prompt, chosen="Sunny.", rejected="Rain.")]
    unshared = documents_of(tmp_path, tokenizer, records).get_many([0])[0]
    budget = len(unshared) - 1  # the pair's two sides just do not fit unshared
    over = documents_of(tmp_path, tokenizer, records, max_tokens=budget).get_many([0])[0]
    assert isinstance(over, Skipped) and over.reason == "overlong"
    path = write_jsonl(tmp_path / "pairs.jsonl", records)
    fits = PairDocuments(
        RecordSource([SourceSpec(path, format="preference")]), tokenizer, budget, share_prompts=True
    ).get_many([0])[0]
    assert isinstance(fits, Document) and len(fits) == len(unshared) - fits.shared_prefix <= budget
    tight = PairDocuments(
        RecordSource([SourceSpec(path, format="preference")]), tokenizer, len(fits) - 1, "drop", share_prompts=True
    )
    skipped = tight.get_many([0])[0]
    assert isinstance(skipped, Skipped) and f"- their shared prompt {fits.shared_prefix})" in skipped.detail
