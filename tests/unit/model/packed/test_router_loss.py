"""MoE models train with their router's load-balancing loss, per document (`chattune.model.packed.router_loss`):
each document's value is transformers' own `aux_loss` of that document run alone, it weighs as many loss
units as the document holds, and a step's gradient does not depend on how its documents are split into
microbatches and ranks. Checked against stock transformers run on each document alone."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F

from chattune.data.documents import IGNORE_INDEX
from chattune.data.feed import StepBatches
from chattune.data.packing import collate_packed, empty_batch
from chattune.distributed import exit_process, shutdown_distributed
from chattune.errors import UserError
from chattune.model.causal_lm import PackedCausalLM
from chattune.model.packed.router_loss import router_loss_for
from chattune.objectives.cross_entropy import TokenCrossEntropy
from chattune.parallel.fsdp import shard_model
from chattune.train.evaluation import evaluate
from chattune.train.metrics import step_metrics
from chattune.train.step import accumulate_gradients
from conftest import (
    demo_documents,
    free_port,
    init_worker_process_group,
    launch,
    mesh_dims,
    relative_error,
    spawn,
    tiny_model,
)

COEFFICIENT = 0.5  # large, so that a wrong router term shows in the gradients
MOE = {
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        head_dim=16,
        output_router_logits=True,
        router_aux_loss_coef=COEFFICIENT,
    ),
    "mixtral": dict(
        model_type="mixtral",
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=COEFFICIENT,
    ),
    # attention sinks, sliding windows and experts with biases
    "gpt_oss": dict(
        model_type="gpt_oss",
        num_local_experts=4,
        num_experts_per_tok=2,
        head_dim=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        output_router_logits=True,
        router_aux_loss_coef=COEFFICIENT,
    ),
}
NUM_DOCS = 8


def moe_model(name: str = "qwen3_moe", seed: int = 0, **overrides):
    return tiny_model(seed=seed, **{**MOE[name], **overrides})


def packed_moe(name: str = "qwen3_moe", **overrides) -> PackedCausalLM:
    hf_model = moe_model(name, **overrides)
    return PackedCausalLM(hf_model, loss_chunk_size=16, router_loss=router_loss_for(hf_model, None))


def stock_step(name: str = "qwen3_moe") -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], int]:
    """(Σ token losses, Σ trainable tokens × router_aux_loss_coef × aux_loss, gradients of their sum / tokens,
    tokens): every document alone through stock transformers (eager attention), its aux_loss its own."""
    model = moe_model(name)
    model.set_attn_implementation("eager")
    token_sum = router_sum = 0.0
    tokens = 0
    for doc in demo_documents(NUM_DOCS):
        out = model(input_ids=torch.tensor([doc.input_ids.tolist()]), use_cache=False, output_router_logits=True)
        labels = torch.tensor(doc.labels.tolist())
        trained = int((labels != IGNORE_INDEX).sum())
        token_sum = token_sum + F.cross_entropy(out.logits[0], labels, ignore_index=IGNORE_INDEX, reduction="sum")
        router_sum = router_sum + trained * model.router_aux_loss_coef * out.aux_loss
        tokens += trained
    ((token_sum + router_sum) / tokens).backward()
    return token_sum.detach(), router_sum.detach(), {n: p.grad for n, p in model.named_parameters()}, tokens


@pytest.mark.parametrize("name", MOE)
def test_each_documents_router_loss_is_transformers_aux_loss_of_the_document_alone(name):
    model = packed_moe(name)
    stock = copy.deepcopy(model.hf_model)
    stock.set_attn_implementation("eager")
    docs = demo_documents(4)
    _, router = model(collate_packed(docs), router_losses=True)
    alone = torch.stack(
        [stock(input_ids=torch.tensor([d.input_ids.tolist()]), output_router_logits=True).aux_loss for d in docs]
    )
    assert torch.allclose(router / COEFFICIENT, alone, rtol=1e-6, atol=0), (router / COEFFICIENT, alone)
    # Packed into one row, the stock function over the whole row differs: the per-document definition matters.
    row = torch.cat([torch.tensor(d.input_ids.tolist()) for d in docs]).unsqueeze(0)
    whole = stock(input_ids=row, output_router_logits=True).aux_loss
    assert not torch.allclose(whole, alone.mean(), rtol=1e-4)


def test_the_coefficient_is_the_models_own_unless_set():
    assert router_loss_for(moe_model(), None).coefficient == COEFFICIENT
    assert router_loss_for(moe_model(), 0.02).coefficient == 0.02
    assert router_loss_for(moe_model(), 0.0) is None  # loss.router_aux_coef=0 turns it off
    assert router_loss_for(moe_model(output_router_logits=False), None) is None  # the model's config leaves it off
    assert router_loss_for(moe_model(output_router_logits=False), 0.1).coefficient == 0.1
    with pytest.raises(UserError, match="loss.router_aux_coef=0"):
        router_loss_for(tiny_model(), 0.1)  # a dense model has no router


def test_evaluation_leaves_the_router_loss_out_and_metrics_show_it_apart():
    model = packed_moe()
    batch = collate_packed(demo_documents(3))
    objective = TokenCrossEntropy()
    model.train()
    loss, figures = objective.loss_sum(model, batch)
    model.eval()
    eval_loss, eval_figures = objective.loss_sum(model, batch)
    assert "router_loss" in figures and "router_loss" not in eval_figures
    assert torch.allclose(loss, eval_loss + figures["router_loss"], rtol=1e-6)
    metrics = objective.metrics({"loss_sum": loss.item(), "router_loss": figures["router_loss"].item()}, 100)
    assert metrics["loss"] == pytest.approx(eval_loss.item() / 100, rel=1e-6)
    assert metrics["router_loss"] == pytest.approx(float(figures["router_loss"]) / 100)


def test_dpo_adds_each_pairs_mean_router_loss():
    """A DPO pair is one document of two sequences (chosen, rejected in context): its router loss is the mean
    of theirs, each stock transformers' aux_loss of that sequence alone."""
    from test_hybrid_models import random_documents, sequences

    from chattune.objectives.dpo import PreferenceObjective
    from chattune.objectives.pair_losses import PreferenceLoss

    model = packed_moe()
    stock = copy.deepcopy(model.hf_model)
    stock.set_attn_implementation("eager")
    pairs = random_documents(model.hf_model.config.vocab_size, (30, 22, 40), segments=True)
    objective = PreferenceObjective(PreferenceLoss(loss_type="simpo"), reference=None)
    model.train()
    loss, figures = objective.loss_sum(model, collate_packed(pairs))
    alone = [
        stock(input_ids=torch.tensor(ids).unsqueeze(0), output_router_logits=True).aux_loss
        for ids, _ in sequences(pairs)
    ]
    want = COEFFICIENT * sum(0.5 * (alone[2 * k] + alone[2 * k + 1]) for k in range(len(pairs)))
    assert figures["router_loss"].item() == pytest.approx(want.item(), rel=1e-6)
    model.eval()
    eval_loss, _ = objective.loss_sum(model, collate_packed(pairs))
    assert loss.item() == pytest.approx(eval_loss.item() + want.item(), rel=1e-6)


