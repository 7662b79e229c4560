"""`chattune.parallel.tensor_parallel.tensor_parallel_problem`: which models split over T ranks, and the reason for
those that do not (what `shard_model` raises as UnsupportedModel at start-up). The split itself is checked on
real processes in test_device_mesh (gradients against stock transformers) and test_mesh_layouts (recipe runs)."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch
from test_device_mesh import documents, plain_gradients
from torch.distributed.tensor import DTensor

from chattune.config.schema import ParallelConfig, PeftConfig
from chattune.data.feed import StepBatches
from chattune.data.packing import collate_packed
from chattune.distributed import exit_process, init_distributed, shutdown_distributed
from chattune.model.causal_lm import PackedCausalLM, build_hf_model
from chattune.model.cost.memory import MemoryInputs, estimate
from chattune.model.packed.router_loss import router_loss_for
from chattune.model.peft.adapters import add_adapters
from chattune.objectives.cross_entropy import TokenCrossEntropy
from chattune.parallel.fsdp import shard_model
from chattune.parallel.tensor_parallel import split_over, tensor_parallel_problem
from chattune.train.step import accumulate_gradients, clip_gradients
from conftest import demo_tokenizer, free_port, init_worker_process_group, relative_error, spawn, tiny_config


def test_the_families_of_the_plan_split_and_others_are_refused_with_the_reason():
    assert tensor_parallel_problem(tiny_config("llama"), 2) is None
    assert tensor_parallel_problem(tiny_config("qwen3"), 1) is None
    assert tensor_parallel_problem(tiny_config("gpt2"), 2) == (
        "gpt2 has no tensor-parallel plan in chattune (families: llama, mistral, qwen2, qwen3, gemma3_text, qwen3_moe, "
        "gemma, gemma2, smollm3, granite, mixtral, qwen2_moe, exaone4); "
        "train it with parallel.tensor=1"
    )
    # tiny_config: 4 query heads, 2 key-value heads, MLP width 128
    assert tensor_parallel_problem(tiny_config("qwen2"), 4) == (
        "4 does not divide the model's 2 key-value heads: each rank holds 1/4 of them"
    )
    assert tensor_parallel_problem(tiny_config("mistral", intermediate_size=129), 2) == (
        "2 does not divide the model's 129 MLP width: each rank holds 1/2 of them"
    )


# Each family of the plan on 2 ranks split over tp (Qwen2's q/k/v biases, Gemma 3's and Qwen3's per-head norms and
# scaled embedding, the mixtures of experts left whole; every one's vocabulary split, tied), against stock transformers
# unsharded on the same documents. "llama_untied": its own output layer, a vocabulary of 1023 (the first rank holds
# one more row), and the embedding's padding row (no gradient) among the second rank's rows, in the documents.
FAMILY_CONFIGS = {
    "llama_untied": ("llama", {"tie_word_embeddings": False}),
    "llama": ("llama", {}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "gemma3_text": ("gemma3_text", {"head_dim": 16}),
    "qwen3_moe": (
        "qwen3_moe",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_only_layers": [1]},
    ),
    "gemma": ("gemma", {"head_dim": 16}),
    "gemma2": ("gemma2", {"head_dim": 16}),  # soft-capped attention scores and logits
    "smollm3": ("smollm3", {}),
    "granite": ("granite", {}),  # its embedding, residual, attention and logit multipliers
    "exaone4": ("exaone4", {}),  # per-head q/k norms
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": (
        "qwen2_moe",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
        },
    ),
}


RECOMPUTED = ("llama_untied", "gemma3_text", "qwen3_moe")  # trained with activation checkpointing
# trained with cut-cross-entropy (its torch implementation), where installed, instead of the chunked loss
FUSED = "qwen2" if importlib.util.find_spec("cut_cross_entropy") else None


def _family_model(name: str):
    model_type, overrides = FAMILY_CONFIGS[name]
    torch.manual_seed(0)
    model = build_hf_model(demo_tokenizer(), config=tiny_config(model_type, **overrides))
    if name == "llama_untied":
        model.resize_token_embeddings(1023)
        embedding = model.get_input_embeddings()
        embedding.padding_idx = next(int(i) for i in documents(0, 1023)[0].input_ids if i >= 512)
        assert embedding.weight.shape[0] == model.get_output_embeddings().weight.shape[0] == 1023
    return model


def _family_worker(rank: int, world_size: int, port: int, out_path: str) -> None:
    init_worker_process_group(rank, world_size, port)
    dims = init_distributed("cpu", ParallelConfig(tensor=world_size))
    found = {}
    for name in FAMILY_CONFIGS:
        hf_model = _family_model(name)
        # activation checkpointing recomputes a layer's forward, its exchanges included, in the backward
        recompute = name in RECOMPUTED
        loss = "cut_cross_entropy" if name == FUSED else "chunked"
        policy = PackedCausalLM(hf_model, loss_chunk_size=64, loss_implementation=loss)
        placement = shard_model(policy, dims, activation_checkpointing=recompute)
        policy.train()
        assert hf_model.is_gradient_checkpointing == recompute, name
        head = "loss: cut-cross-entropy (fused, " if name == FUSED else "loss: chunked fp32 head ("
        assert policy.describe_head() == head + "its vocabulary split over 2 ranks)", name
        row = collate_packed(documents(0, hf_model.config.vocab_size))
        accumulate_gradients(policy, TokenCrossEntropy(), StepBatches([row]), placement)
        split = sum(split_over(p) for p in policy.parameters())
        vocabulary = [split_over(m.weight) for m in (hf_model.get_input_embeddings(), hf_model.get_output_embeddings())]
        assert all(vocabulary), name
        grads = {n.removeprefix("hf_model."): p.grad.full_tensor() for n, p in policy.named_parameters()}
        norm = clip_gradients(policy, placement, None)[0]
        # Generation reads the split embedding and gathers the split output layer's logits.
        policy.eval()
        prompt = torch.tensor([documents(1, hf_model.config.vocab_size)[0].input_ids[:6].tolist()])
        generated = policy.generate(input_ids=prompt, max_new_tokens=4, do_sample=False)
        found[name] = (grads, norm, split, generated)
    if rank == 0:
        torch.save(found, out_path)
    shutdown_distributed()
    exit_process()


@pytest.mark.launch
def test_each_family_of_the_plan_trains_split_as_stock_transformers_whole(tmp_path):
    out_path = str(tmp_path / "families.pt")
    spawn(_family_worker, args=(2, free_port(), out_path), nprocs=2)
    found = torch.load(out_path)
    for name in FAMILY_CONFIGS:
        grads, norm, split, generated = found[name]
        stock = _family_model(name)
        prompt = torch.tensor([documents(1, stock.config.vocab_size)[0].input_ids[:6].tolist()])
        assert torch.equal(
            generated, stock.generate(input_ids=prompt, max_new_tokens=4, do_sample=False, use_cache=False)
        )
        want = plain_gradients(1, _family_model(name))  # one data rank: both ranks of the group read its documents
        assert split >= 8, name  # q, k, v and o of each of the 2 layers at least
        worst = max(float((grads[n] - g).norm() / g.norm()) for n, g in want.items() if g.norm() > 0)
        assert worst <= 1e-5, (name, worst)
        plain = float(torch.nn.utils.get_total_norm(list(want.values())))
        assert abs(norm - plain) <= 1e-5 * plain, (name, norm, plain)


def _moe_with_router_loss() -> PackedCausalLM:
    hf_model = _family_model("qwen3_moe")
    return PackedCausalLM(hf_model, loss_chunk_size=64, router_loss=router_loss_for(hf_model, 0.01))


def _router_losses(policy: PackedCausalLM) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """One forward and backward of the token losses plus each document's router loss, on a 75-token row."""
    policy.train()
    row = collate_packed(documents(0, policy.hf_model.config.vocab_size))
    losses, router = policy(row, router_losses=True)
    (losses.sum() + router.sum()).backward()
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in policy.named_parameters()}
    return losses.detach(), router.detach(), grads


