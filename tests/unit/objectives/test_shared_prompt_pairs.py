"""Shared prompts through the pair objectives: every preference `loss.type` (the DPO family, SimPO, ORPO) with a live
and with a cached reference, and the reward model, give with `data.share_prompts=true` the loss, every gradient and
every metric of the unshared run (1e-6, fp32), on the demo pairs as chattune's data layer makes them, in microbatches
that mix pairs and split them differently. The unshared numbers are themselves held to plain HF forwards in
tests/distributed/test_dpo_step.py and test_reward_step.py."""

from __future__ import annotations

import math

import torch
from test_reward_step import tiny_reward_model

from chattune.config.losses import PREFERENCE_LOSSES, needs_reference
from chattune.config.paths import DEMO_ASSETS
from chattune.data.feed import StepBatches
from chattune.data.ingest.formats import SourceSpec
from chattune.data.ingest.records import RecordSource
from chattune.data.packing import collate_packed
from chattune.data.templates.pair_documents import PairDocuments, RewardPairDocuments
from chattune.distributed import ParallelDims
from chattune.model.causal_lm import PackedCausalLM
from chattune.model.sequence_score import PackedSequenceScorer
from chattune.objectives.dpo import CachedReference, LiveReference, PreferenceObjective
from chattune.objectives.pair_losses import PreferenceLoss
from chattune.objectives.reference_cache import compute_reference_table
from chattune.objectives.reward import RewardObjective
from chattune.parallel.fsdp import shard_model
from chattune.train.metrics import step_metrics
from chattune.train.step import accumulate_gradients
from conftest import demo_tokenizer, mesh_dims, relative_error, tiny_model

PAIRS = 6
MICROBATCHES = [[0, 1, 2], [3], [4, 5]]


def pair_documents(kind: type, share_prompts: bool) -> list:
    spec = SourceSpec(str(DEMO_ASSETS / "preference_train.jsonl"), format="preference")
    made = kind(RecordSource([spec]), demo_tokenizer(), 4096, share_prompts=share_prompts).get_many(range(PAIRS))
    assert all(bool(d.shared_prefix) == share_prompts for d in made)
    return made


def batches(kind: type, share_prompts: bool) -> list:
    documents = pair_documents(kind, share_prompts)
    return [collate_packed([documents[i] for i in split]) for split in MICROBATCHES]


def step(model, objective, microbatches) -> dict:
    placement = shard_model(model, mesh_dims())
    model.train()
    result = accumulate_gradients(model, objective, StepBatches(microbatches), placement)
    metrics = step_metrics(1, result, objective, grad_norm=0.0, lr=0.0, step_time_s=1.0, device=torch.device("cpu"))
    grads = {name: p.grad.full_tensor().clone() for name, p in model.named_parameters() if p.grad is not None}
    return {"metrics": metrics, "grads": grads}


# fp32 rounding: a row of other length rounds each token's log-prob differently (matmul blocking), and a pair's
# log-probs (about -70 here) reach the gradient through beta-scaled differences. The unshared step split into other
# microbatches differs from itself by 0.6e-6 to 1.3e-6 (measured over sigmoid, hinge and ipo); a reply that misses
# its prompt, or sees its sibling, is off by more than 1e-2.
GRADIENT_TOLERANCE = 3e-6


def assert_same_step(got: dict, want: dict, label: str) -> None:
    error = relative_error(got["grads"], want["grads"])
    assert error <= GRADIENT_TOLERANCE, f"{label}: relative gradient error {error:.2e}"
    for name, value in want["metrics"].items():
        if name in ("step_time_s", "tokens_per_sec", "all_tokens_per_sec", "all_tokens_per_sec_per_device"):
            continue  # (the shared row holds fewer tokens: its throughput differs by design)
        if name == "all_tokens":
            continue
        assert math.isclose(got["metrics"][name], value, rel_tol=1e-6, abs_tol=1e-6), (label, name)


def preference_step(loss: PreferenceLoss, microbatches: list, cached: bool = False) -> dict:
    """One step of a fresh policy on `microbatches`, against a live reference (or its table, as the recipe builds it
    from the same batches, with `cached`)."""
    reference = None
    if needs_reference(loss.loss_type):
        reference_model = PackedCausalLM(tiny_model(seed=1), loss_chunk_size=16)
        shard_model(reference_model, mesh_dims())
        reference = LiveReference(reference_model)
        if cached:
            dims = ParallelDims.build(torch.device("cpu"))
            reference = CachedReference(compute_reference_table(reference_model, microbatches, PAIRS, dims, 0))
    policy = PackedCausalLM(tiny_model(seed=0), loss_chunk_size=16)
    return step(policy, PreferenceObjective(loss, reference), microbatches)


def test_every_preference_loss_with_shared_prompts_equals_the_unshared_step(one_rank_group):
    unshared, shared = batches(PairDocuments, False), batches(PairDocuments, True)
    assert sum(b.shared_prompt_tokens for b in shared) > 0
    for loss_type in PREFERENCE_LOSSES:
        loss = PreferenceLoss(loss_type=loss_type, beta=0.1, sft_weight=0.3 if loss_type != "orpo" else 0.0)
        assert_same_step(preference_step(loss, shared), preference_step(loss, unshared), loss_type)


def test_a_reference_table_built_from_shared_rows_gives_the_unshared_step(one_rank_group):
    loss = PreferenceLoss(loss_type="sigmoid", beta=0.1)
    shared = preference_step(loss, batches(PairDocuments, True), cached=True)
    assert_same_step(shared, preference_step(loss, batches(PairDocuments, False), cached=True), "cached reference")


def test_the_reward_model_with_shared_prompts_equals_the_unshared_step(one_rank_group):
    steps = {
        share_prompts: step(
            PackedSequenceScorer(tiny_reward_model()),
            RewardObjective(center_rewards_coefficient=0.01),
            batches(RewardPairDocuments, share_prompts),
        )
        for share_prompts in (False, True)
    }
    assert_same_step(steps[True], steps[False], "reward")
