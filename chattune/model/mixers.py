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
- **varlen** (CUDA): the whole row in one call, the kernels given the boundaries. transformers 5.24 passes a
  mixer's kwargs on to its kernels (filtered to each kernel's parameters), so adding `seq_idx` (each token's
  document, `seq_idx_from_cu_seqlens`) reaches causal-conv1d's `causal_conv1d_fn` and mamba-ssm's
  `mamba_split_conv1d_scan_combined` / `mamba_chunk_scan_combined`, and the row's `cu_seq_lens_q` reaches
  fla's `chunk_gated_delta_rule` as `cu_seqlens` (Kimi-Linear passes its kwargs to fla's `chunk_kda` as they
  are, so `cu_seqlens` is added for KDA). Without `seq_idx` the convolution and the SSM scan read
  across boundaries (transformers' torch fallback of the convolution even takes `cu_seq_lens_q` and ignores
  it). Kinds with a varlen path and the packages it needs: `VARLEN_KERNELS` (the gated delta rule of
  Qwen3.5 / Qwen3-Next / OLMo-Hybrid; KDA of Kimi-Linear; the Mamba-2 SSM of Nemotron-H, Granite-4.0-H, Falcon-H1, Bamba, Zamba2;
  the short convolutions of LFM2, whose input is in the channel-last layout causal-conv1d needs for `seq_idx`).
  Chosen only where its packages import (`pip install -e ".[hybrid]"`) and `check_fast_mixers` finds it
  equal to the per-document path on the device; otherwise the run uses the per-document path and says why.

