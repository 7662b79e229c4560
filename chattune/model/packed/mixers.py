"""Token mixers other than attention (short convolutions, SSMs, linear attention, recurrences) on packed rows.

A packed row holds several documents back to back. Attention keeps them apart with `cu_seqlens`
(`chattune.model.packed.attention`); a convolution, an SSM scan or a linear-attention recurrence run over the
whole row would carry state from one document into the next (the leak `chattune.model.checks.packing_probe`
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
`seq_idx`), and the recurrent families, whose kernels take no boundaries either or have none but transformers'
torch loops:
- Mamba-1 (`mamba`) and FalconMamba: the convolution and the selective scan of their mixers;
- MiniMax's lightning attention: its state (K^T V, decayed) is carried from block to block (`block_size`) and
  returned beside the output; per document each starts from zero, and the row's call returns no state;
- RecurrentGemma's recurrent block: its convolution reads across boundaries (its RG-LRU resets where
  position_ids are 0, so it alone would not); its local attention goes through transformers' attention interface
  (`chattune.model.packed.attention`); its logits are soft-capped (`chattune.model.head.output_logits`);
- RWKV: the time mixing's WKV state and the token shift of both time and channel mixing (the previous token's
  hidden state: zeros at a document's start, as alone);
- xLSTM: the mLSTM's matrix memory, chunked by `chunk_size` (its chunks and its recurrent remainder are those of
  each document alone); it returns its state beside the output, none for the row. In eval mode a row longer
  than its `max_inference_chunksize` is cut into pieces that carry the state: refused (below);
- Bailing-hybrid's delta attention (KDA as Kimi-Linear's): its kernels take `cu_seqlens`/`seq_idx` as Kimi's do,
  but no varlen path is built for it without a GPU to check it on.

The boundaries reach the mixers however the model passes its kwargs: a mixer passed `cu_seq_lens_q` reads it;
otherwise the hooks tell it the row of the call that entered the model (the causal LM or its decoder: Mamba's,
RWKV's and xLSTM's decoders pass their kwargs to no layer, and the causal LMs of Mamba and RWKV not to their
decoder) or of its layer (Jamba's layers are passed the kwargs, their mixers not). A call without them (a
sequence alone, generation) tells the mixers so. Activation checkpointing recomputes a layer in the backward,
after the model's call: the mixers keep the row of the last call, the microbatch being differentiated.

A mixer given a packed row with a cache or recurrent state to continue from (or asked to fill one: `use_cache`)
raises instead of running: each document starts from a zero state, and generation passes no row.

Context parallelism is refused for these models (`check_context_parallel`): a recurrence needs the whole
document in order, and each rank holds a slice of it. An exchange that gives each rank the whole row for a
share of the heads (as attention does) would work for mixers that are independent per head or channel
(the delta rules, Mamba-2's heads, the short convolutions' channels), but it is not built: the mixers'
projections before the split (in_proj of Mamba-2 mixes all channels) would have to move with it.

Generation (a KV cache, no `cu_seq_lens_q`) runs the mixers' own forwards untouched.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import types
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from chattune.errors import UnsupportedModel
from chattune.hf_layout import decoder_of
from chattune.model.packed import isolation

logger = logging.getLogger(__name__)

GATED_DELTA_RULE, KDA, MAMBA2, MAMBA, SHORT_CONV = (
    "gated delta rule",
    "KDA (Kimi delta attention)",
    "Mamba-2 SSM",
    "Mamba SSM",
    "short convolution",
)
# The recurrent families (per document on every device: no varlen path).
LIGHTNING, RG_LRU, RWKV_TIME, RWKV_CHANNEL, MLSTM, BAILING_KDA = (
    "lightning attention",
    "RG-LRU recurrent block",
    "RWKV time mixing",
    "RWKV channel mixing",
    "mLSTM",
    "KDA (Bailing delta attention)",
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
    "MambaMixer": MAMBA,
    "FalconMambaMixer": MAMBA,
    "MiniMaxLightningAttention": LIGHTNING,
    "RecurrentGemmaRecurrentBlock": RG_LRU,
    "RwkvSelfAttention": RWKV_TIME,
    "RwkvFeedForward": RWKV_CHANNEL,
    "xLSTMLayer": MLSTM,
    "BailingHybridDeltaAttention": BAILING_KDA,
}
# Kinds whose forward returns its final recurrent state beside the hidden states, whether or not it was given a
# cache: a packed row's documents each end in one, and nothing reads it without a cache, so the per-document path
# returns None in its place.
RETURNS_STATE = {LIGHTNING, MLSTM}
# The names a mixer's forward takes a cache or a recurrent state by: given one, it continues a sequence (generation).
_STATE_ARGUMENTS = ("cache", "cache_params", "past_key_values", "state")
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
_ROW_ATTRIBUTE = "_chattune_row_cu_seqlens"  # on a mixer: its row's boundaries, set by the decoder's and layers' hooks
_MIXERS_ATTRIBUTE = "_chattune_mixers"  # on the model and its decoder: the handled mixers their hooks tell the row
_CALLS_ATTRIBUTE = "_chattune_row_calls"  # on the model and its decoder: how deep inside their calls a forward is

_varlen: set[str] = set()  # the kinds on the varlen path, settled once at start-up (`choose_mixer_path`)
_VARLEN_DEVICES = ("cuda",)  # where the varlen kernels run (tests add "cpu" with stand-in kernels)
MIXERS = isolation.register(
    "mixers",
    "the state of token mixers (convolutions, SSM and linear-attention recurrences): each document starts from zero",
)


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
    attribute: parameter names, state dicts and FSDP's hooks are unchanged), and the hooks that hand it the row's
    boundaries. Idempotent; cheap when done.

    The forward and the hooks are bound to the modules they serve, not closures over them, so that a deep copy of
    the model (the start-up checks copy the miniature) runs its own weights."""
    if hf_model.__dict__.get("_chattune_mixers_isolated"):
        return
    mixers, layers = [], {}
    for parent in hf_model.modules():
        for child in parent.children():
            if type(child).__name__ in HANDLED and "forward" not in child.__dict__:
                child.forward = types.MethodType(_packed_forward, child)
                mixers.append(child)
                layers[id(parent)] = parent
    # Some layers (Jamba's) do not pass the row's kwargs on to their mixer: the layer's kwargs have them.
    for layer in layers.values():
        layer.register_forward_pre_hook(_remember_layer_row, with_kwargs=True)
    if mixers:  # Some decoders (Mamba's, RWKV's, xLSTM's) pass them to no layer, and some causal LMs (Mamba's,
        # RWKV's) not to their decoder: the kwargs of the call that enters the model have them.
        calls = {"depth": 0}  # shared by the entries: only the outermost call says where a row has none
        for entry in {id(m): m for m in (hf_model, _decoder(hf_model))}.values():
            entry.__dict__[_MIXERS_ATTRIBUTE] = mixers
            entry.__dict__[_CALLS_ATTRIBUTE] = calls
            entry.register_forward_pre_hook(_enter, with_kwargs=True)
            entry.register_forward_hook(_leave, always_call=True)
    hf_model.__dict__["_chattune_mixers_isolated"] = True


