"""The data side of every recipe's run, set up once: the documents of the recipe's kind (its `RecipeData`,
`chattune.data.ingest.sources`, which `chattune validate` and `chattune inspect` read too), one record index over every source, less the records
`data.eval_split` holds out for eval (`chattune.data.ingest.held_out`). `data.mixing` decides
how the training records are drawn (`chattune.data.ingest.mixing_policy`); a sample is counted for the data report; each rank gets its step
feed (tokenized in loader workers, packed, epochs in lockstep) and its share of the held-out batches.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
from transformers import PreTrainedTokenizerBase

from chattune.config.layout_rules import microbatch_ranks_problem
from chattune.config.schema import RunConfig
from chattune.data.feed import InvariantSlots, StepFeed, StepSource
from chattune.data.ingest.cached_sources import open_documents
from chattune.data.ingest.held_out import held_out_line, hold_out, joined
from chattune.data.ingest.mixing_policy import Mixer, mixture_sampling
from chattune.data.ingest.records import source_specs
from chattune.data.ingest.report import count_lines, report_sample, scan_documents
from chattune.data.ingest.sources import MixedDocuments, RecipeData, row_budget
from chattune.data.packing import PackedBatch
from chattune.data.stream import PackedStream, PackingBudget, StreamLayout
from chattune.data.templates.tokenizer import pad_token_id
from chattune.distributed import ParallelDims, reduce_sums
from chattune.errors import UserError
from chattune.train.evaluation import HeldOutScorer

logger = logging.getLogger(__name__)


def packed_stream(
    cfg: RunConfig,
    documents: MixedDocuments,
    layout: StreamLayout,
    pad_id: int,
    context: int,
    sampler=None,
    log_skips: bool = True,
) -> PackedStream:
    """The packed microbatches of `documents` that `layout` reads: its share (a rank's, or all of it for
    world-size-invariant steps) of every epoch, or of a mixture's draws (`sampler`), packed to the config's
    budget for rows split across `context` ranks (`ParallelDims.cp`). `log_skips`: whether this rank logs the records it skips (not when every rank reads the same ones)."""
    # From a token cache there is nothing to tokenize: loader workers would only copy the documents across.
    num_workers = 0 if documents.cached else cfg.data.num_workers
    budget = PackingBudget(
        row_budget(cfg.data, context)[0], pad_id, cfg.data.pad_to_multiple_of, cfg.data.buffer_records
    )
    return PackedStream(
        documents, layout, cfg.seed, budget, num_workers=num_workers, sampler=sampler, log_skips=log_skips
    )


@dataclass
class StepLayout:
    """Which data a rank packs and which of a step's microbatches it trains."""

    share: int  # this rank's share of the data ...
    num_shares: int  # ... of this many
    microbatches_per_step: int  # taken from the stream per step
    slots: range | None  # world-size-invariant: this rank's microbatches of each step; None: all it takes


def step_layout(cfg: RunConfig, dims: ParallelDims) -> StepLayout:
    """Per rank: the rank's share, grad_accum_steps microbatches of it a step. World-size-invariant
    (data.microbatches_per_step = M): all the data, M microbatches a step, rank r training M/W consecutive ones.
    Under context parallelism a "rank" here is a data-parallel rank: the C ranks of a context group read and
    train the same microbatches (`ParallelDims.data_rank`)."""
    total, data_rank, data_ranks = cfg.data.microbatches_per_step, dims.data_rank, dims.data_ranks
    if total is None:
        return StepLayout(data_rank, data_ranks, cfg.grad_accum_steps, None)
    problem = microbatch_ranks_problem(total, dims.world_size, dims.cp)
    if problem:
        raise UserError(f"data.microbatches_per_step={problem}")
    per_rank = total // data_ranks
    return StepLayout(0, 1, total, range(data_rank * per_rank, (data_rank + 1) * per_rank))


@dataclass
class TrainingData:
    train: MixedDocuments | None  # the training records (None: a recipe's own steps, not read from records)
    eval: MixedDocuments | None  # data.eval_split's held-out records and data.eval's sources; None: no eval
    feed: StepSource  # each step's microbatches on this rank (`StepFeed`: read from the records)
    eval_batches: list[PackedBatch]  # this rank's share of the held-out data
    mixer: Mixer | None  # data.mixing static or online; None: the sources are concatenated
    pad_id: int  # what pads an empty microbatch (`chattune.data.templates.tokenizer.pad_token_id`)
    held_out_records: list[np.ndarray]  # per training source, the record numbers data.eval_split holds out
    # a recipe's own held-out evaluation in place of held-out batches (the GRPO recipe's prompts); None: none
    held_out_scorer: HeldOutScorer | None = None

    @property
    def num_sources(self) -> int:
        """Sources the objective reports per-source sums for (1: no mixture, nothing per source)."""
        return self.mixer.num_sources if self.mixer else 1

    @classmethod
    def made_by(cls, feed: StepSource, pad_id: int, held_out: HeldOutScorer | None = None) -> TrainingData:
        """The data of a recipe that makes its own steps (`feed`: its rollouts, say): no records; its own held-out
        evaluation, if any (`held_out`)."""
        return cls(
            train=None,
            eval=None,
            feed=feed,
            eval_batches=[],
            mixer=None,
            pad_id=pad_id,
            held_out_records=[],
            held_out_scorer=held_out,
        )


