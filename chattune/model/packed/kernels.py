"""The attention kernels on a packed row: each attends causally within every document of a row that holds several
back to back, given their boundaries (`cu_seqlens`).

`chattune.model.packed.attention` chooses one per layer (`attention_path`) and calls it; this module says how each one
computes. The per-document loops take (1, H, N, D), as transformers hands its attention functions; the varlen
kernels take (N, H, D) (`_varlen` and `_sink_varlen` turn the one into the other). All return (1, N, Hq, D). Each
takes the tensors as arguments and the call's other settings (longest document, scale, window, dropout,
soft-capping) in one `VarlenOptions`.

- `_per_document_sdpa`: causal SDPA per document (exact, simple).
- `_per_document_exact`: the same loop with the scores written out (fp32 softmax), as transformers' eager
  attention for gpt-oss and Gemma 2 computes them: attention sinks (`s_aux`: gpt-oss, a learned per-head logit
  in every query's softmax denominator, whose probability is dropped) and logit soft-capping (`softcap`: Gemma 2,
  scores become tanh(scores / cap) * cap before the mask). SDPA has neither. On CUDA it holds each document's
  (heads, L, L) fp32 scores and probabilities for the backward: fine for short documents, heavy for long ones
  (Gemma 2 without flash-attn: install it, `pip install -e ".[gpu]"`).
- `_varlen`: flash-attn's `flash_attn_varlen_func` where flash-attn is importable, soft-capping through its
  `softcap`; otherwise torch's `varlen_attn` (`torch_varlen_attn`), which has no soft-capping (those layers take
  the exact loop). A row with shared prompts (`chattune.data.packing.SharedKeys`) takes it too, with separate
  query and key offsets: each segment's keys and values are gathered as its prompt's then its own, and the
  kernels align the causal mask (and a window) bottom-right where a segment has more keys than queries, so reply
  token i sees the prompt and its own first i + 1 tokens, as after its own copy of the prompt. No GPU has run that
  yet, so it is used only where `probe_shared_varlen` saw it agree with the per-document loop on the device at
  start-up (`_shared_varlen`); elsewhere shared rows take the loops, which take the prompt's key range directly.
  Grouped-query attention (fewer kv heads than query heads) goes to torch's flash kernel as it is (the kernel
  supports it): with `enable_gqa` on torch >= 2.12; on torch 2.11, whose wrapper has no such
  flag, once `probe_native_gqa` has seen unequal head counts agree with repeated kv heads on the device at
  start-up; otherwise the kv heads are repeated first (Hq/Hkv times their memory and bandwidth).
- Neither flash kernel takes head sizes over 256 (`VARLEN_MAX_HEAD_DIM`; Gemma 4's global layers: 512), nor value
  heads of another size than the query's (multi-head latent attention): such layers take `_per_document_sdpa`
  (CUDA's efficient and cuDNN kernels do take them).
- `_sink_varlen` (`sink_varlen_attn`): attention sinks on torch's flash kernel through its custom ops
  (`torch.ops.torch_attn._varlen_attn` and `_varlen_attn_backward`, the ones `varlen_attn` wraps), whatever
  else is installed. The forward rescales the output by sigmoid(lse - sink) = exp(lse) / (exp(lse) +
  exp(sink)). The gradient must also flow through lse, and no kernel's public API gives that:
  torch's `varlen_attn(return_aux=AuxRequest(lse=True))` drops the lse's gradient in its backward (it
  returns dq, dk, dv from the output's gradient alone), and flash-attn's `return_attn_probs=True` lse is
  not differentiable either (flash-attention issues 141 and 1137). Rescaling that lse would train with
  wrong q and k gradients. So `_SinkVarlen` hands the kernel's own backward the sink-inclusive lse,
  log(exp(lse) + exp(sink)), and the rescaled output: the flash backward recomputes the probabilities
  from the lse it is given and the softmax correction from the output it is given, which is then exactly
  the backward of a softmax over the keys plus a sink of value zero; the sink's gradient is
  -sum_i exp(sink - lse_i') (dO_i . O_i). Where this torch has no such ops (`_TORCH_SINK_OPS` is None, decided
  at import), those layers take the exact loop; so do sinks together with soft-capping (no model has both).
  torch 2.11's ops have no `enable_gqa` either: there the kv heads go in as `probe_native_gqa` settled (as they
  are, or repeated, whose gradients autograd sums back).

Sliding windows follow transformers' convention (a query sees itself and the `window - 1` keys before it).
The loops over documents are left out of compiled graphs (`torch.compiler.disable`); every choice that
depends on what is installed is made here at import, outside compiled code. Two of them change after import:
`_varlen_gqa`, which `probe_native_gqa` rebinds at start-up, and `_shared_varlen` (`probe_shared_varlen`). Other
modules read these through this module (`attention_kernels._varlen_gqa`), never `from ... import` them: a copy would keep the import-time value, and a
test's monkeypatch here would not reach it.
"""

