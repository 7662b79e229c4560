"""One attention function for packed, padding-free batches, registered with transformers.

A packed microbatch is a single row (1, N) holding several documents back to back. Causal attention
over the row would let a document attend to the ones before it, so attention must run per document.
The collator passes `cu_seq_lens_q`/`max_length_q` (transformers' flash-attention kwarg names, which
the models forward untouched to the attention function); we fall back to deriving them from
`position_ids` (which restart at 0 per document) only when they are missing.

- CPU (and fp32 on CUDA): causal SDPA per document (exact, simple; CPU runs are small).
- CUDA bf16/fp16 with flash-attn importable: `flash_attn_varlen_func`.
- CUDA bf16/fp16 otherwise: torch's `varlen_attn`. Grouped-query attention (fewer kv heads than query
  heads) goes to the flash kernel as it is (the kernel supports it): with `enable_gqa` on torch >= 2.13;
  on an older torch, whose wrapper has no such flag, once `probe_native_gqa` has seen unequal head counts
  agree with repeated kv heads on the device at start-up; otherwise the kv heads are repeated first (Hq/Hkv
  times their memory and bandwidth).

`attention_backend` names the path a run takes (the builder logs it at start-up).

Generation (a prompt, then one token at a time against a KV cache) is not a packed row: `stock_attention`
gives the model transformers' SDPA attention for its duration (`chattune.model.generate`).

With context parallelism (`chattune.model.context_parallel`) each rank holds a slice of the row: an all-to-all
gives every rank the whole row for a share of the heads before the same kernels run, and another swaps back.

Sliding windows follow transformers' convention (a query sees itself and the `window - 1` keys before it).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator

import torch
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


@torch.compiler.disable  # a loop over documents whose bounds come from the data: left out of compiled graphs
def _per_document_sdpa(query, key, value, cu_seqlens, scaling, dropout, window):
    # query: (1, Hq, N, D), key/value: (1, Hkv, N, D)
    enable_gqa = query.shape[1] != key.shape[1]
    bounds = cu_seqlens.tolist()
    outputs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        q, k, v = query[:, :, start:end], key[:, :, start:end], value[:, :, start:end]
        mask = None
        if window is not None and end - start > window:
            positions = torch.arange(end - start, device=query.device)
            distance = positions[:, None] - positions[None, :]
            mask = (distance >= 0) & (distance < window)  # causal, and only the last `window` keys
        outputs.append(F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None, scale=scaling, enable_gqa=enable_gqa,
        ))
    return torch.cat(outputs, dim=2).transpose(1, 2)  # (1, N, Hq, D)


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


def attention_backend(device_type: str, compute_dtype: str) -> str:
    """The attention path packed rows take on this device and compute dtype, for the start-up log."""
    if device_type == "cuda" and compute_dtype in ("bfloat16", "float16"):
        if _FLASH_ATTN_VARLEN is not None:
            return "flash-attn varlen"
        gqa = {"flag": "native (enable_gqa)", "native": "native", "repeat": "by repeated kv heads"}[_varlen_gqa]
        return f"torch varlen_attn (grouped-query attention {gqa})"
    return "per-document SDPA (a loop over documents, outside compiled graphs)"


def _varlen(query, key, value, cu_seqlens, max_seqlen, scaling, dropout, window):
    # varlen kernels take (N, H, D); window (W-1, 0) = causal over the last W keys, as transformers does
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    window_size = (window - 1, 0) if window is not None else (-1, 0)
    if _FLASH_ATTN_VARLEN is not None:
        out = _FLASH_ATTN_VARLEN(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
            dropout_p=dropout, softmax_scale=scaling, causal=True, window_size=window_size,
        )
    else:
        if dropout:
            raise ValueError("torch varlen_attn has no dropout; set attention_dropout=0 or install flash-attn")
        out = torch_varlen_attn(q, k, v, cu_seqlens, max_seqlen, scaling, window_size)
    return out.unsqueeze(0)  # (1, N, Hq, D)


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
    if attention_mask is not None:
        raise ValueError(f"{ATTENTION_NAME} attention takes no attention_mask: packed batches pass cu_seqlens")
    if query.shape[0] != 1:
        raise ValueError(f"{ATTENTION_NAME} attention expects packed rows of batch size 1, got {query.shape[0]}")
    for unsupported in ("softcap", "s_aux"):  # silently ignoring them would train a different model
        if kwargs.get(unsupported) is not None:
            raise UnsupportedModel(f"{ATTENTION_NAME} attention does not implement {unsupported} yet")
    # Some models pass the window per call (Phi-3, Mistral), others keep it on the module (per layer type).
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    max_seqlen = kwargs.get("max_length_q")
    group = active_group()
    if cu_seqlens is None:
        if group is not None:  # a slice's position ids do not say where the row's documents start
            raise ValueError(f"{ATTENTION_NAME} attention under context parallelism needs the row's cu_seq_lens_q")
        cu_seqlens, max_seqlen = cu_seqlens_from_position_ids(kwargs["position_ids"])
    cu_seqlens = cu_seqlens.to(device=query.device, dtype=torch.int32)
    if group is not None:  # this rank's slice of every head -> the whole row for its share of the heads
        query, key, value = heads_to_sequence(query, key, value, group)
    if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16):  # the varlen kernels' dtypes
        output = _varlen(query, key, value, cu_seqlens, int(max_seqlen), scaling, dropout, window)
    else:
        output = _per_document_sdpa(query, key, value, cu_seqlens, scaling, dropout, window)
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


def packed_hidden_states(hf_model: PreTrainedModel, batch: PackedBatch) -> torch.Tensor:
    """The final hidden states (N, H) of a packed (1, N) row through the model's decoder (`packed_decoder_output`)."""
    return packed_decoder_output(hf_model, batch).last_hidden_state[0]


def packed_decoder_output(hf_model: PreTrainedModel, batch: PackedBatch, **outputs: bool):
    """The decoder's output for a packed (1, N) row: no attention mask and no cache; the document boundaries
    reach `packed_attention` as transformers' flash-attention kwargs, which the models pass on untouched; token
    mixers other than attention take them too (`chattune.model.mixers`). `outputs`: transformers' output_*
    flags (`output_router_logits=True` for a MoE model's router logits)."""
    isolate_documents(hf_model)
    decoder = getattr(hf_model, hf_model.base_model_prefix)
    return decoder(
        input_ids=batch.input_ids,
        position_ids=batch.position_ids,
        use_cache=False,
        cu_seq_lens_q=batch.cu_seqlens,
        cu_seq_lens_k=batch.cu_seqlens,
        max_length_q=batch.max_seqlen,
        max_length_k=batch.max_seqlen,
        **{name: value for name, value in outputs.items() if value},
    )
