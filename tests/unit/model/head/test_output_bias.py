"""Output layers with a bias (Phi-1.5/2, GPT-J, CodeGen, CTRL: logits = hidden @ W.T + b) train exactly: one packed
row of documents gives the per-token losses and gradients (the bias's included) of stock transformers run on each
document alone, through the chunked fp32 head and cut-cross-entropy's torch implementation, with the output layer
untied and tied to the embeddings. The bias is set to random values (initialised, it is zero, where leaving it out
would pass unseen); the control leaves it out of the loss and fails. Sharded by FSDP2 the bias is the root's, gets the
same gradient, trains and is exported. The output-layer check compares a bias too, and names a head that reads
something other than the decoder's final hidden states (the BERT family's prediction-head transform)."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from test_every_architecture import Trained, check_exact, tiny_config
from test_hybrid_models import compare_with_stock, random_documents, relative, stock_losses
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from chattune.data.documents import IGNORE_INDEX
from chattune.data.packing import collate_packed
from chattune.errors import UnsupportedModel
from chattune.model import causal_lm
from chattune.model.causal_lm import PackedCausalLM, check_output_head, output_bias
from chattune.model.checks.architecture import check_architecture
from chattune.model.head import fused_loss
from chattune.model.head.chunked_loss import chunked_token_losses
from chattune.model.head.output_logits import LogitTransform
from chattune.model.io.export import export_hf
from chattune.model.packed.attention import ATTENTION_NAME
from chattune.parallel.fsdp import shard_model
from conftest import demo_tokenizer, exported_weights, mesh_dims

LENGTHS = (21, 9, 14)
# (model type, tied): tied, the one matrix gets the gradients of the embedding and of the output layer
MODELS = [("phi", False), ("gptj", False), ("codegen", False), ("ctrl", True)]


@pytest.fixture
def eager_cce(monkeypatch):
    """CCE's torch implementation (what `cut_cross_entropy` runs off CUDA) run eagerly: the same code without its
    torch.compile, which costs ~50 s of compiling per process and dtype on this CI's cores."""
    compiled = pytest.importorskip("cut_cross_entropy.torch_compile")
    apply = compiled.torch_compile_linear_cross_entropy_apply
    monkeypatch.setattr(compiled, "torch_compile_linear_cross_entropy_apply", apply.__wrapped__)


def biased_model(model_type: str, tied: bool = False, checked: bool = False):
    """The walk's tiny config of `model_type`, built with chattune's attention, its output layer's bias random
    (about as large as its logits); `checked`: accepted by the start-up checks first."""
    config = tiny_config(model_type)
    config.tie_word_embeddings = tied
    if checked:
        check_architecture(copy.deepcopy(config))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=ATTENTION_NAME, dtype=torch.float32)
    model.config.use_cache = False
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    with torch.no_grad():
        output_bias(model).normal_(0.0, 0.5)
    return model


def packed_and_stock(model_type: str, tied: bool, implementation: str = "chunked", checked: bool = False):
    model = biased_model(model_type, tied, checked)
    stock = copy.deepcopy(model)
    stock.set_attn_implementation("eager")
    packed = PackedCausalLM(model, loss_chunk_size=16, loss_implementation=implementation)
    return compare_with_stock(packed, stock, random_documents(model.config.vocab_size, LENGTHS))


def assert_exact(losses: torch.Tensor, reference: torch.Tensor, grads: list) -> None:
    """The walk's `check_exact`: per-token losses within 1e-5, each gradient within 1e-4 (one that is zero in exact
    arithmetic, CTRL's key biases, held to the rounding noise of the whole gradient)."""
    check_exact(Trained(losses, reference, {name: (packed, stock) for name, packed, stock in grads}))


@pytest.mark.parametrize("model_type, tied", MODELS)
def test_a_biased_output_layer_trains_exactly(model_type, tied):
    losses, reference, grads = packed_and_stock(model_type, tied, checked=True)
    assert_exact(losses, reference, grads)
    bias_grad = {name: (packed, stock) for name, packed, stock in grads}.get("lm_head.bias")
    assert bias_grad is not None, "the output layer's bias got no gradient"
    assert relative(*bias_grad) <= 1e-4 and float(bias_grad[1].norm()) > 0


