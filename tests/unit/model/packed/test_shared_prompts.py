"""Shared prompts (data.share_prompts): a reply continuing a prompt computed once gives, token for token, what the reply
after its own copy of the prompt gives: the attention loops on random tensors, then whole models of each family
(Llama, Qwen3, Gemma 3 with a window shorter than the prompt, Qwen3-MoE) through the packed loss and every
gradient, on rows that mix shared pairs with plain documents. Controls: a reply that also sees its sibling, and
positions restarted at 0, are caught. The start-up probe accepts those families and refuses a hybrid by its mixer
and a model whose attention ignored the shared prompt.

The CUDA path (a varlen kernel with separate query and key offsets, `SharedKeys`) is checked on the CPU with a
stand-in for torch's `varlen_attn` that keeps flash attention's contract (a causal mask aligned bottom-right where a
sequence has more keys than queries), written here from that contract; a stand-in aligned top-left is the control
the start-up probe must catch. On a GPU the `test_on_cuda_` tests run the real kernel (scripts/gpu_check)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from chattune.data.documents import IGNORE_INDEX, Document
from chattune.data.packing import collate_packed, shared_keys
from chattune.errors import UnsupportedModel
from chattune.model.causal_lm import PackedCausalLM
from chattune.model.checks.packing_probe import check_shared_prompts
from chattune.model.packed import attention, kernels
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


# --------------------------------------------------------------------------------------------------------------
# The varlen path: one kernel call with separate query and key offsets


def test_shared_keys_list_each_segments_prompt_then_its_own_tokens():
    """A plain document of 3, a pair whose first side is 6 tokens (prompt of 4 shared) and whose second continues it
    with 2: the second segment's keys are the row's positions 3..6 then 9..10."""
    first = np.arange(6)
    pair = Document(1, np.concatenate([first, [7, 8]]), np.full(8, IGNORE_INDEX), segments=(6, 2), shared_prefix=4)
    plain = Document(0, np.arange(3), np.full(3, IGNORE_INDEX))
    batch = collate_packed([plain, pair])
    assert batch.shared_keys.index.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 3, 4, 5, 6, 9, 10]
    assert batch.shared_keys.cu_seqlens_k.tolist() == [0, 3, 9, 15] and batch.shared_keys.max_k == 6
    moved = batch.to("cpu")
    assert moved.shared_keys.index.tolist() == batch.shared_keys.index.tolist()
    made_by_hand = collate_packed([plain, pair])
    made_by_hand.shared_keys = None  # (a batch built without them: `to` builds them)
    assert made_by_hand.to("cpu").shared_keys.index.tolist() == batch.shared_keys.index.tolist()
    assert collate_packed([plain]).shared_keys is None


def _flash_contract(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, enable_gqa, top_left):
    """Attention per sequence as flash attention defines it: sequence i's queries are rows cu_seq_q[i]: of the query,
    its keys rows cu_seq_k[i]: of the key; with Lk keys and Lq queries, query j stands at place Lk - Lq + j (aligned
    bottom-right; `top_left`: at j, the control) and sees key t where 0 <= place - t <= left (left -1: no limit)."""
    assert enable_gqa == (key.shape[1] != query.shape[1]) and window_size[1] == 0
    left = window_size[0]
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = scale if scale is not None else query.shape[-1] ** -0.5
    q_bounds, k_bounds = cu_seq_q.tolist(), cu_seq_k.tolist()
    assert max_q == max(b - a for a, b in zip(q_bounds, q_bounds[1:]))
    assert max_k == max(b - a for a, b in zip(k_bounds, k_bounds[1:]))
    outputs = []
    for (qa, qb), (ka, kb) in zip(zip(q_bounds, q_bounds[1:]), zip(k_bounds, k_bounds[1:]), strict=True):
        q, k, v = query[qa:qb].transpose(0, 1), key[ka:kb].transpose(0, 1), value[ka:kb].transpose(0, 1)
        places = torch.arange(qb - qa)[:, None] + (0 if top_left else (kb - ka) - (qb - qa))
        distance = places - torch.arange(kb - ka)[None, :]
        visible = (distance >= 0) & ((distance <= left) if left >= 0 else True)
        scores = (q @ k.transpose(1, 2) * scale).masked_fill(~visible, float("-inf"))
        outputs.append((scores.softmax(-1) @ v).transpose(0, 1))
    return torch.cat(outputs)


def _stand_in(top_left: bool = False):
    """torch 2.12/2.13's `varlen_attn` signature over `_flash_contract`."""

    def varlen_attn(
        query,
        key,
        value,
        cu_seq_q,
        cu_seq_k,
        max_q,
        max_k,
        *,
        return_aux=None,
        scale=None,
        window_size=(-1, -1),
        enable_gqa=False,
        seqused_k=None,
        block_table=None,
        num_splits=None,
    ):
        calls.append((cu_seq_q.tolist(), cu_seq_k.tolist()))
        return _flash_contract(
            query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, enable_gqa, top_left
        )

    calls: list[tuple[list[int], list[int]]] = []
    varlen_attn.calls = calls
    return varlen_attn