def _router_worker(rank: int, world_size: int, port: int, out_path: str) -> None:
    init_worker_process_group(rank, world_size, port)
    dims = init_distributed("cpu", ParallelConfig(tensor=world_size))
    shard_model(model := _moe_with_router_loss(), dims)
    found = _router_losses(model)
    if rank == 0:
        torch.save(found, out_path)
    shutdown_distributed()
    exit_process()


@pytest.mark.launch
def test_a_mixture_of_experts_router_loss_is_the_same_split(tmp_path):
    """Qwen3-MoE's per-document router loss with its row split by tokens over 2 ranks (75 tokens: padded by a
    segment of its own, whose router loss is dropped) equals the model's run whole on one process."""
    out_path = str(tmp_path / "router.pt")
    spawn(_router_worker, args=(2, free_port(), out_path), nprocs=2)
    losses, router, grads = torch.load(out_path)
    want_losses, want_router, want_grads = _router_losses(_moe_with_router_loss())
    assert router.shape == want_router.shape == (2,)
    assert relative_error(router, want_router) <= 1e-5 and relative_error(losses, want_losses) <= 1e-5
    worst = max(relative_error(grads[n], g) for n, g in want_grads.items() if g.norm() > 0)
    assert worst <= 1e-5, worst


# LoRA on every linear layer of the decoder, split with the base (a column-wise layer's B, a row-wise layer's A);
# B drawn at random so that every adapter has a gradient.
LORA = PeftConfig(rank=4, alpha=8)
LORA_FAMILIES = ("llama_untied", "qwen3_moe")


