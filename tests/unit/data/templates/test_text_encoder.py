"""`TextBatchEncoder`: the ids are the tokenizer's own, the masks follow the first-character rule on
transformers' own offsets, and a text cut after an end-of-turn token tokenizes to exactly the first tokens
of the whole text."""

from __future__ import annotations

import json
import random

import pytest
from transformers import AutoTokenizer

from chattune.config.paths import DEMO_ASSETS
from chattune.data.ingest.formats import SourceSpec, to_conversation
from chattune.data.ingest.records import RecordSource
from chattune.data.templates import text_encoder
from chattune.data.templates.chat_template import probe_template, render_conversation
from chattune.data.templates.sft_documents import SFTDocuments
from chattune.data.templates.text_encoder import TextBatchEncoder
from conftest import SHARED_ASSETS

TOKENIZERS = {
    "demo": DEMO_ASSETS / "tokenizer",
    "qwen3": SHARED_ASSETS / "tokenizers" / "qwen3",
    "phi3": SHARED_ASSETS / "tokenizers" / "phi-3-mini",
}
SHARED_CHATS = [
    SourceSpec(str(SHARED_ASSETS / "data" / "sharegpt_fastchat_dummy.json"), format="sharegpt"),
    SourceSpec(str(SHARED_ASSETS / "data" / "sharegpt_toolcall_300.json"), format="sharegpt"),
    SourceSpec(str(SHARED_ASSETS / "data" / "messages_deita_long.parquet")),
]


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def tokenizer(request):
    path = TOKENIZERS[request.param]
    if not path.exists():
        pytest.skip(f"shared test assets not available ({path})")
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def rendered(tokenizer) -> list[str]:
    """The demo chats, and the shared real chats (tool calls, long conversations) where they are present."""
    with open(DEMO_ASSETS / "chat_train.jsonl") as f:
        conversations = [json.loads(line)["messages"] for _, line in zip(range(100), f)]
    # Characters of several tokens each (a byte-level tokenizer splits them), as real chats hold: the only texts
    # whose first characters give more tokens than characters, with or without the shared chats.
    conversations.append(
        [
            {"role": "user", "content": "二加二等于几？" * 12},
            {"role": "assistant", "content": "答案是四。🙂 Ünïcödé " * 12},
        ]
    )
    texts = [render_conversation(tokenizer, messages) for messages in conversations]
    if SHARED_ASSETS.exists():
        records = RecordSource(SHARED_CHATS)
        for index in range(len(records)):
            spec, where, record = records.locate(index)
            conversation = to_conversation(record, spec, where)
            try:
                texts.append(render_conversation(tokenizer, conversation.messages, conversation.tools))
            except Exception:  # a template's own refusal (e.g. Phi-3 and tool roles): not this test's subject
                continue
    return texts


def _first_character_mask(tokenizer, text: str, spans: list[tuple[int, int]]) -> list[bool]:
    """The masking rule from transformers' own offsets, token by token: trained when the token's first
    character lies in a span."""
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return [any(start <= first < end for start, end in spans) for first, _ in offsets]


def test_masks_follow_the_first_character_rule(tokenizer):
    """The encoder finds a span's tokens from its two bounds alone (no per-token offsets): for random spans
    over text with multi-byte and multi-token characters, bounds inside a token, at the end of the text and
    empty spans, its masks equal the first-character rule on transformers' offsets, and so do those of the
    generic path (any tokenizer's own `__call__`)."""
    pieces = [
        "Hello",
        " world",
        "\n\n",
        "  ",
        "Ünïcödé",
        " «quotes»",
        " 🙂🙂",
        " 👩‍👩‍👧",
        " 漢字かな",
        " e\u0301",
        "<|im_end|>",
        "\t",
        "abc123",
        " ...",
        "\u200b",
        "ﬁ",
    ]
    rng = random.Random(0)
    texts, spans = [], []
    for _ in range(200):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 30)))
        bounds = sorted(rng.choices(range(len(text) + 1), k=2 * rng.randint(0, 3)))
        texts.append(text)
        spans.append(list(zip(bounds[0::2], bounds[1::2])))
    spans[0] = [(0, len(texts[0]))]
    generic = TextBatchEncoder(tokenizer)
    generic._backend = None
    for encoder in (TextBatchEncoder(tokenizer), generic):
        encoded = encoder(texts, spans)
        ends = encoded.ends.tolist()
        for k, (text, text_spans) in enumerate(zip(texts, spans)):
            mask = encoded.trainable[ends[k] - encoded.lengths[k] : ends[k]].tolist()
            assert mask == _first_character_mask(tokenizer, text, text_spans), (text, text_spans)
    assert TextBatchEncoder(tokenizer)._backend is not None  # the fast path was the one checked first


