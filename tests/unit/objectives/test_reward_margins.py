"""Per-pair margins for the reward model, as TRL's RewardTrainer reads them: the record's `margin` field is read by
`RewardPairDocuments` (not by DPO's `PairDocuments`), travels on the document through the packed batch and the token
cache, and the reward loss is -log σ(r_chosen - r_rejected - margin) + c (r_chosen + r_rejected)² per pair, a pair
without a margin at margin 0. A margin that is not a finite number is one clear error, or a counted skip.

The loss reference is computed independently: each reply scored alone by transformers' sequence classification
(tests/distributed/test_reward_step.py's helpers), the margins taken from the records as written.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from test_dpo_step import NUM_PAIRS, demo_pairs, pair_documents
from test_reward_step import CENTER, plain_rewards, tiny_reward_model

from chattune.data.documents import Document, Skipped
from chattune.data.feed import StepBatches
from chattune.data.ingest.formats import DataError, SourceSpec
from chattune.data.ingest.sources import PAIR_DATA, REWARD_PAIR_DATA, document_settings
from chattune.data.packing import collate_packed
from chattune.data.token_cache import CachedDocuments, build_source_cache, cache_name, source_key, tokenizer_digest
from chattune.model.sequence_score import PackedSequenceScorer
from chattune.objectives.reward import RewardObjective
from chattune.parallel.fsdp import Placement
from chattune.train.metrics import step_metrics
from chattune.train.step import accumulate_gradients
from conftest import demo_tokenizer, pair_margin_of, relative_error, with_values

# One margin per demo pair (None: the record has no `margin` field); large enough to move every pair's loss.
MARGINS = [1.5, None, -0.75, 3.0, None, 0.25, 2.0, -1.0]
PAIR = {"prompt": "What is 2 + 2?", "chosen": "4.", "rejected": "5."}


def write_lines(path: Path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def with_margin(record: dict, margin) -> dict:
    return record if margin is None else {**record, "margin": margin}


def data_section(cache: Path | str = "off", on_bad_record: str = "error"):
    return OmegaConf.create(
        {
            "cache": str(cache),
            "train_on": "assistant",
            "overlong": "drop",
            "on_bad_record": on_bad_record,
            "max_tokens_per_microbatch": 512,
            "num_workers": 0,
            "share_prompts": False,
        }
    )


def reward_source(path: str, on_bad_record: str = "error"):
    return REWARD_PAIR_DATA.source(
        SourceSpec(path, format="preference"), demo_tokenizer(), data_section("off", on_bad_record)
    )


# --------------------------------------------------------------------------------------------------------------
# Reading: the margin of each record, DPO ignoring it, and a bad one refused
# --------------------------------------------------------------------------------------------------------------


def test_reward_pairs_read_the_margin_of_each_record_and_dpo_pairs_ignore_it(tmp_path):
    records = [
        {**PAIR, "margin": 2.0},
        PAIR,  # no field: margin 0
        {**PAIR, "margin": None},  # null: no margin either
        {**PAIR, "margin": 3},  # an integer is a number
        {**PAIR, "margin": -0.5},
        {**PAIR, "margin": 0},
    ]
    path = write_lines(tmp_path / "pairs.jsonl", [json.dumps(r) for r in records])
    documents = reward_source(path).get_many(range(len(records)))
    assert [pair_margin_of(d) for d in documents] == [2.0, 0.0, 0.0, 3.0, -0.5, 0.0]  # none: trained at 0
    assert all(type(pair_margin_of(d)) is float for d in documents)
    dpo = PAIR_DATA.source(SourceSpec(path, format="preference"), demo_tokenizer(), data_section()).get_many(
        range(len(records))
    )
    assert all(isinstance(d, Document) and pair_margin_of(d) is None for d in dpo)
    # the documents are otherwise DPO's: the same tokens, labels and segments
    assert all(with_values(r, margin=None) == d for r, d in zip(documents, dpo))
    assert documents[0] != with_values(documents[0], margin=2.5)  # Document equality sees the margin


def test_sharegpt_preference_pairs_read_the_margin_too(tmp_path):
    record = {
        "conversations": [{"from": "human", "value": "What is 2 + 2?"}],
        "chosen": {"from": "gpt", "value": "4."},
        "rejected": {"from": "gpt", "value": "5."},
        "margin": 0.5,
    }
    path = write_lines(tmp_path / "pairs.jsonl", [json.dumps(record)])
    spec = SourceSpec(path, format="sharegpt_preference")
    assert REWARD_PAIR_DATA.source(spec, demo_tokenizer(), data_section()).get(0).doc_values["margin"] == 0.5


BAD_MARGINS = [
    ('"2"', "'2' (str)"),
    ('"NaN"', "'NaN' (str)"),
    ("true", "True (bool)"),
    ("false", "False (bool)"),
    ("NaN", "nan (float)"),  # Python's JSON reader accepts these three literals
    ("Infinity", "inf (float)"),
    ("-Infinity", "-inf (float)"),
    ("[1.0]", "[1.0] (list)"),
    ('{"value": 1}', "{'value': 1} (dict)"),
]


@pytest.mark.parametrize("written, shown", BAD_MARGINS)
def test_a_margin_that_is_not_a_finite_number_is_one_clear_error_or_a_counted_skip(tmp_path, written, shown):
    good = json.dumps({**PAIR, "margin": 1.0})
    bad = json.dumps(PAIR)[:-1] + f', "margin": {written}}}'
    path = write_lines(tmp_path / "pairs.jsonl", [good, bad])
    message = f"{path} record 2 (line 2): 'margin' must be a finite number (the pair's reward margin), got {shown}"
    with pytest.raises(DataError) as error:
        reward_source(path).get_many([0, 1])
    assert str(error.value).startswith(message), str(error.value)
    assert "data.on_bad_record=skip" in str(error.value)
    kept, skipped = reward_source(path, on_bad_record="skip").get_many([0, 1])
    assert pair_margin_of(kept) == 1.0
    assert isinstance(skipped, Skipped) and skipped.reason == "bad_record" and skipped.detail == message
    # DPO reads the same record as a pair, the field ignored
    dpo = PAIR_DATA.source(SourceSpec(path, format="preference"), demo_tokenizer(), data_section()).get(1)
    assert isinstance(dpo, Document) and pair_margin_of(dpo) is None


# --------------------------------------------------------------------------------------------------------------
# The margin travels: packed batches and the token cache
# --------------------------------------------------------------------------------------------------------------


def test_packed_batches_carry_the_margins(tmp_path):
    records = [with_margin(PAIR, m) for m in (0.5, None, -2.0)]
    documents = reward_source(write_lines(tmp_path / "p.jsonl", [json.dumps(r) for r in records])).get_many(range(3))
    batch = collate_packed([documents[2], documents[1], documents[0]], pad_to_multiple_of=64)
    assert batch.padding > 0 and batch.doc_ids == [2, 1, 0]
    assert batch.doc_values == {"margin": [-2.0, 0.0, 0.5]}  # one per real document (none: 0), the padding has none
    assert batch.to("cpu").doc_values == {"margin": [-2.0, 0.0, 0.5]}


def test_the_token_cache_keeps_the_margins(tmp_path):
    lines = [json.dumps(with_margin(pair, m)) for pair, m in zip(demo_pairs(), MARGINS)]
    lines.insert(3, json.dumps({**PAIR, "chosen": "same", "rejected": "same", "margin": 1.0}))  # identical: skipped
    lines.insert(5, json.dumps({**PAIR, "margin": "big"}))  # a bad margin: skipped under on_bad_record=skip
    path = write_lines(tmp_path / "pairs.jsonl", lines)
    spec, tokenizer = SourceSpec(path, format="preference"), demo_tokenizer()
    data = data_section(tmp_path / "cache", on_bad_record="skip")
    plain = REWARD_PAIR_DATA.source(spec, tokenizer, data)
    key = source_key("reward", spec, document_settings(spec, data), tokenizer_digest(tokenizer))
    final = tmp_path / "cache" / cache_name("reward", spec, key)
    build_source_cache(plain, final, "reward", spec, key)
    every = list(range(len(lines)))
    want, got = plain.get_many(every), CachedDocuments(final).get_many(every)
    assert [o.reason for o in want if isinstance(o, Skipped)] == ["identical_replies", "bad_record"]
    assert [pair_margin_of(d) for d in want if isinstance(d, Document)] == [m or 0.0 for m in MARGINS]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g == w  # Document equality includes the margin; a skip's reason and message
        if isinstance(w, Document):
            assert pair_margin_of(g) == pair_margin_of(w) and type(pair_margin_of(g)) is float
    # a shard written without margins (before they were read) reads as documents without one
    index = final / "shard-00000" / "index.npz"
    with np.load(index) as arrays:
        assert arrays["value:margin"].dtype == np.float64 and not np.isnan(arrays["value:margin"]).any()
        older = {name: arrays[name] for name in arrays.files if name != "value:margin"}
    np.savez(index, **older)
    assert all(pair_margin_of(d) is None for d in CachedDocuments(final).get_many(every) if isinstance(d, Document))


# --------------------------------------------------------------------------------------------------------------
# The loss: equal to a hand computation from plain sequence-classification forwards
# --------------------------------------------------------------------------------------------------------------


def margin_documents(tmp_path: Path) -> list[Document]:
    """The demo pairs with `MARGINS`, read by `RewardPairDocuments` from a JSONL file; checked against the pairs
    tokenized independently (test_dpo_step's `pair_documents`) with the margins as written."""
    lines = [json.dumps(with_margin(pair, m)) for pair, m in zip(demo_pairs(), MARGINS)]
    documents = reward_source(write_lines(tmp_path / "pairs.jsonl", lines)).get_many(range(NUM_PAIRS))
    assert documents == [with_values(d, margin=m or 0.0) for d, m in zip(pair_documents(), MARGINS)]
    return documents


def hand_losses(rewards, margins) -> list[torch.Tensor]:
    """TRL's RewardTrainer per pair: -log σ(r_chosen - r_rejected - margin) + c (r_chosen + r_rejected)²."""
    return [-F.logsigmoid(c - r - (m or 0.0)) + CENTER * (c + r) ** 2 for (c, r), m in zip(rewards, margins)]


def reference(documents, margins) -> tuple[float, dict[str, torch.Tensor]]:
    model = tiny_reward_model()
    model.set_attn_implementation("sdpa")
    mean = torch.stack(hand_losses(plain_rewards(model, documents), margins)).mean()
    mean.backward()
    return float(mean.detach()), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("splits", [[list(range(NUM_PAIRS))], [[0, 1, 2], [3, 4, 5, 6, 7]]], ids=["1mb", "2mb"])
def test_the_loss_and_gradients_with_margins_match_plain_sequence_classification(tmp_path, splits):
    documents = margin_documents(tmp_path)
    want_loss, want_grads = reference(documents, MARGINS)
    model = PackedSequenceScorer(tiny_reward_model())
    model.train()
    objective = RewardObjective(CENTER)
    microbatches = [collate_packed([documents[i] for i in mb], pad_to_multiple_of=64) for mb in splits]
    result = accumulate_gradients(model, objective, StepBatches(microbatches), Placement.one_rank())
    metrics = step_metrics(1, result, objective, grad_norm=0.0, lr=0.0, step_time_s=1.0, device=torch.device("cpu"))
    grads = {name.removeprefix("hf_model."): p.grad for name, p in model.named_parameters()}
    assert math.isclose(metrics["loss"], want_loss, rel_tol=1e-5, abs_tol=1e-6), (metrics["loss"], want_loss)
    error = relative_error(grads, want_grads)
    assert error <= 1e-5, f"relative gradient error {error:.3g}"
    # the metrics do not see the margins: the accuracy is still the fraction of pairs with r_chosen > r_rejected
    with torch.no_grad():
        rewards = plain_rewards(tiny_reward_model(), documents)
    accuracy = sum(float(c) > float(r) for c, r in rewards) / NUM_PAIRS
    assert math.isclose(metrics["rewards/accuracies"], accuracy, abs_tol=1e-6)
    assert metrics["num_pairs"] == NUM_PAIRS


def test_the_comparison_would_catch_margins_ignored_or_added():
    """Control: with these margins, the loss the objective must give differs clearly from the loss at margin 0 (the
    margins ignored) and from the loss with each margin added instead of subtracted; and a batch without margins
    gives the margin-0 loss."""
    model = tiny_reward_model()
    model.set_attn_implementation("sdpa")
    documents = [with_values(d, margin=m or 0.0) for d, m in zip(pair_documents(), MARGINS)]
    with torch.no_grad():
        rewards = plain_rewards(model, documents)
        want = float(torch.stack(hand_losses(rewards, MARGINS)).mean())
        ignored = float(torch.stack(hand_losses(rewards, [None] * NUM_PAIRS)).mean())
        added = float(torch.stack(hand_losses(rewards, [-(m or 0.0) for m in MARGINS])).mean())
        scorer = PackedSequenceScorer(tiny_reward_model())
        with_margins, _ = RewardObjective(CENTER).loss_sum(scorer, collate_packed(documents))
        without, _ = RewardObjective(CENTER).loss_sum(scorer, collate_packed(pair_documents()))
    assert abs(want - ignored) > 0.1 and abs(want - added) > 0.1, (want, ignored, added)
    assert math.isclose(float(with_margins) / NUM_PAIRS, want, rel_tol=1e-5)
    assert math.isclose(float(without) / NUM_PAIRS, ignored, rel_tol=1e-5)
