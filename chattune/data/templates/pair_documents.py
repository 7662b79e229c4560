"""DPO data: preference pairs of local JSON/JSONL/Parquet files (the `preference` and `sharegpt_preference`
formats of `chattune.data.ingest.formats`), into one shifted-label document per pair.

A pair's document is its chosen sequence then its rejected sequence, back to back (`Document.segments`
gives their lengths, so they are packed as one unit and never attend to each other). Each side is the
context and that side's reply rendered by the chat template exactly as `apply_chat_template` renders it;
its trained tokens are exactly its final assistant reply (as the template renders it after the generation
prompt, e.g. Qwen3's empty think block) and the end-of-turn token. Labels are shifted within each side,
and the last position of each side predicts nothing.

Errors name the file, the record index and the problem, as in `chattune.data.templates.sft_documents`. What is skipped rather
than fatal is counted by whoever consumes the documents: a pair whose two replies are identical (nothing
to prefer) and a pair longer than the microbatch budget (chosen + rejected tokens: both sides must go into
the same microbatch).

A reward model's pairs (`RewardPairDocuments`) also read a pair's margin, as TRL's RewardTrainer does: the record's
`margin` field, a finite JSON number (the document's declared value `margin`; the reward loss is -log σ(r_chosen - r_rejected - margin)).
A record without the field, or with `"margin": null`, has none and trains at margin 0. DPO's pairs ignore the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from numbers import Real

import numpy as np
from transformers import PreTrainedTokenizerBase

from chattune.config.schema import OVERLONG_DPO
from chattune.data.documents import Document, Skipped
from chattune.data.ingest.formats import PREFERENCE_FORMATS, DataError, PreferencePair, SourceSpec, to_preference_pair
from chattune.data.ingest.records import RecordSource
from chattune.data.templates.template_documents import TwoSequenceDocuments


class PairDocuments(TwoSequenceDocuments):
    """Tokenized, label-masked preference pairs by global record index: one `Document` per pair, or why
    the pair is `Skipped`.

    overlong, for a pair of more tokens (chosen + rejected) than `max_tokens`: `drop` (a counted skip) or
    `error`. Pairs are never cut: a truncated reply would be compared on text the model never finishes."""

    def __init__(
        self,
        source: RecordSource,
        tokenizer: PreTrainedTokenizerBase,
        max_tokens: int,
        overlong: str = "drop",
        on_bad_record: str = "error",
        budget_name: str | None = None,
        share_prompts: bool = False,
    ):
        if overlong not in OVERLONG_DPO:
            raise ValueError(f"data.overlong must be one of {OVERLONG_DPO} for preference data, got {overlong!r}")
        not_pairs = [s.path for s in source.specs if s.format not in PREFERENCE_FORMATS]
        if not_pairs:
            raise DataError(f"{not_pairs}: DPO needs preference data (format one of {list(PREFERENCE_FORMATS)})")
        super().__init__(source, tokenizer, max_tokens, overlong, on_bad_record, budget_name)
        self.share_prompts = share_prompts

    def _render(self, index: int, where: str, spec: SourceSpec, record: dict) -> _RenderedPair | Skipped:
        """Convert and check one pair, render its two sides and locate the reply each trains."""
        pair: PreferencePair = to_preference_pair(record, spec, where)
        if pair.chosen == pair.rejected:
            return Skipped(
                "identical_replies", f"{where}: the chosen and the rejected reply are the same, nothing to prefer"
            )
        self.check_tools_rendered(pair.tools, [*pair.context, pair.chosen, pair.rejected], where)
        chosen, rejected = (
            self._render_sequence([*pair.context, side], pair.tools, where) for side in (pair.chosen, pair.rejected)
        )
        return _RenderedPair(index, where, (chosen[0], rejected[0]), (chosen[1], rejected[1]))

    def _document(
        self, rendered: _RenderedPair, counts: list[int], ids: list[np.ndarray], labels: list[np.ndarray]
    ) -> Document | Skipped:
        """The document of a pair whose sides have `counts` tokens (`ids`, `labels`: empty for a side over
        the budget), or why it is skipped."""
        shared = shared_prompt(ids, labels) if self.share_prompts and max(counts) <= self.max_tokens else 0
        total = sum(counts) - shared
        if total > self.max_tokens:
            prompt = f" - their shared prompt {shared}" if shared else ""
            message = (
                f"{rendered.where}: {total} tokens (chosen {counts[0]} + rejected {counts[1]}{prompt}) exceed "
                f"{self.budget_name}"
            )
            if self.overlong == "error":
                raise DataError(message)
            return Skipped("overlong", message)
        for name, side_labels in zip(("chosen", "rejected"), labels):
            if not (side_labels >= 0).any():
                return self._bad_record(DataError(f"{rendered.where}: the {name} reply has no token to train"))
        return Document(
            doc_id=rendered.index,
            input_ids=np.concatenate([ids[0], ids[1][shared:]]),
            labels=np.concatenate([labels[0], labels[1][shared:]]),
            segments=(counts[0], counts[1] - shared),
            shared_prefix=shared,
            doc_values={PAIR_MARGIN: rendered.margin} if rendered.margin is not None else {},
        )


def shared_prompt(ids: list[np.ndarray], labels: list[np.ndarray]) -> int:
    """The tokens the two sides of a pair can share (data.share_prompts): their common first tokens, up to the first
    position either trains (which predicts a token of its own side's reply). The prompt's last token is that
    position, so each side keeps it and the shared part is the prompt less its last token. 0: nothing to share."""
    common = min(len(ids[0]), len(ids[1]))
    differ = np.flatnonzero(ids[0][:common] != ids[1][:common])
    first_trained = min(int(np.argmax(side >= 0)) for side in labels)  # (each side trains some token: checked)
    return min(int(differ[0]) if len(differ) else common, first_trained)


class RewardPairDocuments(PairDocuments):
    """Preference pairs for a reward model: DPO's documents, each with its pair's margin (its declared value `margin`, `Document.doc_values`), read
    from the record's `margin` field as TRL's RewardTrainer reads its `margin` column. A record without the field,
    or whose field is null (a table column where only some records give one), has no margin: the pair trains at
    margin 0. A margin that is not a finite number (a string, a boolean, NaN, an infinity) is a bad record: a
    DataError naming the file, the record, the field and the value, or a counted skip under
    data.on_bad_record=skip."""

    def _render(self, index: int, where: str, spec: SourceSpec, record: dict) -> _RenderedPair | Skipped:
        margin = pair_margin(record, where)
        rendered = super()._render(index, where, spec, record)
        # (every pair declares one, so that a batch's pairs all have it: 0 where the record gives none)
        return rendered if isinstance(rendered, Skipped) else replace(rendered, margin=margin or 0.0)


MARGIN_FIELD = "margin"  # TRL's RewardTrainer reads a pair's margin from this column
PAIR_MARGIN = "margin"  # its name among a document's declared values (`Document.doc_values`)


def pair_margin(record: dict, where: str) -> float | None:
    """The record's margin: its `margin` field as a float, None where the record has no such field or it is null.
    A JSON boolean is refused (Python counts it a number: `true` would train at margin 1), and so is a number that
    is not finite (Python's JSON reader accepts NaN and Infinity)."""
    value = record.get(MARGIN_FIELD)
    if value is None:
        return None
    if isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    raise DataError(
        f"{where}: {MARGIN_FIELD!r} must be a finite number (the pair's reward margin), got {value!r} "
        f"({type(value).__name__})"
    )


@dataclass(frozen=True)
class _RenderedPair:
    """A pair's two sides rendered by the chat template, waiting to be tokenized with the others of its batch."""

    index: int  # global record index
    where: str  # "file record i", for messages
    texts: tuple[str, str]  # chosen, rejected
    spans: tuple[list[tuple[int, int]], list[tuple[int, int]]]  # character span of each side's trained reply
    margin: float | None = None  # a reward pair's margin (`RewardPairDocuments`); None for DPO's and a pair without
