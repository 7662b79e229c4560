"""Prompts as the policy continues them: a `prompt` record (`chattune.data.ingest.formats.to_prompt_record`) rendered
with the chat template and its generation prompt.

`PromptDocuments` is a prompt source's document source for what reads a recipe's first records before a launch
(`chattune validate`, `chattune inspect`): each prompt's tokens, nothing trained (a policy's completions are made
during training, by `chattune.rl.rollouts`).
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from chattune.data.documents import IGNORE_INDEX, Document, Skipped
from chattune.data.ingest.formats import DataError, PromptRecord, SourceSpec, to_prompt_record
from chattune.data.ingest.records import RecordSource
from chattune.data.templates.chat_template import ChatTemplateError


def prompt_token_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict],
    tools: list[dict] | None = None,
    template_kwargs: dict | None = None,
) -> list[int]:
    """The ids the policy continues: the chat template with its generation prompt (`template_kwargs`: the template's
    own switches, e.g. Qwen3's enable_thinking)."""
    encoded = tokenizer.apply_chat_template(
        messages,
        tools=tools,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        **(template_kwargs or {}),
    )
    return list(encoded["input_ids"])


def rendered_prompt(
    record: dict | DataError,
    spec: SourceSpec,
    where: str,
    tokenizer: PreTrainedTokenizerBase,
    template_kwargs: dict | None = None,
) -> tuple[PromptRecord, list[int]]:
    """A prompt record and its token ids; a DataError naming the record where it cannot be read or rendered."""
    if isinstance(record, DataError):
        raise record
    prompt = to_prompt_record(record, spec, where)
    try:
        return prompt, prompt_token_ids(tokenizer, prompt.messages, prompt.tools, template_kwargs)
    except (ChatTemplateError, ValueError, TypeError) as error:  # the template's own failure on this record
        raise DataError(f"{where}: the chat template cannot render it: {error}") from error


class PromptDocuments:
    """A prompt source's records as documents of their prompt's tokens (nothing trained); a prompt over `max_tokens`
    is a counted `Skipped("overlong")`, a record that cannot be read a DataError (with `on_bad_record="skip"`, a
    `Skipped("bad_record")`)."""

    def __init__(
        self,
        source: RecordSource,
        tokenizer: PreTrainedTokenizerBase,
        max_tokens: int,
        on_bad_record: str = "error",
        budget_name: str | None = None,
    ):
        self.source, self.tokenizer, self.max_tokens, self.on_bad_record = source, tokenizer, max_tokens, on_bad_record
        self.budget_name = budget_name or f"data.max_tokens_per_microbatch={max_tokens}"

    def __len__(self) -> int:
        return len(self.source)

    def get(self, index: int) -> Document | Skipped:
        spec, where, record = self.source.locate(index)
        try:
            _, ids = rendered_prompt(record, spec, where, self.tokenizer)
        except DataError as error:
            if self.on_bad_record != "skip":
                raise
            return Skipped("bad_record", str(error))
        if len(ids) > self.max_tokens:
            return Skipped("overlong", f"{where}: its prompt has {len(ids)} tokens, over {self.budget_name}")
        return Document(doc_id=index, input_ids=ids, labels=[IGNORE_INDEX] * len(ids))
