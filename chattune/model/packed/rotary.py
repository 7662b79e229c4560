"""Rotary embeddings whose tables depend on the whole input, computed per document of a packed row.

Most rotary embeddings are a fixed function of each token's position id, and position ids restart at 0 per
document, so a packed row gets each document's tables for free. Two kinds of rotary embedding in transformers
read more than that: they pick their frequencies once per forward from the largest position id of the input
(`dynamic_rope_update` in `transformers.modeling_rope_utils`):

- **LongRoPE** (`rope_type: longrope`: Phi-3.5-mini, Phi-4-mini, PhiMoE, MiniCPM3, Phi-4-multimodal) takes its
  long factors when the input is longer than `original_max_position_embeddings`, its short ones otherwise
  (PhiMoE's own forward also switches its `mscale` there);
- **dynamic NTK** (`rope_type: dynamic`) recomputes its frequencies for an input longer than
  `max_position_embeddings`.

Over a packed row "the input" is the row: a 23-token document packed beside a 57-token one would take the long
factors that it never takes alone (a Phi-3 miniature with `original_max_position_embeddings=32`: gradients 1e-2
off). So each such rotary module computes its tables **per document**: its own forward runs once per distinct
document length L on positions 0..L-1, from the state it had before the row (dynamic NTK caches the longest input
it has seen; run on one document from a fresh model, which is what chattune reproduces, it scales exactly when
L > max_position_embeddings), and each token takes the row of its document's table at its position id. The
alternative, rows that never mix the two regimes, would have to be built into the packer for one model family and
would still be wrong for dynamic NTK, whose frequencies change with every length.

The module needs the row's document boundaries, which transformers does not pass to it: a forward pre-hook on the
module that calls it (the decoder) records the row's `cu_seq_lens_q` each call (`None` in generation, where the
stock forward runs untouched: a prompt is one document). Under context parallelism each rank holds a slice of the
row with the row's position ids and boundaries (`chattune.parallel.context_parallel`): a token's document and its
length come from the whole row's boundaries and the slice's offset.

Cost: one call of the rotary forward per distinct document length (cheap: a table of L × head size), a host sync
to read the boundaries, once per forward (not per layer), only for models with such rotary embeddings. Rotary
modules whose type or position ids this module cannot handle (multimodal 3-D position ids) keep their stock forward;
the start-up packing probe, run with a miniature whose thresholds lie between its documents' lengths
(`chattune.model.checks.architecture.THRESHOLDS`), then sees the difference and refuses the model.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from chattune.errors import UnsupportedModel
from chattune.model.packed import isolation
from chattune.parallel.context_parallel import context_group_of

logger = logging.getLogger(__name__)

_ROW_ATTRIBUTE = "_chattune_row_cu_seqlens"  # the row's boundaries, recorded by the calling module's pre-hook
_ISOLATED = "_chattune_rotaries_isolated"
ROTARIES = isolation.register(
    "rotaries", "rotary tables whose factors depend on the largest position in the row: each document's from its own"
)


def _rope_types(module: nn.Module) -> list[str]:
    rope_type = getattr(module, "rope_type", None)
    if isinstance(rope_type, str):
        return [rope_type]
    if isinstance(rope_type, dict):  # one per layer type (Gemma 3, ...)
        return [value for value in rope_type.values() if isinstance(value, str)]
    return []


@functools.cache
def _forward_reads_row_length(cls: type) -> bool:
    """Whether a rotary class's own forward reads the input's largest position id (PhiMoE's mscale switch)."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return "max(position_ids)" in source or "position_ids.max()" in source


def reads_row_length(module: nn.Module) -> bool:
    """Whether `module` is a rotary embedding whose tables depend on the input's length (module docstring)."""
    types = _rope_types(module)
    if not types:
        return False
    dynamic = any("dynamic" in rope_type or rope_type == "longrope" for rope_type in types)
    return dynamic or (any(rope_type != "default" for rope_type in types) and _forward_reads_row_length(type(module)))


def isolate_rotaries(hf_model: nn.Module) -> None:
    """Give every rotary module of `hf_model` that reads the input's length the per-document forward of the module
    docstring (an instance attribute: parameter names and state dicts are unchanged), and its caller a pre-hook
    recording the row's boundaries. Idempotent; cheap when done."""
    if hf_model.__dict__.get(_ISOLATED):
        return
    for parent in hf_model.modules():
        for child in parent.children():
            if reads_row_length(child) and "forward" not in child.__dict__:
                child.forward = _per_document_forward(child, child.forward)
                parent.register_forward_pre_hook(_remember_row(child), with_kwargs=True)
    hf_model.__dict__[_ISOLATED] = True


def _remember_row(rotary: nn.Module) -> Callable:
    def hook(caller, args, kwargs):
        rotary.__dict__[_ROW_ATTRIBUTE] = kwargs.get("cu_seq_lens_q")

    return hook


def _state(module: nn.Module) -> tuple[dict, dict]:
    """What a rotary forward may change: its buffers and its scalar and tensor attributes (dynamic NTK's cached
    length, frequencies and attention scaling)."""
    attributes = {key: value for key, value in module.__dict__.items() if isinstance(value, (int, float, torch.Tensor))}
    return dict(module._buffers), attributes


def _restore(module: nn.Module, state: tuple[dict, dict]) -> None:
    buffers, attributes = state
    module._buffers.clear()
    module._buffers.update(buffers)
    module.__dict__.update(attributes)


def _document_spans(cu_seqlens: torch.Tensor, offset: int, length: int) -> list[tuple[int, int, int]]:
    """(document length, first, end) of each document overlapping tokens [offset, offset + length) of the row, the
    bounds relative to the offset."""
    bounds = cu_seqlens.tolist()
    spans = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        first, last = max(start, offset), min(end, offset + length)
        if first < last:
            spans.append((end - start, first - offset, last - offset))
    return spans


def _slice_offset(module: nn.Module, length: int) -> int:
    """Where this rank's `length` tokens start in the row: 0, or its slice's under context parallelism."""
    group = context_group_of(module)
    return dist.get_rank(group) * length if group is not None else 0


def _per_document_forward(module: nn.Module, forward: Callable) -> Callable:
    @torch.compiler.disable  # a loop whose bounds come from the data: outside compiled graphs
    def per_document_forward(x: torch.Tensor, position_ids: torch.Tensor | None = None, *args, **kwargs):
        cu_seqlens = module.__dict__.get(_ROW_ATTRIBUTE)
        if (
            not isolation.isolating(ROTARIES)
            or cu_seqlens is None
            or position_ids is None
            or position_ids.dim() != 2
            or position_ids.shape[0] != 1
        ):
            return forward(x, position_ids, *args, **kwargs)  # generation, or position ids it cannot split
        length = position_ids.shape[1]
        offset = _slice_offset(module, length)
        before = _state(module)
        tables: dict[int, tuple] = {}
        pieces = []
        try:
            for document_length, first, end in _document_spans(cu_seqlens, offset, length):
                if document_length not in tables:  # the document alone, from the state before the row
                    _restore(module, before)
                    alone = torch.arange(document_length, device=position_ids.device).unsqueeze(0)
                    output = forward(x, alone, *args, **kwargs)
                    tables[document_length] = output if isinstance(output, tuple) else (output,)
                positions = position_ids[0, first:end]
                pieces.append(tuple(table.index_select(1, positions) for table in tables[document_length]))
        finally:
            _restore(module, before)
        joined = tuple(torch.cat(parts, dim=1) for parts in zip(*pieces))
        return joined if len(joined) > 1 else joined[0]

    return per_document_forward


# Rotary tables of a packed row against each document's alone: the same arithmetic on the same positions, so equal
# up to rounding of the table's dtype (fp32 on the miniature).
TABLE_TOLERANCE = 1e-5


def _calls(module: nn.Module) -> list[dict]:
    """The keyword arguments of each table the module makes: one, or one per layer type it holds."""
    if "layer_type" in inspect.signature(type(module).forward).parameters and isinstance(module.rope_type, dict):
        return [{"layer_type": layer_type} for layer_type in module.rope_type]
    return [{}]


@torch.no_grad()
def check_rotary_tables(hf_model: nn.Module, lengths: tuple[int, ...]) -> None:
    """Refuse (UnsupportedModel) a model whose rotary tables for a packed row of documents of `lengths` differ from
    each document's tables alone, computed by a fresh copy of the module: what a switch on the input's length (the
    miniature moves such switches between the documents' lengths) does to a rotary this module does not handle.
    Every module with a `rope_type` is checked; one whose stock forward does not take 2-D position ids (multimodal
    rotaries) cannot be run alone here and is left to the packing probe."""
    isolate_rotaries(hf_model)
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    row = torch.cat([torch.arange(length) for length in lengths]).unsqueeze(0)
    for name, module in hf_model.named_modules():
        if not _rope_types(module):
            continue
        device = next((buffer.device for buffer in module.buffers()), torch.device("cpu"))
        x = torch.zeros(1, dtype=torch.float32, device=device)
        for kwargs in _calls(module):
            try:  # each document alone, from a fresh copy as a model run on it alone
                alone = [
                    _as_tuple(type(module).forward(_fresh(module), x, torch.arange(n, device=device)[None], **kwargs))
                    for n in lengths
                ]
            except (TypeError, ValueError, RuntimeError, IndexError) as error:
                logger.info("rotary module %s not checked alone (%s: %s)", name, type(error).__name__, error)
                continue
            module.__dict__[_ROW_ATTRIBUTE] = bounds.to(device)
            try:
                packed = _as_tuple(module(x, row.to(device), **kwargs))
            finally:
                module.__dict__.pop(_ROW_ATTRIBUTE, None)
            for got, want in zip(packed, (torch.cat(parts, dim=1) for parts in zip(*alone))):
                difference = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
                if not difference <= TABLE_TOLERANCE:
                    raise UnsupportedModel(
                        f"{type(hf_model).__name__}: its rotary embedding {type(module).__name__} ({name or 'the model'}, "
                        f"rope type {module.rope_type}) computes the tables of a packed row of documents of "
                        f"{'+'.join(map(str, lengths))} tokens differently from each document's alone (up to "
                        f"{difference:.1e} relative): it reads the whole input, not each token's position, and chattune "
                        "cannot give it each document's tables, so packed training would train another model"
                    )


def _fresh(module: nn.Module) -> nn.Module:
    fresh = copy.deepcopy(module)
    fresh.__dict__.pop("forward", None)  # the class's own forward
    return fresh


def _as_tuple(output) -> tuple:
    return output if isinstance(output, tuple) else (output,)
