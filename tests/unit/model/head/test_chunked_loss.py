"""The chunked output-layer cross-entropy equals a plain full-logit cross-entropy, values and gradients."""

import pytest
import torch
import torch.nn.functional as F

from chattune.data.documents import IGNORE_INDEX
from chattune.model.head.chunked_loss import chunked_token_losses
from conftest import relative_error


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1000])
def test_chunked_loss_matches_full_logits(chunk_size):
    torch.manual_seed(0)
    n, h, v = 53, 16, 97
    hidden = torch.randn(n, h, dtype=torch.float32, requires_grad=True)
    weight = torch.randn(v, h, dtype=torch.float32, requires_grad=True)
    labels = torch.randint(0, v, (n,))
    labels[torch.rand(n) < 0.3] = IGNORE_INDEX

    losses = chunked_token_losses(hidden, weight, labels, chunk_size)
    losses.sum().backward()
    got = (losses.detach(), hidden.grad.clone(), weight.grad.clone())

    hidden.grad, weight.grad = None, None
    full = F.cross_entropy(hidden @ weight.t(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    full.backward()

    assert losses.shape == (n,)
    assert torch.all(losses[labels == IGNORE_INDEX] == 0)
    assert relative_error(got[0].sum(), full.detach()) <= 1e-6
    assert relative_error(got[1], hidden.grad) <= 1e-6
    assert relative_error(got[2], weight.grad) <= 1e-6


def test_chunked_loss_keeps_no_full_logits_for_backward():
    """Only the chunk inputs are saved for backward, never a (N, V) logits tensor."""
    n, h, v = 256, 8, 5000
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    labels = torch.randint(0, v, (n,))
    saved = {}  # storage -> elements: the weight is saved by every chunk but stored once

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes() // t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunked_token_losses(hidden, weight, labels, chunk_size=32).sum()
    # Without checkpointing every chunk's logits would be saved: n * v elements in total.
    assert sum(saved.values()) < n * v / 4, f"{sum(saved.values())} saved elements: full logits are {n * v}"


def test_bf16_inputs_give_fp32_logits():
    """Under bf16 mixed precision the loss must equal fp32 cross-entropy of the (exactly upcast) inputs,
    not that of bf16-rounded logits."""
    torch.manual_seed(2)
    hidden = (torch.randn(40, 32) * 3).bfloat16()
    weight = torch.randn(300, 32).bfloat16()
    labels = torch.randint(0, 300, (40,))
    got = chunked_token_losses(hidden, weight, labels, chunk_size=16)
    want = F.cross_entropy(hidden.float() @ weight.float().t(), labels, reduction="none")
    assert got.dtype == torch.float32
    assert relative_error(got, want) <= 1e-6
    rounded = F.cross_entropy((hidden @ weight.t()).float(), labels, reduction="none")
    assert relative_error(rounded, want) > 1e-4  # what the check guards against


def test_no_grad_path_matches():
    torch.manual_seed(1)
    hidden, weight = torch.randn(20, 4), torch.randn(11, 4)
    labels = torch.randint(0, 11, (20,))
    with torch.no_grad():
        got = chunked_token_losses(hidden, weight, labels, chunk_size=6)
    want = F.cross_entropy(hidden @ weight.t(), labels, reduction="none")
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_tf32_is_switched_on_for_the_head_matmuls_alone():
    """With tf32=True (CUDA, bf16 compute) every matmul of the head, forward and backward (the chunks'
    recomputation included), runs with TF32 allowed, and none outside it: the process-wide setting stays
    `highest`. Observed on the CPU through the precision setting each matmul sees when it is dispatched."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[str] = []

    class Precisions(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
                seen.append(torch.get_float32_matmul_precision())
            return func(*args, **(kwargs or {}))

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(40, 16, generator=generator).bfloat16().requires_grad_()
    weight = torch.randn(30, 16, generator=generator).bfloat16().requires_grad_()
    labels = torch.randint(0, 30, (40,), generator=generator)
    assert torch.get_float32_matmul_precision() == "highest"
    with Precisions():
        losses = chunked_token_losses(hidden, weight, labels, chunk_size=16, tf32=True)
        losses.sum().backward()
        outside = torch.randn(4, 4) @ torch.randn(4, 4)
    assert len(seen) == 3 + 3 + 3 * 2 + 1  # 3 chunks: forward, recomputed forward, 2 backward matmuls; one outside
    assert seen[:-1] == ["high"] * (len(seen) - 1) and seen[-1] == "highest"
    assert torch.get_float32_matmul_precision() == "highest"

    # The same values as the plain path (on the CPU TF32 changes nothing; on CUDA the forward is exact).
    plain_hidden, plain_weight = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    plain = chunked_token_losses(plain_hidden, plain_weight, labels, chunk_size=16)
    plain.sum().backward()
    torch.testing.assert_close(losses, plain, rtol=0, atol=0)
    torch.testing.assert_close(hidden.grad, plain_hidden.grad)
    torch.testing.assert_close(weight.grad, plain_weight.grad)
    assert outside.shape == (4, 4)


def test_token_losses_carry_no_bias_against_a_float64_head_over_a_wide_vocabulary():
    # A 49k vocabulary with logits spread as a trained model's are (std ~5): F.cross_entropy's fp32 log-softmax
    # reads the log-normaliser low by several 1e-6 nats a token on average here (1.7e-5 on SmolLM2's real
    # logits), a bias that adds up over a reply's tokens; logsumexp - target stays unbiased to float rounding.
    torch.manual_seed(0)
    n, h, v = 384, 576, 49152
    hidden = torch.randn(n, h)
    weight = torch.randn(v, h) * 0.2
    labels = torch.randint(0, v, (n,))
    labels[:16] = IGNORE_INDEX
    got = chunked_token_losses(hidden, weight, labels, chunk_size=128).double()

    logits = hidden.double() @ weight.double().t()  # the whole head in float64
    trained = labels != IGNORE_INDEX
    exact = torch.logsumexp(logits[trained], -1) - logits[trained].gather(1, labels[trained, None]).squeeze(1)
    bias = (got[trained] - exact).mean().item()
    assert abs(bias) <= 1e-6, bias
    assert torch.all(got[~trained] == 0)


@pytest.mark.parametrize("tf32", [False, True], ids=["fp32", "tf32-path"])
def test_a_bf16_output_layers_gradient_is_summed_over_the_chunks_in_fp32_and_rounded_once(tf32):
    """16 chunks of a bf16 head (what FSDP2's mixed precision hands the loss on CUDA): the output layer's gradient is
    the float64 gradient rounded to bf16 once, not 16 chunk gradients rounded to bf16 and summed in bf16 (3x the
    error: 0.0051 against 0.0017 relative here). The TF32 path's matmuls are fp32 matmuls on the CPU."""
    torch.manual_seed(0)
    tokens, width, vocab, chunk = 4096, 64, 512, 256
    hidden = torch.randn(tokens, width).bfloat16()
    weight = (torch.randn(vocab, width) / 8).bfloat16()
    labels = torch.randint(0, vocab, (tokens,))
    exact = weight.double().requires_grad_()  # the reference: the whole head in float64, one backward
    logits = hidden.double() @ exact.t()
    (torch.logsumexp(logits, -1) - logits.gather(1, labels[:, None])[:, 0]).sum().backward()
    rounded_once = relative_error(exact.grad.bfloat16().double(), exact.grad)
    chunked = weight.clone().requires_grad_()
    chunked_token_losses(hidden, chunked, labels, chunk, tf32=tf32).sum().backward()
    assert chunked.grad.dtype == torch.bfloat16
    assert relative_error(chunked.grad.double(), exact.grad) <= 1.05 * rounded_once
