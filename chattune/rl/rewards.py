"""Reward functions: what scores the policy's completions, chosen in the config by `_target_` with a weight.

    reward:
      functions:
        - {_target_: chattune.rl.rewards.answer_check, weight: 1.0, mode: numeric}
        - {_target_: chattune.rl.rewards.format_check, weight: 0.2, pattern: '\\d+'}

Each entry is made with Hydra's `instantiate` as a partial (its keys but `_target_`, `weight` and `name` are its
arguments) and called once per rollout on a rank's completions, by keyword:

    fn(prompts=[messages, ...], completions=[text, ...], completion_ids=[[id, ...], ...], **fields) -> [float, ...]

`fields` are the prompt records' other fields, each a list with one value per completion (a record's `answer` is
`answer=[...]`; a field a record lacks is None there), as TRL's reward functions receive them. A function returns one
number per completion; one that raises, returns NaN, None or the wrong count stops the run with one error naming the
function, the record and the value (`reward.on_error=skip`: that prompt's group is left out of the step, counted and
logged). The completion's reward is the weighted sum of its functions' values.

Shipped: `answer_check` (exact, numeric, and math through math-verify, an optional extra), `format_check` (a regular
expression, or the tags a reply must be made of), `length_penalty` (DAPO's soft overlong punishment) and
`reward_model` (a reward model exported by `recipes/reward.py`, or any HF sequence classifier with one label).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from chattune.errors import UserError

logger = logging.getLogger(__name__)

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+")
ANSWER_MODES = ("exact", "numeric", "math")


class RewardError(UserError):
    """A reward function that failed or returned something that is no reward, named with its record."""


@dataclass(frozen=True)
class RewardFunction:
    """One configured reward: its name in metrics (`reward/NAME`), its weight in the sum and the callable."""

    name: str
    weight: float
    fn: Callable[..., Sequence[float | None]]


@dataclass(frozen=True)
class Scores:
    """A rollout's rewards: each completion's weighted sum (`total`), each function's values by name (`parts`),
    and the completions left out for a failed reward (`failed`: indices, with reward.on_error=skip)."""

    total: list[float]
    parts: dict[str, list[float]]
    failed: set[int]


PASSED = ("prompts", "completions", "completion_ids")  # what every call passes by keyword
ENTRY_KEYS = ("_target_", "weight", "name")  # an entry's own keys, not the function's arguments


def entry_problem(entry: object) -> str | None:
    """Why a `reward.functions` entry cannot be made (None: it can): no `_target_`, a target that cannot be imported
    or is not callable, a weight that is no number, or a key that is no named parameter of the function (a typo
    would otherwise reach it as a record field, unseen)."""
    if not isinstance(entry, Mapping):
        return f"a reward function is a mapping {{_target_, weight, ...}}, got {entry!r}"
    target = entry.get("_target_")
    if not isinstance(target, str):
        return "no _target_: the reward function's dotted path (e.g. chattune.rl.rewards.answer_check)"
    weight = entry.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
        return f"weight must be a number, got {weight!r}"
    module_name, _, attribute = target.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError, ValueError) as error:
        return f"cannot import {target!r}: {error}"
    if not callable(fn):
        return f"{target} is not callable"
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: taken as it is
        return None
    missing = [name for name in PASSED if name not in parameters and not _takes_any(parameters)]
    if missing:
        return f"{target} takes no {', '.join(missing)}: a reward function is called with {', '.join(PASSED)}"
    named = {name for name, p in parameters.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    unknown = [key for key in entry if key not in ENTRY_KEYS and not str(key).startswith("_") and key not in named]
    if unknown:
        return (
            f"{', '.join(map(str, unknown))}: not a parameter of {target} (its parameters: {', '.join(sorted(named))})"
        )
    for key in PASSED:
        if key in entry:
            return f"{key} is passed by the recipe; remove it from the entry"
    return None


def _takes_any(parameters: Mapping[str, inspect.Parameter]) -> bool:
    return any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def reward_functions(entries: Sequence[Mapping], required: bool = True) -> list[RewardFunction]:
    """The configured functions (`reward.functions`), each made as a partial of its `_target_` (its keys but
    `_target_`, `weight` and `name` its arguments); names are the entry's `name`, else the target's last part
    (numbered where two would share one). A RewardError for an entry that cannot be made (`entry_problem`), and for
    none where the loss learns from rewards (`required`; on-policy distillation learns from its teacher)."""
    from hydra.utils import instantiate

    made, seen = [], {}
    for index, entry in enumerate(entries):
        problem = entry_problem(entry)
        if problem is not None:
            raise RewardError(f"reward.functions[{index}]: {problem}")
        entry = dict(entry)
        weight, name = float(entry.pop("weight", 1.0)), entry.pop("name", None)
        fn = instantiate({**entry, "_partial_": True})
        name = str(name or entry["_target_"].rsplit(".", 1)[-1])
        seen[name] = seen.get(name, 0) + 1
        made.append(RewardFunction(name if seen[name] == 1 else f"{name}_{seen[name]}", weight, fn))
    if not made and required:
        raise RewardError("reward.functions: no reward function: the policy would learn nothing")
    return made


def score(
    functions: Sequence[RewardFunction],
    prompts: list[list[dict]],
    completions: list[str],
    completion_ids: list[list[int]],
    records: list[dict],
    where: list[str],
    on_error: str = "error",
) -> Scores:
    """The rewards of a rollout's completions (`records`: each completion's prompt record's fields; `where`: each
    one's record named for messages). A function that raises, returns the wrong count, or a value that is None, NaN
    or not a number raises a RewardError naming the function, the record and the value; with `on_error="skip"`
    those completions are `failed` instead (logged), their values 0."""
    count = len(completions)
    names = sorted({name for record in records for name in record})
    fields = {name: [record.get(name) for record in records] for name in names}
    parts: dict[str, list[float]] = {}
    failed: set[int] = set()
    for function in functions:
        values: list[float] = [0.0] * count
        try:
            returned = list(
                function.fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **fields)
            )
        except Exception as error:  # the user's code: one error naming it and the records it was given
            problem = f"raised {type(error).__name__}: {error}"
            _fail(function, problem, where[0] if count == 1 else f"{where[0]} .. {where[-1]}", on_error)
            failed.update(range(count))
            parts[function.name] = values
            continue
        if len(returned) != count:
            _fail(function, f"returned {len(returned)} values for {count} completions", where[0], on_error)
            failed.update(range(count))
            parts[function.name] = values
            continue
        for index, value in enumerate(returned):
            number = _reward_value(value)
            if number is None:
                _fail(
                    function,
                    f"returned {value!r} for completion {index} ({completions[index]!r})",
                    where[index],
                    on_error,
                )
                failed.add(index)
            else:
                values[index] = number
        parts[function.name] = values
    total = [sum(f.weight * parts[f.name][i] for f in functions) for i in range(count)]
    return Scores(total, parts, failed)


def _reward_value(value: object) -> float | None:
    """A function's value as a float, or None where it is no reward (None, NaN, infinite, not a number). A numpy or
    torch scalar is read as its number."""
    if hasattr(value, "item") and not isinstance(value, (bool, int, float)):
        try:
            value = value.item()  # type: ignore[union-attr]
        except (ValueError, RuntimeError):  # an array of several values
            return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _fail(function: RewardFunction, problem: str, where: str, on_error: str) -> None:
    message = f"reward function {function.name!r}: {problem}, for {where}"
    if on_error != "skip":
        raise RewardError(message + " (reward.on_error=skip leaves such a prompt's completions out, counted)")
    logger.warning("%s; its prompt's completions are left out of the step (reward.on_error=skip)", message)


# --- the shipped reward functions ---


def answer_check(
    prompts: list,
    completions: list[str],
    completion_ids: list | None = None,
    mode: str = "exact",
    answer_field: str = "answer",
    **fields,
) -> list[float]:
    """1.0 where a completion's answer is the record's (`answer_field`), else 0.0. `mode`: `exact`, the completion
    stripped equals the answer stripped (a list answer: its items joined by ", "); `numeric`, the completion's last
    number equals the answer's within 1e-6 relative (commas in numbers ignored); `math`, math-verify's `verify` of
    the answer parsed against the completion parsed (LaTeX, fractions, sets; `pip install math-verify`)."""
    if mode not in ANSWER_MODES:
        raise ValueError(f"answer_check: mode must be one of {ANSWER_MODES}, got {mode!r}")
    answers = fields.get(answer_field)
    if answers is None:
        raise ValueError(f"answer_check: the prompt records have no {answer_field!r} field (answer_field names it)")
    check = {"exact": _exact, "numeric": _numeric, "math": _math}[mode]
    return [0.0 if answer is None else float(check(text, answer)) for text, answer in zip(completions, answers)]


def _answer_text(answer: object) -> str:
    if isinstance(answer, (list, tuple)):
        return ", ".join(str(item) for item in answer)
    return str(answer)


def _exact(text: str, answer: object) -> bool:
    return text.strip() == _answer_text(answer).strip()


def last_number(text: str) -> float | None:
    """The last number written in `text` (commas between digits ignored), None where it writes none."""
    found = NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def _numeric(text: str, answer: object) -> bool:
    got, want = last_number(text), last_number(_answer_text(answer))
    if got is None or want is None:
        return False
    return math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9)


@functools.cache
def _math_verify():
    try:
        import math_verify
    except ImportError as error:
        raise UserError(
            "answer_check(mode=math) needs math-verify: pip install math-verify (or pip install -e '.[math]')"
        ) from error
    return math_verify


def _math(text: str, answer: object) -> bool:
    verifier = _math_verify()
    gold = verifier.parse(_answer_text(answer))
    return bool(gold) and bool(verifier.verify(gold, verifier.parse(text)))


def format_check(
    prompts: list,
    completions: list[str],
    completion_ids: list | None = None,
    pattern: str | None = None,
    tags: Sequence[str] | None = None,
    **fields,
) -> list[float]:
    """1.0 where a completion (stripped) is all of `pattern` (a Python regular expression, dot matching newlines),
    or is made of the `tags` in order (`[think, answer]`: `<think>...</think>` then `<answer>...</answer>`, space
    between them), else 0.0."""
    if (pattern is None) == (tags is None):
        raise ValueError("format_check: give one of pattern (a regular expression) or tags (a list of tag names)")
    if tags is not None:
        pattern = r"\s*".join(rf"<{re.escape(tag)}>.*?</{re.escape(tag)}>" for tag in tags)
    compiled = re.compile(str(pattern), re.DOTALL)
    return [float(compiled.fullmatch(text.strip()) is not None) for text in completions]


def length_penalty(
    prompts: list,
    completions: list[str],
    completion_ids: list[list[int]],
    max_tokens: int,
    buffer_tokens: int,
    **fields,
) -> list[float]:
    """DAPO's soft overlong punishment: 0 for a completion of at most `max_tokens - buffer_tokens` tokens, falling
    linearly to -1 at `max_tokens`, and -1 beyond."""
    if not 0 < buffer_tokens <= max_tokens:
        raise ValueError(f"length_penalty: needs 0 < buffer_tokens <= max_tokens, got {buffer_tokens}, {max_tokens}")
    free = max_tokens - buffer_tokens
    return [0.0 if len(ids) <= free else max(-1.0, (free - len(ids)) / buffer_tokens) for ids in completion_ids]


def reward_model(
    prompts: list[list[dict]],
    completions: list[str],
    completion_ids: list | None = None,
    path: str = "",
    **fields,
) -> list[float]:
    """The score a reward model gives each prompt with its completion as the assistant's reply, rendered with the
    reward model's own chat template: `path`, a directory `recipes/reward.py` exported (output_dir/hf), or any
    Hugging Face sequence classifier with one label. Loaded once per process, on the CPU (or the rank's GPU); each
    conversation scored alone (no padding, whose side the classifier's pooling would depend on)."""
    import torch

    model, tokenizer, device = _reward_model(path)
    scores = []
    for prompt, completion in zip(prompts, completions):
        text = tokenizer.apply_chat_template(
            [*prompt, {"role": "assistant", "content": completion}], tokenize=False, add_generation_prompt=False
        )
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"].to(device)
        with torch.no_grad():
            scores.append(float(model(input_ids=ids).logits[0, 0].float()))
    return scores


@functools.cache
def _reward_model(path: str):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    if not path:
        raise UserError("reward_model: give path, the reward model's directory (a reward run's output_dir/hf)")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForSequenceClassification.from_pretrained(path).to(device).eval()
    except OSError as error:
        raise UserError(f"reward_model: cannot load {path!r}: {error}") from error
    if model.config.num_labels != 1:
        raise UserError(f"reward_model: {path} has {model.config.num_labels} labels; a reward model has one")
    return model, tokenizer, device
