"""A sampled reply's behaviour log-probabilities (`generate_reply(log_probs=True)`): each token's log-probability under
the distribution it was drawn from, temperature and truncation applied, checked against a plain forward over the
prompt and the reply whose logits the test truncates itself; and a sampling setting never left to the model's own
generation config (transformers' default top_k of 50, a model's own top_k or min_p)."""

from __future__ import annotations

import pytest
import torch

from chattune.model.generate import Sampling, generate_reply, prompt_ids, stop_token_ids
from conftest import demo_chat_prompts, demo_tokenizer, tiny_model


def _stock_model():
    """The tiny Llama as a plain transformers model (stock attention: the KV cache of `generate`)."""
    model = tiny_model(seed=1).eval()
    model.set_attn_implementation("sdpa")
    return model


def _model_with_its_own_sampling_defaults():
    """The tiny Llama with a generation config that would truncate unasked (as Qwen3's top_k 20 does)."""
    model = _stock_model()
    model.generation_config.top_k, model.generation_config.min_p = 20, 0.3
    return model


def _truncated(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Log-probabilities over the vocabulary at each position of the distribution `sampling` names: the logits over
    the temperature, then the `top_k` most probable tokens, the smallest set of most probable tokens whose mass
    reaches `top_p`, the tokens of at least `min_p` times the most probable one's probability; renormalised."""
    scores = logits.float() / sampling.temperature
    keep = torch.ones_like(scores, dtype=torch.bool)
    order = scores.argsort(dim=-1, descending=True)
    rank = order.argsort(dim=-1)  # each token's place, 0 the most probable
    if sampling.top_k:
        keep &= rank < sampling.top_k
    if sampling.top_p < 1:
        probs = scores.masked_fill(~keep, float("-inf")).softmax(-1)
        before = probs.gather(-1, order).cumsum(-1) - probs.gather(-1, order)  # the mass of the tokens above each
        keep &= (before < sampling.top_p).gather(-1, rank)
    if sampling.min_p:
        probs = scores.masked_fill(~keep, float("-inf")).softmax(-1)
        keep &= probs >= sampling.min_p * probs.max(dim=-1, keepdim=True).values
    return scores.masked_fill(~keep, float("-inf")).log_softmax(-1)


@pytest.mark.parametrize(
    "sampling",
    [
        Sampling(max_new_tokens=24, temperature=1.0),  # the model's whole distribution, none of its config's cuts
        Sampling(max_new_tokens=24, temperature=0.7, top_k=8, top_p=0.9, min_p=0.05),
        Sampling(max_new_tokens=24, temperature=1.3, top_p=0.5),
    ],
    ids=["whole", "truncated", "nucleus"],
)
def test_a_sampled_replys_log_probs_are_those_of_the_distribution_it_was_drawn_from(sampling):
    model, tokenizer = _model_with_its_own_sampling_defaults(), demo_tokenizer()
    stops = stop_token_ids(tokenizer)
    for seed, messages in enumerate(demo_chat_prompts(3)):
        ids = prompt_ids(tokenizer, messages)
        torch.manual_seed(seed)
        reply = generate_reply(model, tokenizer, ids, sampling, stops, log_probs=True)
        assert reply.log_probs is not None and len(reply.log_probs) == len(reply.token_ids) > 0
        with torch.no_grad():  # one plain forward over prompt and reply: the logits each token was drawn from
            logits = model(input_ids=torch.tensor([ids + reply.token_ids]), use_cache=False).logits[0]
        want = _truncated(logits[len(ids) - 1 : -1], sampling).gather(-1, torch.tensor(reply.token_ids)[:, None])[:, 0]
        assert torch.isfinite(want).all(), "a sampled token outside the distribution's support"
        torch.testing.assert_close(torch.tensor(reply.log_probs), want, rtol=1e-5, atol=1e-5)


def test_the_whole_distribution_is_not_the_truncated_one():
    """The control: at temperature 1 with no truncation asked for, a reference that applies the model's own top_k of
    20 (what generate did when chattune left the setting to it) disagrees with the reply's log-probs."""
    model, tokenizer = _model_with_its_own_sampling_defaults(), demo_tokenizer()
    ids = prompt_ids(tokenizer, demo_chat_prompts(1)[0])
    torch.manual_seed(0)
    reply = generate_reply(model, tokenizer, ids, Sampling(max_new_tokens=24, temperature=1.0), [], log_probs=True)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids + reply.token_ids]), use_cache=False).logits[0]
    cut = _truncated(logits[len(ids) - 1 : -1], Sampling(temperature=1.0, top_k=20))
    cut = cut.gather(-1, torch.tensor(reply.token_ids)[:, None])[:, 0]
    assert not torch.allclose(torch.tensor(reply.log_probs), cut, rtol=1e-3, atol=1e-3)


def test_a_greedy_reply_has_no_behaviour_log_probs():
    model, tokenizer = _stock_model(), demo_tokenizer()
    ids = prompt_ids(tokenizer, demo_chat_prompts(1)[0])
    reply = generate_reply(model, tokenizer, ids, Sampling(max_new_tokens=8), stop_token_ids(tokenizer), log_probs=True)
    assert reply.log_probs is None and reply.token_ids
