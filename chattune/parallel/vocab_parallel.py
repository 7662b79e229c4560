"""The vocabulary split over a tensor-parallel group (loss-parallel): the output layer's rows and the input
embedding's rows, 1/T of the vocabulary on each rank of the group, as Megatron does.

Why: left whole, the output layer is the one weight tensor parallelism does not divide (Qwen3-0.6B's 151936 x
1024 is a quarter of the model), and every rank of the group would compute the same full-vocabulary logits,
T times the head's matmuls. Split, each rank computes the logits of its own rows only:
- the loss (`vocab_parallel_token_losses`): each rank's log-sum-exp over its rows and the target's logit where
  the target is among them, gathered over the group (2 floats a token and rank), give every rank the whole
  loss; the backward needs no exchange (each rank's log-sum-exp gets the share of the whole softmax its rows
  hold). The chunked loss computes both from its chunk's logits (`chattune.model.head.chunked_loss`), cut-cross-entropy
  from its loss over the rank's rows (`chattune.model.head.fused_loss`);
- the hidden states' gradient is a sum over the group's rows, all-reduced once in the backward
  (`chattune.parallel.tensor_parallel.sum_gradients_over`), before the final norm and the layers see it;
- the input embedding (`split_embedding`): each rank looks up the tokens among its rows, zeros for the others,
  and the group sums the rows (an all-reduce of the hidden states in the forward). A tied model's one matrix is
  split once and serves both. The embedding's `padding_idx` (whose row gets no gradient) is kept, on the rank
  holding that row.
The output layer's own forward (generation) gathers the full logits (torch's ColwiseParallel, output
Replicate). Split rows follow DTensor's Shard(0) (the first ranks hold one more where T does not divide the
vocabulary).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from torch.nn.utils.stateless import _reparametrize_module
from transformers import PreTrainedModel

from chattune.data.documents import IGNORE_INDEX
from chattune.errors import UnsupportedModel
from chattune.parallel.sequence_parallel import Stream, gather_for_loss, reduce_scatter_tokens
from chattune.parallel.tensor_parallel import SumGradientOverGroup, split_over


@dataclass(frozen=True)
class VocabShard:
    """This rank's rows [start, stop) of the vocabulary, and the group holding the others."""

    start: int
    stop: int
    group: dist.ProcessGroup


def vocab_shard(weight: DTensor) -> VocabShard:
    """The rows of `weight` (a (V, H) DTensor split over the mesh axis "tp") this rank holds."""
    shape, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
    mesh = weight.device_mesh
    group = mesh.get_group((mesh.mesh_dim_names or ("tp",)).index("tp"))
    return VocabShard(offset[0], offset[0] + shape[0], group)


def local_head(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stream: Stream | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, VocabShard | None]:
    """What a loss computes this rank's logits from: (hidden states (N, H), output weight, bias, rows), from the
    decoder's (1, n, H). Whole (rows None) unless the output layer is split over tp; split, this rank's rows, and
    the row's hidden states gathered from the ranks' tokens (`stream`, split by tokens) or whole; either way their
    gradient is summed over the group in the backward (each rank's logits contribute their rows' part)."""
    if not split_over(weight):
        return hidden[0], weight, bias, None
    assert isinstance(weight, DTensor)
    rows = vocab_shard(weight)
    if isinstance(bias, DTensor):
        bias = bias.to_local()
    if stream is not None and stream.split:
        hidden = gather_for_loss(hidden, rows.group)
    else:
        hidden = SumGradientOverGroup.apply(hidden, rows.group)
    return hidden[0], weight.to_local(), bias, rows


