"""Hugging Face causal LMs for packed training.

`PackedCausalLM` wraps any `AutoModelForCausalLM` and returns per-token losses computed from the final
hidden states in chunks (see `chattune.model.head.chunked_loss`), or by cut-cross-entropy on CUDA
(`chattune.model.head.fused_loss`), instead of full logits, with the output layer's bias where it has one (Phi,
GPT-J, CodeGen, CTRL) and the model's own logit scaling or soft-capping (`chattune.model.head.output_logits`); for
a MoE model trained with its router loss, also each document's load-balancing loss
(`chattune.model.packed.router_loss`). It is also the FSDP root module, so the embedding, final norm and output head
(tied or not, its bias with it) are gathered by the root's hooks when its forward runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from chattune.data.packing import PackedBatch
from chattune.errors import UnsupportedModel, UserError
from chattune.hf_layout import decoder_of
from chattune.model.cost.flops import model_flops
from chattune.model.head.chunked_divergence import DistillationTarget, chunked_token_divergence
from chattune.model.head.chunked_loss import chunked_token_losses
from chattune.model.head.fused_loss import cce_token_losses, describe_bias
from chattune.model.head.kinds import CAUSAL_LM_HEAD, ModelHead
from chattune.model.head.output_logits import LogitTransform
from chattune.model.packed.attention import ATTENTION_NAME, packed_decoder_output, stock_attention
from chattune.model.packed.router_loss import RouterLoss
from chattune.parallel.context_parallel import gather_row, row_slice, set_context_group
from chattune.parallel.sequence_parallel import Stream
from chattune.parallel.vocab_parallel import local_head


class PackedCausalLM(nn.Module):
    def __init__(
        self,
        hf_model: PreTrainedModel,
        loss_chunk_size: int = 1024,
        loss_implementation: str = "chunked",
        source_dtype: torch.dtype | None = None,
        tf32_head: bool = False,
        router_loss: RouterLoss | None = None,
        context_group: dist.ProcessGroup | None = None,
    ):
        """`loss_implementation`: `chunked` (exact fp32, `chattune.model.head.chunked_loss`) or
        `cut_cross_entropy` (`chattune.model.head.fused_loss`, for CUDA); `tf32_head`: the chunked head's matmuls
        in TF32 (CUDA with bf16/fp16 compute, where that is exact for its forward); `router_loss`: a MoE model's
        load-balancing loss, computed by training forwards that ask for it; `context_group`: the ranks its packed
        rows are split across (`ParallelDims.cp_group`; None: whole rows), set on it and on every module of
        `hf_model` (`chattune.parallel.context_parallel.set_context_group`), where its attention reads it. Its
        architecture is checked by `chattune.model.checks.architecture` (the builder runs it), not here: `hf_model`
        may be on the meta device, its weights loaded after sharding."""
        super().__init__()
        self.hf_model = hf_model
        self.loss_chunk_size = loss_chunk_size
        self.loss_implementation = loss_implementation
        self.tf32_head = tf32_head
        self.source_dtype = source_dtype  # the dtype the weights were stored in (export.dtype=auto writes it back)
        # The vision-language checkpoint whose language model this is, set by the builder: the export writes its
        # layout back (`chattune.model.io.composite`).
        self.composite = None
        self.logit_transform = LogitTransform.from_config(hf_model.config)  # verified by check_output_head
        self.router_loss = router_loss
        self.flops = model_flops(hf_model)  # counted here, before sharding hides the full shapes
        self.stream: Stream | None = (
            None  # tensor parallelism's (`chattune.parallel.tensor_parallel`), set by shard_model
        )
        set_context_group(self, context_group)  # self.context_group, and the attention modules'

    def forward(
        self, batch: PackedBatch, router_losses: bool = False, distill: DistillationTarget | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Per-token losses (N,) in fp32 for a packed (1, N) microbatch; 0 where the label is ignored. With
        `router_losses` (a model with a `router_loss`), also each segment's coefficient-weighted load-balancing
        loss (S,). With `distill` (a teacher's `distillation_target` of the same row), each trained position's
        generalised JSD to the teacher instead (`chattune.model.head.chunked_divergence`). Under context
        parallelism every rank of the group passes the whole row, computes its own slice and returns the whole
        row's losses (`chattune.parallel.context_parallel`)."""
        if distill is not None:  # the whole vocabulary of the whole row on this rank (validate refuses the rest)
            if self.stream is not None or self.context_group is not None or router_losses:
                raise ValueError("distillation over the vocabulary needs whole rows and a whole output layer")
            output = packed_decoder_output(self.hf_model, batch)
            weight, bias = self.hf_model.get_output_embeddings().weight, output_bias(self.hf_model)
            return chunked_token_divergence(
                output.last_hidden_state[0],
                weight,
                batch.labels[0],
                distill,
                self.loss_chunk_size,
                self.logit_transform,
                bias,
            )
        group = self.context_group
        # A stream split by tokens over a tp group (`chattune.parallel.sequence_parallel`) splits each rank's row
        # evenly: a row T (or C x T) does not divide is padded by a segment of its own.
        tokens_over = self.stream.size if self.stream is not None else 1
        if group is None:
            if batch.num_tokens % tokens_over == 0:
                return self._token_losses(batch, router_losses)
            padded = self._token_losses(row_slice(batch, 1, 0, tokens_over), router_losses)
            if router_losses:  # the padding's own segment dropped
                return padded[0][: batch.num_tokens], padded[1][:-1]
            return padded[: batch.num_tokens]
        if router_losses:  # the builder refuses the combination; a document's router logits span the group
            raise ValueError("the router loss is computed per document, which context parallelism splits")
        local = row_slice(batch, dist.get_world_size(group), dist.get_rank(group), tokens_over)
        return gather_row(self._token_losses(local), group, batch.num_tokens)

    @torch.no_grad()
    def distillation_target(self, batch: PackedBatch, beta: float) -> DistillationTarget:
        """As a teacher: what a student's `forward(batch, distill=...)` compares its distributions with on `batch`
        (whole rows, a whole output layer). Sharded, this is one of FSDP2's forward methods: the root's gathered
        output layer stays gathered after it (FSDP2 reshards a root only after a backward), which the student's
        backward needs when it recomputes the teacher's logits."""
        output = packed_decoder_output(self.hf_model, batch)
        return DistillationTarget(
            hidden=output.last_hidden_state[0],
            weight=self.hf_model.get_output_embeddings().weight,
            bias=output_bias(self.hf_model),
            transform=self.logit_transform,
            beta=beta,
        )

    def describe_head(self) -> str:
        """What computes the loss from the final hidden states, for the start-up `compute:` line."""
        biased = output_bias(self.hf_model) is not None
        split = f"its vocabulary split over {self.stream.size} ranks" if self.stream is not None else None
        if self.loss_implementation == "cut_cross_entropy":
            notes = [note for note in (describe_bias() if biased else None, split) if note]
            return "loss: cut-cross-entropy (fused" + "".join(f", {note}" for note in notes) + ")"
        notes = [
            note for note, applies in (("its matmuls in TF32", self.tf32_head), ("with its bias", biased)) if applies
        ]
        if split:  # loss-parallel (`chattune.parallel.vocab_parallel`)
            notes.append(split)
        return "loss: chunked fp32 head" + (f" ({', '.join(notes)})" if notes else "")

    def generate(self, **kwargs) -> torch.Tensor:
        """The wrapped model's `generate` (transformers'), with its attention as transformers' SDPA for the
        duration (a KV cache is no packed row). Sharded, this is one of FSDP2's forward methods
        (`chattune.parallel.fsdp.shard_model` registers it): the root's parameters (embeddings, final norm,
        output layer) are gathered around it, each decoder layer's around each of its forwards, so every
        rank must make the same calls (`chattune.model.generate`)."""
        with stock_attention(self.hf_model), self.stream.whole() if self.stream is not None else nullcontext():
            return self.hf_model.generate(**kwargs)

    def _token_losses(
        self, batch: PackedBatch, router_losses: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if router_losses and self.router_loss is None:
            raise ValueError("router losses asked of a model trained without a router loss")
        output = packed_decoder_output(self.hf_model, batch, output_router_logits=router_losses)
        weight, bias = self.hf_model.get_output_embeddings().weight, output_bias(self.hf_model)
        # (N, H), and this rank's rows of the vocabulary under loss-parallel
        hidden, weight, bias, rows = local_head(output.last_hidden_state, weight, bias, self.stream)
        if self.loss_implementation == "cut_cross_entropy":
            losses = cce_token_losses(hidden, weight, batch.labels[0], self.logit_transform, bias, rows)
        else:
            losses = chunked_token_losses(
                hidden,
                weight,
                batch.labels[0],
                self.loss_chunk_size,
                self.tf32_head,
                self.logit_transform,
                bias,
                rows,
            )
        if not router_losses:
            return losses
        # The segment bounds on the host: one sync per microbatch of a run with a router loss (CUDA).
        return losses, self.router_loss.per_document(output.router_logits, batch.cu_seqlens.tolist())


def output_bias(hf_model: PreTrainedModel) -> torch.Tensor | None:
    """The output layer's bias (V,), where it has one (Phi, GPT-J, CodeGen, CTRL, the BERT family's decoders):
    the losses add it to hidden @ output_embedding.T. Under peft's modules_to_save, the trained copy's."""
    return getattr(hf_model.get_output_embeddings(), "bias", None)


@torch.no_grad()
def check_output_head(hf_model: PreTrainedModel) -> None:
    """The losses compute logits as hidden @ output_embedding.T (+ the output layer's bias, where it has one), then
    scale or soft-cap them as the config says (`LogitTransform`). Refuse a model whose own forward does something
    else (a scaling the config does not name, a transform between the decoder and the output layer), instead of
    training a different model. A bias is compared at random values for the duration (initialised, it is zero,
    and a forward that left it out or added it elsewhere would pass), then restored.

    Both sides are computed in the model's own dtype, as its forward computes them (a bf16 model's logits
    are a bf16 GEMM), so a bf16 model is not refused for bf16 rounding and no fp32 copy of the output
    layer is made; the tolerance is a few units of that dtype's precision."""
    head = hf_model.get_output_embeddings()
    learned = [name for name, _ in head.named_parameters() if name not in ("weight", "bias")]
    if learned:  # Dory's per-token logit_scale: at its initial value the logits match, but it would never train
        raise UnsupportedModel(
            f"{type(hf_model).__name__}: its output layer has parameters besides its weight and bias "
            f"({', '.join(learned)}), which chattune's losses do not train"
        )
    was_training = hf_model.training
    hf_model.eval()
    device = head.weight.device
    input_ids = (
        torch.arange(8, device=device).unsqueeze(0) % head.weight.shape[0]
    )  # a composite config: vocab in its text config
    position_ids = torch.arange(8, device=device).unsqueeze(0)
    # One document, its boundaries passed as a packed row's are (some attention layers get no position ids).
    cu_seqlens = torch.tensor([0, 8], dtype=torch.int32, device=device)
    row = dict(
        input_ids=input_ids,
        position_ids=position_ids,
        use_cache=False,
        cu_seq_lens_q=cu_seqlens,
        cu_seq_lens_k=cu_seqlens,
        max_length_q=8,
        max_length_k=8,
    )
    hidden = decoder_of(hf_model)(**row).last_hidden_state[0]
    product = hidden @ head.weight.t()
    bias = output_bias(hf_model)
    original = None if bias is None else bias.detach().clone()
    head_inputs = []  # what the model's forward hands its output layer, for the refusal's reason
    hook = head.register_forward_pre_hook(lambda module, args: head_inputs.append(args[0].detach()))
    try:
        if bias is not None:  # as large as the logits, so that a bias left out (or added twice) shows
            generator = torch.Generator().manual_seed(0)
            spread = float(product.float().std()) or 1.0
            bias.copy_(torch.randn(bias.shape, generator=generator).mul_(spread).to(bias))
            product = product + bias
        logits = hf_model(**row).logits[0].float()
    finally:
        hook.remove()
        hf_model.train(was_training)
        if bias is not None:
            bias.copy_(original)
    transform = LogitTransform.from_config(hf_model.config)
    ours = transform(product).float()
    tolerance = max(1e-3, 4 * torch.finfo(head.weight.dtype).eps)
    if not torch.allclose(ours, logits, rtol=tolerance, atol=tolerance * float(logits.abs().max())):
        read = head_inputs[0][0] if head_inputs and head_inputs[0].dim() == 3 else None
        if read is not None and not (
            read.shape == hidden.shape
            and torch.allclose(read, hidden, rtol=tolerance, atol=tolerance * float(hidden.abs().max()))
        ):
            raise UnsupportedModel(
                f"{type(hf_model).__name__}: its output layer does not read the decoder's final hidden states (its "
                "causal LM runs modules of its own between them, such as the BERT family's prediction-head transform), "
                "which chattune's losses do not run"
            )
        applied = transform.describe() or "nothing else"
        plus = " + its bias" if bias is not None else ""
        raise UnsupportedModel(
            f"{type(hf_model).__name__} computes its logits differently from hidden @ output_embedding.T{plus} "
            f"followed by what its config names ({applied}); chattune's losses do not support that head"
        )


def written_vocab_size(spec: Mapping, tokenizer_size: int) -> int:
    """The vocabulary of a random-init model built from `model.config` as the user wrote it (`spec`): its
    `vocab_size` (or its `text_config`'s), where one is written, which the tokenizer's ids must fit; else the
    tokenizer's size (a config class's default, such as LlamaConfig's 32000, is no choice of the user's)."""
    key, written = "model.config.vocab_size", spec.get("vocab_size")
    text = spec.get("text_config")
    if written is None and isinstance(text, Mapping):
        key, written = "model.config.text_config.vocab_size", text.get("vocab_size")
    if written is None:
        return tokenizer_size
    if not isinstance(written, int) or written < tokenizer_size:
        raise UserError(
            f"{key}: {written!r}, but the tokenizer has {tokenizer_size} tokens, whose ids must fit the model's "
            f"embeddings: set it to at least {tokenizer_size}, or leave vocab_size out (the model then takes the "
            "tokenizer's size)"
        )
    return written


def build_hf_model(
    tokenizer: PreTrainedTokenizerBase,
    config: PretrainedConfig,
    dtype: torch.dtype = torch.float32,
    head: ModelHead = CAUSAL_LM_HEAD,
    vocab_size: int | None = None,
) -> PreTrainedModel:
    """A model ending in `head` (a causal LM unless told) with random weights built from a config, its vocabulary
    `vocab_size` (`written_vocab_size`: the one the user wrote), else the tokenizer's size. Seed torch before calling
    for reproducible weights. (Model directories are loaded by `chattune.model.io.load`.)"""
    vocab_size = len(tokenizer) if vocab_size is None else vocab_size
    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens")
    config.vocab_size = vocab_size
    config.get_text_config().vocab_size = vocab_size  # a composite config keeps it in its text config
    config.pad_token_id = tokenizer.pad_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.bos_token_id = tokenizer.bos_token_id
    for name, value in head.config_overrides.items():
        setattr(config, name, value)
    model = head.auto_class.from_config(config, attn_implementation=ATTENTION_NAME, dtype=dtype)
    model.config.use_cache = False
    return model
