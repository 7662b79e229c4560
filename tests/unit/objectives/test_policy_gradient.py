"""The policy-gradient losses (GRPO, DAPO, Dr. GRPO, GSPO, CISPO) against their papers' formulas written here, token
by token, from the log-probs alone (not from chattune's code); the same losses split into microbatches any way give
the same loss and gradients; a per-microbatch normaliser would be caught.

The policy is a stand-in whose per-token log-probs are its parameters (completion d's are `theta[d]`), so that the
gradient of each formula is exact and cheap; the losses on a real model, split over real ranks, are
tests/distributed/test_policy_gradient_step.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from chattune.config.policy_losses import POLICY_LOSSES, clip_range
from chattune.data.documents import IGNORE_INDEX, Document
from chattune.data.packing import collate_packed, empty_batch
from chattune.distributed import MAX_FIGURE
from chattune.objectives.policy_gradient import (
    ADVANTAGE,
    BEHAVIOUR_LOGP,
    FIGURES,
    OLD_LOGP,
    RATIO_MAX,
    RATIO_MIN_NEGATED,
    REF_LOGP,
    TEACHER_LOGP,
    PolicyGradientObjective,
    PolicyLoss,
)
from chattune.train.step import accumulate_figure

PROMPT = 3  # prompt tokens of every completion document
# The losses of sampled tokens' log-probs (gkd compares whole distributions: tests/unit/model/head/
# test_chunked_divergence.py, and on a real model tests/distributed/test_policy_gradient_step.py)
SAMPLED = [kind for kind, spec in POLICY_LOSSES.items() if not spec.vocabulary]
MAX_NEW_TOKENS = 9


def completions(seed: int = 0, count: int = 8) -> list[dict]:
    """`count` completions (two groups of 4) of 1 to 7 sampled tokens, each with the policy's log-probs (the
    parameters' starting values), the old policy's, the sampler's and the reference's (each a perturbation of the
    policy's, large enough that clipping and the caps engage) and an advantage."""
    rng = np.random.default_rng(seed)
    made = []
    for d in range(count):
        length = int(rng.integers(1, 8))
        logp = -rng.uniform(0.05, 3.0, size=length)
        made.append(
            {
                "logp": logp,
                "old": logp + rng.normal(0, 0.3, size=length),
                "behaviour": logp + rng.normal(0, 0.4, size=length),
                "ref": logp + rng.normal(0, 0.5, size=length),
                "teacher": logp + rng.normal(0, 0.6, size=length),
                "advantage": float(rng.normal()),
                "tokens": rng.integers(5, 50, size=length),
            }
        )
    return made


def document(d: int, item: dict, declare: tuple[str, ...]) -> Document:
    """Completion `d` as a packed document: 3 prompt tokens, then its tokens, trained at the positions before them,
    with its declared values there."""
    length = len(item["tokens"])
    ids = np.concatenate([[1, 2, 3], item["tokens"]])
    labels = np.full(len(ids), IGNORE_INDEX)
    labels[PROMPT - 1 : PROMPT - 1 + length] = item["tokens"]
    values = {}
    for name, key in ((OLD_LOGP, "old"), (BEHAVIOUR_LOGP, "behaviour"), (REF_LOGP, "ref"), (TEACHER_LOGP, "teacher")):
        if name in declare:
            column = np.zeros(len(ids), dtype=np.float32)
            column[PROMPT - 1 : PROMPT - 1 + length] = item[key]
            values[name] = column
    values[ADVANTAGE] = np.zeros(len(ids), dtype=np.float32)
    values[ADVANTAGE][PROMPT - 1 : PROMPT - 1 + length] = item["advantage"]
    return Document(d, ids, labels, token_values=values)


class ParameterPolicy(nn.Module):
    """Per-token losses (-log-prob at every trained position, 0 elsewhere) read from parameters: document d's
    trained positions hold -theta[d]."""

    def __init__(self, items: list[dict]):
        super().__init__()
        self.theta = nn.ParameterList([nn.Parameter(torch.tensor(item["logp"], dtype=torch.float32)) for item in items])

    def forward(self, batch) -> torch.Tensor:
        losses = []
        for d, length in zip(batch.doc_ids, batch.doc_lengths):
            row = torch.zeros(length)
            trained = len(self.theta[d])
            row = torch.cat([row[: PROMPT - 1], -self.theta[d], row[PROMPT - 1 + trained :]])
            losses.append(row)
        if batch.padding:
            losses.append(torch.zeros(batch.padding))
        return torch.cat(losses) if losses else torch.zeros(batch.num_tokens)


def paper_loss(kind: str, theta: list[torch.Tensor], items: list[dict], settings: dict) -> torch.Tensor:
    """The step's loss as each paper writes it, completion by completion and token by token."""
    low, high = clip_range(kind, None, None)
    beta, cap, old_given = settings["beta"], settings["is_cap"], settings["old"]
    completion_terms, token_count = [], 0
    for logp, item in zip(theta, items):
        old = torch.tensor(item["old"], dtype=torch.float32) if old_given else logp.detach()
        behaviour = torch.tensor(item["behaviour"], dtype=torch.float32)
        ref = torch.tensor(item["ref"], dtype=torch.float32)
        a = item["advantage"]
        terms = []
        sequence_ratio = torch.exp((logp - old).mean())  # GSPO: the geometric mean of the tokens' ratios
        for t in range(len(logp)):
            if kind == "gspo":
                r = sequence_ratio
            else:
                r = torch.exp(logp[t] - old[t])
            if kind == "cispo":  # MiniMax-M1: sg(min(r, eps_max)) * A * log pi
                term = -torch.clamp(r, max=settings["cispo_max"]).detach() * a * logp[t]
            elif kind == "reverse_kl":  # on-policy distillation: the token's advantage log p_teacher - log p_old
                teacher = float(item["teacher"][t])
                term = -r * (teacher - old[t].detach())
            else:  # PPO's clipped surrogate
                term = -torch.min(r * a, torch.clamp(r, 1 - low, 1 + high) * a)
            if cap is not None:  # truncated importance sampling: the sampler drew from another distribution
                term = term * torch.clamp(torch.exp(old[t] - behaviour[t]), max=cap).detach()
            if beta:
                delta = ref[t] - logp[t]
                k3 = torch.exp(delta) - delta - 1
                term = term + beta * (k3 * r if settings.get("kl_ratio", True) else k3)  # DeepSeek-V3.2's, or k3
            terms.append(term)
        token_count += len(terms)
        completion_terms.append(torch.stack(terms))
    count = len(items)
    if kind in ("grpo", "gspo"):  # 1/G sum_i 1/|o_i| sum_t
        return sum(t.mean() for t in completion_terms) / count
    if kind == "dr_grpo":  # sum over every token / (G x the generation budget)
        return sum(t.sum() for t in completion_terms) / (count * MAX_NEW_TOKENS)
    return sum(t.sum() for t in completion_terms) / token_count  # dapo, cispo, reverse_kl: over every token of the step


SETTINGS = [
    {"beta": 0.0, "is_cap": None, "old": True},
    {"beta": 0.04, "is_cap": 2.0, "old": True},
    {"beta": 0.0, "is_cap": None, "old": False},  # one step per rollout: the old policy is the current one
    {"beta": 0.04, "is_cap": None, "old": False, "kl_ratio": False},  # plain k3, on-policy
]


def objective_for(kind: str, settings: dict) -> PolicyGradientObjective:
    low, high = clip_range(kind, None, None)
    loss = PolicyLoss(
        kind,
        epsilon_low=low,
        epsilon_high=high,
        beta=settings["beta"],
        cispo_max_ratio=1.3,
        max_new_tokens=MAX_NEW_TOKENS,
        is_cap=settings["is_cap"],
        kl_ratio=settings.get("kl_ratio", True),
    )
    return PolicyGradientObjective(loss)


def step_loss(
    objective: PolicyGradientObjective, policy: nn.Module, batches: list, per_microbatch: bool = False
) -> torch.Tensor:
    """As the update step computes it: each microbatch's sum over the step's units (`per_microbatch`: the mistake,
    each over its own units, averaged)."""
    units = sum(objective.count_units(b) for b in batches)
    total = torch.zeros(())
    for batch in batches:
        loss_sum, _ = objective.loss_sum(policy, batch)
        if per_microbatch:
            total = total + loss_sum / max(objective.count_units(batch), 1) / len(batches)
        else:
            total = total + loss_sum / units
    return total


def declared(settings: dict) -> tuple[str, ...]:
    return (BEHAVIOUR_LOGP, REF_LOGP, TEACHER_LOGP) + ((OLD_LOGP,) if settings["old"] else ())


@pytest.mark.parametrize("settings", SETTINGS, ids=["clipped", "kl_and_is", "on_policy", "plain_k3"])
@pytest.mark.parametrize("kind", SAMPLED)
def test_each_loss_equals_its_papers_formula_and_its_gradient(kind, settings):
    items = completions()
    documents = [document(d, item, declared(settings)) for d, item in enumerate(items)]
    objective = objective_for(kind, settings)
    policy = ParameterPolicy(items)
    loss = step_loss(objective, policy, [collate_packed(documents)])
    loss.backward()
    got = [p.grad.clone() for p in policy.theta]

    want_policy = ParameterPolicy(items)
    settings = {**settings, "cispo_max": 1.3}
    want = paper_loss(kind, list(want_policy.theta), items, settings)
    want.backward()
    assert math.isclose(float(loss), float(want), rel_tol=1e-6, abs_tol=1e-7), (float(loss), float(want))
    for g, w in zip(got, [p.grad for p in want_policy.theta]):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
    if settings["old"] and kind not in ("cispo", "reverse_kl"):  # the clip is in play: some ratios clipped, some not
        figures = objective.loss_sum(policy, collate_packed(documents))[1]
        assert 0 < float(figures["clipped_low"] + figures["clipped_high"]) < sum(len(i["tokens"]) for i in items)


@pytest.mark.parametrize("kind", SAMPLED)
def test_the_loss_and_its_gradients_do_not_depend_on_the_microbatch_split_and_a_per_microbatch_normaliser_would(kind):
    settings = SETTINGS[1]
    items = completions(seed=1)
    documents = [document(d, item, declared(settings)) for d, item in enumerate(items)]
    objective = objective_for(kind, settings)

    def grads(splits: list[list[int]], per_microbatch: bool = False) -> tuple[float, list[torch.Tensor]]:
        policy = ParameterPolicy(items)
        batches = [collate_packed([documents[i] for i in split]) if split else empty_batch(0) for split in splits]
        loss = step_loss(objective, policy, batches, per_microbatch)
        loss.backward()
        return float(loss), [p.grad.clone() for p in policy.theta]

    whole, want = grads([list(range(8))])
    for splits in ([[0, 1, 2], [3, 4], [5, 6, 7]], [[7, 0], [], [1, 2, 3, 4, 5, 6]], [[i] for i in range(8)]):
        loss, got = grads(splits)
        assert math.isclose(loss, whole, rel_tol=1e-6, abs_tol=1e-8), splits
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-8)
    _, wrong = grads([[0, 1, 2], [3, 4], [5, 6, 7]], per_microbatch=True)
    error = max(float((g - w).norm() / w.norm()) for g, w in zip(wrong, want) if w.norm() > 0)
    assert error > 1e-3  # the control: each microbatch over its own units changes the gradient