@pytest.mark.parametrize("model_type, tied", [("phi", True), ("gptj", False)])
def test_cut_cross_entropy_adds_the_bias_too(model_type, tied, eager_cce):
    assert_exact(*packed_and_stock(model_type, tied, "cut_cross_entropy"))


def test_control_without_the_bias_differs(monkeypatch):
    monkeypatch.setattr(causal_lm, "output_bias", lambda hf_model: None)
    losses, reference, grads = packed_and_stock("phi", False)
    assert relative(losses, reference) > 1e-2  # a thousand times the exactness test's tolerance
    assert "lm_head.bias" not in [name for name, *_ in grads]  # and the bias would never train


def _losses_and_grads(loss_fn, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(120, 32, generator=generator).to(dtype).requires_grad_()
    weight = (torch.randn(300, 32, generator=generator) / 4).to(dtype).requires_grad_()
    bias = torch.randn(300, generator=generator).to(dtype).requires_grad_()
    labels = torch.randint(0, 300, (120,), generator=generator)
    labels[::7] = IGNORE_INDEX
    losses = loss_fn(hidden, weight, labels, bias)
    (losses * torch.linspace(0.5, 1.5, len(losses))).sum().backward()  # a non-uniform upstream gradient
    return losses.detach(), hidden.grad.float(), weight.grad.float(), bias.grad.float(), labels


def test_the_chunked_loss_is_cross_entropy_of_the_biased_logits():
    """Against F.cross_entropy of the full logits hidden @ W.T + b, scaled (Cohere's logit_scale applies to the bias
    too); gradients of hidden states, weight and bias."""
    transform = LogitTransform(multiplier=3.0)
    chunked = _losses_and_grads(
        lambda h, w, y, b: chunked_token_losses(h, w, y, chunk_size=32, transform=transform, bias=b), torch.float32
    )
    full = _losses_and_grads(
        lambda h, w, y, b: F.cross_entropy(transform(h @ w.t() + b), y, ignore_index=IGNORE_INDEX, reduction="none"),
        torch.float32,
    )
    assert relative(chunked[0], full[0]) < 1e-6
    for got, want in zip(chunked[1:4], full[1:4]):
        assert relative(got, want) < 1e-5


@pytest.mark.parametrize("dtype, per_token, grads", [(torch.float32, 1e-5, 1e-4), (torch.bfloat16, 5e-3, 1e-2)])
@pytest.mark.parametrize("multiplier", [1.0, 0.25])
def test_cce_with_the_bias_as_columns_matches_the_reference(dtype, per_token, grads, multiplier, eager_cce):
    """25.1.1 takes no bias: it enters as extra columns. Tolerances as tests/unit/model/head/test_fused_loss.py's."""
    assert not fused_loss.cce_takes_bias()
    transform = LogitTransform(multiplier=multiplier)
    reference = _losses_and_grads(
        lambda h, w, y, b: chunked_token_losses(h, w, y, chunk_size=64, transform=transform, bias=b), dtype
    )
    fused = _losses_and_grads(lambda h, w, y, b: fused_loss.cce_token_losses(h, w, y, transform, b), dtype)
    assert (fused[0] - reference[0]).abs().max() <= per_token * reference[0].abs().max()
    for got, want in zip(fused[1:4], reference[1:4]):
        assert relative(got, want) < grads


def test_a_release_that_takes_the_bias_is_given_it(monkeypatch):
    """The repository after 25.1.1 takes `bias=`: passed as it is (scaled by the logit scale), no columns added."""
    calls = []

    def later_release(e, c, targets, bias=None, ignore_index=-100, softcap=None, reduction="mean", impl="cce"):
        calls.append((e.shape, c.shape, bias))
        logits = e.float() @ c.float().t() + bias.float()
        return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction=reduction)

    assert "bias" in inspect.signature(later_release).parameters
    monkeypatch.setattr(fused_loss, "_import_cce", lambda: (later_release, None))
    assert fused_loss.cce_takes_bias()
    transform = LogitTransform(multiplier=0.25)
    fused = _losses_and_grads(lambda h, w, y, b: fused_loss.cce_token_losses(h, w, y, transform, b), torch.float32)
    reference = _losses_and_grads(
        lambda h, w, y, b: chunked_token_losses(h, w, y, chunk_size=64, transform=transform, bias=b), torch.float32
    )
    assert calls[0][0] == (120, 32) and calls[0][1] == (300, 32) and calls[0][2] is not None
    assert relative(fused[0], reference[0]) < 1e-6
    for got, want in zip(fused[1:4], reference[1:4]):
        assert relative(got, want) < 1e-5
    assert "bias passed to it" in fused_loss.describe_bias()


