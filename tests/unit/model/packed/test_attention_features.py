"""Attention sinks (gpt-oss), logit soft-capping (Gemma 2) and head sizes over the varlen kernels' 256 (Gemma 4's
global layers) in the packed attention.

On the CPU in fp32, a packed row of documents through tiny random models built from transformers' own configs
gives the losses and gradients of stock transformers' eager attention run on each document alone; each feature
has a control that breaks it and sees the difference. The CUDA paths are checked on the CPU with stand-ins:
torch's varlen flash ops replaced by a reference with the kernel's contract (the backward recomputes the
probabilities from the lse it is handed and the softmax correction from the output it is handed), and the
per-layer choice of path run through a whole model with the device type forced to CUDA."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn.functional as F
from test_hybrid_models import random_documents as hybrid_random_documents
from transformers import AutoConfig, AutoModelForCausalLM, Gemma2Config, GptOssConfig

from chattune.data.documents import IGNORE_INDEX, Document
from chattune.data.packing import collate_packed
from chattune.model.packed import attention
from chattune.model.packed import kernels as attention_kernels
from chattune.model.packed.attention import (
    EXACT,
    SDPA,
    SINK_VARLEN,
    VARLEN,
    AttentionLayer,
    attention_backend,
    attention_features,
    attention_path,
    packed_hidden_states,
)
from chattune.model.packed.kernels import VarlenOptions, _per_document_exact, sink_varlen_attn

WINDOW = 4
LENGTHS = (13, 6, 11)  # longer than the window, of different lengths: windows and boundaries both matter
TINY = dict(
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    sliding_window=WINDOW,
    layer_types=["sliding_attention", "full_attention"] * 2,
)


def gpt_oss_config() -> GptOssConfig:
    return GptOssConfig(**TINY, num_local_experts=4, num_experts_per_tok=2)


def gemma2_config() -> Gemma2Config:
    # A small cap so that tanh bites; no final-logit soft-capping (the head's, handled by the loss elsewhere).
    return Gemma2Config(**TINY, attn_logit_softcapping=3.0, final_logit_softcapping=None, query_pre_attn_scalar=16)


def gemma4_config():
    return AutoConfig.for_model(
        "gemma4_text", **TINY, global_head_dim=512, hidden_size_per_layer_input=16, vocab_size_per_layer_input=128
    )


CONFIGS = {"gpt_oss": gpt_oss_config, "gemma2": gemma2_config, "gemma4": gemma4_config}


def attention_modules(model) -> list[torch.nn.Module]:
    return [layer.self_attn for layer in model.model.layers]


def packed_and_stock(name: str, seed: int = 0):
    """The same random weights as a packed model and as stock transformers with its eager attention. Queries and
    keys are scaled up so that scores are large (soft-capping bites); sinks are set well away from 0."""
    torch.manual_seed(seed)
    packed = AutoModelForCausalLM.from_config(CONFIGS[name](), attn_implementation=attention.ATTENTION_NAME)
    with torch.no_grad():
        for module in attention_modules(packed):
            module.q_proj.weight.mul_(8.0)
            module.k_proj.weight.mul_(8.0)
            if isinstance(getattr(module, "sinks", None), torch.Tensor):
                module.sinks.copy_(torch.randn(module.sinks.shape) + 1.5)
    stock = copy.deepcopy(packed)
    stock.set_attn_implementation("eager")
    return packed, stock


def random_documents(vocab_size: int, lengths=LENGTHS, seed: int = 0) -> list[Document]:
    return hybrid_random_documents(vocab_size, lengths, seed)


def packed_losses(model, documents: list[Document]) -> torch.Tensor:
    batch = collate_packed(documents)
    hidden = packed_hidden_states(model, batch)
    return F.cross_entropy(model.lm_head(hidden), batch.labels[0], ignore_index=IGNORE_INDEX, reduction="none")


def stock_losses(model, documents: list[Document]) -> torch.Tensor:
    """Each document alone through stock transformers (its eager attention, its own masks)."""
    losses = []
    for document in documents:
        logits = model(input_ids=torch.tensor(document.input_ids).unsqueeze(0), use_cache=False).logits[0]
        losses.append(
            F.cross_entropy(logits, torch.tensor(document.labels), ignore_index=IGNORE_INDEX, reduction="none")
        )
    return torch.cat(losses)


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach(), want.detach()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def compare(packed, stock, documents):
    """(packed losses, stock losses, the worst relative gradient difference and its parameter)."""
    mine, reference = packed_losses(packed, documents), stock_losses(stock, documents)
    mine.sum().backward()
    reference.sum().backward()
    stock_parameters = dict(stock.named_parameters())
    worst = max(
        ((relative(p.grad, stock_parameters[n].grad), n) for n, p in packed.named_parameters() if p.grad is not None),
        key=lambda pair: pair[0],
    )
    return mine.detach(), reference.detach(), worst


@pytest.mark.parametrize("name", CONFIGS)
def test_a_packed_row_equals_stock_eager_attention_on_each_document(name):
    packed, stock = packed_and_stock(name)
    documents = random_documents(packed.config.vocab_size)
    losses, reference, (worst, parameter) = compare(packed, stock, documents)
    trained = reference != 0
    assert float(((losses - reference).abs()[trained] / reference[trained]).max()) <= 1e-5
    assert worst <= 1e-4, (parameter, worst)
    grads = [p for p in packed.parameters() if p.grad is not None]
    if name == "gpt_oss":  # the sinks are trained, and exactly
        sink_grads = [module.sinks.grad for module in attention_modules(packed)]
        assert all(g is not None and g.abs().max() > 1e-3 for g in sink_grads)
    assert len(grads) > 0


def stock_hidden_states(model, documents: list[Document]) -> torch.Tensor:
    decoder = model.model
    return torch.cat(
        [
            decoder(input_ids=torch.tensor(d.input_ids).unsqueeze(0), use_cache=False).last_hidden_state[0]
            for d in documents
        ]
    )


def control(name: str, break_it) -> float:
    """The relative difference of the final hidden states of a packed model with a feature broken and stock."""
    packed, stock = packed_and_stock(name)
    with torch.no_grad():
        for module in attention_modules(packed):
            break_it(module)
    documents = random_documents(packed.config.vocab_size)
    with torch.no_grad():
        mine, reference = packed_hidden_states(packed, collate_packed(documents)), stock_hidden_states(stock, documents)
    return relative(mine, reference)


def _no_sinks(module):
    module.sinks.fill_(float("-inf"))  # exp(-inf) = 0: the softmax without the sink


def _no_softcap(module):
    module.attn_logit_softcapping = None


def _no_window(module):
    module.sliding_window = None


@pytest.mark.parametrize(
    "name, break_it", [("gpt_oss", _no_sinks), ("gemma2", _no_softcap), ("gpt_oss", _no_window), ("gemma2", _no_window)]
)
def test_the_controls_fail_without_the_feature(name, break_it):
    assert control(name, break_it) > 1e-2


def test_the_gemma4_control_fails_without_the_window():
    assert control("gemma4", _no_window) > 1e-2


# The CUDA sink path on the CPU: torch's varlen flash ops replaced by a reference that keeps their contract.


def _visible(length: int, window_size, device) -> torch.Tensor:
    positions = torch.arange(length, device=device)
    distance = positions[:, None] - positions[None, :]
    left = window_size[0] if window_size is not None else -1
    return (distance >= 0) & ((distance <= left) if left >= 0 else True)


def reference_forward(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None, window_size=None, enable_gqa=False
):
    """torch_attn::_varlen_attn's contract: (out (N, H, D), lse (H, N) fp32, rng state), causal within each
    sequence, (left, 0) windows."""
    assert enable_gqa == (key.shape[1] != query.shape[1]) and window_size[1] == 0
    assert is_causal == (tuple(window_size) == (-1, 0))
    scale = scale if scale is not None else query.shape[-1] ** -0.5
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    bounds = cu_seq_q.tolist()
    out, lse = torch.empty_like(query), torch.empty(query.shape[1], query.shape[0])
    for start, end in zip(bounds[:-1], bounds[1:]):
        q, k, v = (t[start:end].transpose(0, 1).float() for t in (query, key, value))  # (H, L, D)
        scores = (q @ k.transpose(1, 2) * scale).masked_fill(~_visible(end - start, window_size, q.device), -torch.inf)
        lse[:, start:end] = scores.logsumexp(-1)
        out[start:end] = (scores.softmax(-1) @ v).transpose(0, 1).to(query.dtype)
    return out, lse, torch.zeros(2)


def reference_backward(
    grad_out,
    query,
    key,
    value,
    out,
    lse,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    is_causal,
    rng_state,
    scale=None,
    window_size=None,
):
    """torch_attn::_varlen_attn_backward's contract, the flash backward: P = exp(scores - lse) from the lse it is
    handed, D = rowsum(dO * O) from the output it is handed, dS = P (dO V^T - D); grouped kv heads summed."""
    scale = scale if scale is not None else query.shape[-1] ** -0.5
    groups = query.shape[1] // key.shape[1]
    key_r, value_r = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    dq, dk, dv = torch.zeros_like(query), torch.zeros_like(key_r), torch.zeros_like(value_r)
    bounds = cu_seq_q.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        q, k, v, o, do = (t[start:end].transpose(0, 1).float() for t in (query, key_r, value_r, out, grad_out))
        scores = (q @ k.transpose(1, 2) * scale).masked_fill(~_visible(end - start, window_size, q.device), -torch.inf)
        probs = torch.exp(scores - lse[:, start:end, None])
        delta = (do * o).sum(-1, keepdim=True)
        dscores = probs * (do @ v.transpose(1, 2) - delta)
        dq[start:end] = (dscores @ k * scale).transpose(0, 1)
        dk[start:end] = (dscores.transpose(1, 2) @ q * scale).transpose(0, 1)
        dv[start:end] = (probs.transpose(1, 2) @ do).transpose(0, 1)
    fold = lambda t: t.unflatten(1, (key.shape[1], groups)).sum(2)  # noqa: E731  (query heads -> their kv head)
    return dq, fold(dk), fold(dv)


STAND_IN_OPS = (reference_forward, reference_backward)


def _sink_case(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    n, hq, hkv, d = 20, 4, 2, 8
    q = (torch.randn(n, hq, d, generator=generator) * 2).requires_grad_()
    k, v = (torch.randn(n, hkv, d, generator=generator).requires_grad_() for _ in range(2))
    sinks = (torch.randn(hq, generator=generator) + 1).requires_grad_()
    cu_seqlens = torch.tensor([0, 7, 12, 20], dtype=torch.int32)
    upstream = torch.randn(n, hq, d, generator=generator)
    return q, k, v, sinks, cu_seqlens, upstream


def _exact(q, k, v, sinks, cu_seqlens, window):
    rows = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
    return _per_document_exact(*rows, cu_seqlens, VarlenOptions(window=window), sinks)[0]


def _grads(output, upstream, inputs):
    return torch.autograd.grad((output * upstream).sum(), inputs)


@pytest.mark.parametrize("window", [None, 3])
def test_the_cuda_sink_path_equals_the_exact_one_forward_and_backward(window):
    q, k, v, sinks, cu_seqlens, upstream = _sink_case()
    got = sink_varlen_attn(q, k, v, sinks, cu_seqlens, VarlenOptions(8, window=window), ops=STAND_IN_OPS)
    want = _exact(q, k, v, sinks, cu_seqlens, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for mine, reference in zip(_grads(got, upstream, (q, k, v, sinks)), _grads(want, upstream, (q, k, v, sinks))):
        assert relative(mine, reference) <= 1e-5


def test_rescaling_by_an_lse_without_gradient_gets_queries_and_keys_wrong():
    """What rescaling the lse of torch's varlen_attn(return_aux=AuxRequest(lse=True)) or flash-attn's
    return_attn_probs would train: the forward is right, the query and key gradients are not."""
    q, k, v, sinks, cu_seqlens, upstream = _sink_case()
    plain = _exact(q, k, v, None, cu_seqlens, None)
    _, lse, _ = reference_forward(
        q.detach(), k.detach(), v.detach(), cu_seqlens, cu_seqlens, 8, 8, True, None, (-1, 0), True
    )
    naive = plain * torch.sigmoid(lse - sinks[:, None]).transpose(0, 1).unsqueeze(-1)
    want = _exact(q, k, v, sinks, cu_seqlens, None)
    torch.testing.assert_close(naive, want, rtol=1e-5, atol=1e-6)
    naive_grads, exact_grads = _grads(naive, upstream, (q, k)), _grads(want, upstream, (q, k))
    assert min(relative(a, b) for a, b in zip(naive_grads, exact_grads)) > 1e-2


def reference_forward_2_11(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None, window_size=None
):
    """torch 2.11's torch_attn::_varlen_attn: no enable_gqa; its kernel given the kv heads as they are."""
    return reference_forward(
        query,
        key,
        value,
        cu_seq_q,
        cu_seq_k,
        max_q,
        max_k,
        is_causal,
        scale,
        window_size,
        enable_gqa=key.shape[1] != query.shape[1],
    )


