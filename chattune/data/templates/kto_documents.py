"""KTO data: labelled replies (the `unpaired` format) or preference pairs read as labelled replies, into one
document of two segments per example: the example, then its KL sequence.

An example is a context and one assistant reply, desirable or not (KTO's label: the document's declared value `desirable`, `KTO_LABEL`). A source
of the `unpaired` format has one example per record. A source of a preference format is unpaired as TRL's
`unpair_preference_dataset` does it: record r gives example 2r (its chosen reply, desirable) and example 2r + 1
(its rejected reply, undesirable); a pair whose two replies are the same gives two skipped examples (a reply
both desirable and undesirable says nothing).

The KL sequence is KTO's reference point: the example's own context followed by the reply of its *partner*,
a mismatched completion whose log-ratio estimates the KL term. The partner is the same side of the next record
of the source, cyclically (example r of an unpaired source pairs with record (r + 1) mod n; example (r, side)
of a paired one with ((r + 1) mod n, side); a source of one record is its own partner). A bad record is named
as itself, never through the record before it; with on_bad_record=skip it is skipped and the next readable
record is that record's partner instead (it still trains). TRL rotates completions
by one within each `per_device_train_batch_size` chunk; a partner fixed by the record makes the KL sequence
independent of batching, ranks, shuffling and resumes.

Both segments are rendered by the chat template exactly as `apply_chat_template(context + [reply])` renders
them, and each trains exactly its final reply and the end-of-turn token (`last_turn_only`), as a DPO side does
(`chattune.data.templates.pair_documents`). Labels are shifted within each segment, whose last position predicts
nothing. A document longer than the budget (both segments: they share a microbatch) is dropped (counted) or an
error; it is never cut.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from transformers import PreTrainedTokenizerBase

from chattune.config.schema import OVERLONG_DPO
from chattune.data.documents import Document, Skipped
from chattune.data.ingest.formats import (
    PREFERENCE_FORMATS,
    UNPAIRED_FORMATS,
    DataError,
    SourceSpec,
    UnpairedExample,
    to_preference_pair,
    to_unpaired_example,
)
from chattune.data.ingest.records import RecordSource
from chattune.data.templates.template_documents import TwoSequenceDocuments, with_skip_remedy

KTO_FORMATS = (*UNPAIRED_FORMATS, *PREFERENCE_FORMATS)
SIDES = ("chosen", "rejected")  # a preference pair's examples, in example order (2r, 2r + 1)


def examples_per_record(spec: SourceSpec) -> int:
    """A preference pair is two examples (chosen, rejected), an unpaired record one."""
    return 2 if spec.format in PREFERENCE_FORMATS else 1


class KTODocuments(TwoSequenceDocuments):
    """KTO examples of one source by example index: one `Document` of two segments (the example, its KL
    sequence) per example, or why it is `Skipped`.

    One source (one `SourceSpec`), because the KL partner is the next record of the same source. overlong, for
    an example whose two segments together exceed `max_tokens`: `drop` (a counted skip) or `error`."""

    def __init__(
        self,
        source: RecordSource,
        tokenizer: PreTrainedTokenizerBase,
        max_tokens: int,
        overlong: str = "drop",
        on_bad_record: str = "error",
        budget_name: str | None = None,
    ):
        if overlong not in OVERLONG_DPO:
            raise ValueError(f"data.overlong must be one of {OVERLONG_DPO} for KTO data, got {overlong!r}")
        if len(source.specs) != 1:
            raise ValueError(f"KTODocuments reads one source (its KL partners are records of it), got {source.specs}")
        self.spec = source.specs[0]
        if self.spec.format not in KTO_FORMATS:
            raise DataError(
                f"{self.spec.path}: KTO needs unpaired examples or preference pairs (format one of "
                f"{list(KTO_FORMATS)}), got format {self.spec.format!r}"
            )
        super().__init__(source, tokenizer, max_tokens, overlong, on_bad_record, budget_name)
        self.paired = self.spec.format in PREFERENCE_FORMATS
        self.num_records = len(source)

    def __len__(self) -> int:
        return self.num_records * examples_per_record(self.spec)

    def example_of(self, index: int) -> tuple[int, int]:
        """(record, side) of an example index: side 0 chosen / 1 rejected of a pair, 0 for an unpaired record."""
        if not 0 <= index < len(self):
            raise IndexError(f"example {index} of {len(self)}")
        return divmod(index, 2) if self.paired else (index, 0)

    def partner_of(self, index: int) -> int:
        """The example whose reply makes `index`'s KL sequence: the same side of the next record, cyclically."""
        record, side = self.example_of(index)
        following = (record + 1) % self.num_records
        return 2 * following + side if self.paired else following

    def get_many(self, indices: Sequence[int]) -> list[Document | Skipped]:
        """The outcomes of the examples at `indices`, in order: each a `Document` or a `Skipped`. Their records
        and their partners' are read once (one pass over the file); reading stops at the first error under
        on_bad_record=error, raised after the examples before it are tokenized (as `TemplateDocuments`)."""
        indices = [int(i) for i in indices]
        needed = sorted(
            {self.example_of(i)[0] for i in indices} | {self.example_of(self.partner_of(i))[0] for i in indices}
        )
        located = {record: found for record, found in zip(needed, self.source.locate_many(needed))}
        read: dict[int, tuple[str, tuple[UnpairedExample, ...] | DataError]] = {}

        def examples(record: int) -> tuple[str, tuple[UnpairedExample, ...] | DataError]:
            """A record's name and its examples (or why it has none), converted once per batch."""
            if record not in read:
                if record not in located:  # a partner found past a bad record (on_bad_record=skip)
                    located[record] = self.source.locate_many([record])[0]
                _, where, value = located[record]
                read[record] = (where, self._convert(where, value))
            return read[record]

        outcomes: list[_RenderedExample | Skipped] = []
        failure: DataError | None = None
        for index in indices:
            try:
                outcomes.append(self._render_example(index, examples))
            except DataError as error:
                if self.on_bad_record != "skip":
                    failure = error
                    break
                outcomes.append(Skipped("bad_record", str(error)))
        rendered = [o for o in outcomes if isinstance(o, _RenderedExample)]
        tokenized = iter(self._tokenize(rendered) if rendered else [])
        documents = [o if isinstance(o, Skipped) else next(tokenized) for o in outcomes]
        if failure is not None:
            raise with_skip_remedy(failure)
        return documents

    def _convert(self, where: str, value: dict | DataError) -> tuple[UnpairedExample, ...] | DataError:
        """A record's examples: one of an unpaired record, (chosen, rejected) of a pair; or its problem."""
        if isinstance(value, DataError):
            return value
        try:
            if not self.paired:
                return (to_unpaired_example(value, self.spec, where),)
            pair = to_preference_pair(value, self.spec, where)
        except DataError as error:
            return error
        return (
            UnpairedExample(pair.context, pair.chosen, True, pair.tools),
            UnpairedExample(pair.context, pair.rejected, False, pair.tools),
        )

    def _name(self, where: str, side: int) -> str:
        return f"{where}, {SIDES[side]}" if self.paired else where

    def _render_example(
        self, index: int, examples: Callable[[int], tuple[str, tuple[UnpairedExample, ...] | DataError]]
    ) -> _RenderedExample | Skipped:
        """Check one example and its partner, render its two sequences and locate the reply each trains."""
        record, side = self.example_of(index)
        record_where, own = examples(record)
        if isinstance(own, DataError):
            raise own
        where = self._name(record_where, side)
        if self.paired and own[0].completion == own[1].completion:
            return Skipped(
                "identical_replies",
                f"{where}: the chosen and the rejected reply are the same: a reply both desirable and undesirable "
                "says nothing",
            )
        partner_record, _ = self.example_of(self.partner_of(index))
        partner_where, partner = examples(partner_record)
        if isinstance(partner, DataError):
            if self.on_bad_record != "skip":
                raise partner  # the bad record is the one to name, not the good one it would have served
            # skipped, it serves no one: the next readable record is the partner (this one itself at worst)
            while isinstance(partner, DataError):
                partner_record = (partner_record + 1) % self.num_records
                partner_where, partner = examples(partner_record)
        partner_where = self._name(partner_where, side)
        example, partner_reply = own[side], partner[side].completion
        self.check_tools_rendered(example.tools, [*example.context, example.completion, partner_reply], where)
        sequences = [
            self._render_sequence([*example.context, reply], example.tools, what)
            for reply, what in (
                (example.completion, where),
                (partner_reply, f"{where}: its KL sequence ({partner_where})"),
            )
        ]
        texts, spans = [text for text, _ in sequences], [located for _, located in sequences]
        return _RenderedExample(
            index, where, partner_where, (texts[0], texts[1]), (spans[0], spans[1]), example.desirable
        )

    def _document(
        self, rendered: _RenderedExample, counts: list[int], ids: list[np.ndarray], labels: list[np.ndarray]
    ) -> Document | Skipped:
        """The document of an example whose sequences have `counts` tokens (`ids`, `labels`: empty for a
        sequence over the budget), or why it is skipped."""
        total = sum(counts)
        if total > self.max_tokens:
            message = (
                f"{rendered.where}: {total} tokens (the example {counts[0]} + its KL sequence {counts[1]}) exceed "
                f"{self.budget_name}"
            )
            if self.overlong == "error":
                raise DataError(message)
            return Skipped("overlong", message)
        names = ("reply", f"KL sequence's reply (of its KL partner, {rendered.partner_where})")
        for name, segment_labels in zip(names, labels):
            if not (segment_labels >= 0).any():
                return self._bad_record(DataError(f"{rendered.where}: the {name} has no token to train"))
        return Document(
            doc_id=rendered.index,
            input_ids=np.concatenate(ids),
            labels=np.concatenate(labels),
            segments=(counts[0], counts[1]),
            doc_values={KTO_LABEL: 1.0 if rendered.desirable else 0.0},
        )


# The name of KTO's label among a document's declared values (`Document.doc_values`): 1 desirable, 0 undesirable.
KTO_LABEL = "desirable"


@dataclass(frozen=True)
class _RenderedExample:
    """An example's two sequences rendered by the chat template, waiting to be tokenized with the others of its
    batch."""

    index: int  # example index
    where: str  # "file record i[, chosen|rejected]", for messages
    partner_where: str  # the KL partner's name, for messages
    texts: tuple[str, str]  # the example, its KL sequence
    spans: tuple[list[tuple[int, int]], list[tuple[int, int]]]  # character span of each sequence's trained reply
    desirable: bool