def _worker(rank: int, world_size: int, port: int, splits: list[list[list[int]]], out_path: str) -> None:
    init_worker_process_group(rank, world_size, port)
    docs = demo_documents(NUM_DOCS)
    model = packed_moe()
    placement = shard_model(model, mesh_dims())
    model.train()
    microbatches = [collate_packed([docs[i] for i in mb]) if mb else empty_batch(0) for mb in splits[rank]]
    objective = TokenCrossEntropy()
    eval_loss = evaluate(model, objective, microbatches, placement.dims, pad_token_id=0)["eval_loss"]
    result = accumulate_gradients(model, objective, StepBatches(microbatches), placement)
    grads = {name.removeprefix("hf_model."): p.grad.full_tensor().clone() for name, p in model.named_parameters()}
    metrics = step_metrics(1, result, objective, grad_norm=0.0, lr=0.0, step_time_s=1.0, device=torch.device("cpu"))
    if rank == 0:
        torch.save({"grads": grads, "metrics": metrics, "eval_loss": eval_loss, "units": result.global_units}, out_path)
    shutdown_distributed()
    exit_process()


@pytest.mark.parametrize("split", ["1rank_1mb", "1rank_3mb", "2rank_2mb_one_empty"])
@pytest.mark.launch
def test_a_steps_gradient_with_the_router_loss_does_not_depend_on_the_split(split, tmp_path):
    everything = list(range(NUM_DOCS))
    splits = {
        "1rank_1mb": [[everything]],
        "1rank_3mb": [[[0, 1, 2], [3, 4, 5, 6], [7]]],
        "2rank_2mb_one_empty": [[[0, 1, 2, 3], [4, 5, 6]], [[7], []]],
    }[split]
    out_path = str(tmp_path / "out.pt")
    spawn(_worker, args=(len(splits), free_port(), splits, out_path), nprocs=len(splits))
    got = torch.load(out_path)
    token_sum, router_sum, want_grads, tokens = stock_step()
    assert got["units"] == tokens
    assert got["metrics"]["loss"] == pytest.approx(float(token_sum) / tokens, rel=1e-5)
    assert got["metrics"]["router_loss"] == pytest.approx(float(router_sum) / tokens, rel=1e-5)
    assert got["eval_loss"] == pytest.approx(float(token_sum) / tokens, rel=1e-5)  # held out: no router term
    for name, want in want_grads.items():
        assert relative_error(got["grads"][name], want) <= 1e-4, name
    # Control: the router term is a real part of the gradient (the routers' gradients are mostly its own).
    model = moe_model()
    model.set_attn_implementation("eager")
    plain = (
        sum(
            F.cross_entropy(
                model(input_ids=torch.tensor([d.input_ids.tolist()])).logits[0],
                torch.tensor(d.labels.tolist()),
                ignore_index=IGNORE_INDEX,
                reduction="sum",
            )
            for d in demo_documents(NUM_DOCS)
        )
        / tokens
    )
    plain.backward()
    router_weights = [n for n in want_grads if n.endswith("gate.weight")]
    assert router_weights and all(
        relative_error(dict(model.named_parameters())[n].grad, want_grads[n]) > 1e-2 for n in router_weights
    )