def test_an_empty_microbatch_reports_every_figure_as_nothing_seen_and_trains_nothing():
    objective = objective_for("dapo", SETTINGS[0])
    policy = ParameterPolicy(completions())
    loss, figures = objective.loss_sum(policy, empty_batch(0))
    assert float(loss) == 0.0 and sorted(figures) == sorted(FIGURES)
    sums = {name: float(v) for name, v in figures.items() if not name.startswith(MAX_FIGURE)}
    assert (
        all(v == 0 for v in sums.values())
        and float(figures[RATIO_MAX]) == float(figures[RATIO_MIN_NEGATED]) == -math.inf
    )
    assert objective.count_units(empty_batch(0)) == 0


@pytest.mark.parametrize("kind", ["dapo", "gspo"])
def test_the_ratio_range_over_a_step_split_into_microbatches_is_the_range_of_every_token_ratio(kind):
    """ratio_min / ratio_max: the smallest and largest importance ratio of the step's tokens (gspo: of its
    sequence ratios), computed here from the log-probs; the step's figures combined as the update step does."""
    settings = SETTINGS[0]
    items = completions(seed=3)
    documents = [document(d, item, declared(settings)) for d, item in enumerate(items)]
    objective = objective_for(kind, settings)
    policy = ParameterPolicy(items)
    if kind == "gspo":
        ratios = [math.exp(float(np.mean(item["logp"] - item["old"]))) for item in items]
    else:
        ratios = [math.exp(x) for item in items for x in item["logp"] - item["old"]]
    step = {}
    for split in ([0, 1, 2], [], [3, 4, 5, 6, 7]):
        batch = collate_packed([documents[i] for i in split]) if split else empty_batch(0)
        for name, value in objective.loss_sum(policy, batch)[1].items():
            step[name] = accumulate_figure(name, step.get(name), value.detach(), 1.0)
    metrics = objective.metrics({"loss_sum": 0.0} | {name: float(v) for name, v in step.items()}, len(items))
    assert math.isclose(metrics["ratio_min"], min(ratios), rel_tol=1e-6)
    assert math.isclose(metrics["ratio_max"], max(ratios), rel_tol=1e-6)
    assert metrics["ratio_min"] < 1 < metrics["ratio_max"]


