"""Expert parallelism on one GPU: the experts split over an expert group of one rank (`ParallelDims.build(keep={"ep"})`:
NCCL refuses two ranks on one GPU), so that the split's code runs where only one GPU is lent: the experts' weights as
DTensors under FSDP2, the family's experts class on their local parts, the all-to-all exchanges (with itself), the
graph break in a compiled layer, transformers' grouped GEMM. A row with tokens moving between GPUs needs two."""

from __future__ import annotations

import time

import torch

from .context import Context, built_from, chat_documents, qwen3_config, recipe_config, relative

# The split runs the same arithmetic as the unsplit layer in another order (the routing weights applied after the
# experts, not inside them): fp32 on the CPU, the recipe's bf16 on CUDA. (loss, update) relative.
EXPERT_PARALLEL_BOUNDS = {"cpu": (1e-5, 1e-4), "cuda": (2e-3, 2e-2)}
TIMED_STEPS = 3


def moe_config(ctx: Context, layers: int | None) -> dict:
    """transformers.Qwen3MoeConfig's keywords: the shape's attention, every MLP a MoE layer (tiny: 8 experts, top 2;
    on CUDA 16 experts of a quarter of the shape's MLP width, top 4)."""
    config = qwen3_config(ctx.shape, layers)
    experts = (8, 2) if ctx.shape == "tiny" else (16, 4)
    return {
        "_target_": "transformers.Qwen3MoeConfig",
        **config,
        "num_experts": experts[0],
        "num_experts_per_tok": experts[1],
        "moe_intermediate_size": config["intermediate_size"] // 4,
    }


def check_expert_parallel(ctx: Context) -> None:
    """One step of SGD (lr 1: the update is the gradient) of a Qwen3-MoE-shaped model with its experts split over a
    kept ep mesh of one rank against the unsplit model on the same batch (compiled on CUDA, as a recipe is), its
    loss and update within EXPERT_PARALLEL_BOUNDS; on CUDA each model's time for TIMED_STEPS more steps is the figure."""
    from omegaconf import open_dict

    from chattune.data.feed import StepBatches
    from chattune.data.packing import collate_packed
    from chattune.distributed import ParallelDims
    from chattune.objectives.cross_entropy import TokenCrossEntropy
    from chattune.parallel.expert_parallel import ExpertParallelExperts
    from chattune.train.step import UpdateRule, train_step

    split_dims = ParallelDims.build(ctx.device, None, keep=frozenset({"ep"}))
    layers = 4 if ctx.cuda else None
    batches = StepBatches([collate_packed(chat_documents(ctx, 8, start=500))])
    losses, updates, seconds = {}, {}, {}
    for name, dims in (("unsplit", ctx.dims), ("split", split_dims)):
        cfg = recipe_config(ctx, ctx.shape, layers, compile=ctx.cuda)
        with open_dict(cfg):
            cfg.model.config = moe_config(ctx, layers)
        built = built_from(ctx, cfg, dims=dims)
        model, placement = built.model, built.placement
        split = [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]
        if (name == "split") != bool(split):
            raise AssertionError(f"{name}: {len(split)} experts modules split over the kept ep mesh")
        before = {n: p.full_tensor().float().cpu() for n, p in model.named_parameters()}
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        rule = UpdateRule(optimizer, scheduler, None)
        result, _ = train_step(model, TokenCrossEntropy(), batches, rule, placement)
        losses[name] = torch.tensor(result.loss_sum / result.global_units)
        updates[name] = torch.cat(
            [(p.full_tensor().float().cpu() - before[n]).flatten() for n, p in model.named_parameters()]
        )
        if ctx.cuda:  # (timed on CUDA only: the CPU's figure would say nothing and cost the suite)
            seconds[name] = _step_seconds(ctx, model, batches, placement)
        del model, optimizer, built
    loss_bound, update_bound = EXPERT_PARALLEL_BOUNDS[ctx.device.type]
    loss_error = relative(losses["split"], losses["unsplit"])
    update_error = relative(updates["split"], updates["unsplit"])
    timed = f"; step {seconds['split']:.3f} s split vs {seconds['unsplit']:.3f} s unsplit" if seconds else ""
    ctx.add(
        "expert_parallel_one_rank",
        loss_error <= loss_bound and update_error <= update_bound,
        f"loss rel {loss_error:.2g}, update rel {update_error:.2g} against the unsplit model{timed}",
        f"≤ {loss_bound:g} / {update_bound:g}",
        f"ep mesh of 1 rank with FSDP2, {batches.microbatches[0].num_tokens} tokens, one SGD step"
        + (", compiled layers" if ctx.cuda else ""),
    )


def _step_seconds(ctx: Context, model, batches, placement) -> float:
    """A step's seconds (TIMED_STEPS after one untimed, with a learning rate of 0: the weights stay)."""
    from chattune.objectives.cross_entropy import TokenCrossEntropy
    from chattune.train.step import UpdateRule, train_step

    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    rule = UpdateRule(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), None)
    train_step(model, TokenCrossEntropy(), batches, rule, placement)  # (a recompile for the next shapes)
    torch.cuda.synchronize(ctx.device)
    start = time.perf_counter()
    for _ in range(TIMED_STEPS):
        train_step(model, TokenCrossEntropy(), batches, rule, placement)
    torch.cuda.synchronize(ctx.device)
    return (time.perf_counter() - start) / TIMED_STEPS
