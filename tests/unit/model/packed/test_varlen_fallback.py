"""torch's varlen_attn on the torch a GPU machine has: torch 2.11's has no `enable_gqa` (2.12 added it), so
grouped-query attention either passes unequal head counts to the kernel as they are (where a probe at
start-up sees that agree with repeated kv heads) or repeats the kv heads. Checked on the CPU with stand-ins
that compute real attention (per-document SDPA) and have exactly the signature of each supported torch's
`torch.nn.attention.varlen.varlen_attn` (2.11.0, 2.12.0 and 2.13.0, read from their wheels). torch 2.10's
(positional `is_causal`, no `scale`, no `window_size`) is below the supported range (pyproject.toml)."""

from __future__ import annotations

import inspect

import pytest
import torch

from chattune.model.packed.kernels import VarlenOptions, _per_document_sdpa, probe_native_gqa, torch_varlen_attn


def _attention(q, k, v, cu_seqlens, scale):  # (N, H, D) in, (N, Hq, D) out, like the kernels
    as_rows = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
    return _per_document_sdpa(*as_rows, cu_seqlens, VarlenOptions(scale=scale))[0]


def varlen_attn_2_11(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
):
    """torch 2.11's signature, over a kernel that refuses unequal head counts."""
    assert key.shape[1] == query.shape[1], "no GQA flag: the kv heads must come repeated"
    assert tuple(window_size) == (-1, 0)
    return _attention(query, key, value, cu_seq_q, scale)


def varlen_attn_2_12(
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
    """torch 2.12's and 2.13's signature (the same)."""
    assert enable_gqa == (key.shape[1] != query.shape[1]) and tuple(window_size) == (-1, 0)
    return _attention(query, key, value, cu_seq_q, scale)


def varlen_attn_native_gqa(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
):
    """torch 2.11's wrapper over a kernel that takes fewer kv heads as they are (the flash kernel)."""
    assert tuple(window_size) == (-1, 0)
    return _attention(query, key, value, cu_seq_q, scale)


def varlen_attn_first_kv_head(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
):
    """A wrapper that takes unequal head counts without complaint and computes the wrong thing with them."""
    if key.shape[1] != query.shape[1]:
        key, value = key[:, :1].expand(-1, query.shape[1], -1), value[:, :1].expand(-1, query.shape[1], -1)
    return _attention(query, key, value, cu_seq_q, scale)


def test_the_stand_ins_have_the_signature_of_this_torch():
    from torch.nn.attention.varlen import varlen_attn

    names = list(inspect.signature(varlen_attn).parameters)
    assert names in (
        [*inspect.signature(varlen_attn_2_11).parameters],
        [*inspect.signature(varlen_attn_2_12).parameters],
    )


@pytest.mark.parametrize("varlen_attn", [varlen_attn_2_11, varlen_attn_2_12])
def test_grouped_query_attention_on_either_torch(varlen_attn):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(12, 4, 8, generator=generator)  # 4 query heads sharing 2 kv heads
    k, v = torch.randn(12, 2, 8, generator=generator), torch.randn(12, 2, 8, generator=generator)
    cu_seqlens = torch.tensor([0, 5, 12], dtype=torch.int32)
    got = torch_varlen_attn(q, k, v, cu_seqlens, VarlenOptions(7, 0.3), varlen_attn=varlen_attn)
    want = _attention(q, k, v, cu_seqlens, 0.3)  # SDPA's own enable_gqa
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("varlen_attn", [varlen_attn_2_11, varlen_attn_2_12])
def test_every_supported_torch_is_given_the_sliding_window(varlen_attn):
    seen = []

    def recording(*args, window_size=(-1, -1), **kwargs):
        seen.append(tuple(window_size))
        return args[0]

    recording.__signature__ = inspect.signature(varlen_attn)  # what torch_varlen_attn reads
    q = k = v = torch.randn(4, 2, 8)
    torch_varlen_attn(
        q, k, v, torch.tensor([0, 4], dtype=torch.int32), VarlenOptions(4, window=3), varlen_attn=recording
    )
    assert seen == [(2, 0)]


@pytest.mark.parametrize(
    "varlen_attn, settled",
    [
        (varlen_attn_2_12, "flag"),
        (varlen_attn_native_gqa, "native"),
        (varlen_attn_2_11, "repeat"),
        (varlen_attn_first_kv_head, "repeat"),
    ],
)
def test_the_probe_uses_unequal_head_counts_only_where_they_agree_with_repeated_kv_heads(varlen_attn, settled):
    assert probe_native_gqa(torch.device("cpu"), varlen_attn=varlen_attn) == settled


def test_native_grouped_query_attention_hands_the_kernel_the_kv_heads_as_they_are():
    calls = []

    def recording(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
    ):
        calls.append(key.shape[1])
        return varlen_attn_native_gqa(
            query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size
        )

    generator = torch.Generator().manual_seed(1)
    q = torch.randn(9, 4, 8, generator=generator)
    k, v = torch.randn(9, 2, 8, generator=generator), torch.randn(9, 2, 8, generator=generator)
    cu_seqlens = torch.tensor([0, 4, 9], dtype=torch.int32)
    got = torch_varlen_attn(q, k, v, cu_seqlens, VarlenOptions(5), varlen_attn=recording, gqa="native")
    torch.testing.assert_close(got, _attention(q, k, v, cu_seqlens, None))
    assert calls == [2], "the kv heads must not be repeated"
