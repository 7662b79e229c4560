"""The loop's seams (issue 69, item 4), proven by a recipe of the tests' own (tests/recipes/made_steps.py) whose
steps come from a generator, not from records: documents made at each step and weighed, token by token, by the
current model. It trains with chattune's loop, a `StepSource` of its own and per-token values on packed rows,
touching nothing under chattune/. Asserted against an independent replay (plain transformers on each document
alone, torch's AdamW and clipping) and against its own uninterrupted run across a stop and a resume."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import OmegaConf
from test_sft_recipe import read_metrics

from chattune.model.causal_lm import build_hf_model
from conftest import PROJECT_ROOT, SMALL_MODEL, demo_tokenizer, exported_weights, launch, relative_error, torchrun

sys.path.insert(0, str(PROJECT_ROOT / "tests" / "recipes"))
import made_steps  # noqa: E402  (the recipe under test: its documents and weights, as the replay makes them)

pytestmark = pytest.mark.launch

RECIPE = str(PROJECT_ROOT / "tests" / "recipes" / "made_steps.py")
STEPS, RANKS, SEED = 4, 2, 5
RUN = (*SMALL_MODEL, f"max_steps={STEPS}", f"seed={SEED}", "log_every=1", "eval_every=0", "eval.samples=0",
       "save_every=0", "optimizer.lr=1e-2", "max_grad_norm=0.5")  # fmt: skip


def _train(out, *overrides: str) -> list[dict]:
    launch(torchrun(RECIPE, f"output_dir={out}", *RUN, *overrides, nproc=RANKS))
    return read_metrics(out)


def _model_config():
    """The run's model: sft/tiny's config with SMALL_MODEL's keys (what the recipe builds from the same seed)."""
    config = OmegaConf.load(PROJECT_ROOT / "configs" / "sft" / "tiny.yaml")
    for override in SMALL_MODEL:
        key, value = override.split("=", 1)
        OmegaConf.update(config, key, int(value))
    return config


def _replay(lrs: list[float]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The run computed independently: every rank's documents of every step made alike, each weighed by the model
    on it alone, the loss sum(w · nll) over all of them over their trained tokens, torch's clipping and AdamW at the
    run's learning rates. Returns each step's loss and the final weights."""
    config = _model_config()
    tokenizer = demo_tokenizer()
    torch.manual_seed(SEED)
    model = build_hf_model(tokenizer, instantiate(config.model.config, _convert_="all"))
    model.set_attn_implementation("sdpa")
    vocab = model.config.vocab_size
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=lrs[0],
        betas=tuple(config.optimizer.betas),
        weight_decay=config.optimizer.weight_decay,
        eps=config.optimizer.get("eps", 1e-8),
    )
    losses = []
    for step, lr in enumerate(lrs, start=1):
        documents = [
            ids for rank in range(RANKS) for row in made_steps.made_documents(SEED, rank, step, vocab) for ids in row
        ]

        def token_losses(ids: np.ndarray) -> torch.Tensor:
            inputs = torch.tensor(ids[None])
            logits = model(input_ids=inputs).logits[0, :-1].float()
            return F.cross_entropy(logits, inputs[0, 1:], reduction="none")

        model.eval()
        with torch.no_grad():
            weights = [1.0 - torch.exp(-token_losses(ids)) for ids in documents]
        model.train()
        trained = sum(len(ids) - 1 for ids in documents)
        loss = sum((w * token_losses(ids)).sum() for w, ids in zip(weights, documents)) / trained
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses, {name: p.detach() for name, p in model.state_dict().items()}


def test_a_recipe_with_steps_of_its_own_trains_exactly_as_an_independent_replay(tmp_path):
    metrics = _train(tmp_path / "run")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(0.0 < m["mean_weight"] < 1.0 for m in metrics)  # the weights are the model's, not 1
    want_losses, want_weights = _replay([m["lr"] for m in metrics])
    for got, want in zip(metrics, want_losses):
        assert math.isclose(got["loss"], want, rel_tol=1e-5), (got["loss"], want)
    exported = exported_weights(tmp_path / "run" / "hf")
    shared = sorted(set(exported) & set(want_weights))
    assert len(shared) >= len(exported) - 1, sorted(set(exported) ^ set(want_weights))
    error = relative_error({k: exported[k] for k in shared}, {k: want_weights[k] for k in shared})
    assert error <= 1e-4, error


def test_a_recipe_with_steps_of_its_own_resumes_exactly(tmp_path):
    straight = _train(tmp_path / "straight")
    _train(tmp_path / "resumed", "stop_after_step=2")
    resumed = _train(tmp_path / "resumed")
    assert [m["step"] for m in resumed] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in resumed] == [m["loss"] for m in straight]
    assert (
        relative_error(exported_weights(tmp_path / "resumed" / "hf"), exported_weights(tmp_path / "straight" / "hf"))
        == 0
    )
    # the recipe's own component, called by the loop at each point (each launch: its steps, then close)
    stopped = [("pre_train", 0), ("pre_step", 1), ("post_step", 1), ("pre_step", 2), ("post_step", 2), ("close", None)]
    completed = [("pre_train", 2), ("pre_step", 3), ("post_step", 3), ("pre_step", 4), ("post_step", 4)]
    for rank in range(RANKS):
        calls = [tuple(json.loads(line)) for line in (tmp_path / "resumed" / f"hooks.rank{rank}.jsonl").open()]
        assert calls == [*stopped, *completed, ("post_train", 4), ("close", None)], calls
