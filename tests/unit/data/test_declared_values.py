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
