"""Many texts tokenized in one call, as flat numpy arrays, with the tokens of given character spans marked.

The token ids are exactly `tokenizer(text, add_special_tokens=False)["input_ids"]` of each text, and a
token is marked when its first character lies in one of its text's spans (what `chattune.data.templates.chat_template`
trains). Three costs of the plain `tokenizer(...)` call are avoided, none of them by approximating:

- a stock fast tokenizer is called through its Rust backend: transformers' per-text conversion of each
  encoding into Python dicts and lists costs more than the tokenization of a short chat;
- the offsets of every token are not converted to Python (a third of the tokenizer's cost again): the
  tokens of a span are found from its two bounds alone (`_first_token_at_or_after`);
- when only a text's first tokens matter (a conversation over the budget is truncated or dropped), a long
  text is tokenized only up to a special token that the tokenizer always splits on (`_cut_point`). A fast
  tokenizer splits its input at added tokens before anything else and tokenizes the pieces apart, so the
  tokens of such a prefix are exactly the first tokens of the whole text.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
from transformers import PreTrainedTokenizerBase
from transformers.tokenization_utils_tokenizers import TokenizersBackend

# A text is cut only where this many characters per token would still leave more tokens than needed: real
# text has 1 to 5 (a cut text that falls short is tokenized again whole, so this is a cost, not a risk).
CUT_CHARS_PER_TOKEN = 6


@dataclass(frozen=True)
class EncodedTexts:
    """Several texts tokenized back to back: flat arrays over all their tokens."""

    ids: np.ndarray  # int64 token ids
    trainable: np.ndarray  # bool: the token's first character lies in one of its own text's spans
    lengths: np.ndarray  # int64 tokens per text in these arrays (0 for a text over `keep_at_most`)
    counts: np.ndarray  # int64 tokens per text (of its prefix, for a text that was cut)
    cut: np.ndarray  # bool: only a prefix of the text was tokenized (it has more than `needed` tokens)

    @property
    def ends(self) -> np.ndarray:
        """Index one past each text's last token in the flat arrays."""
        return np.cumsum(self.lengths)


class TextBatchEncoder:
    """`tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)` with span masks; see the
    module docstring. `cut_after`: a special token after which a text may be cut (the chat template's
    end of turn); it is used only where cutting there is exact for this tokenizer (`_cuts_exactly`)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, cut_after: str | None = None):
        self.tokenizer = tokenizer
        stock = (
            isinstance(tokenizer, TokenizersBackend) and type(tokenizer)._encode_plus is TokenizersBackend._encode_plus
        )
        self._backend = tokenizer.backend_tokenizer if stock else None
        self.cut_after = cut_after if self._backend is not None and _cuts_exactly(tokenizer, cut_after) else None

    def __call__(
        self,
        texts: list[str],
        spans: list[list[tuple[int, int]]] | None = None,
        keep_at_most: int | None = None,
        needed: int | None = None,
    ) -> EncodedTexts:
        """Tokenize `texts`, marking the tokens in `spans[k]` of text k (none without `spans`).

        keep_at_most: texts of more tokens are only counted (they will be dropped: converting their tokens
        to arrays would be wasted work). needed: only a text's first `needed` tokens, and whether it has
        more, matter: a long text may be tokenized only up to a cut point past them."""
        spans = spans if spans is not None else [[] for _ in texts]
        if self._backend is None:
            return self._encode_generic(texts, spans, keep_at_most)
        prefixes = [self._prefix(text, needed) for text in texts]
        encodings = self._encode_with_backend(prefixes)
        short = [
            k
            for k, (prefix, text) in enumerate(zip(prefixes, texts))
            if len(prefix) < len(text) and len(encodings[k]) <= needed
        ]
        if short:  # a cut text without enough tokens before its cut: tokenized whole after all
            for k, encoding in zip(short, self._encode_with_backend([texts[k] for k in short])):
                prefixes[k], encodings[k] = texts[k], encoding
        counts = [len(e) for e in encodings]
        kept = [keep_at_most is None or n <= keep_at_most for n in counts]
        ids = [e.ids if keep else [] for e, keep in zip(encodings, kept)]
        ranges = [
            [(_first_token_at_or_after(e, start), _first_token_at_or_after(e, end)) for start, end in text_spans]
            if keep
            else []
            for e, keep, text_spans in zip(encodings, kept, spans)
        ]
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        return EncodedTexts(
            ids=np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=int(lengths.sum())),
            trainable=_mask_of_ranges(ranges, lengths),
            lengths=lengths,
            counts=np.array(counts, dtype=np.int64),
            cut=np.array([len(prefix) < len(text) for prefix, text in zip(prefixes, texts)], dtype=bool),
        )

    def _prefix(self, text: str, needed: int | None) -> str:
        """The text up to the first cut point far enough in to hold more than `needed` tokens, or all of it."""
        if needed is None or self.cut_after is None or len(text) <= needed * CUT_CHARS_PER_TOKEN:
            return text
        at = text.find(self.cut_after, needed * CUT_CHARS_PER_TOKEN)
        return text if at < 0 else text[: at + len(self.cut_after)]

    def _encode_with_backend(self, texts: list[str]) -> list:
        """The Rust backend's encodings, configured exactly as transformers' `_encode_plus` configures it
        (no truncation, no padding, the tokenizer's `split_special_tokens`)."""
        backend = self._backend
        if backend.truncation is not None:
            backend.no_truncation()
        if backend.padding is not None:
            backend.no_padding()
        if backend.encode_special_tokens != self.tokenizer.split_special_tokens:
            backend.encode_special_tokens = self.tokenizer.split_special_tokens
        return backend.encode_batch(texts, add_special_tokens=False)

    def _encode_generic(
        self, texts: list[str], spans: list[list[tuple[int, int]]], keep_at_most: int | None
    ) -> EncodedTexts:
        """Any tokenizer, through its own `__call__` and a search over all its offsets (never cut)."""
        out = self.tokenizer(list(texts), add_special_tokens=False, return_offsets_mapping=True)
        counts = [len(i) for i in out["input_ids"]]
        kept = [keep_at_most is None or n <= keep_at_most for n in counts]
        ids = [i if keep else [] for i, keep in zip(out["input_ids"], kept)]
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        starts = [start for offsets, keep in zip(out["offset_mapping"], kept) if keep for start, _ in offsets]
        return EncodedTexts(
            ids=np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=int(lengths.sum())),
            trainable=_mask_of_starts(np.array(starts, dtype=np.int64), lengths, spans),
            lengths=lengths,
            counts=np.array(counts, dtype=np.int64),
            cut=np.zeros(len(texts), dtype=bool),
        )