def test_a_text_cut_after_end_of_turn_tokenizes_to_the_first_tokens_of_the_whole(tokenizer, rendered):
    """The property cutting relies on, checked with the tokenizer alone: at every end-of-turn token of every
    rendered chat, the prefix's ids and token starts are the whole text's first ones."""
    end_of_turn = probe_template(tokenizer).end_of_turn
    assert TextBatchEncoder(tokenizer, cut_after=end_of_turn).cut_after == end_of_turn
    checked = 0
    for text in rendered:
        whole = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        at = text.find(end_of_turn)
        while at >= 0:
            cut = at + len(end_of_turn)
            prefix = tokenizer(text[:cut], add_special_tokens=False, return_offsets_mapping=True)
            count = len(prefix["input_ids"])
            assert prefix["input_ids"] == whole["input_ids"][:count]
            assert [s for s, _ in prefix["offset_mapping"]] == [s for s, _ in whole["offset_mapping"][:count]]
            checked += 1
            at = text.find(end_of_turn, cut)
    assert checked > len(rendered)


def test_cutting_is_refused_where_it_would_not_be_exact(tokenizer):
    end_of_turn = probe_template(tokenizer).end_of_turn
    assert TextBatchEncoder(tokenizer, cut_after="plain words").cut_after is None  # not an added token
    assert TextBatchEncoder(tokenizer, cut_after=None).cut_after is None
    tokenizer.split_special_tokens = True  # special tokens tokenized as text: no longer a split point
    try:
        assert TextBatchEncoder(tokenizer, cut_after=end_of_turn).cut_after is None
    finally:
        tokenizer.split_special_tokens = False


@pytest.mark.parametrize("chars_per_token", [6, 1])
def test_cut_texts_keep_their_first_tokens_and_masks(tokenizer, rendered, monkeypatch, chars_per_token):
    """With only the first `needed` tokens needed, cut texts give the same first tokens and masks as whole
    ones and count more than `needed`; at 1 character per token some cuts fall short and are redone whole."""
    monkeypatch.setattr(text_encoder, "CUT_CHARS_PER_TOKEN", chars_per_token)
    needed = 48
    end_of_turn = probe_template(tokenizer).end_of_turn
    spans = [[(0, len(t) // 3), (len(t) // 2, len(t))] for t in rendered]
    whole = TextBatchEncoder(tokenizer)(rendered, spans)
    calls = []
    encode = TextBatchEncoder._encode_with_backend
    monkeypatch.setattr(
        TextBatchEncoder, "_encode_with_backend", lambda self, texts: calls.append(len(texts)) or encode(self, texts)
    )
    cut = TextBatchEncoder(tokenizer, cut_after=end_of_turn)(rendered, spans, needed=needed)
    assert cut.cut.any()
    assert len(calls) == (2 if chars_per_token == 1 else 1)  # the second call: cuts that fell short, whole
    whole_ends, cut_ends = whole.ends.tolist(), cut.ends.tolist()
    for k in range(len(rendered)):
        a, b = whole_ends[k] - whole.lengths[k], cut_ends[k] - cut.lengths[k]
        if cut.cut[k]:
            assert cut.counts[k] > needed and cut.counts[k] < whole.counts[k]
            assert cut.ids[b : b + needed].tolist() == whole.ids[a : a + needed].tolist()
            assert cut.trainable[b : b + needed].tolist() == whole.trainable[a : a + needed].tolist()
        else:
            assert cut.ids[b : cut_ends[k]].tolist() == whole.ids[a : whole_ends[k]].tolist()
            assert cut.trainable[b : cut_ends[k]].tolist() == whole.trainable[a : whole_ends[k]].tolist()


def test_truncated_and_dropped_records_are_those_of_whole_tokenization(tmp_path, monkeypatch):
    """SFT documents cut early (truncate, drop) equal the first piece of a split, which is never cut, and
    their ids are apply_chat_template's; the drops are the same records."""
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZERS["demo"])
    rows = [json.loads(line) for line in (DEMO_ASSETS / "chat_train.jsonl").read_text().splitlines()[:200]]
    # long multi-turn chats: several demo chats one after the other
    chats = [
        {"messages": [m for row in rows[i : i + 12] for m in row["messages"] if m["role"] != "system"]}
        for i in range(0, 200, 12)
    ] + rows[:20]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in chats))
    cuts = []
    encode = TextBatchEncoder._encode_with_backend
    monkeypatch.setattr(
        TextBatchEncoder,
        "_encode_with_backend",
        lambda self, texts: cuts.extend(len(t) for t in texts) or encode(self, texts),
    )
    budget = 96
    documents = {
        policy: SFTDocuments(RecordSource([SourceSpec(str(path))]), tokenizer, budget, overlong=policy)
        for policy in ("truncate", "drop", "split")
    }
    indices = list(range(len(chats)))
    truncated = documents["truncate"].get_many(indices)
    assert sum(cuts) < sum(len(render_conversation(tokenizer, c["messages"])) for c in chats)  # some were cut
    dropped = documents["drop"].get_many(indices)
    first_pieces = [d for d in documents["split"].get_many(indices) if d.piece == 0]
    assert [(d.doc_id, d.input_ids.tolist(), d.labels.tolist()) for d in truncated] == [
        (d.doc_id, d.input_ids.tolist(), d.labels.tolist()) for d in first_pieces
    ]
    for d in truncated:
        assert d.input_ids.tolist() == tokenizer.apply_chat_template(chats[d.doc_id]["messages"])["input_ids"][:budget]
    long_ones = {d.doc_id for d in first_pieces if d.overlong}
    assert long_ones and {i for i, d in enumerate(dropped) if getattr(d, "reason", "") == "overlong"} == long_ones
