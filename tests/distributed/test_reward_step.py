"""The reward model through the shared update step: its packed loss, gradients and metrics equal a hand computation
from plain unpacked Hugging Face sequence-classification forwards (each reply alone, read by transformers at its
last token), however the pairs are split into microbatches and ranks (1 and 2 gloo ranks)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from test_dpo_step import NUM_PAIRS, pair_documents

from chattune.data.feed import StepBatches
from chattune.data.packing import collate_packed, empty_batch
from chattune.distributed import exit_process, shutdown_distributed
from chattune.model.causal_lm import build_hf_model
from chattune.model.head.kinds import SCORE_HEAD
from chattune.model.sequence_score import PackedSequenceScorer
from chattune.objectives.reward import RewardObjective
from chattune.parallel.fsdp import shard_model
from chattune.train.evaluation import evaluate
from chattune.train.metrics import step_metrics
from chattune.train.step import accumulate_gradients
from conftest import demo_tokenizer, free_port, init_worker_process_group, mesh_dims, relative_error, spawn, tiny_config

CENTER = 0.05  # loss.center_rewards_coefficient: its term in the loss and the gradient is checked too
HEAD_SCALE = 50.0  # random-init scores are ~1e-2: scaled, the rewards differ enough for the accuracy to say something


def tiny_reward_model(seed: int = 0):
    """The tiny Llama as transformers' sequence classification with one label (chattune's packed attention)."""
    torch.manual_seed(seed)
    model = build_hf_model(demo_tokenizer(), config=tiny_config(), head=SCORE_HEAD)
    with torch.no_grad():
        model.score.weight.mul_(HEAD_SCALE)
    return model


def plain_rewards(model, documents) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Plain HF: every side alone (the conversation as `apply_chat_template` renders it, ChatML's newline after the
    last `<|im_end|>` included), stock SDPA, the model's own forward (its score read at the last token)."""
    out = []
    for doc in documents:
        n_chosen = doc.segments[0]
        sides = (doc.input_ids[:n_chosen].tolist(), doc.input_ids[n_chosen:].tolist())
        rewards = [model(input_ids=torch.tensor([ids])).logits[0, 0] for ids in sides]
        out.append((rewards[0], rewards[1]))
    return out


def reference_step() -> dict:
    """The gradient of the mean per-pair loss, and every metric, by hand."""
    model = tiny_reward_model()
    model.set_attn_implementation("sdpa")
    documents = pair_documents()
    rewards = plain_rewards(model, documents)
    losses = [-F.logsigmoid(c - r) + CENTER * (c + r) ** 2 for c, r in rewards]
    mean = torch.stack(losses).mean()
    mean.backward()
    n = len(documents)
    values = [(float(c.detach()), float(r.detach())) for c, r in rewards]
    return {
        "grads": {name: p.grad for name, p in model.named_parameters()},
        "metrics": {
            "loss": float(mean),
            "rewards/chosen": sum(c for c, _ in values) / n,
            "rewards/rejected": sum(r for _, r in values) / n,
            "rewards/margins": sum(c - r for c, r in values) / n,
            "rewards/accuracies": sum(c > r for c, r in values) / n,
            "num_pairs": n,
            "num_tokens": sum(int((d.labels >= 0).sum()) for d in documents),
        },
    }


def _worker(rank, world_size, port, splits, out_path):
    init_worker_process_group(rank, world_size, port)
    documents = pair_documents()
    model = PackedSequenceScorer(tiny_reward_model())
    placement = shard_model(model, mesh_dims())
    model.train()
    objective = RewardObjective(CENTER)
    microbatches = [collate_packed([documents[i] for i in mb]) if mb else empty_batch(0) for mb in splits[rank]]
    result = accumulate_gradients(model, objective, StepBatches(microbatches), placement)
    metrics = step_metrics(1, result, objective, grad_norm=0.0, lr=0.0, step_time_s=1.0, device=torch.device("cpu"))
    grads = {name.removeprefix("hf_model."): p.grad.full_tensor().clone() for name, p in model.named_parameters()}
    held_out = evaluate(model, objective, microbatches, placement.dims, pad_token_id=0)
    if rank == 0:
        torch.save({"grads": grads, "metrics": metrics, "held_out": held_out}, out_path)
    shutdown_distributed()
    exit_process()


@pytest.mark.launch
def test_reward_loss_gradients_and_metrics_match_plain_sequence_classification_forwards(tmp_path):
    want = reference_step()
    assert 0 < want["metrics"]["rewards/accuracies"] < 1  # the accuracy is not trivially 0 or 1 here
    everything = list(range(NUM_PAIRS))
    splits = {
        "1rank_1mb": [[everything]],
        "1rank_2mb": [[[0, 1, 2], [3, 4, 5, 6, 7]]],
        "2rank_2mb_uneven": [[[0, 1, 2, 3], [4]], [[5, 6], [7]]],
        "2rank_2mb_one_empty": [[[0, 1, 2, 3, 4], [5, 6, 7]], [[], []]],
    }
    for name, split in splits.items():
        out_path = str(tmp_path / f"{name}.pt")
        spawn(_worker, args=(len(split), free_port(), split, out_path), nprocs=len(split))
        got = torch.load(out_path)
        error = relative_error(got["grads"], want["grads"])
        assert error <= 1e-5, f"{name}: relative gradient error {error:.3g}"
        # abs 5e-6: the rewards are ~2 (the head x50) in fp32, and the margin a difference of their two means.
        for key, value in want["metrics"].items():
            assert math.isclose(got["metrics"][key], value, rel_tol=1e-5, abs_tol=5e-6), (name, key)
            assert math.isclose(got["held_out"][f"eval_{key}"], value, rel_tol=1e-5, abs_tol=5e-6), (name, key)


def test_the_comparison_would_catch_a_reward_read_one_token_early():
    """The packed model's reward at each side's last token is transformers' score of the whole rendered side; read
    at the position before it (the reply's end-of-turn token, where ChatML writes a newline after it) it is not."""
    model = tiny_reward_model()
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    documents = pair_documents()[:3]
    with torch.no_grad():
        want = torch.stack([torch.stack(pair) for pair in plain_rewards(reference, documents)])
        scorer = PackedSequenceScorer(model)
        batch = collate_packed(documents)
        chosen, rejected, scores = RewardObjective().rewards(scorer, batch)
        got = torch.stack([chosen, rejected], dim=1)
        one_early = torch.stack([scores[_ends(batch, 0) - 1], scores[_ends(batch, 1) - 1]], dim=1)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(one_early, want, rtol=1e-2, atol=1e-3)


def _ends(batch, side: int) -> torch.Tensor:
    from chattune.objectives.reward import side_end_positions

    return side_end_positions(batch)[side]


def test_a_per_microbatch_mean_would_be_caught():
    """The comparison can fail: averaging per microbatch (not per global pair) changes the gradient."""
    want = reference_step()["grads"]
    model = tiny_reward_model()
    model.set_attn_implementation("sdpa")
    rewards = plain_rewards(model, pair_documents())
    losses = [-F.logsigmoid(c - r) + CENTER * (c + r) ** 2 for c, r in rewards]
    (torch.stack(losses[:5]).mean() + torch.stack(losses[5:]).mean()).div(2).backward()
    wrong = {name: p.grad for name, p in model.named_parameters()}
    assert relative_error(wrong, want) > 1e-3
