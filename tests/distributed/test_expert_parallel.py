"""Expert parallelism's token exchange (`chattune.parallel.expert_parallel`) on 2 and 4 real gloo ranks: every MoE
family's stacked experts split over the ranks (2 or 1 experts of 4 each), each rank's tokens dispatched to the experts
their router chose by all-to-all with uneven splits and combined back. Against the whole model on one process (no
chattune code): each rank's loss equals the whole model's on that rank's tokens, each rank's dense and router
gradients the whole model's on its tokens, and each rank's experts' gradients the whole model's summed over every
rank's tokens (what an expert's gradient is when the group's tokens reach it). Families: Qwen3-MoE, Qwen2-MoE (shared
expert), Mixtral, OLMoE, Granite-MoE, gpt-oss (biases, clamped SwiGLU), DeepSeek-V3 (shared experts, group-limited
routing), GLM-4.5, Qwen3.5-MoE (hybrid layers, a shared expert), and Qwen3-MoE with routing ties (a router of zeros:
every expert scores the same for every token). Controls: a combine that leaves out the routing weights, and a token
whose choices are dropped (as a capacity factor would), are caught."""

from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from chattune.distributed import exit_process, shutdown_distributed
from chattune.parallel.expert_parallel import ExpertParallelExperts, expert_range, experts_modules, split_experts
from conftest import free_port, init_worker_process_group, spawn, tiny_model

FAMILIES = {
    "qwen3_moe": dict(
        model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16
    ),
    "qwen2_moe": dict(
        model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    ),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(model_type="olmoe", num_experts=4, num_experts_per_tok=2),
    "granitemoe": dict(model_type="granitemoe", num_local_experts=4, num_experts_per_tok=2),
    "gpt_oss": dict(
        model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "deepseek_v3": dict(
        model_type="deepseek_v3", n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, n_group=2, topk_group=1, num_key_value_heads=4,
    ),
    "glm4_moe": dict(
        model_type="glm4_moe", n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
    ),
    "qwen3_5_moe": dict(  # its hybrid layers: a gated-delta-net layer and an attention layer, each with a MoE MLP
        model_type="qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"],
    ),
}  # fmt: skip
LENGTHS = (13, 5, 9, 2)  # each rank's tokens: uneven, so the exchanges' splits are too
TIES = "qwen3_moe, routing ties"  # qwen3_moe with its routers zeroed


class WeightsLeftOut(ExpertParallelExperts):
    """A control: the combine sums the experts' outputs without their routing weights."""

    def forward(self, hidden, top_k_index, top_k_weights):
        return super().forward(hidden, top_k_index, torch.ones_like(top_k_weights))


class TokenDropped(ExpertParallelExperts):
    """A control: each rank's first token reaches no expert (a capacity factor's drop)."""

    def forward(self, hidden, top_k_index, top_k_weights):
        kept = top_k_weights.clone()
        kept[0] = 0
        return super().forward(hidden, top_k_index, kept)


def _control_error(model, control: type, mesh, rank: int) -> float:
    """The largest relative error of this rank's dense gradients with the experts split by `control`, against
    the whole model's (the test's measure of the real split: at most 1e-5)."""
    _, reference = _loss_and_grads(model, _tokens(rank, model.config.vocab_size))
    for parent, name, child in experts_modules(model):
        setattr(parent, name, control(child, mesh))
    _, grads = _loss_and_grads(model, _tokens(rank, model.config.vocab_size))
    return max(_relative(grad, reference[n]) for n, grad in grads.items() if not isinstance(grad, DTensor))


