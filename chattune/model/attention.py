"""One attention function for packed, padding-free batches, registered with transformers.

A packed microbatch is a single row (1, N) holding several documents back to back. Causal attention
over the row would let a document attend to the ones before it, so attention must run per document.
The collator passes `cu_seq_lens_q`/`max_length_q` (transformers' flash-attention kwarg names, which
the models forward untouched to the attention function); we fall back to deriving them from
`position_ids` (which restart at 0 per document) only when they are missing.

The path is chosen per layer (`attention_path`), from the device, the dtype, the layer's head size and
whether it has attention sinks (`s_aux`: gpt-oss, a learned per-head logit in every query's softmax
denominator, whose probability is dropped) or logit soft-capping (`softcap`: Gemma 2, scores become
tanh(scores / cap) * cap before the mask):

- CPU (and fp32 on CUDA): causal SDPA per document (exact, simple; CPU runs are small). Layers with sinks
  or soft-capping: the same loop over documents with the scores written out (`_per_document_exact`, fp32
  softmax), as transformers' eager attention for gpt-oss and Gemma 2 computes them. SDPA has neither.
- CUDA bf16/fp16 with flash-attn importable: `flash_attn_varlen_func`; soft-capping through its `softcap`.
- CUDA bf16/fp16 otherwise: torch's `varlen_attn`. Grouped-query attention (fewer kv heads than query
  heads) goes to the flash kernel as it is (the kernel supports it): with `enable_gqa` on torch >= 2.13;
  on an older torch, whose wrapper has no such flag, once `probe_native_gqa` has seen unequal head counts
  agree with repeated kv heads on the device at start-up; otherwise the kv heads are repeated first (Hq/Hkv
  times their memory and bandwidth). It has no soft-capping: those layers take the exact per-document loop.
- CUDA bf16/fp16, head sizes over 256 (Gemma 4's global layers: 512): neither flash kernel takes them, so
  those layers take per-document SDPA (CUDA's efficient and cuDNN kernels do), the others stay on varlen.
  So do value heads of another size than the query's (multi-head latent attention), which they do not take.
- CUDA bf16/fp16, attention sinks: torch's flash kernel through its custom ops
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
  -sum_i exp(sink - lse_i') (dO_i . O_i). Where this torch has no such ops (decided at import), those layers
  take the exact per-document loop. Sinks together with soft-capping (no model has both): the exact loop.

The exact loop on CUDA holds each document's (heads, L, L) fp32 scores and probabilities for the backward:
fine for short documents, heavy for long ones (Gemma 2 without flash-attn: install it, `pip install -e ".[gpu]"`).

`attention_backend` names the path a run takes (the builder logs it at start-up), per layer where the
layers differ (`attention_features` reads what it needs from the model).

Generation (a prompt, then one token at a time against a KV cache) is not a packed row: `stock_attention`
gives the model transformers' SDPA attention for its duration (`chattune.model.generate`).

With context parallelism (`chattune.model.context_parallel`) each rank holds a slice of the row: an all-to-all
gives every rank the whole row for a share of the heads before the same kernels run (with those heads'
sinks), and another swaps back.

Sliding windows follow transformers' convention (a query sees itself and the `window - 1` keys before it).
The loops over documents are left out of compiled graphs (`torch.compiler.disable`); every choice that
depends on what is installed is made at import, outside compiled code.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.varlen import varlen_attn as _torch_varlen_attn
from transformers import AttentionInterface, PreTrainedModel

from chattune.data.packing import PackedBatch
from chattune.errors import UnsupportedModel
from chattune.model.context_parallel import active_group, heads_to_sequence, sequence_to_heads
from chattune.model.mixers import isolate_documents

ATTENTION_NAME = "chattune_packed"
logger = logging.getLogger(__name__)


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Document boundaries of a packed row whose position ids restart at 0 per document."""
    positions = position_ids.reshape(-1)
    starts = torch.nonzero(positions == 0).reshape(-1)
    total = torch.tensor([positions.numel()], device=positions.device)
    cu_seqlens = torch.cat([starts, total]).to(torch.int32)
    return cu_seqlens, int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


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
_FLASH_ATTN_SOFTCAP = _FLASH_ATTN_VARLEN is not None and "softcap" in inspect.signature(_FLASH_ATTN_VARLEN).parameters
VARLEN_MAX_HEAD_DIM = 256  # the largest head size flash-attn's and torch's varlen flash kernels take