def _use_stand_in(monkeypatch, stand_in) -> None:
    monkeypatch.setattr(kernels, "_FLASH_ATTN_VARLEN", None)  # torch's varlen_attn, as without flash-attn
    monkeypatch.setattr(kernels, "_torch_varlen_attn", stand_in)
    monkeypatch.setattr(kernels, "_TORCH_VARLEN_PARAMETERS", frozenset(["enable_gqa", "scale", "window_size"]))


@pytest.mark.parametrize("window", [None, 3])
def test_the_varlen_kernel_with_shared_keys_attends_as_after_the_prompts_own_copy(window, monkeypatch):
    """Random q, k, v (4 query heads on 2 kv heads): [plain][prompt + X][Y][Z], Y and Z continuing the prompt, through
    one varlen call against [plain][prompt + X][prompt + Y][prompt + Z] per document; outputs and q, k, v gradients."""
    stand_in = _stand_in()
    _use_stand_in(monkeypatch, stand_in)
    torch.manual_seed(0)
    plain, prompt, x, y, z = 5, 6, 4, 5, 3
    lengths = [plain, prompt + x, y, z]
    rows = [torch.randn(1, heads, sum(lengths), 8) for heads in (4, 2, 2)]
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    prefixes = torch.tensor([[0, 0], [0, 0], [plain, prompt], [plain, prompt]])
    leaves = [t.clone().requires_grad_() for t in rows]
    options = VarlenOptions(max(lengths), scale=0.3, window=window)
    got = kernels._varlen(*leaves, cu, options, shared_keys(cu, prefixes))
    got.square().sum().backward()
    assert stand_in.calls == [
        (cu.tolist(), [0, plain, plain + prompt + x, plain + 2 * prompt + x + y, sum(lengths) + 2 * prompt])
    ]

    copies = [t.clone().requires_grad_() for t in rows]
    head, pieces = plain + prompt + x, []
    for t in copies:
        p = t[:, :, plain : plain + prompt]
        pieces.append(torch.cat([t[:, :, :head], p, t[:, :, head : head + y], p, t[:, :, head + y :]], dim=2))
    unshared_lengths = [plain, prompt + x, prompt + y, prompt + z]
    out = _per_document_sdpa(
        *pieces,
        torch.tensor([0, *np.cumsum(unshared_lengths)], dtype=torch.int32),
        VarlenOptions(scale=0.3, window=window),
    )
    want = torch.cat([out[:, :head], out[:, head + prompt : head + prompt + y], out[:, head + 2 * prompt + y :]], dim=1)
    want.square().sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for mine, expected in zip(leaves, copies):
        torch.testing.assert_close(mine.grad, expected.grad, rtol=1e-5, atol=1e-6)


def test_the_probe_takes_the_varlen_kernel_only_where_it_agrees(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "_shared_varlen", False)  # (restored after the test)
    assert not kernels.probe_shared_varlen(torch.device("cpu"))  # torch's own kernel: CUDA only
    _use_stand_in(monkeypatch, _stand_in(top_left=True))  # the control: replies miss most of their prompt
    with caplog.at_level("WARNING"):
        assert not kernels.probe_shared_varlen(torch.device("cpu")) and not kernels._shared_varlen
    assert "the varlen kernel differs from it by up to" in caplog.text
    _use_stand_in(monkeypatch, _stand_in())
    assert kernels.probe_shared_varlen(torch.device("cpu")) and kernels._shared_varlen


