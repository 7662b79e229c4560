"""The policy-gradient losses (on-policy distillation's included; gkd's teacher a second random model) through the
shared update step on a real (tiny) model: each loss type's gradients and loss over a step of completions equal its
paper's formula (tests/unit/objectives/test_policy_gradient.py's) applied to the log-probs (gkd: the distributions) of
a plain unpacked Hugging Face forward of each completion at the sampling temperature, however the completions are
split into microbatches and ranks (1 rank, 4 microbatches, 2 ranks unevenly, one rank empty), and however a group's
completions are laid out (data.share_prompts: replies continuing one copy of their prompt, beside plain documents)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_policy_gradient import MAX_NEW_TOKENS, SETTINGS, objective_for, paper_loss

from chattune.config.paths import DEMO_ASSETS
from chattune.config.policy_losses import POLICY_LOSSES
from chattune.data.documents import IGNORE_INDEX, Document
from chattune.data.feed import StepBatches
from chattune.data.packing import collate_packed, empty_batch
from chattune.distributed import exit_process, reduce_sums, shutdown_distributed
from chattune.model.causal_lm import PackedCausalLM
from chattune.model.packed.attention import ATTENTION_NAME
from chattune.objectives.policy_gradient import (
    ADVANTAGE,
    BEHAVIOUR_LOGP,
    OLD_LOGP,
    RATIO_MAX,
    RATIO_MIN_NEGATED,
    REF_LOGP,
    TEACHER_LOGP,
    PolicyGradientObjective,
    PolicyLoss,
)
from chattune.parallel.fsdp import shard_model
from chattune.rl.completion_documents import group_documents
from chattune.rl.sampling import Sampled
from chattune.train.step import accumulate_gradients
from conftest import demo_tokenizer, free_port, init_worker_process_group, mesh_dims, relative_error, spawn, tiny_model

TEMPERATURE = 0.7
POLICY_SEED = 0
COUNT = 8
SETTING = SETTINGS[1]  # old log-probs given (the clip in play), a KL penalty, truncated importance sampling
TEACHER_SEED, JSD_BETA = 1, 0.3  # gkd: another random model as the teacher


def hf_policy():
    model = tiny_model(seed=POLICY_SEED)
    model.set_attn_implementation("sdpa")
    return model


def completion_logps(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The log-probs of `tokens` after `prompt` at the temperature: a plain forward of the completion alone."""
    ids = torch.tensor([prompt + tokens])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / TEMPERATURE
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def items() -> list[dict]:
    """`COUNT` completions of the demo's first prompts (2 groups of 4): random tokens (a loss does not ask how they
    were drawn), and the old policy's, the sampler's and the reference's log-probs as perturbations of the policy's."""
    tokenizer = demo_tokenizer()
    lines = (DEMO_ASSETS / "sort_prompts.jsonl").read_text().splitlines()
    rng = np.random.default_rng(0)
    model, made = hf_policy(), []
    for d in range(COUNT):
        messages = json.loads(lines[d // 4])["messages"]
        prompt = list(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        )
        tokens = rng.integers(10, len(tokenizer), size=int(rng.integers(2, MAX_NEW_TOKENS))).tolist()
        with torch.no_grad():
            logp = completion_logps(model, prompt, tokens).numpy()
        made.append(
            {
                "prompt": prompt,
                "tokens": np.array(tokens),
                "old": logp + rng.normal(0, 0.2, len(tokens)),
                "behaviour": logp + rng.normal(0, 0.3, len(tokens)),
                "ref": logp + rng.normal(0, 0.4, len(tokens)),
                "teacher": logp + rng.normal(0, 0.5, len(tokens)),
                "advantage": float(rng.normal()),
            }
        )
    return made


# the values a completion declares on its trained tokens, and where an item holds them
VALUES = (
    (ADVANTAGE, "advantage"),
    (OLD_LOGP, "old"),
    (BEHAVIOUR_LOGP, "behaviour"),
    (REF_LOGP, "ref"),
    (TEACHER_LOGP, "teacher"),
)


def documents(made: list[dict]) -> list[Document]:
    docs = []
    for d, item in enumerate(made):
        prompt, tokens = item["prompt"], item["tokens"].tolist()
        ids = np.array(prompt + tokens)
        start = len(prompt) - 1
        labels = np.full(len(ids), IGNORE_INDEX)
        labels[start : start + len(tokens)] = tokens
        values = {}
        for name, key in VALUES:
            column = np.zeros(len(ids), dtype=np.float32)
            column[start : start + len(tokens)] = item[key]
            values[name] = column
        docs.append(Document(d, ids, labels, token_values=values))
    return docs


def shared_documents(made: list[dict]) -> list[Document]:
    """The same completions with each group's replies sharing one copy of its prompt (data.share_prompts): the first
    group's four in one document, the second's first three in one and its last alone (a plain document), each
    completion's declared values at its trained positions as `documents` declares them."""
    groups = [made[:4], made[4:7], made[7:]]
    docs = []
    for number, group in enumerate(groups):
        samples = [
            (number, Sampled(item["tokens"].tolist(), item["behaviour"], [0.0] * len(item["tokens"]), True, ""), 0.0)
            for item in group
        ]
        (doc,) = group_documents(group[0]["prompt"], samples, budget=None)
        trained = np.flatnonzero(doc.labels != IGNORE_INDEX)
        for name, key in VALUES:
            column = np.zeros(len(doc), dtype=np.float32)
            column[trained] = np.concatenate([np.broadcast_to(item[key], len(item["tokens"])) for item in group])
            doc.token_values[name] = column
        docs.append(doc)
    assert [bool(doc.shared_prefix) for doc in docs] == [True, True, False]
    return docs


def completion_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The logits at the positions that predict `tokens` after `prompt`, at the temperature: a plain forward."""
    return model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float() / TEMPERATURE


def gkd_paper_loss(model, made: list[dict]) -> torch.Tensor:
    """GKD's generalised JSD (arXiv 2306.13649, eq. 1) at every completion token, over the whole vocabulary, from
    the two models' probabilities, averaged over the step's completion tokens."""
    teacher, terms = tiny_model(seed=TEACHER_SEED), []
    for item in made:
        prompt, tokens = item["prompt"], item["tokens"].tolist()
        s = torch.softmax(completion_logits(model, prompt, tokens), -1)
        with torch.no_grad():
            t = torch.softmax(completion_logits(teacher, prompt, tokens), -1)
        m = JSD_BETA * t + (1 - JSD_BETA) * s
        terms.append(JSD_BETA * (t * (t / m).log()).sum(-1) + (1 - JSD_BETA) * (s * (s / m).log()).sum(-1))
    return torch.cat(terms).mean()


def hand_step(kind: str, made: list[dict]) -> dict:
    model = hf_policy()
    if kind == "gkd":
        loss = gkd_paper_loss(model, made)
        loss.backward()
        return {"loss": float(loss.detach()), "grads": {name: p.grad.clone() for name, p in model.named_parameters()}}
    theta = [completion_logps(model, item["prompt"], item["tokens"].tolist()) for item in made]
    loss = paper_loss(kind, theta, made, {**SETTING, "cispo_max": 1.3})
    loss.backward()
    ratios = torch.cat([torch.exp(logp.detach() - torch.tensor(item["old"])) for logp, item in zip(theta, made)])
    return {
        "loss": float(loss),
        "grads": {name: p.grad.clone() for name, p in model.named_parameters()},
        "ratio_range": (float(ratios.min()), float(ratios.max())),
    }


def _worker(rank, world_size, port, splits, out_path, made, shared):
    init_worker_process_group(rank, world_size, port)
    docs = shared_documents(made) if shared else documents(made)
    model = hf_policy()
    model.set_attn_implementation(ATTENTION_NAME)  # (as the recipe builds it: the packed attention)
    policy = PackedCausalLM(model, loss_chunk_size=16)
    policy.logit_transform = policy.logit_transform.at_temperature(TEMPERATURE)
    placement = shard_model(policy, mesh_dims())
    policy.train()
    microbatches = [collate_packed([docs[i] for i in mb]) if mb else empty_batch(0) for mb in splits[rank]]
    teacher = PackedCausalLM(tiny_model(seed=TEACHER_SEED), loss_chunk_size=16)
    teacher.logit_transform = teacher.logit_transform.at_temperature(TEMPERATURE)
    shard_model(teacher, mesh_dims())
    teacher.eval().requires_grad_(False)
    out = {}
    for kind in POLICY_LOSSES:
        if kind == "gkd":  # the teacher run on each microbatch, an empty one too
            objective = PolicyGradientObjective(PolicyLoss("gkd", jsd_beta=JSD_BETA), teacher)
        else:
            objective = objective_for(kind, SETTING)
        result = accumulate_gradients(policy, objective, StepBatches(microbatches), placement)
        total = torch.tensor([result.loss_sum], dtype=torch.float64)
        torch.distributed.all_reduce(total)
        grads = {name.removeprefix("hf_model."): p.grad.full_tensor().clone() for name, p in policy.named_parameters()}
        out[kind] = {"loss": float(total) / result.global_units, "grads": grads}
        if kind == "dapo":  # the ratio's range as the metrics reduce it: the extremes over microbatches and ranks
            sums = reduce_sums(result.figures, torch.device("cpu"))
            out[kind]["ratio_range"] = (-sums[RATIO_MIN_NEGATED], sums[RATIO_MAX])
        policy.zero_grad(set_to_none=True)
    if rank == 0:
        torch.save(out, out_path)
    shutdown_distributed()
    exit_process()


SPLITS = {
    "1rank_1mb": [[list(range(COUNT))]],
    "1rank_4mb": [[[0, 1], [2, 3, 4], [5], [6, 7]]],
    "2rank_uneven": [[[0, 1, 2, 3, 4], [5]], [[6], [7]]],
    "2rank_one_empty": [[[0, 1, 2, 3], [4, 5, 6, 7]], [[], []]],
    # data.share_prompts: the documents of `shared_documents` (a group of 4, one of 3 beside a plain completion)
    "shared_1rank_2mb": [[[0, 2], [1]]],
    "shared_2rank": [[[1]], [[2, 0]]],
}


@pytest.mark.launch
def test_every_loss_equals_its_formula_on_plain_forwards_however_the_step_is_split(tmp_path):
    made = items()
    want = {kind: hand_step(kind, made) for kind in POLICY_LOSSES}
    runs = {}
    for name, split in SPLITS.items():
        out_path = str(tmp_path / f"{name}.pt")
        shared = name.startswith("shared")
        spawn(_worker, args=(len(split), free_port(), split, out_path, made, shared), nprocs=len(split))
        runs[name] = torch.load(out_path)
        for kind in POLICY_LOSSES:
            got = runs[name][kind]
            error = relative_error(got["grads"], want[kind]["grads"])
            assert error <= 1e-5, f"{name} {kind}: relative gradient error {error:.3g} against the formula"
            assert abs(got["loss"] - want[kind]["loss"]) <= 1e-5 * max(1.0, abs(want[kind]["loss"])), (name, kind)
        for got, want_ in zip(runs[name]["dapo"]["ratio_range"], want["dapo"]["ratio_range"]):
            assert abs(got - want_) <= 1e-5, (name, runs[name]["dapo"]["ratio_range"], want["dapo"]["ratio_range"])
    for name in SPLITS:  # the split alone: the same update to 1e-6
        for kind in POLICY_LOSSES:
            error = relative_error(runs[name][kind]["grads"], runs["1rank_1mb"][kind]["grads"])
            assert error <= 1e-6, f"{name} {kind}: {error:.3g} from one microbatch"