# The arguments `_SinkVarlen` passes torch's varlen flash ops by name (torch >= 2.13's schemas).
_SINK_OP_ARGUMENTS = {
    "_varlen_attn": {"query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "is_causal", "scale",
                     "window_size", "enable_gqa"},
    "_varlen_attn_backward": {"grad_out", "query", "key", "value", "out", "lse", "cu_seq_q", "cu_seq_k", "max_q",
                              "max_k", "is_causal", "rng_state", "scale", "window_size"},
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


_TORCH_SINK_OPS = _torch_sink_ops()

# The paths a layer's attention takes (`attention_path`).
VARLEN, SINK_VARLEN, SDPA, EXACT = "varlen", "sink varlen", "per-document sdpa", "per-document exact"


@torch.compiler.disable  # a loop over documents whose bounds come from the data: left out of compiled graphs
def _per_document_sdpa(query, key, value, cu_seqlens, scaling, dropout, window):
    # query: (1, Hq, N, D), key/value: (1, Hkv, N, D)
    enable_gqa = query.shape[1] != key.shape[1]
    bounds = cu_seqlens.tolist()
    outputs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        q, k, v = query[:, :, start:end], key[:, :, start:end], value[:, :, start:end]
        mask = None  # causal, and only the last `window` keys where the window is shorter than the document
        if window is not None and end - start > window:
            mask = _document_mask(end - start, window, query.device)
        outputs.append(F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None, scale=scaling, enable_gqa=enable_gqa,
        ))
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()  # (1, N, Hq, D): some models .view() it


def _document_mask(length: int, window: int | None, device: torch.device) -> torch.Tensor:
    """(L, L) bool, True where query i may see key j: causal, and only the last `window` keys (itself included)."""
    positions = torch.arange(length, device=device)
    distance = positions[:, None] - positions[None, :]
    return (distance >= 0) & (distance < window) if window is not None else distance >= 0


@torch.compiler.disable  # a loop over documents whose bounds come from the data: left out of compiled graphs
def _per_document_exact(query, key, value, cu_seqlens, scaling, dropout, window, softcap=None, sinks=None):
    """Attention per document with the scores written out, as transformers' eager attention computes them:
    soft-capping (Gemma 2) is tanh(scores / cap) * cap before the mask; sinks (gpt-oss) are one more logit per
    head in every query's softmax, whose probability is dropped. Scores and softmax in fp32 (exact on fp32)."""
    # query: (1, Hq, N, D), key/value: (1, Hkv, N, D), sinks: (Hq,)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # transformers' repeat_kv: query head h reads kv head h // groups
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    bounds = cu_seqlens.tolist()
    outputs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        q, k, v = (t[:, :, start:end].float() for t in (query, key, value))
        scores = torch.matmul(q, k.transpose(2, 3)) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~_document_mask(end - start, window, query.device), float("-inf"))
        if sinks is not None:
            sink = sinks.float().reshape(1, -1, 1, 1).expand(1, -1, end - start, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        if dropout:
            probs = F.dropout(probs, p=dropout)
        outputs.append(torch.matmul(probs, v).to(query.dtype))
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()  # (1, N, Hq, D): some models .view() it


def torch_varlen_attn(q, k, v, cu_seqlens, max_seqlen, scaling, window_size, varlen_attn=None, gqa: str | None = None):
    """torch's `varlen_attn` on (N, H, D) tensors, on the torch a machine has: before 2.13 it has no
    `enable_gqa` (grouped-query attention then passes unequal head counts as they are where `gqa` is
    "native", else repeats the kv heads) and, in some versions, no `window_size` (then only plain causal
    attention, `is_causal`). `gqa`: "native" or "repeat" for a wrapper without the flag (default: what
    `probe_native_gqa` settled)."""
    if varlen_attn is None:
        varlen_attn, parameters = _torch_varlen_attn, _TORCH_VARLEN_PARAMETERS
    else:  # a stand-in (tests, the probe)
        parameters = inspect.signature(varlen_attn).parameters
    extra = {}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in parameters:
            extra["enable_gqa"] = True
        elif (gqa or _varlen_gqa) != "native":
            repeats = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    if "window_size" in parameters:
        extra["window_size"] = window_size
    elif tuple(window_size) != (-1, 0):
        raise UnsupportedModel(f"this torch's varlen_attn cannot apply a sliding window {window_size}: install "
                               "flash-attn (pip install -e \".[gpu]\") or torch>=2.13")
    elif "is_causal" in parameters:
        extra["is_causal"] = True
    else:
        raise UnsupportedModel("this torch's varlen_attn has no causal masking: install flash-attn or torch>=2.13")
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scaling, **extra)


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
        out = torch_varlen_attn(q, k, v, cu_seqlens, 31, None, (-1, 0), varlen_attn=varlen_attn, gqa=gqa)
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


