"""Sampling a group: each token's behaviour log-prob is its log-prob under the distribution it was drawn from
(temperature, top-k and top-p applied), computed here from plain forwards of the model on each prefix; the
untruncated distribution would be caught; the entropy is the policy's at the temperature; a group is the same for
the same seed whoever draws it, and leaves the global RNG alone; a completion becomes the document the loss reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from chattune.data.documents import IGNORE_INDEX
from chattune.model.generate import Sampling, stop_token_ids
from chattune.objectives.policy_gradient import ADVANTAGE, BEHAVIOUR_LOGP
from chattune.rl.completion_documents import completion_document, group_documents
from chattune.rl.sampling import GroupSampling, Sampled, sample_group
from conftest import demo_tokenizer, tiny_model

PROMPT = [{"role": "user", "content": "Sort these numbers in ascending order: 5, 3, 9"}]


def setup(**sampling):
    tokenizer = demo_tokenizer()
    model = tiny_model(seed=3).eval()
    model.set_attn_implementation("sdpa")
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True, return_dict=True)
    how = GroupSampling(Sampling(max_new_tokens=12, **sampling), 4, tuple(stop_token_ids(tokenizer)))
    return tokenizer, model, list(ids["input_ids"]), how


def drawn_from(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The log-probs of the distribution sampled from, as the papers of top-k and nucleus sampling define it: the
    k most probable tokens, then of those the fewest whose probability reaches p (transformers' rule: a token is
    dropped where the mass of the tokens less probable than it and itself is at most 1 - p)."""
    scaled = logits / temperature
    keep = torch.ones_like(scaled, dtype=torch.bool)
    if top_k:
        keep &= scaled >= torch.topk(scaled, top_k).values[-1]
    if top_p < 1.0:
        probs = torch.softmax(scaled.masked_fill(~keep, -float("inf")), -1)
        order = torch.argsort(probs)  # ascending
        below = torch.cumsum(probs[order], 0) <= 1 - top_p
        below[-1] = False  # the most probable token stays
        keep[order[below]] = False
    return torch.log_softmax(scaled.masked_fill(~keep, -float("inf")), -1)


def independent(model, prompt: list[int], sample: Sampled, temperature: float, top_k: int, top_p: float):
    """Each sampled token's log-prob under the truncated and the untruncated distribution, and the entropy at
    the temperature, from a plain forward of the model on the prompt and the tokens before it."""
    truncated, whole, entropy = [], [], []
    for t, token in enumerate(sample.token_ids):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + sample.token_ids[:t]])).logits[0, -1].float()
        truncated.append(float(drawn_from(logits, temperature, top_k, top_p)[token]))
        log_p = torch.log_softmax(logits / temperature, -1)
        whole.append(float(log_p[token]))
        entropy.append(float(-(log_p.exp() * log_p).sum()))
    return truncated, whole, entropy


