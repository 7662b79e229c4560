"""Attention that selects its keys per query (DeepSeek Sparse Attention and kin, Qwen4-Exp's QSA, MiniMax-M3's
block-sparse layers, DeepSeek-V4's compressed attention) trains packed and exact (`chattune.model.packed.indexed_attention`):
one packed row of documents longer than the selection (index_topk 8 against 23 to 57 tokens) gives, forward and
backward in training mode, the per-token losses and every gradient of stock transformers run on each document alone
(eager attention, no chattune code), through the walk's start-up path (`tests/unit/model/checks/test_every_architecture.walk`). The
controls: the stock model with its selection widened to every key computes other losses at these lengths (so the
selection is exercised); the layers run over the whole row (their indexer choosing among earlier documents' tokens)
or the selection left out of the attention, and the comparison fails; the start-up checks refuse both."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import test_every_architecture as walk_module
import torch
import torch.nn.functional as F
from test_every_architecture import check_exact, stock_losses, tiny_config, walk
from transformers import AutoModelForCausalLM

from chattune.data.documents import IGNORE_INDEX, Document
from chattune.data.packing import collate_packed
from chattune.errors import UnsupportedModel
from chattune.model.causal_lm import PackedCausalLM
from chattune.model.checks.architecture import check_architecture
from chattune.model.cost.flops import text_config
from chattune.model.packed import indexed_attention, isolation
from chattune.model.packed.attention import ATTENTION_NAME, packed_attention, stock_attention
from chattune.objectives.dpo import LiveReference

# Per family: what the walk's tiny config gets so that the selection is smaller than the documents (LENGTHS).
QWEN4_PLE = {"ple_layer_ids": [1, 3], "eos_token_id": 3, "ple_embed_dim": 64, "ngram_vocab_size_base": 1000}
SPARSE = {
    "deepseek_v32": {"index_topk": 8},
    "glm_moe_dsa": {"index_topk": 8, "indexer_types": ["full", "shared", "full", "shared"]},  # layers reusing top-k
    "dots3_note_text": {"index_topk": 8},  # indexed layers among sliding-window ones
    "hy_v4": {"index_topk": 8},  # attention sinks; its third layer reuses the second's top-k
    "axk2": {"index_topk": 8},
    # blocks of 4 tokens, the 2 best and the unfinished one; PLE on (its checkpoints have it), its n-grams per document
    "qwen4_exp_text": {**walk_module.EXTRA["qwen4_exp_text"], **QWEN4_PLE},
    # a compressed entry per 4 (CSA: the indexer's 2 best) or 8 (HCA: all) tokens, after the 8-token window; sinks
    "deepseek_v4": {
        "index_topk": 2,
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    },
    "minimax_m3_vl_text": {  # its default config has no sparse layer
        "layer_types": ["minimax_m3_sparse", "minimax_m3_sparse"],
        "index_block_size": 4,
        "index_topk_blocks": 2,
        "index_local_blocks": 1,
    },
}
LENGTHS = (40, 23, 57)


@pytest.fixture
def sparse(monkeypatch):
    """The walk with each family's selection smaller than its documents (`SPARSE`, `LENGTHS`)."""
    monkeypatch.setattr(walk_module, "LENGTHS", LENGTHS)
    for family, extra in SPARSE.items():
        monkeypatch.setitem(walk_module.EXTRA, family, extra)


def select_everything(model: torch.nn.Module) -> None:
    """Every earlier key (block, compressed entry) selected: the layers' dense counterpart."""
    for module in model.modules():
        for name in ("index_topk", "topk_blocks"):
            if isinstance(getattr(module, name, None), int):
                setattr(module, name, 10**6)
        if isinstance(getattr(module, "block_topk", None), int):  # Qwen4-Exp: a budget of 256 tokens
            module.token_budget = 256
            module.block_topk = module.token_budget // module.compress_ratio


@pytest.mark.parametrize("family", SPARSE)
def test_a_packed_row_trains_as_each_document_alone(family, sparse):
    trained = walk(family)
    assert not isinstance(trained, UnsupportedModel), trained
    check_exact(trained)
    # The selection matters at these lengths: the same stock model attending to every earlier key differs.
    config = tiny_config(family)
    torch.manual_seed(0)  # walk's weights
    dense = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    select_everything(dense)
    with torch.no_grad():
        dense_losses = stock_losses(dense.train(), walk_module.random_documents(text_config(config).vocab_size))
    assert float((dense_losses - trained.reference).abs().max()) > 1e-3