class _SinkVarlen(torch.autograd.Function):
    """Attention with sinks on torch's varlen flash kernel (module docstring): the output rescaled by
    sigmoid(lse - sink), and the kernel's backward handed the sink-inclusive lse and the rescaled output."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, cu_seqlens, max_seqlen, scale, window_size, ops):
        forward_op, backward_op = ops if ops is not None else _TORCH_SINK_OPS
        is_causal = tuple(window_size) == (-1, 0)  # as varlen_attn tells the op
        out, lse, rng_state = forward_op(
            query=q, key=k, value=v, cu_seq_q=cu_seqlens, cu_seq_k=cu_seqlens, max_q=max_seqlen, max_k=max_seqlen,
            is_causal=is_causal, scale=scale, window_size=list(window_size), enable_gqa=q.shape[1] != k.shape[1])
        if tuple(lse.shape) != (q.shape[1], q.shape[0]):  # the layout the rescaling below is written for
            raise RuntimeError(f"torch's varlen flash kernel returned an lse of shape {tuple(lse.shape)}, not "
                               f"(heads, tokens) = {(q.shape[1], q.shape[0])}: attention sinks cannot use it")
        sink = sinks.float()[:, None]
        lse_with_sink = torch.logaddexp(lse, sink)  # (H, N), the kernel's lse layout
        out = (out * torch.sigmoid(lse - sink).transpose(0, 1).unsqueeze(-1)).to(out.dtype)
        ctx.save_for_backward(q, k, v, out, lse_with_sink, sinks, cu_seqlens, rng_state)
        ctx.arguments = (max_seqlen, is_causal, scale, list(window_size), backward_op)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse_with_sink, sinks, cu_seqlens, rng_state = ctx.saved_tensors
        max_seqlen, is_causal, scale, window_size, backward_op = ctx.arguments
        grad_out = grad_out.contiguous()
        # The kernel recomputes the probabilities as exp(score - lse) and subtracts rowsum(dO * O): with the
        # sink-inclusive lse and the rescaled output that is the backward of the softmax with the sink in it.
        dq, dk, dv = backward_op(
            grad_out=grad_out, query=q, key=k, value=v, out=out, lse=lse_with_sink, cu_seq_q=cu_seqlens,
            cu_seq_k=cu_seqlens, max_q=max_seqlen, max_k=max_seqlen, is_causal=is_causal, rng_state=rng_state,
            scale=scale, window_size=window_size)
        dsinks = None
        if ctx.needs_input_grad[3]:  # d sink = -sum_i P(sink)_i (dO_i . O_i), P(sink)_i = exp(sink - lse_i)
            delta = (grad_out.float() * out.float()).sum(-1).transpose(0, 1)  # (H, N)
            sink_probs = torch.exp(sinks.float()[:, None] - lse_with_sink)
            dsinks = -(sink_probs * delta).sum(1).to(sinks.dtype)
        return dq, dk, dv, dsinks, None, None, None, None, None


def sink_varlen_attn(q, k, v, sinks, cu_seqlens, max_seqlen, scaling, window_size, ops=None) -> torch.Tensor:
    """Attention with sinks on (N, H, D) tensors through torch's varlen flash kernel (`_SinkVarlen`); `sinks`: (Hq,).
    `ops`: stand-ins for torch's (forward, backward) ops (tests)."""
    return _SinkVarlen.apply(q, k, v, sinks, cu_seqlens, max_seqlen, scaling, tuple(window_size), ops)


