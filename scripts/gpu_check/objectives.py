"""The in-process checks of the preference objectives: DPO's reference memory, and DPO, ORPO, KTO and the reward
model in the recipe's bf16 numerics against exact fp32."""

from __future__ import annotations

import gc
import math
from contextlib import contextmanager
from dataclasses import replace

import torch

from chattune.data.documents import IGNORE_INDEX, Document
from chattune.data.packing import collate_packed

from .context import Context, _model_and_placement, chat_documents, recipe_model, relative


def _pair_documents(ctx: Context, count: int, max_side: int | None = None) -> list[Document]:
    """Preference pairs made of real chats: chosen = a chat, rejected = another, one document of two segments each;
    `max_side`: each side cut to its first tokens (its last position then predicts nothing; a chat with no trained
    token left is passed over: a side without one makes per-token losses such as ORPO's 0 / 0), None: whole."""

    def side(document: Document) -> tuple[list[int], list[int]]:
        ids, labels = list(document.input_ids), list(document.labels)
        if max_side is not None and len(ids) > max_side:
            ids, labels = ids[:max_side], [*labels[: max_side - 1], IGNORE_INDEX]
        return ids, labels

    if max_side is None:
        sides = [side(document) for document in chat_documents(ctx, 2 * count, start=300)]
    else:
        sides = [side(document) for document in chat_documents(ctx, 8 * count, start=300)]
        sides = [(ids, labels) for ids, labels in sides if any(label != IGNORE_INDEX for label in labels)]
        if len(sides) < 2 * count:
            raise RuntimeError(f"{len(sides)} chats keep a trained token in their first {max_side}: {2 * count} needed")
    pairs = []
    for k in range(count):
        (chosen_ids, chosen_labels), (rejected_ids, rejected_labels) = sides[2 * k], sides[2 * k + 1]
        pairs.append(
            Document(
                k,
                [*chosen_ids, *rejected_ids],
                [*chosen_labels, *rejected_labels],
                segments=(len(chosen_ids), len(rejected_ids)),
            )
        )
    return pairs


def _pair_batches(ctx: Context, count: int) -> list:
    """Preference pairs made of real chats (`_pair_documents`), packed four to a microbatch."""
    pairs = _pair_documents(ctx, count)
    return [collate_packed(pairs[i : i + 4]) for i in range(0, count, 4)]


def check_dpo_reference(ctx: Context) -> None:
    from torch.distributed.tensor import DTensor

    from chattune.data.feed import StepBatches
    from chattune.objectives.dpo import LiveReference, PreferenceObjective, pair_logps
    from chattune.objectives.pair_losses import PreferenceLoss
    from chattune.train.step import UpdateRule, train_step

    class WithoutReshard(LiveReference):  # the reference as it was: its root left gathered after a forward
        @torch.no_grad()
        def __call__(self, batch):
            chosen, rejected, _, _ = pair_logps(self.model(batch), batch)
            return chosen, rejected

    batches = _pair_batches(ctx, 8)

    def run(reference_class) -> tuple[float, int]:
        """(peak memory above what was allocated before, GiB; the reference's parameters left gathered).
        Whatever an earlier run or check left in reference cycles is collected first: freed during this run,
        it would lower this run's figure by its size (the first GPU run measured the two runs 4 GiB apart,
        the wrong way round, before this)."""
        gc.collect()
        if ctx.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(ctx.device)
        before = torch.cuda.memory_allocated(ctx.device) if ctx.cuda else 0
        befores.append(before / 2**30)
        policy, placement = _model_and_placement(recipe_model(ctx, ctx.shape))
        reference_model = recipe_model(ctx, ctx.shape).model
        objective = PreferenceObjective(PreferenceLoss(loss_type="sigmoid", beta=0.1), reference_class(reference_model))
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        for step in range(2):
            train_step(
                policy,
                objective,
                StepBatches(batches[step : step + 1]),
                UpdateRule(optimizer, scheduler, 1.0),
                placement,
            )
        gathered = sum(not isinstance(p, DTensor) for p in reference_model.parameters())
        peak = (torch.cuda.max_memory_allocated(ctx.device) - before) / 2**30 if ctx.cuda else float("nan")
        del policy, reference_model, objective, optimizer, scheduler
        return peak, gathered

    befores: list[float] = []
    fixed, unfixed = run(LiveReference), run(WithoutReshard)
    if ctx.cuda:
        ctx.add(
            "dpo_reference_memory",
            fixed[0] < unfixed[0] and fixed[1] == 0,
            f"peak {fixed[0]:.2f} GiB resharded vs {unfixed[0]:.2f} GiB gathered",
            "lower",
            f"gathered reference parameters: {fixed[1]} vs {unfixed[1]}; allocated before each run "
            f"{befores[0]:.2f} / {befores[1]:.2f} GiB",
        )
    else:
        ctx.add(
            "dpo_reference_memory",
            fixed[1] == 0 < unfixed[1],
            f"reference parameters left gathered: {fixed[1]} resharded vs {unfixed[1]} without",
            "0 and not 0",
        )


