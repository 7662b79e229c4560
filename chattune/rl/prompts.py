"""The prompts a policy is trained on: records of the `prompt` format (`chattune.data.ingest.formats`) behind one
index, and the order the run takes them in.

The run's prompts form one stream: epoch e is a permutation of every prompt, seeded by the run's seed and e, and the
stream is the epochs back to back. Rollout r takes the stream's places r·P .. (r+1)·P - 1 (P = rollout.prompts_per_step),
data-parallel rank d of D the P/D of them from r·P + d·P/D. Where a step's prompts come from is a function of the
step, the seed and the number of prompts alone: a resumed run takes the prompts the uninterrupted run took with no
position to save, and each place's completions are drawn from an RNG seeded by the place
(`chattune.rl.sampling.sample_group`), not by the rank that draws them.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import numpy as np
from transformers import PreTrainedTokenizerBase

from chattune.data.documents import Skipped
from chattune.data.ingest.formats import DataError, PromptRecord, SourceSpec
from chattune.data.ingest.records import RecordSource
from chattune.data.templates.prompt_documents import rendered_prompt

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prompt:
    """A prompt ready to sample: its record (messages, tools, fields), its token ids and where it comes from."""

    record: PromptRecord
    ids: list[int]
    where: str


class PromptSource:
    """The prompts of `specs` (each of the `prompt` format) by global index, read and tokenized when asked for. A
    record that cannot be read or rendered is a DataError naming it, or with `on_bad_record="skip"` a counted
    `Skipped("bad_record")`."""

    def __init__(
        self,
        specs: list[SourceSpec],
        tokenizer: PreTrainedTokenizerBase,
        template_kwargs: dict | None = None,
        on_bad_record: str = "error",
    ):
        for spec in specs:
            if spec.format != "prompt":
                raise DataError(
                    f"{spec.path}: format {spec.format!r}; the GRPO recipe samples prompts: give its sources "
                    "format: prompt (records of {prompt} or {messages}, with the fields its rewards read)"
                )
        self.records = RecordSource(specs)
        self.tokenizer, self.template_kwargs, self.on_bad_record = tokenizer, dict(template_kwargs or {}), on_bad_record

    def __len__(self) -> int:
        return len(self.records)

    def get(self, index: int) -> Prompt | Skipped:
        spec, where, record = self.records.locate(index)
        try:
            prompt, ids = rendered_prompt(record, spec, where, self.tokenizer, self.template_kwargs)
        except DataError as error:
            if self.on_bad_record != "skip":
                raise
            logger.warning("skipped %s (data.on_bad_record=skip)", error)
            return Skipped("bad_record", str(error))
        return Prompt(prompt, ids, where)


@dataclass(frozen=True)
class PromptOrder:
    """The run's prompt stream (the module docstring): `size` prompts, each epoch a permutation seeded by `seed`."""

    size: int
    seed: int

    def at(self, place: int) -> tuple[int, int]:
        """(epoch, prompt index) of the stream's place `place`."""
        epoch, offset = divmod(place, self.size)
        return epoch, int(_permutation(self.seed, epoch, self.size)[offset])


@functools.lru_cache(maxsize=4)  # a run reads one epoch at a time, two across an epoch's end
def _permutation(seed: int, epoch: int, size: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(size)


def place_seed(seed: int, place: int) -> int:
    """The sampling RNG's seed for the prompt at the stream's place `place`: the same on any number of ranks."""
    return (seed * 1_000_003 + place * 7_919 + 17) % 2**63
