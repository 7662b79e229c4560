"""Context parallelism: one packed row laid across the C ranks of a context group, so that a conversation longer
than one rank's token budget trains whole (`parallel.context`).

Each rank of the group holds a contiguous slice of the row, N/C tokens (the row is padded to a multiple of C
by a padding segment of its own). The documents in the row, and so `cu_seqlens`, are those of the whole row,
and each slice keeps the row's position ids, so rotary positions are computed as in the whole row. Every
layer but attention works token by token (the start-up packing probe refuses models with any other layer that
mixes tokens: convolutions, state-space mixers, positions that ignore position ids), so only attention needs
the rest of the row. It gets it DeepSpeed-Ulysses style: before attention one all-to-all swaps (N/C tokens,
all heads) for (all N tokens, H/C heads); the varlen kernel of the one-rank path then runs on whole documents
with the row's `cu_seqlens`; a second all-to-all swaps back. Nothing else changes: the output layer's
chunked loss runs on the rank's own N/C tokens.

Why Ulysses and not ring attention:
- It is exact with the kernels we already have (flash-attn varlen, torch varlen_attn, per-document SDPA):
  each head group sees whole documents. Ring attention merges partial softmaxes block by block and, for
  packed rows, has to cut every document's causal work across the ring (zig-zag balancing depends on where
  the documents fall), which needs a varlen ring kernel of its own.
- Its traffic per rank falls as 1/C (each all-to-all moves N/C tokens' q, k, v or output); a ring moves
  every rank's keys and values past every rank.
- Its limit: C must divide the number of query heads (refused at start-up otherwise). A model with fewer
  kv heads than C has them repeated before the swap (only as often as the split needs). The 1.7B-8B chat
  models have 16-64 query heads, so C up to 16 covers 256k-token chats on today's GPUs; ring attention is
  what would go past that.

The loss: each rank computes the per-token losses of its slice, and `gather_row` all-gathers them into the
whole row's (N,) for the objective, whose per-document sums (DPO's pairs, per-source figures) then see whole
documents. Every rank of the group computes the same objective on the same row, and the gather's backward
hands each rank the gradient of its own slice only (it does not sum over the group), so each token's
gradient is counted once over the group. The update step counts a row's loss units, and reports its losses
and figures, on the group's first rank only (`ParallelDims.reports_rows`), so the global unit count is the same
as on one rank per row.

The group is the model's: the builder gives `PackedCausalLM` the run's context group (`ParallelDims.cp_group`), which
sets it on itself and every module of the Hugging Face model (`set_context_group`, attribute `context_group`), where
the loss (`PackedCausalLM.forward`) and the attention function (`packed_attention`, handed its module by
transformers) read it. A model without it (None, or never set: a start-up probe's miniature) runs its rows whole;
`split_across` and `whole_rows` set it for the duration of a block.

Every collective here runs eagerly, outside compiled graphs (`torch.compiler.disable`): a compiled decoder
layer breaks its graph around the exchange, and its matmuls stay compiled.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from chattune.data.documents import IGNORE_INDEX
from chattune.data.packing import PackedBatch
from chattune.errors import UnsupportedModel

CONTEXT_GROUP = "context_group"  # the attribute of a model's modules that holds its context group (None: whole rows)


def check_heads(num_heads: int, context_size: int, model_name: str = "the model") -> None:
    """Refuse a context size that does not divide the query heads: the swap gives each rank H/C whole heads."""
    if context_size > 1 and num_heads % context_size:
        raise UnsupportedModel(
            f"parallel.context={context_size} does not divide the {num_heads} attention heads of {model_name}: "
            f"each rank of a context group attends with heads/context of them; choose a divisor of {num_heads}"
        )


def _all_to_all(x: torch.Tensor, group: ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Chunk j of `x` along `scatter_dim` goes to rank j of `group`; what rank i sent becomes chunk i along
    `gather_dim`."""
    size = dist.get_world_size(group)
    send = torch.stack(x.chunk(size, dim=scatter_dim)).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