@pytest.mark.parametrize("settled", ["repeat", "native"])
def test_the_sink_path_on_torch_2_11s_ops_gives_the_kv_heads_as_the_probe_settled_and_stays_exact(settled, monkeypatch):
    monkeypatch.setattr(attention_kernels, "_varlen_gqa", settled)
    heads_seen = []

    def recording(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None, window_size=None):
        heads_seen.append(key.shape[1])
        return reference_forward_2_11(
            query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, scale, window_size
        )

    q, k, v, sinks, cu_seqlens, upstream = _sink_case()
    got = sink_varlen_attn(q, k, v, sinks, cu_seqlens, VarlenOptions(8, window=3), ops=(recording, reference_backward))
    assert heads_seen == [q.shape[1] if settled == "repeat" else k.shape[1]]
    want = _exact(q, k, v, sinks, cu_seqlens, 3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for mine, reference in zip(_grads(got, upstream, (q, k, v, sinks)), _grads(want, upstream, (q, k, v, sinks))):
        assert relative(mine, reference) <= 1e-5


def test_the_sink_path_tells_the_kernel_what_varlen_attn_would():
    calls = []

    def recording(**kwargs):
        calls.append({k: kwargs[k] for k in ("is_causal", "window_size", "enable_gqa", "max_q")})
        return reference_forward(**kwargs)

    recording.__signature__ = inspect.signature(reference_forward)  # torch >= 2.12's op: it takes enable_gqa
    q, k, v, sinks, cu_seqlens, _ = _sink_case()
    sink_varlen_attn(q, k, v, sinks, cu_seqlens, VarlenOptions(8, window=3), ops=(recording, reference_backward))
    sink_varlen_attn(q, k, v, sinks, cu_seqlens, VarlenOptions(8), ops=(recording, reference_backward))
    assert calls == [
        {"is_causal": False, "window_size": [2, 0], "enable_gqa": True, "max_q": 8},
        {"is_causal": True, "window_size": [-1, 0], "enable_gqa": True, "max_q": 8},
    ]


@torch.library.custom_op("chattune_test::varlen_attn", mutates_args=())
def _reference_forward_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    is_causal: bool = False,
    scale: float | None = None,
    window_size: list[int] | None = None,
    enable_gqa: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return reference_forward(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, scale, window_size, enable_gqa
    )


@_reference_forward_op.register_fake
def _(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None, window_size=None, enable_gqa=False
):
    return torch.empty_like(query), query.new_empty(query.shape[1], query.shape[0]), query.new_empty(2)


@torch.library.custom_op("chattune_test::varlen_attn_backward", mutates_args=())
def _reference_backward_op(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    is_causal: bool,
    rng_state: torch.Tensor,
    scale: float | None = None,
    window_size: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grads = reference_backward(
        grad_out,
        query,
        key,
        value,
        out,
        lse,
        cu_seq_q,
        cu_seq_k,
        max_q,
        max_k,
        is_causal,
        rng_state,
        scale,
        window_size,
    )
    return tuple(g.contiguous() for g in grads)


@_reference_backward_op.register_fake
def _(
    grad_out,
    query,
    key,
    value,
    out,
    lse,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    is_causal,
    rng_state,
    scale=None,
    window_size=None,
):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def test_the_sink_path_compiles_in_one_graph(monkeypatch):
    """With custom ops standing in for torch's (registered as torch registers its own), `_SinkVarlen` traces
    forward and backward without a graph break, and the compiled gradients are the eager ones."""
    monkeypatch.setattr(attention_kernels, "_TORCH_SINK_GQA_FLAG", True)  # the stand-in ops take enable_gqa
    monkeypatch.setattr(
        attention_kernels,
        "_TORCH_SINK_OPS",
        (torch.ops.chattune_test.varlen_attn, torch.ops.chattune_test.varlen_attn_backward),
    )
    q, k, v, sinks, cu_seqlens, upstream = _sink_case()

    def loss(q, k, v, sinks):
        return (sink_varlen_attn(q * 1.0, k, v, sinks, cu_seqlens, VarlenOptions(8, window=3)) * upstream).sum()

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(q, k, v, sinks), (q, k, v, sinks))
    want = torch.autograd.grad(loss(q, k, v, sinks), (q, k, v, sinks))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    exact = _grads(_exact(q, k, v, sinks, cu_seqlens, 3), upstream, (q, k, v, sinks))
    assert max(relative(a, b) for a, b in zip(got, exact)) <= 1e-5


def test_this_torch_has_the_ops_the_sink_path_calls():
    """torch's varlen flash ops (2.11 and later), with the arguments `_SinkVarlen` passes by name (checked at
    import)."""
    assert attention_kernels._TORCH_SINK_OPS is not None


# The path of each layer.


def test_each_layer_takes_the_path_its_device_dtype_head_size_and_features_allow(monkeypatch):
    monkeypatch.setattr(attention_kernels, "_FLASH_ATTN_SOFTCAP", False)
    monkeypatch.setattr(attention_kernels, "_TORCH_SINK_OPS", STAND_IN_OPS)  # the choice, whatever ops this torch has
    assert attention_path("cpu", torch.float32, 64) == SDPA
    assert attention_path("cpu", torch.bfloat16, 64, sinks=True) == EXACT
    assert attention_path("cpu", "float32", 64, softcap=True) == EXACT
    assert attention_path("cuda", torch.float32, 64) == SDPA
    assert attention_path("cuda", torch.float32, 64, sinks=True) == EXACT
    assert attention_path("cuda", torch.bfloat16, 64) == VARLEN
    assert attention_path("cuda", "float16", 256) == VARLEN
    assert attention_path("cuda", torch.bfloat16, 512) == SDPA
    assert attention_path("cuda", torch.bfloat16, 64, value_head_dim=128) == SDPA
    assert attention_path("cuda", torch.bfloat16, 512, sinks=True) == EXACT
    assert attention_path("cuda", torch.bfloat16, 64, sinks=True) == SINK_VARLEN
    assert attention_path("cuda", torch.bfloat16, 64, softcap=True) == EXACT  # torch's varlen_attn: no softcap
    assert attention_path("cuda", torch.bfloat16, 64, sinks=True, softcap=True) == EXACT
    monkeypatch.setattr(attention_kernels, "_FLASH_ATTN_SOFTCAP", True)
    assert attention_path("cuda", torch.bfloat16, 64, softcap=True) == VARLEN
    assert attention_path("cuda", torch.bfloat16, 512, softcap=True) == EXACT
    monkeypatch.setattr(attention_kernels, "_TORCH_SINK_OPS", None)
    assert attention_path("cuda", torch.bfloat16, 64, sinks=True) == EXACT


def _force_cuda(monkeypatch) -> list[tuple[str, int]]:
    """Route as on CUDA (the tensors stay on the CPU) and record each layer's path and head size; the varlen
    kernels are replaced by the per-document computations they must equal."""
    taken = []
    real_path = attention.attention_path

    def as_on_cuda(device_type, dtype, head_dim, **features):
        path = real_path("cuda", dtype, head_dim, **features)
        taken.append((path, head_dim))
        return path

    def varlen_stand_in(query, key, value, cu_seqlens, options):
        return _per_document_exact(query, key, value, cu_seqlens, options)

    monkeypatch.setattr(attention, "attention_path", as_on_cuda)
    monkeypatch.setattr(attention_kernels, "_varlen", varlen_stand_in)
    monkeypatch.setattr(attention_kernels, "_TORCH_SINK_GQA_FLAG", True)  # the stand-in ops take enable_gqa
    monkeypatch.setattr(attention_kernels, "_TORCH_SINK_OPS", STAND_IN_OPS)
    return taken


def test_gemma4_layers_over_256_take_per_document_sdpa_and_the_others_varlen(monkeypatch):
    packed, stock = packed_and_stock("gemma4")
    taken = _force_cuda(monkeypatch)
    documents = random_documents(packed.config.vocab_size)
    packed, stock = packed.to(torch.bfloat16), stock.to(torch.bfloat16)
    with torch.no_grad():
        losses = packed_losses(packed, documents)
    assert taken == [(VARLEN, 16), (SDPA, 512), (VARLEN, 16), (SDPA, 512)]
    with torch.no_grad():
        reference = stock_losses(stock, documents)
    trained = reference != 0
    assert float(((losses - reference).abs()[trained] / reference[trained]).max()) < 5e-2  # bf16


def test_gpt_oss_on_the_cuda_sink_path_equals_stock(monkeypatch):
    """The whole model with every layer on `_SinkVarlen` (stand-in ops, fp32 so that it is exact)."""
    packed, stock = packed_and_stock("gpt_oss")
    taken = _force_cuda(monkeypatch)
    monkeypatch.setattr(attention, "_half", lambda dtype: True)
    losses, reference, (worst, parameter) = compare(packed, stock, random_documents(packed.config.vocab_size))
    assert {path for path, _ in taken} == {SINK_VARLEN}
    trained = reference != 0
    assert float(((losses - reference).abs()[trained] / reference[trained]).max()) <= 1e-5
    assert worst <= 1e-4, (parameter, worst)


# The start-up line.


def test_the_start_up_line_names_each_group_of_layers(monkeypatch):
    plain = "per-document SDPA (a loop over documents, outside compiled graphs)"
    assert attention_backend("cpu", "float32") == plain  # the old call
    monkeypatch.setattr(attention_kernels, "_TORCH_SINK_OPS", STAND_IN_OPS)  # the choice, whatever ops this torch has
    monkeypatch.setattr(attention_kernels, "_FLASH_ATTN_VARLEN", lambda *args, **kwargs: None)
    monkeypatch.setattr(attention_kernels, "_FLASH_ATTN_SOFTCAP", True)
    assert attention_backend("cuda", "bfloat16") == "flash-attn varlen"
    gemma4 = attention_features(AutoModelForCausalLM.from_config(gemma4_config()))
    assert gemma4 == (AttentionLayer(16), AttentionLayer(512), AttentionLayer(16), AttentionLayer(512))
    assert attention_backend("cuda", "bfloat16", gemma4) == f"flash-attn varlen; 2 layers with head size 512: {plain}"
    assert attention_backend("cpu", "float32", gemma4) == plain
    gpt_oss = attention_features(AutoModelForCausalLM.from_config(gpt_oss_config()))
    assert gpt_oss == (AttentionLayer(16, sinks=True),) * 4
    monkeypatch.setattr(attention_kernels, "_TORCH_SINK_GQA_FLAG", True)
    assert attention_backend("cuda", "bfloat16", gpt_oss).startswith(
        "all 4 layers with attention sinks: torch varlen flash kernel (grouped-query attention native (enable_gqa)), "
        "output times sigmoid(lse - sink)"
    )
    monkeypatch.setattr(attention_kernels, "_TORCH_SINK_GQA_FLAG", False)  # torch 2.11's ops, as the probe settled
    monkeypatch.setattr(attention_kernels, "_varlen_gqa", "repeat")
    assert "torch varlen flash kernel (grouped-query attention by repeated kv heads)" in attention_backend(
        "cuda", "bfloat16", gpt_oss
    )
    assert attention_backend("cpu", "float32", gpt_oss).startswith(
        "all 4 layers with attention sinks: per-document exact attention"
    )
    gemma2 = attention_features(AutoModelForCausalLM.from_config(gemma2_config()))
    assert gemma2 == (AttentionLayer(16, softcap=True),) * 4
    assert attention_backend("cuda", "bfloat16", gemma2) == "all 4 layers with soft-capping: flash-attn varlen"
    monkeypatch.setattr(attention_kernels, "_FLASH_ATTN_SOFTCAP", False)
    assert attention_backend("cuda", "bfloat16", gemma2).startswith(
        "all 4 layers with soft-capping: per-document exact attention"
    )
    latent = (AttentionLayer(192, value_head_dim=128),)  # query/key and value heads of different sizes (MLA)
    assert attention_backend("cuda", "bfloat16", latent) == f"1 layer with value head size 128: {plain}"
    mixed = (AttentionLayer(64),) * 3 + (AttentionLayer(64, sinks=True),)
    assert attention_backend("cpu", "float32", mixed).startswith(f"{plain}; 1 layer with attention sinks: per-document")


def test_a_plain_model_has_plain_attention_layers():
    from conftest import tiny_model

    assert attention_features(tiny_model()) == (AttentionLayer(16),) * 2


# On a CUDA machine: the real kernels against the exact path (bf16 inputs, fp32 reference from the same inputs).

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the varlen flash kernels")


def _cuda_case(hq: int = 8, hkv: int = 2, d: int = 64):
    generator = torch.Generator(device="cuda").manual_seed(0)
    n = 300
    q, k, v = (
        torch.randn(n, h, d, generator=generator, device="cuda", dtype=torch.bfloat16).requires_grad_()
        for h in (hq, hkv, hkv)
    )
    sinks = (torch.randn(hq, generator=generator, device="cuda") + 1).requires_grad_()
    cu_seqlens = torch.tensor([0, 100, 130, 300], dtype=torch.int32, device="cuda")
    upstream = torch.randn(n, hq, d, generator=generator, device="cuda")
    return q, k, v, sinks, cu_seqlens, upstream


@cuda
@pytest.mark.parametrize("window", [None, 64])
def test_on_cuda_the_sink_kernel_path_equals_the_exact_one(window):
    q, k, v, sinks, cu_seqlens, upstream = _cuda_case()
    got = sink_varlen_attn(q, k, v, sinks, cu_seqlens, VarlenOptions(170, window=window))
    fp32 = [t.detach().float().requires_grad_() for t in (q, k, v)]
    want = _exact(*fp32, sinks, cu_seqlens, window)
    assert relative(got.float(), want) <= 1e-2
    mine = _grads(got.float(), upstream, (q, k, v, sinks))
    reference = _grads(want, upstream, (*fp32, sinks))
    worst = max(relative(a.float(), b) for a, b in zip(mine, reference))
    assert worst <= 3e-2, worst


@cuda
@pytest.mark.skipif(not attention_kernels._FLASH_ATTN_SOFTCAP, reason="needs flash-attn with softcap")
def test_on_cuda_flash_attn_soft_capping_equals_the_exact_path():
    q, k, v, _, cu_seqlens, upstream = _cuda_case()
    rows = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
    got = attention_kernels._varlen(*rows, cu_seqlens, VarlenOptions(170, scale=0.125, window=64, softcap=3.0))[0]
    fp32 = [t.detach().float().requires_grad_() for t in (q, k, v)]
    want = _per_document_exact(
        *[t.transpose(0, 1).unsqueeze(0) for t in fp32], cu_seqlens, VarlenOptions(scale=0.125, window=64, softcap=3.0)
    )[0]
    assert relative(got.float(), want) <= 1e-2
    worst = max(
        relative(a.float(), b)
        for a, b in zip(_grads(got.float(), upstream, (q, k, v)), _grads(want, upstream, tuple(fp32)))
    )
    assert worst <= 3e-2, worst


@cuda
def test_on_cuda_head_size_512_takes_per_document_sdpa():
    q, k, v, _, cu_seqlens, _ = _cuda_case(d=512)
    rows = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
    assert attention_path("cuda", q.dtype, 512) == SDPA
    got = attention.packed_attention(
        torch.nn.Module(), *rows, None, scaling=None, cu_seq_lens_q=cu_seqlens, max_length_q=170
    )[0][0]
    want = _per_document_exact(*[t.float() for t in rows], cu_seqlens, VarlenOptions())[0]
    assert relative(got.float(), want) <= 1e-2
