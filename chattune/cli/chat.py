"""`chattune chat DIR`: talk to a trained model in the terminal, or answer a file of prompts.

DIR is what a run exports: a Hugging Face directory (`output_dir/hf`), or a peft adapter directory
(`output_dir/adapter`) run over the base its adapter_config.json names (a local directory, or a hub
repository; `--base` names another). Each turn is rendered with the tokenizer's chat template and its
generation prompt, answered by transformers' `generate` (greedy at temperature 0, else sampled), and read
up to the template's end-of-turn token (`chattune.model.generate`).

- On a terminal (or with lines on stdin): one conversation, turn by turn; `/reset` starts it over, `/quit`
  (or Ctrl-D) ends it.
- `--prompts FILE`: each prompt answered on its own (`chattune.data.templates.prompts` reads the file: JSONL of
  {"messages": [...]} or {"prompt": "text"}, else one prompt a line), one JSON line per prompt,
  {"prompt": [messages], "reply": text, "finished": bool}, to stdout or `--out FILE`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from chattune.errors import UserError
from chattune.hub import HUB_LIKE, HUB_PREFIX

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedTokenizerBase

    from chattune.data.templates.prompts import Prompt
    from chattune.model.generate import Reply, Sampling

ADAPTER_CONFIG = "adapter_config.json"
RESET, QUIT = "/reset", ("/quit", "/exit")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "directory",
        metavar="DIR",
        type=Path,
        help="an exported model directory (output_dir/hf) or adapter directory (output_dir/adapter)",
    )
    parser.add_argument(
        "--base",
        default=None,
        help="the base model of an adapter directory (default: the one its adapter_config.json names)",
    )
    parser.add_argument(
        "--prompts",
        type=Path,
        default=None,
        help="answer the prompts of this file (JSONL of {messages} or {prompt}, else one a line) and exit",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="with --prompts: write the JSONL replies here (default: stdout)"
    )
    parser.add_argument("--system", default=None, help="a system message to open every conversation that has none")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="the longest reply, in tokens (default: 256)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; above 0: sampled")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's probability mass (default: 1.0)")
    parser.add_argument(
        "--top-k", type=int, default=0, help="sample among the K most probable tokens (0, default: all)"
    )
    parser.add_argument(
        "--min-p", type=float, default=0.0, help="drop tokens under this share of the most probable one's (default: 0)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds sampling (default: 0)")
    parser.add_argument(
        "--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto (default): CUDA where there is one"
    )


def run_chat(args: argparse.Namespace, stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise UserError(f"--temperature must be >= 0 and --top-p in (0, 1], got {args.temperature} and {args.top_p}")
    if args.top_k < 0 or not 0 <= args.min_p < 1:
        raise UserError(f"--top-k must be >= 0 and --min-p in [0, 1), got {args.top_k} and {args.min_p}")
    if args.out is not None and args.prompts is None:
        raise UserError("--out writes the replies to --prompts: give the prompts file too")
    from chattune.data.templates.prompts import read_prompts_file

    prompts = (
        read_prompts_file(args.prompts) if args.prompts is not None else None
    )  # a bad file fails before the model loads
    import torch

    from chattune.model.generate import Sampling, stop_token_ids

    model, tokenizer = load_chat_model(args.directory, args.base, args.device)
    stop_ids = stop_token_ids(tokenizer)
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p, args.top_k, args.min_p)
    torch.manual_seed(args.seed)
    chat = Chat(model, tokenizer, sampling, stop_ids)
    if prompts is not None:
        return answer_prompts(chat, prompts, args.system, args.out, stdout)
    return converse(chat, args.system, stdin, stdout, interactive=stdin.isatty(), name=str(args.directory))


class Chat:
    """A loaded model answering conversations."""

    def __init__(self, model: nn.Module, tokenizer: PreTrainedTokenizerBase, sampling: Sampling, stop_ids: list[int]):
        self.model, self.tokenizer, self.sampling, self.stop_ids = model, tokenizer, sampling, stop_ids

    def reply(self, messages: list[dict], tools: list[dict] | None = None) -> Reply:
        import torch

        from chattune.model.generate import generate_reply, prompt_ids

        with torch.no_grad():
            return generate_reply(
                self.model, self.tokenizer, prompt_ids(self.tokenizer, messages, tools), self.sampling, self.stop_ids
            )


def answer_prompts(chat: Chat, prompts: list[Prompt], system: str | None, out: Path | None, stdout: TextIO) -> int:
    """Each prompt answered on its own, one JSON line each: to stdout as they come, or `out`, written whole at
    the end (through a temporary file: an earlier file there is replaced at once, never half-written)."""
    lines = []
    for prompt in prompts:
        prompt = prompt.with_system(system)
        reply = chat.reply(prompt.messages, prompt.tools)
        line = json.dumps({"prompt": prompt.messages, "reply": reply.text, "finished": reply.finished})
        if out is None:
            print(line, file=stdout, flush=True)
        lines.append(line + "\n")
    if out is not None:
        from chattune.files import write_atomically

        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(out, "".join(lines).encode())
        print(f"wrote {len(lines)} replies to {out}", file=stdout)
    return 0


def converse(chat: Chat, system: str | None, stdin: TextIO, stdout: TextIO, interactive: bool, name: str) -> int:
    """One conversation, a line of `stdin` per user turn; `/reset` starts over, `/quit` or the end of input ends."""
    opening = [{"role": "system", "content": system}] if system else []
    messages = list(opening)
    if interactive:
        print(f"chatting with {name}: {RESET} starts over, {QUIT[0]} or Ctrl-D ends", file=stdout)
    while True:
        if interactive:
            print("you> ", end="", file=stdout, flush=True)
        try:
            line = stdin.readline()
        except KeyboardInterrupt:
            line = ""
        if not line:  # end of input (Ctrl-D)
            if interactive:
                print(file=stdout)
            return 0
        text = line.strip()
        if not text:
            continue
        if text in QUIT:
            return 0
        if text == RESET:
            messages = list(opening)
            print("(a new conversation)", file=stdout, flush=True)
            continue
        messages.append({"role": "user", "content": text})
        try:
            reply = chat.reply(messages)
        except KeyboardInterrupt:  # Ctrl-C stops the reply in progress, not the chat
            messages.pop()
            print("\n(interrupted)", file=stdout, flush=True)
            continue
        messages.append({"role": "assistant", "content": reply.text})
        cut = "" if reply.finished else f"  [cut at --max-new-tokens={chat.sampling.max_new_tokens}]"
        print(("model> " if interactive else "") + reply.text.strip() + cut, file=stdout, flush=True)


def run_export(directory: Path) -> Path:
    """A run's output_dir stands for what it exported: its `hf/` (the merged model), else its `adapter/`; any
    other directory is taken as it is."""
    if (directory / ADAPTER_CONFIG).is_file() or (directory / "config.json").is_file():
        return directory
    for export in ("hf", "adapter"):
        if (directory / export / "config.json").is_file() or (directory / export / ADAPTER_CONFIG).is_file():
            print(f"chattune chat: {directory} is a run's output directory: its {export}/", file=sys.stderr)
            return directory / export
    return directory


def load_chat_model(directory: Path, base: str | None, device: str) -> tuple[nn.Module, PreTrainedTokenizerBase]:
    """(the model in eval mode on `device`, its tokenizer) from an exported model directory, or an adapter
    directory over its base; a UserError that names the directory and the problem otherwise."""
    if not directory.is_dir():
        raise UserError(
            f"{directory} "
            + ("is not a directory" if directory.exists() else "does not exist")
            + ": give an exported model directory (output_dir/hf) or adapter directory (output_dir/adapter)"
        )
    directory = run_export(directory)
    adapter = (directory / ADAPTER_CONFIG).is_file()
    if not adapter and not (directory / "config.json").is_file():
        raise UserError(
            f"{directory} holds neither config.json (a Hugging Face model directory, such as output_dir/hf) "
            f"nor {ADAPTER_CONFIG} (a peft adapter directory, such as output_dir/adapter)"
        )
    _refuse_a_scorer(directory, adapter)
    import torch

    tokenizer = _load_tokenizer(directory)
    model_dir = _adapter_base(directory, base) if adapter else directory
    resolved = "cuda" if device == "auto" and torch.cuda.is_available() else "cpu" if device == "auto" else device
    if resolved == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda, but torch finds no CUDA device on this machine: use --device auto or cpu")
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # a bar per loaded file: noise before the first prompt
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    except (OSError, ValueError) as error:
        raise UserError(
            f"{model_dir} could not be loaded as a causal language model: {type(error).__name__}: "
            f"{str(error).splitlines()[0]}"
        ) from error
    if adapter:
        import warnings

        from peft import PeftModel

        try:
            with warnings.catch_warnings():  # peft reads transformers' deprecated `is_gradient_checkpointing`
                warnings.filterwarnings(
                    "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
                )
                model = PeftModel.from_pretrained(model, directory)
        except (OSError, ValueError, RuntimeError, KeyError) as error:
            raise UserError(
                f"the adapter {directory} does not fit the base model {model_dir}: {type(error).__name__}: "
                f"{str(error).splitlines()[0]}"
            ) from error
    return model.to(resolved).eval(), tokenizer


def _refuse_a_scorer(directory: Path, adapter: bool) -> None:
    """A reward model (a sequence-classification export, or a peft adapter of task type SEQ_CLS) scores and writes
    no reply; transformers would load its decoder under a fresh output layer and answer noise."""
    try:
        if adapter:
            scorer = json.loads((directory / ADAPTER_CONFIG).read_text()).get("task_type") == "SEQ_CLS"
            what = f"a reward model's adapter ({ADAPTER_CONFIG}: task_type SEQ_CLS)"
            loads = (
                "PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(BASE, num_labels=1), DIR)"
            )
        else:
            classes = json.loads((directory / "config.json").read_text()).get("architectures") or []
            scorer = any(name.endswith("ForSequenceClassification") for name in classes)
            what = f"a reward model ({', '.join(classes)}: a score head)"
            loads = "AutoModelForSequenceClassification.from_pretrained(DIR)"
    except (OSError, ValueError, AttributeError):
        return  # not readable as chattune writes it: loading says what is wrong
    if scorer:
        raise UserError(
            f"{directory} is {what}: it scores a conversation and writes no reply, so there is nothing to chat "
            f"with. Score conversations with {loads} (docs/reward.md); chat with an SFT, DPO or KTO run's export"
        )


def _load_tokenizer(directory: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError) as error:
        raise UserError(
            f"{directory}: its tokenizer could not be loaded ({type(error).__name__}: "
            f"{str(error).splitlines()[0]}); a run's export holds the tokenizer it trained with"
        ) from error
    if not tokenizer.chat_template:
        raise UserError(
            f"{directory}: the tokenizer has no chat template, which chattune chat renders each "
            "conversation with. Add one (tokenizer.chat_template = open('template.jinja').read(); "
            "tokenizer.save_pretrained(DIR)), or chat with a chat (instruct) model"
        )
    return tokenizer


def _adapter_base(directory: Path, base: str | None) -> Path:
    """The local directory of an adapter's base model: `base`, else what adapter_config.json names (a local
    directory, or a hub repository `org/name` at its `revision`, from the Hugging Face cache or downloaded)."""
    from chattune.hub import local_directory

    if base is not None:
        path = local_directory(base, "--base")
        if not (path / "config.json").is_file():
            raise UserError(
                f"--base {base} "
                + (
                    "has no config.json: not a Hugging Face model directory"
                    if path.is_dir()
                    else "is not a local directory"
                )
            )
        return path
    config = json.loads((directory / ADAPTER_CONFIG).read_text())
    named, revision = config.get("base_model_name_or_path"), config.get("revision")
    key = f"{directory / ADAPTER_CONFIG}'s base_model_name_or_path"
    remedy = "give the base with --base DIR"
    if not named:
        raise UserError(
            f"the adapter {directory} names no base model: its run built the base from model.config "
            "(random weights, saved nowhere). Chat with the run's merged export (export.merge=true "
            f"writes output_dir/hf), or {remedy}"
        )
    path = Path(named)
    if not path.exists() and HUB_LIKE.fullmatch(named):  # chattune writes a hub base as org/name (and a revision)
        try:
            path = local_directory(f"{HUB_PREFIX}{named}" + (f"@{revision}" if revision else ""), key)
        except UserError as error:
            raise UserError(
                f"the base model {named} ({key}) is not a directory here (a relative path is read from "
                f"where you run chattune chat), nor a hub repository found: {error}. Or {remedy}"
            ) from None
    if not (path / "config.json").is_file():
        what = "has no config.json" if path.is_dir() else "does not exist"
        raise UserError(
            f"the base model {named} ({key}) {what} (a relative path is read from where you run chattune "
            f"chat): {remedy}"
        )
    return path
