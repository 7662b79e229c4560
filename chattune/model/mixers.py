"""Token mixers other than attention (short convolutions, Mamba SSMs, linear attention) on packed rows.

A packed row holds several documents back to back. Attention keeps them apart with `cu_seqlens`
(`chattune.model.attention`); a convolution, an SSM scan or a linear-attention recurrence run over the
whole row would carry state from one document into the next (the leak `chattune.model.packing_probe`
measures). Each mixer transformers implements for the model families of `HANDLED` is therefore made to see
each document alone, by one of two paths:

- **per document** (exact, any device): the mixer's own forward is called once per document of the row
  (its slice of the hidden states) and the outputs are concatenated. Each call starts from a zero state and
  its convolution is padded with zeros, exactly as the document run alone: no masking to prove equivalent.
  On CUDA each call uses whatever kernels transformers picks for the mixer (mamba-ssm, causal-conv1d, fla),
  so this path is fast where documents are long; its cost is a Python loop over documents per layer, kept
  out of compiled graphs (a graph break around each mixer).
- **varlen** (CUDA, the gated DeltaNet of Qwen3.5 / Qwen3-Next / OLMo-Hybrid only): the whole row in one
  call. transformers already hands the row's `cu_seq_lens_q` to fla's `chunk_gated_delta_rule` as
  `cu_seqlens`; we add `seq_idx` (each token's document)
  for causal-conv1d's `causal_conv1d_fn`, which transformers does not pass (without it the convolution
  reads across boundaries, as transformers' torch fallback does with `cu_seq_lens_q`). Chosen only where
  both packages import (`pip install -e ".[hybrid]"`) and `check_fast_mixers` finds it equal to the
  per-document path on the device; otherwise the run uses the per-document path and says why.

Kimi-Linear's KDA runs per document: transformers 5.24 passes its kwargs to fla's `chunk_kda` as they are,
and `chunk_kda` takes `cu_seqlens`, not `cu_seq_lens_q` (the boundaries would be dropped). Mamba-2 mixers (Nemotron-H, Granite-4.0-H, Falcon-H1, Bamba, Zamba2) take no document boundaries in
transformers 5.24 (`seq_idx` is gone from their forwards), so they run per document on every device.

Context parallelism is refused for these models (`check_context_parallel`): a recurrence needs the whole
document in order, and each rank holds a slice of it. An exchange that gives each rank the whole row for a
share of the heads (as attention does) would work for mixers that are independent per head or channel
(the delta rules, Mamba-2's heads, the short convolutions' channels), but it is not built: the mixers'
projections before the split (in_proj of Mamba-2 mixes all channels) would have to move with it.

Generation (a KV cache, no `cu_seq_lens_q`) runs the mixers' own forwards untouched.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from chattune.errors import UnsupportedModel

logger = logging.getLogger(__name__)

GATED_DELTA_RULE, KDA, MAMBA2, MAMBA, SHORT_CONV = (
    "gated delta rule", "KDA (Kimi delta attention)", "Mamba-2 SSM", "Mamba SSM", "short convolution")
# The mixer classes of transformers this module keeps per document, by class name, with their kind.
HANDLED = {
    "Qwen3_5GatedDeltaNet": GATED_DELTA_RULE,
    "Qwen3_5MoeGatedDeltaNet": GATED_DELTA_RULE,
    "Qwen3NextGatedDeltaNet": GATED_DELTA_RULE,
    "OlmoHybridGatedDeltaNet": GATED_DELTA_RULE,
    "KimiLinearDeltaAttention": KDA,
    "NemotronHMamba2Mixer": MAMBA2,
    "GraniteMoeHybridMambaLayer": MAMBA2,
    "FalconH1Mixer": MAMBA2,
    "BambaMixer": MAMBA2,
    "Zamba2MambaMixer": MAMBA2,
    "Mamba2Mixer": MAMBA2,
    "JambaMambaMixer": MAMBA,
    "ZambaMambaMixer": MAMBA,
    "Lfm2ShortConv": SHORT_CONV,
    "Lfm2MoeShortConv": SHORT_CONV,
    "Lfm3ShortConv": SHORT_CONV,
}
VARLEN_KINDS = (GATED_DELTA_RULE,)
INSTALL_HINT = 'pip install -e ".[hybrid]"'
# The packed-row kwargs transformers forwards to the mixers: the per-document path takes them out (each call
# is one document; transformers' torch fallbacks refuse `cu_seqlens`).
_ROW_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
_ROW_ATTRIBUTE = "_chattune_row_cu_seqlens"  # set by the layer hook for mixers that are not passed the kwargs

PER_DOCUMENT, VARLEN = "per-document", "varlen"
_path = PER_DOCUMENT  # the path the delta-rule mixers take on CUDA, settled once at start-up (`choose_mixer_path`)
_isolating = True  # tests turn it off (`leaking_mixers`) to show the leak it removes


def handled_mixers(hf_model: nn.Module) -> dict[str, str]:
    """{class name: kind} of the model's mixers this module handles."""
    return {type(m).__name__: HANDLED[type(m).__name__] for m in hf_model.modules() if type(m).__name__ in HANDLED}