@torch.compiler.disable
def heads_to_sequence(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(1, H, N/C, D) slices of every head → (1, H/C, N, D): the whole row for this rank's heads. Kv heads that
    C does not divide are repeated first, each as often as the split needs (grouped-query attention keeps
    pairing query head h with kv head h // (Hq / Hkv) within each rank's contiguous group of heads)."""
    size = dist.get_world_size(group)
    kv_heads = key.shape[1]
    if kv_heads % size:
        repeats = size // math.gcd(kv_heads, size)
        key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
    return tuple(_AllToAll.apply(t, group, 1, 2) for t in (query, key, value))


@torch.compiler.disable
def sequence_to_heads(output: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Attention's (1, N, H/C, D) output for this rank's heads → (1, N/C, H, D), this rank's slice of every head."""
    return _AllToAll.apply(output, group, 1, 2)


class _GatherRow(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, group: ProcessGroup, length: int) -> torch.Tensor:
        ctx.group, ctx.per_rank = group, local.shape[0]
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts)[:length].clone()  # the row without its padding, a tensor of its own

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # Every rank of the group computes the same objective from the gathered row: each keeps the gradient of
        # its own slice (summing over the group would count every token's gradient C times).
        rank, per_rank = dist.get_rank(ctx.group), ctx.per_rank  # (the row's padding: its last slices' tails)
        mine = grad[rank * per_rank : (rank + 1) * per_rank]
        return torch.cat([mine, mine.new_zeros(per_rank - mine.shape[0])]), None, None


@torch.compiler.disable
def gather_row(local: torch.Tensor, group: ProcessGroup, length: int) -> torch.Tensor:
    """The whole row's first `length` per-token values (its padding dropped) from each rank's slice, concatenated
    in rank order."""
    return _GatherRow.apply(local, group, length)


def padded_length(num_tokens: int, context_size: int) -> int:
    return -(-num_tokens // context_size) * context_size


def row_slice(batch: PackedBatch, context_size: int, context_rank: int, slice_multiple: int = 1) -> PackedBatch:
    """This rank's contiguous slice of a packed row, for the decoder and the output layer: its tokens, labels
    and position ids, with the whole row's `cu_seqlens` (attention, after the swap, sees the whole row). A row
    whose length C (times `slice_multiple`: each slice split further by tokens, `chattune.parallel.sequence_parallel`)
    does not divide is first padded by a segment of its own (pad id 0, nothing trained); its losses are dropped by
    the caller (`PackedCausalLM`). Per-document bookkeeping (segment and document ids) stays with the whole row,
    which is what the objectives read."""
    length = batch.num_tokens
    padding = padded_length(length, context_size * slice_multiple) - length
    input_ids, labels, position_ids, cu_seqlens = batch.input_ids, batch.labels, batch.position_ids, batch.cu_seqlens
    if padding:

        def extend(t: torch.Tensor, fill) -> torch.Tensor:
            tail = (
                fill
                if isinstance(fill, torch.Tensor)
                else torch.full((1, padding), fill, dtype=t.dtype, device=t.device)
            )
            return torch.cat([t, tail.view(1, padding).to(t.device, t.dtype)], dim=1)

        input_ids = extend(input_ids, 0)
        labels = extend(labels, IGNORE_INDEX)
        # Made on the row's device: a tensor built on the host and copied over (arange, new_tensor) is a copy from
        # pageable memory, which waits for the device (two syncs a microbatch).
        position_ids = extend(position_ids, torch.arange(padding, device=position_ids.device))
        cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_full((1,), length + padding)])
    per_rank = (length + padding) // context_size
    piece = slice(context_rank * per_rank, (context_rank + 1) * per_rank)
    return dataclasses.replace(
        batch,
        input_ids=input_ids[:, piece],
        labels=labels[:, piece],
        position_ids=position_ids[:, piece],
        cu_seqlens=cu_seqlens,
        max_seqlen=max(batch.max_seqlen, padding),
    )


def set_context_group(model: torch.nn.Module, group: ProcessGroup | None) -> None:
    """Split `model`'s packed rows across `group` (None: run them whole): set on the model and on every module
    in it, so whatever module reaches the attention function carries it. Set it before compiling: a compiled layer
    reads it under a guard, and a later change would recompile it."""
    for module in model.modules():
        setattr(module, CONTEXT_GROUP, group)


def context_group_of(module: torch.nn.Module) -> ProcessGroup | None:
    """The context group `module`'s rows are split across; None: whole rows (also for a module never given one)."""
    return getattr(module, CONTEXT_GROUP, None)


@contextmanager
def split_across(model: torch.nn.Module, group: ProcessGroup | None) -> Iterator[None]:
    """`model`'s forwards inside run split across `group` (None: whole), then as before: the start-up probes."""
    before = {module: module.__dict__.get(CONTEXT_GROUP) for module in model.modules()}
    set_context_group(model, group)
    try:
        yield
    finally:
        for module, group_before in before.items():
            setattr(module, CONTEXT_GROUP, group_before)


def whole_rows(model: torch.nn.Module):
    """`model`'s forwards inside run every row whole on each rank, as without context parallelism: the start-up
    probes of a model's miniature, which each rank runs on its own."""
    return split_across(model, None)


@torch.no_grad()
def split_hidden_states(hidden_states_of, batch: PackedBatch, group: ProcessGroup) -> torch.Tensor:
    """The final hidden states (N, H) of a whole row computed split across `group`, each rank its slice
    (`hidden_states_of(slice)`, a decoder forward), gathered: what the start-up probe compares with the row run
    whole (`chattune.model.checks.packing_probe.check_context_split`)."""
    local = hidden_states_of(row_slice(batch, dist.get_world_size(group), dist.get_rank(group)))
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts)[: batch.num_tokens]