@contextmanager
def exact_matmuls():
    """fp32 matmuls in full precision (no TF32: torch.set_float32_matmul_precision("highest"), which sets
    torch.backends.cuda.matmul.allow_tf32=False, and cuDNN's TF32 off), restored after."""
    precision, cudnn_tf32 = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.backends.cudnn.allow_tf32 = cudnn_tf32


# objectives_bf16's bounds, (the step's loss, its gradient over all parameters), relative. CUDA: the recipe's bf16
# compute against fp32. bf16 keeps 8 bits of mantissa (a rounding of 2^-9 ≈ 2e-3 relative per value); the heads
# and the loss reductions run in fp32, so a step's loss (a mean of log-sigmoids of differences of sequence log-prob
# sums) drifts by the per-token errors' sum: packed_vs_hf bounds one token's loss by 0.05, a sum by 1e-3 relative;
# differences of two such sums (policy vs reference, chosen vs rejected) lose relative precision, hence 2e-2. The
# gradient goes back through 28 bf16 layers (packed_vs_hf's q_proj gradient: ≤ 3e-2 relative) and through the
# objectives' sigmoid weights, which inherit the loss's error: 1e-1 over all parameters. Guesses from what bf16
# can give, never yet measured on a GPU: the first GPU run should tighten them from its figures (to about twice
# those). CPU: both runs are fp32 (param_dtype auto is fp32 there), so the figures are rounding (about 0).
OBJECTIVES_BF16_BOUNDS = {"cuda": (2e-2, 1e-1), "cpu": (1e-5, 1e-5)}