def fast_kernels_available() -> bool:
    """Whether fla (varlen delta rules) and causal-conv1d (the convolution with `seq_idx`) both import."""
    return all(importlib.util.find_spec(name) is not None for name in ("fla", "causal_conv1d"))


def seq_idx_from_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """(1, N) int32: each token's document index, causal-conv1d's `seq_idx`, from a row's `cu_seqlens`."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.long)
    documents = torch.arange(lengths.numel(), device=cu_seqlens.device, dtype=torch.int32)
    return documents.repeat_interleave(lengths).unsqueeze(0)


def isolate_documents(hf_model: nn.Module) -> None:
    """Give every mixer of `HANDLED` in `hf_model` the packed-row forward of the module docstring (an instance
    attribute: parameter names, state dicts and FSDP's hooks are unchanged). Idempotent; cheap when done."""
    if hf_model.__dict__.get("_chattune_mixers_isolated"):
        return
    for parent in hf_model.modules():
        for child in parent.children():
            if type(child).__name__ in HANDLED and "forward" not in child.__dict__:
                child.forward = _packed_forward(child, child.forward)
                # Some layers (Jamba's) do not pass the row's kwargs on to their mixer: the layer's do.
                parent.register_forward_pre_hook(_remember_row(child), with_kwargs=True)
    hf_model.__dict__["_chattune_mixers_isolated"] = True


def _remember_row(mixer: nn.Module) -> Callable:
    def hook(layer, args, kwargs):
        mixer.__dict__[_ROW_ATTRIBUTE] = kwargs.get("cu_seq_lens_q")
    return hook


def _packed_forward(mixer: nn.Module, forward: Callable) -> Callable:
    kind = HANDLED[type(mixer).__name__]

    @torch.compiler.disable  # a loop whose bounds come from the data: outside compiled graphs
    def packed_forward(*args, **kwargs):
        cu_seqlens = kwargs.get("cu_seq_lens_q", mixer.__dict__.get(_ROW_ATTRIBUTE))
        cache = kwargs.get("cache", kwargs.get("cache_params"))
        if cu_seqlens is None or cache is not None:  # generation
            return forward(*args, **kwargs)
        if not _isolating:  # the whole row in one call, without its boundaries: the leak, for tests
            return forward(*args, **{key: value for key, value in kwargs.items() if key not in _ROW_KWARGS})
        if kwargs.get("attention_mask") is not None:
            raise ValueError(f"{type(mixer).__name__}: a packed row takes no attention_mask")
        hidden = args[0] if args else kwargs["hidden_states"]
        if kind in VARLEN_KINDS and _path == VARLEN and hidden.is_cuda:  # one call; the kernels take the boundaries
            kwargs["seq_idx"] = seq_idx_from_cu_seqlens(cu_seqlens.to(torch.int32))
            return forward(*args, **kwargs)
        return _per_document(forward, cu_seqlens, args, kwargs)

    return packed_forward


def _per_document(forward: Callable, cu_seqlens: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
    kwargs = {key: value for key, value in kwargs.items() if key not in _ROW_KWARGS}
    hidden = args[0] if args else kwargs.pop("hidden_states")
    if hidden.shape[0] != 1:
        raise ValueError(f"packed rows have batch size 1, got hidden states of shape {tuple(hidden.shape)}")
    length = hidden.shape[1]
    # Per-token tensors passed along (Mamba2Mixer gets position_ids) are cut like the hidden states.
    per_token = {key for key, value in kwargs.items()
                 if torch.is_tensor(value) and value.dim() >= 2 and value.shape[:2] == (1, length)}
    bounds = cu_seqlens.tolist()
    outputs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        piece = {key: (value[:, start:end] if key in per_token else value) for key, value in kwargs.items()}
        if args:
            output = forward(hidden[:, start:end], *args[1:], **piece)
        else:
            output = forward(hidden_states=hidden[:, start:end], **piece)
        outputs.append(output)
    if isinstance(outputs[0], tuple):  # (hidden states, nothing else for a cache-free call)
        if any(item is not None for output in outputs for item in output[1:]):
            raise ValueError("a mixer returned more than hidden states on a packed row")
        return (torch.cat([output[0] for output in outputs], dim=1), *outputs[0][1:])
    return torch.cat(outputs, dim=1)


def choose_mixer_path(device: torch.device, kinds: set[str]) -> str:
    """Settle, once at start-up, the path the delta-rule mixers take (module docstring): varlen on CUDA where the
    kernels import, else per document, with a warning giving the install command on CUDA."""
    global _path
    _path = PER_DOCUMENT
    if device.type == "cuda" and kinds & set(VARLEN_KINDS):
        if fast_kernels_available():
            _path = VARLEN
        else:
            logger.warning("the model's %s layers run per document of each packed row (exact, a loop over "
                           "documents) because fla and causal-conv1d are not both installed; for the varlen "
                           "kernels: %s", " and ".join(sorted(kinds & set(VARLEN_KINDS))), INSTALL_HINT)
    return _path


def fall_back_to_per_document(reason: str) -> None:
    """The varlen path failed its check on the device (`check_fast_mixers`): per document, with a warning."""
    global _path
    _path = PER_DOCUMENT
    logger.warning("the varlen linear-attention kernels are not used: %s; the mixers run per document (exact)", reason)


def mixer_path_name(kinds: set[str], device_type: str) -> str | None:
    """The mixers' path for the `compute:` line, or None for a model without handled mixers."""
    if not kinds:
        return None
    names = []
    for kind in sorted(kinds):
        if kind in VARLEN_KINDS and device_type == "cuda" and _path == VARLEN:
            names.append(f"{kind}: varlen (fla cu_seqlens, causal-conv1d seq_idx)")
        else:
            names.append(f"{kind}: per document")
    return "; ".join(names)


def mixer_path() -> str:
    return _path


@contextmanager
def per_document() -> Iterator[None]:
    """The per-document path while the block runs, whatever was chosen (`check_fast_mixers` compares them)."""
    global _path
    chosen, _path = _path, PER_DOCUMENT
    try:
        yield
    finally:
        _path = chosen


@contextmanager
def leaking_mixers() -> Iterator[None]:
    """The mixers run over the whole row while the block runs: the leak this module removes (tests only)."""
    global _isolating
    _isolating = False
    try:
        yield
    finally:
        _isolating = True


def check_context_parallel(hf_model: nn.Module, context_size: int) -> None:
    """Refuse context parallelism for a model with handled mixers (module docstring: why)."""
    mixers = handled_mixers(hf_model)
    if context_size > 1 and mixers:
        layers = ", ".join(f"{name} ({kind})" for name, kind in mixers.items())
        raise UnsupportedModel(
            f"{type(hf_model).__name__} has sequence layers other than attention ({layers}) that need each document "
            "whole and in order, and parallel.context splits packed rows across ranks: set parallel.context=1 "
            "(for memory, a smaller data.max_tokens_per_microbatch or model.fsdp.activation_checkpointing=true)"
        )
