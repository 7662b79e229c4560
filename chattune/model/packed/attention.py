"""One attention function for packed, padding-free batches, registered with transformers.

A packed microbatch is a single row (1, N) holding several documents back to back. Causal attention
over the row would let a document attend to the ones before it, so attention must run per document.
The collator passes `cu_seq_lens_q`/`max_length_q` (transformers' flash-attention kwarg names, which
the models forward untouched to the attention function); we fall back to deriving them from
`position_ids` (which restart at 0 per document) only when they are missing.

The path is chosen per layer (`attention_path`), from the device, the dtype, the layer's head size and
whether it has attention sinks (`s_aux`: gpt-oss) or logit soft-capping (`softcap`: Gemma 2). The kernels
each path calls are in `chattune.model.packed.kernels`, whose docstring says how they compute sinks,
soft-capping, grouped-query attention and what the varlen kernels do not take:

- CPU (and fp32 on CUDA): causal SDPA per document (`SDPA`: exact, simple; CPU runs are small). Layers with sinks
  or soft-capping: the same loop over documents with the scores written out (`EXACT`, fp32 softmax), as
  transformers' eager attention for gpt-oss and Gemma 2 computes them. SDPA has neither.
- CUDA bf16/fp16: a varlen flash kernel (`VARLEN`), flash-attn's where it is importable, else torch's
  `varlen_attn`. Soft-capping only through flash-attn's `softcap`; without it those layers take the exact loop.
- CUDA bf16/fp16, head sizes over 256 (Gemma 4's global layers: 512) or value heads of another size than the
  query's (multi-head latent attention): neither flash kernel takes them, so those layers take per-document SDPA
  (the exact loop with sinks or soft-capping), the others stay on varlen.
- CUDA bf16/fp16, attention sinks: torch's varlen flash kernel through its custom ops, the output rescaled by
  the sink and the backward given the sink-inclusive lse (`SINK_VARLEN`), whatever else is installed. Where
  this torch has no such ops, those layers take the exact loop. Sinks together with soft-capping (no model
  has both): the exact loop.

What is installed is decided once at import, in the kernels module, outside compiled code; the per-layer choice
and the start-up line read those decisions through that module, not copies of them (`probe_native_gqa` rebinds
one at start-up, and tests patch them there).

`attention_backend` names the path a run takes (the builder logs it at start-up), per layer where the
layers differ (`attention_features` reads what it needs from the model).

Generation (a prompt, then one token at a time against a KV cache) is not a packed row: `stock_attention`
gives the model transformers' SDPA attention for its duration (`chattune.model.generate`).

With context parallelism (`chattune.parallel.context_parallel`) each rank holds a slice of the row: an all-to-all
gives every rank the whole row for a share of the heads before the same kernels run (with those heads'
sinks), and another swaps back. The group is the attention module's own (`context_group`, set on every module
of the model by the builder), which transformers hands the attention function as its first argument.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers import AttentionInterface, PreTrainedModel

from chattune.data.packing import PackedBatch
from chattune.errors import UnsupportedModel
from chattune.hf_layout import decoder_of
from chattune.model.packed import indexed_attention, kernels
from chattune.model.packed.chunked_attention import (
    attention_chunk,
    chunk_boundaries,
    per_document_temperature,
    temperature_tuned,
)
from chattune.model.packed.mixers import isolate_documents
from chattune.model.packed.rotary import isolate_rotaries
from chattune.model.packed.row_kwargs import PREFIXES_KWARG, SHARED_KEYS_KWARG
from chattune.parallel.context_parallel import context_group_of, heads_to_sequence, sequence_to_heads

ATTENTION_NAME = "chattune_packed"


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Document boundaries of a packed row whose position ids restart at 0 per document."""
    positions = position_ids.reshape(-1)
    starts = torch.nonzero(positions == 0).reshape(-1)
    total = torch.tensor([positions.numel()], device=positions.device)
    cu_seqlens = torch.cat([starts, total]).to(torch.int32)
    return cu_seqlens, int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


# The paths a layer's attention takes (`attention_path`).
VARLEN, SINK_VARLEN, SDPA, EXACT = "varlen", "sink varlen", "per-document sdpa", "per-document exact"


def _half(dtype: torch.dtype | str) -> bool:
    return dtype in (torch.bfloat16, torch.float16, "bfloat16", "float16")