# One of each code path: DeepSeek Sparse Attention with shared layers (GLM-5), with sinks (HY-V4), and the others.
@pytest.mark.parametrize("family", ["glm_moe_dsa", "hy_v4", "qwen4_exp_text", "deepseek_v4", "minimax_m3_vl_text"])
def test_the_layers_over_the_whole_row_read_earlier_documents(family, sparse, monkeypatch):
    """The control: each indexed layer run once over the row (its indexer choosing among earlier documents' tokens,
    attention reading them); the start-up check, which refuses it, left out. Even the first document may differ:
    `topk` breaks ties (ReLU makes exact zeros common) by where they lie in the row it is given, so only scores of
    the document's own length choose as stock does."""
    monkeypatch.setattr(walk_module, "check_architecture", lambda config: None)
    with isolation.leaking(indexed_attention.INDEXERS):
        trained = walk(family)
    with pytest.raises(AssertionError, match="packed losses differ"):
        check_exact(trained)


@pytest.mark.parametrize("family", ["deepseek_v32", "hy_v4", "minimax_m3_vl_text"])
def test_the_selection_left_out_of_the_attention_is_dense_attention(family, sparse, monkeypatch):
    """The control for the families that hand their selection to the attention function (`indices`,
    `block_indices`): without it folded into the mask, each document attends to every earlier key."""
    monkeypatch.setattr(walk_module, "check_architecture", lambda config: None)
    monkeypatch.setattr(indexed_attention, "_selection_mask", lambda module, mask, *args: mask)
    with pytest.raises(AssertionError, match="packed losses differ"):
        check_exact(walk(family))


def pairs(vocab_size: int, lengths: tuple[tuple[int, int], ...] = ((40, 23), (30, 27))) -> list[Document]:
    """DPO pairs: one document each, chosen then rejected (two segments) sharing a 12-token prompt, trained on
    their replies (`chattune.data.templates.pair_documents`)."""
    rng = np.random.default_rng(1)
    documents = []
    for index, (chosen, rejected) in enumerate(lengths):
        prompt = rng.integers(0, vocab_size, size=12)
        sides = [np.concatenate([prompt, rng.integers(0, vocab_size, size=n - 12)]) for n in (chosen, rejected)]
        labels = [np.append(side[1:], IGNORE_INDEX) for side in sides]
        for side_labels in labels:
            side_labels[:11] = IGNORE_INDEX
        documents.append(
            Document(
                doc_id=index,
                input_ids=np.concatenate(sides),
                labels=np.concatenate(labels),
                segments=(chosen, rejected),
            )
        )
    return documents


def side_logps(model, document: Document) -> list[float]:
    """Each side's summed log-probability of its trained tokens, the side run alone through stock transformers."""
    bounds = np.cumsum((0, *document.segments))
    logps = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        logits = model(input_ids=torch.tensor(document.input_ids[start:end]).unsqueeze(0), use_cache=False).logits[0]
        labels = torch.tensor(document.labels[start:end])
        logps.append(-float(F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")))
    return logps


@pytest.mark.parametrize("family", ["glm_moe_dsa", "qwen4_exp_text"])
def test_the_dpo_reference_pass_gives_each_side_its_stock_log_probs(family, sparse):
    """The DPO reference pass (`LiveReference`: a no-grad forward of the packed pairs) gives each pair's chosen and
    rejected log-probs as stock transformers computes them on each side alone: the rejected side's top-k (and its
    n-grams) never read the chosen side. The control runs the pairs' rows as one sequence and differs."""
    config = tiny_config(family)
    check_architecture(copy.deepcopy(config))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=ATTENTION_NAME, dtype=torch.float32)
    stock = copy.deepcopy(model)
    stock.set_attn_implementation("eager")
    documents = pairs(text_config(config).vocab_size)
    batch = collate_packed(documents)
    chosen, rejected = LiveReference(PackedCausalLM(model))(batch)
    with torch.no_grad():
        want = torch.tensor([side_logps(stock.eval(), document) for document in documents], dtype=torch.float64)
    got = torch.stack([chosen, rejected], dim=1).double()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4), (got - want).abs().max()
    with isolation.leaking(indexed_attention.INDEXERS):
        leaked = torch.stack(LiveReference(PackedCausalLM(model))(batch), dim=1).double()
    assert float((leaked[:, 1] - want[:, 1]).abs().min()) > 1e-2  # every rejected side read its chosen one


@pytest.mark.parametrize("family", ["deepseek_v32", "qwen4_exp_text", "deepseek_v4", "minimax_m3_vl_text"])
def test_the_start_up_check_sees_the_selection_when_it_is_cut_below_its_documents(family, monkeypatch):
    """The miniature's checks (`check_architecture`) pass with the selection cut below the probe's documents
    (`architecture_check.SCALES`, `COMPRESS_RATES`) and refuse the layers run over the
    whole row; with the selection left out of the attention, they refuse the model at any budget (the miniature cuts
    the budget below the probe's documents)."""
    config = tiny_config(family)  # the miniature cuts its selection below the probe's documents itself
    text = text_config(config)
    if family == "minimax_m3_vl_text":
        text.layer_types = ["minimax_m3_sparse"] * text.num_hidden_layers
    check_architecture(copy.deepcopy(config))
    with isolation.leaking(indexed_attention.INDEXERS), pytest.raises(UnsupportedModel, match="does not keep packed"):
        check_architecture(copy.deepcopy(config))
    if family in ("deepseek_v32", "minimax_m3_vl_text"):  # their selection reaches the attention function
        monkeypatch.setattr(indexed_attention, "_selection_mask", lambda module, mask, *args: mask)
        with pytest.raises(UnsupportedModel, match="computes a single document differently"):
            check_architecture(copy.deepcopy(config))
        # at budgets above the probe's documents too (DeepSeek's 2048 keys, 128-token blocks): the miniature cuts
        # them below (`architecture_check.SCALES`), so a dropped selection is seen whatever the config says
        wide = _wide_blocks(config) if family == "minimax_m3_vl_text" else copy.deepcopy(config)
        if family == "deepseek_v32":
            text_config(wide).index_topk = 2048
        with pytest.raises(UnsupportedModel, match="computes a single document differently"):
            check_architecture(wide)