def _decoder(hf_model: nn.Module) -> nn.Module:
    """The module `chattune.model.packed.attention.packed_decoder_output` calls with the row (`decoder_of`), or the model
    itself where it is a decoder (no base model of its own)."""

    try:
        return decoder_of(hf_model)
    except AttributeError:  # a bare decoder: neither a prefix attribute nor `.model`
        return hf_model


def _enter(entry: nn.Module, args: tuple, kwargs: dict) -> None:
    """A call of the model or of its decoder tells the mixers the row's boundaries: those it is passed, or where it
    is the outermost call, None (a sequence alone, generation), so that no call reads those of an earlier one.
    A layer recomputed by activation checkpointing in the backward reads those of the last call: the microbatch
    being differentiated (a training step runs each microbatch's forward, then its backward)."""
    calls = entry.__dict__[_CALLS_ATTRIBUTE]
    calls["depth"] += 1
    if "cu_seq_lens_q" in kwargs or calls["depth"] == 1:
        for mixer in entry.__dict__[_MIXERS_ATTRIBUTE]:
            mixer.__dict__[_ROW_ATTRIBUTE] = kwargs.get("cu_seq_lens_q")


def _leave(entry: nn.Module, args: tuple, output) -> None:
    entry.__dict__[_CALLS_ATTRIBUTE]["depth"] -= 1


def _remember_layer_row(layer: nn.Module, args: tuple, kwargs: dict) -> None:
    """A layer passed the row's kwargs (Jamba's, also when recomputed by activation checkpointing) tells its mixers;
    one that is not (Mamba's blocks) leaves what the model's hooks told them (`_enter`)."""
    if "cu_seq_lens_q" in kwargs:
        for child in layer.children():
            if type(child).__name__ in HANDLED:
                child.__dict__[_ROW_ATTRIBUTE] = kwargs["cu_seq_lens_q"]


@functools.cache
def _parameters(cls: type) -> tuple[str, ...]:
    """The names of `cls.forward`'s parameters after self (through transformers' decorators)."""
    return tuple(inspect.signature(cls.forward).parameters)[1:]