def attention_path(
    device_type: str,
    dtype: torch.dtype | str,
    head_dim: int,
    *,
    sinks: bool = False,
    softcap: bool = False,
    value_head_dim: int | None = None,
) -> str:
    """The path one layer's attention takes (VARLEN, SINK_VARLEN, SDPA or EXACT; module docstring): the varlen
    kernels only on CUDA in bf16/fp16 and for head sizes they take; sinks and soft-capping where a kernel
    computes them, else the exact per-document loop."""
    special = sinks or softcap
    if device_type != "cuda" or not _half(dtype):
        return EXACT if special else SDPA
    # head sizes neither flash kernel takes
    if head_dim > kernels.VARLEN_MAX_HEAD_DIM or value_head_dim not in (None, head_dim):
        return EXACT if special else SDPA
    if sinks:
        return SINK_VARLEN if kernels._TORCH_SINK_OPS is not None and not softcap else EXACT
    if softcap:
        return VARLEN if kernels._FLASH_ATTN_SOFTCAP else EXACT
    return VARLEN


def _path_name(path: str) -> str:
    gqa_names = {"flag": "native (enable_gqa)", "native": "native", "repeat": "by repeated kv heads"}
    if path == VARLEN:
        if kernels._FLASH_ATTN_VARLEN is not None:
            return "flash-attn varlen"
        return f"torch varlen_attn (grouped-query attention {gqa_names[kernels._varlen_gqa]})"
    if path == SINK_VARLEN:
        gqa = gqa_names["flag" if kernels._TORCH_SINK_GQA_FLAG else kernels._varlen_gqa]
        return (
            f"torch varlen flash kernel (grouped-query attention {gqa}), output times sigmoid(lse - sink), "
            "backward through the sink-inclusive lse"
        )
    if path == SDPA:
        return "per-document SDPA (a loop over documents, outside compiled graphs)"
    return (
        "per-document exact attention (scores written out, fp32 softmax; a loop over documents, "
        "outside compiled graphs)"
    )


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
        parts = [f"head size {self.head_dim}"] if self.head_dim > kernels.VARLEN_MAX_HEAD_DIM else []
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
        layers.append(
            AttentionLayer(
                head_dim=head_dim,
                sinks=isinstance(getattr(module, "sinks", None), torch.Tensor),
                softcap=bool(getattr(module, "attn_logit_softcapping", None)),
                value_head_dim=value_head_dim if isinstance(value_head_dim, int) else None,
            )
        )
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
        path = attention_path(
            device_type,
            compute_dtype,
            layer.head_dim,
            sinks=layer.sinks,
            softcap=layer.softcap,
            value_head_dim=layer.value_head_dim,
        )
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


@torch.compiler.disable  # a collective's rank: outside compiled graphs, as the all-to-all around it
def _rank_of(group) -> int:
    return dist.get_rank(group)


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
    if indexed_attention.in_document_call(module):  # a layer selecting its keys, called per document with its mask
        return indexed_attention.document_attention(
            module, query, key, value, attention_mask, dropout, scaling, **kwargs
        )
    indexed_attention.refuse_selection(module, kwargs)
    if attention_mask is not None:  # a model that builds its own mask (Doge, MPT) cannot be kept to documents here
        raise UnsupportedModel(
            f"{type(module).__name__} passes its own attention mask to the attention function; "
            f"{ATTENTION_NAME} attention takes none (packed rows pass cu_seqlens)"
        )
    if query.shape[0] != 1:
        raise ValueError(f"{ATTENTION_NAME} attention expects packed rows of batch size 1, got {query.shape[0]}")
    sinks = kwargs.get("s_aux")  # gpt-oss: (Hq,) logits, one per query head
    softcap = kwargs.get("softcap") or None  # Gemma 2; transformers passes None when off, flash-attn 0.0
    # Some models pass the window per call (Phi-3, Mistral), others keep it on the module (per layer type).
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    max_seqlen = kwargs.get("max_length_q")
    group = context_group_of(module)  # the model's (`chattune.parallel.context_parallel.set_context_group`)
    if cu_seqlens is None:
        if group is not None:  # a slice's position ids do not say where the row's documents start
            raise ValueError(f"{ATTENTION_NAME} attention under context parallelism needs the row's cu_seq_lens_q")
        if kwargs.get("position_ids") is None:  # BLT, Inkling2: nothing says where the documents are
            raise UnsupportedModel(
                f"{type(module).__name__} passes neither cu_seq_lens_q nor position_ids to its "
                "attention, so the packed attention cannot tell where a row's documents start"
            )
        cu_seqlens, max_seqlen = cu_seqlens_from_position_ids(kwargs["position_ids"])
    cu_seqlens = cu_seqlens.to(device=query.device, dtype=torch.int32)
    tuned = temperature_tuned(module)
    if tuned:  # Llama 4's NoPE layers scaled their queries by the row's places
        offset = _rank_of(group) * query.shape[2] if group is not None else 0
        query = per_document_temperature(module, query, cu_seqlens, offset)
    if group is not None:  # this rank's slice of every head -> the whole row for its share of the heads
        query, key, value = heads_to_sequence(query, key, value, group)
        if sinks is not None:
            sinks = _rank_heads(sinks, group)
    chunk = attention_chunk(module)
    if chunk is not None:  # Llama 4's chunked layers: each chunk of a document attends as a document of its own
        cu_seqlens, max_seqlen = chunk_boundaries(cu_seqlens, chunk)
    path = attention_path(
        query.device.type,
        query.dtype,
        query.shape[-1],
        sinks=sinks is not None,
        softcap=softcap is not None,
        value_head_dim=value.shape[-1],
    )
    # The row's longest document only where a varlen kernel reads it.
    max_seqlen = int(max_seqlen) if path in (VARLEN, SINK_VARLEN) else None
    options = kernels.VarlenOptions(max_seqlen, scale=scaling, window=window, dropout=dropout, softcap=softcap)
    prefixes = kwargs.get(PREFIXES_KWARG)
    if prefixes is not None:
        if group is not None or chunk is not None or tuned:  # these read the row by its own boundaries
            raise UnsupportedModel(
                f"{type(module).__name__}: shared prompts (data.share_prompts) under context parallelism, or with "
                "Llama 4's chunked or temperature-tuned attention, are not supported; set data.share_prompts=false"
            )
        # The varlen kernel with separate key offsets (`PackedBatch.shared_keys`) only where `probe_shared_varlen` saw
        # it agree on this device at start-up; sinks (never the VARLEN path) keep the exact loop.
        keys = kwargs.get(SHARED_KEYS_KWARG)
        if path == VARLEN and kernels._shared_varlen and keys is not None:
            return kernels._varlen(query, key, value, cu_seqlens, options, keys), None
        return _shared_prompt_loops(query, key, value, cu_seqlens, prefixes, options, sinks), None
    if path == VARLEN:
        output = kernels._varlen(query, key, value, cu_seqlens, options)
    elif path == SINK_VARLEN:
        output = kernels._sink_varlen(query, key, value, sinks, cu_seqlens, options)
    elif path == SDPA:
        output = kernels._per_document_sdpa(query, key, value, cu_seqlens, options)
    else:
        output = kernels._per_document_exact(query, key, value, cu_seqlens, options, sinks)
    return (output if group is None else sequence_to_heads(output, group)), None


