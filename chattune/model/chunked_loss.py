"""Cross-entropy from final hidden states, in chunks, so a microbatch's full-vocabulary fp32 logits
never exist at once (at a 152k vocabulary, 8k tokens of fp32 logits alone are 5 GB).

Each chunk is computed under non-reentrant activation checkpointing: the forward keeps only the chunk's
hidden states and labels, and the backward recomputes that chunk's logits, one chunk at a time.
Returning per-token losses (not only their sum) keeps the function general: SFT sums them, DPO turns
them into per-sequence log-probabilities.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from chattune.data.documents import IGNORE_INDEX


def _chunk_token_losses(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # Upcast before the matmul: a bf16 matmul rounds every logit to 8 significant bits (0.125 at 20)
    # before the loss sees it. bf16 -> fp32 is exact, and so is TF32 on CUDA for bf16-valued inputs.
    logits = hidden.float() @ weight.float().t()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")


def chunked_token_losses(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int
) -> torch.Tensor:
    """Per-token cross-entropy (fp32, 0 where label is IGNORE_INDEX).

    hidden: (N, H) final hidden states; weight: (V, H) output embedding; labels: (N,) already shifted
    (labels[i] is the token that position i must predict).
    """
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1]:
        raise ValueError(f"expected hidden (N, H) and labels (N,), got {tuple(hidden.shape)} and {tuple(labels.shape)}")
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    losses = []
    for start in range(0, hidden.shape[0], chunk_size):
        h, y = hidden[start : start + chunk_size], labels[start : start + chunk_size]
        if needs_grad:
            losses.append(checkpoint(_chunk_token_losses, h, weight, y, use_reentrant=False))
        else:
            losses.append(_chunk_token_losses(h, weight, y))
    return torch.cat(losses)
