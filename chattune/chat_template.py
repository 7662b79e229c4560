"""Assistant-only label masks for any Hugging Face chat template, without `{% generation %}` markers.

The trained token ids are exactly `apply_chat_template(messages, tokenize=True)`: we render the whole
conversation once and tokenize it the way transformers does (`add_special_tokens=False`).

To find what to train, we do not re-render the conversation turn by turn: templates such as Qwen3's
render the last assistant turn differently (an empty think block), so turn-by-turn renderings are not
prefixes of the full one. Instead we probe the template once for two strings:

- the generation prompt (what `add_generation_prompt=True` appends, e.g. `<|im_start|>assistant\\n`),
  which opens every assistant turn and is the prompt the model sees at inference time;
- the end-of-turn token (the first special token the template writes after an assistant reply, e.g.
  `<|im_end|>`, or Phi-3's `<|end|>`, which is not its eos).

Each assistant reply is then the text from the end of its generation prompt to the end of its
end-of-turn token: everything the model must produce at inference (think block and tool calls included),
and nothing of the system/user/tool turns. Tokens whose first character lies in such a span are trained.

For throughput, many rendered conversations are tokenized and masked in one call (`TextBatchEncoder`);
`tokenize_conversation` is the same path for a single conversation.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import jinja2
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment
from transformers import PreTrainedTokenizerBase
from transformers.tokenization_utils_tokenizers import TokenizersBackend

try:  # how transformers renders chat templates (private: checked against apply_chat_template by the tests)
    from transformers.utils.chat_template_utils import (_alias_reasoning_fields, _compile_jinja_template,
                                                        _plain_template_data)
except ImportError:
    _compile_jinja_template = None

_PROBE_USER = "chattune probe question"
_PROBE_REPLY = "chattune probe reply"


class ChatTemplateError(ValueError):
    """The template cannot be used to locate assistant replies, or a conversation does not fit it."""


@dataclass(frozen=True)
class TemplateMarkers:
    generation_prompt: str
    end_of_turn: str
    renders_tools: bool = False  # does the template write a `tools` list into the prompt?
    renders_tool_calls: bool = False  # does it write an assistant message's `tool_calls`?


@dataclass(frozen=True)
class TokenizedConversation:
    input_ids: list[int]
    assistant_mask: list[bool]  # True where the token belongs to an assistant reply (incl. end of turn)


def probe_template(tokenizer: PreTrainedTokenizerBase) -> TemplateMarkers:
    """Find the generation prompt and the end-of-turn token of a tokenizer's chat template."""
    if tokenizer.chat_template is None:
        raise ChatTemplateError("the tokenizer has no chat_template")
    user = [{"role": "user", "content": _PROBE_USER}]
    without_prompt = tokenizer.apply_chat_template(user, tokenize=False)
    with_prompt = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    rendered = tokenizer.apply_chat_template(user + [{"role": "assistant", "content": _PROBE_REPLY}], tokenize=False)
    # Some templates end a conversation with eos unless a generation prompt follows (Phi-3), so the prompt
    # is what follows the common prefix of the two renderings, and a reply must follow the prompt.
    common = 0
    while common < min(len(with_prompt), len(without_prompt)) and with_prompt[common] == without_prompt[common]:
        common += 1
    special = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special and t.content]
    common = _back_off_to_token_boundary(with_prompt, common, special)
    generation_prompt = with_prompt[common:]
    if not generation_prompt.strip() or not rendered.startswith(with_prompt):
        raise ChatTemplateError(
            "the chat template has no generation prompt that an assistant reply follows "
            f"(generation prompt {generation_prompt!r}), so assistant turns cannot be located"
        )

    reply_at = rendered.rfind(_PROBE_REPLY)
    if reply_at < 0:
        raise ChatTemplateError("the chat template does not render the assistant content verbatim")
    after_reply = rendered[reply_at + len(_PROBE_REPLY) :]
    found = [(after_reply.find(s), -len(s), s) for s in special if after_reply.find(s) >= 0]
    if not found:
        raise ChatTemplateError(
            f"no special token follows an assistant reply in the chat template (text after the reply: {after_reply!r}); "
            "cannot tell which end-of-turn token to train"
        )
    end_of_turn = min(found)[2]  # the earliest, longest at a tie
    tool = {"type": "function", "function": {"name": "chattune_probe_tool", "description": "probe",
                                             "parameters": {"type": "object", "properties": {}}}}
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "chattune_probe_call", "arguments": {}}}]}
    return TemplateMarkers(
        generation_prompt=generation_prompt,
        end_of_turn=end_of_turn,
        renders_tools=_renders(tokenizer, user, [tool], "chattune_probe_tool"),
        renders_tool_calls=_renders(tokenizer, user + [call], None, "chattune_probe_call"),
    )