def _shared_prompt_loops(query, key, value, cu_seqlens, prefixes, options, sinks) -> torch.Tensor:
    """A row with shared prompts through the per-document loops: each segment attends to its prompt's keys, then
    causally to its own (`PackedBatch.prefixes`): SDPA with the explicit, bottom-right aligned mask; the exact loop
    for sinks and soft-capping."""
    if sinks is not None or options.softcap is not None:
        return kernels._per_document_exact(query, key, value, cu_seqlens, options, sinks, prefixes)
    return kernels._per_document_sdpa(query, key, value, cu_seqlens, options, prefixes)


AttentionInterface.register(ATTENTION_NAME, packed_attention)


@contextlib.contextmanager
def stock_attention(hf_model: PreTrainedModel) -> Iterator[None]:
    """transformers' SDPA attention (eager where the model has no SDPA path: HY-V4's and DeepSeek-V4's sinks) instead
    of the packed one while the block runs, then the packed one again. For generation: its queries after the prompt
    are one token against a KV cache of the tokens before it, which the packed attention (whole rows, documents from
    position ids) does not take."""
    if hf_model.config._attn_implementation != ATTENTION_NAME:
        yield
        return
    # Models without an SDPA path (HY-V4's and DeepSeek-V4's sinks; Mamba and xLSTM, which use neither) take eager.
    hf_model.set_attn_implementation("sdpa" if hf_model._supports_sdpa else "eager")
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
    mixers other than attention take them too (`chattune.model.packed.mixers`), and so do rotary embeddings whose tables
    depend on the input's length (`chattune.model.packed.rotary`). `outputs`: transformers' output_*
    flags (`output_router_logits=True` for a MoE model's router logits)."""
    if batch.prefixes is not None and hf_model.config._attn_implementation != ATTENTION_NAME:
        # (another attention function would ignore the prompts' key ranges: each reply would miss its prompt)
        raise ValueError(
            f"a row whose replies share a prompt needs the {ATTENTION_NAME} attention, not "
            f"{hf_model.config._attn_implementation!r}"
        )
    isolate_documents(hf_model)
    isolate_rotaries(hf_model)
    indexed_attention.isolate_indexed_attention(hf_model)
    return decoder_of(hf_model)(
        input_ids=batch.input_ids,
        position_ids=batch.position_ids,
        use_cache=False,
        cu_seq_lens_q=batch.cu_seqlens,
        cu_seq_lens_k=batch.cu_seqlens,
        max_length_q=batch.max_seqlen,
        max_length_k=batch.max_seqlen,
        **(
            {PREFIXES_KWARG: batch.prefixes, SHARED_KEYS_KWARG: batch.keys_of_shared_prompts()}
            if batch.prefixes is not None
            else {}
        ),
        **{name: value for name, value in outputs.items() if value},
    )
