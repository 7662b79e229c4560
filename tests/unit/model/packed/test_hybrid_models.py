"""Hybrid models (short convolutions, Mamba SSMs, gated delta rule / KDA linear attention between attention
layers) train packed and exact: one packed row of documents gives the per-token losses and gradients of
stock transformers run on each document alone (its own SDPA attention, no chattune code), fp32 on CPU. The
leak control runs the same row with the mixers over the whole row and sees the difference."""

from __future__ import annotations

import contextlib
import copy
import inspect

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers

from chattune.data.documents import IGNORE_INDEX, Document
from chattune.data.packing import collate_packed
from chattune.errors import UnsupportedModel
from chattune.model.causal_lm import PackedCausalLM
from chattune.model.packed import isolation
from chattune.model.packed.mixers import (
    GATED_DELTA_RULE,
    KDA,
    MAMBA,
    MAMBA2,
    MIXERS,
    SHORT_CONV,
    check_context_parallel,
    handled_mixers,
    seq_idx_from_cu_seqlens,
)
from conftest import tiny_model

GATED_DELTA_NET = {
    "layer_types": ["linear_attention", "full_attention"],
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}
SMALL_MAMBA2 = {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_chunk_size": 16}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
# name: (tiny config overrides, the mixer kind it must hold). Chunked recurrences: the delta rules' torch
# path chunks by 64 tokens, the Mamba-2 configs below by 16; the convolutions' kernels are 3 or 4 taps.
FAMILIES = {
    "qwen3_5": ({"model_type": "qwen3_5_text", "head_dim": 16, **GATED_DELTA_NET}, GATED_DELTA_RULE),
    "qwen3_5_moe": (
        {
            "model_type": "qwen3_5_moe_text",
            "head_dim": 16,
            **GATED_DELTA_NET,
            **MOE,
            "shared_expert_intermediate_size": 32,
        },
        GATED_DELTA_RULE,
    ),
    "qwen3_next": (
        {"model_type": "qwen3_next", "head_dim": 16, **GATED_DELTA_NET, **MOE, "shared_expert_intermediate_size": 32},
        GATED_DELTA_RULE,
    ),
    "olmo_hybrid": ({"model_type": "olmo_hybrid", **GATED_DELTA_NET}, GATED_DELTA_RULE),
    "kimi_linear": (
        {
            "model_type": "kimi_linear",
            "layer_types": ["linear_attention", "full_attention"],
            "linear_head_dim": 16,
            "linear_num_heads": 4,
            "kv_lora_rank": 32,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
        },
        KDA,
    ),
    "nemotron_h": (
        {
            "model_type": "nemotron_h",
            "layers_block_type": ["mamba", "attention"],
            "head_dim": 16,
            "mamba_num_heads": 8,
            "mamba_head_dim": 16,
            "n_groups": 1,
            "ssm_state_size": 16,
            "chunk_size": 16,
            "n_routed_experts": 4,
            "moe_intermediate_size": 32,
            "moe_shared_expert_intermediate_size": 32,
        },
        MAMBA2,
    ),
    "granitemoehybrid": (
        {
            "model_type": "granitemoehybrid",
            "layer_types": ["mamba", "attention"],
            **SMALL_MAMBA2,
            "num_local_experts": 4,
            "shared_intermediate_size": 64,
        },
        MAMBA2,
    ),
    "falcon_h1": (
        {
            "model_type": "falcon_h1",
            "mamba_d_ssm": 128,
            "mamba_n_heads": 8,
            "mamba_d_head": 16,
            "mamba_d_state": 16,
            "mamba_chunk_size": 16,
            "head_dim": 16,
        },
        MAMBA2,
    ),
    "bamba": ({"model_type": "bamba", "attn_layer_indices": [1], **SMALL_MAMBA2}, MAMBA2),
    "zamba2": (
        {
            "model_type": "zamba2",
            "layers_block_type": ["mamba", "hybrid"],
            "n_mamba_heads": 4,
            "mamba_d_state": 16,
            "chunk_size": 16,
            "adapter_rank": 8,
        },
        MAMBA2,
    ),
    "jamba": (
        {
            "model_type": "jamba",
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "expert_layer_period": 2,
            "expert_layer_offset": 1,
            "num_experts": 4,
        },
        MAMBA,
    ),
    "zamba": (
        {
            "model_type": "zamba",
            "num_hidden_layers": 5,
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "n_mamba_heads": 2,
            "mamba_d_state": 16,
        },
        MAMBA,
    ),
    "lfm2": ({"model_type": "lfm2", "layer_types": ["conv", "full_attention"]}, SHORT_CONV),
    "lfm2_moe": (
        {"model_type": "lfm2_moe", "layer_types": ["conv", "full_attention"], "num_dense_layers": 1, **MOE},
        SHORT_CONV,
    ),
}
# Longer than the chunk (64) and the kernels, of different lengths: chunk boundaries fall inside documents.
LENGTHS = (83, 17, 70)
# Mamba-1 has no chunks, and its torch path scans token by token (Zamba's 5 layers: 107 s at LENGTHS on 2 cores).
MAMBA_LENGTHS = (23, 7, 17)


def random_documents(vocab_size: int, lengths=LENGTHS, seed: int = 0, segments: bool = False) -> list[Document]:
    """Documents of random tokens, every other label ignored (the loss must keep positions straight)."""
    rng = np.random.default_rng(seed)
    documents = []
    for index, length in enumerate(lengths):
        ids = rng.integers(0, vocab_size, size=length)
        labels = np.append(ids[1:], IGNORE_INDEX)
        labels[rng.random(length) < 0.3] = IGNORE_INDEX
        split = (length // 2, length - length // 2) if segments else ()
        if segments:
            labels[split[0] - 1] = IGNORE_INDEX  # nothing trained across the chosen/rejected boundary
        documents.append(Document(doc_id=index, input_ids=ids, labels=labels, segments=split))
    return documents


def sequences(documents: list[Document]) -> list[tuple[np.ndarray, np.ndarray]]:
    """(input ids, labels) of each sequence run alone: a document, or each segment of one."""
    pieces = []
    for document in documents:
        bounds = np.cumsum((0, *(document.segments or (len(document),))))
        pieces += [(document.input_ids[a:b], document.labels[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    return pieces


def stock_losses(model, documents: list[Document]) -> torch.Tensor:
    """Per-token losses of each sequence through stock transformers alone (SDPA attention, its own mixers)."""
    losses = []
    for ids, labels in sequences(documents):
        logits = model(input_ids=torch.tensor(ids).unsqueeze(0), use_cache=False).logits[0]
        losses.append(
            F.cross_entropy(logits.float(), torch.tensor(labels), ignore_index=IGNORE_INDEX, reduction="none")
        )
    return torch.cat(losses)


def packed_and_stock(overrides: dict, documents_for, leak: bool = False):
    """(packed losses, stock losses, [(name, packed grad, stock grad)]) of one tiny model."""
    model = tiny_model(**overrides)
    stock = copy.deepcopy(model)
    stock.set_attn_implementation("sdpa")
    documents = documents_for(model.config.vocab_size)
    with isolation.leaking(MIXERS) if leak else contextlib.nullcontext():
        return compare_with_stock(PackedCausalLM(model), stock, documents)


def compare_with_stock(packed: PackedCausalLM, stock, documents: list[Document]):
    """(packed losses, stock losses, [(name, packed grad, stock grad)]): one packed row of `documents` through
    `packed`, each sequence alone through `stock` (the same weights), forward and backward."""
    packed_losses = packed(collate_packed(documents))
    packed_losses.sum().backward()
    reference = stock_losses(stock, documents)
    reference.sum().backward()
    stock_parameters = dict(stock.named_parameters())
    grads = [
        (name, p.grad, stock_parameters[name].grad)
        for name, p in packed.hf_model.named_parameters()
        if p.grad is not None
    ]
    return packed_losses.detach(), reference.detach(), grads


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


@pytest.mark.parametrize("name", FAMILIES)
def test_packed_row_equals_each_document_alone(name):
    overrides, kind = FAMILIES[name]
    assert kind in handled_mixers(tiny_model(**overrides)).values()
    lengths = MAMBA_LENGTHS if kind == MAMBA else LENGTHS
    losses, reference, grads = packed_and_stock(overrides, lambda vocab: random_documents(vocab, lengths))
    trained = reference != 0
    assert torch.allclose(losses, reference, rtol=1e-5, atol=1e-6), (losses - reference).abs().max()
    assert float(((losses - reference).abs()[trained] / reference[trained]).max()) <= 1e-5
    assert len(grads) == len(list(p for p in tiny_model(**overrides).parameters()))  # every weight trained
    worst = max(grads, key=lambda g: relative(g[1], g[2]))
    assert relative(worst[1], worst[2]) <= 1e-4, (worst[0], relative(worst[1], worst[2]))


@pytest.mark.parametrize("name", ["qwen3_5", "nemotron_h", "lfm2"])
def test_a_dpo_pair_chosen_and_rejected_are_separate_sequences(name):
    """A DPO pair is one document of two segments (chosen, rejected) sharing a prompt: each goes alone."""

    def pairs(vocab_size):
        documents = random_documents(vocab_size, lengths=(90, 40), segments=True)
        for document in documents:  # the rejected reply repeats the chosen one's prompt, as a pair does
            half = document.segments[0]
            document.input_ids[half : half + 10] = document.input_ids[:10]
        return documents

    losses, reference, grads = packed_and_stock(FAMILIES[name][0], pairs)
    assert torch.allclose(losses, reference, rtol=1e-5, atol=1e-6)
    assert max(relative(packed, stock) for _, packed, stock in grads) <= 1e-4


@pytest.mark.parametrize("name", ["qwen3_5", "nemotron_h", "lfm2", "jamba"])
def test_the_leak_control_fails_with_mixers_over_the_whole_row(name):
    lengths = MAMBA_LENGTHS if FAMILIES[name][1] == MAMBA else LENGTHS
    losses, reference, grads = packed_and_stock(
        FAMILIES[name][0], lambda vocab: random_documents(vocab, lengths), leak=True
    )
    first = lengths[0]
    assert torch.allclose(losses[:first], reference[:first], rtol=1e-5, atol=1e-6)  # nothing before document 1
    # Documents 2 and 3 see the ones before: the exactness test's limits are broken, the gradients' by far.
    assert not torch.allclose(losses[first:], reference[first:], rtol=1e-5, atol=1e-6)
    assert max(relative(packed, stock) for _, packed, stock in grads) > 100 * 1e-4


def test_seq_idx_numbers_each_token_by_its_document():
    cu_seqlens = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    assert seq_idx_from_cu_seqlens(cu_seqlens).tolist() == [[0, 0, 0, 1, 2, 2, 2, 2]]
    assert seq_idx_from_cu_seqlens(cu_seqlens).dtype == torch.int32
    assert seq_idx_from_cu_seqlens(cu_seqlens, 8).tolist() == [[0, 0, 0, 1, 2, 2, 2, 2]]


def test_context_parallelism_is_refused_with_the_layer_and_the_remedy():
    model = tiny_model(**FAMILIES["qwen3_5"][0])
    check_context_parallel(model, 1)
    with pytest.raises(UnsupportedModel, match=r"Qwen3_5GatedDeltaNet \(gated delta rule\).*parallel.context=1"):
        check_context_parallel(model, 2)
    check_context_parallel(tiny_model(), 2)  # attention only: context parallelism stays open


def test_cuda_without_the_kernels_runs_per_document_and_says_how_to_install_them(caplog, monkeypatch):
    from chattune.model.packed import mixers

    monkeypatch.setattr(mixers, "kernels_available", lambda kind: False)
    with caplog.at_level("WARNING", logger="chattune.model.packed.mixers"):
        assert mixers.choose_mixer_path(torch.device("cuda"), {GATED_DELTA_RULE, SHORT_CONV}) == set()
    assert 'pip install -e ".[hybrid]"' in caplog.text and "gated delta rule" in caplog.text
    monkeypatch.setattr(mixers, "kernels_available", lambda kind: True)
    try:
        assert mixers.choose_mixer_path(torch.device("cuda"), {GATED_DELTA_RULE, MAMBA2, SHORT_CONV, KDA, MAMBA}) == {
            GATED_DELTA_RULE,
            MAMBA2,
            SHORT_CONV,
            KDA,
        }  # no varlen path for Mamba-1 (module docstring)
        assert mixers.choose_mixer_path(torch.device("cpu"), {GATED_DELTA_RULE}) == set()
        mixers.choose_mixer_path(torch.device("cuda"), {GATED_DELTA_RULE})
        assert "varlen" in mixers.mixer_path_name({GATED_DELTA_RULE}, "cuda")
        assert mixers.mixer_path_name({GATED_DELTA_RULE}, "cpu") == "gated delta rule: per document"
        with caplog.at_level("WARNING", logger="chattune.model.packed.mixers"):
            mixers.fall_back_to_per_document("a reason")
        assert mixers.varlen_kinds() == set() and "a reason" in caplog.text
    finally:
        mixers.choose_mixer_path(torch.device("cpu"), set())


def _segments(seq_idx: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each run of equal values of a (1, N) seq_idx: the documents a kernel must keep apart."""
    values = seq_idx[0].tolist()
    starts = [i for i in range(len(values)) if i == 0 or values[i] != values[i - 1]]
    return list(zip(starts, starts[1:] + [len(values)]))


def _per_segment(function, sliced: dict[str, int], bounds):
    """`function` (transformers' torch path) run per segment on the arguments named in `sliced`, each cut on its
    sequence dimension, the outputs concatenated on the first argument's: what a varlen kernel computes."""
    names = list(inspect.signature(function).parameters)

    def run(*args, **kwargs):
        bound = dict(zip(names, args)) | kwargs
        pieces = []
        for start, end in bounds(bound):
            cut = {k: v.narrow(sliced[k], start, end - start) if k in sliced else v for k, v in bound.items()}
            out = function(**cut)
            pieces.append(out[0] if isinstance(out, tuple) else out)
        joined = torch.cat(pieces, sliced[names[0]])
        return (joined, None) if "beta" in sliced else joined

    return run


CONV = {"hidden_states": 2}  # (B, C, N)
VARLEN_STAND_INS = {  # family: (transformers module, {kernel: (its boundary argument, {argument: sequence dim})})
    "qwen3_5": (
        "transformers.models.qwen3_5.modeling_qwen3_5",
        {
            "causal_conv1d_fn": ("seq_idx", CONV),
            "torch_chunk_gated_delta_rule": ("cu_seqlens", dict.fromkeys(("query", "key", "value", "g", "beta"), 1)),
        },
    ),
    "kimi_linear": (
        "transformers.models.kimi_linear.modeling_kimi_linear",
        {
            "causal_conv1d_fn": ("seq_idx", CONV),
            "chunk_kimi_delta_attention": ("cu_seqlens", dict.fromkeys(("query", "key", "value", "g", "beta"), 1)),
        },
    ),
    "lfm2": ("transformers.models.lfm2.modeling_lfm2", {"causal_conv1d_fn": ("seq_idx", CONV)}),
    "bamba": (
        "transformers.models.bamba.modeling_bamba",
        {
            "causal_conv1d_fn": ("seq_idx", CONV),
            "mamba2_chunk_scan": ("seq_idx", dict.fromkeys(("hidden_states", "dt", "B", "C"), 1)),
        },
    ),
}


@pytest.mark.parametrize("name", VARLEN_STAND_INS)
def test_the_varlen_path_gives_the_kernels_the_rows_boundaries(name, monkeypatch):
    """The varlen path on CPU, with stand-ins for the CUDA kernels that keep documents apart only by the
    boundaries they are given (`seq_idx`, `cu_seqlens`), and fail without them: the whole row in one call per
    layer equals stock transformers on each document alone."""
    import importlib

    from chattune.model.packed import mixers

    module_name, kernels = VARLEN_STAND_INS[name]
    module = importlib.import_module(module_name)
    calls = []
    for kernel, (boundary, sliced) in kernels.items():
        torch_path = getattr(module, kernel).__wrapped__

        def bounds(bound, boundary=boundary, kernel=kernel, sliced=sliced):
            given = bound.get(boundary)
            if given is None:  # one sequence (stock transformers on one document), or a varlen call that leaks
                first = next(iter(sliced))
                return [(0, bound[first].shape[sliced[first]])]
            calls.append(kernel)
            if boundary == "seq_idx":
                assert given.dtype == torch.int32 and given.shape[0] == 1
                return _segments(given)
            edges = given.tolist()
            return list(zip(edges[:-1], edges[1:]))

        monkeypatch.setattr(module, kernel, _per_segment(torch_path, sliced, bounds))
    if name == "bamba":  # the fused training kernel (conv, scan, norm, out_proj) has no torch path: transformers
        # then takes the unfused one, whose two kernels are stood in for (the fused one takes seq_idx the same way)
        monkeypatch.setattr(module, "mamba2_split_conv1d_scan_combined", lambda *args, **kwargs: None)
    monkeypatch.setattr(mixers, "_VARLEN_DEVICES", ("cpu", "cuda"))
    monkeypatch.setattr(mixers, "kernels_available", lambda kind: True)
    kind = FAMILIES[name][1]
    try:
        assert mixers.choose_mixer_path(torch.device("cuda"), {kind}) == {kind}
        from chattune.model.checks.packing_probe import check_fast_mixers

        check_fast_mixers(tiny_model(**FAMILIES[name][0]), torch.device("cpu"))  # the start-up check keeps it
        assert mixers.varlen_kinds() == {kind}
        calls.clear()
        losses, reference, grads = packed_and_stock(FAMILIES[name][0], random_documents)
    finally:
        mixers.choose_mixer_path(torch.device("cpu"), set())
    assert set(calls) == set(kernels)  # the whole row went to each stand-in, with its boundaries
    assert torch.allclose(losses, reference, rtol=1e-5, atol=1e-6), (losses - reference).abs().max()
    assert max(relative(packed, stock) for _, packed, stock in grads) <= 1e-4


def _torch_short_conv_refuses_seq_idx() -> bool:
    from transformers.models.lfm2 import modeling_lfm2

    try:
        modeling_lfm2.causal_conv1d_fn(
            torch.zeros(1, 2, 4), torch.zeros(2, 3), seq_idx=torch.zeros(1, 4, dtype=torch.int32)
        )
    except Exception:  # refused: transformers' own TypeError/ValueError, or a real kernel's RuntimeError on CPU tensors
        return True
    return False


# transformers 5.17's torch fallback takes seq_idx and ignores it: the varlen path then leaks into the first two
# tokens of each document, 0.7% of the hidden states in bf16, under FAST_MIXER_TOLERANCE: there is nothing to refuse.
@pytest.mark.skipif(
    not _torch_short_conv_refuses_seq_idx(),
    reason=f"transformers {transformers.__version__}'s "
    "torch fallback of the short convolution ignores seq_idx instead of refusing it",
)
def test_a_varlen_path_that_fails_on_the_device_falls_back_to_per_document(caplog, monkeypatch):
    """The start-up check of the varlen path (`check_fast_mixers`), on CPU: transformers' torch fallbacks refuse
    `seq_idx` (as kernels that are missing or refuse the row would), so the run is put on the per-document path
    with a warning that says why; the miniature itself is left as it was."""
    from chattune.model.checks.packing_probe import check_fast_mixers
    from chattune.model.packed import mixers

    monkeypatch.setattr(mixers, "_VARLEN_DEVICES", ("cpu", "cuda"))
    monkeypatch.setattr(mixers, "kernels_available", lambda kind: True)
    model = tiny_model(**FAMILIES["lfm2"][0]).eval()
    try:
        mixers.choose_mixer_path(torch.device("cuda"), {SHORT_CONV})
        with caplog.at_level("WARNING", logger="chattune.model.packed.mixers"):
            check_fast_mixers(model, torch.device("cpu"))
        assert mixers.varlen_kinds() == set()
    finally:
        mixers.choose_mixer_path(torch.device("cpu"), set())
    assert "varlen kernels of the short convolution layers are not used" in caplog.text
    assert "can't keep packed sequences apart" in caplog.text and "per document (exact)" in caplog.text
    assert not model.training and next(model.parameters()).dtype == torch.float32


def test_kernels_that_are_installed_but_do_not_import_are_not_available(tmp_path, monkeypatch, caplog):
    """A causal-conv1d built for another torch is found but fails to import: transformers then falls back to its
    torch convolution, so the varlen path is not chosen, and the import error is said."""
    import sys

    from chattune.model.packed import mixers

    package = tmp_path / "causal_conv1d"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('undefined symbol: _ZN3c10 (built for another torch)')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "causal_conv1d", raising=False)
    with caplog.at_level("WARNING", logger="chattune.model.packed.mixers"):
        assert not mixers.kernels_available(SHORT_CONV)
    assert "causal_conv1d is installed but does not import" in caplog.text and "another torch" in caplog.text
    (package / "__init__.py").write_text("")
    monkeypatch.delitem(sys.modules, "causal_conv1d", raising=False)
    try:
        assert mixers.kernels_available(SHORT_CONV)
    finally:  # the stand-in imported: later tests in this process must not find it
        sys.modules.pop("causal_conv1d", None)
