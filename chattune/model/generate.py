"""Replies from a chat model: a conversation rendered with the tokenizer's chat template and its generation
prompt, transformers' `generate`, the reply read up to the template's end-of-turn token.

One path for `chattune chat` (a plain Hugging Face model, or a peft adapter over its base) and for the
samples of an evaluation (the sharded model being trained, `chattune.train.samples`). The sharded model is
gathered whole for the replies where every rank has room, and each rank then generates on its own; otherwise
it runs collectively: every rank calls `generate_reply` the same number of times with `synced=True`, and
transformers' `synced_gpus` keeps a rank whose reply has ended running forwards (each one all-gathers the
layers' parameters) until every rank's has.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from chattune.data.templates.chat_template import probe_template
from chattune.model.causal_lm import PackedCausalLM
from chattune.model.checks.architecture import MINIATURE_LAYERS, miniature_config
from chattune.model.checks.code_failures import where_it_fails
from chattune.model.cost.flops import text_config
from chattune.parallel.fsdp import Placement, can_stay_gathered, eager_layers, model_device, reshard, stay_gathered


@dataclass(frozen=True)
class Sampling:
    """How a reply is drawn: greedy at temperature 0, else sampled from the model's distribution at `temperature`,
    truncated to the `top_k` most probable tokens (0: no limit), the nucleus of mass `top_p` and the tokens of at
    least `min_p` times the most probable one's probability (0: none), in transformers' order (temperature, top-k,
    top-p, min-p). Each setting is passed to `generate` whatever it is: a model's own generation config (Qwen3's
    top_k 20, transformers' default top_k 50) never truncates the distribution unasked, so that a reply's
    `log_probs` are those of the distribution named here."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    def generate_kwargs(self) -> dict:
        if self.temperature <= 0:
            return {"do_sample": False, "max_new_tokens": self.max_new_tokens}
        return {
            "do_sample": True,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p or None,  # (transformers adds min-p's warper for any value that is not None)
            "max_new_tokens": self.max_new_tokens,
        }