def _as_on_cuda_with_varlen(monkeypatch) -> list:
    """Every layer routed as on CUDA in bf16 (tensors on the CPU, fp32), torch's kernel replaced by the stand-in."""
    stand_in = _stand_in()
    _use_stand_in(monkeypatch, stand_in)
    real_path = attention.attention_path  # as CUDA would choose in bf16, the tensors fp32 on the CPU
    monkeypatch.setattr(
        attention,
        "attention_path",
        lambda _, __, head_dim, **features: real_path("cuda", "bfloat16", head_dim, **features),
    )
    monkeypatch.setattr(kernels, "_shared_varlen", True)
    return stand_in.calls


@pytest.mark.parametrize("family", ["llama", "gemma3_window"])
def test_a_whole_model_on_the_varlen_path_gives_a_shared_row_the_unshared_rows_losses_and_gradients(
    family, monkeypatch
):
    model = PackedCausalLM(tiny_model(seed=0, **FAMILIES[family]), loss_chunk_size=16)
    unshared, shared, dropped = pair_layouts(seed=3)
    want_losses, want_grads = loss_and_grads(model, unshared)  # the per-document loop (the CPU path)
    calls = _as_on_cuda_with_varlen(monkeypatch)
    got_losses, got_grads = loss_and_grads(model, shared)
    assert calls and all(q != k for q, k in calls)  # every layer called the kernel with the prompts' keys
    torch.testing.assert_close(got_losses, without_copies(want_losses, dropped), rtol=1e-6, atol=1e-6)
    assert sorted(got_grads) == sorted(want_grads)
    for name, grad in want_grads.items():
        error = float((got_grads[name] - grad).norm() / grad.norm().clamp_min(1e-30))
        # 3e-6: two kernels' fp32 summation orders (the stand-in's full masked softmax against SDPA per document)
        assert error <= 3e-6, f"{family} {name}: relative gradient error {error:.2e}"


def test_sinks_with_shared_prompts_take_the_exact_loop_even_where_the_varlen_kernel_is_chosen(monkeypatch):
    calls = _as_on_cuda_with_varlen(monkeypatch)
    q, k, v = (torch.randn(1, heads, 12, 8) for heads in (2, 2, 2))
    cu = torch.tensor([0, 8, 12], dtype=torch.int32)
    prefixes = torch.tensor([[0, 0], [0, 5]])
    sinks = torch.randn(2)
    got, _ = attention.packed_attention(
        torch.nn.Module(),
        q,
        k,
        v,
        None,
        cu_seq_lens_q=cu,
        max_length_q=8,
        s_aux=sinks,
        chattune_prefixes=prefixes,
        chattune_shared_keys=shared_keys(cu, prefixes),
    )
    want = _per_document_exact(q, k, v, cu, VarlenOptions(), sinks, prefixes)
    assert not calls
    torch.testing.assert_close(got, want)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the varlen flash kernels")


@cuda
def test_on_cuda_the_probe_accepts_the_varlen_kernel_and_a_model_on_it_matches_the_loop(monkeypatch):
    """The real kernel (flash-attn's or torch's) on shared rows, bf16: the start-up probe agrees, and a tiny Llama's
    per-token losses on a shared row through it are the per-document loop's within bf16's rounding."""
    monkeypatch.setattr(kernels, "_shared_varlen", False)
    assert kernels.probe_shared_varlen(torch.device("cuda"))
    model = PackedCausalLM(tiny_model(seed=0), loss_chunk_size=16).to("cuda", torch.bfloat16)
    _, shared, _ = pair_layouts(seed=4)
    batch = collate_packed(shared).to("cuda")
    fast = model(batch).float()
    monkeypatch.setattr(kernels, "_shared_varlen", False)
    loop = model(batch).float()
    assert float((fast - loop).abs().max() / loop.abs().max()) <= 2e-2