from __future__ import annotations

import inspect
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention.varlen import varlen_attn as _torch_varlen_attn

from chattune.data.packing import SharedKeys, shared_keys

logger = logging.getLogger(__name__)


def _import_flash_attn_varlen():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


# Decided once at import, outside any compiled code: under torch.compile, a failing import or an
# inspect.signature inside the attention function would be traced (a graph break in every layer).
_FLASH_ATTN_VARLEN = _import_flash_attn_varlen()
_TORCH_VARLEN_PARAMETERS = frozenset(inspect.signature(_torch_varlen_attn).parameters)
# How torch's varlen_attn is given fewer kv heads than query heads: "flag" (its enable_gqa), "native" (unequal
# head counts as they are: a wrapper without the flag, verified by `probe_native_gqa`) or "repeat".
_varlen_gqa = "flag" if "enable_gqa" in _TORCH_VARLEN_PARAMETERS else "repeat"
# Whether rows with shared prompts take `_varlen` (module docstring): False until `probe_shared_varlen` saw it agree
# with the per-document loop on the run's device.
_shared_varlen = False
_FLASH_ATTN_SOFTCAP = _FLASH_ATTN_VARLEN is not None and "softcap" in inspect.signature(_FLASH_ATTN_VARLEN).parameters
VARLEN_MAX_HEAD_DIM = 256  # the largest head size flash-attn's and torch's varlen flash kernels take
# How far `probe_shared_varlen` lets the varlen kernel's shared rows differ from the per-document loop, relative to the
# largest value: a few units of bf16's rounding (2^-8) over two kernels' summation orders.
SHARED_VARLEN_TOLERANCE = 2e-2

# The arguments `_SinkVarlen` passes torch's varlen flash ops by name (torch >= 2.11's schemas; `enable_gqa`
# too where the forward op has it, from 2.12).
_SINK_OP_ARGUMENTS = {
    "_varlen_attn": {
        "query",
        "key",
        "value",
        "cu_seq_q",
        "cu_seq_k",
        "max_q",
        "max_k",
        "is_causal",
        "scale",
        "window_size",
    },
    "_varlen_attn_backward": {
        "grad_out",
        "query",
        "key",
        "value",
        "out",
        "lse",
        "cu_seq_q",
        "cu_seq_k",
        "max_q",
        "max_k",
        "is_causal",
        "rng_state",
        "scale",
        "window_size",
    },
}


def _torch_sink_ops() -> tuple | None:
    """torch's varlen flash forward and backward ops, (out, lse, rng_state) and (dq, dk, dv), where this torch has
    them with the arguments `_SinkVarlen` passes; None otherwise (attention sinks then take the exact loop)."""
    ops = []
    for name, needed in _SINK_OP_ARGUMENTS.items():
        op = getattr(torch.ops.torch_attn, name, None)
        schema = getattr(getattr(op, "default", None), "_schema", None)
        if schema is None or len(schema.returns) != 3 or not needed <= {a.name for a in schema.arguments}:
            return None
        ops.append(op)
    return tuple(ops)