def _half(dtype: torch.dtype | str) -> bool:
    return dtype in (torch.bfloat16, torch.float16, "bfloat16", "float16")


def attention_path(device_type: str, dtype: torch.dtype | str, head_dim: int, *, sinks: bool = False,
                   softcap: bool = False, value_head_dim: int | None = None) -> str:
    """The path one layer's attention takes (VARLEN, SINK_VARLEN, SDPA or EXACT; module docstring): the varlen
    kernels only on CUDA in bf16/fp16 and for head sizes they take; sinks and soft-capping where a kernel
    computes them, else the exact per-document loop."""
    special = sinks or softcap
    if device_type != "cuda" or not _half(dtype):
        return EXACT if special else SDPA
    if head_dim > VARLEN_MAX_HEAD_DIM or value_head_dim not in (None, head_dim):  # neither flash kernel takes it
        return EXACT if special else SDPA
    if sinks:
        return SINK_VARLEN if _TORCH_SINK_OPS is not None and not softcap else EXACT
    if softcap:
        return VARLEN if _FLASH_ATTN_SOFTCAP else EXACT
    return VARLEN


def _path_name(path: str) -> str:
    if path == VARLEN:
        if _FLASH_ATTN_VARLEN is not None:
            return "flash-attn varlen"
        gqa = {"flag": "native (enable_gqa)", "native": "native", "repeat": "by repeated kv heads"}[_varlen_gqa]
        return f"torch varlen_attn (grouped-query attention {gqa})"
    if path == SINK_VARLEN:
        return "torch varlen flash kernel, output times sigmoid(lse - sink), backward through the sink-inclusive lse"
    if path == SDPA:
        return "per-document SDPA (a loop over documents, outside compiled graphs)"
    return ("per-document exact attention (scores written out, fp32 softmax; a loop over documents, "
            "outside compiled graphs)")


@dataclass(frozen=True)
class AttentionLayer:
    """What decides one attention layer's path (`attention_path`)."""

    head_dim: int
    sinks: bool = False
    softcap: bool = False
    value_head_dim: int | None = None  # where it differs from head_dim (multi-head latent attention)

    @property
    def description(self) -> str:
        """What sets the layer apart ("" for a plain one)."""
        parts = [f"head size {self.head_dim}"] if self.head_dim > VARLEN_MAX_HEAD_DIM else []
        if self.value_head_dim not in (None, self.head_dim):
            parts.append(f"value head size {self.value_head_dim}")
        parts += ["attention sinks"] * self.sinks + ["soft-capping"] * self.softcap
        return " and ".join(parts)


@functools.cache
def _calls_attention_interface(cls: type) -> bool:
    """Whether a module class's forward calls transformers' attention interface (so reaches `packed_attention`)."""
    forward = getattr(cls, "forward", None)
    if forward is None or forward is torch.nn.Module.forward:
        return False
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):  # no source to read (built in, or compiled): not one of transformers' modules
        return False
    return "ALL_ATTENTION_FUNCTIONS" in source


def attention_features(hf_model: torch.nn.Module) -> tuple[AttentionLayer, ...]:
    """Each attention layer's head size, sinks and soft-capping, in module order, for `attention_backend`.
    Attention layers: the modules whose forward calls transformers' attention interface."""
    layers = []
    for module in hf_model.modules():
        if not _calls_attention_interface(type(module)):
            continue
        head_dim = getattr(module, "head_dim", None) or getattr(module, "qk_head_dim", None)
        if not isinstance(head_dim, int):
            continue
        value_head_dim = getattr(module, "v_head_dim", None)
        layers.append(AttentionLayer(head_dim=head_dim, sinks=isinstance(getattr(module, "sinks", None), torch.Tensor),
                                     softcap=bool(getattr(module, "attn_logit_softcapping", None)),
                                     value_head_dim=value_head_dim if isinstance(value_head_dim, int) else None))
    return tuple(layers)