def _argument(mixer: nn.Module, name: str, args: tuple, kwargs: dict):
    """The value of the forward's parameter `name` in this call, positional or not (None where not given)."""
    parameters = _parameters(type(mixer))
    if name in parameters and parameters.index(name) < len(args):
        return args[parameters.index(name)]
    return kwargs.get(name)


def _continues_a_sequence(mixer: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether the call is given a cache or a recurrent state to continue from, or asked to fill one."""
    return any(_argument(mixer, name, args, kwargs) is not None for name in _STATE_ARGUMENTS) or bool(
        _argument(mixer, "use_cache", args, kwargs)
    )


@torch.compiler.disable  # a loop whose bounds come from the data: outside compiled graphs
def _packed_forward(mixer: nn.Module, *args, **kwargs):
    """The mixer's forward (bound to it as its instance `forward`): per document on a packed row, its own
    otherwise."""
    forward = type(mixer).forward.__get__(mixer)
    kind = HANDLED[type(mixer).__name__]
    cu_seqlens = kwargs.get("cu_seq_lens_q", mixer.__dict__.get(_ROW_ATTRIBUTE))
    if cu_seqlens is None:  # not a packed row: a sequence alone, generation
        return forward(*args, **kwargs)
    if _continues_a_sequence(mixer, args, kwargs):  # each document starts from a zero state
        raise ValueError(
            f"{type(mixer).__name__} was given a packed row with a cache or recurrent state to continue from; a "
            "packed row's documents each start from a zero state (xLSTM in eval mode cuts a row longer than its "
            "config.max_inference_chunksize into pieces that carry the state: raise it above the row's length)"
        )
    if not isolation.isolating(MIXERS):  # the whole row in one call, without its boundaries: the leak, for tests
        return forward(*args, **{key: value for key, value in kwargs.items() if key not in _ROW_KWARGS})
    if _argument(mixer, "attention_mask", args, kwargs) is not None:
        raise ValueError(f"{type(mixer).__name__}: a packed row takes no attention_mask")
    hidden = args[0] if args else kwargs[_parameters(type(mixer))[0]]
    if hidden.shape[1] != int(cu_seqlens[-1]):  # boundaries of another row (the decoder's hook not run for this one)
        raise ValueError(
            f"{type(mixer).__name__} got {hidden.shape[1]} tokens but the packed row's boundaries end at "
            f"{int(cu_seqlens[-1])}"
        )
    if kind in _varlen and hidden.device.type in _VARLEN_DEVICES:  # one call; the kernels take the boundaries
        kwargs["seq_idx"] = seq_idx_from_cu_seqlens(cu_seqlens.to(torch.int32), hidden.shape[1])
        if kind == KDA:  # transformers hands Kimi's kwargs to fla's chunk_kda as they are: it reads `cu_seqlens`
            kwargs["cu_seqlens"] = cu_seqlens
        return forward(*args, **kwargs)
    return _per_document(mixer, forward, cu_seqlens, args, kwargs)


def _per_document(mixer: nn.Module, forward, cu_seqlens: torch.Tensor, args: tuple, kwargs: dict):
    """`forward` once per document of the row (its slice of the hidden states and of any per-token argument), the
    outputs concatenated along the sequence."""
    kwargs = {key: value for key, value in kwargs.items() if key not in _ROW_KWARGS}
    hidden_name = _parameters(type(mixer))[0]
    hidden = args[0] if args else kwargs.pop(hidden_name)
    if hidden.shape[0] != 1:
        raise ValueError(f"packed rows have batch size 1, got hidden states of shape {tuple(hidden.shape)}")
    length = hidden.shape[1]

    def per_token(value) -> bool:  # Mamba2Mixer and RecurrentGemma's recurrent block get position_ids
        return torch.is_tensor(value) and value.dim() >= 2 and value.shape[:2] == (1, length)

    bounds = cu_seqlens.tolist()
    outputs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        rest = [value[:, start:end] if per_token(value) else value for value in args[1:]]
        piece = {key: (value[:, start:end] if per_token(value) else value) for key, value in kwargs.items()}
        if args:
            output = forward(hidden[:, start:end], *rest, **piece)
        else:
            output = forward(**{hidden_name: hidden[:, start:end]}, **piece)
        outputs.append(output)
    if not isinstance(outputs[0], tuple):
        return torch.cat(outputs, dim=1)
    # (hidden states, then nothing for a cache-free call, or the final state of the kinds of RETURNS_STATE)
    if HANDLED[type(mixer).__name__] in RETURNS_STATE:
        extras = (None,) * (len(outputs[0]) - 1)
    elif any(item is not None for output in outputs for item in output[1:]):
        raise ValueError("a mixer returned more than hidden states on a packed row")
    else:
        extras = outputs[0][1:]
    return (torch.cat([output[0] for output in outputs], dim=1), *extras)


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