def test_lora_with_the_output_layer_trained_in_full_trains_its_bias():
    """peft.modules_to_save=[lm_head]: the losses read the trained copy's weight and bias (the adapters start at
    zero: the stock model's gradient)."""
    from chattune.model.peft.adapters import add_adapters

    model = biased_model("phi")
    stock = copy.deepcopy(model)
    stock.set_attn_implementation("eager")
    lora = {"type": "lora", "rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear", "use_dora": False}
    add_adapters(model, OmegaConf.create({**lora, "modules_to_save": ["lm_head"], "quantize_base": None}))
    documents = random_documents(model.config.vocab_size, LENGTHS)
    PackedCausalLM(model, loss_chunk_size=16)(collate_packed(documents)).sum().backward()
    stock_losses(stock, documents).sum().backward()
    trained = dict(model.named_parameters())["lm_head.modules_to_save.default.bias"]
    assert trained.requires_grad and relative(trained.grad, stock.lm_head.bias.grad) <= 1e-4


class _BiasTwice(torch.nn.Linear):
    """An output layer that adds its bias twice: what a check at the bias's initial value (zero) would not see."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden) + self.bias


def test_the_head_check_compares_the_bias():
    model = biased_model("phi")
    assert PackedCausalLM(model).describe_head() == "loss: chunked fp32 head (with its bias)"  # the compute: line
    bias = output_bias(model).detach().clone()
    check_output_head(model)  # accepted (and in bf16: tests/unit/model/test_model.py's tolerance)
    check_output_head(copy.deepcopy(model).to(torch.bfloat16))
    assert torch.equal(output_bias(model), bias), "the check must leave the bias as it was"
    twice = _BiasTwice(model.lm_head.in_features, model.lm_head.out_features)
    twice.weight, twice.bias = model.lm_head.weight, model.lm_head.bias
    model.lm_head = twice
    with torch.no_grad():
        twice.bias.zero_()
    with pytest.raises(UnsupportedModel, match=r"hidden @ output_embedding.T \+ its bias"):
        check_output_head(model)


def test_a_head_behind_a_transform_is_refused_with_the_reason():
    """The BERT family's decoders (bias and all) run a dense layer, an activation and a LayerNorm between the decoder
    and the output layer: refused, saying so."""
    with pytest.raises(UnsupportedModel, match="does not read the decoder's final hidden states"):
        check_architecture(tiny_config("roberta"))


def test_sharded_the_bias_is_the_roots_trains_and_is_exported(one_rank_group, tmp_path):
    """FSDP2 (one rank): the bias is sharded with the root (a DTensor its forward gathers), gets the stock gradient;
    one SGD step later the export holds b - lr * grad and loads as a model whose logits carry it."""
    model = biased_model("phi")
    stock = copy.deepcopy(model)
    stock.set_attn_implementation("eager")
    documents = random_documents(model.config.vocab_size, LENGTHS)
    packed = PackedCausalLM(model, loss_chunk_size=16)
    shard_model(packed, mesh_dims(), param_dtype="float32")
    assert isinstance(model.lm_head.bias, DTensor)
    assert model.lm_head.bias not in set(p for layer in model.model.layers for p in layer.parameters())
    packed(collate_packed(documents)).sum().backward()
    stock_losses(stock, documents).sum().backward()
    grad = model.lm_head.bias.grad.full_tensor()
    assert relative(grad, stock.lm_head.bias.grad) <= 1e-4
    optimizer = torch.optim.SGD(packed.parameters(), lr=0.5)
    optimizer.step()
    export_hf(packed, demo_tokenizer(), tmp_path / "hf", is_main=True, dtype=torch.float32)
    stepped = stock.lm_head.bias.detach() - 0.5 * stock.lm_head.bias.grad
    assert relative(exported_weights(tmp_path / "hf")["lm_head.bias"], stepped) <= 1e-5
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert relative(loaded.lm_head.bias.detach(), stepped) <= 1e-5
