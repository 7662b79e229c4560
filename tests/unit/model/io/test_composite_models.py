"""Vision-language checkpoints trained on text (chattune.model.io.composite), in process: tiny composite checkpoint
directories as transformers saves them (Mistral 3 in its legacy `language_model.model.*` names, the others in the
current ones) are loaded as chattune loads them (meta-built text model, tensors read from the checkpoint's own
keys), and the packed loss and gradients equal the stock composite class run on each document alone, fp32."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_every_architecture import tiny_config as walk_config
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, AutoModelForImageTextToText, PretrainedConfig

import chattune.model.io.composite as composite_module
from chattune.data.documents import IGNORE_INDEX, Document
from chattune.data.packing import collate_packed
from chattune.errors import UnsupportedModel, UserError
from chattune.model.build import _empty_or_full
from chattune.model.causal_lm import PackedCausalLM
from chattune.model.checks.architecture import check_architecture
from chattune.model.head.kinds import SCORE_HEAD
from chattune.model.io import load
from chattune.model.io.composite import (
    VERIFIED_COMPOSITES,
    WRAPPED_TEXT_MODELS,
    is_composite,
    text_causal_lm_class,
    text_config_of,
)
from chattune.model.packed.attention import stock_attention
from chattune.model.peft.adapters import initial_values

VOCAB = 200
TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    head_dim=16,
    max_position_embeddings=512,
)
MROPE = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
GLM_ROPE = {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
QWEN_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=64)


def composite_config(kind: str, **text_settings) -> PretrainedConfig:
    """A tiny config of a vision-language `kind`, its vision tower one small layer."""
    text = {**TEXT, **text_settings}
    if kind == "mistral3":
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, patch_size=8)
        return CONFIG_MAPPING[kind](text_config=text, vision_config=vision, tie_word_embeddings=False)
    if kind == "kimi_k25":  # a DeepSeek-V3 text model (its rotary dimension is qk_rope_head_dim)
        del text["head_dim"]
        text.update(
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            n_group=1,
            topk_group=1,
        )
        return CONFIG_MAPPING[kind](text_config=text, vision_config=dict(depth=1, hidden_size=32, num_heads=4))
    if kind in ("qwen2_vl", "qwen2_5_vl"):
        vision = dict(depth=1, embed_dim=32, hidden_size=32, num_heads=4, out_hidden_size=64, intermediate_size=64)
        return CONFIG_MAPPING[kind](text_config={**text, "rope_parameters": MROPE}, vision_config=vision)
    if kind in ("qwen3_vl", "qwen3_vl_moe"):
        text["rope_parameters"] = {**MROPE, "mrope_interleaved": True}
        if kind == "qwen3_vl_moe":
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
        return CONFIG_MAPPING[kind](text_config=text, vision_config={**QWEN_VISION, "deepstack_visual_indexes": [0]})
    if kind in ("glm4v", "glm4v_moe", "glm46v"):
        text["rope_parameters"] = GLM_ROPE
        if kind == "glm4v_moe":
            text.update(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=0)
        return CONFIG_MAPPING[kind](text_config=text, vision_config=QWEN_VISION)
    return walk_config(kind)  # the architecture walk's miniature of the type's default config (vocabulary >= 512)


KINDS = VERIFIED_COMPOSITES


def save_composite(kind: str, directory, dtype: torch.dtype = torch.float32, **text_settings) -> torch.nn.Module:
    """A composite checkpoint directory as transformers writes it (random weights); the model it holds."""
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(composite_config(kind, **text_settings)).to(dtype)
    model.save_pretrained(directory)
    return model


def documents(lengths=(13, 40, 7)) -> list[Document]:
    rng = np.random.default_rng(0)
    docs = []
    for index, length in enumerate(lengths):
        ids = rng.integers(0, VOCAB, size=length)
        docs.append(Document(doc_id=index, input_ids=ids, labels=np.append(ids[1:], IGNORE_INDEX)))
    return docs


def loaded_text_model(directory, head=None):
    """The language model as chattune's builder loads it (meta-built, read from the checkpoint's keys), without
    FSDP: materialised here on the CPU, its tied output layer kept tied, then filled by `materialise_and_load`."""
    hf_model, files, composite = _empty_or_full(directory, *([head] if head else []))
    if files is not None:  # else loaded whole (`composite.per_shard` false), as the builder does
        initial = initial_values(hf_model)  # a reward model's new score head, as the builder passes it
        buffers = {name: buffer.clone() for name, buffer in hf_model.named_buffers()}
        hf_model.to_empty(device="cpu")
        hf_model.tie_weights()
        with torch.no_grad():
            for name, buffer in hf_model.named_buffers():
                buffer.copy_(buffers[name])
        cpu = torch.device("cpu")
        load.materialise_and_load(torch.nn.Module(), hf_model, directory, files, cpu, initial, composite.stored_names)
    return hf_model, composite


def packed_against_stock(directory) -> tuple[float, float]:
    """(max per-token loss difference, max relative gradient difference per parameter) of the language model as
    chattune loads and trains it on a packed row, against the stock composite class from `directory` run on each
    document alone (fp32, eval mode: no dropout, MoE routers as in inference)."""
    stock = AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32).eval()
    model, composite = loaded_text_model(directory)
    model.eval()
    assert composite.class_name == type(stock).__name__
    docs = documents()
    vocabulary = min(model.config.vocab_size, VOCAB)
    for document in docs:  # ids within the smallest vocabulary
        document.input_ids[:] %= vocabulary
        document.labels[:-1] = document.input_ids[1:]
    got = PackedCausalLM(model, loss_implementation="chunked")(collate_packed(docs))
    got.sum().backward()
    want = []
    for document in docs:
        logits = stock(input_ids=torch.tensor(document.input_ids).unsqueeze(0), use_cache=False).logits[0]
        want.append(F.cross_entropy(logits, torch.tensor(document.labels), ignore_index=IGNORE_INDEX, reduction="none"))
    want = torch.cat(want)
    want.sum().backward()
    assert int((got != 0).sum()) == sum(len(d.input_ids) - 1 for d in docs)
    stock_parameters = dict(stock.named_parameters())
    errors = [0.0]
    for name, parameter in model.named_parameters():
        reference = stock_parameters[composite.composite_name(name)].grad
        errors.append(float((parameter.grad - reference).norm() / reference.norm().clamp_min(1e-12)))
    # What the export copies as stored: every checkpoint tensor but the language model's.
    assert composite.other_keys and not set(composite.stored_names.values()) & set(composite.other_keys)
    return float((got - want).detach().abs().max()), max(errors)


@pytest.mark.parametrize("kind", KINDS)
def test_the_packed_text_loss_equals_the_stock_composite_per_document(kind, tmp_path):
    save_composite(kind, tmp_path)
    loss_error, gradient_error = packed_against_stock(tmp_path)
    assert loss_error <= 1e-5 and gradient_error <= 1e-4, (loss_error, gradient_error)


def test_mistral3_is_read_from_its_legacy_names(tmp_path):
    save_composite("mistral3", tmp_path)
    keys = set(load.checkpoint_files(tmp_path))
    assert "language_model.model.embed_tokens.weight" in keys and "lm_head.weight" not in keys  # legacy layout
    _, composite = loaded_text_model(tmp_path)
    assert composite.stored_names["model.embed_tokens.weight"] == "language_model.model.embed_tokens.weight"
    assert composite.stored_names["lm_head.weight"] == "language_model.lm_head.weight"
    assert all(key.startswith(("vision_tower.", "multi_modal_projector.")) for key in composite.other_keys)


@pytest.mark.parametrize("kind", [kind for kind in KINDS if kind.split("_")[0] in ("qwen3", "glm4v")][:2])
def test_the_start_up_checks_pass_on_the_wrapped_text_models(kind):
    """The miniature of the start-up checks is built through the causal LM chattune gives these text models."""
    check_architecture(text_config_of(composite_config(kind)))


def test_every_wrapped_text_model_is_tested_against_its_composite():
    tested = {composite_config(kind).get_text_config().model_type for kind in KINDS}
    assert set(WRAPPED_TEXT_MODELS) <= tested


def test_the_wrapped_causal_lm_generates_as_the_composite_does(tmp_path):
    stock = save_composite("qwen3_vl", tmp_path).eval()
    model, _ = loaded_text_model(tmp_path)
    model.eval().config.use_cache = True
    prompt = torch.tensor([[5, 17, 33, 2, 91]])
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with stock_attention(model):  # as chattune's sample replies generate
        generated = model.generate(prompt, **kwargs)
    assert torch.equal(generated, stock.generate(input_ids=prompt, **kwargs))


def test_a_composite_without_a_trainable_language_model_is_refused_with_the_reason(tmp_path):
    config = CONFIG_MAPPING["glm5_next"]()
    assert is_composite(config)
    with pytest.raises(
        UnsupportedModel,
        match="glm5_next: a vision-language model that chattune cannot train on text yet: its language model .* has no causal LM class",
    ) as refusal:
        text_config_of(config)
    assert "mistral3" in str(refusal.value) and "qwen3_vl" in str(refusal.value)  # what it does train


@pytest.mark.parametrize("kind", ["aya_vision", "paligemma"])
def test_a_composite_whose_text_causal_lm_computes_something_else_is_refused(kind, tmp_path, monkeypatch):
    """Aya Vision's text model is Cohere 2, whose causal LM scales its logits, which the composite does not do;
    PaliGemma's composite runs its Gemma otherwise too. Refused; the control, let through, differs."""
    save_composite(kind, tmp_path)
    with pytest.raises(UnsupportedModel, match=f"{kind}: .* is not verified to compute what the composite"):
        _empty_or_full(tmp_path)
    monkeypatch.setattr(composite_module, "VERIFIED_COMPOSITES", (kind,))
    assert packed_against_stock(tmp_path)[0] > 1e-2