def _takes_gqa_flag(op) -> bool:
    """Whether a varlen forward op (torch's, or a test's stand-in function) has an `enable_gqa` argument."""
    schema = getattr(getattr(op, "default", None), "_schema", None)
    names = {a.name for a in schema.arguments} if schema is not None else set(inspect.signature(op).parameters)
    return "enable_gqa" in names


_TORCH_SINK_OPS = _torch_sink_ops()
_TORCH_SINK_GQA_FLAG = _TORCH_SINK_OPS is not None and _takes_gqa_flag(_TORCH_SINK_OPS[0])


# The kernels mirror torch's `varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale,
# window_size, ...)`: the tensors are arguments of their own, and the settings of one call, which always travel
# together from `chattune.model.packed.attention.packed_attention` to the kernel it picks, are one value. Frozen (hashable,
# Python scalars only): torch.compile specializes on it like on the scalars it holds, and `_SinkVarlen` takes it as
# one non-tensor input (whose gradient is None).
@dataclass(frozen=True)
class VarlenOptions:
    """One attention call's settings besides its tensors."""

    # The row's longest document: the varlen kernels' max_q and max_k (the per-document loops need none).
    max_seqlen: int | None = None
    scale: float | None = None  # of the scores; None: head_dim ** -0.5
    window: int | None = None  # sliding window: a query sees itself and the `window - 1` keys before it; None: all
    dropout: float = 0.0  # of the attention probabilities (flash-attn's kernel and the per-document loops)
    softcap: float | None = None  # Gemma 2's soft-capping of the scores (flash-attn's kernel and the exact loop)

    @property
    def window_size(self) -> tuple[int, int]:
        """The window as the varlen kernels take it: (W-1, 0) causal over the last W keys, (-1, 0) causal."""
        return (self.window - 1, 0) if self.window is not None else (-1, 0)


class _SinkOps(NamedTuple):
    """What `_SinkVarlen` runs: torch's varlen flash forward and backward ops (or a test's stand-ins), and whether the
    forward takes `enable_gqa`."""

    forward: Callable
    backward: Callable
    takes_gqa_flag: bool


def _segments(cu_seqlens, prefixes) -> list[tuple[int, int, int, int]]:
    """(start, end, prefix start, prefix length) of each segment of the row: its own tokens, and the earlier ones it
    also attends to first (shared prompts, `PackedBatch.prefixes`; length 0: none)."""
    bounds = cu_seqlens.tolist()
    spans = prefixes.tolist() if prefixes is not None else [(0, 0)] * (len(bounds) - 1)
    return [(start, end, a, n) for start, end, (a, n) in zip(bounds[:-1], bounds[1:], spans, strict=True)]


def _segment_keys(tensor: torch.Tensor, start: int, end: int, prefix_start: int, prefix: int) -> torch.Tensor:
    """A segment's keys (or values) along dim 2: its prompt's, then its own."""
    own = tensor[:, :, start:end]
    return own if not prefix else torch.cat([tensor[:, :, prefix_start : prefix_start + prefix], own], dim=2)


@torch.compiler.disable  # a loop over documents whose bounds come from the data: left out of compiled graphs
def _per_document_sdpa(query, key, value, cu_seqlens, options: VarlenOptions, prefixes=None):
    # query: (1, Hq, N, D), key/value: (1, Hkv, N, D); prefixes: shared prompts (`_segments`)
    window = options.window
    enable_gqa = query.shape[1] != key.shape[1]
    outputs = []
    for start, end, prefix_start, prefix in _segments(cu_seqlens, prefixes):
        q = query[:, :, start:end]
        k, v = (_segment_keys(t, start, end, prefix_start, prefix) for t in (key, value))
        mask = None  # causal, and only the last `window` keys where the window is shorter than the document
        if prefix or (window is not None and end - start > window):  # (SDPA's is_causal aligns top-left)
            mask = _document_mask(end - start, window, query.device, prefix)
        outputs.append(
            F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=options.dropout,
                is_causal=mask is None,
                scale=options.scale,
                enable_gqa=enable_gqa,
            )
        )
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()  # (1, N, Hq, D): some models .view() it


