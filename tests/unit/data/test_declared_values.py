"""Per-token and per-document values a recipe's data declares (`Document.token_values`, `doc_values`), carried by
packing to the objective without packing naming them: laid back to back with the tokens (padding 0), in document
order, moved with the batch; a document missing a value its batch has, or with one of the wrong length, refused."""

import numpy as np
import pytest
import torch

from chattune.data.documents import IGNORE_INDEX, Document
from chattune.data.packing import collate_packed


def _document(doc_id: int, length: int, **values) -> Document:
    ids = np.arange(1, length + 1)
    tokens = {name: np.asarray(v, dtype=np.float64) for name, v in values.items() if name != "reward"}
    documents = {"reward": values["reward"]} if "reward" in values else {}
    return Document(doc_id, ids, np.append(ids[1:], IGNORE_INDEX), token_values=tokens, doc_values=documents)


def test_values_ride_with_their_tokens_and_documents():
    batch = collate_packed(
        [_document(7, 3, advantage=[0.5, -1.0, 2.0], reward=1.5), _document(9, 2, advantage=[3.0, 4.0], reward=-2)],
        pad_to_multiple_of=8,
    )
    assert batch.doc_ids == [7, 9]
    want = torch.tensor([[0.5, -1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 0.0]])
    assert torch.equal(batch.token_values["advantage"], want)  # padding: 0
    assert batch.token_values["advantage"].shape == batch.input_ids.shape
    assert batch.doc_values == {"reward": [1.5, -2.0]}
    moved = batch.to("cpu")
    assert torch.equal(moved.token_values["advantage"], want) and moved.doc_values == batch.doc_values


def test_a_batch_without_values_has_none():
    batch = collate_packed([_document(0, 4), _document(1, 2)])
    assert batch.token_values == {} and batch.doc_values == {}


def test_a_value_missing_or_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match=r"document 1 has no value \['advantage'\]"):
        collate_packed([_document(0, 2, advantage=[1.0, 2.0]), _document(1, 2)])
    with pytest.raises(
        ValueError, match=r"document 0: token values \['advantage'\] are not one per token \(3 tokens\)"
    ):
        collate_packed([_document(0, 3, advantage=[1.0, 2.0])])


class _ValuedRecords:
    """A document source (one document a record) whose documents declare per-token values on some records only:
    `weight` on every third, `advantage` from record 5 on (a name first met in a later chunk of a build)."""

    def __init__(self, count: int):
        self.count = count

    def __len__(self) -> int:
        return self.count

    def get_many(self, indices):
        out = []
        for i in indices:
            length = 2 + i % 5
            tokens = {}
            if i % 3 == 0:
                tokens["weight"] = np.linspace(-1.0, 1.0, length).astype(np.float32) * (i + 1)
            if i >= 5:
                tokens["advantage"] = np.full(length, 0.25 * i, dtype=np.float32)
            doc = _document(i, length, **tokens, **({"reward": float(i)} if i % 2 else {}))
            out.append(doc)
        return out


def test_the_token_cache_keeps_each_documents_own_per_token_values(tmp_path, monkeypatch):
    """A token cache built in chunks and shards holds each document's per-token values as the source made them
    (float32), no value where a document declares none, and packing gets them from the cached documents as from
    the source's own."""
    from chattune.data import token_cache
    from chattune.data.ingest.formats import SourceSpec

    monkeypatch.setattr(token_cache, "CHUNK_RECORDS", 2)  # chunks of 2 records: `advantage` appears in the third
    source = _ValuedRecords(12)
    final = tmp_path / "cache" / "valued"
    staged = tmp_path / "cache" / ".building-valued"
    staged.mkdir(parents=True)
    for shard in (1, 0):  # shard 0 (records 0-5) commits after shard 1 (records 6-11) is written
        token_cache.build_source_cache(
            source,
            final,
            "sft",
            SourceSpec(str(tmp_path / "records.jsonl")),
            "key",
            part=token_cache.BuildShard(shard, num_shards=2, staging=staged, agree=lambda error: None),
        )
    cached = token_cache.CachedDocuments(final)
    every = list(range(len(source)))
    want, got = source.get_many(every), cached.get_many(every)
    for mine, theirs in zip(want, got):
        assert sorted(theirs.token_values) == sorted(mine.token_values), mine.doc_id
        for name, values in mine.token_values.items():
            assert theirs.token_values[name].dtype == np.float32 and np.array_equal(theirs.token_values[name], values)
        assert theirs.doc_values == mine.doc_values
    assert [d.doc_id for d in got if "advantage" in d.token_values] == list(range(5, 12))
    for picked, names in (([6], ["advantage", "weight"]), ([5, 7], ["advantage"])):
        batch = collate_packed([got[i] for i in picked])
        plain = collate_packed([want[i] for i in picked])
        assert sorted(batch.token_values) == names and batch.doc_values == plain.doc_values
        for name in names:
            assert torch.equal(batch.token_values[name], plain.token_values[name])
