"""The output-layer loss on CUDA: cut-cross-entropy (Apple's CCE), no logits in memory and no fp32 GEMM.

Why CCE: measured on one H100 (`profile_variants.py` in ../shared/gpu, Qwen3-0.6B shape, 16k packed
tokens, forward + backward), against our fp32 chunked head at 761 ms:
- TF32 for that head: 522 ms;
- Liger's fused linear cross-entropy: 482 ms;
- CCE: 329 ms, the fastest, with 10% less peak memory.

Its kernels compute logits block by block in bf16 with fp32 accumulation and never store them. They
return per-token losses (`reduction="none"`), which DPO's log-probs and mixing's per-source figures need.
Its gradient filtering (`filter_eps="high"`, the library's default) skips logit blocks whose softmax is
below bf16 resolution, so their gradient contribution is invisible in bf16 anyway. It finds the trained
positions with `nonzero()`, one host sync per microbatch that our own code avoids.

`loss.implementation`:
- `auto`: CCE on CUDA with bf16/fp16 compute when `cut_cross_entropy` is importable (the `gpu` extra),
  otherwise `chunked`;
- `chunked`: the exact fp32 chunked path (`chattune.model.chunked_loss`), the CPU path and the reference;
- `cut_cross_entropy`: always CCE. On the CPU it runs CCE's torch implementation, which is how the tests
  check it against the reference.
"""

from __future__ import annotations

import functools

import torch

from chattune.data.documents import IGNORE_INDEX
from chattune.errors import UserError


@functools.cache
def _linear_cross_entropy():
    try:
        from cut_cross_entropy import linear_cross_entropy
    except ImportError:
        return None
    return linear_cross_entropy


def cce_available() -> bool:
    return _linear_cross_entropy() is not None


def resolve_loss_implementation(setting: str, device_type: str, compute_dtype: str) -> str:
    """loss.implementation resolved to `chunked` or `cut_cross_entropy` for this device and dtype."""
    if setting == "cut_cross_entropy":
        if device_type == "cuda" and compute_dtype == "float32":
            raise UserError("loss.implementation=cut_cross_entropy: its CUDA kernels take bf16 or fp16 inputs; with "
                            "model.fsdp.param_dtype=float32 use loss.implementation=chunked (or auto)")
        if not cce_available():
            raise UserError("loss.implementation=cut_cross_entropy: the cut_cross_entropy package is not installed "
                            "(pip install -e \".[gpu]\", or pip install cut-cross-entropy)")
        return setting
    if setting == "auto":
        fast = device_type == "cuda" and compute_dtype in ("bfloat16", "float16")
        return "cut_cross_entropy" if fast and cce_available() else "chunked"
    return setting


def cce_token_losses(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy (fp32, 0 where the label is IGNORE_INDEX) of hidden (N, H) against the
    output embedding weight (V, H), in the inputs' dtype (bf16 under FSDP's mixed precision)."""
    if weight.dtype != hidden.dtype:  # CCE wants one dtype; FSDP hands both over in param_dtype
        weight = weight.to(hidden.dtype)
    impl = "cce" if hidden.is_cuda else "torch_compile"
    return _linear_cross_entropy()(hidden, weight, labels, ignore_index=IGNORE_INDEX, reduction="none",
                                   impl=impl).float()
