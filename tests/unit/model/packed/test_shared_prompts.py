"""Shared prompts (data.share_prompts): a reply continuing a prompt computed once gives, token for token, what the reply
after its own copy of the prompt gives: the attention loops on random tensors, then whole models of each family
(Llama, Qwen3, Gemma 3 with a window shorter than the prompt, Qwen3-MoE) through the packed loss and every
gradient, on rows that mix shared pairs with plain documents. Controls: a reply that also sees its sibling, and
positions restarted at 0, are caught. The start-up probe accepts those families and refuses a hybrid by its mixer
and a model whose attention ignored the shared prompt."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from chattune.data.documents import IGNORE_INDEX, Document
from chattune.data.packing import collate_packed
from chattune.errors import UnsupportedModel
from chattune.model.causal_lm import PackedCausalLM
from chattune.model.checks.packing_probe import check_shared_prompts
from chattune.model.packed import kernels
from chattune.model.packed.kernels import VarlenOptions, _per_document_exact, _per_document_sdpa
from conftest import tiny_model

FAMILIES = {
    "llama": {},
    "qwen3": {"model_type": "qwen3"},
    # a window of 4 keys, shorter than every prompt here: replies' early tokens see only the prompt's last keys
    "gemma3_window": {
        "model_type": "gemma3_text",
        "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "qwen3_moe": {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
}


def tokens(rng: np.random.Generator, count: int) -> np.ndarray:
    return rng.integers(16, 250, count)


def trained(ids: np.ndarray, first: int) -> np.ndarray:
    """Shifted labels training every position from `first` on (the last predicts nothing)."""
    labels = np.full(len(ids), IGNORE_INDEX)
    labels[first:-1] = ids[first + 1 :]
    return labels


def pair_layouts(seed: int) -> tuple[list[Document], list[Document], list[tuple[int, int]]]:
    """The same rows both ways: (unshared documents, shared documents, where each shared row's dropped prompt copy
    starts and its length in the unshared row). A row: a plain document, two pairs (a prompt of 7 to 12 tokens,
    replies of 3 to 8), a plain document."""
    rng = np.random.default_rng(seed)
    unshared, shared, dropped, offset = [], [], [], 0
    for index in range(4):
        if index in (0, 3):  # a plain document, trained throughout
            ids = tokens(rng, int(rng.integers(5, 10)))
            document = Document(index, ids, trained(ids, 0))
            unshared.append(document)
            shared.append(document)
            offset += len(ids)
            continue
        prompt = tokens(rng, int(rng.integers(7, 13)))
        first, second = (np.concatenate([prompt, tokens(rng, int(rng.integers(3, 9)))]) for _ in range(2))
        start = len(prompt) - 1  # the prompt's last position predicts each reply's first token
        labels = [trained(first, start), trained(second, start)]
        unshared.append(
            Document(index, np.concatenate([first, second]), np.concatenate(labels), segments=(len(first), len(second)))
        )
        shared.append(
            Document(
                index,
                np.concatenate([first, second[start:]]),
                np.concatenate([labels[0], labels[1][start:]]),
                segments=(len(first), len(second) - start),
                shared_prefix=start,
            )
        )
        dropped.append((offset + len(first), start))
        offset += len(first) + len(second)
    return unshared, shared, dropped


def without_copies(values: torch.Tensor, dropped: list[tuple[int, int]]) -> torch.Tensor:
    """The unshared row's per-token values less the prompt copies the shared row does not hold."""
    keep = torch.ones(values.shape[0], dtype=torch.bool)
    for start, length in dropped:
        keep[start : start + length] = False
    return values[keep]


