"""Sampling a group of completions of one prompt from the policy: transformers' `generate` with a KV cache, the G
completions of a prompt in one batch, with what a policy-gradient step needs of each token.

A token's behaviour log-probability is its log-probability under the distribution it was actually drawn from: the
policy's logits after every processor `generate` applied (the temperature, top-k, top-p and min-p truncations, and
whatever else the model's generation config adds before them), read by the last processor, one step at a time: no
scores of every generated token are kept (at 152k tokens a vocabulary, 8 completions of 1024 tokens would hold 5 GB
of them). The trainer's own
log-probabilities are the policy's at the temperature alone: the two differ where sampling truncated, and the ratio
between them (`chattune.objectives.policy_gradient`: `rollout.is_correction`) makes the update unbiased for the
distribution sampled. The policy's entropy at each position is read before the truncations, at the temperature.

A rank's prompts are sampled together, in one `generate` call (left-padded, each prompt repeated G times), from torch's
RNG seeded for that call: the same step draws the same completions after a resume; the global RNG is left as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from chattune.model.generate import Sampling


@dataclass(frozen=True)
class Sampled:
    """One completion: its tokens as generated (the stop token or the token that completed a stop string included
    when one ended it), each token's behaviour log-probability and the policy's entropy there, whether a stop ended
    it (False: cut at max_new_tokens), and its text (without a stop token)."""

    token_ids: list[int]
    behaviour_logp: list[float]
    entropy: list[float]
    finished: bool
    text: str


@dataclass(frozen=True)
class GroupSampling:
    """How a prompt's group is drawn: `count` completions at `sampling`'s temperature (> 0) and truncations, each
    ended by a token of `stop_ids`, by one of `stop_strings`, or at `sampling.max_new_tokens`."""

    sampling: Sampling
    count: int
    stop_ids: tuple[int, ...]
    stop_strings: tuple[str, ...] = ()


def sample_group(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    ids: list[int],
    how: GroupSampling,
    seed: int = 0,
    device: torch.device | None = None,
    synced: bool = False,
) -> list[Sampled]:
    """One prompt's group (`sample_groups` of that prompt alone)."""
    return sample_groups(model, tokenizer, [ids], how, seed, device, synced)[0]


def sample_groups(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    how: GroupSampling,
    seed: int = 0,
    device: torch.device | None = None,
    synced: bool = False,
) -> list[list[Sampled]]:
    """A group of completions of each prompt (token ids), drawn as `how` says in one `generate` call (the prompts
    left-padded, each repeated `how.count` times) from torch's RNG seeded by `seed`. `model`: a Hugging Face causal LM
    or chattune's sharded one inside `chattune.model.generate.sharded_generation` (`synced`: every rank calls this
    alike, transformers' synced_gpus)."""
    sampling, count, stop_ids, stop_strings = how.sampling, how.count, how.stop_ids, how.stop_strings
    if sampling.temperature <= 0:
        raise ValueError("sampling completions for a policy gradient needs a temperature > 0 (greedy draws nothing)")
    device = device or next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    width = max(len(ids) for ids in prompts)
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompts], dtype=torch.long, device=device)
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts], device=device)
    entropy, recorder = _Entropy(sampling.temperature), _SampledLogProbs()
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        output = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            num_return_sequences=count,
            eos_token_id=list(stop_ids),
            pad_token_id=pad,
            use_cache=True,
            synced_gpus=synced,
            return_dict_in_generate=True,
            logits_processor=LogitsProcessorList([entropy, *_truncations(sampling), recorder]),
            **({"stop_strings": list(stop_strings), "tokenizer": tokenizer} if stop_strings else {}),
            **UNTRUNCATED,
            max_new_tokens=sampling.max_new_tokens,
        )
    new = output.sequences[:, width:]  # row p*count + k: prompt p's k-th completion
    steps = new.shape[1]
    if steps == 0:
        return [[Sampled([], [], [], False, "") for _ in range(count)] for _ in prompts]
    drawn = recorder.log_probs(new)
    entropies = torch.stack(entropy.values[:steps], dim=1)
    groups: list[list[Sampled]] = [[] for _ in prompts]
    for row in range(new.shape[0]):
        tokens = new[row].tolist()
        end = _end(tokens, tokenizer, stop_ids, stop_strings)
        kept = tokens if end is None else tokens[: end + 1]
        shown = kept if end is None or kept[-1] not in stop_ids else kept[:-1]
        text = tokenizer.decode(shown, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        groups[row // count].append(
            Sampled(kept, drawn[row, : len(kept)].tolist(), entropies[row, : len(kept)].tolist(), end is not None, text)
        )
    return groups


# What `generate` is told of sampling: draw, and truncate nothing itself. The truncations are chattune's processors
# (`_truncations`, transformers' own warpers in transformers' order), so that the last processor sees the distribution
# drawn from; a model's generation config (Qwen3's top_k 20) cannot add one after it.
UNTRUNCATED = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": None, "typical_p": 1.0,
               "epsilon_cutoff": 0.0, "eta_cutoff": 0.0}  # fmt: skip