def _tokens(rank: int, vocab_size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randint(0, vocab_size, (1, LENGTHS[rank]), generator=generator)


def _loss_and_grads(model, input_ids) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _worker(rank: int, world_size: int, port: int, out_path: str) -> None:
    init_worker_process_group(rank, world_size, port)
    mesh = init_device_mesh("cpu", (world_size,))
    results = {}
    for name, settings in [*FAMILIES.items(), (TIES, FAMILIES["qwen3_moe"])]:
        model = tiny_model(seed=0, **settings)
        model.set_attn_implementation("eager")
        if name == TIES:
            for layer in model.model.layers:
                torch.nn.init.zeros_(layer.mlp.gate.weight)
        vocab = model.config.vocab_size
        references = [_loss_and_grads(model, _tokens(r, vocab)) for r in range(world_size)]  # the whole model
        names = [n for n, _ in model.named_parameters()]
        replaced = split_experts(model, mesh)
        assert split_experts(model, mesh) == 0  # a model split once is not split again
        assert [n for n, _ in model.named_parameters()] == names  # the stock names (checkpoints, export)
        loss, grads = _loss_and_grads(model, _tokens(rank, vocab))
        errors = {"loss": abs(loss - references[rank][0]) / abs(references[rank][0])}
        dense = {}
        experts = {}
        for parameter_name, grad in grads.items():
            if isinstance(grad, DTensor):  # this rank's experts: the group's tokens' gradient
                first, end = expert_range(4, world_size, rank)
                want = sum(reference[1][parameter_name] for reference in references)[first:end]
                experts[parameter_name] = _relative(grad.to_local(), want)
            else:
                dense[parameter_name] = _relative(grad, references[rank][1][parameter_name])
        missing = sorted(
            n for n in references[rank][1] if ".experts." not in n and n not in grads
        )  # a dense or router weight left without its gradient
        results[name] = {
            "replaced": replaced,
            "loss": errors["loss"],
            "dense": max(dense.values()),
            "experts": max(experts.values()) if experts else None,
            "expert_weights": len(experts),
            "missing": missing,
        }
    for control in (WeightsLeftOut, TokenDropped):
        model = tiny_model(seed=0, **FAMILIES["qwen3_moe"])
        model.set_attn_implementation("eager")
        results[control.__name__] = _control_error(model, control, mesh, rank)
    if rank == 0:
        with open(out_path, "w") as file:
            json.dump(results, file)
    shutdown_distributed()
    exit_process()


@pytest.mark.launch
@pytest.mark.parametrize("ranks", [2, 4])
def test_each_family_split_over_the_ranks_trains_as_the_whole_model(tmp_path, ranks):
    out = tmp_path / "results.json"
    spawn(_worker, args=(ranks, free_port(), str(out)), nprocs=ranks)
    results = json.loads(out.read_text())
    controls = {name: results.pop(name) for name in ("WeightsLeftOut", "TokenDropped")}
    assert min(controls.values()) > 1e-3, controls  # each control moves rank 0's gradients: caught
    assert sorted(results) == sorted([*FAMILIES, TIES])
    for name, result in results.items():
        assert result["replaced"] >= 1 and result["expert_weights"] >= 2 and not result["missing"], (name, result)
        assert result["loss"] <= 1e-6, (name, result)
        assert result["dense"] <= 1e-5 and result["experts"] <= 1e-5, (name, result)


def _memory_worker(rank: int, world_size: int, port: int, out_path: str) -> None:
    """A tiny Qwen3-MoE (8 experts) sharded by `shard_model` with parallel.expert=2 on 4 ranks: the parameter bytes
    this rank holds and the expert elements a forward gathers, against the memory estimate's."""
    from chattune.config.schema import ParallelConfig
    from chattune.data.packing import collate_packed
    from chattune.distributed import ParallelDims
    from chattune.model.causal_lm import PackedCausalLM
    from chattune.model.cost.memory import MemoryInputs, estimate
    from chattune.parallel.fsdp import reshard, shard_model
    from conftest import demo_documents

    init_worker_process_group(rank, world_size, port)
    settings = {**FAMILIES["qwen3_moe"], "num_experts": 8}
    hf_model = tiny_model(seed=0, **settings)
    whole_experts = sum(p.numel() for _, _, m in experts_modules(hf_model) for p in m.parameters(recurse=False))
    stacked = {id(p) for _, _, m in experts_modules(hf_model) for p in m.parameters(recurse=False)}
    layers = hf_model.model.layers
    dense_per_layer = [sum(p.numel() for p in layer.parameters() if id(p) not in stacked) for layer in layers]
    in_layers = {id(p) for p in layers.parameters()}
    root = sum(p.numel() for p in hf_model.parameters() if id(p) not in in_layers)
    dims = ParallelDims.build(torch.device("cpu"), ParallelConfig(expert=2))
    model = PackedCausalLM(hf_model)
    shard_model(model, dims)
    gathered = []

    def count(module, _args):  # (after FSDP2's own pre-forward hook: the experts unit is gathered)
        gathered.append(sum(p.to_local().numel() for p in module.parameters(recurse=False)))

    for _, _, module in experts_modules(model):
        module.register_forward_pre_hook(count)
    with torch.no_grad():
        model(collate_packed(demo_documents(2, start=2 * rank)))
    reshard(model)  # (a forward alone leaves the root gathered)
    inputs = MemoryInputs(hf_model.config, ranks=world_size, tokens=512, expert=2)
    results = {
        "held": sum(p.to_local().numel() * p.element_size() for p in model.parameters()),
        "estimated": estimate(inputs).rows["parameters (fp32 shards)"],
        "gathered experts": sum(gathered),
        "whole experts / ep": whole_experts // 2,
        "dispatch row": "expert dispatch buffers" in estimate(inputs).rows,
        # FSDP2 gathers two layers at once (one prefetched) and keeps the root: fp32 here
        "gathered bytes": 4 * (2 * max(d + g for d, g in zip(dense_per_layer, gathered)) + root),
        "estimated gathered": estimate(inputs).rows["gathered for compute"],
    }
    if rank == 0:  # (the first rank holds the largest shards)
        with open(out_path, "w") as file:
            json.dump(results, file)
    shutdown_distributed()
    exit_process()


@pytest.mark.launch
def test_the_memory_estimate_counts_what_a_rank_holds_and_gathers_with_split_experts(tmp_path):
    out = tmp_path / "results.json"
    spawn(_memory_worker, args=(4, free_port(), str(out)), nprocs=4)
    results = json.loads(out.read_text())
    assert results["held"] == results["estimated"], results
    assert results["gathered experts"] == results["whole experts / ep"], results
    assert results["dispatch row"], results
    assert results["gathered bytes"] == results["estimated gathered"], results


def _skewed_worker(rank: int, world_size: int, port: int, out_path: str) -> None:
    """4 ranks, parallel.expert=2 (experts 0-1 on ranks 0 and 2, 2-3 on ranks 1 and 3, each pair one FSDP2 unit's
    group), transformers' per-expert loop, and a routing skewed so that ep group {0, 1} sends every token to experts
    2-3 and ep group {2, 3} to experts 0-1: rank 0's experts receive nothing while rank 2's, in the same FSDP2 group,
    receive tokens. One forward and backward must finish (a rank whose experts ran no token still reduce-scatters
    their zero gradient with its peer), and every expert weight gets a gradient."""
    from datetime import timedelta

    from chattune.config.schema import ParallelConfig
    from chattune.data.packing import collate_packed
    from chattune.distributed import ParallelDims
    from chattune.model.causal_lm import PackedCausalLM
    from chattune.parallel.fsdp import shard_model
    from conftest import demo_documents

    init_worker_process_group(rank, world_size, port)
    torch.distributed.destroy_process_group()  # (again, with a timeout that fails a hang within the test's time)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    hf_model = tiny_model(seed=0, **FAMILIES["qwen3_moe"])
    hf_model.config._experts_implementation = "eager"
    stock = ExpertParallelExperts.forward

    def skewed(self, hidden, top_k_index, top_k_weights):
        first = 0 if rank >= 2 else 2
        chosen = torch.stack([torch.full_like(top_k_index[:, 0], first), torch.full_like(top_k_index[:, 0], first + 1)])
        return stock(self, hidden, chosen.T.contiguous(), top_k_weights)

    ExpertParallelExperts.forward = skewed
    model = PackedCausalLM(hf_model)
    shard_model(model, ParallelDims.build(torch.device("cpu"), ParallelConfig(expert=2)))
    model(collate_packed(demo_documents(2, start=2 * rank))).sum().backward()
    experts = [p for _, _, m in experts_modules(model) for p in m.parameters(recurse=False)]
    results = {"grads": sum(p.grad is not None for p in experts), "weights": len(experts)}
    with open(f"{out_path}.{rank}", "w") as file:
        json.dump(results, file)
    shutdown_distributed()
    exit_process()


@pytest.mark.launch
def test_a_rank_whose_experts_receive_no_token_still_reduces_their_gradients(tmp_path):
    out = tmp_path / "results.json"
    spawn(_skewed_worker, args=(4, free_port(), str(out)), nprocs=4)
    for rank in range(4):
        results = json.loads((tmp_path / f"results.json.{rank}").read_text())
        assert results["grads"] == results["weights"] > 0, (rank, results)