def check_objectives_bf16(ctx: Context) -> None:
    """DPO (sigmoid, live reference), ORPO, KTO (live reference) and the reward model: one update step's
    forward/backward (chattune.train.step.accumulate_gradients on 2 microbatches, so the step-level parts run: ORPO's
    chosen-token count, KTO's no-grad reference-point pass) twice on the same documents: with the recipe's numerics
    (recipe_model: model.fsdp.param_dtype auto, bf16 compute on CUDA, loss.implementation auto: cut-cross-entropy
    where installed; eager layers, compile being compile_vs_eager's) and as the exact reference (param_dtype float32,
    the chunked fp32 head, no TF32 anywhere: `exact_matmuls`). The same seeds give both the same fp32 weights; the
    policy is seed 0, the reference seed 1 (a reference equal to the policy would make every log-ratio 0 and DPO's
    and KTO's losses constants). A row per objective: the step's loss and its gradient over all parameters (full
    tensors), relative, against OBJECTIVES_BF16_BOUNDS. On the CPU both numerics resolve to fp32 and the chunked
    head: the same models serve both runs, and the check shows that the whole path runs (figures about 0)."""

    from torch.distributed.tensor import DTensor

    from chattune.data.feed import StepBatches
    from chattune.model.head.fused_loss import resolve_loss_implementation
    from chattune.model.head.kinds import SCORE_HEAD
    from chattune.objectives.dpo import LiveReference, PreferenceObjective
    from chattune.objectives.kto import KTOObjective, KTOWeights
    from chattune.objectives.pair_losses import PreferenceLoss
    from chattune.objectives.reward import RewardObjective
    from chattune.parallel.fsdp import Placement, compute_dtype
    from chattune.train.step import accumulate_gradients

    # 2 microbatches: of 4 pairs on CUDA, each side cut to 512 tokens (the fp32 reference of the 0.6B shape keeps
    # every layer's activations of a microbatch, ≤ 4096 tokens, for its backward); of 2 pairs on the CPU, each side
    # cut to 64 tokens (the demo chats' sides are about 55: some are cut, as on CUDA).
    count = 8 if ctx.cuda else 4
    pairs = _pair_documents(ctx, count, max_side=512 if ctx.cuda else 64)
    examples = [replace(pair, doc_values={"desirable": float(k % 2 == 0)}) for k, pair in enumerate(pairs)]  # KTO
    pair_batches = [collate_packed(pairs[: count // 2]), collate_packed(pairs[count // 2 :])]
    kto_batches = [collate_packed(examples[: count // 2]), collate_packed(examples[count // 2 :])]

    def step(model, objective, batches) -> tuple[float, dict[str, torch.Tensor]]:
        """(the step's mean loss, every parameter's whole gradient, an fp32 copy on the device: four objectives'
        of the 0.6B shape are 10 GiB a run, compared there faster than on the host)."""
        model.zero_grad(set_to_none=True)
        # (every model here is built on ctx.dims, nothing offloaded: what the step reads of its placement)
        result = accumulate_gradients(model, objective, StepBatches(batches), Placement(ctx.dims))
        grads = {
            name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().float().clone()
            for name, p in model.named_parameters()
            if p.grad is not None
        }
        model.zero_grad(set_to_none=True)
        return result.loss_sum / max(result.global_units, 1), grads

    def build(group: str, exact: bool) -> tuple:
        """The models of a group of objectives: the policy (seed 0) and its live reference (seed 1), or the
        reward model (seed 0), with the exact or the recipe's numerics."""
        numerics = dict(loss="chunked", overrides=("model.fsdp.param_dtype=float32",)) if exact else dict(loss="auto")
        if group == "reward":
            return (recipe_model(ctx, ctx.shape, seed=0, head=SCORE_HEAD, **numerics).model.train(),)
        policy = recipe_model(ctx, ctx.shape, seed=0, **numerics).model.train()
        return policy, LiveReference(recipe_model(ctx, ctx.shape, seed=1, **numerics).model)

    def run(group: str, models: tuple) -> dict[str, tuple[float, dict[str, torch.Tensor]]]:
        if group == "reward":
            return {"reward": step(models[0], RewardObjective(), pair_batches)}
        policy, reference = models
        dpo = PreferenceObjective(PreferenceLoss(loss_type="sigmoid", beta=0.1), reference)
        kto = KTOObjective(KTOWeights(beta=0.1), reference)
        out = {
            "dpo_sigmoid": step(policy, dpo, pair_batches),
            "orpo": step(policy, PreferenceObjective(PreferenceLoss(loss_type="orpo"), None), pair_batches),
            "kto": step(policy, kto, kto_batches),
        }
        reference_points.append(float(kto.reference_point))  # KTO's z (0: clamped, its numerics not in play)
        return out

    def free() -> None:
        gc.collect()
        if ctx.cuda:
            torch.cuda.empty_cache()

    # Where the recipe's numerics resolve to the exact ones (the CPU: fp32, the chunked head), the models are built
    # once and both runs use them.
    dtype = compute_dtype("auto", ctx.device.type)
    same = (dtype, resolve_loss_implementation("auto", ctx.device.type, dtype)) == ("float32", "chunked")
    fast: dict = {}
    exact: dict = {}
    reference_points: list[float] = []  # KTO's z: the recipe's numerics', the exact one's
    for group in ("policy", "reward"):
        models = build(group, exact=False)
        fast |= run(group, models)
        if not same:
            del models
            free()
            models = build(group, exact=True)
        with exact_matmuls():
            exact |= run(group, models)
        del models
        free()
    bounds = OBJECTIVES_BF16_BOUNDS["cuda" if ctx.cuda else "cpu"]
    tokens = sum(batch.num_tokens for batch in pair_batches)
    for name, (want_loss, want_grads) in exact.items():
        got_loss, got_grads = fast[name]
        if set(got_grads) != set(want_grads):
            ctx.add(f"objectives_bf16_{name}", False, "the two runs have gradients of different parameters")
            continue
        loss_error = abs(got_loss - want_loss) / max(abs(want_loss), 1e-30)
        difference = sum(float((got_grads[n] - want_grads[n]).double().square().sum()) for n in want_grads)
        norm = sum(float(want_grads[n].double().square().sum()) for n in want_grads)
        grad_error = (difference / max(norm, 1e-300)) ** 0.5
        worst = max(want_grads, key=lambda n: relative(got_grads[n], want_grads[n]))
        ctx.add(
            f"objectives_bf16_{name}",
            math.isfinite(loss_error) and loss_error <= bounds[0] and grad_error <= bounds[1],
            f"loss rel {loss_error:.2g}, gradient rel {grad_error:.2g}",
            f"≤ {bounds[0]:g} / {bounds[1]:g}",
            f"loss {got_loss:.6g} vs fp32 {want_loss:.6g}; worst parameter {worst} "
            f"{relative(got_grads[worst], want_grads[worst]):.2g}; {tokens} tokens in 2 microbatches"
            + (f"; z {reference_points[0]:.4g} vs fp32 {reference_points[1]:.4g}" if name == "kto" else ""),
        )
