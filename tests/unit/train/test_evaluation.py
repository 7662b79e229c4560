"""Held-out evaluation (chattune/train/evaluation.py): the loss of stock transformers on each document alone,
with one device-to-host transfer for the whole evaluation, not one per batch."""

from __future__ import annotations

import traceback
from unittest import mock

import torch
import torch.nn.functional as F

from chattune.data.documents import IGNORE_INDEX
from chattune.data.packing import collate_packed
from chattune.distributed import ParallelDims
from chattune.model.causal_lm import PackedCausalLM
from chattune.objectives.cross_entropy import TokenCrossEntropy
from chattune.train.evaluation import evaluate
from conftest import demo_documents, tiny_model

TRANSFERS = ("__float__", "item", "tolist", "__int__", "__bool__")


def test_evaluation_sums_on_the_device_and_transfers_once_at_the_end():
    documents = demo_documents(6)
    batches = [collate_packed(documents[i : i + 2]) for i in range(0, 6, 2)]
    model = PackedCausalLM(tiny_model(seed=0))
    calls: list[tuple[str, str]] = []
    original = {name: getattr(torch.Tensor, name) for name in TRANSFERS}

    def counted(name):
        def method(self, *args, **kwargs):
            caller = traceback.extract_stack(limit=2)[0]
            calls.append((name, f"{caller.filename}:{caller.name}"))
            return original[name](self, *args, **kwargs)

        return method

    with mock.patch.multiple(torch.Tensor, **{name: counted(name) for name in TRANSFERS}):
        held_out = evaluate(model, TokenCrossEntropy(), batches, ParallelDims.one_rank(), pad_token_id=0)
    # (the per-document attention's host bounds and the host batch's unit count are not transfers on a GPU)
    from_evaluation = [name for name, caller in calls if caller.endswith("evaluation.py:evaluate")]
    assert from_evaluation == ["tolist"] and not any(name == "__float__" for name, _ in calls), calls

    # Independently: stock transformers on each document alone, the token losses summed over all of them.
    reference = tiny_model(seed=0)
    with torch.no_grad():
        losses = [
            F.cross_entropy(
                reference(input_ids=torch.as_tensor(d.input_ids).unsqueeze(0)).logits[0],
                torch.tensor(d.labels),
                ignore_index=IGNORE_INDEX,
                reduction="sum",
            )
            for d in documents
        ]
    tokens = sum(sum(label != IGNORE_INDEX for label in d.labels) for d in documents)
    assert held_out["eval_num_tokens"] == tokens
    assert abs(held_out["eval_loss"] - float(sum(losses)) / tokens) < 1e-5 * held_out["eval_loss"]