def _cuts_exactly(tokenizer: PreTrainedTokenizerBase, token: str | None) -> bool:
    """Whether a text cut right after `token` tokenizes to exactly the first tokens of the whole text.

    True when the fast tokenizer splits every text at `token` before normalizing or pre-tokenizing it: an
    added token, matched in the raw text (not `normalized`, unless there is no normalizer), wherever it
    stands (not `single_word`, whose match depends on the character after it), with special tokens not
    split (`split_special_tokens`), and no other added token that could claim part of it (one containing
    it, or overlapping it)."""
    if token is None or tokenizer.split_special_tokens:
        return False
    added = {t.content: t for t in tokenizer.added_tokens_decoder.values()}
    entry = added.get(token)
    if entry is None or entry.single_word:
        return False
    if entry.normalized and tokenizer.backend_tokenizer.normalizer is not None:
        return False
    for other in added:
        if other == token:
            continue
        if token in other or any(
            other.endswith(token[:k]) or other.startswith(token[-k:]) for k in range(1, min(len(other), len(token)))
        ):
            return False
    return True


def _first_token_at_or_after(encoding, position: int) -> int:
    """The index of the first token of a Rust `Encoding` whose first character is at or after `position`
    (the number of tokens if none is). Token starts never decrease along an encoding, so that is where
    `position` would be inserted into the sorted starts: the token holding the character at `position`
    (`char_to_token`, the first such token) is a guess within a token or two of it, corrected by walking;
    a position no token holds (past the end, or a character the normalizer removed) is binary-searched."""
    count = len(encoding)
    guess = encoding.char_to_token(position)
    if guess is None:
        low, high = 0, count
        while low < high:
            middle = (low + high) // 2
            if encoding.token_to_chars(middle)[0] < position:
                low = middle + 1
            else:
                high = middle
        return low
    while guess > 0 and encoding.token_to_chars(guess - 1)[0] >= position:
        guess -= 1
    while guess < count and encoding.token_to_chars(guess)[0] < position:
        guess += 1
    return guess


def _mask_of_ranges(ranges: list[list[tuple[int, int]]], lengths: np.ndarray) -> np.ndarray:
    """A flat mask over all texts' tokens (text k has lengths[k]), True inside each text's token ranges."""
    offsets = (np.cumsum(lengths) - lengths).tolist()  # where each text's tokens begin
    flat = np.array(
        [
            (offset + first, offset + end)
            for offset, text_ranges in zip(offsets, ranges)
            for first, end in text_ranges
            if end > first
        ],
        dtype=np.int64,
    ).reshape(-1, 2)
    # +1 where a range opens, -1 where it closes: the running sum is positive inside a range.
    change = np.zeros(int(lengths.sum()) + 1, dtype=np.int64)
    np.add.at(change, flat[:, 0], 1)
    np.add.at(change, flat[:, 1], -1)
    return np.cumsum(change[:-1]) > 0


def _mask_of_starts(starts: np.ndarray, lengths: np.ndarray, spans: list[list[tuple[int, int]]]) -> np.ndarray:
    """True for each token whose first character (`starts`, in its own text) lies in one of its own text's
    `spans`, for any order of token starts.

    All texts at once: text k's offsets (token starts and span bounds alike) are moved by k * _TEXT_STRIDE,
    so one sorted array of span starts serves every text and no span reaches into another text."""
    text_of_token = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    positions = starts + text_of_token * _TEXT_STRIDE
    bounds = np.array(
        [
            (start + k * _TEXT_STRIDE, end + k * _TEXT_STRIDE)
            for k, text_spans in enumerate(spans)
            for start, end in text_spans
        ],
        dtype=np.int64,
    ).reshape(-1, 2)
    # The span that starts at or before each token's first character, if the token starts inside it.
    span = np.searchsorted(bounds[:, 0], positions, side="right") - 1
    inside = positions < bounds[np.maximum(span, 0), 1] if len(bounds) else np.zeros(len(positions), dtype=bool)
    return (span >= 0) & inside


_TEXT_STRIDE = 1 << 40  # more characters than any one text has
