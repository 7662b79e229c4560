"""Sequence parallelism under tensor parallelism (Megatron's): between the split attention and MLP blocks, each
rank of a tp group holds 1/T of the row's tokens, not all of them.

Why: without it, everything outside the split linears runs on the whole row on every rank of the group: the
norms, the residual additions, and what activation checkpointing keeps (each layer's input), T times over. Split
by tokens, those are 1/T each, for the same traffic: the all-reduce of a block's partial sums becomes a
reduce-scatter to the ranks' tokens, and the block's input an all-gather of them (together one all-reduce's
bytes), and the same in the backward.

How the stream moves (`Stream` holds the group; each hook reads whether it is on):
- the split embedding's lookups are reduce-scattered to the ranks' tokens (`chattune.parallel.vocab_parallel`);
- the attention and the MLP take the tokens all-gathered (`gather_block_input`) and hand back their partial sums
  reduce-scattered (`finish_block_output`); a mixture of experts, whole on every rank, takes them gathered and
  hands back its own tokens' part (its gradient gathered back, so every rank's experts get the whole gradient);
- the norms (the layers' and the final one) see their rank's tokens only: their weights' gradients are summed
  over the group in the backward, as are the per-head q/k norms' (`chattune.parallel.tensor_parallel`);
- the final hidden states are all-gathered for the split output layer (`gather_for_loss`), whose rows' gradients
  of them are summed back to each rank's tokens (reduce-scatter).
A row whose length T does not divide is padded by a segment of its own (`PackedCausalLM`, as context parallelism
pads): nothing trains on it and its losses are dropped.

Generation runs with the stream whole (`Stream.whole`): one new token at a time cannot be split, and nothing is
differentiated there. Activation checkpointing's recompute runs in the backward, after the forward has
returned, so the stream is on unless a block turns it off, not only inside a forward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard


class Stream:
    """Whether the residual stream is split by tokens over the tp group (on, except inside `whole`)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        """`mesh`: the tp group's 1-D mesh."""
        self.mesh, self.group, self.split = mesh, mesh.get_group(), True
        self.size = mesh.size()

    @contextmanager
    def whole(self) -> Iterator[None]:
        previous, self.split = self.split, False
        try:
            yield
        finally:
            self.split = previous


def _all_gather_tokens(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(1, n, ...) from each rank -> (1, T n, ...) in rank order."""
    size = dist.get_world_size(group)
    gathered = local.new_empty((size * local.shape[1], *local.shape[2:]))
    dist.all_gather_into_tensor(gathered, local[0].contiguous(), group=group)
    return gathered.unsqueeze(0)


def _reduce_scatter_tokens(whole: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(1, T n, ...) summed over the ranks -> this rank's (1, n, ...)."""
    size = dist.get_world_size(group)
    local = whole.new_empty((whole.shape[1] // size, *whole.shape[2:]))
    dist.reduce_scatter_tensor(local, whole[0].contiguous(), group=group)
    return local.unsqueeze(0)


def _own_tokens(whole: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's part (1, n, ...) of the tokens of (1, T n, ...)."""
    return whole.chunk(dist.get_world_size(group), dim=1)[dist.get_rank(group)].contiguous()


class _Exchange(torch.autograd.Function):
    """`forward(tensor, group)` in the forward and `backward(grad, group)` in the backward: one of the pairs below."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup, forward: Callable, backward: Callable):
        ctx.group, ctx.exchange_back = group, backward
        return forward(tensor, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.exchange_back(grad, ctx.group), None, None, None


def reduce_scatter_tokens(partial: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Partial sums of the whole row (1, N, H) on each rank -> the sum over the group of this rank's tokens (the
    backward all-gathers)."""
    return _Exchange.apply(partial, group, _reduce_scatter_tokens, _all_gather_tokens)


def gather_for_loss(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The whole row's hidden states from each rank's tokens; each rank's gradient of them (its vocabulary rows')
    summed back to the ranks' tokens (reduce-scattered)."""
    return _Exchange.apply(local, group, _all_gather_tokens, _reduce_scatter_tokens)


def gather_block_input(stream: Stream, hidden: torch.Tensor) -> DTensor:
    """A split block's input as one replicated DTensor: its column-wise layers add their input gradients into it
    (partial sums), reduced once: scattered to the ranks' tokens (split stream) or all-reduced (whole)."""
    placement = Shard(1) if stream.split else Replicate()
    return DTensor.from_local(hidden, stream.mesh, [placement], run_check=False).redistribute(
        stream.mesh, [Replicate()]
    )


def finish_block_output(stream: Stream, output: DTensor) -> torch.Tensor:
    """A split block's partial sums (its row-wise layer's output): the rank's tokens of their sum (split stream) or
    the whole sum."""
    assert output.placements == (Partial(),), output.placements
    return output.redistribute(stream.mesh, [Shard(1) if stream.split else Replicate()]).to_local()


def gather_whole_block_input(stream: Stream, hidden: torch.Tensor) -> torch.Tensor:
    """A block whole on every rank (a mixture of experts): the row's tokens gathered, each rank's gradient of them
    the whole one (kept: this rank's part)."""
    # (every rank's gradient of the whole row is the same: the backward keeps this rank's part)
    return _Exchange.apply(hidden, stream.group, _all_gather_tokens, _own_tokens) if stream.split else hidden


def finish_whole_block_output(stream: Stream, output: torch.Tensor) -> torch.Tensor:
    """A block whole on every rank: this rank's tokens of its output, the ranks' gradients gathered back."""
    return _Exchange.apply(output, stream.group, _own_tokens, _all_gather_tokens) if stream.split else output
