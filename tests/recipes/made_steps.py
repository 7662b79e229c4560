"""A recipe whose update steps come from a generator of its own, not from records: the loop's seams at work (a
`StepSource`, per-token values carried on packed rows, an objective of its own), with nothing changed under
chattune/. Tests only (tests/e2e/test_made_steps.py).

Each step, every rank makes MICROBATCHES rows of documents of random tokens (seeded by the run's seed, the rank and
the step) and weighs each token by how unsure the current model is of it, 1 - p(token), from a no-grad forward of
the model being trained: documents made from the model's outputs. The loss is the weighted cross-entropy
sum(w · nll) over the step's tokens, divided by the step's trained tokens over all ranks.

    torchrun --nproc_per_node 2 tests/recipes/made_steps.py output_dir=... max_steps=4
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig
from torch import nn

from chattune.checkpoint.output_dir import claim_output_dir
from chattune.data.documents import IGNORE_INDEX, Document
from chattune.data.feed import StepBatches
from chattune.data.packing import PackedBatch, collate_packed
from chattune.data.templates.tokenizer import load_tokenizer, pad_token_id
from chattune.distributed import init_distributed, shutdown_distributed
from chattune.launch.app import recipe_main
from chattune.launch.recipe_kinds import SFT
from chattune.launch.validate import checked_config
from chattune.log import setup_logging
from chattune.model.build import build_trained_model
from chattune.objectives.base import Objective
from chattune.parallel.fsdp import Placement, reshard
from chattune.train.callbacks import Callback, Update
from chattune.train.inputs import TrainingData
from chattune.train.loop import Learning, train
from chattune.train.optimizer import build_optimizer, build_scheduler

MICROBATCHES = 2  # rows per rank per step
DOCUMENTS = 2  # documents per row
LENGTHS = (5, 17)  # a document's tokens: from the first up to the second


def made_documents(seed: int, rank: int, step: int, vocab_size: int) -> list[list[np.ndarray]]:
    """Each row's documents' tokens for `rank`'s step `step`: the same whoever asks (the test's replay too)."""
    rng = np.random.default_rng([seed, rank, step])
    return [
        [rng.integers(3, vocab_size, size=int(rng.integers(*LENGTHS))) for _ in range(DOCUMENTS)]
        for _ in range(MICROBATCHES)
    ]


def weights(token_losses: np.ndarray, trained: np.ndarray) -> np.ndarray:
    """A token's weight: how unsure the model is of it, 1 - p = 1 - exp(-nll); 0 where nothing is trained."""
    return np.where(trained, 1.0 - np.exp(-token_losses), 0.0)


def as_document(doc_id: int, ids: np.ndarray) -> Document:
    labels = np.append(ids[1:], IGNORE_INDEX)  # every next token, none across the document's end
    return Document(doc_id=doc_id, input_ids=ids, labels=labels)


class ModelWeightedSteps:
    """The recipe's `chattune.data.feed.StepSource`: documents made at each step, weighed by the current model.
    Its state is the next step to make: the documents of a step depend only on it and on the model, so a resumed
    run makes the steps the uninterrupted run made."""

    mixer = None
    finished = False
    epoch = 0
    skipped: dict[str, int] = {}

    def __init__(self, model: nn.Module, placement: Placement, seed: int, vocab_size: int):
        self.model, self.placement, self.seed, self.vocab_size = model, placement, seed, vocab_size
        self.next = 1

    @torch.no_grad()
    def next_step(self, step: int) -> StepBatches:
        if step != self.next:
            raise RuntimeError(f"asked for step {step}, the next one is {self.next}")
        rows = []
        was_training = self.model.training
        self.model.eval()
        for row, tokens in enumerate(made_documents(self.seed, self.placement.dims.rank, step, self.vocab_size)):
            documents = [as_document(1000 * step + 10 * row + k, ids) for k, ids in enumerate(tokens)]
            losses = self.model(collate_packed(documents).to(self.placement.device)).float().cpu().numpy()
            start = 0
            for document in documents:  # each document's tokens weighed by the model's losses on them
                end = start + len(document)
                document.token_values["weight"] = weights(losses[start:end], document.labels != IGNORE_INDEX)
                start = end
            rows.append(collate_packed(documents))
        self.model.train(was_training)
        reshard(self.model)  # (a forward without a backward leaves the root gathered)
        self.next = step + 1
        return StepBatches(rows, epoch=0)

    def close_step(self, ranks_at_epoch_end: int) -> list[tuple[int, dict[str, int]]]:
        return []

    def state_dict(self) -> dict:
        return {"next": self.next}

    def load_state_dict(self, state: dict) -> None:
        self.next = int(state["next"])

    def close(self) -> None:
        del self.model


class WeightedCrossEntropy(Objective):
    """sum(weight · nll) of a microbatch; its units are its trained tokens (the step divides by them all)."""

    unit_name = "trained token"

    def count_units(self, batch: PackedBatch) -> int:
        return batch.num_trainable_tokens

    def loss_sum(self, model: nn.Module, batch: PackedBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        token_losses = model(batch)
        if "weight" not in batch.token_values:  # an empty microbatch (a padding token): nothing to weigh
            return token_losses.sum() * 0.0, {"weight_sum": token_losses.new_zeros(())}
        weight = batch.token_values["weight"].reshape(-1).to(token_losses.device)
        return (weight * token_losses).sum(), {"weight_sum": weight.sum()}

    def metrics(self, sums: dict[str, float], global_units: int) -> dict[str, float]:
        units = max(global_units, 1)
        return {"loss": sums["loss_sum"] / units, "num_tokens": global_units, "mean_weight": sums["weight_sum"] / units}


class HookLog(Callback):
    """A component of the recipe's own: one line per hook the loop calls, in `path` (the test reads their order)."""

    def __init__(self, path: Path):
        self.path = path

    def _write(self, hook: str, step: int | None = None) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps([hook, step]) + "\n")

    def pre_train(self, start_step: int) -> None:
        self._write("pre_train", start_step)

    def pre_step(self, step: int) -> None:
        self._write("pre_step", step)

    def post_step(self, update: Update) -> None:
        self._write("post_step", update.step)

    def post_train(self, last_step: int) -> None:
        self._write("post_train", last_step)

    def close(self) -> None:
        self._write("close")


@recipe_main(config_name="sft/tiny", kind=SFT)
def main(composed: DictConfig) -> None:
    cfg, _ = checked_config(composed, SFT)
    dims = init_distributed(cfg.device, cfg.parallel)
    setup_logging(dims.rank)
    start = claim_output_dir(cfg, dims)
    tokenizer = load_tokenizer(cfg.tokenizer)
    built = build_trained_model(cfg, tokenizer, dims)
    steps = ModelWeightedSteps(built.model, built.placement, cfg.seed, built.hf_model.config.vocab_size)
    data = TrainingData(
        train=None,
        eval=None,
        feed=steps,
        eval_batches=[],
        mixer=None,
        pad_id=pad_token_id(tokenizer),
        held_out_records=[],
    )
    optimizer = build_optimizer(cfg.optimizer, [p for p in built.model.parameters() if p.requires_grad], dims.device)
    scheduler = build_scheduler(cfg.scheduler, optimizer, cfg.max_steps)
    hooks = HookLog(Path(cfg.output_dir) / f"hooks.rank{dims.rank}.jsonl")
    learning = Learning(WeightedCrossEntropy(), optimizer, scheduler)
    train(cfg, dims, start, built, data, learning, tokenizer, callbacks=[hooks])
    shutdown_distributed()


if __name__ == "__main__":
    main()
