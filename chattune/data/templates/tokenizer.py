"""A run's tokenizer (the config's `tokenizer` section): from a local directory, or a hub id written
`hf:org/name` (`chattune.hub`: a missing local path is never taken for a hub id, so a typo fails at once
instead of trying the network), with the chat template chattune renders every record with: the tokenizer's
own, or the one `tokenizer.chat_template` names (`chattune.data.templates.template_choice`), which then becomes the
tokenizer's template everywhere (the token cache key, the export's `hf/` and `adapter/`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from chattune.data.templates.template_choice import (
    KEY,
    ChatTemplateSettingError,
    fitting_shipped_templates,
    missing_markers,
    read_chat_template,
)
from chattune.errors import UserError
from chattune.hub import hub_hint, local_directory

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from chattune.config.schema import TokenizerConfig


class TokenizerError(UserError):
    """A tokenizer that cannot be loaded, or has no chat template."""


NO_TEMPLATE_HELP = (
    "chattune renders every record with a chat template. Use the tokenizer of a chat (instruct) "
    f"model, or give one with {KEY}: a template chattune ships (chatml, llama3), a file, or "
    "inline Jinja"
)


def load_tokenizer(settings: DictConfig | TokenizerConfig) -> PreTrainedTokenizerBase:
    """The tokenizer a config's `tokenizer` section describes (`path`, and `chat_template`, null: the tokenizer's
    own), or a TokenizerError / ChatTemplateSettingError that names the key. Collective for a hub id under
    torch.distributed (`chattune.hub.local_directory`)."""
    path, chat_template = settings.path, getattr(settings, "chat_template", None)
    directory = local_directory(path, "tokenizer.path")
    if not directory.is_dir():
        raise TokenizerError(
            f"tokenizer.path {path!r} "
            + ("is not a directory" if Path(path).exists() else "does not exist")
            + hub_hint(path, "tokenizer")
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError) as error:  # a directory without tokenizer files, or a hub id that fails offline
        raise TokenizerError(f"tokenizer.path {path!r} could not be loaded: {type(error).__name__}: {error}") from error
    if chat_template is not None:
        tokenizer.chat_template = usable_template(tokenizer, chat_template, path)
    if not tokenizer.chat_template:
        raise TokenizerError(f"tokenizer.path {path!r}: the tokenizer has no chat template. {NO_TEMPLATE_HELP}")
    return tokenizer


def usable_template(tokenizer: PreTrainedTokenizerBase, setting: str, path: str) -> str:
    """The text of the template `setting` names, once it compiles and every `<|...|>` marker it writes is one
    token of the tokenizer at `path`."""
    from jinja2 import TemplateError

    try:  # how transformers compiles a template (its extensions included); a private name, so not relied on
        from transformers.utils.chat_template_utils import _compile_jinja_template as compile_template
    except ImportError:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        compile_template = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).from_string

    chosen = read_chat_template(setting)
    try:
        compile_template(chosen.text)
    except TemplateError as error:
        line = f" (line {error.lineno})" if getattr(error, "lineno", None) else ""
        raise ChatTemplateSettingError(f"{chosen.label} is not valid Jinja{line}: {error}") from error
    missing = missing_markers(tokenizer, chosen.text)
    if missing:
        fitting = [name for name in fitting_shipped_templates(tokenizer) if name != setting]
        raise ChatTemplateSettingError(
            f"{chosen.label} writes {', '.join(missing)}, which the tokenizer at tokenizer.path {path!r} does not have "
            "as tokens: each would be split into pieces of ordinary text, and the model would learn its turn "
            "boundaries as text. Choose a template whose special tokens this tokenizer has: "
            + (f"{' or '.join(f'{KEY}={name}' for name in fitting)}, or " if fitting else "")
            + f"the tokenizer's own ({KEY}=null)"
        )
    return chosen.text


def pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id that pads: empty microbatches hold one token that nothing attends to and nothing trains, so
    any valid id will do (the tokenizer's pad, else its eos, else 0)."""
    return next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)