@pytest.mark.parametrize(
    "compile, param_dtype, grouped_gemm", [(False, "float32", True), (True, "bfloat16", True), (True, "float32", False)]
)
@pytest.mark.launch
def test_experts_run_transformers_grouped_gemm_under_fsdp_checkpointing_and_compile(
    compile, param_dtype, grouped_gemm, monkeypatch
):
    """transformers' `experts_implementation` defaults to grouped_mm where it can dispatch; sharded, with
    activation checkpointing and compiled layers, the experts must still run torch's grouped GEMM, not fall
    back to the per-expert loop (which shows as transformers::grouped_mm_fallback, no aten::_grouped_mm).
    transformers falls back inside compiled code for weights other than bf16 (inductor has no such grouped
    GEMM): compiled fp32 layers loop over the experts, and the compute line says so."""
    from torch.profiler import ProfilerActivity, profile

    from chattune.model.build import experts_implementation

    packed = packed_moe()
    assert (
        experts_implementation(packed.hf_model, compiled=False, compute_dtype="float32")
        == "grouped GEMM (torch._grouped_mm)"
    )
    torch._dynamo.reset()
    for name, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
    }.items():
        monkeypatch.setenv(name, value)
    if compile and not grouped_gemm:  # transformers chooses the loop while dynamo traces; no kernels needed to see it
        monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = packed
        shard_model(packed, mesh_dims(), activation_checkpointing=True, compile=compile, param_dtype=param_dtype)
        model.train()
        batch = collate_packed(demo_documents(3))
        with profile(activities=[ProfilerActivity.CPU]) as trace:
            losses, router = model(batch, router_losses=True)
            (losses.sum() + router.sum()).backward()
    finally:
        torch.distributed.destroy_process_group()
    names = [event.name for event in trace.events()]
    grouped, looped = names.count("aten::_grouped_mm"), names.count("transformers::grouped_mm_fallback")
    if grouped_gemm:  # every MoE layer's two grouped GEMMs, forward (and recomputed), and their backward
        assert grouped >= 2 * packed.hf_model.config.num_hidden_layers and looped == 0, (grouped, looped)
    else:
        assert looped > 0 and grouped == 0, (grouped, looped)
    assert (
        "loop" in experts_implementation(packed.hf_model, compiled=compile, compute_dtype=param_dtype)
    ) != grouped_gemm


QWEN3_MOE = [
    "model.config._target_=transformers.Qwen3MoeConfig",
    "model.config.hidden_size=64",
    "model.config.intermediate_size=128",
    "model.config.num_hidden_layers=2",
    "model.config.num_attention_heads=4",
    "+model.config.head_dim=16",
    "+model.config.num_experts=4",
    "+model.config.num_experts_per_tok=2",
    "+model.config.moe_intermediate_size=32",
    "+model.config.output_router_logits=true",
    "+model.config.router_aux_loss_coef=0.01",
]


@pytest.mark.launch
def test_the_recipe_trains_a_moe_model_with_its_router_loss_and_says_so(tmp_path):
    """SFT of a tiny Qwen3-MoE: the compute line names the experts' implementation and the router loss, and
    every step logs router_loss; loss.router_aux_coef=0 (the remedy the builder's refusal names) turns it off."""
    import sys

    from test_sft_recipe import read_metrics

    common = [
        sys.executable,
        "recipes/sft.py",
        "max_steps=2",
        "log_every=1",
        "eval_every=0",
        "save_every=0",
        "eval.samples=0",
        "data.eval=[]",
        "data.max_tokens_per_microbatch=512",
        "data.buffer_records=8",
        "data.report_records=0",
        *QWEN3_MOE,
    ]
    result = launch([*common, f"output_dir={tmp_path / 'on'}"])
    log = result.stdout + result.stderr
    assert "experts: grouped GEMM (torch._grouped_mm)" in log
    assert "router load-balancing loss × 0.01 (per document, 2 of 4 experts)" in log
    steps = read_metrics(tmp_path / "on")
    assert len(steps) == 2 and all(0 < m["router_loss"] < 0.1 for m in steps), steps
    result = launch([*common, f"output_dir={tmp_path / 'off'}", "loss.router_aux_coef=0"])
    assert "router load-balancing loss" not in result.stdout + result.stderr
    assert all("router_loss" not in m for m in read_metrics(tmp_path / "off"))