def _layers_with(descriptions: set[str]) -> str:
    return ", ".join(sorted(descriptions))


def attention_backend(device_type: str, compute_dtype: str, layers: Sequence[AttentionLayer] | None = None) -> str:
    """The attention path packed rows take on this device and compute dtype, for the start-up log; given the
    model's attention layers (`attention_features`), the path of each group of layers whose paths differ."""
    if not layers:
        return _path_name(attention_path(device_type, compute_dtype, 0))
    groups: dict[str, list[AttentionLayer]] = {}
    for layer in layers:
        path = attention_path(device_type, compute_dtype, layer.head_dim, sinks=layer.sinks, softcap=layer.softcap,
                              value_head_dim=layer.value_head_dim)
        groups.setdefault(path, []).append(layer)
    parts = []
    for rank, (path, members) in enumerate(sorted(groups.items(), key=lambda item: -len(item[1]))):
        described = {layer.description for layer in members}
        count = f"all {len(members)}" if len(members) == len(layers) > 1 else str(len(members))
        noun = "layer" if len(members) == 1 else "layers"
        if "" not in described:
            parts.append(f"{count} {noun} with {_layers_with(described)}: {_path_name(path)}")
        elif rank == 0:  # the main path, plain layers among its own
            parts.append(_path_name(path))
        else:
            parts.append(f"{count} {noun}: {_path_name(path)}")
    return "; ".join(parts)


def _varlen(query, key, value, cu_seqlens, max_seqlen, scaling, dropout, window, softcap=None):
    # varlen kernels take (N, H, D); window (W-1, 0) = causal over the last W keys, as transformers does
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    window_size = (window - 1, 0) if window is not None else (-1, 0)
    if _FLASH_ATTN_VARLEN is not None:
        extra = {"softcap": softcap} if softcap is not None else {}  # attention_path: only where it takes softcap
        out = _FLASH_ATTN_VARLEN(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
            dropout_p=dropout, softmax_scale=scaling, causal=True, window_size=window_size, **extra,
        )
    else:
        if dropout:
            raise ValueError("torch varlen_attn has no dropout; set attention_dropout=0 or install flash-attn")
        out = torch_varlen_attn(q, k, v, cu_seqlens, max_seqlen, scaling, window_size)
    return out.unsqueeze(0)  # (1, N, Hq, D)


def _sink_varlen(query, key, value, sinks, cu_seqlens, max_seqlen, scaling, dropout, window):
    if dropout:
        raise ValueError("torch's varlen flash kernel (attention sinks) has no dropout; set attention_dropout=0")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    window_size = (window - 1, 0) if window is not None else (-1, 0)
    return sink_varlen_attn(q, k, v, sinks, cu_seqlens, max_seqlen, scaling, window_size).unsqueeze(0)


