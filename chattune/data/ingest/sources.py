"""The documents a recipe reads, defined once for the recipes, `chattune validate` and `chattune inspect`.

What a recipe kind reads (`RecipeData`, one per kind in `RECIPE_DATA`: "sft", "dpo", "reward", "kto"): the record
formats it accepts and how a source's records become documents, conversations with assistant-only labels,
preference pairs or KTO's labelled examples. The recipe kinds themselves (their schema, objective, reference model) are the table of
`chattune.launch.recipe_kinds`, whose entries hold these; the data layer keeps them by kind name because a
token cache is keyed by it (`chattune.data.token_cache`). Every source of `data.train` / `data.eval` becomes
its own document source (with its own format, columns and `train_on`), all behind one record index
(`MixedDocuments`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
from transformers import PreTrainedTokenizerBase

from chattune.config.schema import DataConfig
from chattune.data.documents import Document, Skipped, outcomes_by_record
from chattune.data.ingest.formats import (
    DEFAULT_COLUMNS,
    PREFERENCE_FORMATS,
    PROMPT_FORMATS,
    UNPAIRED_FORMATS,
    SourceSpec,
)
from chattune.data.ingest.records import RecordSource
from chattune.data.stream import DocumentSource, documents_of
from chattune.data.templates.kto_documents import KTO_FORMATS, KTODocuments, examples_per_record
from chattune.data.templates.pair_documents import PairDocuments, RewardPairDocuments
from chattune.data.templates.prompt_documents import PromptDocuments
from chattune.data.templates.sft_documents import SFTDocuments


class MixedDocuments:
    """Several document sources behind one record index (source k's records follow source k-1's).
    Each document is re-addressed by that global index and tagged with its source."""

    def __init__(self, sources: Sequence[tuple[str, DocumentSource]], examples_per_record: Sequence[int] | None = None):
        """`examples_per_record`: how many consecutive documents each record of a source gives (KTO: a preference
        pair's two examples), kept together where records are split (`chattune.data.ingest.held_out`); 1 by default."""
        self.names = [name for name, _ in sources]
        self.sources = [documents for _, documents in sources]
        self.examples_per_record = list(examples_per_record or [1] * len(self.sources))
        self.sizes = [len(documents) for documents in self.sources]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).tolist()

    def __len__(self) -> int:
        return self.offsets[-1]

    @property
    def cached(self) -> bool:
        """Every source reads from its token cache (`chattune.data.token_cache`): nothing left to tokenize."""
        return all(getattr(documents, "cached", False) for documents in self.sources)

    def source_of(self, index: int) -> int:
        return bisect.bisect_right(self.offsets, index) - 1

    def origin(self, index: int) -> tuple[int, int]:
        """(source, the record's number in that source) of a record index. The number is the record's in its
        file even where the source holds only some of the file's records (`chattune.data.ingest.held_out.RecordSubset`)."""
        source = self.source_of(index)
        local = index - self.offsets[source]
        record = getattr(self.sources[source], "record", None)
        return source, record(local) if record is not None else local

    def get(self, index: int) -> Document | Skipped:
        return self.get_many([index])[0]

    def get_many(self, indices: Sequence[int]) -> list[Document | Skipped]:
        """The outcomes of `indices` in order, flat like `documents_of` (a split record gives all its pieces)."""
        by_source: dict[int, list[int]] = {}
        for position, index in enumerate(indices):
            by_source.setdefault(self.source_of(index), []).append(position)
        out: list[list[Document | Skipped]] = [[] for _ in indices]
        for source, positions in by_source.items():  # one batch per source, as its tokenizer prefers
            offset = self.offsets[source]
            got = documents_of(self.sources[source], [indices[p] - offset for p in positions])
            for position, outcomes in zip(positions, outcomes_by_record(got, len(positions))):
                out[position] = [
                    replace(item, doc_id=item.doc_id + offset, source=source) if isinstance(item, Document) else item
                    for item in outcomes
                ]
        return [item for outcomes in out for item in outcomes]


def row_budget(data: DataConfig, context: int = 1) -> tuple[int, str]:
    """The tokens of one packed row and how messages name them: data.max_tokens_per_microbatch per rank, times
    the `context` ranks that share a row under context parallelism (parallel.context). A run passes its mesh's
    degree (`ParallelDims.cp`, made from that setting); `chattune prepare`, `inspect` and `validate`, which make no
    process group, the setting itself: a number, not a group, so the data side needs no mesh."""
    per_rank = data.max_tokens_per_microbatch
    if context == 1:
        return per_rank, f"data.max_tokens_per_microbatch={per_rank}"
    return per_rank * context, (
        f"the row budget {per_rank * context} (data.max_tokens_per_microbatch={per_rank} x parallel.context={context})"
    )


def sft_source(
    spec: SourceSpec, tokenizer: PreTrainedTokenizerBase, data: DataConfig, context: int = 1
) -> SFTDocuments:
    """A source's conversations with assistant-only labels (its `train_on`, else `data.train_on`), each at most
    a row (`row_budget`)."""
    settings = document_settings(spec, data, context)
    return SFTDocuments(
        RecordSource([spec]),
        tokenizer,
        settings["budget"],
        settings["overlong"],
        settings["train_on"],
        settings["on_bad_record"],
        settings["budget_name"],
    )


def pair_source(
    spec: SourceSpec, tokenizer: PreTrainedTokenizerBase, data: DataConfig, context: int = 1
) -> PairDocuments:
    """A source's preference pairs: one document of two segments (chosen, rejected) per pair, at most a row."""
    return _pairs_of(PairDocuments, spec, tokenizer, data, context)


