"""KTO through the shared update step: the reference point z is the whole step's (a no-grad pass, all-reduced), so
gradients and metrics equal a hand computation from plain unpacked HF forwards however the examples are split into
microbatches and ranks, with a live or a cached reference; an evaluation uses its whole set's z."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from test_dpo_step import demo_pairs, sequence_logps

from chattune.data.documents import Document, shifted_labels
from chattune.data.feed import StepBatches
from chattune.data.packing import collate_packed, empty_batch
from chattune.data.templates.chat_template import probe_template, tokenize_conversation
from chattune.distributed import exit_process, shutdown_distributed
from chattune.model.causal_lm import PackedCausalLM
from chattune.objectives.dpo import CachedReference, LiveReference
from chattune.objectives.kto import KTOObjective, KTOWeights
from chattune.parallel.fsdp import shard_model
from chattune.train.evaluation import evaluate
from chattune.train.metrics import step_metrics
from chattune.train.step import accumulate_gradients
from conftest import (
    demo_tokenizer,
    free_port,
    init_worker_process_group,
    kto_label,
    mesh_dims,
    relative_error,
    spawn,
    tiny_model,
    with_values,
)

NUM_EXAMPLES = 8
WEIGHTS = KTOWeights(beta=0.1, desirable=1.0, undesirable=1.5)  # unequal: a swapped weight would be caught
POLICY_SEED, REFERENCE_SEED = 0, 1


def desirable(index: int) -> bool:
    return index % 3 != 2  # 6 desirable, 2 undesirable: unbalanced, as real KTO data often is


def kto_documents() -> list[Document]:
    """Built here, independently of chattune.data.templates.kto_documents: example i is pair i's prompt with its chosen reply
    (desirable) or its rejected one (undesirable); its mismatched sequence is the same prompt with the same side of
    pair i + 1. Each sequence tokenized alone, only its last reply trained."""
    tokenizer = demo_tokenizer()
    markers = probe_template(tokenizer)
    pairs = demo_pairs()[:NUM_EXAMPLES]
    documents = []
    for i, pair in enumerate(pairs):
        side = "chosen" if desirable(i) else "rejected"
        partner = pairs[(i + 1) % len(pairs)]
        ids, labels, lengths = [], [], []
        for messages in (pair["prompt"] + pair[side], pair["prompt"] + partner[side]):
            tokenized = tokenize_conversation(tokenizer, messages, markers, last_turn_only=True)
            ids += tokenized.input_ids
            labels += shifted_labels(tokenized.input_ids, tokenized.assistant_mask)
            lengths.append(len(tokenized.input_ids))
        documents.append(
            Document(i, ids, labels, segments=tuple(lengths), doc_values={"desirable": float(desirable(i))})
        )
    return documents


def hand_losses(policy, reference, documents, groups: list[list[int]]) -> tuple[torch.Tensor, dict]:
    """The mean KTO loss over `documents` with z the mean mismatched log-ratio of each group (one group: the step's),
    clamped at 0 and detached; and the metrics."""
    with torch.no_grad():
        ref = sequence_logps(reference, documents)
    pol = sequence_logps(policy, documents)
    losses, z_of = [], {}
    for group in groups:
        z = torch.stack([pol[i][1].detach() - ref[i][1] for i in group]).mean().clamp(min=0)
        z_of.update(dict.fromkeys(group, z))
    rewards = []
    for i, doc in enumerate(documents):
        r = pol[i][0] - ref[i][0]
        if kto_label(doc):
            losses.append(WEIGHTS.desirable * (1 - torch.sigmoid(WEIGHTS.beta * (r - z_of[i]))))
        else:
            losses.append(WEIGHTS.undesirable * (1 - torch.sigmoid(WEIGHTS.beta * (z_of[i] - r))))
        rewards.append(WEIGHTS.beta * float(r.detach()))
    loss = torch.stack(losses).mean()
    good = [i for i, d in enumerate(documents) if kto_label(d)]
    bad = [i for i, d in enumerate(documents) if not kto_label(d)]
    chosen = sum(rewards[i] for i in good) / max(len(good), 1)
    rejected = sum(rewards[i] for i in bad) / max(len(bad), 1)
    metrics = {
        "loss": float(loss.detach()),
        "kl": float(z_of[0]),
        "rewards/chosen": chosen,
        "rewards/rejected": rejected,
        "rewards/margins": chosen - rejected,
        "logps/chosen": sum(float(pol[i][0]) for i in good) / max(len(good), 1),
        "logps/rejected": sum(float(pol[i][0]) for i in bad) / max(len(bad), 1),
        "num_examples": len(documents),
        "num_desirable": len(good),
        "num_tokens": sum(p[2] for p in pol),
    }
    return loss, metrics


def models():
    policy, reference = tiny_model(seed=POLICY_SEED), tiny_model(seed=REFERENCE_SEED)
    for model in (policy, reference):
        model.set_attn_implementation("sdpa")
    return policy, reference


def reference_step() -> dict:
    policy, reference = models()
    documents = kto_documents()
    loss, metrics = hand_losses(policy, reference, documents, [list(range(NUM_EXAMPLES))])
    loss.backward()
    with torch.no_grad():
        ref = sequence_logps(reference, documents)
    return {
        "grads": {name: p.grad for name, p in policy.named_parameters()},
        "metrics": metrics,
        "ref_table": torch.tensor([[float(a), float(b)] for a, b, _, _ in ref], dtype=torch.float64),
    }


def _worker(rank, world_size, port, splits, out_path, ref_table):
    init_worker_process_group(rank, world_size, port)
    documents = kto_documents()
    policy = PackedCausalLM(tiny_model(seed=POLICY_SEED), loss_chunk_size=16)
    placement = shard_model(policy, mesh_dims())
    policy.train()
    if ref_table is None:
        shard_model(reference_model := PackedCausalLM(tiny_model(seed=REFERENCE_SEED)), mesh_dims())
        reference = LiveReference(reference_model)
    else:
        reference = CachedReference(ref_table)
    objective = KTOObjective(WEIGHTS, reference)
    microbatches = [collate_packed([documents[i] for i in mb]) if mb else empty_batch(0) for mb in splits[rank]]
    result = accumulate_gradients(policy, objective, StepBatches(microbatches), placement)
    metrics = step_metrics(1, result, objective, grad_norm=0.0, lr=0.0, step_time_s=1.0, device=torch.device("cpu"))
    grads = {name.removeprefix("hf_model."): p.grad.full_tensor().clone() for name, p in policy.named_parameters()}
    # The weights did not move: the held-out figures of the same examples are the step's (z over the whole set).
    held_out = evaluate(policy, KTOObjective(WEIGHTS, reference), microbatches, placement.dims, pad_token_id=0)
    if rank == 0:
        torch.save({"grads": grads, "metrics": metrics, "eval": held_out}, out_path)
    shutdown_distributed()
    exit_process()


@pytest.mark.launch
def test_kto_gradients_and_metrics_are_invariant_and_match_a_hand_computation(tmp_path):
    want = reference_step()
    assert want["metrics"]["kl"] > 0.05  # the reference point is in play (not clamped to 0)
    everything = list(range(NUM_EXAMPLES))
    splits = {
        "1rank_1mb": [[everything]],
        "1rank_3mb": [[[0, 1, 2], [3, 4], [5, 6, 7]]],
        "2rank_2mb_uneven": [[[0, 1, 2, 3], [4]], [[5, 6], [7]]],
        "2rank_2mb_one_empty": [[[0, 1, 2, 3, 4], [5, 6, 7]], [[], []]],
    }
    cases = [("live", name) for name in splits] + [("cached", "1rank_3mb"), ("cached", "2rank_2mb_uneven")]
    for reference, name in cases:
        split = splits[name]
        out_path = str(tmp_path / f"{reference}_{name}.pt")
        table = want["ref_table"] if reference == "cached" else None
        spawn(_worker, args=(len(split), free_port(), split, out_path, table), nprocs=len(split))
        got = torch.load(out_path)
        error = relative_error(got["grads"], want["grads"])
        assert error <= 1e-5, f"{reference} {name}: relative gradient error {error:.3g}"
        # abs 5e-6: the rewards are beta x differences of fp32 log-prob sums of ~70 nats (each ~1e-5 off), and
        # their margin is a difference of two such means.
        for key, value in want["metrics"].items():
            assert math.isclose(got["metrics"][key], value, rel_tol=1e-5, abs_tol=5e-6), (reference, name, key)
            assert math.isclose(got["eval"][f"eval_{key}"], value, rel_tol=1e-5, abs_tol=5e-6), (name, "eval", key)


def test_a_per_microbatch_reference_point_would_be_caught():
    """The comparison can fail: z estimated per microbatch (as TRL does per device batch) changes the gradient."""
    want = reference_step()["grads"]
    policy, reference = models()
    loss, _ = hand_losses(policy, reference, kto_documents(), [[0, 1, 2], [3, 4], [5, 6, 7]])
    loss.backward()
    wrong = {name: p.grad for name, p in policy.named_parameters()}
    assert relative_error(wrong, want) > 1e-3


def test_swapped_labels_would_be_caught():
    """The comparison can fail: the labels reach the loss (every example taken as desirable changes it)."""
    want = reference_step()["grads"]
    policy, reference = models()
    documents = [with_values(d, desirable=True) for d in kto_documents()]
    loss, _ = hand_losses(policy, reference, documents, [list(range(NUM_EXAMPLES))])
    loss.backward()
    wrong = {name: p.grad for name, p in policy.named_parameters()}
    assert relative_error(wrong, want) > 1e-3


def test_each_pass_runs_one_segment_of_each_example_padded_as_the_stream_pads():
    """segment_batch: the examples (0) or their mismatched sequences (1) alone, in order, with their records, sources
    and labels, each its own segment, the row padded to the stream's multiple with a padding segment of its own."""
    from chattune.objectives.kto import segment_batch

    documents = [replace(d, source=d.doc_id % 2) for d in kto_documents()[:3]]
    batch = collate_packed(documents, pad_to_multiple_of=64)
    for segment in (0, 1):
        part = segment_batch(batch, segment, 64, pad_token_id=0)
        want = [d.segments[0] if segment == 0 else d.segments[1] for d in documents]
        pieces = [(d.input_ids[: d.segments[0]], d.labels[: d.segments[0]]) for d in documents]
        if segment == 1:
            pieces = [(d.input_ids[d.segments[0] :], d.labels[d.segments[0] :]) for d in documents]
        assert part.cu_seqlens.diff().tolist()[:3] == want and part.num_tokens % 64 == 0 and part.padding > 0
        assert part.input_ids[0, : sum(want)].tolist() == [t for ids, _ in pieces for t in ids.tolist()]
        assert part.labels[0, : sum(want)].tolist() == [t for _, labels in pieces for t in labels.tolist()]
        assert (part.doc_ids, part.doc_sources, part.doc_values) == (
            [0, 1, 2],
            [0, 1, 0],
            {"desirable": [1.0, 1.0, 0.0]},
        )
    empty = empty_batch(0)
    assert segment_batch(empty, 1, 64) is empty