@torch.compiler.disable  # a collective's rank: outside compiled graphs, as the all-to-all around it
def _rank_heads(sinks: torch.Tensor, group) -> torch.Tensor:
    """This rank's share of the per-head sinks under context parallelism: rank r attends with chunk r of the heads."""
    return sinks.chunk(dist.get_world_size(group))[dist.get_rank(group)]


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each document of a packed (1, N) row. Returns (1, N, H, D)."""
    if attention_mask is not None:  # a model that builds its own mask (Doge, MPT) cannot be kept to documents here
        raise UnsupportedModel(f"{type(module).__name__} passes its own attention mask to the attention function; "
                               f"{ATTENTION_NAME} attention takes none (packed rows pass cu_seqlens)")
    if query.shape[0] != 1:
        raise ValueError(f"{ATTENTION_NAME} attention expects packed rows of batch size 1, got {query.shape[0]}")
    sinks = kwargs.get("s_aux")  # gpt-oss: (Hq,) logits, one per query head
    softcap = kwargs.get("softcap") or None  # Gemma 2; transformers passes None when off, flash-attn 0.0
    # Some models pass the window per call (Phi-3, Mistral), others keep it on the module (per layer type).
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    max_seqlen = kwargs.get("max_length_q")
    group = active_group()
    if cu_seqlens is None:
        if group is not None:  # a slice's position ids do not say where the row's documents start
            raise ValueError(f"{ATTENTION_NAME} attention under context parallelism needs the row's cu_seq_lens_q")
        if kwargs.get("position_ids") is None:  # BLT, Inkling2: nothing says where the documents are
            raise UnsupportedModel(f"{type(module).__name__} passes neither cu_seq_lens_q nor position_ids to its "
                                   "attention, so the packed attention cannot tell where a row's documents start")
        cu_seqlens, max_seqlen = cu_seqlens_from_position_ids(kwargs["position_ids"])
    cu_seqlens = cu_seqlens.to(device=query.device, dtype=torch.int32)
    if group is not None:  # this rank's slice of every head -> the whole row for its share of the heads
        query, key, value = heads_to_sequence(query, key, value, group)
        if sinks is not None:
            sinks = _rank_heads(sinks, group)
    path = attention_path(query.device.type, query.dtype, query.shape[-1], sinks=sinks is not None,
                          softcap=softcap is not None, value_head_dim=value.shape[-1])
    if path == VARLEN:
        output = _varlen(query, key, value, cu_seqlens, int(max_seqlen), scaling, dropout, window, softcap)
    elif path == SINK_VARLEN:
        output = _sink_varlen(query, key, value, sinks, cu_seqlens, int(max_seqlen), scaling, dropout, window)
    elif path == SDPA:
        output = _per_document_sdpa(query, key, value, cu_seqlens, scaling, dropout, window)
    else:
        output = _per_document_exact(query, key, value, cu_seqlens, scaling, dropout, window, softcap, sinks)
    return (output if group is None else sequence_to_heads(output, group)), None


AttentionInterface.register(ATTENTION_NAME, packed_attention)


@contextlib.contextmanager
def stock_attention(hf_model: PreTrainedModel) -> Iterator[None]:
    """transformers' SDPA attention instead of the packed one while the block runs, then the packed one again.
    For generation: its queries after the prompt are one token against a KV cache of the tokens before it,
    which the packed attention (whole rows, documents from position ids) does not take."""
    if hf_model.config._attn_implementation != ATTENTION_NAME:
        yield
        return
    hf_model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        hf_model.set_attn_implementation(ATTENTION_NAME)


def decoder_of(hf_model: PreTrainedModel) -> torch.nn.Module:
    """The decoder a causal LM runs: its `base_model_prefix` attribute, or `.model` where that names none (Llama 4's
    and Mllama's causal LMs: prefix language_model, decoder model)."""
    return getattr(hf_model, hf_model.base_model_prefix, None) or hf_model.model


def packed_hidden_states(hf_model: PreTrainedModel, batch: PackedBatch) -> torch.Tensor:
    """The final hidden states (N, H) of a packed (1, N) row through the model's decoder (`packed_decoder_output`)."""
    return packed_decoder_output(hf_model, batch).last_hidden_state[0]


def packed_decoder_output(hf_model: PreTrainedModel, batch: PackedBatch, **outputs: bool):
    """The decoder's output for a packed (1, N) row: no attention mask and no cache; the document boundaries
    reach `packed_attention` as transformers' flash-attention kwargs, which the models pass on untouched; token
    mixers other than attention take them too (`chattune.model.mixers`). `outputs`: transformers' output_*
    flags (`output_router_logits=True` for a MoE model's router logits)."""
    isolate_documents(hf_model)
    return decoder_of(hf_model)(
        input_ids=batch.input_ids,
        position_ids=batch.position_ids,
        use_cache=False,
        cu_seq_lens_q=batch.cu_seqlens,
        cu_seq_lens_k=batch.cu_seqlens,
        max_length_q=batch.max_seqlen,
        max_length_k=batch.max_seqlen,
        **{name: value for name, value in outputs.items() if value},
    )
