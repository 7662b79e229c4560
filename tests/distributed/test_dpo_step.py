"""DPO through the shared update step: gradients invariant to how pairs are split into microbatches and
ranks, equal to a plain per-pair computation (unpacked HF forwards, full logits), and metrics equal to
the same per-pair values averaged by hand; live and cached reference alike."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from chattune.config.paths import DEMO_ASSETS
from chattune.data.documents import IGNORE_INDEX, Document, shifted_labels
from chattune.data.feed import StepBatches
from chattune.data.packing import collate_packed, empty_batch
from chattune.data.templates.chat_template import probe_template, tokenize_conversation
from chattune.distributed import exit_process, shutdown_distributed
from chattune.model.causal_lm import PackedCausalLM
from chattune.objectives.dpo import CachedReference, LiveReference, PreferenceObjective, is_initial_policy
from chattune.objectives.pair_losses import PreferenceLoss
from chattune.parallel.fsdp import shard_model
from chattune.train.evaluation import evaluate
from chattune.train.metrics import step_metrics
from chattune.train.step import accumulate_gradients
from conftest import demo_tokenizer, free_port, init_worker_process_group, mesh_dims, relative_error, spawn, tiny_model

NUM_PAIRS = 8
# beta 0.1 (the usual DPO value): the loss depends on differences of sequence log-probs (~-70 here), so fp32
# rounding in them reaches the gradient multiplied by beta; at beta 0.5 the same fp32 agreement is ~4e-6.
LOSS = PreferenceLoss(loss_type="sigmoid", beta=0.1, label_smoothing=0.1, sft_weight=0.3)


def sides(pair: dict) -> list[list[dict]]:
    return [pair["prompt"] + pair["chosen"], pair["prompt"] + pair["rejected"]]


def demo_pairs() -> list[dict]:
    lines = (DEMO_ASSETS / "preference_train.jsonl").read_text().splitlines()[:NUM_PAIRS]
    return [json.loads(line) for line in lines]


def pair_documents() -> list[Document]:
    """Built here, independently of chattune.data.templates.pair_documents: each side tokenized alone, only its last reply trained."""
    tokenizer = demo_tokenizer()
    markers = probe_template(tokenizer)
    documents = []
    for i, pair in enumerate(demo_pairs()):
        ids, labels, lengths = [], [], []
        for messages in sides(pair):
            tokenized = tokenize_conversation(tokenizer, messages, markers, last_turn_only=True)
            ids += tokenized.input_ids
            labels += shifted_labels(tokenized.input_ids, tokenized.assistant_mask)
            lengths.append(len(tokenized.input_ids))
        documents.append(Document(i, ids, labels, segments=tuple(lengths)))
    return documents


def sequence_logps(model, documents) -> list[tuple[torch.Tensor, torch.Tensor, int, int]]:
    """Plain HF: every side run alone with stock SDPA and full logits; (chosen, rejected, tokens, tokens)."""
    out = []
    for doc in documents:
        n_chosen = doc.segments[0]
        per_side = []
        for ids, labels in (
            (doc.input_ids[:n_chosen].tolist(), doc.labels[:n_chosen].tolist()),
            (doc.input_ids[n_chosen:].tolist(), doc.labels[n_chosen:].tolist()),
        ):
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
            target = torch.tensor(labels)
            per_side.append(
                (
                    -F.cross_entropy(logits, target, ignore_index=IGNORE_INDEX, reduction="sum"),
                    int((target != IGNORE_INDEX).sum()),
                )
            )
        out.append((per_side[0][0], per_side[1][0], per_side[0][1], per_side[1][1]))
    return out


def reference_step() -> dict:
    """The gradient of the mean per-pair loss, and every metric, by hand."""
    policy, reference = tiny_model(seed=0), tiny_model(seed=1)
    for model in (policy, reference):
        model.set_attn_implementation("sdpa")
    documents = pair_documents()
    with torch.no_grad():
        ref = sequence_logps(reference, documents)
    pol = sequence_logps(policy, documents)
    losses, rewards = [], []
    for (pc, pr, nc, nr), (rc, rr, _, _) in zip(pol, ref):
        chosen_reward, rejected_reward = LOSS.beta * (pc - rc), LOSS.beta * (pr - rr)
        d = chosen_reward - rejected_reward
        eps = LOSS.label_smoothing
        loss = -(1 - eps) * F.logsigmoid(d) - eps * F.logsigmoid(-d) + LOSS.sft_weight * (-pc / nc)
        losses.append(loss)
        rewards.append((float(chosen_reward.detach()), float(rejected_reward.detach())))
    mean = torch.stack(losses).mean()
    mean.backward()
    n = len(documents)
    return {
        "grads": {name: p.grad for name, p in policy.named_parameters()},
        "ref_table": torch.tensor([[float(rc), float(rr)] for rc, rr, _, _ in ref], dtype=torch.float64),
        "metrics": {
            "loss": float(mean),
            "rewards/chosen": sum(c for c, _ in rewards) / n,
            "rewards/rejected": sum(r for _, r in rewards) / n,
            "rewards/margins": sum(c - r for c, r in rewards) / n,
            "rewards/accuracies": sum(c > r for c, r in rewards) / n,
            "logps/chosen": sum(float(p[0]) for p in pol) / n,
            "logps/rejected": sum(float(p[1]) for p in pol) / n,
            "num_pairs": n,
            "num_tokens": sum(p[2] + p[3] for p in pol),
        },
    }


def _worker(rank, world_size, port, splits, out_path, ref_table):
    init_worker_process_group(rank, world_size, port)
    documents = pair_documents()
    policy = PackedCausalLM(tiny_model(seed=0), loss_chunk_size=16)
    placement = shard_model(policy, mesh_dims())
    policy.train()
    if ref_table is None:
        shard_model(reference_model := PackedCausalLM(tiny_model(seed=1)), mesh_dims())
        reference = LiveReference(reference_model)
    else:
        reference = CachedReference(ref_table)
    objective = PreferenceObjective(LOSS, reference)
    microbatches = [collate_packed([documents[i] for i in mb]) if mb else empty_batch(0) for mb in splits[rank]]
    result = accumulate_gradients(policy, objective, StepBatches(microbatches), placement)
    metrics = step_metrics(1, result, objective, grad_norm=0.0, lr=0.0, step_time_s=1.0, device=torch.device("cpu"))
    grads = {name.removeprefix("hf_model."): p.grad.full_tensor().clone() for name, p in policy.named_parameters()}
    if rank == 0:
        torch.save({"grads": grads, "metrics": metrics}, out_path)
    shutdown_distributed()
    exit_process()


@pytest.mark.launch
def test_dpo_gradients_and_metrics_are_invariant_and_match_a_per_pair_computation(tmp_path):
    want = reference_step()
    everything = list(range(NUM_PAIRS))
    splits = {
        "1rank_1mb": [[everything]],
        "1rank_3mb": [[[0, 1, 2], [3, 4], [5, 6, 7]]],
        "2rank_2mb_uneven": [[[0, 1, 2, 3], [4]], [[5, 6], [7]]],
        "2rank_2mb_one_empty": [[[0, 1, 2, 3, 4], [5, 6, 7]], [[], []]],
    }
    for reference in ("live", "cached"):
        for name, split in splits.items():
            out_path = str(tmp_path / f"{reference}_{name}.pt")
            table = want["ref_table"] if reference == "cached" else None
            spawn(_worker, args=(len(split), free_port(), split, out_path, table), nprocs=len(split))
            got = torch.load(out_path)
            error = relative_error(got["grads"], want["grads"])
            assert error <= 1e-6, f"{reference} {name}: relative gradient error {error:.3g}"
            for key, value in want["metrics"].items():
                assert math.isclose(got["metrics"][key], value, rel_tol=1e-5, abs_tol=1e-6), (reference, name, key)


def test_a_per_microbatch_mean_would_be_caught():
    """The comparison can fail: averaging per microbatch (not per global pair) changes the gradient."""
    want = reference_step()["grads"]
    policy, reference = tiny_model(seed=0), tiny_model(seed=1)
    documents = pair_documents()
    with torch.no_grad():
        ref = sequence_logps(reference, documents)
    pol = sequence_logps(policy, documents)
    losses = [
        LOSS(
            *[torch.stack([x]) for x in (p[0], p[1], r[0], r[1])],
            torch.tensor([float(p[2])]),
            torch.tensor([float(p[3])]),
        )[0][0]
        for p, r in zip(pol, ref)
    ]
    (torch.stack(losses[:5]).mean() + torch.stack(losses[5:]).mean()).div(2).backward()
    wrong = {name: p.grad for name, p in policy.named_parameters()}
    assert relative_error(wrong, want) > 1e-3


def test_dpo_metrics_before_the_first_step_are_known_where_the_reference_is_the_initial_policy(one_rank_group):
    """Known without a forward (every reward 0, the loss at margin 0, pairs and tokens counted, log-probs from a
    cached table) and equal to what a real evaluation computes, for every loss type whose value is known."""
    cpu = torch.device("cpu")
    documents = pair_documents()
    batches = [collate_packed(documents[:5]), collate_packed(documents[5:])]
    policy = PackedCausalLM(tiny_model(seed=0), loss_chunk_size=16)
    placement = shard_model(policy, mesh_dims())
    shard_model(initial := PackedCausalLM(tiny_model(seed=0)), mesh_dims())
    live = LiveReference(initial)  # the initial policy, again
    table = torch.full((NUM_PAIRS, 2), float("nan"), dtype=torch.float64)
    for batch in batches:  # the reference cache's table, as reference_cache computes it: the live reference's values
        chosen, rejected = live(batch)
        table[batch.doc_ids] = torch.stack([chosen, rejected], dim=1).double()
    losses = [
        PreferenceLoss(loss_type="sigmoid", beta=0.1, label_smoothing=0.1),
        PreferenceLoss(loss_type="robust", beta=0.2, label_smoothing=0.2),
        PreferenceLoss(loss_type="hinge", beta=0.5),
        PreferenceLoss(loss_type="ipo", beta=0.3),
        PreferenceLoss(loss_type="sigmoid_norm", beta=0.1),
    ]
    for loss in losses:
        for reference in (live, CachedReference(table)):
            objective = PreferenceObjective(loss, reference, reference_is_start=True)
            known = objective.known_start_metrics(batches, cpu)
            real = evaluate(policy, objective, batches, placement.dims, pad_token_id=0)
            assert {f"eval_{name}" for name in known} == set(real) - (
                set() if reference is not live else {"eval_logps/chosen", "eval_logps/rejected"}
            )
            for name, value in known.items():
                assert math.isclose(real[f"eval_{name}"], value, rel_tol=1e-6, abs_tol=1e-6), (loss, name)
            assert real["eval_rewards/margins"] == 0.0  # the comparison is of a real evaluation with exact zeros
    assert math.isclose(PreferenceLoss(loss_type="sigmoid").loss_without_preference(), math.log(2))
    assert math.isclose(PreferenceLoss(loss_type="ipo", beta=0.25).loss_without_preference(), 4.0)
    # Not known in advance: a reference-free loss, an SFT term (the chosen reply's NLL), another reference.
    assert (
        PreferenceObjective(PreferenceLoss(loss_type="simpo"), None, reference_is_start=True).known_start_metrics(
            batches, cpu
        )
        is None
    )
    assert (
        PreferenceObjective(LOSS, live, reference_is_start=True).known_start_metrics(batches, cpu) is None
    )  # sft_weight
    assert PreferenceObjective(PreferenceLoss(loss_type="sigmoid"), live).known_start_metrics(batches, cpu) is None


def test_which_reference_is_the_initial_policy(tmp_path):
    (tmp_path / "model").mkdir()
    assert is_initial_policy(None, None) and is_initial_policy(None, "hf:org/name")
    assert is_initial_policy(str(tmp_path / "model"), str(tmp_path / "." / "model"))
    assert not is_initial_policy(str(tmp_path / "other"), str(tmp_path / "model"))
    assert not is_initial_policy(str(tmp_path / "model"), None)  # a directory against a model built from config
    assert is_initial_policy("hf:org/name", "hf:org/name") and not is_initial_policy("hf:org/name", "hf:org/other")
    # QLoRA: the policy's base in 4 bits; a reference.path is read whole, so it is not the policy (its own base,
    # adapters off, with no reference.path, is)
    assert not is_initial_policy(str(tmp_path / "model"), str(tmp_path / "model"), quantized_base=True)
    assert is_initial_policy(None, str(tmp_path / "model"), quantized_base=True)
