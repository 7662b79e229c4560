"""The recurrent families (Mamba-1, FalconMamba, MiniMax's lightning attention, RecurrentGemma's recurrent block, RWKV's
time and channel mixing, xLSTM's mLSTM, Bailing's delta attention) train packed and exact: one packed row gives the
per-token losses and gradients of stock transformers run on each document alone (its eager attention, no chattune
code), fp32 on CPU, training mode, forward and backward, on the walk's documents and on documents longer than the
recurrences' chunks (lightning attention's blocks and xLSTM's chunks set to 16 tokens; Bailing's delta rule chunks
by 64, which they do not reach). The leak control runs the same row with the mixers over the whole row: the start-up
probe refuses it and the losses and gradients differ.

Their decoders pass the row's boundaries to no layer (Mamba's, RWKV's, xLSTM's), so hooks on the model and its
decoder hand them to the mixers (`chattune.model.packed.mixers`): also when activation checkpointing recomputes a layer in
the backward. Generation (a cache or recurrent state, no boundaries) runs the mixers' own forwards."""

from __future__ import annotations

import contextlib
import copy

import pytest
import test_every_architecture
import torch
from test_every_architecture import (
    Trained,
    check_exact,
    random_documents,
    stock_losses,
    tiny_config,
)
from torch.utils.checkpoint import CheckpointError
from transformers import AutoModelForCausalLM, PretrainedConfig

from chattune.data.packing import collate_packed
from chattune.errors import UnsupportedModel
from chattune.model.causal_lm import PackedCausalLM
from chattune.model.checks.architecture import _check_output_head
from chattune.model.checks.packing_probe import check_packing_isolation
from chattune.model.cost.flops import text_config
from chattune.model.head.output_logits import LogitTransform
from chattune.model.packed import isolation, mixers
from chattune.model.packed.attention import ATTENTION_NAME, packed_hidden_states

# model type: (what the walk's tiny config needs besides, the mixer kinds the model must hold)
FAMILIES = {
    "mamba": ({}, {mixers.MAMBA}),
    "falcon_mamba": ({}, {mixers.MAMBA}),
    "minimax": ({"block_size": 16}, {mixers.LIGHTNING}),  # blocks of 16 tokens: the long documents cross several
    # three layers: the third is its local attention (the tiny config's two are both recurrent)
    "recurrent_gemma": ({"num_hidden_layers": 3}, {mixers.RG_LRU}),
    "rwkv": ({}, {mixers.RWKV_TIME, mixers.RWKV_CHANNEL}),
    # num_blocks is its depth (the tiny config cuts num_hidden_layers only); chunks of 16 tokens; a query and key
    # as wide as the values (its cache, so its generation, needs them so)
    "xlstm": ({"num_blocks": 2, "chunk_size": 16, "qk_dim_factor": 1.0}, {mixers.MLSTM}),
    "bailing_hybrid": (
        {
            "num_hidden_layers": 2,
            "layer_types": ["linear_attention", "full_attention"],
            "mlp_layer_types": ["dense", "sparse"],
        },
        {mixers.BAILING_KDA},
    ),
}
SHORT, LONG = (13, 6, 10), (40, 23, 57)  # the walk's documents; longer than the chunks of 16


def family_config(model_type: str) -> PretrainedConfig:
    config = tiny_config(model_type)
    for name, value in FAMILIES[model_type][0].items():
        setattr(config, name, value)
    return config


def build(model_type: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        family_config(model_type), attn_implementation=ATTENTION_NAME, dtype=torch.float32
    )
    model.config.use_cache = False
    return model


def packed_and_stock(model_type: str, lengths: tuple[int, ...], monkeypatch, leak: bool = False) -> Trained:
    """One packed row of `lengths` documents through chattune, forward and backward in training mode, against a copy
    of the same weights with transformers' eager attention run on each document alone (as the walk does)."""
    monkeypatch.setattr(test_every_architecture, "LENGTHS", lengths)
    model = build(model_type)
    stock = copy.deepcopy(model)
    stock.set_attn_implementation("eager")
    assert FAMILIES[model_type][1] <= set(mixers.handled_mixers(model).values())
    packed = PackedCausalLM(model)
    packed.train(), stock.train()
    documents = random_documents(text_config(model.config).vocab_size)
    with isolation.leaking(mixers.MIXERS) if leak else contextlib.nullcontext():
        losses = packed(collate_packed(documents))
    losses.sum().backward()
    reference = stock_losses(stock, documents)
    reference.sum().backward()
    stock_grads = {name: p.grad for name, p in stock.named_parameters()}
    grads = {name: (p.grad, stock_grads[name]) for name, p in model.named_parameters()}
    return Trained(losses.detach(), reference.detach(), grads)


