"""GKD's generalised Jensen-Shannon divergence from hidden states in chunks, against the paper's formula written here
over the full vocabulary in float64 with probabilities (Agarwal et al., arXiv 2306.13649, eq. 1; TRL's convention
at beta 0 and 1): its values, its gradients (hidden states, output layer, bias), any chunk size; a student equal to
its teacher has zero loss and zero gradient."""

from __future__ import annotations

import pytest
import torch

from chattune.data.documents import IGNORE_INDEX
from chattune.model.head.chunked_divergence import DistillationTarget, chunked_token_divergence
from chattune.model.head.output_logits import LogitTransform

N, H, V = 11, 8, 37


def paper_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float) -> torch.Tensor:
    """Each row's divergence from the two distributions' probabilities (float64)."""
    s, t = torch.softmax(student_logits.double(), -1), torch.softmax(teacher_logits.double(), -1)
    if beta == 0:  # KL(teacher || student)
        return (t * (t / s).log()).sum(-1)
    if beta == 1:  # KL(student || teacher)
        return (s * (s / t).log()).sum(-1)
    m = beta * t + (1 - beta) * s
    return beta * (t * (t / m).log()).sum(-1) + (1 - beta) * (s * (s / m).log()).sum(-1)


def transformed(logits: torch.Tensor, softcap: float | None, temperature: float) -> torch.Tensor:
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits / temperature


def make(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    student = {
        "hidden": torch.randn(N, H, generator=generator),
        "weight": torch.randn(V, H, generator=generator) * 0.7,
        "bias": torch.randn(V, generator=generator) * 0.3,
    }
    teacher = {
        "hidden": torch.randn(N, H, generator=generator),
        "weight": torch.randn(V, H, generator=generator) * 0.7,
        "bias": torch.randn(V, generator=generator) * 0.3,
    }
    labels = torch.randint(0, V, (N,), generator=generator)
    labels[[0, 1, 5]] = IGNORE_INDEX  # a prompt's positions and a gap: not trained
    return student, teacher, labels


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("chunk_size", [4, 9, 1024])  # a quarter of it per chunk: 1, 2 and every position at once
def test_values_and_gradients_equal_the_paper_formula_over_the_full_vocabulary(beta, chunk_size):
    student, teacher, labels = make()
    softcap, temperature = 5.0, 0.7
    params = {name: value.clone().double().requires_grad_() for name, value in student.items()}
    want_logits = transformed(params["hidden"] @ params["weight"].T + params["bias"], softcap, temperature)
    teacher_logits = transformed(teacher["hidden"] @ teacher["weight"].T + teacher["bias"], softcap, temperature)
    trained = labels != IGNORE_INDEX
    want = paper_jsd(want_logits, teacher_logits.double(), beta) * trained
    want.sum().backward()

    got_params = {name: value.clone().requires_grad_() for name, value in student.items()}
    transform = LogitTransform(softcap=softcap).at_temperature(temperature)
    target = DistillationTarget(teacher["hidden"], teacher["weight"], teacher["bias"], transform, beta)
    got = chunked_token_divergence(
        got_params["hidden"], got_params["weight"], labels, target, chunk_size, transform, got_params["bias"]
    )
    got.sum().backward()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want.detach(), rtol=1e-5, atol=1e-6)
    assert torch.all(got[~trained] == 0)
    for name in params:
        torch.testing.assert_close(got_params[name].grad.double(), params[name].grad, rtol=1e-4, atol=1e-6)


def test_a_student_equal_to_its_teacher_has_zero_loss_and_zero_gradient():
    student, _, labels = make(1)
    params = {name: value.clone().requires_grad_() for name, value in student.items()}
    target = DistillationTarget(student["hidden"], student["weight"], student["bias"], LogitTransform(), 0.5)
    got = chunked_token_divergence(
        params["hidden"], params["weight"], labels, target, 8, LogitTransform(), params["bias"]
    )
    got.sum().backward()
    assert got.abs().max() < 1e-6
    for name, param in params.items():
        assert param.grad.abs().max() < 1e-6, name


def test_a_control_a_different_teacher_is_seen():
    student, teacher, labels = make(2)
    target = DistillationTarget(teacher["hidden"], teacher["weight"], None, LogitTransform(), 0.5)
    got = chunked_token_divergence(student["hidden"], student["weight"], labels, target, 8, LogitTransform())
    assert got[labels != IGNORE_INDEX].min() > 1e-3


def test_a_bf16_output_layer_gets_its_gradient_summed_in_fp32_across_chunks():
    student, teacher, labels = make(3)
    target = DistillationTarget(teacher["hidden"], teacher["weight"], None, LogitTransform(), 0.5)
    grads = {}
    for dtype, chunk in ((torch.float32, 1024), (torch.bfloat16, 4)):
        weight = student["weight"].to(dtype).detach().clone().requires_grad_()
        chunked_token_divergence(student["hidden"], weight, labels, target, chunk, LogitTransform()).sum().backward()
        assert weight.grad.dtype == dtype
        grads[dtype] = weight.grad.float()
    torch.testing.assert_close(grads[torch.bfloat16], grads[torch.float32], rtol=2e-2, atol=2e-3)


def test_no_trained_position_gives_zeros_with_a_graph_to_the_output_layer():
    student, teacher, labels = make(4)
    labels[:] = IGNORE_INDEX
    weight = student["weight"].clone().requires_grad_()
    target = DistillationTarget(teacher["hidden"], teacher["weight"], None, LogitTransform(), 0.5)
    got = chunked_token_divergence(student["hidden"], weight, labels, target, 8, LogitTransform())
    got.sum().backward()
    assert torch.all(got == 0) and torch.all(weight.grad == 0)


def test_output_layers_of_different_rows_are_refused():
    student, teacher, labels = make(5)
    target = DistillationTarget(teacher["hidden"], teacher["weight"][:-1], None, LogitTransform(), 0.5)
    with pytest.raises(ValueError, match="36 rows, the student's 37"):
        chunked_token_divergence(student["hidden"], student["weight"], labels, target, 8, LogitTransform())
