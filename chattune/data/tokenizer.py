"""A run's tokenizer: from a local directory, or a hub id written `hf:org/name` (a missing local path is
never taken for a hub id, so a typo fails at once instead of trying the network), with a chat template,
which chattune renders every record with."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from chattune.data.formats import HUB_LIKE, HUB_PREFIX, hub_id
from chattune.errors import UserError


class TokenizerError(UserError):
    """A tokenizer that cannot be loaded, or has no chat template."""


NO_TEMPLATE_HELP = ("chattune renders every record with the tokenizer's chat template. Use the tokenizer of a chat "
                    "(instruct) model, or add a template to this one: tokenizer.chat_template = "
                    "open('template.jinja').read(); tokenizer.save_pretrained(DIR)")


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer at `path` (config key tokenizer.path); a TokenizerError that names the path otherwise."""
    name = hub_id(path)
    if name is None and not Path(path).is_dir():
        hint = f" (a hub tokenizer is written {HUB_PREFIX}{path})" if HUB_LIKE.fullmatch(path) else ""
        raise TokenizerError(f"tokenizer.path {path!r} " + ("is not a directory" if Path(path).exists() else "does not exist")
                             + hint)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name or path)
    except (OSError, ValueError) as error:  # a directory without tokenizer files, or a hub id that fails offline
        raise TokenizerError(f"tokenizer.path {path!r} could not be loaded: {type(error).__name__}: {error}") from error
    if not tokenizer.chat_template:
        raise TokenizerError(f"tokenizer.path {path!r}: the tokenizer has no chat template. {NO_TEMPLATE_HELP}")
    return tokenizer