def _document_mask(length: int, window: int | None, device: torch.device, prefix: int = 0) -> torch.Tensor:
    """(L, prefix + L) bool, True where query i may see key j: causal, and only the last `window` keys (itself
    included). The `prefix` keys are a shared prompt standing before the segment's own: query i is at place
    prefix + i (aligned bottom-right)."""
    distance = (torch.arange(length, device=device) + prefix)[:, None] - torch.arange(prefix + length, device=device)
    return (distance >= 0) & (distance < window) if window is not None else distance >= 0


@torch.compiler.disable  # a loop over documents whose bounds come from the data: left out of compiled graphs
def _per_document_exact(query, key, value, cu_seqlens, options: VarlenOptions, sinks=None, prefixes=None):
    """Attention per document with the scores written out, as transformers' eager attention computes them:
    soft-capping (Gemma 2) is tanh(scores / cap) * cap before the mask; sinks (gpt-oss) are one more logit per
    head in every query's softmax, whose probability is dropped. Scores and softmax in fp32 (exact on fp32)."""
    # query: (1, Hq, N, D), key/value: (1, Hkv, N, D), sinks: (Hq,)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # transformers' repeat_kv: query head h reads kv head h // groups
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = options.scale if options.scale is not None else query.shape[-1] ** -0.5
    softcap, window, dropout = options.softcap, options.window, options.dropout
    outputs = []
    for start, end, prefix_start, prefix in _segments(cu_seqlens, prefixes):
        q = query[:, :, start:end].float()
        k, v = (_segment_keys(t, start, end, prefix_start, prefix).float() for t in (key, value))
        scores = torch.matmul(q, k.transpose(2, 3)) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~_document_mask(end - start, window, query.device, prefix), float("-inf"))
        if sinks is not None:
            sink = sinks.float().reshape(1, -1, 1, 1).expand(1, -1, end - start, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        if dropout:
            probs = F.dropout(probs, p=dropout)
        outputs.append(torch.matmul(probs, v).to(query.dtype))
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()  # (1, N, Hq, D): some models .view() it


def _kv_heads_for_kernel(q, k, v, takes_gqa_flag: bool, gqa: str):
    """The kv heads as a varlen kernel is to be given them: as they are where it takes `enable_gqa` or takes
    unequal head counts natively (`gqa` "native", settled by `probe_native_gqa`), else repeated to the query's."""
    if q.shape[1] == k.shape[1] or takes_gqa_flag or gqa == "native":
        return k, v
    repeats = q.shape[1] // k.shape[1]
    return k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)


def torch_varlen_attn(
    q,
    k,
    v,
    cu_seqlens,
    options: VarlenOptions,
    varlen_attn=None,
    gqa: str | None = None,
    key_bounds: tuple[torch.Tensor, int] | None = None,
):
    """torch's `varlen_attn` on (N, H, D) tensors, on the torch a machine has: torch 2.11's has no `enable_gqa`
    (grouped-query attention then passes unequal head counts as they are where `gqa` is "native", else repeats
    the kv heads). `gqa`: "native" or "repeat" for a wrapper without the flag (default: what `probe_native_gqa`
    settled). Every supported torch (>= 2.11) takes `scale` and `window_size`, and none takes dropout or
    soft-capping (`_varlen` and `attention_path` send no such call here). `key_bounds`: the keys' own (cu_seqlens_k,
    max_k) where they differ from the queries' (shared prompts)."""
    if varlen_attn is None:
        varlen_attn, parameters = _torch_varlen_attn, _TORCH_VARLEN_PARAMETERS
    else:  # a stand-in (tests, the probe)
        parameters = inspect.signature(varlen_attn).parameters
    takes_gqa_flag = "enable_gqa" in parameters
    extra = {"enable_gqa": True} if takes_gqa_flag and q.shape[1] != k.shape[1] else {}
    k, v = _kv_heads_for_kernel(q, k, v, takes_gqa_flag, gqa or _varlen_gqa)
    max_seqlen = options.max_seqlen
    cu_seqlens_k, max_seqlen_k = key_bounds if key_bounds is not None else (cu_seqlens, max_seqlen)
    return varlen_attn(
        q,
        k,
        v,
        cu_seqlens,
        cu_seqlens_k,
        max_seqlen,
        max_seqlen_k,
        scale=options.scale,
        window_size=options.window_size,
        **extra,
    )


