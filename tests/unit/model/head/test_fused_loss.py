"""The fused output-layer loss (`chattune.model.head.fused_loss`, cut-cross-entropy) against the exact fp32
chunked reference, through CCE's torch implementation on the CPU (its CUDA kernels run in bench_gpu.py).

Tolerances: with fp32 inputs both compute the same fp32 logits, so per-token losses agree to 1e-5
relative. With bf16 inputs (FSDP's compute dtype on CUDA) CCE's logits are bf16 GEMMs accumulated in fp32,
while the reference upcasts first: per-token losses within 5e-3 of the largest, their sum within 2.5e-4
relative, gradients within 1e-2 (measured: 9e-4, 2e-5, 4e-3)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from chattune.data.documents import IGNORE_INDEX
from chattune.errors import UserError
from chattune.model.head import fused_loss
from chattune.model.head.chunked_loss import chunked_token_losses
from chattune.model.head.output_logits import LogitTransform
from chattune.parallel.vocab_parallel import VocabShard
from conftest import free_port, init_worker_process_group, relative_error, spawn

pytest.importorskip("cut_cross_entropy")


def _inputs(dtype: torch.dtype):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(200, 32, generator=generator).to(dtype).requires_grad_()
    weight = (torch.randn(500, 32, generator=generator) / 4).to(dtype).requires_grad_()
    labels = torch.randint(0, 500, (200,), generator=generator)
    labels[::7] = IGNORE_INDEX
    return hidden, weight, labels


def _losses_and_grads(loss_fn, dtype):
    hidden, weight, labels = _inputs(dtype)
    losses = loss_fn(hidden, weight, labels)
    (losses * torch.linspace(0.5, 1.5, len(losses))).sum().backward()  # a non-uniform upstream gradient
    return losses.detach(), hidden.grad.float(), weight.grad.float(), labels


@pytest.mark.parametrize("dtype, per_token, grads", [(torch.float32, 1e-5, 1e-4), (torch.bfloat16, 5e-3, 1e-2)])
@pytest.mark.launch
def test_cce_matches_the_fp32_reference(dtype, per_token, grads):
    reference = _losses_and_grads(lambda h, w, y: chunked_token_losses(h, w, y, chunk_size=64), dtype)
    fused = _losses_and_grads(fused_loss.cce_token_losses, dtype)
    ignored = reference[3] == IGNORE_INDEX
    assert fused[0].dtype == torch.float32 and bool((fused[0][ignored] == 0).all())
    assert (fused[0] - reference[0]).abs().max() <= per_token * reference[0].abs().max()
    assert relative_error(fused[0].sum(), reference[0].sum()) < max(per_token / 20, 1e-6)
    assert relative_error(fused[1], reference[1]) < grads and relative_error(fused[2], reference[2]) < grads


def test_the_implementation_is_chosen_by_device_dtype_and_setting(monkeypatch):
    assert fused_loss.resolve_loss_implementation("auto", "cpu", "float32") == "chunked"
    assert fused_loss.resolve_loss_implementation("auto", "cuda", "float32") == "chunked"  # exact fp32 stays exact
    assert fused_loss.resolve_loss_implementation("auto", "cuda", "bfloat16") == "cut_cross_entropy"
    assert fused_loss.resolve_loss_implementation("chunked", "cuda", "bfloat16") == "chunked"
    with pytest.raises(UserError, match="bf16 or fp16"):  # CCE's CUDA kernels refuse fp32 inputs in backward
        fused_loss.resolve_loss_implementation("cut_cross_entropy", "cuda", "float32")
    assert fused_loss.resolve_loss_implementation("cut_cross_entropy", "cpu", "float32") == "cut_cross_entropy"
    monkeypatch.setattr(fused_loss, "cce_available", lambda: False)
    assert fused_loss.resolve_loss_implementation("auto", "cuda", "bfloat16") == "chunked"
    with pytest.raises(UserError, match="cut_cross_entropy package cannot be imported"):
        fused_loss.resolve_loss_implementation("cut_cross_entropy", "cuda", "bfloat16")


def test_a_failed_import_on_cuda_is_a_warning_with_the_reason(monkeypatch, caplog):
    monkeypatch.setattr(fused_loss, "_import_cce", lambda: (None, "RuntimeError: Triton found no compiler"))
    with caplog.at_level("WARNING"):
        assert fused_loss.resolve_loss_implementation("auto", "cpu", "float32") == "chunked"
        assert not caplog.records, "the CPU never uses CCE: nothing to warn about"
        assert fused_loss.resolve_loss_implementation("auto", "cuda", "bfloat16") == "chunked"
    assert len(caplog.records) == 1 and "Triton found no compiler" in caplog.text
    with pytest.raises(UserError, match="Triton found no compiler"):
        fused_loss.resolve_loss_implementation("cut_cross_entropy", "cuda", "bfloat16")


def test_the_gradients_accumulate_in_fp32_where_the_release_allows_it(monkeypatch):
    """25.1.1 (the registry's newest) has no fp32 accumulation; later releases take accum_e_fp32/accum_c_fp32."""
    assert fused_loss.cce_options(on_cuda=False) == {"impl": "torch_compile"}

    def later_release(
        e,
        c,
        targets,
        ignore_index=-100,
        softcap=None,
        reduction="mean",
        shift=0,
        filter_eps="auto",
        accum_e_fp32=False,
        accum_c_fp32=False,
        impl="cce",
    ):
        raise AssertionError("not called")

    monkeypatch.setattr(fused_loss, "_import_cce", lambda: (later_release, None))
    assert fused_loss.cce_options(on_cuda=True) == {"impl": "cce", "accum_e_fp32": True, "accum_c_fp32": True}


# The vocabulary split over 2 ranks (loss-parallel, `chattune.parallel.vocab_parallel`): each loss computed from a
# rank's rows of the output layer (501 of them: the first rank holds 251) and reduced over the group, against the
# same loss computed whole, with a soft-cap; the hidden states' gradient summed over the ranks and the weight's
# gathered from their rows, as the model's split does.
SPLIT_LOSSES = {
    "chunked": lambda h, w, y, t, rows: chunked_token_losses(h, w, y, chunk_size=64, transform=t, rows=rows),
    "cut_cross_entropy": lambda h, w, y, t, rows: fused_loss.cce_token_losses(h, w, y, t, rows=rows),
}


def _split_inputs(dtype: torch.dtype):
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(200, 32, generator=generator).to(dtype)
    weight = (torch.randn(501, 32, generator=generator) / 4).to(dtype)
    labels = torch.randint(0, 501, (200,), generator=generator)
    labels[::7] = IGNORE_INDEX
    return hidden, weight, labels


def _split_losses_and_grads(name: str, dtype: torch.dtype, rows=None):
    hidden, weight, labels = _split_inputs(dtype)
    if rows is not None:
        weight = weight[rows.start : rows.stop]
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    losses = SPLIT_LOSSES[name](hidden, weight, labels, LogitTransform(softcap=5.0), rows)
    (losses * torch.linspace(0.5, 1.5, len(losses))).sum().backward()
    return losses.detach(), hidden.grad.float(), weight.grad.float()


def _split_worker(rank: int, world_size: int, port: int, out_path: str) -> None:
    init_worker_process_group(rank, world_size, port)
    group = dist.group.WORLD
    start, stop = [(0, 251), (251, 501)][rank]
    found = {}
    for name in SPLIT_LOSSES:
        for dtype in (torch.float32, torch.bfloat16):
            losses, grad_hidden, grad_weight = _split_losses_and_grads(name, dtype, VocabShard(start, stop, group))
            dist.all_reduce(grad_hidden)  # (the model's split sums it in the backward: SumGradientOverGroup)
            gathered = [torch.zeros(251, 32) for _ in range(world_size)]
            dist.all_gather(gathered, torch.cat([grad_weight, grad_weight.new_zeros(251 - len(grad_weight), 32)]))
            found[name, str(dtype)] = (losses, grad_hidden, torch.cat([gathered[0], gathered[1][:250]]))
    if rank == 0:
        torch.save(found, out_path)
    dist.destroy_process_group()


@pytest.mark.launch
def test_both_losses_reduce_a_vocabulary_split_over_ranks(tmp_path):
    out_path = str(tmp_path / "split.pt")
    spawn(_split_worker, args=(2, free_port(), out_path), nprocs=2)
    found = torch.load(out_path)
    # (losses, hidden's gradient, weight's gradient), relative to the whole loss's. fp32: the same up to float
    # rounding (measured at most 4e-7). bf16: each rank's part of the hidden states' gradient is rounded to bf16
    # before the sum (measured 2.4e-3 chunked, 3.8e-3 CCE), and CCE's torch implementation rounds its logits to
    # bf16 while the rank's anchor logit added back is fp32-accumulated, as CCE's CUDA kernels keep them
    # (measured: losses 2.6e-4, weight's gradient 6.1e-3): the bounds of CCE's own bf16 error above.
    tolerances = {str(torch.float32): (1e-5, 1e-5, 1e-5), str(torch.bfloat16): (1e-3, 1e-2, 1e-2)}
    for (name, dtype), split in found.items():
        whole = _split_losses_and_grads(name, getattr(torch, dtype.removeprefix("torch.")))
        errors = [relative_error(a, b) for a, b in zip(split, whole)]
        assert all(error <= bound for error, bound in zip(errors, tolerances[dtype])), (name, dtype, errors)
        assert bool((split[0][whole[0] == 0] == 0).all()), "ignored tokens' losses are 0"


class _KernelAccumulation(torch.autograd.Function):
    """CCE 25.1.1's CUDA kernels as far as their output-layer gradient goes (the CPU has no Triton): per-token
    losses from the inputs' logits in fp32, the weight's gradient summed over blocks of 128 tokens into a buffer in
    the inputs' dtype (the kernels' atomic adds into bf16), each block's product in fp32."""

    @staticmethod
    def forward(ctx, hidden, weight, targets):
        logits = hidden.float() @ weight.float().T
        kept = targets != IGNORE_INDEX
        losses = torch.logsumexp(logits, -1) - logits.gather(1, targets.clamp(min=0)[:, None])[:, 0]
        ctx.save_for_backward(hidden, weight, logits, targets, kept)
        return losses.masked_fill(~kept, 0.0)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, logits, targets, kept = ctx.saved_tensors
        delta = torch.softmax(logits, -1)
        delta[torch.arange(len(targets)), targets.clamp(min=0)] -= 1
        delta = delta * (grad * kept)[:, None]
        grad_weight = torch.zeros_like(weight)
        for start in range(0, len(targets), 128):
            block = delta[start : start + 128].T @ hidden[start : start + 128].float()
            grad_weight = (grad_weight.float() + block).to(weight.dtype)
        return (delta @ weight.float()).to(hidden.dtype), grad_weight, None


def _kernel_accumulation(hidden, weight, targets, ignore_index, reduction, softcap, **options):
    assert ignore_index == IGNORE_INDEX and reduction == "none" and softcap is None
    return _KernelAccumulation.apply(hidden, weight, targets)


def test_under_loss_parallel_no_row_of_cces_bf16_weight_gradient_collects_the_other_ranks_tokens(
    monkeypatch, one_rank_group
):
    """A token whose target is another rank's is CCE's loss at an anchor row of this rank's, whose logit is added
    back: the anchor's gradient cancels (-h from CCE, +h from the logit). Were every such token anchored at row 0
    (half of them here, (T-1)/T over T ranks), row 0 would collect thousands of opposite terms, each summed in
    bf16, and keep their rounding: row 0's error would be hundreds of times a row's. Spread, no row's error stands
    out: row 0's within 5x the median row's, against the exact fp32 chunked loss on the same bf16 values."""
    monkeypatch.setattr(fused_loss, "_import_cce", lambda: (_kernel_accumulation, None))
    monkeypatch.setattr(fused_loss, "cce_options", lambda on_cuda: {})
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(4096, 64, generator=generator).to(torch.bfloat16)
    weight = (torch.randn(4096, 64, generator=generator) / 8).to(torch.bfloat16)
    labels = torch.randint(0, 4096, (4096,), generator=generator)  # half of them among this rank's rows
    rows = VocabShard(0, 2048, dist.group.WORLD)  # this rank's half of the vocabulary

    def weight_gradient(loss_fn, dtype: torch.dtype) -> torch.Tensor:
        h, w = hidden.to(dtype).requires_grad_(), weight[:2048].to(dtype).requires_grad_()
        loss_fn(h, w, labels, None, rows).sum().backward()
        return w.grad.float()

    exact = weight_gradient(SPLIT_LOSSES["chunked"], torch.float32)
    errors = (weight_gradient(SPLIT_LOSSES["cut_cross_entropy"], torch.bfloat16) - exact).norm(dim=1)
    median = errors.median()
    print(f"row 0's error {errors[0]:.3g}, the median row's {median:.3g}, the largest {errors.max():.3g}")
    assert errors[0] <= 5 * median and errors.max() <= 20 * median, (errors[0], median, errors.max())