def reward_pair_source(
    spec: SourceSpec, tokenizer: PreTrainedTokenizerBase, data: DataConfig, context: int = 1
) -> RewardPairDocuments:
    """A source's preference pairs for a reward model: `pair_source`'s documents, a record with a margin refused."""
    return _pairs_of(RewardPairDocuments, spec, tokenizer, data, context)


def kto_source(
    spec: SourceSpec, tokenizer: PreTrainedTokenizerBase, data: DataConfig, context: int = 1
) -> KTODocuments:
    """A source's KTO examples (of unpaired records, or two per preference pair): one document of two segments
    (the example, its KL sequence) per example, at most a row."""
    return _pairs_of(KTODocuments, spec, tokenizer, data, context)


def prompt_source(
    spec: SourceSpec, tokenizer: PreTrainedTokenizerBase, data: DataConfig, context: int = 1
) -> PromptDocuments:
    """A source's prompts (GRPO), each as the tokens the policy continues; nothing trained."""
    settings = document_settings(spec, data, context)
    return PromptDocuments(
        RecordSource([spec]), tokenizer, settings["budget"], settings["on_bad_record"], settings["budget_name"]
    )


def _pairs_of(documents: type, spec: SourceSpec, tokenizer: PreTrainedTokenizerBase, data: DataConfig, context: int):
    settings = document_settings(spec, data, context)
    # a pair's two replies continue one prompt (data.share_prompts); KTO's examples are unpaired
    shared = {"share_prompts": settings["share_prompts"]} if issubclass(documents, PairDocuments) else {}
    return documents(
        RecordSource([spec]),
        tokenizer,
        settings["budget"],
        settings["overlong"],
        settings["on_bad_record"],
        settings["budget_name"],
        **shared,
    )


def document_settings(spec: SourceSpec, data: DataConfig, context: int = 1) -> dict:
    """The settings, besides the spec and the tokenizer, that shape a source's documents (and so key its token
    cache, `chattune.data.token_cache`): the masking, the overlong policy, the budget and its name in messages,
    and what a bad record does. The sources above are made from these very settings, so the key cannot miss one."""
    budget, budget_name = row_budget(data, context)
    return {
        "train_on": spec.train_on or data.train_on,
        "overlong": data.overlong,
        "budget": budget,
        "budget_name": budget_name,
        "on_bad_record": data.on_bad_record,
        "share_prompts": data.share_prompts,
    }


SourceOf = Callable[[SourceSpec, PreTrainedTokenizerBase, DataConfig, int], DocumentSource]


@dataclass(frozen=True)
class RecipeData:
    """What a recipe kind reads: each source's documents and the record formats that give them."""

    name: str  # the recipe kind's name, which keys its token caches
    source: SourceOf  # (a source's spec, the tokenizer, the data section, parallel.context) -> its documents
    formats: tuple[str, ...]
    reads: str  # said when a source's format is not one of `formats`
    # each document is two segments (a preference pair: chosen, rejected; a KTO example: it, its KL sequence),
    # not one conversation
    pairs: bool
    # One sequence of a document, for messages about its length (positions restart with each segment).
    sequence: str = "a pair's side (the prompt and one reply)"
    # How many consecutive documents a record of a source gives (KTO reads a preference pair as two examples).
    examples_per_record: Callable[[SourceSpec], int] = lambda spec: 1

    def read(
        self, specs: list[SourceSpec], tokenizer: PreTrainedTokenizerBase, data: DataConfig, context: int = 1
    ) -> MixedDocuments:
        """Every source's documents behind one record index, tokenized as they are read (no token cache)."""
        return MixedDocuments(
            [(spec.display_name, self.source(spec, tokenizer, data, context)) for spec in specs],
            [self.examples_per_record(spec) for spec in specs],
        )


SFT_DATA = RecipeData(
    "sft",
    sft_source,
    tuple(f for f in DEFAULT_COLUMNS if f not in PREFERENCE_FORMATS + UNPAIRED_FORMATS + PROMPT_FORMATS),
    "",
    pairs=False,
    sequence="a document",
)
PAIR_DATA = RecipeData(
    "dpo",
    pair_source,
    tuple(f for f in DEFAULT_COLUMNS if f in PREFERENCE_FORMATS),
    " (DPO reads preference pairs)",
    pairs=True,
)
# DPO's pairs under a name of their own (a token cache is keyed by it): the reward recipe's documents.
REWARD_PAIR_DATA = RecipeData(
    "reward",
    reward_pair_source,
    PAIR_DATA.formats,
    " (a reward model reads preference pairs)",
    pairs=True,
)
# KTO's examples: unpaired records, or preference pairs unpaired (each pair two examples).
KTO_DATA = RecipeData(
    "kto",
    kto_source,
    KTO_FORMATS,
    " (KTO reads unpaired examples or preference pairs)",
    pairs=True,
    sequence="an example or its mismatched sequence (a prompt and one completion)",
    examples_per_record=examples_per_record,
)
# GRPO's prompts: the tokens the policy continues (its completions are made during training).
PROMPT_DATA = RecipeData(
    "grpo",
    prompt_source,
    PROMPT_FORMATS,
    " (the GRPO recipe samples completions of prompts: format prompt)",
    pairs=False,
    sequence="a prompt and its longest completion",
)
# By kind name, for what is handed a kind's name (the token cache's key, `chattune.data.ingest.cached_sources`).
RECIPE_DATA: dict[str, RecipeData] = {
    data.name: data for data in (SFT_DATA, PAIR_DATA, REWARD_PAIR_DATA, KTO_DATA, PROMPT_DATA)
}
