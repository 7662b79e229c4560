"""The automatic held-out split (`data.eval_split`): records of the training sources kept out of training and
evaluated instead.

How many: a fraction f in (0, 1) holds out f x N records, rounded half up, of each training source of N records (at least
one); a count C >= 1 holds out C records in all, shared by the sources in proportion to their sizes (largest
remainder; a tie goes to the earlier source). Every source keeps at least one record to train.

Which: a source's held-out records are those with the smallest keys, where record i (numbered from 0 in its
source) of the k-th training source (numbered from 0 in `data.train`) has the key

    key = mix(mix(mix(seed) + k) + i)        (unsigned 64-bit arithmetic, wrapping)

and mix is SplitMix64's output function (`mix64`). The keys depend on the seed, the source's place and the
record's number alone: not on the number of ranks, loader workers, the token cache or a resume, so every rank
and every launch of a run holds out the same records. A larger split holds out a superset of a smaller one.

The split is two views of each source (`RecordSubset`): its kept records, which are all training ever reads
(every epoch, any mixture, world-size-invariant steps: samplers and packing only see these), and its held-out
records, added to the eval sources.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from chattune.config.schema import is_eval_split
from chattune.data.documents import Document, Skipped, outcomes_by_record
from chattune.data.ingest.sources import MixedDocuments
from chattune.data.stream import DocumentSource, documents_of
from chattune.errors import UserError

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MULTIPLIERS = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function of each uint64 in `x` (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MULTIPLIERS[0]
        z = (z ^ (z >> np.uint64(27))) * _MULTIPLIERS[1]
        return z ^ (z >> np.uint64(31))


def record_keys(num_records: int, seed: int, source: int) -> np.ndarray:
    """The key of every record of the `source`-th training source (see the module docstring)."""
    with np.errstate(over="ignore"):
        base = mix64(mix64(np.array([seed % 2**64], dtype=np.uint64)) + np.uint64(source))
        return mix64(base + np.arange(num_records, dtype=np.uint64))


def held_out_records(num_records: int, count: int, seed: int, source: int) -> np.ndarray:
    """The `count` record numbers of a source that are held out, ascending."""
    order = np.argsort(record_keys(num_records, seed, source), kind="stable")
    return np.sort(order[:count])


def held_out_counts(sizes: Sequence[int], eval_split: float | int | None) -> list[int]:
    """How many records of each source (of `sizes` records) `data.eval_split` holds out."""
    if eval_split is None:
        return [0] * len(sizes)
    if isinstance(eval_split, float):
        return [max(1, int(eval_split * size + 0.5)) for size in sizes]
    total = sum(sizes)
    counts = [eval_split * size // total for size in sizes]
    remainders = [eval_split * size % total for size in sizes]
    for source in sorted(range(len(sizes)), key=lambda k: -remainders[k])[: eval_split - sum(counts)]:
        counts[source] += 1
    return counts


def split_problem(names: Sequence[str], sizes: Sequence[int], eval_split) -> str | None:
    """Why `data.eval_split` cannot split sources `names` of `sizes` records (one line naming the key), or None."""
    if eval_split is None:
        return None
    if isinstance(eval_split, bool) or not is_eval_split(eval_split):
        return (
            f"data.eval_split: must be a fraction in (0, 1) or a whole number of records of at least 1 "
            f"(null: none held out), got {eval_split!r}"
        )
    total = sum(sizes)
    if isinstance(eval_split, int) and eval_split >= total:
        return (
            f"data.eval_split: {eval_split} records held out, but data.train holds {total}: nothing would be left "
            f"to train; hold out fewer (or a fraction, e.g. 0.02)"
        )
    for name, size, count in zip(names, sizes, held_out_counts(sizes, eval_split)):
        if count >= size:
            return (
                f"data.eval_split: {eval_split} holds out all {size} record(s) of training source {name}: nothing "
                f"of it would be left to train; hold out a smaller fraction"
            )
    return None


class RecordSubset:
    """Some records of a document source, addressed 0..len-1 in record order: a document's doc_id is its
    record's place here (what a data position, the reference cache and the ledger index), and `record(i)`
    is that record's number in the source."""

    def __init__(self, documents: DocumentSource, records: np.ndarray):
        self.documents, self.records = documents, np.asarray(records, dtype=np.int64)

    @property
    def cached(self) -> bool:
        return getattr(self.documents, "cached", False)

    def __len__(self) -> int:
        return len(self.records)

    def record(self, index: int) -> int:
        return int(self.records[index])

    def get(self, index: int) -> Document | Skipped:
        return self.get_many([index])[0]

    def get_many(self, indices: Sequence[int]) -> list[Document | Skipped]:
        got = documents_of(self.documents, [int(self.records[i]) for i in indices])
        return [
            replace(item, doc_id=index) if isinstance(item, Document) else item
            for index, outcomes in zip(indices, outcomes_by_record(got, len(indices)))
            for item in outcomes
        ]


@dataclass
class HeldOutSplit:
    train: MixedDocuments  # the kept records of every training source: all training reads
    held_out: MixedDocuments | None  # the held-out records of the sources that give some (None: no split)
    counts: list[int]  # held out of each training source
    sizes: list[int]  # each training source's records before the split
    records: list[np.ndarray]  # the record numbers held out of each training source (ascending; empty: none)


def hold_out(train: MixedDocuments, eval_split, seed: int) -> HeldOutSplit:
    """`train` split by `data.eval_split` (None: not split). A UserError naming data.eval_split where it cannot."""
    if eval_split is None:
        none = np.zeros(0, dtype=np.int64)
        return HeldOutSplit(train, None, [0] * len(train.sizes), list(train.sizes), [none] * len(train.sizes))
    # Records, not documents, are held out: a record that gives several documents (KTO's two examples of a preference
    # pair) goes whole to one side, so no prompt is both trained on and held out.
    groups = train.examples_per_record
    sizes = [len(documents) // group for documents, group in zip(train.sources, groups)]
    problem = split_problem(train.names, sizes, eval_split)
    if problem is not None:
        raise UserError(problem)
    kept, held, records = [], [], []
    counts = held_out_counts(sizes, eval_split)
    for source, (name, documents, count) in enumerate(zip(train.names, train.sources, counts)):
        group = groups[source]
        out = held_out_records(sizes[source], count, seed, source)
        held_documents = (group * out[:, None] + np.arange(group)).reshape(-1)
        kept.append((name, RecordSubset(documents, np.setdiff1d(np.arange(len(documents)), held_documents))))
        records.append(out)
        if count:
            held.append((f"{name} (held out)", RecordSubset(documents, held_documents)))
    return HeldOutSplit(MixedDocuments(kept), MixedDocuments(held), counts, sizes, records)


def held_out_line(split: HeldOutSplit, eval_split) -> str:
    """What the split holds out, for the data report and `chattune inspect`."""
    return f"held out for eval (data.eval_split={eval_split}): " + "; ".join(
        f"{name} {count} of {size} records" for name, count, size in zip(split.train.names, split.counts, split.sizes)
    )


def joined(*parts: MixedDocuments | None) -> MixedDocuments | None:
    """The sources of several MixedDocuments behind one record index (None where there are none)."""
    sources = [
        (name, documents) for part in parts if part is not None for name, documents in zip(part.names, part.sources)
    ]
    return MixedDocuments(sources) if sources else None
