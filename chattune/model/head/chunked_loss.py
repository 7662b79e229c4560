"""Cross-entropy from final hidden states, in chunks, so a microbatch's full-vocabulary fp32 logits
never exist at once (at a 152k vocabulary, 8k tokens of fp32 logits alone are 5 GB).

Each chunk is computed under non-reentrant activation checkpointing: the forward keeps only the chunk's
hidden states and labels, and the backward recomputes that chunk's logits, one chunk at a time.
Returning per-token losses (not only their sum) keeps the function general: SFT sums them, DPO turns
them into per-sequence log-probabilities.

With `tf32=True` (CUDA, bf16/fp16 compute: the builder decides) the head's own matmuls, forward and
backward, run in TF32, and nothing else does: the global switch (`torch.set_float32_matmul_precision`) would
also turn every other fp32 matmul of the process into TF32 (RoPE where transformers computes it as a
matmul, LoRA merges, DoRA magnitudes). The forward is exact in TF32: its inputs are bf16 values, which TF32
represents exactly (10 mantissa bits), and it accumulates in fp32. The backward rounds the fp32 softmax
gradient to TF32 (a relative 2^-11 per element) before its two matmuls.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils.checkpoint import checkpoint

from chattune.data.documents import IGNORE_INDEX
from chattune.model.head.output_logits import LogitTransform
from chattune.parallel.vocab_parallel import VocabShard, local_targets, vocab_parallel_token_losses


@contextmanager
def tf32_matmuls() -> Iterator[None]:
    """fp32 matmuls in TF32 inside the block only. The legacy setter, as every reader of the flag expects
    (mixing it with the newer `fp32_precision` settings makes the legacy getters raise)."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


