"""Llama 4's attention on packed rows: its chunked layers and its NoPE layers' temperature, from each document's start.

Llama 4 computes two things from a token's place in the *input* rather than from its position id, which a packed
row (several documents back to back, position ids restarting at 0 per document) would get wrong for every
document but the first:

- **Chunked attention** (`attention_chunk_size`, the layers `layer_types` names `chunked_attention`): a query sees
  the keys of its own chunk only, chunks cut at multiples of the chunk size from the input's start. transformers
  carries it in the mask, which chattune's packed attention does not take. Cut from each document's own start,
  chunked attention within a document is causal attention within each of its chunks, so the row's document
  boundaries are refined at every chunk boundary (`chunk_boundaries`) and every kernel (per-document SDPA, the varlen
  kernels, context parallelism's whole rows) runs as for ordinary documents. One host read of the boundaries per
  forward (cached for the row's layers).
- **Attention temperature** (`attn_temperature_tuning` on the layers without rotary embeddings): the queries are
  scaled by `1 + attn_scale * log(1 + floor((p + 1) / floor_scale))` where `p` is `torch.arange` over the input, not
  the position id. The attention function receives the queries already scaled by the row's `p`; it multiplies them
  by the ratio of the document's scale to the row's (`per_document_temperature`: exact up to one rounding, both
  scales are at least 1), with each token's place in its document read from the row's boundaries (its position
  id is not passed to the attention). Under context parallelism the module saw its rank's slice, so `p` is the
  slice's arange and the place in the document counts from the slice's offset in the row.
"""

from __future__ import annotations

import torch
from torch import nn

_CHUNK_ATTRIBUTE = "_chattune_attention_chunk"
_cached: tuple[torch.Tensor, int, tuple[torch.Tensor, int]] | None = None  # (row boundaries, chunk, result)


def attention_chunk(module: nn.Module) -> int | None:
    """The chunk size of `module`'s chunked attention, or None where its layer attends without chunks."""
    if _CHUNK_ATTRIBUTE not in module.__dict__:
        config = getattr(module, "config", None)
        chunk = getattr(config, "attention_chunk_size", None)
        layer_types = getattr(config, "layer_types", None)
        index = getattr(module, "layer_idx", None)
        chunked = (
            isinstance(chunk, int)
            and isinstance(index, int)
            and isinstance(layer_types, (list, tuple))
            and index < len(layer_types)
            and layer_types[index] == "chunked_attention"
        )
        module.__dict__[_CHUNK_ATTRIBUTE] = chunk if chunked else None
    return module.__dict__[_CHUNK_ATTRIBUTE]


@torch.compiler.disable  # a host read of the boundaries: outside compiled graphs
def chunk_boundaries(cu_seqlens: torch.Tensor, chunk: int) -> tuple[torch.Tensor, int]:
    """The row's boundaries with every document also cut at each multiple of `chunk` from its own start, and the
    longest piece. The same boundaries reach every layer of a forward: the last result is reused for them."""
    global _cached
    if _cached is not None and _cached[0] is cu_seqlens and _cached[1] == chunk:
        return _cached[2]
    bounds = cu_seqlens.tolist()
    pieces = [bounds[0]]
    for start, end in zip(bounds[:-1], bounds[1:]):
        pieces.extend(range(start + chunk, end, chunk))
        pieces.append(end)
    longest = max((b - a for a, b in zip(pieces[:-1], pieces[1:])), default=0)
    result = torch.tensor(pieces, dtype=torch.int32, device=cu_seqlens.device), longest
    _cached = (cu_seqlens, chunk, result)
    return result


def temperature_tuned(module: nn.Module) -> bool:
    """Whether `module` scales its queries by Llama 4's attention temperature (its layers without rotary)."""
    return bool(getattr(module, "attn_temperature_tuning", False)) and not getattr(module, "use_rope", True)


def _temperature(places: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """Llama 4's query scale at 0-based `places` (as `Llama4TextAttention.forward` computes it)."""
    return torch.log1p(torch.floor((places.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0


def document_places(cu_seqlens: torch.Tensor, offset: int, length: int) -> torch.Tensor:
    """(length,) each token's place in its document for tokens [offset, offset + length) of the row."""
    cu_seqlens = cu_seqlens.to(torch.long)
    tokens = torch.arange(offset, offset + length, device=cu_seqlens.device)
    document = torch.searchsorted(cu_seqlens, tokens, right=True) - 1
    return tokens - cu_seqlens[document]


def per_document_temperature(
    module: nn.Module, query: torch.Tensor, cu_seqlens: torch.Tensor, offset: int
) -> torch.Tensor:
    """`query` (1, H, n, D), scaled by `module` with the row's places 0..n-1, rescaled to each token's place in its
    document (module docstring)."""
    length = query.shape[2]
    row = torch.arange(length, device=query.device)
    ratio = _temperature(document_places(cu_seqlens.to(query.device), offset, length), module) / _temperature(
        row, module
    )
    return (query.float() * ratio.view(1, 1, length, 1)).to(query.dtype)