def test_the_units_are_completion_tokens_or_completions_as_the_paper_normalises():
    items = completions()
    batch = collate_packed([document(d, item, ()) for d, item in enumerate(items)])
    tokens = sum(len(item["tokens"]) for item in items)
    for kind in SAMPLED:
        units = objective_for(kind, SETTINGS[2]).count_units(batch)
        assert units == (tokens if POLICY_LOSSES[kind].unit == "completion token" else len(items)), kind
    assert {k for k, s in POLICY_LOSSES.items() if s.unit == "completion token"} == {
        "dapo",
        "cispo",
        "reverse_kl",
        "gkd",
    }


def test_gkd_needs_its_teacher_and_reports_its_divergence_without_ratios():
    loss = PolicyLoss("gkd")
    with pytest.raises(ValueError, match="teacher"):
        PolicyGradientObjective(loss)
    objective = PolicyGradientObjective(loss, teacher=nn.Identity())
    metrics = objective.metrics({"loss_sum": 3.0, "completion_tokens": 12.0, "completions": 2.0}, 12)
    assert metrics == {"loss": 0.25, "num_tokens": 12, "completions": 2}


def test_a_kl_penalty_without_reference_log_probs_is_refused():
    items = completions()
    batch = collate_packed([document(d, item, (BEHAVIOUR_LOGP,)) for d, item in enumerate(items)])
    objective = objective_for("grpo", {"beta": 0.1, "is_cap": None, "old": False})
    with pytest.raises(ValueError, match="reference's log-probs"):
        objective.loss_sum(ParameterPolicy(items), batch)