def _truncations(sampling: Sampling) -> list[LogitsProcessor]:
    """transformers' warpers for `sampling`, in the order `generate` applies its own: temperature, top-k, top-p, min-p."""
    warpers: list[LogitsProcessor] = []
    if sampling.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k:
        warpers.append(TopKLogitsWarper(top_k=sampling.top_k))
    if sampling.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=sampling.top_p))
    if sampling.min_p:
        warpers.append(MinPLogitsWarper(min_p=sampling.min_p))
    return warpers


class _Entropy(LogitsProcessor):
    """First of chattune's processors: each step's entropy of the policy's distribution at the temperature, before any
    truncation, (count,) a step."""

    def __init__(self, temperature: float):
        self.temperature, self.values = temperature, []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        log_p = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        self.values.append(-(log_p.exp() * log_p).nan_to_num().sum(-1))
        return scores


class _SampledLogProbs(LogitsProcessor):
    """Last of the processors: the log-softmax of the distribution each step draws from, kept for one step only (a
    vocabulary per sequence, not one per generated token); the next step's call reads the token drawn from it."""

    def __init__(self) -> None:
        self.previous: torch.Tensor | None = None
        self.drawn: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.previous is not None:
            self.drawn.append(self.previous.gather(-1, input_ids[:, -1:])[:, 0])
        self.previous = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def log_probs(self, new: torch.Tensor) -> torch.Tensor:
        """(count, steps): each drawn token's log-prob, the last step's read from `new`, the generated tokens."""
        assert self.previous is not None
        last = self.previous.gather(-1, new[:, len(self.drawn) : len(self.drawn) + 1])[:, 0]
        return torch.stack([*self.drawn, last], dim=1)[:, : new.shape[1]]


def _end(
    tokens: list[int], tokenizer: PreTrainedTokenizerBase, stop_ids: Sequence[int], stop_strings: Sequence[str]
) -> int | None:
    """The index of the token that ended a completion: the first stop token, or the first token whose text completes
    a stop string; None where neither did (cut at the budget: `generate` pads what follows an end)."""
    stop = next((i for i, token in enumerate(tokens) if token in stop_ids), None)
    if not stop_strings:
        return stop
    limit = len(tokens) if stop is None else stop

    def holds_one(end: int) -> bool:  # the text up to token `end` holds a stop string: once true, true after
        text = tokenizer.decode(tokens[: end + 1], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return any(s in text for s in stop_strings)

    if limit == 0 or not holds_one(limit - 1):
        return stop
    low, high = 0, limit - 1  # the first end whose text holds one: a binary search, log2(n) decodes
    while low < high:
        middle = (low + high) // 2
        if holds_one(middle):
            high = middle
        else:
            low = middle + 1
    return low
