"""A GRPO completion as packed documents: the prompt (untrained) then the sampled tokens (trained, each at the
position before it), with the completion's advantage and the sampler's log-probs declared on the trained positions
(`chattune.objectives.policy_gradient`). With data.share_prompts a group's completions continue one copy of their
prompt in one document, as many as fit a row."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from chattune.data.documents import IGNORE_INDEX, Document
from chattune.objectives.policy_gradient import ADVANTAGE, BEHAVIOUR_LOGP
from chattune.rl.sampling import Sampled


def completion_document(doc_id: int, prompt_ids: list[int], sample: Sampled, advantage: float) -> Document:
    """A completion as a packed document: the prompt then the sampled tokens, the sampled tokens trained (the
    position before each predicts it), with its advantage and each sampled token's behaviour log-prob declared at
    the position that predicts that token."""
    return group_documents(prompt_ids, [(doc_id, sample, advantage)], budget=None)[0]


def group_documents(
    prompt_ids: list[int], completions: Sequence[tuple[int, Sampled, float]], budget: int | None
) -> list[Document]:
    """A group's completions (doc id, sample, advantage) of one prompt as documents whose replies share one copy of
    the prompt (data.share_prompts): [prompt + reply 1][reply 2]...[reply k], each later segment continuing the
    prompt, as many completions in a document as fit `budget` tokens (None: all), in order. What is shared is the
    prompt less its last token: that token predicts each reply's first token, so every reply keeps its own copy (the
    unshared layout's labels at the same positions). A document of one completion is the plain [prompt + reply]."""
    shared = len(prompt_ids) - 1
    documents, chunk, size = [], [], 0
    for completion in completions:
        reply = 1 + len(completion[1].token_ids)  # (the prompt's last token, then the sampled ones)
        if chunk and budget is not None and size + reply > budget:
            documents.append(_shared_document(prompt_ids, chunk))
            chunk, size = [], 0
        chunk.append(completion)
        size += reply if len(chunk) > 1 else shared + reply
    if chunk:
        documents.append(_shared_document(prompt_ids, chunk))
    return documents


def _shared_document(prompt_ids: list[int], completions: Sequence[tuple[int, Sampled, float]]) -> Document:
    """[prompt + reply 1][prompt's last token + reply 2]...: one document, its first completion's doc id."""
    shared = len(prompt_ids) - 1
    ids: list[int] = []
    labels, behaviour, advantage, segments = [], [], [], []
    for number, (_, sample, value) in enumerate(completions):
        context = prompt_ids if number == 0 else prompt_ids[shared:]
        tokens = sample.token_ids
        ids += [*context, *tokens]
        # the context's last position predicts the first sampled token; the last sampled token predicts nothing
        untrained = len(context) - 1
        labels += [IGNORE_INDEX] * untrained + list(tokens) + [IGNORE_INDEX]
        behaviour += [0.0] * untrained + list(sample.behaviour_logp) + [0.0]
        advantage += [0.0] * untrained + [float(value)] * len(tokens) + [0.0]
        segments.append(len(context) + len(tokens))
    return Document(
        doc_id=completions[0][0],
        input_ids=np.asarray(ids, dtype=np.int64),
        labels=np.asarray(labels, dtype=np.int64),
        token_values={
            BEHAVIOUR_LOGP: np.asarray(behaviour, dtype=np.float32),
            ADVANTAGE: np.asarray(advantage, dtype=np.float32),
        },
        segments=tuple(segments) if len(completions) > 1 else (),
        shared_prefix=shared if len(completions) > 1 else 0,
    )