def test_the_metrics_are_the_step_sums_over_its_tokens_and_rollout():
    objective = objective_for("dapo", SETTINGS[1])
    sums = {
        "loss_sum": 2.0,
        "completion_tokens": 40.0,
        "completions": 8.0,
        "clipped_low": 4.0,
        "clipped_high": 2.0,
        "ratio_sum": 41.0,
        "kl_sum": 0.8,
        "is_weight_sum": 38.0,
        "mismatch_kl_sum": 0.4,
        "ranks": 2.0,
        "sampled": 8.0,
        "reward_sum": 4.0,
        "reward_sq_sum": 2.5,
        "reward_sum/exact": 2.0,
        "advantage_abs_sum": 6.0,
        "groups": 2.0,
        "uniform_groups": 1.0,
        "skipped_groups": 0.0,
        "sampled_tokens": 40.0,
        "truncated": 2.0,
        "entropy_sum": 20.0,
        "rollout_s": 4.0,
    }
    metrics = objective.metrics(sums, 40)
    assert metrics["loss"] == 2.0 / 40 and metrics["num_tokens"] == 40 and metrics["completions"] == 8
    assert (metrics["clipped_low"], metrics["clipped_high"], metrics["ratio_mean"]) == (0.1, 0.05, 41 / 40)
    assert (metrics["kl"], metrics["is_weight_mean"], metrics["mismatch_kl"]) == (0.02, 0.95, 0.01)
    assert metrics["reward"] == 0.5 and math.isclose(metrics["reward_std"], math.sqrt(2.5 / 8 - 0.25))
    assert metrics["reward/exact"] == 0.25 and metrics["uniform_groups"] == 1 and metrics["truncated"] == 0.25
    assert metrics["completion_length"] == 5.0 and metrics["entropy"] == 0.5
    assert metrics["rollout_s"] == 2.0 and metrics["rollout_tokens_per_sec"] == 20.0  # mean over the 2 ranks
    assert "skipped_groups" not in metrics  # (none: said only where some were)
    assert "ratio_min" not in metrics  # (no range given: none said)
    ranged = objective.metrics(sums | {RATIO_MAX: 1.5, RATIO_MIN_NEGATED: -0.25}, 40)
    assert (ranged["ratio_min"], ranged["ratio_max"]) == (0.25, 1.5)