def check_something_trains(
    cfg: RunConfig, dims: ParallelDims, train: MixedDocuments, counts: dict[str, float] | None = None
) -> None:
    """Collective: a UserError, with what the records gave, when not one record of the training data gives a
    token to train (every one over the budget with data.overlong=drop, say). `counts`: the whole data's, if
    already counted (otherwise the ranks count it in parts here)."""
    if counts is None:
        every = range(len(train))
        counts = reduce_sums(scan_documents(train, every[dims.rank :: dims.world_size]).counts(), dims.device)
    if counts["trainable_tokens"] > 0:
        return
    skipped = {name.removeprefix("skipped/"): int(n) for name, n in counts.items() if name.startswith("skipped/") and n}
    hints = []
    if skipped.get("overlong"):
        hints.append(
            f"{skipped['overlong']} are longer than {row_budget(cfg.data, dims.cp)[1]} "
            f"(data.overlong={cfg.data.overlong}): raise the budget"
            + (", or keep them with data.overlong=truncate or split" if cfg.data.overlong == "drop" else "")
        )
    if skipped.get("no_trainable_tokens"):
        hints.append(f"{skipped['no_trainable_tokens']} have no token to train under data.train_on={cfg.data.train_on}")
    reasons = ", ".join(f"{reason} {n}" for reason, n in skipped.items())
    raise UserError(
        f"data.train: none of its {int(counts['records'])} records gives a token to train (skipped: "
        f"{reasons or 'none'})" + (": " + "; ".join(hints) if hints else "")
    )


def build_training_data(
    cfg: RunConfig, dims: ParallelDims, tokenizer: PreTrainedTokenizerBase, recipe_data: RecipeData
) -> TrainingData:
    """Collective (the data report's counts are summed over ranks). `recipe_data`: what the recipe's kind reads
    (`chattune.launch.recipe_kinds.RecipeKind.data`)."""
    pad_id, context = pad_token_id(tokenizer), dims.cp
    train_specs = source_specs(cfg.data.train)
    # Each source from its token cache (data.cache), built by every rank together on the first launch.
    train = open_documents(recipe_data.name, train_specs, tokenizer, cfg.data, context)
    # data.eval_split: some records of each source held out for eval; training reads only the others (any epoch,
    # mixture or step layout), the same ones on every rank and launch
    split = hold_out(train, cfg.data.eval_split, cfg.seed)
    train = split.train
    if split.held_out is not None:
        logger.info(held_out_line(split, cfg.data.eval_split))
    # data.mixing: the sources concatenated (mode none), or sampled by weight (static) or by a bandit (online)
    layout = step_layout(cfg, dims)
    mixer, sampler = mixture_sampling(
        cfg.data.mixing,
        train_specs,
        train.sizes,
        layout.share,
        layout.num_shares,
        cfg.seed,
        cfg.data.num_epochs,
        cfg.data.buffer_records,
    )
    if cfg.data.report_records != 0:  # what the data holds, from a sample that the ranks count in parts
        sample = report_sample(len(train), cfg.data.report_records, cfg.seed)
        counts = reduce_sums(scan_documents(train, sample[dims.rank :: dims.world_size]).counts(), dims.device)
        logger.info(
            "training data (%d of %d records sampled): %s", len(sample), len(train), "; ".join(count_lines(counts))
        )
        if counts["trainable_tokens"] == 0:  # before the model is loaded: nothing of this data would train
            check_something_trains(cfg, dims, train, counts if len(sample) == len(train) else None)
    # Every step takes its microbatches from this rank's stream (world-size-invariant: every rank's is the same
    # stream, and only rank 0 logs its skipped records; context parallelism: a group's ranks read the same stream,
    # and only its first counts and logs); epochs end on the same step on every rank.
    reports = dims.reports_rows
    stream = packed_stream(
        cfg,
        train,
        StreamLayout(layout.share, layout.num_shares, shuffle=True, num_epochs=cfg.data.num_epochs),
        pad_id,
        context,
        sampler=sampler,
        log_skips=reports and (layout.slots is None or dims.is_main),
    )
    feed = StepFeed(
        stream,
        layout.microbatches_per_step,
        pad_id,
        num_epochs=cfg.data.num_epochs,
        mixer=mixer,
        num_ranks=dims.world_size,
        invariant=InvariantSlots(layout.slots, cfg.seed) if layout.slots is not None else None,
        reports_figures=reports,
    )
    own_eval = (
        open_documents(recipe_data.name, source_specs(cfg.data.eval), tokenizer, cfg.data, context)
        if cfg.data.eval
        else None
    )
    held_out = joined(split.held_out, own_eval)  # data.eval_split's records, then data.eval's
    eval_batches = (
        list(
            packed_stream(
                cfg,
                held_out,
                StreamLayout(dims.data_rank, dims.data_ranks, shuffle=False, num_epochs=1),
                pad_id,
                context,
                log_skips=reports,
            )
        )
        if held_out is not None
        else []
    )
    return TrainingData(train, held_out, feed, eval_batches, mixer, pad_id, split.records)