def probe_native_gqa(device: torch.device, varlen_attn=None) -> str:
    """Settle how torch's varlen_attn takes grouped-query attention on `device` ("flag", "native" or "repeat",
    see the module docstring), once, before anything is compiled. A wrapper without `enable_gqa` is tried on
    a small case with unequal head counts, forward and backward; it is used so only where it runs and agrees
    with repeated kv heads."""
    global _varlen_gqa
    parameters = _TORCH_VARLEN_PARAMETERS if varlen_attn is None else inspect.signature(varlen_attn).parameters
    if "enable_gqa" in parameters:
        return "flag"
    if varlen_attn is None and (device.type != "cuda" or _FLASH_ATTN_VARLEN is not None):
        return _varlen_gqa  # the kernel is CUDA's, and with flash-attn installed it is not used
    generator = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    inputs = [torch.randn(48, heads, 64, generator=generator, device=device, dtype=dtype) for heads in (4, 2, 2)]
    cu_seqlens = torch.tensor([0, 17, 48], dtype=torch.int32, device=device)

    def run(gqa: str) -> list[torch.Tensor]:
        q, k, v = (t.clone().requires_grad_() for t in inputs)
        out = torch_varlen_attn(q, k, v, cu_seqlens, VarlenOptions(max_seqlen=31), varlen_attn=varlen_attn, gqa=gqa)
        out.float().square().sum().backward()
        return [out.detach().float(), *(t.grad.float() for t in (q, k, v))]

    try:
        native = run("native")
    except (RuntimeError, ValueError, AssertionError) as error:  # the wrapper or kernel refuses unequal heads
        logger.info("torch varlen_attn takes no unequal head counts here (%s): kv heads are repeated", error)
        native = None
    repeated = run("repeat")
    agree = native is not None and all(torch.allclose(a, b, rtol=2e-2, atol=2e-2) for a, b in zip(native, repeated))
    if native is not None and not agree:
        logger.warning("torch varlen_attn with unequal head counts disagrees with repeated kv heads: repeating them")
    if varlen_attn is None:
        _varlen_gqa = "native" if agree else "repeat"
    return "native" if agree else "repeat"


# The shared-prompt probe's row: a plain segment, a prompt with a first reply, and two replies continuing that prompt
# less its last token (as `chattune.data.packing` lays a group out); a window shorter than the prompt in one case.
_SHARED_PROBE_SEGMENTS = (9, 19, 10, 6)
_SHARED_PROBE_PREFIXES = ((0, 0), (0, 0), (9, 11), (9, 11))
_SHARED_PROBE_WINDOWS = (None, 5)


