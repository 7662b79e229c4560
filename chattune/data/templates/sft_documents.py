"""SFT documents: conversations (any format of `chattune.data.ingest.formats`) rendered with the chat template
into shifted-label documents, trained on the assistant replies (`data.train_on`).

Errors name the file, the record index and the problem. What is skipped rather than fatal is counted
and logged: a conversation with no trainable token, and one longer than the microbatch budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from transformers import PreTrainedTokenizerBase

from chattune.config.schema import OVERLONG, TRAIN_ON
from chattune.data.documents import IGNORE_INDEX, Document, Skipped, shifted_label_array
from chattune.data.ingest.formats import DataError, SourceSpec, to_conversation
from chattune.data.ingest.records import RecordSource
from chattune.data.templates.chat_template import render_conversation, trained_spans
from chattune.data.templates.template_documents import TemplateDocuments


class SFTDocuments(TemplateDocuments):
    """Tokenized, label-masked documents by global record index.

    train_on: `assistant` (every assistant reply and its end-of-turn token), `last_assistant` (only the
    final reply), or `all` (every token, prompts included).

    overlong, for a record of more tokens than the budget: `drop` (a counted skip), `truncate` (keep its
    first max_tokens tokens), `split` (cut it into pieces of up to max_tokens tokens, each its own
    document: a piece does not attend to the pieces before it, and the first token of each later piece is
    not trained, as nothing before it in the piece predicts it), or `error`. Truncated and split records are
    marked on their first document (`Document.overlong`) so the stream can count them; pieces with
    nothing to train are left out, and their number and which they are noted on the first piece
    (`Document.pieces_left_out`, `left_out_detail`) for the stream and the data report to count and log.
    `get` gives the first piece of a split record, `get_many` all its pieces in order."""

    def __init__(
        self,
        source: RecordSource,
        tokenizer: PreTrainedTokenizerBase,
        max_tokens: int,
        overlong: str = "drop",
        train_on: str = "assistant",
        on_bad_record: str = "error",
        budget_name: str | None = None,
    ):
        if overlong not in OVERLONG:
            raise ValueError(f"data.overlong must be one of {OVERLONG}, got {overlong!r}")
        if train_on not in TRAIN_ON:
            raise ValueError(f"data.train_on must be one of {TRAIN_ON}, got {train_on!r}")
        super().__init__(source, tokenizer, max_tokens, overlong, on_bad_record, budget_name)
        self.train_on = train_on

    def _render(self, index: int, where: str, spec: SourceSpec, record: dict) -> _Rendered:
        """Convert, check and render one record, and locate the assistant replies it trains."""
        conversation = to_conversation(record, spec, where)
        self.check_tools_rendered(conversation.tools, conversation.messages, where)
        try:
            text = render_conversation(self.tokenizer, conversation.messages, conversation.tools)
            spans = trained_spans(
                text,
                conversation.messages,
                self.markers,
                last_turn_only=self.train_on == "last_assistant",
                skip_turns=conversation.prompt_replies,
            )
        except Exception as error:  # the template's own checks (raise_exception) and its failures on odd data
            raise DataError(f"{where}: {type(error).__name__}: {error}") from error
        return _Rendered(index, where, text, spans)

    def _tokenize(self, rendered: list[_Rendered]) -> list[Document | Skipped]:
        """Tokenize the rendered texts together; label and check each document."""
        # Dropped records need only their token count: converting their tokens would be wasted work. And when
        # they are dropped or truncated, a record's tokens past the budget are never used: a long one need
        # not be tokenized whole (its count is then a lower bound; an error reports the exact one).
        keep_at_most = self.max_tokens if self.overlong in ("drop", "error") else None
        needed = self.max_tokens if self.overlong in ("drop", "truncate") else None
        everything = self.train_on == "all"
        encoded = self._encode(
            [r.text for r in rendered],
            None if everything else [r.spans for r in rendered],
            keep_at_most=keep_at_most,
            needed=needed,
        )
        trainable = np.ones(len(encoded.ids), dtype=bool) if everything else encoded.trainable
        labels = shifted_label_array(encoded.ids, trainable, encoded.ends)
        ends = encoded.ends.tolist()
        documents: list[Document | Skipped] = []
        for r, count, cut, start, end in zip(
            rendered, encoded.counts.tolist(), encoded.cut.tolist(), [0, *ends[:-1]], ends
        ):
            documents += self._documents(r, count, cut, encoded.ids[start:end], labels[start:end])
        return documents

    def _documents(
        self, rendered: _Rendered, count: int, cut: bool, ids: np.ndarray, labels: np.ndarray
    ) -> list[Document | Skipped]:
        """The document(s) of a record of `count` tokens (at least, if `cut`: only its beginning was
        tokenized; `ids`, `labels`: empty when it will be dropped), or why it is skipped."""
        message = f"{rendered.where}: {'at least ' if cut else ''}{count} tokens exceed {self.budget_name}"
        if count > self.max_tokens and self.overlong == "error":
            raise DataError(message)
        if count > self.max_tokens and self.overlong == "drop":
            return [Skipped("overlong", message)]
        if not (labels >= 0).any():
            return [
                Skipped("no_trainable_tokens", f"{rendered.where}: no token to train with train_on={self.train_on}")
            ]
        if count <= self.max_tokens:
            return [Document(doc_id=rendered.index, input_ids=ids, labels=labels)]
        cuts = range(0, count if self.overlong == "split" else 1, self.max_tokens)
        pieces, left_out = [], []
        for number, start in enumerate(cuts, 1):
            piece_labels = labels[start : start + self.max_tokens].copy()
            piece_labels[-1] = IGNORE_INDEX  # its target is the first token of the next piece, not in this one
            if not (piece_labels >= 0).any():
                left_out.append(f"{number} (tokens {start}-{min(start + self.max_tokens, count) - 1})")
                continue
            pieces.append(
                Document(
                    doc_id=rendered.index,
                    input_ids=ids[start : start + self.max_tokens],
                    labels=piece_labels,
                    piece=len(pieces),
                )
            )
        if not pieces:
            return [Skipped("no_trainable_tokens", f"{message}, and its first {self.max_tokens} tokens train nothing")]
        pieces[0].overlong = "truncated" if self.overlong == "truncate" else "split"
        if self.overlong == "split" and left_out:
            pieces[0].pieces_left_out = len(left_out)
            pieces[0].left_out_detail = (
                f"{message}: split into {len(cuts)} pieces; piece{'s' if len(left_out) > 1 else ''} "
                f"{', '.join(left_out)} train{'' if len(left_out) > 1 else 's'} nothing and "
                f"{'are' if len(left_out) > 1 else 'is'} left out"
            )
        return pieces


@dataclass(frozen=True)
class _Rendered:
    """A record rendered by the chat template, waiting to be tokenized with the others of its batch."""

    index: int  # global record index
    where: str  # "file record i", for messages
    text: str
    spans: list[tuple[int, int]]  # character spans of the assistant replies to train