Per document on every device: the Mamba-1 SSMs of Jamba and Zamba (mamba-ssm's selective scan takes no
`seq_idx`).

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
    "gated delta rule",
    "KDA (Kimi delta attention)",
    "Mamba-2 SSM",
    "Mamba SSM",
    "short convolution",
)
# The mixer classes of transformers this module keeps per document, by class name, with their kind.
HANDLED = {
    "Qwen3_5GatedDeltaNet": GATED_DELTA_RULE,
    "Qwen3_5MoeGatedDeltaNet": GATED_DELTA_RULE,
    "Qwen3NextGatedDeltaNet": GATED_DELTA_RULE,
    "OlmoHybridGatedDeltaNet": GATED_DELTA_RULE,
    "LaraMiniGatedDeltaNet": GATED_DELTA_RULE,
    "Qwen4ExpTextGatedDeltaNet": GATED_DELTA_RULE,
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
# The kinds with a varlen path on CUDA, and the packages (import names) it needs.
VARLEN_KERNELS = {
    GATED_DELTA_RULE: ("fla", "causal_conv1d"),
    KDA: ("fla", "causal_conv1d"),
    MAMBA2: ("mamba_ssm", "causal_conv1d"),
    SHORT_CONV: ("causal_conv1d",),
}
_VARLEN_NAMES = {
    GATED_DELTA_RULE: "varlen (fla chunk_gated_delta_rule with cu_seqlens, causal-conv1d with seq_idx)",
    KDA: "varlen (fla chunk_kda with cu_seqlens, causal-conv1d with seq_idx)",
    MAMBA2: "varlen (mamba-ssm and causal-conv1d with seq_idx)",
    SHORT_CONV: "varlen (causal-conv1d with seq_idx)",
}
INSTALL_HINT = 'pip install -e ".[hybrid]"'
# The packed-row kwargs transformers forwards to the mixers: the per-document path takes them out (each call
# is one document; transformers' torch fallbacks refuse `cu_seqlens`).
_ROW_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
_ROW_ATTRIBUTE = "_chattune_row_cu_seqlens"  # set by the layer hook for mixers that are not passed the kwargs

_varlen: set[str] = set()  # the kinds on the varlen path, settled once at start-up (`choose_mixer_path`)
_VARLEN_DEVICES = ("cuda",)  # where the varlen kernels run (tests add "cpu" with stand-in kernels)
_isolating = True  # tests turn it off (`leaking_mixers`) to show the leak it removes


def handled_mixers(hf_model: nn.Module) -> dict[str, str]:
    """{class name: kind} of the model's mixers this module handles."""
    return {type(m).__name__: HANDLED[type(m).__name__] for m in hf_model.modules() if type(m).__name__ in HANDLED}


def kernels_available(kind: str) -> bool:
    """Whether the packages of `kind`'s varlen path (`VARLEN_KERNELS`) all import. Imported, not only found: a
    package that is installed but does not import (a build for another torch) makes transformers <= 5.17 take its
    torch fallback, which ignores `seq_idx` (the leak of a short convolution is then too small for
    `check_fast_mixers` to see); transformers 5.24's fallback refuses it instead."""
    for name in VARLEN_KERNELS[kind]:
        if importlib.util.find_spec(name) is None:
            return False
        try:
            importlib.import_module(name)
        except Exception as error:  # an extension built for another torch or CUDA fails in many ways
            logger.warning("%s is installed but does not import (%s: %s)", name, type(error).__name__, error)
            return False
    return True


def seq_idx_from_cu_seqlens(cu_seqlens: torch.Tensor, num_tokens: int | None = None) -> torch.Tensor:
    """(1, N) int32: each token's document index, causal-conv1d's `seq_idx`, from a row's `cu_seqlens`. Given
    the row's length `num_tokens`, CUDA need not be synchronised to size the result."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.long)
    documents = torch.arange(lengths.numel(), device=cu_seqlens.device, dtype=torch.int32)
    return documents.repeat_interleave(lengths, output_size=num_tokens).unsqueeze(0)


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
        if kind in _varlen and hidden.device.type in _VARLEN_DEVICES:  # one call; the kernels take the boundaries
            kwargs["seq_idx"] = seq_idx_from_cu_seqlens(cu_seqlens.to(torch.int32), hidden.shape[1])
            if kind == KDA:  # transformers hands Kimi's kwargs to fla's chunk_kda as they are: it reads `cu_seqlens`
                kwargs["cu_seqlens"] = cu_seqlens
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
    per_token = {
        key
        for key, value in kwargs.items()
        if torch.is_tensor(value) and value.dim() >= 2 and value.shape[:2] == (1, length)
    }
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


def choose_mixer_path(device: torch.device, kinds: set[str]) -> set[str]:
    """Settle, once at start-up, which of the model's mixer `kinds` take the varlen path (module docstring): on
    CUDA, those whose kernels import; a kind that has a varlen path but lacks its kernels is said, with the
    install command. Returns the varlen kinds."""
    _varlen.clear()
    if device.type != "cuda":
        return set()
    for kind in sorted(kinds & VARLEN_KERNELS.keys()):
        if kernels_available(kind):
            _varlen.add(kind)
        else:
            logger.warning(
                "the model's %s layers run per document of each packed row (exact, a loop over documents) "
                "because %s do not all import; for the varlen kernels: %s",
                kind,
                " and ".join(VARLEN_KERNELS[kind]),
                INSTALL_HINT,
            )
    return set(_varlen)


def varlen_kinds() -> set[str]:
    return set(_varlen)


def fall_back_to_per_document(reason: str) -> None:
    """The varlen path failed its check on the device (`check_fast_mixers`): per document, with a warning."""
    kinds = " and ".join(sorted(_varlen))
    _varlen.clear()
    logger.warning(
        "the varlen kernels of the %s layers are not used: %s; those layers run per document (exact)", kinds, reason
    )


def mixer_path_name(kinds: set[str], device_type: str) -> str | None:
    """The mixers' path for the `compute:` line, or None for a model without handled mixers."""
    if not kinds:
        return None
    return "; ".join(
        f"{kind}: {_VARLEN_NAMES[kind] if kind in _varlen and device_type in _VARLEN_DEVICES else 'per document'}"
        for kind in sorted(kinds)
    )


@contextmanager
def per_document() -> Iterator[None]:
    """The per-document path while the block runs, whatever was chosen (`check_fast_mixers` compares them)."""
    chosen = set(_varlen)
    _varlen.clear()
    try:
        yield
    finally:
        _varlen.update(chosen)


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