def test_a_student_equal_to_its_teacher_has_zero_loss_and_zero_gradient():
    items = [{**item, "teacher": item["logp"]} for item in completions()]
    documents = [document(d, item, (TEACHER_LOGP,)) for d, item in enumerate(items)]
    policy = ParameterPolicy(items)
    objective = objective_for("reverse_kl", {"beta": 0.0, "is_cap": None, "old": False})
    loss, figures = objective.loss_sum(policy, collate_packed(documents))
    loss.backward()
    assert float(loss) == 0.0 and float(figures["teacher_kl_sum"]) == 0.0
    assert all(float(p.grad.abs().max()) == 0.0 for p in policy.theta)


class LogitPolicy(nn.Module):
    """One position's logits as parameters: a document's one trained token v has the loss -log softmax(logits)[v]."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = nn.Parameter(logits.clone())

    def forward(self, batch) -> torch.Tensor:
        losses = torch.zeros(batch.num_tokens)
        trained = (batch.labels[0] != IGNORE_INDEX).nonzero()[:, 0]
        return losses.index_put((trained,), -torch.log_softmax(self.logits, -1)[batch.labels[0, trained]])


def test_reverse_kls_expected_gradient_is_the_exact_reverse_kls_over_the_vocabulary():
    """Over every token v the student may sample at a position, weighed by its probability, the loss's gradient
    is the gradient of KL(student || teacher) summed over the whole vocabulary, computed here by autograd."""
    vocab = 7
    generator = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(vocab, generator=generator), torch.randn(vocab, generator=generator)
    objective = objective_for("reverse_kl", {"beta": 0.0, "is_cap": None, "old": False})
    probs = torch.softmax(student, -1)
    expected = torch.zeros(vocab)
    teacher_logp = torch.log_softmax(teacher, -1)
    for v in range(vocab):  # a one-token completion of v, alone in its step
        ids, labels = np.array([1, 2, v]), np.array([IGNORE_INDEX, v, IGNORE_INDEX])
        column = np.zeros(3, dtype=np.float32)
        column[1] = float(teacher_logp[v])
        batch = collate_packed([Document(0, ids, labels, token_values={TEACHER_LOGP: column})])
        policy = LogitPolicy(student)
        loss, _ = objective.loss_sum(policy, batch)
        loss.backward()
        expected += float(probs[v]) * policy.logits.grad
    logits = student.clone().requires_grad_()
    log_p = torch.log_softmax(logits, -1)
    (log_p.exp() * (log_p - teacher_logp)).sum().backward()  # KL(student || teacher), exactly
    torch.testing.assert_close(expected, logits.grad, rtol=1e-5, atol=1e-6)
    assert float(logits.grad.abs().max()) > 1e-2  # (the two differ: there is a gradient to match)
