"""The data layer's shared types: a tokenized, labelled document, a record left out on purpose (and the
closed list of reasons), and the label value that trains nothing.

Labels are shifted per document (labels[i] is the token position i predicts) and the last position of
every document is IGNORE_INDEX: no token is trained to predict across a document boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

IGNORE_INDEX = -100  # a label that trains nothing (torch's cross_entropy default ignore_index)


# Every reason a record can be left out, for SFT and preference data alike. The skip counters are
# `dict.fromkeys(SKIP_REASONS, 0)` on every rank, so ranks all-reduce the same keys whatever their
# share of the data skipped (a counter that grew a key on one rank only aborted the collective).
SKIP_REASONS = ("overlong", "no_trainable_tokens", "identical_replies", "bad_record")
# What is counted of the records over the budget that are kept (`data.overlong` truncate or split): the records
# truncated, the records split, and the pieces of split records left out because they train nothing. The same keys
# on every rank, as the skip counters.
OVERLONG_COUNTS = ("truncated", "split", "split_pieces_left_out")


@dataclass(frozen=True)
class Skipped:
    """A record left out on purpose; counted and logged by whoever consumes the documents (a loader
    worker's counters would never reach the trainer)."""

    reason: str  # one of SKIP_REASONS
    detail: str

    def __post_init__(self) -> None:
        if self.reason not in SKIP_REASONS:
            raise ValueError(f"unknown skip reason {self.reason!r}: add it to SKIP_REASONS")


def outcomes_by_record(outcomes: list[Document | Skipped], num_records: int) -> list[list[Document | Skipped]]:
    """The flat outcomes of `num_records` records (as `get_many` gives them), one list per record: a
    record's outcomes start with a `Skipped` or with its first piece (piece 0), and its later pieces
    (`overlong=split`) follow in order."""
    records: list[list[Document | Skipped]] = []
    for outcome in outcomes:
        if isinstance(outcome, Skipped) or outcome.piece == 0:
            records.append([])
        elif not records:
            raise RuntimeError(f"a later piece of record {outcome.doc_id} came without its first piece")
        records[-1].append(outcome)
    if len(records) != num_records:  # a source broke the contract: fail loudly rather than lose records
        raise RuntimeError(f"{num_records} records gave the outcomes of {len(records)}")
    return records


@dataclass(eq=False)
class Document:
    """A tokenized, labelled record (or piece of one). Its tokens are integer numpy arrays (lists are
    converted to int64): a loader worker hands documents to the trainer by pickling, and an array pickles as
    one block of bytes where a list pickles int by int. From a token cache they are int32 views of its memory
    maps, read only when collated (`chattune.data.token_cache`)."""

    doc_id: int  # the record it comes from
    input_ids: np.ndarray
    labels: np.ndarray  # shifted: labels[i] is the target of position i, IGNORE_INDEX when untrained
    piece: int = 0  # which piece of its record (data.overlong=split cuts a long record into several)
    overlong: str = ""  # "truncated" or "split" on the first piece of a record over the budget
    # On the first piece of a split record: how many of its pieces train nothing and were left out (a piece of
    # prompt alone), and which, in the record's words (counted and logged as skips are).
    pieces_left_out: int = 0
    left_out_detail: str = ""
    # Sequences laid back to back inside the document that must not attend to each other, packed as one
    # unit (DPO: chosen then rejected, so a pair always shares a microbatch). Empty: one sequence.
    segments: tuple[int, ...] = ()
    # Shared prompts (`data.share_prompts`): every segment after the first continues the first segment's first
    # `shared_prefix` tokens (a pair's prompt, computed once): it attends to them and its positions start after
    # them, as if they stood before it. 0: the segments are independent sequences.
    shared_prefix: int = 0
    source: int = 0  # which data source (of a mixture) the record belongs to
    # Values a recipe's data declares, which packing and the token cache carry to its objective without knowing
    # what they mean: per token (an advantage, a weight, a teacher's log-prob: one value per position, the
    # document's length) and per document (KTO's label, a reward pair's margin, a group id). Every document of a
    # batch that has one name has them all.
    token_values: dict[str, np.ndarray] = field(default_factory=dict)
    doc_values: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (isinstance(self.input_ids, np.ndarray) and self.input_ids.dtype in (np.int32, np.int64)):
            self.input_ids = np.asarray(self.input_ids, dtype=np.int64)
        if not (isinstance(self.labels, np.ndarray) and self.labels.dtype in (np.int32, np.int64)):
            self.labels = np.asarray(self.labels, dtype=np.int64)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Document):
            return NotImplemented
        return (
            self._identity() == other._identity()
            and np.array_equal(self.input_ids, other.input_ids)
            and np.array_equal(self.labels, other.labels)
        )

    __hash__ = None  # mutable, compared by value

    def _identity(self) -> tuple:
        """Everything compared but the token arrays."""
        return (
            self.doc_id,
            self.piece,
            self.overlong,
            self.pieces_left_out,
            self.left_out_detail,
            self.segments,
            self.shared_prefix,
            self.source,
            tuple(sorted(self.doc_values.items())),
            tuple(sorted((name, values.tobytes()) for name, values in self.token_values.items())),
        )

    @property
    def segment_lengths(self) -> tuple[int, ...]:
        return self.segments or (len(self.input_ids),)

    @property
    def key(self) -> tuple[int, int]:
        """What identifies the document in a data position (a checkpoint): record and piece."""
        return self.doc_id, self.piece

    def __len__(self) -> int:
        return len(self.input_ids)


def shifted_labels(input_ids: list[int], trainable: list[bool]) -> list[int]:
    """Targets for each position: the next token when that next token is trainable."""
    labels = [tok if keep else IGNORE_INDEX for tok, keep in zip(input_ids[1:], trainable[1:])]
    return labels + [IGNORE_INDEX]


def shifted_label_array(input_ids: np.ndarray, trainable: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """`shifted_labels` of several documents laid back to back (document k ends before index ends[k]):
    the last position of every document predicts nothing, so no label crosses into the next document."""
    labels = np.full(len(input_ids), IGNORE_INDEX, dtype=np.int64)
    labels[:-1] = np.where(trainable[1:], input_ids[1:], IGNORE_INDEX)
    labels[ends[ends > 0] - 1] = IGNORE_INDEX
    return labels
