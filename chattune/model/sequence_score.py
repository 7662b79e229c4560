"""Hugging Face sequence-classification models with one label (a scalar per sequence) as packed reward models.

`PackedSequenceScorer` wraps an `AutoModelForSequenceClassification` (Llama's, Qwen's, Mistral's, ...: the
decoder under a linear `score` head) and returns the head's scalar at every position of a packed (1, N) row,
from the decoder's final hidden states computed exactly as `PackedCausalLM` computes a causal LM's
(`packed_decoder_output`: documents kept apart, the same sharding and compilation). Which positions count is the
objective's to say (`chattune.objectives.reward`: each side's last token); the head at every position
costs N x hidden multiply-adds, nothing next to the decoder, and keeps this module a plain per-token map like
the causal LM's per-token losses.

Transformers' own forward of such a model scores each row at its last token that is not the config's
`pad_token_id`: a conversation as `apply_chat_template` renders it is scored at its last token, as training scores it.
The export (`chattune.model.io.export`) is such a model's directory; its config names the class
(`architectures`), `num_labels=1` and a `pad_token_id`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from chattune.data.packing import PackedBatch
from chattune.data.templates.chat_template import render_conversation
from chattune.data.templates.tokenizer import pad_token_id
from chattune.errors import UnsupportedModel
from chattune.model.cost.flops import model_flops
from chattune.model.packed.attention import packed_decoder_output
from chattune.parallel.context_parallel import row_slice
from chattune.parallel.sequence_parallel import Stream, gather_whole_block_input

logger = logging.getLogger(__name__)

SCORE_MODULE = "score"  # transformers' name for the head of its decoder models' sequence classification


class PackedSequenceScorer(nn.Module):
    """The FSDP root around a sequence-classification model: its forward gathers the root's parameters
    (embeddings, final norm, score head) as `PackedCausalLM`'s does, and the loop reads the same attributes
    (`source_dtype`, `flops`)."""

    def __init__(self, hf_model: PreTrainedModel, source_dtype: torch.dtype | None = None):
        super().__init__()
        score_head(hf_model)  # refuses a model without one
        self.hf_model = hf_model
        self.source_dtype = source_dtype  # the dtype the weights were stored in (export.dtype=auto writes it back)
        # The vision-language checkpoint whose language model this is, set by the builder: the export writes its
        # layout back (`chattune.model.io.composite`).
        self.composite = None
        self.router_loss = None  # a MoE model's router loss is not trained next to a reward (the builder refuses it)
        self.flops = model_flops(hf_model)
        self.stream: Stream | None = (
            None  # tensor parallelism's (`chattune.parallel.tensor_parallel`), set by shard_model
        )
        # The export is a sequence-classification directory whatever the checkpoint it started from said it was.
        hf_model.config.architectures = [type(hf_model).__name__]

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """The score head's value (N,) in fp32 at every position of a packed (1, N) microbatch."""
        length, stream = batch.num_tokens, self.stream
        if stream is not None and length % stream.size:  # split by tokens over tp: padded by a segment of its own
            batch = row_slice(batch, 1, 0, stream.size)
        hidden = packed_decoder_output(self.hf_model, batch).last_hidden_state
        if stream is not None:  # the row's tokens gathered for the head, whole on every rank of the tp group
            hidden = gather_whole_block_input(stream, hidden)
        # A tensor of its own, not a view of the head's (N, 1) output: FSDP2's hook on the root's output would be
        # lost to an in-place op on a view.
        return getattr(self.hf_model, SCORE_MODULE)(hidden[0, :length]).float().flatten().clone()

    def describe_head(self) -> str:
        """For the start-up `compute:` line."""
        return "head: a scalar score of each side's last token (sequence classification, num_labels=1)"


def score_head(hf_model: PreTrainedModel) -> nn.Module:
    """The model's score head, a linear layer to one output; UnsupportedModel for a model whose sequence
    classification is something else (a pooler, several labels)."""
    head = getattr(hf_model, SCORE_MODULE, None)
    # (peft wraps a trained head: `modules_to_save`; the wrapper's original module is the layer)
    layer = getattr(head, "original_module", head)
    if not isinstance(layer, nn.Linear) or layer.out_features != 1:
        raise UnsupportedModel(
            f"{type(hf_model).__name__}: a reward model needs a sequence-classification model whose head is one linear "
            f"layer `{SCORE_MODULE}` to a single output (num_labels=1), got {type(layer).__name__}"
        )
    return head


@torch.no_grad()
def initialise_missing_head(hf_model: PreTrainedModel, stored: set[str], directory: Path) -> set[str]:
    """On a meta-built model whose checkpoint (`stored`: its tensor names) lacks some of the score head's
    parameters (a causal LM's directory has none): give the whole head CPU memory and the model's own
    initialisation, as `from_pretrained` initialises weights a checkpoint lacks. Returns the names of the head's
    parameters (loaded from these values, none from the checkpoint); empty where the checkpoint holds the head."""
    head = score_head(hf_model)
    names = {f"{SCORE_MODULE}.{name}" for name, _ in head.named_parameters()}
    missing = sorted(names - stored)
    if not missing:
        return set()
    head.to_empty(device="cpu")
    hf_model._init_weights(head)
    logger.info(
        "model.path %s holds no %s head (%s): it starts from the model's initialisation",
        directory,
        SCORE_MODULE,
        ", ".join(missing),
    )
    return names


def set_padding(hf_model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Give the config the `pad_token_id` that transformers' sequence classification needs to find a padded row's
    last token (the tokenizer's, where the checkpoint names none), and warn where that id is the last token the chat
    template writes after a reply, which the reward model is trained to score at: stock scoring would then read an
    earlier token."""
    config = hf_model.config
    if config.pad_token_id is None:
        config.pad_token_id = pad_token_id(tokenizer)
    last = last_rendered_token(tokenizer)
    if last is not None and config.pad_token_id == last:
        logger.warning(
            "the pad token id %d is the last token the chat template writes after a reply (%r), where the reward "
            "model is trained to score: transformers' sequence classification of the export would read each "
            "sequence at an earlier token. Give the tokenizer a pad token of its own (or set pad_token_id in the "
            "export's config.json)",
            last,
            tokenizer.convert_ids_to_tokens(last),
        )


def last_rendered_token(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The last token of a conversation as the chat template renders it (a side's last token, where its reward is
    read); None where the template renders nothing."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    ids = tokenizer(render_conversation(tokenizer, messages), add_special_tokens=False)["input_ids"]
    return ids[-1] if ids else None
