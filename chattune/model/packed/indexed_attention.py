"""Attention that selects its keys per query (an indexer, block selection, compressed keys) on packed rows.

Some attention layers do not attend to every earlier token: a small scorer (the "indexer") picks, for each query,
the keys it may attend to, and the layer attends only to those.

- DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5 `glm_moe_dsa`, dots.llm3 `dots3_note`, HY-V4, A.X-K2): the
  indexer scores every earlier token (`sum_h w_h * relu(q_h . k)`) and keeps the `index_topk` best. GLM-5 and
  HY-V4 let some layers reuse the previous layer's selection (`prev_topk_indices`, "shared" indexer layers).
- Qwen4-Exp's QSA: the indexer pools the keys into blocks of `indexer_compress_ratio` tokens, keeps the
  `indexer_budget / indexer_compress_ratio` best blocks and the unfinished last block.
- MiniMax-M3's sparse layers: per query, the `index_topk_blocks` best blocks of `index_block_size` keys and the
  `index_local_blocks` blocks before it.
- DeepSeek-V4's compressed layers: the document's keys within a sliding window, then compressed entries (one
  per `compress_rates[...]` tokens: heavily compressed attention attends to all of them, compressed sparse
  attention to the `index_topk` its indexer picks), each query seeing only entries of windows it has passed.

Each of these computes its selection from a causal mask the decoder builds, and transformers' eager and SDPA paths
fold the selection into that mask; chattune's packed rows have no mask (documents are kept apart by `cu_seqlens`),
so these models crashed on the indexer's `attention_mask[:, 0]` or, where the layer hands its selection to the
attention function as `block_indices` (MiniMax-M3), trained dense attention. A selection made over the whole row
would also be wrong: the top-k would be chosen among earlier documents' tokens too. Even with a block-diagonal mask
it would not be exact: `topk` breaks ties by where they lie in the scores it is given (a row's N columns or a
document's L), and ties are common (the ReLU makes many scores exactly 0), so only scores of the document's own
shape choose the keys stock chooses.

So such a layer runs **per document**, as `chattune.model.packed.mixers` runs convolutions and SSMs: the attention module's
own forward is called once per document (each segment of `cu_seqlens`: a DPO pair's chosen and rejected replies are
two), with that document's slice of the hidden states, position embeddings and position ids, and that document's own
causal mask (with the layer's sliding window, as the stock decoder builds it), in the form stock transformers gives it
(`HANDLED`: boolean as for SDPA, or DeepSeek-V4's additive float, which its forward concatenates with its compressed
entries' bias). The indexer, the compressor and everything else in the layer therefore see exactly what they see
when the document runs alone: `topk(min(index_topk, L))` over the same (L, L) scores, so the same keys, ties broken
alike; the indexer's O(L^2 * heads) scores stay per document instead of O(N^2 * heads) for the row. A layer's
selection handed to the next layer (GLM-5, HY-V4) goes back into the row as each document's local indices, padded
with -1 to the widest, and is cut per document again for the next layer. The layer's projections run per document
too (a loop over documents per layer, outside compiled graphs, as the mixers' per-document path): one mechanism for
all of these, where calling only the indexer per document would leave Qwen4-Exp (whose indexer returns a mask) and
DeepSeek-V4 (whose keys include compressed entries) to other code.

Inside such a call transformers hands chattune's attention function the document's mask and, for the DeepSeek
Sparse Attention family (whose forward passes its selection only to attention functions other than eager and SDPA),
the selected keys as `indices` (MiniMax-M3: `block_indices`). `document_attention` computes what transformers'
eager attention computes with the mask it would have built: the mask with the selection folded in (as the models'
own eager branches fold it: `indices` scattered, `block_indices` through the indexer's `build_block_mask`), then
SDPA with that mask, or, for layers with attention sinks (HY-V4, DeepSeek-V4) or soft-capping, the scores written
out with an fp32 softmax. Keys may outnumber queries (DeepSeek-V4's compressed entries after the document's own).
The mask carries the window; the `sliding_window` argument is ignored, as eager ignores it.
On CUDA this is the same masked SDPA per document: no sparse kernel (flash-mla's) is used, so a layer costs dense
attention over its document plus an (L, L) mask, which SDPA keeps for the backward.

Qwen4-Exp's per-layer n-gram embeddings (PLE, off in its default config, on in its checkpoints) hash each token with
the tokens before it and run a dilated convolution over the row: `Qwen4ExpTextPLELayer` runs per document too, so a
document's n-grams start from the end-of-sequence context, as alone, instead of the previous document's tokens.

DeepSeek-V4 is supported exactly rather than refused (it was refused because chattune's per-document kernels cut
the keys to the document and dropped its compressed entries): the same per-document call needs nothing of its own.
Its compressors and indexer run on the document as stock runs them on a document alone, and the mask its forward
builds (the sliding window over the document's keys, then each compressed entry's causal and selected bias) is
honoured as eager honours it, with its sinks; its hash routing and hyper-connections work token by token.

Context parallelism is refused for these layers (`check_context_parallel`): a rank holds a slice of a document, and
the selection needs all of its earlier tokens. An attention layer with an indexer of a kind not in `HANDLED` is refused
at start-up (`check_indexed_attention`), and so is a layer outside it that hands its attention function a selection
(`refuse_selection`, in `chattune.model.packed.attention.packed_attention`): chattune would otherwise attend densely.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from chattune.errors import UnsupportedModel
from chattune.model.packed import isolation
from chattune.model.packed.row_kwargs import SHARED_PROMPT_KWARGS
from chattune.parallel.context_parallel import context_group_of


@dataclass(frozen=True)
class IndexedLayer:
    """How one attention class of transformers selects its keys, for the per-document call."""

    selection: str  # what it selects, in words (refusals name it)
    float_mask: bool = False  # its forward needs eager's additive mask (0 / min) rather than SDPA's boolean one


_DSA = "DeepSeek Sparse Attention (an indexer's top-k keys per query)"
# The attention classes of transformers run per document, by class name.
HANDLED = {
    "DeepseekV32Attention": IndexedLayer(_DSA),
    "GlmMoeDsaAttention": IndexedLayer(_DSA),
    "Dots3NoteTextAttention": IndexedLayer(_DSA),
    "HYV4Attention": IndexedLayer(_DSA),
    "AXK2Attention": IndexedLayer(_DSA),
    "Qwen4ExpTextAttention": IndexedLayer("QSA (an indexer's top-k key blocks per query)"),
    "MiniMaxM3VLAttention": IndexedLayer("block-sparse attention (an indexer's top-k key blocks per query)"),
    "DeepseekV4Attention": IndexedLayer(
        "compressed attention (compressed key entries, an indexer's top-k of them)", float_mask=True
    ),
}
# Other modules that read the tokens before them and are run per document alongside (no attention in them).
PER_DOCUMENT_MODULES = {"Qwen4ExpTextPLELayer": "per-layer n-gram embeddings (hashed n-grams, a dilated convolution)"}
# The packed-row kwargs transformers forwards; a per-document call is one document and takes none of them.
_ROW_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
_ROW_ATTRIBUTE = "_chattune_indexed_row"  # the row's cu_seqlens, for modules whose layer does not pass them on
_IN_DOCUMENT = "_chattune_in_document"  # set on an attention module while its forward runs on one document
# The kwargs in which attention modules hand their attention function a selection of keys.
SELECTION_KWARGS = ("indices", "block_indices")

INDEXERS = isolation.register(
    "indexers", "indexers and compressors that choose keys among earlier tokens: each document's from its own"
)


def selects_keys(module: nn.Module) -> bool:
    """Whether an attention module of `HANDLED` selects its keys in this layer: it has an indexer (or compressor), or
    reuses the previous layer's selection (GLM-5's and HY-V4's shared layers). Dots3's and MiniMax-M3's dense layers,
    DeepSeek-V4's sliding-only ones, take chattune's packed attention as every other layer."""
    return (
        getattr(module, "indexer", None) is not None
        or getattr(module, "compressor", None) is not None
        or bool(getattr(module, "skip_topk", False))
    )


def _per_document_modules(hf_model: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Module]]:
    """(parent, its name for the module, module) for every module of `hf_model` run per document."""
    for parent in hf_model.modules():
        for name, child in parent.named_children():
            kind = type(child).__name__
            if kind in PER_DOCUMENT_MODULES or kind in HANDLED and selects_keys(child):
                yield parent, name, child


def _described(kind: str) -> str:
    return HANDLED[kind].selection if kind in HANDLED else PER_DOCUMENT_MODULES[kind]


def check_indexed_attention(hf_model: nn.Module) -> None:
    """Refuse (UnsupportedModel) a model with an indexer outside the attention classes of `HANDLED`: its selection
    would not be kept to each document, or not applied at all."""
    covered: set[int] = set()
    for module in hf_model.modules():
        if type(module).__name__ in HANDLED:
            covered.update(id(inner) for inner in module.modules())
    unknown = sorted(
        {
            type(module).__name__
            for module in hf_model.modules()
            if type(module).__name__.endswith("Indexer") and id(module) not in covered
        }
    )
    if unknown:
        raise UnsupportedModel(
            f"{type(hf_model).__name__} selects the keys each query attends to with {', '.join(unknown)}, which "
            "chattune does not run per document: on packed rows its selection would be made among other "
            "documents' tokens, or not applied (chattune handles the indexers of "
            f"{', '.join(sorted(HANDLED))})"
        )


def isolate_indexed_attention(hf_model: nn.Module) -> None:
    """Give every module of `hf_model` that `HANDLED` (where it selects keys) or `PER_DOCUMENT_MODULES` name the
    per-document forward of the module docstring (an instance attribute: parameter names, state dicts and FSDP's
    hooks are unchanged). Idempotent; cheap when done. The forward is bound to its module and the hook finds its
    module by name, so a deep copy of the model (`check_stock_attention`'s) runs its own weights."""
    if hf_model.__dict__.get("_chattune_indexed_isolated"):
        return
    check_indexed_attention(hf_model)
    for parent, name, module in list(_per_document_modules(hf_model)):
        if "forward" not in module.__dict__:
            module.forward = types.MethodType(_packed_forward, module)
            # Qwen4-Exp's layer does not pass the row's kwargs on to its n-gram embeddings: the layer's call has them.
            parent.register_forward_pre_hook(_remember_row(name), with_kwargs=True)
    hf_model.__dict__["_chattune_indexed_isolated"] = True


def check_context_parallel(hf_model: nn.Module, context_size: int) -> None:
    """Refuse context parallelism for a model with layers run per document here (module docstring: why)."""
    kinds = sorted({type(module).__name__ for _, _, module in _per_document_modules(hf_model)})
    if context_size > 1 and kinds:
        layers = ", ".join(f"{kind}: {_described(kind)}" for kind in kinds)
        raise UnsupportedModel(
            f"{type(hf_model).__name__} has layers that read each document's earlier tokens outside the attention "
            f"kernel ({layers}), which need the whole document on one rank, and parallel.context splits packed "
            "rows across ranks: set parallel.context=1"
        )


def indexed_path_name(hf_model: nn.Module) -> str | None:
    """What the layers run per document here compute, for the start-up `compute:` line (None for a model without
    them): the attention line's path does not hold for them."""
    counts: dict[str, int] = {}
    for _, _, module in _per_document_modules(hf_model):
        kind = type(module).__name__
        counts[kind] = counts.get(kind, 0) + 1
    if not counts:
        return None
    layers = "; ".join(f"{kind} x{count}: {_described(kind)}" for kind, count in sorted(counts.items()))
    return (
        f"layers run per document ({layers}): a selection folded into each document's mask, attention by "
        "masked SDPA per document (scores written out where there are sinks); no sparse kernel"
    )


def _remember_row(name: str) -> Callable:
    def hook(layer, args, kwargs):
        getattr(layer, name).__dict__[_ROW_ATTRIBUTE] = kwargs.get("cu_seq_lens_q")

    return hook


def in_document_call(module: nn.Module) -> bool:
    """Whether `module`'s forward is running on one document of a packed row (`document_attention` then attends)."""
    return getattr(module, _IN_DOCUMENT, False)


@functools.cache
def _signature(cls: type) -> tuple[inspect.Signature, str | None]:
    """The signature of a module class's forward (self included) and the name of its **kwargs, if any."""
    signature = inspect.signature(cls.forward)
    variadic = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    return signature, variadic


@torch.compiler.disable  # a loop whose bounds come from the data: outside compiled graphs
def _packed_forward(module: nn.Module, *args, **kwargs):
    """The forward of a module run per document (module docstring), bound to it by `isolate_indexed_attention`."""
    forward = type(module).forward
    signature, variadic = _signature(type(module))
    arguments = dict(signature.bind(module, *args, **kwargs).arguments)
    arguments.pop(next(iter(signature.parameters)))  # self
    arguments.update(arguments.pop(variadic, {}) if variadic else {})
    cu_seqlens = arguments.get("cu_seq_lens_q", module.__dict__.get(_ROW_ATTRIBUTE))
    cache = arguments.get("cache", arguments.get("past_key_values"))
    if cu_seqlens is None or cache is not None:  # generation (transformers' own attention and masks)
        return forward(module, *args, **kwargs)
    if arguments.get("attention_mask") is not None or arguments.get("conv_mask") is not None:
        raise ValueError(f"{type(module).__name__}: a packed row takes no attention mask")
    if context_group_of(module) is not None:
        raise UnsupportedModel(
            f"{type(module).__name__} selects its keys among each document's earlier tokens, which needs the "
            "whole document on one rank: train it with parallel.context=1"
        )
    if any(arguments.get(name) is not None for name in SHARED_PROMPT_KWARGS):  # (its call is per segment)
        raise UnsupportedModel(
            f"{type(module).__name__} selects its keys among each document's earlier tokens, document by document, "
            "and does not select among a shared prompt's for the replies that continue it; set data.share_prompts=false"
        )
    arguments = {key: value for key, value in arguments.items() if key not in _ROW_KWARGS}
    hidden = arguments["hidden_states"]
    if hidden.shape[0] != 1:
        raise ValueError(f"packed rows have batch size 1, got hidden states of shape {tuple(hidden.shape)}")
    length = hidden.shape[1]
    float_mask = HANDLED.get(type(module).__name__, IndexedLayer("")).float_mask
    bounds = cu_seqlens.tolist() if isolation.isolating(INDEXERS) else [0, length]
    outputs = []
    setattr(module, _IN_DOCUMENT, True)
    try:
        for start, end in zip(bounds[:-1], bounds[1:]):
            call = {key: _document_part(value, length, start, end) for key, value in arguments.items()}
            if "attention_mask" in call:
                call["attention_mask"] = document_mask(module, end - start, hidden, float_mask)
            outputs.append(forward(module, **call))
    finally:
        setattr(module, _IN_DOCUMENT, False)
    return _row_output(outputs)


def _document_part(value, length: int, start: int, end: int):
    """One document's part of an argument of a packed row's call: per-token tensors (1, N, ...) cut to [start, end),
    in tuples, lists and dicts too (position embeddings: DeepSeek-V4's by rotary kind); anything else as it is.
    A previous layer's selection (1, N, k) is each document's local indices, cut alike."""
    if torch.is_tensor(value):
        return value[:, start:end] if value.dim() >= 2 and value.shape[:2] == (1, length) else value
    if isinstance(value, (tuple, list)):
        return type(value)(_document_part(item, length, start, end) for item in value)
    if isinstance(value, dict):
        return {key: _document_part(item, length, start, end) for key, item in value.items()}
    return value


def document_mask(module: nn.Module, length: int, like: torch.Tensor, float_mask: bool) -> torch.Tensor:
    """(1, 1, L, L): the causal mask of one document, within the layer's sliding window where it has one, as the
    stock decoder builds it for the layer: boolean (True where visible, as for SDPA) or, `float_mask`, additive in
    `like`'s dtype (0 where visible, the dtype's min elsewhere, as for eager)."""
    positions = torch.arange(length, device=like.device)
    distance = positions[:, None] - positions[None, :]
    visible = distance >= 0
    window = getattr(module, "sliding_window", None)
    if isinstance(window, int) and not isinstance(window, bool):
        visible = visible & (distance < window)
    visible = visible[None, None]
    if not float_mask:
        return visible
    return torch.zeros(visible.shape, dtype=like.dtype, device=like.device).masked_fill(
        ~visible, torch.finfo(like.dtype).min
    )


def _row_output(outputs: list):
    """The documents' outputs as the row's: hidden states (1, L, H) back to back; a selection handed to the next
    layer (integer (1, L, k)) padded with -1 to the widest k first; attention weights (None here) stay None."""
    if torch.is_tensor(outputs[0]):
        return torch.cat(outputs, dim=1)
    parts = []
    for items in zip(*outputs):
        if all(item is None for item in items):
            parts.append(None)
        elif all(torch.is_tensor(item) and not item.is_floating_point() and item.dim() == 3 for item in items):
            width = max(item.shape[-1] for item in items)
            parts.append(torch.cat([F.pad(item, (0, width - item.shape[-1]), value=-1) for item in items], dim=1))
        elif all(torch.is_tensor(item) and item.is_floating_point() and item.dim() == 3 for item in items):
            parts.append(torch.cat(items, dim=1))
        else:
            raise ValueError(f"an indexed attention layer returned {[type(item).__name__ for item in items]}")
    return tuple(parts)


def _selection_mask(module: nn.Module, mask: torch.Tensor, key_length: int, query, kwargs: dict) -> torch.Tensor:
    """The document's mask with the layer's selection folded in, as the models' eager branches fold it: `indices`
    (B, L, k) of selected keys (-1: none) scattered; MiniMax-M3's `block_indices` through its indexer's own
    `build_block_mask`. Qwen4-Exp and DeepSeek-V4 fold theirs into the mask themselves."""
    indices = kwargs.get("indices")
    if indices is not None:
        indices = indices.long()
        safe = torch.where(indices >= 0, indices, key_length)  # -1 (padding, a shorter document's) to a dropped column
        selected = torch.zeros((*indices.shape[:-1], key_length + 1), dtype=torch.bool, device=indices.device)
        selected = selected.scatter(-1, safe, True)[..., :key_length].unsqueeze(1)  # (B, 1, L, K)
        if mask.dtype == torch.bool:
            return mask & selected
        return mask.masked_fill(~selected, torch.finfo(mask.dtype).min)
    block_indices = kwargs.get("block_indices")
    if block_indices is not None:
        return module.indexer.build_block_mask(
            block_indices, mask, key_length, query.dtype, query.device, kwargs["position_ids"]
        )
    return mask


@torch.compiler.disable  # called from the per-document loop, outside compiled graphs
def document_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of one document's queries (1, Hq, L, D) to its keys and values (1, Hkv, K, D), K >= L, under the
    mask the layer's forward built from `document_mask` (module docstring), as transformers' eager attention computes
    it. Returns (1, L, Hq, Dv) and no weights."""
    mask = _selection_mask(module, attention_mask, key.shape[2], query, kwargs)
    sinks = kwargs.get("s_aux")  # HY-V4, DeepSeek-V4: (Hq,) logits, one per query head
    softcap = kwargs.get("softcap") or None
    if sinks is None and softcap is None:
        output = F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=mask,
            dropout_p=dropout,
            scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1],
        )
        return output.transpose(1, 2).contiguous(), None
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # transformers' repeat_kv: query head h reads kv head h // groups
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query.float(), key.float().transpose(2, 3)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    if sinks is not None:
        sink = sinks.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    if dropout:
        probs = F.dropout(probs, p=dropout)
    output = torch.matmul(probs, value.float()).to(query.dtype)
    return output.transpose(1, 2).contiguous(), None


def refuse_selection(module: nn.Module, kwargs: dict) -> None:
    """Refuse (UnsupportedModel) an attention call outside a per-document one that hands a selection of keys
    (`SELECTION_KWARGS`): chattune's packed attention would attend to every earlier key of the document instead."""
    given = [name for name in SELECTION_KWARGS if kwargs.get(name) is not None]
    if given:
        raise UnsupportedModel(
            f"{type(module).__name__} hands its attention function a selection of keys per query ({', '.join(given)}), "
            "which chattune's packed attention does not apply: it would train dense attention instead"
        )