def probe_shared_varlen(device: torch.device) -> bool:
    """Settle, once at start-up, whether rows with shared prompts take `_varlen` with their `SharedKeys` on `device`
    (module docstring): the probe's row (`_SHARED_PROBE_SEGMENTS`, grouped-query heads, causal and windowed) through
    `_varlen` and through `_per_document_sdpa` with the prompts' key ranges, outputs and the gradients of q, k and v;
    used only where it runs and agrees (within bf16's rounding; a kernel aligning the mask top-left misses most of
    each prompt and differs by far more). Returns what it settled."""
    global _shared_varlen
    generator = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokens = sum(_SHARED_PROBE_SEGMENTS)
    inputs = [torch.randn(1, heads, tokens, 64, generator=generator, device=device, dtype=dtype) for heads in (4, 2, 2)]
    upstream = torch.randn(1, tokens, 4, 64, generator=generator, device=device, dtype=dtype)
    cu_seqlens = torch.tensor([0, *itertools.accumulate(_SHARED_PROBE_SEGMENTS)], dtype=torch.int32)
    prefixes = torch.tensor(_SHARED_PROBE_PREFIXES, dtype=torch.int64)
    keys = shared_keys(cu_seqlens, prefixes)
    keys = SharedKeys(keys.index.to(device), keys.cu_seqlens_k.to(device), keys.max_k)

    def run(varlen: bool, options: VarlenOptions) -> list[torch.Tensor]:
        q, k, v = (t.clone().requires_grad_() for t in inputs)
        if varlen:
            out = _varlen(q, k, v, cu_seqlens.to(device), options, keys)
        else:
            out = _per_document_sdpa(q, k, v, cu_seqlens, options, prefixes)
        (out.float() * upstream.float()).sum().backward()
        return [out.detach().float(), *(t.grad.float() for t in (q, k, v))]

    worst = 0.0
    try:
        for window in _SHARED_PROBE_WINDOWS:
            options = VarlenOptions(max(_SHARED_PROBE_SEGMENTS), scale=0.125, window=window)
            for a, b in zip(run(True, options), run(False, options), strict=True):
                worst = max(worst, float((a - b).abs().max() / b.abs().max().clamp_min(1e-6)))
    except (RuntimeError, ValueError, AssertionError, TypeError) as error:  # a kernel that refuses the call
        logger.warning(
            "rows with shared prompts take the per-document loop: the varlen kernel failed on them (%s)", error
        )
        _shared_varlen = False
        return False
    _shared_varlen = worst <= SHARED_VARLEN_TOLERANCE
    if _shared_varlen:
        logger.info("rows with shared prompts take the varlen kernel (it agrees with the per-document loop here)")
    else:
        logger.warning(
            "rows with shared prompts take the per-document loop: the varlen kernel differs from it by up to %.2e "
            "of the largest value here (limit %.0e)",
            worst,
            SHARED_VARLEN_TOLERANCE,
        )
    return _shared_varlen


class _SinkVarlen(torch.autograd.Function):
    """Attention with sinks on torch's varlen flash kernel (module docstring): the output rescaled by
    sigmoid(lse - sink), and the kernel's backward handed the sink-inclusive lse and the rescaled output."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, cu_seqlens, options: VarlenOptions, ops: _SinkOps):
        max_seqlen, window_size = options.max_seqlen, options.window_size
        is_causal = window_size == (-1, 0)  # as varlen_attn tells the op
        extra = {"enable_gqa": q.shape[1] != k.shape[1]} if ops.takes_gqa_flag else {}
        out, lse, rng_state = ops.forward(
            query=q,
            key=k,
            value=v,
            cu_seq_q=cu_seqlens,
            cu_seq_k=cu_seqlens,
            max_q=max_seqlen,
            max_k=max_seqlen,
            is_causal=is_causal,
            scale=options.scale,
            window_size=list(window_size),
            **extra,
        )
        if tuple(lse.shape) != (q.shape[1], q.shape[0]):  # the layout the rescaling below is written for
            raise RuntimeError(
                f"torch's varlen flash kernel returned an lse of shape {tuple(lse.shape)}, not "
                f"(heads, tokens) = {(q.shape[1], q.shape[0])}: attention sinks cannot use it"
            )
        sink = sinks.float()[:, None]
        lse_with_sink = torch.logaddexp(lse, sink)  # (H, N), the kernel's lse layout
        rescaled = out * torch.sigmoid(lse - sink).transpose(0, 1).unsqueeze(-1)
        # No `.to` where the dtype is already right: torch 2.11's dynamo, given that no-op alias as the Function's
        # output, traced zero gradients for every input (tests/unit/model/packed/test_attention_features.py, compiled in one graph).
        out = rescaled if rescaled.dtype == out.dtype else rescaled.to(out.dtype)
        ctx.save_for_backward(q, k, v, out, lse_with_sink, sinks, cu_seqlens, rng_state)
        ctx.arguments = (max_seqlen, is_causal, options.scale, list(window_size), ops.backward)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse_with_sink, sinks, cu_seqlens, rng_state = ctx.saved_tensors
        max_seqlen, is_causal, scale, window_size, backward_op = ctx.arguments
        grad_out = grad_out.contiguous()
        # The kernel recomputes the probabilities as exp(score - lse) and subtracts rowsum(dO * O): with the
        # sink-inclusive lse and the rescaled output that is the backward of the softmax with the sink in it.
        dq, dk, dv = backward_op(
            grad_out=grad_out,
            query=q,
            key=k,
            value=v,
            out=out,
            lse=lse_with_sink,
            cu_seq_q=cu_seqlens,
            cu_seq_k=cu_seqlens,
            max_q=max_seqlen,
            max_k=max_seqlen,
            is_causal=is_causal,
            rng_state=rng_state,
            scale=scale,
            window_size=window_size,
        )
        dsinks = None
        if ctx.needs_input_grad[3]:  # d sink = -sum_i P(sink)_i (dO_i . O_i), P(sink)_i = exp(sink - lse_i)
            delta = (grad_out.float() * out.float()).sum(-1).transpose(0, 1)  # (H, N)
            sink_probs = torch.exp(sinks.float()[:, None] - lse_with_sink)
            dsinks = -(sink_probs * delta).sum(1).to(sinks.dtype)
        return dq, dk, dv, dsinks, None, None, None  # nothing for cu_seqlens, options and ops


def sink_varlen_attn(q, k, v, sinks, cu_seqlens, options: VarlenOptions, ops=None) -> torch.Tensor:
    """Attention with sinks on (N, H, D) tensors through torch's varlen flash kernel (`_SinkVarlen`); `sinks`: (Hq,).
    No dropout or soft-capping (`_sink_varlen` and `attention_path` send no such call here). `ops`: stand-ins for
    torch's (forward, backward) ops (tests)."""
    # torch's ops' flag is read at import (no signature inspection under torch.compile); stand-ins run eagerly
    ops, gqa_flag = (_TORCH_SINK_OPS, _TORCH_SINK_GQA_FLAG) if ops is None else (ops, _takes_gqa_flag(ops[0]))
    k, v = _kv_heads_for_kernel(q, k, v, gqa_flag, _varlen_gqa)  # torch 2.11's ops have no enable_gqa
    return _SinkVarlen.apply(q, k, v, sinks, cu_seqlens, options, _SinkOps(ops[0], ops[1], gqa_flag))


