"""The frozen reference of a recipe whose loss compares the policy with one (DPO, KTO): a live model sharded like
the policy, or (reference.cache) a table of its log-probs computed once before training. Both recipes read their
documents as two segments, so the same reference serves them: it gives each document's two segments' log-probs."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import cast

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from chattune.config.policy_losses import compares_vocabularies
from chattune.config.schema import DPOConfig, GRPOConfig, KTOConfig
from chattune.data.ingest.sources import MixedDocuments
from chattune.data.stream import StreamLayout
from chattune.distributed import ParallelDims
from chattune.errors import UserError
from chattune.model.build import BuiltModel, ModelSections, ModelSource, build_sharded_model
from chattune.model.cost.memory import memory_levers
from chattune.model.peft.adapters import BaseModelView
from chattune.objectives import reference_cache
from chattune.objectives.dpo import CachedReference, LiveReference, Reference
from chattune.train.inputs import TrainingData, packed_stream

logger = logging.getLogger(__name__)


def reference_model(
    cfg: DPOConfig | KTOConfig | GRPOConfig, tokenizer: PreTrainedTokenizerBase, dims: ParallelDims, built: BuiltModel
) -> torch.nn.Module:
    """Collective: the frozen reference: reference.path, else the initial policy, sharded like the policy; with LoRA
    and no reference.path, the policy's own base (its adapters off): no second model."""
    if built.peft_model is not None and cfg.reference.path is None:
        logger.info("reference: the policy's base (adapters off)")
        return cast(torch.nn.Module, BaseModelView(built.model, built.peft_model))  # (a module's stand-in)
    return build_sharded_model(
        sections=ModelSections.of(cfg),
        tokenizer=tokenizer,
        dims=dims,
        source=ModelSource(
            cfg.reference.path or cfg.model.path,
            "reference.path" if cfg.reference.path else "model.path",
            role="reference",
        ),
        levers=memory_levers(cfg),
    ).model


def teacher_model(
    cfg: GRPOConfig, tokenizer: PreTrainedTokenizerBase, dims: ParallelDims, student: torch.nn.Module
) -> torch.nn.Module:
    """Collective: on-policy distillation's teacher, teacher.path, frozen and sharded like the policy. It scores the
    student's tokens, so its tokenizer must be the student's, and (loss.type=gkd, which compares distributions) its
    output layer must have the student's rows: a UserError names the difference otherwise."""
    from transformers import AutoTokenizer

    path = cfg.teacher.path
    if path is None:
        raise UserError(f"loss.type={cfg.loss.type} distills from a teacher: set teacher.path")
    try:
        teacher_tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise UserError(f"teacher.path {path}: no tokenizer to compare with the student's ({error})") from error
    theirs, ours = teacher_tokenizer.get_vocab(), tokenizer.get_vocab()
    if theirs != ours:
        differ = sorted(set(theirs.items()) ^ set(ours.items()))[:3]
        raise UserError(
            f"teacher.path {path}: its tokenizer differs from the student's ({len(theirs)} and {len(ours)} tokens; "
            f"e.g. {differ}): the teacher scores the student's tokens, so both must share one tokenizer"
        )
    model = build_sharded_model(
        sections=ModelSections.of(cfg),
        tokenizer=tokenizer,
        dims=dims,
        source=ModelSource(path, "teacher.path", role="teacher"),
        levers=memory_levers(cfg),
    ).model
    if compares_vocabularies(cfg.loss.type):
        rows = {name: _output_rows(held) for name, held in (("teacher", model), ("student", student))}
        if rows["teacher"] != rows["student"]:
            raise UserError(
                f"teacher.path {path}: its output layer has {rows['teacher']} rows and the student's "
                f"{rows['student']}: loss.type={cfg.loss.type} compares distributions over one vocabulary "
                "(loss.type=reverse_kl compares the sampled tokens only)"
            )
    return model.eval().requires_grad_(False)


def _output_rows(model: torch.nn.Module) -> int:
    """The rows of a causal LM's output layer (sharded: the whole layer's, a DTensor's shape)."""
    head = cast(PreTrainedModel, model.hf_model).get_output_embeddings()
    assert head is not None, "a causal LM has an output layer"
    return int(cast(torch.Tensor, head.weight).shape[0])


def reference_log_probs(
    cfg: DPOConfig | KTOConfig,
    tokenizer: PreTrainedTokenizerBase,
    dims: ParallelDims,
    built: BuiltModel,
    data: TrainingData,
    documents: str,
) -> tuple[Reference, Reference | None]:
    """The reference log-probs of the training and held-out documents (of the recipe kind named `documents`): a live
    frozen model (`reference_model`), or (reference.cache) a table of them computed in one pass before training and
    stored under reference.cache_dir."""

    def reference_model_now() -> torch.nn.Module:
        return reference_model(cfg, tokenizer, dims, built)

    if not cfg.reference.cache:
        live = LiveReference(reference_model_now())
        return live, live
    device = dims.device
    if data.train is None:
        raise ValueError("reference.cache computes the reference log-probs of the training records: this run has none")
    train: MixedDocuments = data.train
    splits = {"train": train, **({"eval": data.eval} if data.eval is not None else {})}
    tables = reference_cache.load_or_build(
        Path(cfg.reference.cache_dir),
        {split: reference_cache.cache_fingerprint(cfg, split, device.type, dims.cp, documents) for split in splits},
        {split: len(split_documents) for split, split_documents in splits.items()},
        reference_model_now,
        # The records this pass skips are the ones training and the held-out batches skip, and those log them
        # (once per run): logged here too, each would be listed twice.
        lambda split: packed_stream(
            cfg,
            splits[split],
            StreamLayout(dims.data_rank, dims.data_ranks, shuffle=False, num_epochs=1),
            data.pad_id,
            dims.cp,
            log_skips=False,
        ),
        dims,
        data.pad_id,
    )
    return CachedReference(tables["train"]), CachedReference(tables["eval"]) if data.eval is not None else None
