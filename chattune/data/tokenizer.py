"""A run's tokenizer: from a local directory, or a hub id written `hf:org/name` (`chattune.hub`: a missing
local path is never taken for a hub id, so a typo fails at once instead of trying the network), with a chat
template, which chattune renders every record with."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from chattune.errors import UserError
from chattune.hub import hub_hint, local_directory


class TokenizerError(UserError):
    """A tokenizer that cannot be loaded, or has no chat template."""


NO_TEMPLATE_HELP = ("chattune renders every record with the tokenizer's chat template. Use the tokenizer of a chat "
                    "(instruct) model, or add a template to this one: tokenizer.chat_template = "
                    "open('template.jinja').read(); tokenizer.save_pretrained(DIR)")


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer at `path` (config key tokenizer.path); a TokenizerError that names the path otherwise.
    Collective for a hub id under torch.distributed (`chattune.hub.local_directory`)."""
    directory = local_directory(path, "tokenizer.path")
    if not directory.is_dir():
        raise TokenizerError(f"tokenizer.path {path!r} " + ("is not a directory" if Path(path).exists() else "does not exist")
                             + hub_hint(path, "tokenizer"))
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError) as error:  # a directory without tokenizer files, or a hub id that fails offline
        raise TokenizerError(f"tokenizer.path {path!r} could not be loaded: {type(error).__name__}: {error}") from error
    if not tokenizer.chat_template:
        raise TokenizerError(f"tokenizer.path {path!r}: the tokenizer has no chat template. {NO_TEMPLATE_HELP}")
    return tokenizer


def pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id that pads: empty microbatches hold one token that nothing attends to and nothing trains, so
    any valid id will do (the tokenizer's pad, else its eos, else 0)."""
    return next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)
