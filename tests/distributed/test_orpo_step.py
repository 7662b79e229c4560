"""ORPO through the shared update step: the odds-ratio term per pair and the chosen replies' NLL per chosen token
of the whole step (Hong et al. 2024; TRL's ORPOTrainer), both normalised globally. Gradients and metrics equal a
hand computation from plain unpacked HF forwards, however the pairs are split into microbatches and ranks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_dpo_step import NUM_PAIRS, pair_documents, sequence_logps

from chattune.data.feed import StepBatches
from chattune.data.packing import collate_packed, empty_batch
from chattune.distributed import exit_process, shutdown_distributed
from chattune.model.causal_lm import PackedCausalLM
from chattune.objectives.dpo import PreferenceObjective
from chattune.objectives.pair_losses import PreferenceLoss
from chattune.parallel.fsdp import shard_model
from chattune.train.evaluation import evaluate
from chattune.train.metrics import step_metrics
from chattune.train.step import accumulate_gradients
from conftest import free_port, init_worker_process_group, mesh_dims, relative_error, spawn, tiny_model

LOSS = PreferenceLoss(loss_type="orpo", beta=0.1, orpo_lambda=0.5)


def log_odds(mean_logp: torch.Tensor) -> torch.Tensor:
    return mean_logp - torch.log(1 - torch.exp(mean_logp))  # log(P / (1 - P)), as the paper writes it


def reference_step() -> dict:
    """The ORPO loss of the 8 pairs by hand: lambda * mean over pairs of -log s(log-odds ratio), plus the NLL of
    every chosen token over all chosen tokens; its gradient and metrics."""
    policy = tiny_model(seed=0)
    policy.set_attn_implementation("sdpa")
    pol = sequence_logps(policy, pair_documents())
    odds_terms, rewards = [], []
    for pc, pr, nc, nr in pol:
        ratio = log_odds(pc / nc) - log_odds(pr / nr)
        odds_terms.append(-LOSS.orpo_lambda * F.logsigmoid(ratio))
        rewards.append((LOSS.beta * float(pc) / nc, LOSS.beta * float(pr) / nr))
    odds_ratio_loss = torch.stack(odds_terms).mean()
    nll_loss = -torch.stack([p[0] for p in pol]).sum() / sum(p[2] for p in pol)
    loss = odds_ratio_loss + nll_loss
    loss.backward()
    n = len(pol)
    return {
        "grads": {name: p.grad for name, p in policy.named_parameters()},
        "metrics": {
            "loss": float(loss),
            "nll_loss": float(nll_loss),
            "odds_ratio_loss": float(odds_ratio_loss),
            "rewards/chosen": sum(c for c, _ in rewards) / n,
            "rewards/rejected": sum(r for _, r in rewards) / n,
            "rewards/accuracies": sum(c > r for c, r in rewards) / n,
            "num_pairs": n,
        },
    }


def _worker(rank, world_size, port, splits, out_path):
    init_worker_process_group(rank, world_size, port)
    documents = pair_documents()
    policy = PackedCausalLM(tiny_model(seed=0), loss_chunk_size=16)
    placement = shard_model(policy, mesh_dims())
    policy.train()
    objective = PreferenceObjective(LOSS, None)
    microbatches = [collate_packed([documents[i] for i in mb]) if mb else empty_batch(0) for mb in splits[rank]]
    result = accumulate_gradients(policy, objective, StepBatches(microbatches), placement)
    metrics = step_metrics(1, result, objective, grad_norm=0.0, lr=0.0, step_time_s=1.0, device=torch.device("cpu"))
    grads = {name.removeprefix("hf_model."): p.grad.full_tensor().clone() for name, p in policy.named_parameters()}
    # Evaluation has no training step to weigh the NLL: its loss comes from the sums, with the same value.
    held_out = evaluate(policy, PreferenceObjective(LOSS, None), microbatches, placement.dims, pad_token_id=0)
    if rank == 0:
        torch.save({"grads": grads, "metrics": metrics, "eval": held_out}, out_path)
    shutdown_distributed()
    exit_process()


@pytest.mark.launch
def test_orpo_gradients_and_metrics_are_invariant_and_match_a_hand_computation(tmp_path):
    want = reference_step()
    everything = list(range(NUM_PAIRS))
    splits = {
        "1rank_1mb": [[everything]],
        "1rank_3mb": [[[0, 1, 2], [3, 4], [5, 6, 7]]],
        "2rank_2mb_uneven": [[[0, 1, 2, 3], [4]], [[5, 6], [7]]],
        "2rank_2mb_one_empty": [[[0, 1, 2, 3, 4], [5, 6, 7]], [[], []]],
    }
    for name, split in splits.items():
        out_path = str(tmp_path / f"{name}.pt")
        spawn(_worker, args=(len(split), free_port(), split, out_path), nprocs=len(split))
        got = torch.load(out_path)
        error = relative_error(got["grads"], want["grads"])
        assert error <= 1e-5, f"{name}: relative gradient error {error:.3g}"
        for key, value in want["metrics"].items():
            assert math.isclose(got["metrics"][key], value, rel_tol=1e-5, abs_tol=1e-6), (name, key)
            assert math.isclose(got["eval"][f"eval_{key}"], value, rel_tol=1e-5, abs_tol=1e-6), (name, "eval", key)


def test_a_per_pair_nll_would_be_caught():
    """The comparison can fail: the chosen NLL averaged per pair (each reply's mean, then the mean over pairs, as
    loss.sft_weight does) instead of over all chosen tokens changes the gradient."""
    want = reference_step()["grads"]
    policy = tiny_model(seed=0)
    policy.set_attn_implementation("sdpa")
    pol = sequence_logps(policy, pair_documents())
    terms = [
        -LOSS.orpo_lambda * F.logsigmoid(log_odds(pc / nc) - log_odds(pr / nr)) - pc / nc for pc, pr, nc, nr in pol
    ]
    torch.stack(terms).mean().backward()
    wrong = {name: p.grad for name, p in policy.named_parameters()}
    assert relative_error(wrong, want) > 1e-3