@pytest.mark.parametrize("lengths", [SHORT, LONG], ids=["short", "long"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_packed_row_equals_each_document_alone(model_type, lengths, monkeypatch):
    trained = packed_and_stock(model_type, lengths, monkeypatch)
    check_exact(trained)
    assert all(packed is not None for packed, _ in trained.grads.values())  # every weight trained


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_leak_control_fails_with_mixers_over_the_whole_row(model_type, monkeypatch):
    trained = packed_and_stock(model_type, LONG, monkeypatch, leak=True)
    first = LONG[0]
    losses, reference = trained.losses, trained.reference
    assert torch.allclose(losses[:first], reference[:first], rtol=1e-5, atol=1e-5)  # nothing before document 1
    assert not torch.allclose(losses[first:], reference[first:], rtol=1e-5, atol=1e-5)
    with pytest.raises(AssertionError, match="differ"):
        check_exact(trained)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_packing_probe_accepts_them_and_refuses_the_leak(model_type):
    model = build(model_type)
    check_packing_isolation(model)
    with (
        isolation.leaking(mixers.MIXERS),
        pytest.raises(UnsupportedModel, match="does not keep packed documents apart"),
    ):
        check_packing_isolation(model)


@pytest.mark.parametrize("model_type", ["recurrent_gemma", "xlstm"])
def test_the_logit_soft_cap_is_applied_and_the_output_layer_check_sees_it(model_type, monkeypatch):
    """RecurrentGemma caps its logits at config.logits_soft_cap, xLSTM at config.output_logit_soft_cap (30 both):
    chattune's losses apply the cap (the output-layer check passes on logits large enough to saturate it); with the
    cap left out of the losses, the check refuses the model."""
    model = build(model_type)
    assert LogitTransform.from_config(model.config).softcap == 30.0
    _check_output_head(model)
    monkeypatch.setattr(LogitTransform, "from_config", classmethod(lambda cls, config: cls()))
    with pytest.raises(UnsupportedModel, match="computes its logits differently"):
        _check_output_head(model)


@pytest.mark.parametrize("model_type", ["mamba", "recurrent_gemma", "rwkv", "xlstm", "minimax"])
def test_generation_after_packed_training_runs_the_mixers_own_forwards(model_type):
    """After a packed training forward (the mixers isolated), `PackedCausalLM.generate` (a cache, no boundaries) gives
    the logits of a stock copy made before: its mixers run their own forwards, and a model without softmax attention
    (Mamba, xLSTM, RWKV) is not asked to take SDPA."""
    model = build(model_type)
    stock = copy.deepcopy(model)
    stock.set_attn_implementation("eager")
    packed = PackedCausalLM(model)
    packed(collate_packed(random_documents(text_config(model.config).vocab_size)))
    packed.eval(), stock.eval()
    ids = torch.tensor([[5, 17, 99, 3, 42, 7]])
    options = dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=4,
        do_sample=False,
        use_cache=True,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    with torch.no_grad():
        ours, theirs = packed.generate(**options), stock.generate(**options)
    assert torch.equal(ours.sequences, theirs.sequences)
    assert torch.allclose(torch.stack(ours.logits), torch.stack(theirs.logits), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("forget", [False, True], ids=["kept", "control"])
def test_activation_checkpointing_recomputes_with_the_rows_boundaries(forget, monkeypatch):
    """Mamba's decoder passes the boundaries to no layer: the model's hooks hand them to the mixers. Its layers,
    recomputed by activation checkpointing in the backward after the model's forward returned, still run per
    document: the gradients are stock ones. The control forgets the boundaries between the forward and the backward:
    the layers recomputed over the whole row are not those of the forward (torch's checkpoint sees it)."""
    monkeypatch.setattr(test_every_architecture, "LENGTHS", LONG)
    model = build("mamba")
    stock = copy.deepcopy(model)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    packed = PackedCausalLM(model)
    packed.train(), stock.train()
    documents = random_documents(model.config.vocab_size)
    losses = packed(collate_packed(documents))
    if forget:
        for mixer in (m for m in model.modules() if type(m).__name__ == "MambaMixer"):
            mixer.__dict__[mixers._ROW_ATTRIBUTE] = None
        with pytest.raises(CheckpointError):
            losses.sum().backward()
        return
    losses.sum().backward()
    reference = stock_losses(stock, documents)
    reference.sum().backward()
    stock_grads = {name: p.grad for name, p in stock.named_parameters()}
    grads = {name: (p.grad, stock_grads[name]) for name, p in model.named_parameters()}
    check_exact(Trained(losses.detach(), reference.detach(), grads))


def test_a_deep_copy_runs_its_own_weights():
    """The start-up checks copy the isolated miniature (to bf16 on the device in `check_fast_mixers`): the copy's
    mixers must run the copy's weights, not the original's."""
    model = build("mamba")
    batch = collate_packed(random_documents(model.config.vocab_size))
    with torch.no_grad():
        before = packed_hidden_states(model, batch)
        twin = copy.deepcopy(model)
        for mixer in (m for m in twin.modules() if type(m).__name__ == "MambaMixer"):
            mixer.out_proj.weight.mul_(2.0)
        assert torch.equal(packed_hidden_states(model, batch), before)
        assert not torch.allclose(packed_hidden_states(twin, batch), before)


def test_a_packed_row_with_a_recurrent_state_is_refused():
    """xLSTM in eval mode cuts a row longer than config.max_inference_chunksize into pieces that carry the recurrent
    state from one to the next: the mixers refuse a packed row with a state rather than leak it."""
    model = build("xlstm").eval()
    model.config.max_inference_chunksize = 8
    with torch.no_grad(), pytest.raises(ValueError, match="max_inference_chunksize"):
        packed_hidden_states(model, collate_packed(random_documents(model.config.vocab_size)))


def test_fsdp_shards_mambas_blocks_not_the_mixers_inside_them():
    """Mamba lists both its block and its mixer as layers not to split (`_no_split_modules`): FSDP2 shards the
    blocks, each with its mixer (sharding the mixer too, after its block, failed on parameters sharded already)."""
    from chattune.hf_layout import decoder_layers

    model = build("mamba")
    assert [type(layer).__name__ for layer in decoder_layers(model)] == ["MambaBlock"] * model.config.num_hidden_layers