def test_a_reward_model_on_a_composite_without_a_sequence_classifier_is_refused(tmp_path):
    save_composite("qwen3_vl", tmp_path)
    with pytest.raises(UnsupportedModel, match="no sequence score class"):
        _empty_or_full(tmp_path, SCORE_HEAD)


def test_a_reward_model_on_mistral3_loads_its_language_model_under_a_new_score_head(tmp_path):
    stock = save_composite("mistral3", tmp_path)
    model, composite = loaded_text_model(tmp_path, SCORE_HEAD)
    assert type(model).__name__ == "MistralForSequenceClassification" and "score.weight" not in composite.stored_names
    embedding = stock.get_input_embeddings().weight
    assert torch.equal(model.get_input_embeddings().weight, embedding)


def test_a_directory_that_is_no_language_model_is_one_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit"}))
    with pytest.raises(UserError, match=r"its config.json is a vit model, which is neither a causal LM"):
        _empty_or_full(tmp_path)


def test_the_wrapper_is_a_causal_lm_of_transformers_by_name():
    config = text_config_of(composite_config("qwen3_vl"))
    model = AutoModelForCausalLM.from_config(config)
    assert type(model) is text_causal_lm_class(type(model.model)) and type(model).__name__ == "Qwen3VLTextForCausalLM"
