"""What SFT documents and preference pairs share: records read from a `RecordSource`, rendered with
the tokenizer's chat template and tokenized in one batch, with bad records raised or skipped
(`data.on_bad_record`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from chattune.config.schema import ON_BAD_RECORD
from chattune.data.documents import Document, Skipped, outcomes_by_record, shifted_label_array
from chattune.data.ingest.formats import DataError, SourceSpec
from chattune.data.ingest.records import RecordSource
from chattune.data.templates.chat_template import (
    ChatTemplateError,
    TemplateMarkers,
    probe_template,
    render_conversation,
    trained_spans,
)
from chattune.data.templates.template_choice import KEY, fitting_shipped_templates, shipped_names
from chattune.data.templates.text_encoder import TextBatchEncoder


class TemplateDocuments:
    """What SFT documents and preference pairs share: records of a source, rendered with the tokenizer's
    chat template (`_render`, one record) and tokenized in one batch (`_tokenize`), by global record index.

    A record that cannot be read, converted, rendered or trained on is a DataError, or with
    `on_bad_record="skip"` a counted `Skipped("bad_record")` naming the record and the problem. Reading
    stops at the first error, which is raised after the records before it are tokenized: the error is the
    one reading one by one would report (a record before it may itself be refused when tokenized, e.g. an
    overlong one under `overlong="error"`, which `on_bad_record` does not turn into a skip)."""

    def __init__(
        self,
        source: RecordSource,
        tokenizer: PreTrainedTokenizerBase,
        max_tokens: int,
        overlong: str,
        on_bad_record: str = "error",
        budget_name: str | None = None,
    ):
        if on_bad_record not in ON_BAD_RECORD:
            raise ValueError(f"data.on_bad_record must be one of {ON_BAD_RECORD}, got {on_bad_record!r}")
        self.source = source
        self.tokenizer = tokenizer
        try:
            self.markers: TemplateMarkers = probe_template(tokenizer)
        except ChatTemplateError as error:
            raise ChatTemplateError(f"tokenizer {tokenizer.name_or_path}: {error}") from error
        # Cut long texts after the token that closes earlier replies: harmony's end of turn (<|return|>)
        # closes only the last one, so a text would hardly ever be cut there.
        self._encode = TextBatchEncoder(tokenizer, cut_after=self.markers.end_of_earlier_turn)
        self.max_tokens = max_tokens
        # How messages name the budget: the config key, or under context parallelism the row budget it comes from.
        self.budget_name = budget_name or f"data.max_tokens_per_microbatch={max_tokens}"
        self.overlong = overlong
        self.on_bad_record = on_bad_record

    def __len__(self) -> int:
        return len(self.source)

    def get(self, index: int) -> Document | Skipped:
        return self.get_many([index])[0]

    def get_many(self, indices: Sequence[int]) -> list[Document | Skipped]:
        """The outcomes of the records at `indices`, flat and in order: a record gives one `Skipped` or
        its documents (several pieces of a record that `overlong="split"` cuts)."""
        outcomes: list = []  # per record: what _render prepared for tokenizing, or why it is skipped
        failure: DataError | None = None
        for index, (spec, where, record) in zip(indices, self.source.locate_many(indices)):
            try:
                if isinstance(record, DataError):
                    raise record
                outcomes.append(self._render(index, where, spec, record))
            except DataError as error:
                if self.on_bad_record != "skip":
                    failure = error
                    break
                outcomes.append(Skipped("bad_record", str(error)))
        rendered = [o for o in outcomes if not isinstance(o, Skipped)]
        tokenized = iter(outcomes_by_record(self._tokenize(rendered), len(rendered)) if rendered else [])
        documents = [item for o in outcomes for item in ([o] if isinstance(o, Skipped) else next(tokenized))]
        if failure is not None:
            raise with_skip_remedy(failure)
        return documents

    def _bad_record(self, error: DataError) -> Skipped:
        """A record found unusable while tokenizing: raised, or skipped under on_bad_record="skip"."""
        if self.on_bad_record != "skip":
            raise with_skip_remedy(error)
        return Skipped("bad_record", str(error))

    def check_tools_rendered(self, tools: list | None, messages: list[dict], where: str) -> None:
        """Refuse tools or tool calls that the chat template would silently leave out of the text."""
        uses_calls = any("tool_calls" in m for m in messages)
        if (tools and not self.markers.renders_tools) or (uses_calls and not self.markers.renders_tool_calls):
            raise DataError(
                f"{where}: the record has tools or tool calls, but the tokenizer's chat template does not "
                f"render them (training would silently leave them out): {self._tools_remedy}"
            )

    @functools.cached_property
    def _tools_remedy(self) -> str:
        """A template that renders tools: a shipped one whose special tokens this tokenizer has, else a file."""
        fitting = fitting_shipped_templates(self.tokenizer)
        if fitting:
            return (
                f"set {' or '.join(f'{KEY}={name}' for name in fitting)} (a template chattune ships that renders "
                "them, with special tokens this tokenizer has)"
            )
        return (
            f"set {KEY}=PATH, a template file that renders them (chattune's own, {', '.join(shipped_names())}, "
            "write special tokens this tokenizer does not have)"
        )

    def _render(self, index: int, where: str, spec: SourceSpec, record: dict):
        raise NotImplementedError

    def _tokenize(self, rendered: list) -> list[Document | Skipped]:
        raise NotImplementedError


class TwoSequenceDocuments(TemplateDocuments):
    """Documents of two sequences each, both a context and one reply rendered by the chat template and trained on
    that reply alone (DPO's pairs: chosen, rejected; KTO's examples: the example, its mismatched sequence): how a
    sequence is rendered and located (`_render_sequence`), and how a batch of them is tokenized together
    (`_tokenize`); each subclass makes its own document of a rendered item's two sequences (`_document`)."""

    def _render_sequence(self, messages: list[dict], tools: list | None, where: str) -> tuple[str, list]:
        """The text of `messages` as the chat template renders it and the character spans of its last reply."""
        try:
            text = render_conversation(self.tokenizer, messages, tools)
            return text, trained_spans(text, messages, self.markers, last_turn_only=True)
        except Exception as error:  # the template's own checks (raise_exception) and its failures on odd data
            raise DataError(f"{where}: {type(error).__name__}: {error}") from error

    def _tokenize(self, rendered: list) -> list[Document | Skipped]:
        """Tokenize both sequences of every rendered item (`texts`, `spans`) together; label and check each item."""
        # A sequence over the budget makes its item overlong: only its token count is needed.
        encoded = self._encode(
            [text for r in rendered for text in r.texts],
            [spans for r in rendered for spans in r.spans],
            keep_at_most=self.max_tokens,
        )
        labels = shifted_label_array(encoded.ids, encoded.trainable, encoded.ends)
        ends = encoded.ends.tolist()
        starts, counts = [0, *ends[:-1]], encoded.counts.tolist()
        return [
            self._document(
                r,
                counts[2 * k : 2 * k + 2],
                [encoded.ids[starts[t] : ends[t]] for t in (2 * k, 2 * k + 1)],
                [labels[starts[t] : ends[t]] for t in (2 * k, 2 * k + 1)],
            )
            for k, r in enumerate(rendered)
        ]

    def _document(self, rendered, counts: list[int], ids: list, labels: list) -> Document | Skipped:
        raise NotImplementedError


def with_skip_remedy(error: DataError) -> DataError:
    """A record's error as raised under on_bad_record="error": it names the setting that skips such records."""
    remedy = DataError(f"{error}; with data.on_bad_record=skip such records are skipped (counted and logged)")
    remedy.__cause__ = error
    return remedy
