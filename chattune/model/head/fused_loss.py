"""The output-layer loss on CUDA: cut-cross-entropy (Apple's CCE), no logits in memory and no fp32 GEMM.

Why CCE: measured on one H100 (`profile_variants.py` in ../shared/gpu, Qwen3-0.6B shape, 16k packed
tokens, forward + backward), against our fp32 chunked head at 761 ms:
- TF32 for that head: 522 ms;
- Liger's fused linear cross-entropy: 482 ms;
- CCE: 329 ms, the fastest, with 10% less peak memory.

What its kernels do (read from the release the registry has, 25.1.1, and the repository after it):
- The forward computes logits block by block in bf16 with fp32 accumulation and never stores them; it
  returns per-token losses (`reduction="none"`), which DPO's log-probs and mixing's per-source figures need.
- The backward recomputes each block's softmax and drops (`filter_eps`) every block of (tokens × vocabulary
  entries) in which all |softmax − one-hot| are below `filter_eps`: "high" (the default of
  `linear_cross_entropy`; `cce_linear_cross_entropy`'s is "auto", the same value) is bf16's machine epsilon
  / 32 = 2.4e-4. Those entries are small, not zero: their contributions to the hidden-state and output-layer
  gradients are left out, an approximation (the vocabulary rows that only rare tokens' small probabilities
  touch lose their gradient), not a rounding bf16 would make anyway.
- The gradients of the hidden states and of the output layer are accumulated over token blocks in the
  inputs' dtype (bf16), with atomic adds, in 25.1.1: more roundings than our chunked path, which sums each
  chunk's fp32 product before one cast. Later releases (the repository's, not yet on the registry) can
  accumulate both in fp32 (`accum_e_fp32`, `accum_c_fp32`): `cce_token_losses` asks for that wherever the
  installed release has those options (`cce_options`).
- It finds the trained positions with `nonzero()`: one host sync per microbatch that our own code avoids.
- 25.1.1 takes no bias; the repository's later `linear_cross_entropy` takes `bias=` (forward and gradient).
  An output layer with a bias (Phi, GPT-J, CodeGen) passes it where the installed release takes it, and
  otherwise as extra columns of the hidden states and the weight (`_bias_as_columns`), which CCE's dot products
  add like any other term: the same logits, one weight copy of V × (H + BIAS_COLUMNS) per forward.

The tolerance against the exact fp32 chunked path, on the same bf16 inputs: `scripts/gpu_check` measures
it on CUDA (per-token losses, summed loss, output-layer gradient; BENCHMARKS.md), the tests on the CPU
through CCE's torch implementation (`tests/unit/model/head/test_fused_loss.py`).

`loss.implementation`:
- `auto`: CCE on CUDA with bf16/fp16 compute when `cut_cross_entropy` is importable (the `gpu` extra),
  otherwise `chunked`, with a warning on CUDA that says why CCE could not be used;
- `chunked`: the exact fp32 chunked path (`chattune.model.head.chunked_loss`), the CPU path and the reference;
- `cut_cross_entropy`: always CCE. On the CPU it runs CCE's torch implementation, which is how the tests
  check it against the reference.
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch

from chattune.data.documents import IGNORE_INDEX
from chattune.errors import UserError
from chattune.model.head.output_logits import LogitTransform
from chattune.parallel.vocab_parallel import VocabShard, local_targets, vocab_parallel_token_losses

logger = logging.getLogger(__name__)
# Options of later releases that accumulate the hidden-state and output-layer gradients in fp32.
FP32_ACCUMULATION_OPTIONS = ("accum_e_fp32", "accum_c_fp32")


@functools.cache
def _import_cce() -> tuple[object | None, str | None]:
    """(cut_cross_entropy's linear_cross_entropy, None), or (None, why it cannot be imported). Importing it
    also imports Triton, which can fail for other reasons than a missing package: any error is a reason."""
    try:
        from cut_cross_entropy import linear_cross_entropy
    except Exception as error:  # noqa: BLE001  (reported, never swallowed: see resolve_loss_implementation)
        return None, f"{type(error).__name__}: {error}"
    return linear_cross_entropy, None


def _linear_cross_entropy():
    return _import_cce()[0]


def cce_available() -> bool:
    return _linear_cross_entropy() is not None


def cce_options(on_cuda: bool) -> dict:
    """The keyword options of our call: CCE's kernels on CUDA, with fp32 accumulation of the gradients where
    the installed release has it (25.1.1 has not); CCE's torch implementation elsewhere, which has none of
    the kernels' options."""
    if not on_cuda:
        return {"impl": "torch_compile"}
    parameters = inspect.signature(_linear_cross_entropy()).parameters
    return {"impl": "cce", **{name: True for name in FP32_ACCUMULATION_OPTIONS if name in parameters}}


def resolve_loss_implementation(setting: str, device_type: str, compute_dtype: str, *, quiet: bool = False) -> str:
    """loss.implementation resolved to `chunked` or `cut_cross_entropy` for this device and dtype. `quiet`
    neither warns nor refuses (the memory estimate's reading of a config: the run itself warns, or refuses a
    setting it cannot take, which then reads as `chunked`)."""
    if setting == "cut_cross_entropy":
        problem = _cce_refusal(device_type, compute_dtype)
        if problem is not None and not quiet:
            raise UserError(problem)
        return "chunked" if problem is not None else setting
    if setting == "auto":
        fast = device_type == "cuda" and compute_dtype in ("bfloat16", "float16")
        if fast and not cce_available() and not quiet:
            logger.warning(
                "loss.implementation=auto: cut-cross-entropy cannot be imported (%s), so the output layer's "
                'loss is the chunked fp32 head, about twice as slow on CUDA (pip install -e ".[gpu]"; '
                "loss.implementation=chunked says it is meant)",
                _import_cce()[1],
            )
        return "cut_cross_entropy" if fast and cce_available() else "chunked"
    return setting


def _cce_refusal(device_type: str, compute_dtype: str) -> str | None:
    """Why loss.implementation=cut_cross_entropy cannot run here, or None."""
    if device_type == "cuda" and compute_dtype == "float32":
        return (
            "loss.implementation=cut_cross_entropy: its CUDA kernels take bf16 or fp16 inputs; with "
            "model.fsdp.param_dtype=float32 use loss.implementation=chunked (or auto)"
        )
    if not cce_available():
        return (
            "loss.implementation=cut_cross_entropy: the cut_cross_entropy package cannot be imported "
            f'({_import_cce()[1]}); pip install -e ".[gpu]", or pip install cut-cross-entropy'
        )
    return None


def cce_takes_bias() -> bool:
    """Whether the installed release's `linear_cross_entropy` takes the output layer's bias (`bias=`: the
    repository after 25.1.1 does; 25.1.1, the registry's newest, does not)."""
    return "bias" in inspect.signature(_linear_cross_entropy()).parameters


def describe_bias() -> str:
    """How CCE adds an output layer's bias, for the start-up `compute:` line."""
    if cce_takes_bias():
        return "the output layer's bias passed to it"
    return f"the output layer's bias as {BIAS_COLUMNS} more columns of its weight and hidden states"


# An output layer's bias is added as extra columns where the installed CCE takes no bias: hidden states get a
# column of ones (s, the logit scale) and the weight a column holding the bias, then zeros up to BIAS_COLUMNS so
# that the width stays a multiple of CCE's widest block (128) where the hidden size is one (its kernels' unmasked
# loads). Unmeasured on CUDA: the head's matmuls widen by BIAS_COLUMNS / hidden size (5% at Phi-2's 2560).
BIAS_COLUMNS = 128


def _bias_as_columns(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """[h, s, 0...] and [W, b, 0...] (in the inputs' dtype), whose product is h @ W.T + s·b: the bias enters CCE's
    logits as one more product of its fp32-accumulated dot products, and its gradient is what the extra column of
    the weight's gradient receives (the sum over tokens of softmax - one-hot, in CCE's own accumulation)."""
    ones = hidden.new_zeros(hidden.shape[0], BIAS_COLUMNS)
    ones[:, 0] = scale
    column = torch.cat([bias.to(weight.dtype).unsqueeze(1), weight.new_zeros(weight.shape[0], BIAS_COLUMNS - 1)], 1)
    return torch.cat([hidden, ones], 1), torch.cat([weight, column], 1)


def cce_token_losses(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    transform: LogitTransform | None = None,
    bias: torch.Tensor | None = None,
    rows: VocabShard | None = None,
) -> torch.Tensor:
    """Per-token cross-entropy (fp32, 0 where the label is IGNORE_INDEX) of hidden (N, H) against the
    output embedding weight (V, H), in the inputs' dtype (bf16 under FSDP's mixed precision). `rows`: under
    loss-parallel, `weight` and `bias` are this rank's rows of the vocabulary (`chattune.parallel.vocab_parallel`),
    each token's log-sum-exp over them and its target logit reduced over the group.

    `transform` (`chattune.model.head.output_logits`): CCE soft-caps natively (`softcap`); a logit scale s has no
    option of its own, so the hidden states are scaled instead ((s·h) @ W.T = s·(h @ W.T)), in fp32 and rounded
    once to the inputs' dtype: one more bf16 rounding of each hidden state than the model's own forward.
    `bias` (V,): the output layer's bias, added before the scaling and the cap as the model's forward adds it:
    passed to CCE where the installed release takes one (scaled by s), otherwise as extra columns
    (`_bias_as_columns`); either way it gets CCE's gradient."""
    if weight.dtype != hidden.dtype:  # CCE wants one dtype; FSDP hands both over in param_dtype
        weight = weight.to(hidden.dtype)
    softcap, scale = None, 1.0
    if transform is not None:
        if (
            transform.softcap is not None and transform.temperature != 1.0
        ):  # (the recipe refuses it: loss.implementation)
            raise ValueError("cut-cross-entropy cannot divide soft-capped logits by a temperature")
        divisor = transform.divisor * transform.temperature  # (no cap: a temperature scales the logits too)
        scale = transform.multiplier / divisor
        if transform.multiplier != 1.0 or divisor != 1.0:
            hidden = (hidden.float() * transform.multiplier / divisor).to(weight.dtype)
        softcap = transform.softcap
    options = cce_options(hidden.is_cuda)
    if bias is not None and cce_takes_bias():
        options["bias"] = (bias.float() * scale).to(weight.dtype) if scale != 1.0 else bias.to(weight.dtype)
    elif bias is not None:
        hidden, weight = _bias_as_columns(hidden, weight, bias, scale)
    if rows is None:
        return _linear_cross_entropy()(
            hidden, weight, labels, ignore_index=IGNORE_INDEX, reduction="none", softcap=softcap, **options
        ).float()
    # This rank's rows of a vocabulary split over tp: CCE gives log-sum-exp over them minus the logit of a row
    # of them (the target where it is here, else an anchor row); that logit, computed here as CCE's logits are
    # (the inputs' dtype, accumulated in fp32, then capped), is added back: their gradients cancel at that row.
    # The anchors are spread over the rows by position: (T-1)/T of the tokens have their target elsewhere, and
    # on one anchor row their opposite gradients (-h in CCE's bf16 accumulation, +h from the logit) would each
    # be summed over thousands of tokens in bf16 and keep that rounding (measured: 500x a row's error).
    index, here = local_targets(labels, rows)
    spread = torch.arange(labels.numel(), device=labels.device) % (rows.stop - rows.start)
    index = torch.where(here, index, spread)
    anchors = index.masked_fill(labels == IGNORE_INDEX, IGNORE_INDEX)
    relative = _linear_cross_entropy()(
        hidden, weight, anchors, ignore_index=IGNORE_INDEX, reduction="none", softcap=softcap, **options
    ).float()
    logit = (hidden.float() * weight[index].float()).sum(-1)
    if "bias" in options:
        logit = logit + options["bias"][index].float()
    if softcap is not None:
        logit = torch.tanh(logit / softcap) * softcap
    return vocab_parallel_token_losses(relative + logit, logit.masked_fill(~here, 0.0), labels, rows)