@dataclass(frozen=True)
class Reply:
    text: str  # the reply's tokens decoded, without the end-of-turn token that ended it
    token_ids: list[int]  # as generated, the end-of-turn token included when it ended the reply
    finished: bool  # ended by an end-of-turn token (False: cut at max_new_tokens)
    # With `generate_reply(log_probs=True)` and sampling: each token's log-probability under the distribution it was
    # drawn from (temperature and truncation applied: what an importance ratio against the policy divides by);
    # None for a greedy reply, whose tokens were not drawn from a distribution.
    log_probs: list[float] | None = None


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids that end a reply: the chat template's end-of-turn token (`chattune.data.templates.chat_template`: e.g.
    `<|im_end|>`, or Phi-3's `<|end|>`, which is not its eos), the token that ends a tool call where the template
    has one of its own (gpt-oss's `<|call|>`), and the eos token: the ends training teaches. A ChatTemplateError
    (a UserError) for a tokenizer without a usable chat template."""
    markers = probe_template(tokenizer)
    ends = [tokenizer.convert_tokens_to_ids(token) for token in (markers.end_of_turn, markers.end_of_tool_call)]
    ids = [end for end in ends if isinstance(end, int) and end != tokenizer.unk_token_id]
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return list(dict.fromkeys(ids))


def prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The token ids the model continues: `apply_chat_template(messages, tools=tools, add_generation_prompt=True)`."""
    encoded = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(encoded["input_ids"])


def generate_reply(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    ids: list[int],
    sampling: Sampling,
    stop_ids: list[int],
    synced: bool = False,
    device: torch.device | None = None,
    log_probs: bool = False,
) -> Reply:
    """The model's reply to the prompt `ids` (`prompt_ids`). `model`: a Hugging Face causal LM (or a peft model
    over one), or chattune's sharded `PackedCausalLM` inside `sharded_generation`, where every rank must call
    this alike with `synced=True`, on its `Placement`'s `device` (None: the parameters', a plain model's). Sampling
    draws from torch's global RNG (seed it for a repeatable reply). `log_probs`: the sampled tokens' log-probabilities
    under the distribution they were drawn from (`Reply.log_probs`), read from the scores `generate` sampled."""
    device = device or model_device(model)
    log_probs = log_probs and sampling.temperature > 0  # (a greedy reply's tokens were not drawn: none)
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    output = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        eos_token_id=stop_ids,
        pad_token_id=pad,
        use_cache=True,
        synced_gpus=synced,
        output_scores=log_probs,
        return_dict_in_generate=True,
        **sampling.generate_kwargs(),
    )
    new = output.sequences[0, len(ids) :].tolist()
    end = next((i for i, token in enumerate(new) if token in stop_ids), None)
    # (a rank that finished first under synced_gpus pads its row until every rank has: cut at the stop token)
    token_ids = new if end is None else new[: end + 1]
    text = tokenizer.decode(
        token_ids if end is None else token_ids[:-1], skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    drawn = None
    if log_probs:  # the scores after every processor: the distribution sampled from
        scores = torch.stack(output.scores[: len(token_ids)], dim=1)[0].float()
        chosen = torch.tensor(token_ids, device=scores.device)[:, None]
        drawn = torch.log_softmax(scores, dim=-1).gather(-1, chosen)[:, 0].tolist()
    return Reply(text, token_ids, end is not None, drawn)


@contextlib.contextmanager
def sharded_generation(model: PackedCausalLM, placement: Placement, gather: bool | None = None) -> Iterator[bool]:
    """Collective: the sharded model being trained, ready for `generate_reply`: eval mode (no dropout), no
    gradients, its decoder layers uncompiled (`chattune.parallel.fsdp.eager_layers`); afterwards its mode as it was
    and every FSDP unit resharded (the root stays gathered after a forward method).

    Yields whether each rank may generate on its own: with `gather` (None: where every rank has room,
    `chattune.parallel.fsdp.can_stay_gathered`) the whole model is gathered once for the block and a forward runs
    no collective; without it each forward gathers each layer, so every rank must call `generate_reply` alike,
    with `synced=True`. Under expert parallelism every forward exchanges tokens with the expert group, gathered
    or not: never on its own."""
    was_training = model.training
    model.eval()
    if gather is None:
        gather = can_stay_gathered(model, placement)
    try:
        with torch.no_grad(), eager_layers(model), stay_gathered(model) if gather else contextlib.nullcontext():
            yield gather and placement.dims.ep == 1
    finally:
        model.train(was_training)
        reshard(model)


def generation_failure(model: PreTrainedModel) -> str | None:
    """Why stock transformers cannot generate with a model like `model` (None: it can), seen on a random-init
    miniature of its class and config (every kind of layer kept, `chattune.model.checks.architecture`) generating
    3 tokens with a KV cache, as the sample replies do. Some hybrid and recurrent models' caches fail there in
    transformers itself (Bamba and Granite-4-H without an attention layer, HRM, Qwen4-Exp, xLSTM at some
    sizes); training them is unaffected. The global RNG is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        miniature = _stock_miniature(model).eval()
        miniature.set_attn_implementation("sdpa" if miniature._supports_sdpa else "eager")  # as `stock_attention`
        ids = torch.arange(9).unsqueeze(0) % text_config(miniature.config).vocab_size
        try:
            with torch.no_grad():
                miniature.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    pad_token_id=0,
                    use_cache=True,
                    do_sample=False,
                    max_new_tokens=3,
                )
        except Exception as error:  # the model's code, reported: the caller turns the sample replies off
            return f"{type(model).__name__}.generate fails in stock transformers {where_it_fails(error)}"
    return None


def _stock_miniature(model: PreTrainedModel) -> PreTrainedModel:
    """A random-init fp32 miniature of `model`'s own class (a text model's config need not be one that
    AutoModelForCausalLM maps: Mllama's, Emu3's), one layer deeper at a time where the shallowest does not build."""
    config = model.config
    total = getattr(text_config(config), "num_hidden_layers", None)
    depths = range(MINIATURE_LAYERS, total + 1) if isinstance(total, int) and total > MINIATURE_LAYERS else [None]
    for depth in depths:
        try:
            return type(model)._from_config(miniature_config(config, depth or MINIATURE_LAYERS), dtype=torch.float32)
        except Exception as error:  # as `build_miniature`: deeper, or the last error below
            failure = error
    raise failure