def _varlen(query, key, value, cu_seqlens, options: VarlenOptions, keys: SharedKeys | None = None):
    # varlen kernels take (N, H, D); window (W-1, 0) = causal over the last W keys, as transformers does
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    max_seqlen, softcap = options.max_seqlen, options.softcap
    cu_seqlens_k, max_seqlen_k = cu_seqlens, max_seqlen
    if keys is not None:  # shared prompts: each segment's keys are its prompt's, then its own (bottom-right causal)
        k, v = k.index_select(0, keys.index), v.index_select(0, keys.index)
        cu_seqlens_k, max_seqlen_k = keys.cu_seqlens_k, keys.max_k
    if _FLASH_ATTN_VARLEN is not None:
        extra = {"softcap": softcap} if softcap is not None else {}  # attention_path: only where it takes softcap
        out = _FLASH_ATTN_VARLEN(
            q,
            k,
            v,
            cu_seqlens,
            cu_seqlens_k,
            max_seqlen,
            max_seqlen_k,
            dropout_p=options.dropout,
            softmax_scale=options.scale,
            causal=True,
            window_size=options.window_size,
            **extra,
        )
    else:
        if options.dropout:
            raise ValueError("torch varlen_attn has no dropout; set attention_dropout=0 or install flash-attn")
        out = torch_varlen_attn(q, k, v, cu_seqlens, options, key_bounds=(cu_seqlens_k, max_seqlen_k))
    return out.unsqueeze(0)  # (1, N, Hq, D)


def _sink_varlen(query, key, value, sinks, cu_seqlens, options: VarlenOptions):
    if options.dropout:
        raise ValueError("torch's varlen flash kernel (attention sinks) has no dropout; set attention_dropout=0")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    return sink_varlen_attn(q, k, v, sinks, cu_seqlens, options).unsqueeze(0)
