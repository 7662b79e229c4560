"""The generalised Jensen-Shannon divergence between a teacher's and a student's next-token distributions over the
whole vocabulary (GKD, Agarwal et al., arXiv 2306.13649: on-policy distillation's `loss.type=gkd`), from both
models' final hidden states, in chunks of tokens, so that neither model's full logits exist at once.

Per trained position, with S and T the student's and the teacher's distributions (each model's own logit transform,
the sampling temperature included) and beta in [0, 1], as TRL's `GKDTrainer.generalized_jsd_loss`:

    beta = 0:    KL(T || S)                                   (forward KL: the student covers the teacher)
    beta = 1:    KL(S || T)                                   (reverse KL: the student seeks the teacher's modes)
    otherwise:   beta KL(T || M) + (1 - beta) KL(S || M),     M = beta T + (1 - beta) S

Each chunk runs under non-reentrant activation checkpointing, as the cross-entropy's does
(`chattune.model.head.chunked_loss`): the forward keeps the chunk's hidden states only and the backward recomputes
its two logit blocks. Only the trained positions (the sampled completion tokens) are computed: a completion's prompt
is most of its row and its distribution is not trained. A chunk holds about six (C, V) fp32 blocks where the
cross-entropy holds two, so it takes a quarter of the loss's chunk size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from chattune.data.documents import IGNORE_INDEX
from chattune.model.head.chunked_loss import SummedInFp32, chunk_logits, upcast_for_chunk
from chattune.model.head.output_logits import LogitTransform

CHUNK_SHARE = 4  # the divergence's chunk: the loss's chunk size divided by this (its (C, V) blocks, see above)


@dataclass(frozen=True)
class DistillationTarget:
    """What the student's distributions are compared with on one packed row: the teacher's final hidden states of
    that row (N, H; no graph), its output layer (V, H) and bias, its logit transform, and the divergence's beta."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    transform: LogitTransform
    beta: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"the generalised JSD's beta must be in [0, 1], got {self.beta}")


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float) -> torch.Tensor:
    """The divergence of each row (R,) of two (R, V) logit blocks (see the module's docstring), in their dtype."""
    student = torch.log_softmax(student_logits, dim=-1)
    teacher = torch.log_softmax(teacher_logits, dim=-1)
    if beta == 0.0:
        return (teacher.exp() * (teacher - student)).sum(-1)
    if beta == 1.0:
        return (student.exp() * (student - teacher)).sum(-1)
    mixture = torch.logaddexp(student + math.log1p(-beta), teacher + math.log(beta))
    return beta * (teacher.exp() * (teacher - mixture)).sum(-1) + (1 - beta) * (
        student.exp() * (student - mixture)
    ).sum(-1)


def _chunk_divergence(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    transform: LogitTransform,
    teacher_hidden: torch.Tensor,
    target: DistillationTarget,
    sums: tuple[SummedInFp32 | None, SummedInFp32 | None],
) -> torch.Tensor:
    weight, bias = upcast_for_chunk(weight, bias, sums)  # a bf16 output layer's gradient summed in fp32
    with torch.no_grad():
        teacher_logits = chunk_logits(teacher_hidden, target.weight, target.bias, target.transform)
    return generalized_jsd(chunk_logits(hidden, weight, bias, transform), teacher_logits, target.beta)


def chunked_token_divergence(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    target: DistillationTarget,
    chunk_size: int,
    transform: LogitTransform,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token generalised JSD (N,) in fp32 between the student (`hidden` (N, H) its final hidden states, `weight`
    (V, H) and `bias` its output layer, `transform` its logit transform) and `target`'s teacher on the same row, at
    the positions whose label is trained (0 elsewhere). Both output layers must have the same rows (one tokenizer,
    the same vocabulary size: the teacher's builder checks)."""
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1] or target.hidden.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"expected the student's and the teacher's hidden states (N, H) and labels (N,), got "
            f"{tuple(hidden.shape)}, {tuple(target.hidden.shape)} and {tuple(labels.shape)}"
        )
    if target.weight.shape[0] != weight.shape[0]:
        raise ValueError(
            f"the teacher's output layer has {target.weight.shape[0]} rows, the student's {weight.shape[0]}: the "
            "divergence compares distributions over one vocabulary"
        )
    positions = (labels != IGNORE_INDEX).nonzero().squeeze(1)
    student, teacher = hidden.index_select(0, positions), target.hidden.index_select(0, positions)
    size = max(1, chunk_size // CHUNK_SHARE)
    chunks = -(-student.shape[0] // size)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    sums = (SummedInFp32.where_needed(weight, chunks), SummedInFp32.where_needed(bias, chunks))
    divergences = []
    for start in range(0, student.shape[0], size):
        args = (student[start : start + size], weight, bias, transform, teacher[start : start + size], target, sums)
        if needs_grad:
            divergences.append(checkpoint(_chunk_divergence, *args, use_reentrant=False))
        else:
            divergences.append(_chunk_divergence(*args[:-1], (None, None)))
    out = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    if not divergences:  # no trained position: the graph still reaches the student's parameters (FSDP2 reduces
        # every rank's gradients together, so each rank's must exist)
        reached = hidden.float().sum() + weight.float().sum() + (bias.float().sum() if bias is not None else 0.0)
        return out + reached * 0.0
    return out.index_put((positions,), torch.cat(divergences))