# --------------------------------------------------------------------------------------------------------------
# The attention loops


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"window": 3},
        {"softcap": 5.0, "exact": True},
        {"sinks": True, "exact": True},
        {"window": 4, "exact": True},
    ],
    ids=["sdpa", "sdpa_window", "exact_softcap", "exact_sinks", "exact_window"],
)
def test_a_segment_continuing_a_prompt_attends_as_it_would_after_its_own_copy(settings):
    """Random queries, keys and values (grouped-query: 4 query heads on 2 kv heads): the row [prompt + X][Y]
    with Y continuing the prompt, against [prompt + X][prompt + Y]; outputs and the gradients of q, k, v."""
    torch.manual_seed(0)
    prompt, x, y = 6, 4, 5
    options = VarlenOptions(scale=0.3, window=settings.get("window"), softcap=settings.get("softcap"))
    sinks = torch.randn(4) if settings.get("sinks") else None

    def attend(q, k, v, lengths, prefixes=None):
        cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
        if settings.get("exact"):
            return _per_document_exact(q, k, v, cu, options, sinks, prefixes)
        return _per_document_sdpa(q, k, v, cu, options, prefixes)

    q_row = torch.randn(1, 4, prompt + x + y, 8)
    k_row, v_row = torch.randn(1, 2, prompt + x + y, 8), torch.randn(1, 2, prompt + x + y, 8)
    leaves = [t.clone().requires_grad_() for t in (q_row, k_row, v_row)]
    shared_out = attend(*leaves, [prompt + x, y], torch.tensor([[0, 0], [0, prompt]]))
    shared_out.square().sum().backward()

    copies = [t.clone().requires_grad_() for t in (q_row, k_row, v_row)]
    # the unshared row: the prompt's tokens again (the same q, k, v: a copy computes the same) before Y
    unshared = [torch.cat([t[:, :, : prompt + x], t[:, :, :prompt], t[:, :, prompt + x :]], dim=2) for t in copies]
    out = attend(*unshared, [prompt + x, prompt + y])
    want = torch.cat([out[:, : prompt + x], out[:, 2 * prompt + x :]], dim=1)
    want.square().sum().backward()
    torch.testing.assert_close(shared_out, want, rtol=1e-6, atol=1e-6)
    for got, expected in zip(leaves, copies):
        torch.testing.assert_close(got.grad, expected.grad, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------------------------
# Whole models


def loss_and_grads(model: PackedCausalLM, documents: list[Document]) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    losses = model(collate_packed(documents))
    losses.sum().backward()
    return losses.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_token_loss_and_gradient_of_a_shared_row_equal_the_unshared_row(family):
    model = PackedCausalLM(tiny_model(seed=0, **FAMILIES[family]), loss_chunk_size=16)
    unshared, shared, dropped = pair_layouts(seed=1)
    want_losses, want_grads = loss_and_grads(model, unshared)
    got_losses, got_grads = loss_and_grads(model, shared)
    torch.testing.assert_close(got_losses, without_copies(want_losses, dropped), rtol=1e-6, atol=1e-6)
    assert float(want_losses.sum()) > 0 and sorted(got_grads) == sorted(want_grads)
    for name, grad in want_grads.items():
        error = float((got_grads[name] - grad).norm() / grad.norm().clamp_min(1e-30))
        assert error <= 1e-6, f"{family} {name}: relative gradient error {error:.2e}"


def test_a_reply_that_sees_its_sibling_or_restarts_its_positions_is_caught():
    """The controls: the same shared rows, wrong in one way each, differ from the unshared row."""
    model = PackedCausalLM(tiny_model(seed=0), loss_chunk_size=16)
    unshared, shared, dropped = pair_layouts(seed=2)
    want = without_copies(model(collate_packed(unshared)).detach(), dropped)
    batch = collate_packed(shared)
    assert batch.shared_prompt_tokens == sum(length for _, length in dropped)
    sibling = collate_packed(shared)  # the second reply's prefix: the whole first segment, its sibling included
    sibling.prefixes = sibling.prefixes.clone()
    for row in range(sibling.prefixes.shape[0]):
        if sibling.prefixes[row, 1]:
            start = int(sibling.prefixes[row, 0])
            sibling.prefixes[row, 1] = int(sibling.cu_seqlens[row]) - start
    restarted = collate_packed(shared)
    restarted.position_ids = collate_packed(
        [Document(d.doc_id, d.input_ids, d.labels, segments=d.segments) for d in shared]
    ).position_ids
    for wrong in (sibling, restarted):
        got = model(wrong).detach()
        assert float((got - want).abs().max()) > 1e-3


# --------------------------------------------------------------------------------------------------------------
# The start-up probe


@pytest.mark.parametrize("family", FAMILIES)
def test_the_probe_accepts_the_attention_families(family):
    check_shared_prompts(tiny_model(seed=0, **FAMILIES[family]))


def test_the_probe_refuses_a_hybrid_by_its_mixer():
    hybrid = tiny_model(seed=0, model_type="lfm2", layer_types=["conv", "full_attention"])
    with pytest.raises(
        UnsupportedModel, match=r"short convolution layers keep a state per document.*share_prompts=false"
    ):
        check_shared_prompts(hybrid)


def test_the_probe_refuses_attention_that_ignores_the_shared_prompt(monkeypatch):
    monkeypatch.setattr(
        kernels, "_segment_keys", lambda tensor, start, end, prefix_start, prefix: tensor[:, :, start:end]
    )
    monkeypatch.setattr(
        kernels, "_document_mask", lambda length, window, device, prefix=0: torch.ones(length, length).tril().bool()
    )
    with pytest.raises(UnsupportedModel, match=r"differ by up to .* set data.share_prompts=false"):
        check_shared_prompts(tiny_model(seed=0))


def test_a_shared_row_through_another_attention_function_is_refused_not_computed_without_its_prompts():
    model = tiny_model(seed=0)
    model.set_attn_implementation("sdpa")  # (transformers' own would ignore the prompts' key ranges)
    _, shared, _ = pair_layouts(seed=0)
    with pytest.raises(ValueError, match="share a prompt needs the chattune_packed attention, not 'sdpa'"):
        PackedCausalLM(model, loss_chunk_size=16)(collate_packed(shared))