def local_targets(labels: torch.Tensor, rows: VocabShard) -> tuple[torch.Tensor, torch.Tensor]:
    """(each token's target as an index into this rank's rows, 0 where it is not among them; whether it is)."""
    local = labels - rows.start
    here = (local >= 0) & (local < rows.stop - rows.start) & (labels != IGNORE_INDEX)
    return local.masked_fill(~here, 0), here


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from each rank's log-sum-exp over its rows and its target logit (0 where the target
    is another rank's), over a vocabulary split across `rows.group`."""

    @staticmethod
    def forward(
        ctx, local_lse: torch.Tensor, target: torch.Tensor, ignored: torch.Tensor, rows: VocabShard
    ) -> torch.Tensor:
        mine = torch.stack([local_lse.float(), target.float()])  # (2, n)
        gathered = mine.new_empty(dist.get_world_size(rows.group) * 2, mine.shape[1])
        dist.all_gather_into_tensor(gathered, mine, group=rows.group)
        gathered = gathered.view(-1, 2, mine.shape[1])  # (T, 2, n)
        lse = torch.logsumexp(gathered[:, 0], dim=0)
        ctx.save_for_backward(local_lse, lse, ignored)
        return (lse - gathered[:, 1].sum(0)).masked_fill(ignored, 0.0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        # Every rank of the group holds the same losses and the same gradient for them: each differentiates its own
        # rows' part with no exchange. d loss / d local_lse = exp(local_lse - lse): chained through local_lse's
        # softmax, each logit gets the whole vocabulary's softmax.
        local_lse, lse, ignored = ctx.saved_tensors
        grad = grad.masked_fill(ignored, 0.0)
        return (grad * torch.exp(local_lse.float() - lse)).to(local_lse.dtype), -grad, None, None


def vocab_parallel_token_losses(
    local_lse: torch.Tensor, target: torch.Tensor, labels: torch.Tensor, rows: VocabShard
) -> torch.Tensor:
    """log-sum-exp over the whole vocabulary minus the target's logit, per token (fp32, 0 where ignored), from
    this rank's log-sum-exp over its rows and its target logits (0 where the target is not among its rows:
    `local_targets`); labels are vocabulary ids."""
    return _VocabParallelCrossEntropy.apply(local_lse, target, labels == IGNORE_INDEX, rows)


class _SumOverGroup(torch.autograd.Function):
    """The forward sums over `group`; the backward is the identity (Megatron's "g" operator): every rank of the
    group uses the sum, and each gets its own part's gradient."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def split_embedding(embedding: nn.Embedding, tp_mesh: DeviceMesh, stream: Stream) -> None:
    """`embedding`'s rows split over `tp_mesh` (in place): its forward looks up the tokens among this rank's rows
    with its own class's forward (Gemma's scaling included) and sums the group's lookups: each rank's tokens of
    the sum, where the `stream` is split by tokens, else the whole row."""
    weight = embedding.weight
    embedding.weight = nn.Parameter(distribute_tensor(weight, tp_mesh, [Shard(0)]), requires_grad=weight.requires_grad)
    forward, padding = type(embedding).forward, embedding.padding_idx

    def split_forward(input_ids: torch.Tensor) -> torch.Tensor:
        weight = embedding.weight
        rows = vocab_shard(weight)
        here = (input_ids >= rows.start) & (input_ids < rows.stop)
        # The padding row (no gradient) is this rank's only where it holds it.
        embedding.padding_idx = (
            padding - rows.start if padding is not None and rows.start <= padding < rows.stop else None
        )
        try:
            with _reparametrize_module(embedding, {"weight": weight.to_local()}):
                looked_up = forward(embedding, (input_ids - rows.start).masked_fill(~here, 0))
        finally:
            embedding.padding_idx = padding
        looked_up = looked_up.masked_fill(~here.unsqueeze(-1), 0.0)
        if stream.split:
            return reduce_scatter_tokens(looked_up, rows.group)
        return _SumOverGroup.apply(looked_up, rows.group)

    embedding.forward = split_forward


def parallelize_vocabulary(hf_model: PreTrainedModel, tp_mesh: DeviceMesh, stream: Stream) -> None:
    """The input embedding's and the output layer's rows split over `tp_mesh` (in place; tied, one matrix; a model
    without an output layer, only its embedding); the embedding hands on the `stream`
    (`chattune.parallel.sequence_parallel`)."""
    embedding, head = hf_model.get_input_embeddings(), hf_model.get_output_embeddings()
    if not isinstance(embedding, nn.Embedding) or not isinstance(head, nn.Linear | None):
        raise UnsupportedModel(
            f"parallel.tensor: {type(hf_model).__name__}'s input embedding or output layer is not the "
            "nn.Embedding and nn.Linear chattune splits over the vocabulary"
        )
    if head is None:  # a sequence classifier (a reward model): its score head stays whole
        split_embedding(embedding, tp_mesh, stream)
        return
    tied = head.weight is embedding.weight
    split_embedding(embedding, tp_mesh, stream)
    # The output layer's own forward (generation) returns the whole vocabulary's logits.
    parallelize_module(head, tp_mesh, ColwiseParallel(output_layouts=Replicate()))
    if tied:  # ColwiseParallel wraps the (already split) matrix in a new parameter: the one matrix again
        head.weight = embedding.weight
