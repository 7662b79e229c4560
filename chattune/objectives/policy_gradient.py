"""On-policy policy-gradient objectives (the GRPO recipe): GRPO, DAPO, Dr. GRPO, GSPO and CISPO, with an optional KL
penalty to a reference model and truncated importance sampling of the sampler's tokens.

A completion is one segment of a packed row: its prompt (untrained; with data.share_prompts a group's later
completions continue one copy of it) and the tokens the policy sampled (trained). What each token's loss needs rides
on the document as declared values (`chattune.data.documents.Document`), which packing carries to the objective, per
token: its completion's advantage, and the log-probabilities of the
policy that sampled it (`OLD_LOGP`, computed once per rollout where several optimizer steps reuse it), of the
distribution the sampler actually drew from (`BEHAVIOUR_LOGP`: temperature and truncation applied) and of the
reference model (`REF_LOGP`, with loss.beta > 0). A value sits at the position whose label is its token.

With one optimizer step per rollout the old policy is the current one: its log-probs are the current ones detached
(the ratio is 1, its gradient the policy gradient), as TRL does, with no second forward.

On-policy distillation (`reverse_kl`) takes each token's advantage from a teacher instead of a reward: log p_teacher -
log p_old at the sampled token (`TEACHER_LOGP`), whose expectation under the student is minus the reverse KL from the
student to the teacher at that position, so the update descends that KL (Agarwal et al.'s on-policy distillation).
`gkd` compares the whole distributions instead: at each sampled position the generalised Jensen-Shannon divergence
between the teacher's and the student's next-token distributions over the vocabulary, the teacher run on each
microbatch beside the student (`chattune.model.head.chunked_divergence`: neither model's full logits at once).

The step's loss is the sum of its per-token (or per-completion) terms over every microbatch and rank divided by the
count its paper defines over the whole step (`chattune.config.policy_losses`): the loop all-reduces that count once
and divides each microbatch's sum by it (`chattune.train.step`), so the gradient does not depend on how the step's
completions are split into microbatches and ranks. The formulas are TRL 1.16's `GRPOTrainer._compute_loss`'s where
TRL defines the loss (differences: docs/grpo.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from chattune.config.policy_losses import POLICY_LOSSES, clip_range
from chattune.config.schema import PolicyLossConfig, RolloutConfig
from chattune.data.documents import IGNORE_INDEX
from chattune.data.packing import PackedBatch
from chattune.distributed import MAX_FIGURE
from chattune.objectives.base import Objective

# The values a completion document declares on its tokens (`Document.token_values`), at the positions that predict
# its sampled tokens. Per token, not per document: a group's completions may share one document (data.share_prompts).
ADVANTAGE = "advantage"  # per token: its completion's advantage
OLD_LOGP = "old_logp"  # per token: the rollout policy's log-prob (several optimizer steps per rollout)
BEHAVIOUR_LOGP = "behaviour_logp"  # per token: the sampled distribution's log-prob (temperature, truncation)
REF_LOGP = "ref_logp"  # per token: the reference model's log-prob (loss.beta > 0)
TEACHER_LOGP = "teacher_logp"  # per token: the teacher's log-prob (on-policy distillation: loss.type=reverse_kl)

# The ratio's range: the largest over the step's tokens, and the smallest (negated: extremes travel as maxima).
RATIO_MAX = f"{MAX_FIGURE}ratio"
RATIO_MIN_NEGATED = f"{MAX_FIGURE}-ratio"

# The figures every microbatch reports, summed over the step's microbatches and ranks (the same keys for an empty
# microbatch: ranks all-reduce them stacked).
FIGURES = (
    "completions",
    "completion_tokens",
    "clipped_low",
    "clipped_high",
    "ratio_sum",
    "kl_sum",
    "is_weight_sum",
    "mismatch_kl_sum",
    "teacher_kl_sum",
    RATIO_MAX,
    RATIO_MIN_NEGATED,
)


def empty_figures(like: torch.Tensor) -> dict[str, torch.Tensor]:
    """`FIGURES` of a microbatch with no completion token: sums 0, extremes -inf (nothing seen)."""
    return {
        name: like.new_full((), -math.inf if name.startswith(MAX_FIGURE) else 0.0, dtype=torch.float64)
        for name in FIGURES
    }


@dataclass(frozen=True)
class PolicyLoss:
    """One policy-gradient loss (`loss.type`, `chattune.config.policy_losses`) and its settings: the clip range, the
    KL penalty `beta` (k3 estimator, against REF_LOGP; `kl_ratio`: each token's weighed by its importance ratio, as
    DeepSeek-V3.2 and TRL 1.16 by default), CISPO's cap on its weight, Dr. GRPO's constant (`max_new_tokens`) and the
    cap of truncated importance sampling (`is_cap`, None: off) of the sampler's tokens."""

    type: str
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0
    cispo_max_ratio: float = 5.0
    max_new_tokens: int = 1
    is_cap: float | None = None
    kl_ratio: bool = True
    jsd_beta: float = 0.5

    def __post_init__(self) -> None:
        if self.type not in POLICY_LOSSES:
            raise ValueError(f"unknown policy loss {self.type!r}; one of {sorted(POLICY_LOSSES)}")

    @classmethod
    def from_config(cls, loss: PolicyLossConfig, rollout: RolloutConfig) -> PolicyLoss:
        """The loss a GRPO run's `loss` and `rollout` sections name (null clip settings: the loss's paper's)."""
        low, high = clip_range(loss.type, loss.epsilon_low, loss.epsilon_high)
        return cls(
            type=loss.type,
            epsilon_low=low,
            epsilon_high=high,
            beta=loss.beta,
            cispo_max_ratio=loss.cispo_max_ratio,
            max_new_tokens=rollout.max_new_tokens,
            is_cap=rollout.is_cap if rollout.is_correction == "truncate" else None,
            kl_ratio=loss.kl_ratio,
            jsd_beta=loss.jsd_beta,
        )

    @property
    def per_token(self) -> bool:
        """The step's loss is a mean over its completion tokens (else over its completions)."""
        return POLICY_LOSSES[self.type].unit == "completion token"

    def token_terms(
        self,
        logp: torch.Tensor,
        advantages: torch.Tensor,
        old_logp: torch.Tensor | None = None,
        behaviour_logp: torch.Tensor | None = None,
        ref_logp: torch.Tensor | None = None,
        sequence_log_ratio: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The per-token loss terms (M,) of M completion tokens and their figures (per token, unsummed): `logp` the
        policy's log-probs (with their graph), `advantages` each token's completion's advantage, `old_logp` the
        rollout policy's (None: `logp` detached), `behaviour_logp` the sampler's (with `is_cap`: the correction),
        `ref_logp` the reference's (with beta > 0); `sequence_log_ratio` (gspo): each token's completion's mean log
        ratio, with its graph."""
        old = logp.detach() if old_logp is None else old_logp
        log_ratio = sequence_log_ratio if POLICY_LOSSES[self.type].sequence_ratio else logp - old
        ratio = torch.exp(log_ratio)
        if self.type == "cispo":  # the weight capped and detached: only the log-prob carries the gradient
            terms = -torch.clamp(ratio, max=self.cispo_max_ratio).detach() * advantages * logp
        elif self.type == "reverse_kl":  # importance-weighted, unclipped: its advantages are per token already
            terms = -ratio * advantages
        else:
            clipped = torch.clamp(ratio, 1 - self.epsilon_low, 1 + self.epsilon_high)
            terms = -torch.min(ratio * advantages, clipped * advantages)
        figures = {
            "clipped_low": ((ratio < 1 - self.epsilon_low) & (advantages < 0)).double(),
            "clipped_high": ((ratio > 1 + self.epsilon_high) & (advantages > 0)).double(),
            "ratio": ratio.detach().double(),
        }
        if self.is_cap is not None and behaviour_logp is not None:  # the sampler drew from another distribution
            weight = torch.clamp(torch.exp(old.detach() - behaviour_logp), max=self.is_cap)
            terms = terms * weight
            figures["is_weight"] = weight.double()
        if behaviour_logp is not None:  # an estimate of KL(sampler || rollout policy) on the sampler's tokens
            figures["mismatch_kl"] = (behaviour_logp - old.detach()).double()
        if self.beta != 0.0:
            if ref_logp is None:
                raise ValueError("loss.beta > 0 needs the reference's log-probs of every completion token")
            delta = ref_logp - logp
            kl = torch.exp(delta) - delta - 1  # k3: a non-negative estimate of KL(policy || reference)
            figures["kl"] = kl.detach().double()
            if self.kl_ratio:  # DeepSeek-V3.2: weighed by the ratio, its gradient is the reverse KL's, unbiased
                kl = kl * ratio
            terms = terms + self.beta * kl
        return terms, figures

    def aggregate(self, terms: torch.Tensor, completion: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The microbatch's share of the step's loss sum: its terms summed as the loss's unit says (`completion`:
        each term's completion, its segment; `lengths`: each segment's trained tokens)."""
        if self.type in ("grpo", "gspo"):  # each completion's token mean, summed over completions
            return (terms / lengths[completion].to(terms.dtype)).sum()
        if self.type == "dr_grpo":  # a constant per completion: the generation budget
            return terms.sum() / self.max_new_tokens
        return terms.sum()


def completion_lengths(batch: PackedBatch, trained: torch.Tensor) -> torch.Tensor:
    """Each segment's trained tokens (S,), where the batch is. A completion is a segment with trained tokens: a
    document of its own, or one of a group's replies continuing their shared prompt (data.share_prompts), so a
    completion's tokens are found the same way in both layouts; its index is its segment's."""
    lengths = torch.zeros(batch.cu_seqlens.numel() - 1, dtype=torch.long, device=trained.device)
    return lengths.index_add_(0, batch.segment_ids.to(trained.device), trained.long())


class PolicyGradientObjective(Objective):
    """The GRPO recipe's objective: `loss` (a `PolicyLoss`) over completion documents. Its unit is the step's
    completions or completion tokens, as the loss's paper normalises (`chattune.config.policy_losses`). The step's
    rollout figures (rewards, lengths, the sampler's time), which the rollout source reports beside the microbatches
    (`StepBatches.figures`), become metrics here with the loss's own."""

    def __init__(self, loss: PolicyLoss, teacher: nn.Module | None = None):
        """`teacher`: loss.type=gkd's, a frozen causal LM (`PackedCausalLM`, sharded like the policy) run on every
        microbatch for its distributions."""
        if POLICY_LOSSES[loss.type].vocabulary and teacher is None:
            raise ValueError(f"loss.type={loss.type} compares the policy's distributions with a teacher's: pass it")
        self.loss = loss
        self.teacher = teacher
        self.unit_name = POLICY_LOSSES[loss.type].unit

    def count_units(self, batch: PackedBatch) -> int:
        if self.loss.per_token:
            return batch.num_trainable_tokens
        trained = batch.labels[0] != IGNORE_INDEX
        return int((completion_lengths(batch, trained) > 0).sum())

    def loss_sum(self, model: nn.Module, batch: PackedBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self.teacher is not None:
            return self._divergence_sum(model, batch)
        token_losses = model(batch)  # (N,) -log p of each label at the sampling temperature; 0 where untrained
        device = token_losses.device
        zeros = empty_figures(token_losses)
        if not batch.doc_ids:  # an empty microbatch (a rank short of completions): nothing to train
            return token_losses.sum() * 0.0, zeros
        trained = (batch.labels[0] != IGNORE_INDEX).to(device)
        logp = -token_losses[trained]
        completion = batch.segment_ids.to(device)[trained]  # each trained token's completion: its segment
        lengths = completion_lengths(batch, trained)  # (0 for a segment without a completion: never indexed)
        values = {name: batch.token_values[name][0].to(device)[trained] for name in batch.token_values}
        old = values.get(OLD_LOGP)
        teacher_kl = None
        if POLICY_LOSSES[self.loss.type].teacher:  # each token's advantage: log p_teacher - log p_old
            if TEACHER_LOGP not in values:
                raise ValueError(f"loss.type={self.loss.type} needs the teacher's log-probs of every completion token")
            sampler = logp.detach() if old is None else old
            advantages = values[TEACHER_LOGP] - sampler
            teacher_kl = -advantages  # log p_old - log p_teacher: the sampled estimate of KL(student || teacher)
        else:
            if ADVANTAGE not in values:
                raise ValueError("a policy-gradient loss needs the advantage declared on every completion token")
            advantages = values[ADVANTAGE].to(logp.dtype)
        sequence_log_ratio = None
        if POLICY_LOSSES[self.loss.type].sequence_ratio:  # each completion's mean log ratio, on each of its tokens
            log_ratio = logp - (logp.detach() if old is None else old)
            sums = torch.zeros(len(lengths), dtype=logp.dtype, device=device).index_add(0, completion, log_ratio)
            sequence_log_ratio = (sums / lengths.clamp(min=1).to(logp.dtype))[completion]
        terms, token_figures = self.loss.token_terms(
            logp, advantages, old, values.get(BEHAVIOUR_LOGP), values.get(REF_LOGP), sequence_log_ratio
        )
        figures = dict(zeros)
        figures["completions"] = zeros["completions"] + (lengths > 0).sum()
        figures["completion_tokens"] = zeros["completion_tokens"] + int(trained.sum())
        for name, per_token in token_figures.items():
            figures[name if name.startswith("clipped") else f"{name}_sum"] = per_token.sum()
        if len(logp):
            figures[RATIO_MAX] = token_figures["ratio"].max()
            figures[RATIO_MIN_NEGATED] = -token_figures["ratio"].min()
        if teacher_kl is not None:
            figures["teacher_kl_sum"] = teacher_kl.double().sum()
        return self.loss.aggregate(terms, completion, lengths), figures

    def _divergence_sum(self, model: nn.Module, batch: PackedBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """gkd: the microbatch's summed per-token divergences to the teacher. Every rank runs the teacher on every
        microbatch, an empty one too: its sharded layers gather collectively."""
        assert self.teacher is not None
        target = self.teacher.distillation_target(batch, self.loss.jsd_beta)  # type: ignore[operator]
        divergences = model(batch, distill=target)  # (N,) at the sampled positions, 0 elsewhere
        figures = empty_figures(divergences)
        figures["completions"] += (completion_lengths(batch, batch.labels[0] != IGNORE_INDEX) > 0).sum()
        figures["completion_tokens"] += batch.num_trainable_tokens
        return divergences.sum(), figures

    def metrics(self, sums: dict[str, float], global_units: int) -> dict[str, float]:
        """loss: the step's loss (its sum over the step's units); num_tokens: its completion tokens; the clipped
        shares of its tokens (below the range with a negative advantage, above it with a positive one), the ratio's
        mean and range over the step's tokens (ratio_min, ratio_max), the mean k3 KL to the reference (loss.beta > 0),
        the sampler's mismatch and the importance weights where the sampler's log-probs are known; then the rollout's
        figures (`rollout_metrics`)."""
        tokens = max(sums.get("completion_tokens", 0.0), 1.0)
        metrics = {
            "loss": sums["loss_sum"] / max(global_units, 1),
            "num_tokens": int(sums.get("completion_tokens", 0.0)),
            "completions": int(sums.get("completions", 0.0)),
        }
        if self.teacher is not None:  # gkd: the loss is the mean divergence; no ratio, no sampled log-probs
            return metrics | rollout_metrics(sums)
        metrics |= {
            "clipped_low": sums.get("clipped_low", 0.0) / tokens,
            "clipped_high": sums.get("clipped_high", 0.0) / tokens,
            "ratio_mean": sums.get("ratio_sum", 0.0) / tokens,
        }
        if math.isfinite(sums.get(RATIO_MAX, -math.inf)):  # (a step with no completion token has no range)
            metrics |= {"ratio_min": -sums[RATIO_MIN_NEGATED], "ratio_max": sums[RATIO_MAX]}
        if self.loss.beta != 0.0:
            metrics["kl"] = sums.get("kl_sum", 0.0) / tokens
        if POLICY_LOSSES[self.loss.type].teacher:  # the student's sampled reverse KL to its teacher, per token
            metrics["teacher_kl"] = sums.get("teacher_kl_sum", 0.0) / tokens
        # the sampler's log-probs ride on every completion (rollout.temperature > 0: drawn, not greedy)
        metrics["mismatch_kl"] = sums.get("mismatch_kl_sum", 0.0) / tokens
        if self.loss.is_cap is not None:
            metrics["is_weight_mean"] = sums.get("is_weight_sum", 0.0) / tokens
        metrics.update(rollout_metrics(sums))
        return metrics


def rollout_metrics(sums: dict[str, float]) -> dict[str, float]:
    """The metrics of a step's rollout from its sums over ranks (`chattune.rl.rollouts` reports them): the reward's
    mean and standard deviation over the step's sampled completions, each reward function's mean, the advantages'
    spread, the groups whose rewards were all equal, completion lengths and the share cut at the generation budget,
    the policy's entropy at the sampled tokens, whether the step was sampled (GKD's λ < 1), and the sampler's time and
    tokens per second (mean over ranks)."""
    sampled = sums.get("sampled")
    if not sampled:
        return {}
    metrics = {}
    if "reward_sum" in sums:  # (a run without a reward function, distilling from a teacher, reports none)
        mean = sums["reward_sum"] / sampled
        metrics["reward"] = mean
        metrics["reward_std"] = math.sqrt(max(sums["reward_sq_sum"] / sampled - mean * mean, 0.0))
        metrics.update(
            {
                f"reward/{name[len('reward_sum/') :]}": value / sampled
                for name, value in sums.items()
                if name.startswith("reward_sum/")
            }
        )
    metrics |= {
        "advantage_abs_mean": sums["advantage_abs_sum"] / sampled,
        "groups": int(sums["groups"]),
        "uniform_groups": int(sums["uniform_groups"]),
        "completion_length": sums["sampled_tokens"] / sampled,
        "truncated": sums["truncated"] / sampled,
    }
    if "entropy_sum" in sums:  # (a rollout of the data's own replies, GKD's off-policy one, samples nothing)
        metrics["entropy"] = sums["entropy_sum"] / max(sums["sampled_tokens"], 1.0)
    if sums.get("skipped_groups"):
        metrics["skipped_groups"] = int(sums["skipped_groups"])
    ranks = max(sums.get("ranks", 1.0), 1.0)
    if "on_policy" in sums:  # GKD's λ < 1: 1 where the step's completions were sampled, 0 where the data's
        metrics["on_policy"] = sums["on_policy"] / ranks
    metrics["rollout_s"] = sums.get("rollout_s", 0.0) / ranks  # 0: a later step of the same rollout
    if metrics["rollout_s"] > 0:
        metrics["rollout_tokens_per_sec"] = sums["sampled_tokens"] / metrics["rollout_s"]
    return metrics