def _renders(tokenizer: PreTrainedTokenizerBase, messages: list[dict], tools: list[dict] | None, needle: str) -> bool:
    """Whether the template writes `needle` (a probe tool or call); a template that rejects them does not."""
    try:
        return needle in tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    except (jinja2.TemplateError, TypeError, ValueError):
        return False


def _back_off_to_token_boundary(text: str, position: int, special_tokens: list[str]) -> int:
    """Move `position` left until no special token of `text` straddles it."""
    moved = True
    while moved:
        moved = False
        for token in special_tokens:
            at = text.find(token, max(0, position - len(token) + 1))
            if 0 <= at < position < at + len(token):
                position, moved = at, True
    return position


def assistant_spans(text: str, messages: list[dict], markers: TemplateMarkers) -> list[tuple[int, int]]:
    """Character spans [start, end) of each assistant reply (with its end-of-turn token) in `text`."""
    assistant_messages = [m for m in messages if m.get("role") == "assistant"]
    headers = text.count(markers.generation_prompt)
    if headers != len(assistant_messages):
        raise ChatTemplateError(
            f"the template rendered {headers} assistant headers {markers.generation_prompt!r} "
            f"for {len(assistant_messages)} assistant messages"
        )
    spans, cursor = [], 0
    for turn, message in enumerate(assistant_messages):
        start = text.index(markers.generation_prompt, cursor) + len(markers.generation_prompt)
        end_at = text.find(markers.end_of_turn, start)
        if end_at < 0:
            raise ChatTemplateError(f"assistant turn {turn} has no end-of-turn token {markers.end_of_turn!r}")
        content = message.get("content")
        # Templates may rewrite the start of a reply (Qwen3 drops the reasoning of earlier turns), but a
        # reply cut short by an end-of-turn token inside it loses its end: check that its last line is there.
        ending = content.strip().splitlines()[-1][-32:] if isinstance(content, str) and content.strip() else ""
        if ending and ending not in text[start:end_at]:
            raise ChatTemplateError(
                f"assistant turn {turn}: the end of its content is not inside the turn the template renders "
                f"(does the content contain {markers.end_of_turn!r}?)"
            )
        spans.append((start, end_at + len(markers.end_of_turn)))
        cursor = spans[-1][1]
    return spans


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict],
    markers: TemplateMarkers,
    tools: list[dict] | None = None,
    last_turn_only: bool = False,
    skip_turns: int = 0,
) -> TokenizedConversation:
    """Render (with `tools`, as `apply_chat_template` would) and tokenize a conversation, marking the
    tokens of assistant replies after the first `skip_turns` ones, or of the last one only.

    One conversation through the same path as the batched ones (`TextBatchEncoder`)."""
    text = render_conversation(tokenizer, messages, tools)
    spans = trained_spans(text, messages, markers, last_turn_only, skip_turns)
    encoded = TextBatchEncoder(tokenizer)([text], [spans])
    return TokenizedConversation(input_ids=encoded.ids.tolist(), assistant_mask=encoded.trainable.tolist())


def render_conversation(tokenizer: PreTrainedTokenizerBase, messages: list[dict], tools: list[dict] | None = None) -> str:
    """The text `apply_chat_template(messages, tools=tools, tokenize=False)` renders, byte for byte.

    Rendered the way transformers renders it (the same compiled template and sandbox, the same plain copies
    of the messages and tools, the same variables), except that the sandbox's attribute checks are memoized
    (`_memoized_template`): they cost a third of the rendering. Where transformers' internals are not
    there to reuse, `apply_chat_template` itself."""
    if _compile_jinja_template is None:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    template = _memoized_template(tokenizer.get_chat_template(None, tools))
    chat = _plain_template_data([{k: v for k, v in m.items() if v is not None} for m in messages])
    return template.render(messages=_alias_reasoning_fields(chat), tools=_plain_template_data(tools), documents=None,
                           add_generation_prompt=False, **_plain_template_data(tokenizer.special_tokens_map))


@functools.lru_cache(maxsize=16)
def _memoized_template(source: str) -> jinja2.Template:
    """transformers' compiled chat template, in an overlay of its sandboxed environment (same filters,
    globals, extensions) whose verdicts on attribute safety are kept per (type of object, attribute name):
    jinja's sandbox decides from those two alone, yet re-decides on every `message.content.strip` of every
    conversation."""
    environment = _compile_jinja_template(source).environment
    overlay = environment.overlay()
    if type(environment).is_safe_attribute is ImmutableSandboxedEnvironment.is_safe_attribute:
        overlay.is_safe_attribute = _memoized_verdicts(overlay.is_safe_attribute)
    return overlay.from_string(source)


def _memoized_verdicts(is_safe_attribute: Callable[[object, str, object], bool]) -> Callable[[object, str, object], bool]:
    verdicts: dict[tuple[type, str], bool] = {}

    def memoized(obj: object, attr: str, value: object) -> bool:
        key = (type(obj), attr)
        verdict = verdicts.get(key)
        if verdict is None:
            verdict = is_safe_attribute(obj, attr, value)
            if len(verdicts) < 10_000:  # attribute names come from the template: a few dozen
                verdicts[key] = verdict
        return verdict

    return memoized


