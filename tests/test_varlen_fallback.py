"""torch's varlen_attn on the torch a GPU machine has: before 2.13 it has no `enable_gqa` (and some versions
only `is_causal`), so grouped-query attention repeats the kv heads. Checked on the CPU with stand-ins
that compute real attention (per-document SDPA) and accept only what each torch's signature accepts."""

from __future__ import annotations

import pytest
import torch

from chattune.errors import UnsupportedModel
from chattune.model.attention import _per_document_sdpa, torch_varlen_attn


def _attention(q, k, v, cu_seqlens, scale):  # (N, H, D) in, (N, Hq, D) out, like the kernels
    as_rows = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
    return _per_document_sdpa(*as_rows, cu_seqlens, scale, 0.0, None)[0]


def varlen_attn_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, is_causal=False):
    assert key.shape[1] == query.shape[1] and is_causal, "no GQA and causal only, as torch 2.11's"
    return _attention(query, key, value, cu_seq_q, scale)


def varlen_attn_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                     enable_gqa=False):
    assert enable_gqa == (key.shape[1] != query.shape[1]) and tuple(window_size) == (-1, 0)
    return _attention(query, key, value, cu_seq_q, scale)


@pytest.mark.parametrize("varlen_attn", [varlen_attn_2_11, varlen_attn_2_13])
def test_grouped_query_attention_on_either_torch(varlen_attn):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(12, 4, 8, generator=generator)  # 4 query heads sharing 2 kv heads
    k, v = torch.randn(12, 2, 8, generator=generator), torch.randn(12, 2, 8, generator=generator)
    cu_seqlens = torch.tensor([0, 5, 12], dtype=torch.int32)
    got = torch_varlen_attn(q, k, v, cu_seqlens, 7, 0.3, (-1, 0), varlen_attn=varlen_attn)
    want = _attention(q, k, v, cu_seqlens, 0.3)  # SDPA's own enable_gqa
    torch.testing.assert_close(got, want)


def test_a_sliding_window_needs_a_torch_that_applies_it():
    q = k = v = torch.randn(4, 2, 8)
    with pytest.raises(UnsupportedModel, match="sliding window"):
        torch_varlen_attn(q, k, v, torch.tensor([0, 4], dtype=torch.int32), 4, None, (2, 0), varlen_attn=varlen_attn_2_11)
