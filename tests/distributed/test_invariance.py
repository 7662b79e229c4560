"""The core promise: one step's gradients do not depend on how its documents are split into
microbatches and ranks, and equal the gradient of the mean token loss computed the plain way."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from chattune.data.documents import IGNORE_INDEX
from chattune.data.feed import StepBatches
from chattune.data.packing import collate_packed, empty_batch
from chattune.distributed import exit_process, shutdown_distributed
from chattune.hf_layout import decoder_layers
from chattune.model.causal_lm import PackedCausalLM
from chattune.objectives.cross_entropy import TokenCrossEntropy
from chattune.parallel.fsdp import shard_model
from chattune.train.evaluation import evaluate
from chattune.train.metrics import step_metrics
from chattune.train.step import accumulate_gradients, clip_gradients
from conftest import demo_documents, free_port, init_worker_process_group, mesh_dims, relative_error, spawn, tiny_model

NUM_DOCS = 12


def _worker(
    rank: int, world_size: int, port: int, splits: list[list[list[int]]], out_path: str, checkpointing: bool
) -> None:
    init_worker_process_group(rank, world_size, port)
    docs = demo_documents(NUM_DOCS)
    model = PackedCausalLM(tiny_model(seed=0), loss_chunk_size=16)
    placement = shard_model(model, mesh_dims(), activation_checkpointing=checkpointing)
    model.train()
    assert all(layer.gradient_checkpointing == checkpointing for layer in decoder_layers(model))
    microbatches = [collate_packed([docs[i] for i in mb]) if mb else empty_batch(0) for mb in splits[rank]]
    objective = TokenCrossEntropy()
    eval_loss = evaluate(model, objective, microbatches, placement.dims, pad_token_id=0)["eval_loss"]
    result = accumulate_gradients(model, objective, StepBatches(microbatches), placement)
    grads = {name.removeprefix("hf_model."): p.grad.full_tensor().clone() for name, p in model.named_parameters()}
    metrics = step_metrics(1, result, objective, grad_norm=0.0, lr=0.0, step_time_s=1.0, device=torch.device("cpu"))
    grad_norm, _ = clip_gradients(model, placement, max_norm=None)
    clipped_norm, _ = clip_gradients(model, placement, max_norm=grad_norm / 4)  # clips, returns the norm before
    clipped = {name.removeprefix("hf_model."): p.grad.full_tensor() for name, p in model.named_parameters()}
    if rank == 0:
        torch.save(
            {
                "grads": grads,
                "global_units": result.global_units,
                "loss": metrics["loss"],
                "eval_loss": eval_loss,
                "grad_norm": grad_norm,
                "clipped_norm": clipped_norm,
                "clipped": clipped,
            },
            out_path,
        )
    shutdown_distributed()
    exit_process()


def run_split(splits: list[list[list[int]]], tmp_path, name: str, checkpointing: bool = False) -> dict:
    out_path = str(tmp_path / f"{name}.pt")
    spawn(_worker, args=(len(splits), free_port(), splits, out_path, checkpointing), nprocs=len(splits))
    return torch.load(out_path)


def reference_gradients() -> tuple[dict[str, torch.Tensor], int, float]:
    """Plain HF forward, one document at a time, stock SDPA, full logits: mean over all trained tokens."""
    model = tiny_model(seed=0)
    model.set_attn_implementation("sdpa")
    docs = demo_documents(NUM_DOCS)
    total_loss, total_tokens = 0.0, 0
    for doc in docs:
        logits = model(input_ids=torch.tensor([doc.input_ids.tolist()]), use_cache=False).logits[0]
        labels = torch.tensor(doc.labels.tolist())
        total_loss = total_loss + F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
        total_tokens += int((labels != IGNORE_INDEX).sum())
    mean_loss = total_loss / total_tokens
    mean_loss.backward()
    return {name: p.grad for name, p in model.named_parameters()}, total_tokens, float(mean_loss.detach())


@pytest.mark.launch
def test_gradients_invariant_to_microbatches_and_ranks(tmp_path):
    everything = list(range(NUM_DOCS))
    splits = {
        "1rank_1mb": [[everything]],
        "1rank_4mb": [[[0, 1, 2], [3, 4, 5, 6, 7], [8, 9], [10, 11]]],
        # Deliberately uneven: rank 0 holds more tokens, so a rank-local normaliser would be wrong.
        "2rank_2mb": [[[0, 1, 2, 3, 4], [5, 6, 7, 8]], [[9], [10, 11]]],
        # A rank short of data runs an empty microbatch and still contributes correctly.
        "2rank_2mb_one_empty": [[[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], [[11], []]],
        # Activation checkpointing recomputes layers (and re-enters FSDP hooks) in backward: same numbers.
        "2rank_2mb_checkpointing": [[[0, 1, 2, 3, 4], [5, 6, 7, 8]], [[9], [10, 11]]],
    }
    want, want_tokens, want_loss = reference_gradients()
    for name, split in splits.items():
        result = run_split(split, tmp_path, name, checkpointing=name.endswith("checkpointing"))
        assert result["global_units"] == want_tokens, name
        assert abs(result["loss"] - want_loss) <= 1e-5 * want_loss, (
            f"{name}: logged loss {result['loss']} vs {want_loss}"
        )
        assert abs(result["eval_loss"] - want_loss) <= 1e-5 * want_loss, f"{name}: eval loss {result['eval_loss']}"
        want_norm = float(torch.sqrt(sum(g.double().square().sum() for g in want.values())))
        assert abs(result["grad_norm"] - want_norm) <= 1e-5 * want_norm, (
            f"{name}: grad norm {result['grad_norm']} vs {want_norm}"
        )
        assert result["clipped_norm"] == result["grad_norm"]
        assert relative_error(result["clipped"], {k: g / 4 for k, g in want.items()}) <= 1e-5, f"{name}: clipping"
        error = relative_error(result["grads"], want)
        assert error <= 1e-6, f"{name}: relative gradient error {error:.3g}"


def test_reference_detects_a_wrong_normaliser():
    """Guard that the comparison can fail: a per-document mean (a common mistake) differs clearly."""
    want, _, _ = reference_gradients()
    model = tiny_model(seed=0)
    model.set_attn_implementation("sdpa")
    docs = demo_documents(NUM_DOCS)
    loss = 0.0
    for doc in docs:
        logits = model(input_ids=torch.tensor([doc.input_ids.tolist()]), use_cache=False).logits[0]
        loss = loss + F.cross_entropy(logits, torch.tensor(doc.labels.tolist()), ignore_index=IGNORE_INDEX) / len(docs)
    loss.backward()
    wrong = {name: p.grad for name, p in model.named_parameters()}
    assert relative_error(wrong, want) > 1e-3