def trained_spans(text: str, messages: list[dict], markers: TemplateMarkers, last_turn_only: bool = False,
                  skip_turns: int = 0) -> list[tuple[int, int]]:
    """The assistant spans to train: those after the first `skip_turns` replies, or the last one only."""
    spans = assistant_spans(text, messages, markers)[skip_turns:]
    return spans[-1:] if last_turn_only else spans


@dataclass(frozen=True)
class EncodedTexts:
    """Several texts tokenized back to back: flat arrays over all their tokens."""

    ids: np.ndarray  # int64 token ids
    trainable: np.ndarray  # bool: the token's first character lies in one of its own text's spans
    lengths: np.ndarray  # int64 tokens per text in these arrays (0 for a text over `keep_at_most`)
    counts: np.ndarray  # int64 tokens per text

    @property
    def ends(self) -> np.ndarray:
        """Index one past each text's last token in the flat arrays."""
        return np.cumsum(self.lengths)


class TextBatchEncoder:
    """`tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)`, as flat numpy arrays, with
    the tokens whose first character lies in given character spans marked trainable.

    A stock fast tokenizer is called through its Rust backend, configured exactly as transformers'
    `_encode_plus` configures it (no truncation, no padding, its `split_special_tokens`): transformers'
    per-text conversion of each encoding into Python dicts and lists costs more than the tokenization of a
    short chat. Nor are the offsets of every token converted to Python (a third of the tokenizer's cost
    again): the tokens of a span are found from its two bounds alone (`_first_token_at_or_after`).
    Any other tokenizer goes through its own `__call__` and a search over all its offsets."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        stock = isinstance(tokenizer, TokenizersBackend) and type(tokenizer)._encode_plus is TokenizersBackend._encode_plus
        self._backend = tokenizer.backend_tokenizer if stock else None

    def __call__(self, texts: list[str], spans: list[list[tuple[int, int]]] | None = None,
                 keep_at_most: int | None = None) -> EncodedTexts:
        """Tokenize `texts`, marking the tokens in `spans[k]` of text k (none without `spans`); texts of
        more than `keep_at_most` tokens are only counted (they will be dropped: converting their tokens to
        arrays would be wasted work)."""
        spans = spans if spans is not None else [[] for _ in texts]
        if self._backend is not None:
            encodings = self._encode_with_backend(texts)
            counts = [len(e) for e in encodings]
            kept = [keep_at_most is None or n <= keep_at_most for n in counts]
            ids = [e.ids if keep else [] for e, keep in zip(encodings, kept)]
            ranges = [[(_first_token_at_or_after(e, start), _first_token_at_or_after(e, end)) for start, end in text_spans]
                      if keep else [] for e, keep, text_spans in zip(encodings, kept, spans)]
            lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
            trainable = _mask_of_ranges(ranges, lengths)
        else:
            out = self.tokenizer(list(texts), add_special_tokens=False, return_offsets_mapping=True)
            counts = [len(i) for i in out["input_ids"]]
            kept = [keep_at_most is None or n <= keep_at_most for n in counts]
            ids = [i if keep else [] for i, keep in zip(out["input_ids"], kept)]
            lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
            starts = [start for offsets, keep in zip(out["offset_mapping"], kept) if keep for start, _ in offsets]
            trainable = _mask_of_starts(np.array(starts, dtype=np.int64), lengths, spans)
        return EncodedTexts(
            ids=np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=int(lengths.sum())),
            trainable=trainable,
            lengths=lengths,
            counts=np.array(counts, dtype=np.int64),
        )

    def _encode_with_backend(self, texts: list[str]) -> list:
        backend = self._backend
        if backend.truncation is not None:
            backend.no_truncation()
        if backend.padding is not None:
            backend.no_padding()
        if backend.encode_special_tokens != self.tokenizer.split_special_tokens:
            backend.encode_special_tokens = self.tokenizer.split_special_tokens
        return backend.encode_batch(texts, add_special_tokens=False)


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
    flat = np.array([(offset + first, offset + end) for offset, text_ranges in zip(offsets, ranges)
                     for first, end in text_ranges if end > first], dtype=np.int64).reshape(-1, 2)
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
    bounds = np.array([(start + k * _TEXT_STRIDE, end + k * _TEXT_STRIDE)
                       for k, text_spans in enumerate(spans) for start, end in text_spans], dtype=np.int64).reshape(-1, 2)
    # The span that starts at or before each token's first character, if the token starts inside it.
    span = np.searchsorted(bounds[:, 0], positions, side="right") - 1
    inside = positions < bounds[np.maximum(span, 0), 1] if len(bounds) else np.zeros(len(positions), dtype=bool)
    return (span >= 0) & inside


_TEXT_STRIDE = 1 << 40  # more characters than any one text has