@pytest.mark.parametrize(
    "sampling", [dict(temperature=0.7, top_k=6, top_p=0.8), dict(temperature=1.3, top_k=0, top_p=0.5)]
)
def test_each_tokens_behaviour_log_prob_is_the_truncated_distributions_and_the_entropy_the_policys(sampling):
    tokenizer, model, ids, how = setup(**sampling)
    samples = sample_group(model, tokenizer, ids, how, seed=7)
    assert len(samples) == 4 and all(s.token_ids for s in samples)
    differs = 0.0
    for sample in samples:
        truncated, whole, entropy = independent(model, ids, sample, **sampling)
        np.testing.assert_allclose(sample.behaviour_logp, truncated, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(sample.entropy, entropy, rtol=1e-5, atol=1e-5)
        differs = max(differs, float(np.max(np.abs(np.array(sample.behaviour_logp) - np.array(whole)))))
    assert differs > 1e-2  # the control: the untruncated log-probs are not what was drawn from


def test_a_group_is_the_same_for_the_same_seed_and_leaves_the_global_rng_alone():
    tokenizer, model, ids, how = setup(temperature=1.0)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = sample_group(model, tokenizer, ids, how, seed=11)
    assert torch.equal(torch.get_rng_state(), state)
    again = sample_group(model, tokenizer, ids, how, seed=11)
    other = sample_group(model, tokenizer, ids, how, seed=12)
    assert [s.token_ids for s in first] == [s.token_ids for s in again]
    assert [s.token_ids for s in first] != [s.token_ids for s in other]
    assert len({tuple(s.token_ids) for s in first}) > 1  # the group's completions are drawn, not copies


def test_a_completion_ends_at_its_stop_token_or_is_cut_at_the_budget():
    tokenizer, model, ids, how = setup(temperature=1.0)
    stop = set(how.stop_ids)
    for sample in sample_group(model, tokenizer, ids, how, seed=5):
        inside = [t for t in sample.token_ids[:-1] if t in stop]
        assert not inside
        if sample.finished:
            assert sample.token_ids[-1] in stop
            assert sample.text == tokenizer.decode(sample.token_ids[:-1])
        else:
            assert len(sample.token_ids) == how.sampling.max_new_tokens
        assert len(sample.behaviour_logp) == len(sample.token_ids) == len(sample.entropy)


def test_a_greedy_group_is_refused():
    tokenizer, model, ids, how = setup(temperature=0.0)
    with pytest.raises(ValueError, match="temperature > 0"):
        sample_group(model, tokenizer, ids, how)


def test_a_completion_document_trains_its_sampled_tokens_from_the_positions_before_them():
    sample = Sampled([7, 8, 9], [-0.5, -1.0, -1.5], [1.0, 1.0, 1.0], True, "x")
    doc = completion_document(42, [1, 2, 3, 4], sample, advantage=0.25)
    assert doc.input_ids.tolist() == [1, 2, 3, 4, 7, 8, 9]
    assert doc.labels.tolist() == [IGNORE_INDEX] * 3 + [7, 8, 9] + [IGNORE_INDEX]
    assert doc.token_values[BEHAVIOUR_LOGP].tolist() == [0, 0, 0, -0.5, -1.0, -1.5, 0]
    assert doc.token_values[ADVANTAGE].tolist() == [0, 0, 0, 0.25, 0.25, 0.25, 0]
    assert doc.doc_id == 42 and not doc.shared_prefix and doc.doc_values == {}


def test_a_groups_documents_continue_one_copy_of_the_prompt_less_its_last_token_as_many_as_fit():
    prompt = [1, 2, 3, 4]
    samples = [Sampled(ids, [-0.5] * len(ids), [1.0] * len(ids), True, "x") for ids in ([7, 8], [9], [5, 6, 7])]
    completions = [(10 + k, sample, advantage) for k, (sample, advantage) in enumerate(zip(samples, [0.5, -1.0, 2.0]))]
    (doc,) = group_documents(prompt, completions, budget=None)
    # [prompt + reply 1][4 + reply 2][4 + reply 3]: each later segment continues the prompt's first 3 tokens
    assert doc.input_ids.tolist() == [1, 2, 3, 4, 7, 8, 4, 9, 4, 5, 6, 7]
    assert doc.segments == (6, 2, 4) and doc.shared_prefix == 3 and doc.doc_id == 10
    skip = IGNORE_INDEX
    assert doc.labels.tolist() == [skip, skip, skip, 7, 8, skip, 9, skip, 5, 6, 7, skip]
    assert doc.token_values[ADVANTAGE].tolist() == [0, 0, 0, 0.5, 0.5, 0, -1, 0, 2, 2, 2, 0]
    assert doc.token_values[BEHAVIOUR_LOGP].tolist() == [0, 0, 0, -0.5, -0.5, 0, -0.5, 0, -0.5, -0.5, -0.5, 0]
    # a budget of 8 holds [prompt + reply 1] and [4 + reply 2]; reply 3 alone is the plain completion document
    first, second = group_documents(prompt, completions, budget=8)
    assert first.segments == (6, 2) and len(first) == 8
    plain = completion_document(12, prompt, samples[2], 2.0)
    assert second.input_ids.tolist() == plain.input_ids.tolist() and not second.shared_prefix and second.doc_id == 12
    assert second.token_values[ADVANTAGE].tolist() == plain.token_values[ADVANTAGE].tolist()


def test_a_stop_string_ends_a_completion_at_the_token_that_completes_it():
    from chattune.rl.sampling import _end

    tokenizer = demo_tokenizer()
    tokens = tokenizer("12, 34, 56, 78", add_special_tokens=False)["input_ids"]
    text_until = [tokenizer.decode(tokens[: i + 1]) for i in range(len(tokens))]
    want = next(i for i, text in enumerate(text_until) if "56" in text)
    assert _end(tokens, tokenizer, (), ("56",)) == want
    assert _end(tokens, tokenizer, (), ("99",)) is None
    assert _end(tokens, tokenizer, (tokens[1],), ("56",)) == 1  # a stop token before the string ends it first


def test_prompts_of_different_lengths_sampled_together_are_each_continued_as_alone():
    """One generate call, the shorter prompt left-padded: each completion's log-probs are those of a plain forward of
    its own prompt and prefix, unpadded (padding that leaked into a prompt's attention would show here)."""
    from chattune.rl.sampling import sample_groups

    tokenizer, model, short, how = setup(temperature=0.8, top_k=8)
    longer = [
        {"role": "user", "content": "Sort these numbers in ascending order: 51, 7, 98, 3, 44, 12"},
        {"role": "assistant", "content": "3, 7, 12, 44, 51, 98"},
        {"role": "user", "content": "And in descending order?"},
    ]
    long_ids = list(tokenizer.apply_chat_template(longer, add_generation_prompt=True, return_dict=True)["input_ids"])
    assert len(long_ids) > len(short) + 10
    groups = sample_groups(model, tokenizer, [short, long_ids], how, seed=3)
    assert [len(group) for group in groups] == [how.count, how.count]
    for prompt, group in zip((short, long_ids), groups):
        for sample in group:
            truncated, _, entropy = independent(model, prompt, sample, temperature=0.8, top_k=8, top_p=1.0)
            np.testing.assert_allclose(sample.behaviour_logp, truncated, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(sample.entropy, entropy, rtol=1e-5, atol=1e-5)