def _wide_blocks(config):
    """MiniMax-M3's sparse layers with blocks as wide as the default's (128 tokens): one block, always selected."""
    config = copy.deepcopy(config)
    text_config(config).index_block_size = 128
    return config


def test_qwen4_n_grams_restart_at_each_document(sparse, monkeypatch):
    """Qwen4-Exp's per-layer n-gram embeddings hash each token with the ones before it and convolve over the row:
    run over the row, a document's first n-grams read the previous document's last tokens, which the probe refuses."""
    monkeypatch.delitem(indexed_attention.PER_DOCUMENT_MODULES, "Qwen4ExpTextPLELayer")
    with pytest.raises(UnsupportedModel, match="does not keep packed documents apart"):
        check_architecture(tiny_config("qwen4_exp_text"))


def test_an_indexer_chattune_does_not_run_per_document_is_refused(monkeypatch):
    monkeypatch.delitem(indexed_attention.HANDLED, "DeepseekV32Attention")
    with pytest.raises(UnsupportedModel, match="DeepseekV32Indexer, which chattune does not run per document"):
        check_architecture(tiny_config("deepseek_v32"))


def test_a_selection_outside_a_per_document_call_is_refused():
    """An attention layer chattune does not run per document that hands its attention function a selection would
    train dense attention: refused, not ignored."""
    query = torch.randn(1, 4, 6, 16)
    with pytest.raises(UnsupportedModel, match=r"selection of keys per query \(indices\)"):
        packed_attention(
            torch.nn.Linear(1, 1),
            query,
            query,
            query,
            None,
            indices=torch.zeros(1, 6, 2, dtype=torch.int32),
            cu_seq_lens_q=torch.tensor([0, 6]),
        )


def test_context_parallelism_is_refused_and_a_deep_copy_runs_its_own_weights():
    config = tiny_config("glm_moe_dsa")
    model = AutoModelForCausalLM.from_config(config, attn_implementation=ATTENTION_NAME, dtype=torch.float32)
    assert "(GlmMoeDsaAttention x4: DeepSeek Sparse Attention" in indexed_attention.indexed_path_name(
        model
    )  # the start-up compute line
    assert indexed_attention.indexed_path_name(AutoModelForCausalLM.from_config(tiny_config("llama"))) is None
    indexed_attention.check_context_parallel(model, 1)
    with pytest.raises(UnsupportedModel, match="set parallel.context=1"):
        indexed_attention.check_context_parallel(model, 2)
    batch = collate_packed(walk_module.random_documents(text_config(config).vocab_size))
    packed = PackedCausalLM(model).eval()
    with torch.no_grad():
        losses = packed(batch)
        twin = copy.deepcopy(packed)  # `check_stock_attention` copies a miniature that has run packed
        attention = twin.hf_model.model.layers[0].self_attn
        assert attention.forward.__self__ is attention
        attention.o_proj.weight.zero_()
        assert not torch.allclose(twin(batch), losses) and torch.equal(packed(batch), losses)


@pytest.mark.parametrize("family", ["hy_v4", "deepseek_v4"])
def test_generation_after_packed_training_is_stock_generation(family, sparse):
    """Generation (eval samples) runs transformers' own attention and masks with a KV cache: the per-document layers
    step aside, and a model without an SDPA path (HY-V4's and DeepSeek-V4's sinks) generates with eager attention.
    Greedy tokens equal those of the stock model."""
    config = tiny_config(family)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=ATTENTION_NAME, dtype=torch.float32).eval()
    stock = copy.deepcopy(model)
    stock.set_attn_implementation("eager")
    prompt = torch.tensor([[5, 17, 9, 33, 2, 41, 7, 12, 60, 3, 8]])
    settings = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        PackedCausalLM(model)(collate_packed(walk_module.random_documents(text_config(config).vocab_size)))
        with stock_attention(model):
            tokens = model.generate(input_ids=prompt, **settings)
        assert torch.equal(tokens, stock.generate(input_ids=prompt, **settings))
    assert model.config._attn_implementation == ATTENTION_NAME
