"""A new objective plugs in by subclassing `Objective` and writing its three abstract methods: the update step
and the evaluation call every other hook through its default, with no probing (`chattune.objectives.base`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from chattune.data.documents import IGNORE_INDEX
from chattune.data.feed import StepBatches
from chattune.data.packing import PackedBatch, collate_packed
from chattune.distributed import exit_process, shutdown_distributed
from chattune.model.causal_lm import PackedCausalLM
from chattune.objectives.base import Objective, model_losses
from chattune.parallel.fsdp import shard_model
from chattune.train.evaluation import evaluate
from chattune.train.step import accumulate_gradients
from conftest import demo_documents, free_port, init_worker_process_group, mesh_dims, relative_error, spawn, tiny_model


class DocumentMeanCrossEntropy(Objective):
    """Each document weighs the same, whatever its length: the mean of its tokens' cross-entropy."""

    unit_name = "document"

    def count_units(self, batch: PackedBatch) -> int:
        return len(batch.doc_ids)

    def loss_sum(self, model, batch):
        token_losses, _ = model_losses(model, batch)
        trained = (batch.labels[0] != IGNORE_INDEX).to(token_losses.dtype)
        segments = batch.segment_ids.to(token_losses.device)
        count = len(batch.doc_ids)
        sums = torch.zeros(count, dtype=token_losses.dtype).index_add(
            0, segments[segments < count], token_losses[segments < count]
        )
        tokens = torch.zeros(count, dtype=token_losses.dtype).index_add(
            0, segments[segments < count], trained[segments < count]
        )
        return (sums / tokens.clamp(min=1)).sum(), {}

    def metrics(self, sums, global_units):
        return {"loss": sums["loss_sum"] / max(global_units, 1)}


def test_an_objective_must_write_the_three_abstract_methods():
    class Incomplete(Objective):
        unit_name = "thing"

        def count_units(self, batch):
            return 0

    with pytest.raises(TypeError, match="loss_sum"):
        Incomplete()


def _worker(rank: int, out: str) -> None:
    init_worker_process_group(rank, 1, int(out.rsplit(":", 1)[1]))
    documents = demo_documents(3)
    model = PackedCausalLM(tiny_model(seed=0))
    placement = shard_model(model, mesh_dims())
    objective = DocumentMeanCrossEntropy()
    accumulate_gradients(model, objective, StepBatches([collate_packed(documents)]), placement)
    packed = {name.removeprefix("hf_model."): p.grad.full_tensor() for name, p in model.named_parameters()}
    held_out = evaluate(model, objective, [collate_packed(documents)], placement.dims, pad_token_id=0)

    # Independently: stock transformers on each document alone, the mean of its tokens' losses, averaged.
    reference = tiny_model(seed=0)
    losses = []
    for document in documents:
        input_ids = torch.tensor([document.input_ids])
        labels = torch.tensor([document.labels])
        logits = reference(input_ids=input_ids).logits[0]
        losses.append(F.cross_entropy(logits, labels[0], ignore_index=IGNORE_INDEX))
    loss = torch.stack(losses).mean()
    loss.backward()
    assert abs(held_out["eval_loss"] - loss.item()) < 1e-5 * loss.item()
    for name, parameter in reference.named_parameters():
        assert relative_error(packed[name], parameter.grad) < 1e-5, name
    shutdown_distributed()
    exit_process()


@pytest.mark.launch
def test_a_new_objective_trains_and_evaluates_exactly_without_touching_the_loop():
    spawn(_worker, args=(f"port:{free_port()}",), nprocs=1)