def _lora_model(name: str):
    hf_model = _family_model(name)
    add_adapters(hf_model, LORA)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module_name, parameter in hf_model.named_parameters():
            if ".lora_B." in module_name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) / 8)
    return hf_model


def _lora_worker(rank: int, world_size: int, port: int, out_path: str) -> None:
    init_worker_process_group(rank, world_size, port)
    dims = init_distributed("cpu", ParallelConfig(tensor=world_size))
    found = {}
    for name in LORA_FAMILIES:
        policy = PackedCausalLM(_lora_model(name), loss_chunk_size=64)
        placement = shard_model(policy, dims)
        policy.train()
        row = collate_packed(documents(0, policy.hf_model.config.vocab_size))
        accumulate_gradients(policy, TokenCrossEntropy(), StepBatches([row]), placement)
        trained = [(n, p) for n, p in policy.named_parameters() if p.requires_grad]
        split = sum(split_over(p) for _, p in trained)
        held = sum(4 * p.grad.to_local().numel() for _, p in trained)  # this rank's gradient shards, fp32
        found[name] = ({n.removeprefix("hf_model."): p.grad.full_tensor() for n, p in trained}, split, held)
    if rank == 0:
        torch.save(found, out_path)
    shutdown_distributed()
    exit_process()


@pytest.mark.launch
def test_lora_adapters_train_split_as_on_stock_peft_whole(tmp_path):
    out_path = str(tmp_path / "lora.pt")
    spawn(_lora_worker, args=(2, free_port(), out_path), nprocs=2)
    found = torch.load(out_path)
    for name in LORA_FAMILIES:
        grads, split, held = found[name]
        want = plain_gradients(1, _lora_model(name))  # the adapters' gradients only: the base is frozen
        # the memory estimate's adapters: split with their base layers (1 data rank, its 2 tp ranks)
        model_type, overrides = FAMILY_CONFIGS[name]
        inputs = MemoryInputs(tiny_config(model_type, **overrides), ranks=1, tokens=75, tensor=2, lora_rank=4)
        estimated = estimate(replace(inputs, lora_targets=("all-linear",))).rows["gradients (fp32 shards)"]
        assert abs(estimated - held) <= 0.02 * held, (name, estimated, held)
        assert sorted(grads) == sorted(want) and split >= 8, (name, split)
        worst = max(relative_error(grads[n], g) for n, g in want.items())
        assert worst <= 1e-5, (name, worst)