class _TF32Logits(torch.autograd.Function):
    """hidden.float() @ weight.float().t(), its forward and backward matmuls in TF32 (the backward runs
    outside the forward's code, in autograd's engine, so a context around the forward would not reach it)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(hidden, weight)
        with tf32_matmuls():
            return hidden.float() @ weight.float().t()

    @staticmethod
    def backward(ctx, grad_logits: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        hidden, weight = ctx.saved_tensors
        grad_hidden = grad_weight = None
        with tf32_matmuls():
            if ctx.needs_input_grad[0]:
                grad_hidden = (grad_logits @ weight.float()).to(hidden.dtype)
            if ctx.needs_input_grad[1]:
                grad_weight = (grad_logits.t() @ hidden.float()).to(weight.dtype)
        return grad_hidden, grad_weight


def chunk_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    transform: LogitTransform | None = None,
    tf32: bool = False,
) -> torch.Tensor:
    """A chunk's fp32 logits as the model's forward makes them: hidden @ W.T, its bias, then its transform."""
    # Upcast before the matmul: a bf16 matmul rounds every logit to 8 significant bits (0.125 at 20)
    # before the loss sees it. bf16 -> fp32 is exact.
    logits = _TF32Logits.apply(hidden, weight) if tf32 else hidden.float() @ weight.float().t()
    if bias is not None:  # the output layer's own (Phi, GPT-J, CodeGen): before any scaling, as its forward adds it
        logits = logits + bias.float()
    if transform is not None and not transform.is_identity:
        logits = transform(logits)  # in fp32, inside the checkpoint: recomputed with the chunk's logits
    return logits


def _chunk_token_losses(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    tf32: bool = False,
    transform: LogitTransform | None = None,
    bias: torch.Tensor | None = None,
    rows: VocabShard | None = None,
) -> torch.Tensor:
    logits = chunk_logits(hidden, weight, bias, transform, tf32)
    if rows is not None:  # this rank's rows of a vocabulary split over tp: reduced over the group
        index, here = local_targets(labels, rows)
        target = logits.gather(1, index.unsqueeze(1)).squeeze(1).masked_fill(~here, 0.0)
        return vocab_parallel_token_losses(torch.logsumexp(logits, dim=-1), target, labels, rows)
    # logsumexp minus the target logit, not F.cross_entropy: the same value and gradient, but cross_entropy's
    # fused log-softmax under-estimates the log-normaliser of a wide vocabulary by ~1e-5 nats a token on average
    # (a bias, which sums over a reply) where logsumexp stays within float rounding of a float64 computation
    # (tests/unit/model/head/test_chunked_loss.py).
    ignored = labels == IGNORE_INDEX
    target = logits.gather(1, labels.masked_fill(ignored, 0).unsqueeze(1)).squeeze(1)
    return (torch.logsumexp(logits, dim=-1) - target).masked_fill(ignored, 0.0)


def chunked_token_losses(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int,
    tf32: bool = False,
    transform: LogitTransform | None = None,
    bias: torch.Tensor | None = None,
    rows: VocabShard | None = None,
) -> torch.Tensor:
    """Per-token cross-entropy (fp32, 0 where label is IGNORE_INDEX).

    hidden: (N, H) final hidden states; weight: (V, H) output embedding; labels: (N,) already shifted
    (labels[i] is the token that position i must predict). `tf32`: the head's matmuls in TF32 (see above).
    `transform`: the model's scaling / soft-capping of hidden @ W.T (`chattune.model.head.output_logits`).
    `bias`: (V,) the output layer's bias, where it has one: logits are hidden @ W.T + bias (added in fp32), then
    transformed; it gets its gradient like the weight (the sum over tokens of softmax - one-hot).
    `rows`: under loss-parallel, `weight` and `bias` are this rank's rows of the vocabulary
    (`chattune.parallel.vocab_parallel`), and each chunk's log-sum-exp and target logit are reduced over the group.
    """
    transform = None if transform is None or transform.is_identity else transform
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1]:
        raise ValueError(f"expected hidden (N, H) and labels (N,), got {tuple(hidden.shape)} and {tuple(labels.shape)}")
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    chunks = -(-hidden.shape[0] // chunk_size)
    # A bf16/fp16 output layer's gradient summed over the chunks in fp32 and rounded once (`SummedInFp32`);
    # upcast by each chunk, every chunk's gradient was rounded to bf16 and the chunks summed in bf16 (3x the
    # rounding of one cast over 16 chunks: tests/unit/model/head/test_chunked_loss.py).
    sums = (SummedInFp32.where_needed(weight, chunks), SummedInFp32.where_needed(bias, chunks))
    losses = []
    for start in range(0, hidden.shape[0], chunk_size):
        h, y = hidden[start : start + chunk_size], labels[start : start + chunk_size]
        if needs_grad:
            losses.append(
                checkpoint(
                    _summed_chunk_token_losses,
                    h,
                    weight,
                    y,
                    tf32,
                    transform,
                    bias,
                    rows,
                    sums,
                    use_reentrant=False,
                )
            )
        else:
            losses.append(_chunk_token_losses(h, weight, y, tf32, transform, bias, rows))
    return torch.cat(losses)


class SummedInFp32:
    """The fp32 sum of a low-precision output layer's gradient over the chunks of one loss. Each chunk upcasts the
    layer inside its checkpoint (`_Upcast`: nothing of fp32 outlives a chunk's forward); each chunk's backward adds
    its fp32 gradient into `total` in place and hands autograd nothing, and the last one hands it the sum rounded
    to the layer's dtype once. At its peak: the sum, a chunk's gradient and its upcast (12 bytes an element, the
    estimate's loss-head row)."""

    def __init__(self, chunks: int) -> None:
        self.left = chunks
        self.total: torch.Tensor | None = None

    @classmethod
    def where_needed(cls, tensor: torch.Tensor | None, chunks: int) -> SummedInFp32 | None:
        """One for a trained low-precision `tensor` (an fp32 one's chunks already sum in fp32)."""
        if tensor is None or not tensor.requires_grad or tensor.dtype == torch.float32:
            return None
        return cls(chunks)


class _Upcast(torch.autograd.Function):
    """tensor.float(), its gradient summed over the chunks in `summed` (see SummedInFp32)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, summed: SummedInFp32) -> torch.Tensor:
        ctx.summed, ctx.dtype = summed, tensor.dtype
        return tensor.float()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        summed = ctx.summed
        summed.total = grad.float().clone() if summed.total is None else summed.total.add_(grad)
        summed.left -= 1
        if summed.left > 0:
            return None, None
        total, summed.total = summed.total, None
        return total.to(ctx.dtype), None


def _summed_chunk_token_losses(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    tf32: bool,
    transform: LogitTransform | None,
    bias: torch.Tensor | None,
    rows: VocabShard | None,
    sums: tuple[SummedInFp32 | None, SummedInFp32 | None],
) -> torch.Tensor:
    """A chunk's token losses with the output layer and its bias upcast where `sums` (theirs) has a sum."""
    weight, bias = upcast_for_chunk(weight, bias, sums)
    return _chunk_token_losses(hidden, weight, labels, tf32, transform, bias, rows)


def upcast_for_chunk(
    weight: torch.Tensor, bias: torch.Tensor | None, sums: tuple[SummedInFp32 | None, SummedInFp32 | None]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output layer and its bias as one chunk uses them: through `_Upcast` where `sums` (their
    `SummedInFp32.where_needed`) has a sum, so that their gradient adds up over the chunks in fp32."""
    weight_sum, bias_sum = sums
    if weight_sum is not None:
        weight = _Upcast.apply(weight, weight_sum)
    if bias is not None and bias_sum is not None:
        bias = _Upcast.apply(bias, bias_sum)
    return weight, bias
