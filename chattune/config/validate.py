"""Check a config before a run: `chattune validate CONFIG [key=value ...]`, and `check_config` at the start
of every recipe (and, through `chattune.config.launch`, a command line Hydra cannot compose). Every problem is
reported at once, one line each ("key: problem"), without loading a model.

What is checked:

- composition: a config name that does not exist, an override Hydra cannot parse or apply (an override
  of a key that is not in the config is retried as `+key=value`, so it is reported as below), a key the
  config file marks ??? and no override sets (`chattune validate` only: the composed config cannot
  tell, as merging keeps the value of the config it builds on);
- keys: the valid keys of a recipe are those of its shipped base config (`sft/tiny`; `dpo/tiny`, which
  builds on it). An unknown key is reported with the nearest valid one; a key the recipe reads that was
  removed (`~key`) is reported missing. A section with a `_target_` is checked against the callable's
  signature instead: unknown and missing required arguments, arguments the recipe passes itself
  (the optimizer's parameters, the scheduler's optimizer and `num_training_steps`), and `_partial_`.
  Hugging Face config classes accept any extra keyword, so an unknown `model.config` key is a note.
  `wandb` is passed to `wandb.init` as it is: any key. Data sources are checked against `SourceSpec`;
- types, against the base config's values (an int is a number, a bool is not an int); keys documented
  as taking null are listed in `NULLABLE` with their type when set;
- enum values (device, logger, progress, nonfinite_loss, data.train_on, data.overlong, model.fsdp dtypes,
  loss.type, source formats for the recipe, resume = auto | null | a checkpoint directory);
- paths: each data source (a file must exist and be .jsonl/.json/.parquet; a directory is a dataset;
  `hf:org/name` is a hub dataset: a note; a missing path never is one), tokenizer.path (`hf:org/name` a
  hub tokenizer: a note), model.path and reference.path
  (local directories; a model directory must hold config.json);
- numbers that cannot work: steps, intervals, budgets and counts below their minimum (`AT_LEAST`),
  max_grad_norm and loss.beta not positive, label smoothing outside [0, 0.5), a negative lr,
  stop_after_step after max_steps, a budget that is not a multiple of data.pad_to_multiple_of, neither
  model.path nor model.config;
- `chattune validate` only (a recipe decides these itself, holding the output directory's lock):
  output_dir must be writable and not locked by a live run, and what a launch would continue is
  decided as the launch decides it (`chattune.train.output_dir.plan_start`: the resume's checks against the
  checkpoint, an earlier run that only overwrite=true may replace);
- `chattune validate` only: the tokenizer is loaded (it must have a chat template) and the first
  `FIRST_RECORDS` records of every source are read as the recipe reads them (an empty or malformed
  file, a bad record).

Notes (not problems): hub ids, a microbatch budget above the max_position_embeddings of model.path
(documents that long get positions the model was not trained on), unknown HF config keys, an unused
reference.path, the checkpoint `chattune validate` would resume from and the ranks it needs, what a
resume would accept and what would be moved aside, records of the first ones that would be skipped.
"""

from __future__ import annotations

import difflib
import inspect
import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from functools import lru_cache
from pathlib import Path
from typing import Any

from hydra import compose
from hydra._internal.hydra import Hydra  # Hydra's own set-up, so --config-dir is searched as a recipe searches it
from hydra._internal.utils import create_config_search_path
from hydra.core.config_search_path import SearchPathQuery
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import InterpolationToMissingValueError, MissingMandatoryValue, OmegaConfBaseException
from transformers import PretrainedConfig

from chattune.config.paths import CONFIG_DIR  # importing chattune.config.paths also registers ${demo_asset:...}
from chattune.data.formats import DEFAULT_COLUMNS, PREFERENCE_FORMATS, DataError, SourceSpec
from chattune.errors import UserError
from chattune.objectives.pair_losses import LOSS_TYPES, REFERENCE_FREE
from chattune.train.progress import PROGRESS_MODES

# The shipped configs (CONFIG_DIR), whose base configs define the valid keys.
BASE_CONFIGS = {"sft": "sft/tiny", "dpo": "dpo/tiny"}

# Copies of constants whose modules take seconds to import (datasets, FSDP, the HF model code), which
# `chattune validate` would otherwise wait for; tests/test_validate.py checks that they still agree.
OVERLONG = ("drop", "truncate", "split", "error")  # sft_data.OVERLONG
OVERLONG_DPO = ("drop", "error")  # dpo_data.OVERLONG_DPO
TRAIN_ON = ("assistant", "last_assistant", "all")  # sft_data.TRAIN_ON
ON_BAD_RECORD = ("error", "skip")  # sft_data.ON_BAD_RECORD
MIXING_MODES = ("none", "static", "online")  # mixer.MODES
MIXING_REWARDS = ("mean_loss", "loss_decrease")  # mixer.REWARDS
MIXING_STOPPING = ("first_exhausted", "all_exhausted")  # mixture.STOPPING
DTYPES = ("float32", "bfloat16", "float16")  # fsdp.DTYPES
HUB_PREFIX = "hf:"  # sft_data.HUB_PREFIX: a hub id is written hf:org/name (a missing path never is one)
HUB_LIKE = re.compile(r"[\w.-]+/[\w.-]+")  # sft_data.HUB_LIKE: a missing path that may have meant a hub id

DEVICES = ("auto", "cpu", "cuda")  # distributed.init_distributed: anything but "cuda" runs on the CPU
LOGGERS = ("stdout", "wandb")  # metrics.MetricLogger
NONFINITE_LOSS = ("skip", "stop")  # training_loop.train: anything but "stop" skips
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")  # the files sft_data.RecordSource reads itself
SOURCE_KEYS = tuple(f.name for f in fields(SourceSpec))
OPEN_SECTIONS = ("wandb",)  # passed to wandb.init as keyword arguments: any key

# Keys documented as taking null, with their type when set (a null in the base config has no type).
NULLABLE: dict[str, type] = {
    "max_grad_norm": float, "keep_last_n": int, "resume": str, "stop_after_step": int, "wandb.name": str,
    "wandb.mode": str, "model.path": str, "model.config": dict, "reference.path": str, "data.eval": list,
    "data.pad_to_multiple_of": int, "data.num_epochs": int, "data.report_records": int,
}
# Keys that take a value of another type than their default's too.
ALTERNATIVE_TYPES: dict[str, tuple[type, ...]] = {"resume_allow_changes": (bool, list)}  # list: of strings
# The smallest value that can work (null, where allowed, is fine).
AT_LEAST = {
    "max_steps": 1, "grad_accum_steps": 1, "log_every": 1, "save_every": 0, "eval_every": 0, "keep_last_n": 1,
    "stop_after_step": 1, "data.max_tokens_per_microbatch": 1, "data.buffer_records": 1, "data.num_workers": 0,
    "data.pad_to_multiple_of": 1, "data.num_epochs": 1, "data.report_records": 0, "loss.chunk_size": 1,
    "scheduler.num_warmup_steps": 0,
}
HINTS = {"keep_last_n": " (null keeps every checkpoint)", "save_every": " (0: never)", "eval_every": " (0: never)"}
# What the recipes pass to the callables they instantiate with `_partial_: true`: positional arguments
# and keywords, which the config must leave alone.
RECIPE_ARGUMENTS = {"optimizer": (1, ()), "scheduler": (1, ("num_training_steps",))}

_UNSET = object()  # a value that could not be resolved (already reported)


class ConfigError(UserError, ValueError):
    """A config that cannot run; the message lists every problem, one per line."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join([*self.problems, summary_line(self.problems)]))


@dataclass
class Findings:
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def problem(self, key: str, message: str) -> None:
        self.problems.append(f"{key}: {message}")

    def note(self, key: str, message: str) -> None:
        self.notes.append(f"{key}: {message}")

    def has_problem(self, key: str) -> bool:
        """Whether a problem is reported for `key` or a section that holds it."""
        parts = key.split(".")
        prefixes = tuple(".".join(parts[:n]) + ":" for n in range(1, len(parts) + 1))
        return any(line.startswith(prefixes) for line in self.problems)


def summary_line(problems: list[str]) -> str:
    return f"{len(problems)} problem(s)" if problems else "config OK"


def format_report(findings: Findings) -> str:
    return "\n".join([*findings.problems, *(f"note: {n}" for n in findings.notes), summary_line(findings.problems)])


# --- entry points ---


def check_config(cfg: DictConfig, world_size: int, recipe: str | None = None) -> list[str]:
    """Raise ConfigError listing every problem of a composed config; otherwise return the notes.
    `recipe` ("sft" or "dpo") defaults to "dpo" when the config has a `reference` section."""
    findings = find_problems(cfg, world_size, recipe, output_dir_checks=False)
    if findings.problems:
        raise ConfigError(findings.problems)
    return findings.notes


def run_validate(config_name: str, overrides: list[str], config_path: Path,
                 world_size: int | None = None, config_dir: Path | None = None,
                 read_data: bool = False) -> tuple[str, bool]:
    """Compose `config_name` from `config_path` (and `config_dir`, Hydra's --config-dir, searched first)
    with `overrides` as a recipe would and check it: (the report, whether the config has no problem).
    `read_data`: also load the tokenizer and read the first records of every source."""
    findings = validate_command(config_name, overrides, config_path, world_size, config_dir, read_data)
    return format_report(findings), not findings.problems


def validate_command(config_name: str, overrides: list[str], config_path: Path, world_size: int | None = None,
                     config_dir: Path | None = None, read_data: bool = False, output_dir_checks: bool = True) -> Findings:
    """The findings of `run_validate` (`output_dir_checks`: also what a launch would do with output_dir)."""
    findings = Findings()
    cfg, added = _compose(config_name, list(overrides), Path(config_path), findings, config_dir)
    if cfg is not None:
        recipe = "dpo" if config_name.startswith("dpo/") or "reference" in cfg else "sft"
        overridden = {override.lstrip("+~").split("=", 1)[0] for override in overrides}
        searched = [d for d in (config_dir, Path(config_path)) if d is not None]
        unset = [key for key in _required_keys(config_name, searched) if key not in overridden]
        for key in unset:
            findings.problem(key, f"required by {config_name} (???), not set")
        find_problems(cfg, world_size, recipe, findings, output_dir_checks)
        # An unset required key still holds the value it inherited: its other problems are about that value.
        findings.problems = [line for line in findings.problems
                             if line.split(":", 1)[0] not in unset or line.endswith("(???), not set")]
        for key, override in added.items():  # valid keys, but Hydra adds a key only with "+"
            if not findings.has_problem(key):
                findings.problem(key, f"not in the config; add it with +{override}")
        if read_data and not findings.problems:
            read_first_records(cfg, recipe, findings)
    return findings


FIRST_RECORDS = 8  # records `chattune validate` reads of each source


def read_first_records(cfg: DictConfig, recipe: str, findings: Findings, count: int = FIRST_RECORDS) -> None:
    """Load the tokenizer and read the first `count` records of every source as the recipe reads them
    (format, chat template, masks, budget): an empty or malformed file, a bad first record or a tokenizer
    without a chat template is reported here rather than after the model is loaded."""
    from chattune.data.documents import Skipped
    from chattune.data.pair_documents import PairDocuments
    from chattune.data.sft_documents import SFTDocuments
    from chattune.data.sources import RecordSource, source_specs
    from chattune.data.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(cfg.tokenizer.path)
    except UserError as error:
        findings.problems.append(str(error))  # it names tokenizer.path
        return
    data = cfg.data
    for split in ("train", "eval"):
        for index, spec in enumerate(source_specs(data[split] or [])):
            key = f"data.{split}[{index}]"
            try:
                source = RecordSource([spec])
                if recipe == "dpo":
                    documents = PairDocuments(source, tokenizer, data.max_tokens_per_microbatch, data.overlong,
                                              data.on_bad_record)
                else:
                    documents = SFTDocuments(source, tokenizer, data.max_tokens_per_microbatch, data.overlong,
                                             spec.train_on or data.train_on, data.on_bad_record)
                outcomes = documents.get_many(range(min(count, len(documents))))
            except UserError as error:
                findings.problem(key, str(error))
                continue
            skipped = [o for o in outcomes if isinstance(o, Skipped)]
            if skipped:
                findings.note(key, f"{len(skipped)} of its first {min(count, len(documents))} records would be skipped, "
                                   f"e.g. {skipped[0].reason}: {skipped[0].detail}")


def find_problems(cfg: DictConfig, world_size: int | None = None, recipe: str | None = None,
                  findings: Findings | None = None, output_dir_checks: bool = True) -> Findings:
    """Every problem (and note) of a composed config, added to `findings`. `output_dir_checks`: also
    what a launch would do with output_dir (a recipe decides that itself, holding the directory's lock)."""
    findings = findings if findings is not None else Findings()
    recipe = recipe or ("dpo" if "reference" in cfg else "sft")
    values = _plain(cfg, "", findings)
    _Checker(values, recipe, findings, cfg if output_dir_checks else None).run(world_size)
    return findings


# --- composing ---


@contextmanager
def hydra_search_path(config_path: Path, config_dir: Path | None = None) -> Iterator[None]:
    """Hydra initialised as a recipe initialises it: configs from `config_path` (its --config-path, or
    the shipped configs), with `config_dir` (--config-dir) searched before it and the shipped configs
    after it (the search-path plugin)."""
    search_path = create_config_search_path(str(Path(config_path).resolve()))
    if config_dir is not None:
        search_path.prepend(provider="command-line", path=f"file://{Path(config_dir).resolve()}",
                            anchor=SearchPathQuery(provider="schema"))
    Hydra.create_main_hydra2(task_name="chattune", config_search_path=search_path)
    try:
        yield
    finally:
        GlobalHydra.instance().clear()


def composes(config_name: str, overrides: list[str], config_path: Path, config_dir: Path | None = None) -> bool:
    """Whether Hydra composes the config as given (a recipe's launch does exactly this first)."""
    with hydra_search_path(config_path, config_dir):
        return _try_compose(config_name, overrides)[0] is not None


def _compose(config_name: str, overrides: list[str], config_path: Path, findings: Findings,
             config_dir: Path | None = None) -> tuple[DictConfig | None, dict[str, str]]:
    """The composed config (None if even the bare config fails) and the keys that were only added by
    retrying an override as `+key=value` (key -> override). Failing overrides are reported and left out."""
    added: dict[str, str] = {}
    for flag, directory in (("--config-path", config_path), ("--config-dir", config_dir)):
        if directory is not None and not Path(directory).is_dir():
            hint = (" (a relative --config-path is resolved from the recipe's directory, as Hydra does: give an "
                    "absolute path, or --config-dir DIR for a directory relative to where you are)"
                    if flag == "--config-path" else "")
            findings.problem(flag, f"{directory} is not a directory{hint}")
            return None, added
    with hydra_search_path(config_path, config_dir):
        cfg, _ = _try_compose(config_name, overrides)
        if cfg is not None:
            return cfg, added
        cfg, error = _try_compose(config_name, [])
        if cfg is None:
            searched = [d for d in (config_dir, config_path, CONFIG_DIR) if d is not None]
            names = set().union(*map(_config_names, searched)) - {config_name}
            findings.problem("config", f"{config_name} from {' or '.join(map(str, dict.fromkeys(searched)))}: "
                                       f"{_first_line(error)}{_did_you_mean(config_name, names)}")
            return None, added
        accepted: list[str] = []  # one override at a time, to find those at fault
        for override in overrides:
            cfg, error = _try_compose(config_name, [*accepted, override])
            if cfg is not None:
                accepted.append(override)
            elif override[:1] not in "+~" and _try_compose(config_name, [*accepted, "+" + override])[0] is not None:
                accepted.append("+" + override)
                added[override.split("=", 1)[0]] = override
            else:
                findings.problem(f"override {override!r}", _first_line(error))
        return compose(config_name, overrides=accepted), added


def _required_keys(config_name: str, config_dirs: list[Path]) -> list[str]:
    """The keys the config file itself marks ??? (required). Merging keeps a value from the configs it
    builds on over a ???, so the composed config does not show them missing: a recipe would silently run
    with the parent's value (e.g. sft/tiny's model)."""
    for directory in (*config_dirs, CONFIG_DIR):  # the search path's order
        path = directory / f"{config_name}.yaml"
        if path.is_file():
            if "/" in config_name and "@package _global_" not in path.read_text():
                return []  # its keys live under its group's package, where a ??? shows as missing anyway
            raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
            return [key for key in _dotted_keys(raw) if _get(raw, key) == "???"]
    return []


def _try_compose(config_name: str, overrides: list[str]) -> tuple[DictConfig | None, Exception | None]:
    try:
        return compose(config_name, overrides=overrides), None
    except (HydraException, OmegaConfBaseException) as error:
        return None, error


def _config_names(directory: Path) -> set[str]:
    return {str(p.relative_to(directory).with_suffix("")) for p in directory.rglob("*.yaml")}


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


# --- the schema: the shipped base configs ---


@lru_cache(maxsize=None)
def base_config(recipe: str) -> dict:
    """The shipped base config of a recipe, resolved: its keys are the valid keys, its values' types the
    expected types."""
    cfg = _load_with_defaults(CONFIG_DIR / f"{BASE_CONFIGS[recipe]}.yaml")
    return OmegaConf.to_container(cfg, resolve=True)


def _load_with_defaults(path: Path) -> DictConfig:
    """A shipped config merged with the configs its `defaults` list names, as Hydra composes it, without
    Hydra: recipes call `check_config` inside their Hydra app, where Hydra cannot be initialised again.
    The shipped configs use only `_self_`, other config files and `override /hydra/...` entries, which
    configure Hydra itself and are skipped."""
    own = OmegaConf.load(path)
    defaults = list(own.pop("defaults", None) or ["_self_"])
    own.pop("hydra", None)
    parts = []
    for entry in defaults:
        if entry == "_self_":
            parts.append(own)
        elif isinstance(entry, str):
            included = CONFIG_DIR / entry[1:] if entry.startswith("/") else path.parent / entry
            parts.append(_load_with_defaults(included.with_suffix(".yaml")))
    return OmegaConf.merge(*parts)


# --- the composed config as plain values ---


def _plain(node: Any, key: str, findings: Findings) -> Any:
    """`node` as plain Python values, each interpolation resolved; a value that cannot be resolved is
    reported and becomes _UNSET."""
    if isinstance(node, DictConfig):
        items = [(name, _join(key, str(name))) for name in node.keys()]
    elif isinstance(node, ListConfig):
        items = [(index, f"{key}[{index}]") for index in range(len(node))]
    else:
        return node
    plain = {}
    for name, child_key in items:
        try:
            plain[name] = _plain(node[name], child_key, findings)
        except InterpolationToMissingValueError:
            findings.problem(child_key, f"{node._get_node(name)._value()} refers to a value that is not set")
            plain[name] = _UNSET
        except MissingMandatoryValue:
            findings.problem(child_key, "required value (???) is not set")
            plain[name] = _UNSET
        except OmegaConfBaseException as error:
            findings.problem(child_key, f"cannot resolve {node._get_node(name)._value()}: {_first_line(error)}")
            plain[name] = _UNSET
    return plain if isinstance(node, DictConfig) else list(plain.values())


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _get(values: dict, key: str) -> Any:
    for name in key.split("."):
        if not isinstance(values, dict) or name not in values:
            return _UNSET
        values = values[name]
    return values


def _number(values: dict, key: str) -> int | float | None:
    value = _get(values, key)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _show(value: Any) -> str:
    return json.dumps(value) if value is None or isinstance(value, bool) else repr(value)


def _closest(name: str, candidates) -> str | None:
    match = difflib.get_close_matches(name, sorted(candidates), n=1, cutoff=0.6)
    return match[0] if match else None


def _did_you_mean(name: str, candidates) -> str:
    match = _closest(name, candidates)
    return f"; did you mean {match}?" if match else ""


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "a mapping",
              list: "a list"}


def _fits(value: Any, expected: type) -> bool:
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, expected)


# --- the checks ---


class _Checker:
    def __init__(self, values: dict, recipe: str, findings: Findings, cfg: DictConfig | None = None):
        """`cfg`: the composed config, to check output_dir and the resume as a launch would (None: not checked)."""
        self.values, self.recipe, self.findings, self.cfg = values, recipe, findings, cfg
        self.schema = base_config(recipe)
        self.schema_keys = list(_dotted_keys(self.schema))

    def run(self, world_size: int | None) -> None:
        self.structure(self.values, self.schema, "")
        self.enums()
        self.sources("data.train", required=True)
        self.sources("data.eval", required=False)
        self.paths()
        self.numbers()
        if self.cfg is not None:
            self.output_dir(self.cfg, world_size)

    # keys and types

    def structure(self, values: dict, schema: dict, key: str) -> None:
        is_open = key in OPEN_SECTIONS
        for name, value in values.items():
            child = _join(key, str(name))
            if name in schema:
                self.value(value, schema[name], child)
            elif not is_open:
                self.unknown(child, [_join(key, n) for n in schema])
        if not is_open:
            for name in schema:
                if name not in values:
                    self.findings.problem(_join(key, name), "missing: the recipe reads it (removed with ~?)")

    def value(self, value: Any, expected: Any, key: str) -> None:
        if value is _UNSET or key in ("data.train", "data.eval"):  # sources are checked on their own
            return
        if value is None:
            if expected is not None and key not in NULLABLE:
                self.findings.problem(key, f"null is not allowed; expected {TYPE_NAMES.get(type(expected), 'a value')}")
            return
        if isinstance(value, dict) and "_target_" in value:
            self.target(value, expected if isinstance(expected, dict) else None, key)
            return
        if key in ALTERNATIVE_TYPES and isinstance(value, ALTERNATIVE_TYPES[key]):
            if isinstance(value, list) and not all(isinstance(item, str) for item in value):
                self.findings.problem(key, f"expected a list of strings, got {_show(value)}")
            return
        expected_type = type(expected) if expected is not None else NULLABLE.get(key)
        if expected_type is None:
            return
        if not _fits(value, expected_type):
            self.wrong_type(key, value, expected_type)
        elif isinstance(value, dict):
            self.structure(value, expected or {}, key)
        elif isinstance(value, list) and expected and not isinstance(expected[0], (dict, list)):
            for index, item in enumerate(value):
                if not _fits(item, type(expected[0])):
                    self.wrong_type(f"{key}[{index}]", item, type(expected[0]))

    def wrong_type(self, key: str, value: Any, expected: type) -> None:
        quoted_number = expected in (int, float) and isinstance(value, str) and _is_number(value)
        hint = " (a quoted number: write it without quotes)" if quoted_number else ""
        self.findings.problem(key, f"expected {TYPE_NAMES[expected]}, got {_show(value)}{hint}")

    def unknown(self, key: str, siblings: list[str]) -> None:
        """An unknown key, with the closest sibling or, failing that, a key of that name in another section."""
        leaf = key.rsplit(".", 1)[-1]
        by_leaf = {k.rsplit(".", 1)[-1]: k for k in siblings}
        closest = _closest(leaf, by_leaf)
        match = [by_leaf[closest]] if closest else [k for k in self.schema_keys if k.rsplit(".", 1)[-1] == leaf][:1]
        self.findings.problem(key, f"unknown key; did you mean {match[0]}?" if match else "unknown key")

    def target(self, values: dict, schema: dict | None, key: str) -> None:
        """A section instantiated with `_target_`: its keys against the callable's signature."""
        name = values["_target_"]
        try:
            target = get_object(name)
            parameters = inspect.signature(target).parameters
        except Exception as error:  # an import of user code can raise anything
            self.findings.problem(f"{key}._target_", f"cannot import {name!r}: {type(error).__name__}: {_first_line(error)}")
            return
        is_hf_config = isinstance(target, type) and issubclass(target, PretrainedConfig)
        accepts_any = is_hf_config or any(p.kind is p.VAR_KEYWORD for p in parameters.values())
        accepted = set(parameters) | set(getattr(target, "attribute_map", None) or {})
        positional, keywords = RECIPE_ARGUMENTS.get(key, (0, ()))
        given_by_recipe = {*list(parameters)[:positional], *keywords}
        if key in RECIPE_ARGUMENTS and values.get("_partial_") is not True:
            self.findings.problem(f"{key}._partial_", "must be true: the recipe calls the result with its own arguments")
        same_target = schema is not None and schema.get("_target_") == name
        for arg, value in values.items():
            child = f"{key}.{arg}"
            if arg.startswith("_"):  # Hydra's own: _target_, _partial_, _convert_, _recursive_, _args_
                continue
            if arg in given_by_recipe:
                self.findings.problem(child, "passed by the recipe; remove it from the config")
            elif arg not in accepted:
                closest = _closest(arg, accepted)
                hint = f"; did you mean {key}.{closest}?" if closest else ""
                if accepts_any:
                    self.findings.note(child, f"not a named parameter of {name} (passed on as an extra keyword){hint}")
                else:
                    self.findings.problem(child, f"unknown key{hint}" if hint else f"unknown key: not a parameter of {name}")
            elif same_target and arg in schema:
                self.value(value, schema[arg], child)
        for arg, parameter in list(parameters.items())[positional:]:
            if (parameter.default is parameter.empty and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
                    and arg not in values and arg not in keywords):
                self.findings.problem(f"{key}.{arg}", f"required by {name}, not set")

    # values

    def enums(self) -> None:
        allowed = {
            "device": DEVICES, "logger": LOGGERS, "progress": PROGRESS_MODES, "nonfinite_loss": NONFINITE_LOSS,
            "data.train_on": TRAIN_ON, "data.on_bad_record": ON_BAD_RECORD, "data.mixing.mode": MIXING_MODES, "data.mixing.reward": MIXING_REWARDS,
            "data.mixing.stopping": MIXING_STOPPING,
            "data.overlong": OVERLONG_DPO if self.recipe == "dpo" else OVERLONG,
            "model.fsdp.param_dtype": ("auto", *DTYPES), "model.fsdp.reduce_dtype": tuple(DTYPES),
        }
        if self.recipe == "dpo":
            allowed["loss.type"] = LOSS_TYPES
        for key, choices in allowed.items():
            self.choice(key, _get(self.values, key), choices)

    def choice(self, key: str, value: Any, choices) -> None:
        if isinstance(value, str) and value not in choices:
            self.findings.problem(key, f"{value!r} is not one of {', '.join(choices)}{_did_you_mean(value, choices)}")

    def sources(self, key: str, required: bool) -> None:
        sources = _get(self.values, key)
        if sources is _UNSET or (sources is None and not required):
            return
        if not isinstance(sources, list):
            self.findings.problem(key, f"expected a list of data sources, got {_show(sources)}")
            return
        if required and not sources:
            self.findings.problem(key, "no data sources: training needs at least one")
            return
        formats = [f for f in DEFAULT_COLUMNS if (f in PREFERENCE_FORMATS) == (self.recipe == "dpo")]
        for index, entry in enumerate(sources):
            where = f"{key}[{index}]"
            if isinstance(entry, str):
                entry = {"path": entry}
            if not isinstance(entry, dict):
                if entry is not _UNSET:
                    self.findings.problem(where, "a data source is a path or a mapping {path, format, columns, roles, split}")
                continue
            if _UNSET in entry.values():
                continue
            unknown = [name for name in entry if name not in SOURCE_KEYS]
            for name in unknown:
                self.unknown(f"{where}.{name}", [f"{where}.{k}" for k in SOURCE_KEYS])
            fmt = entry.get("format", SourceSpec.format)
            if fmt not in formats:
                recipe_note = " (DPO reads preference pairs)" if self.recipe == "dpo" else ""
                self.findings.problem(f"{where}.format", f"{fmt!r} is not one of {', '.join(formats)}{recipe_note}"
                                                         f"{_did_you_mean(str(fmt), formats)}")
            elif not unknown:
                try:
                    SourceSpec.from_config(entry)
                except DataError as error:
                    self.findings.problem(where, str(error))
            if not isinstance(entry.get("path"), str):
                self.findings.problem(f"{where}.path", f"a source needs a path, got {_show(entry.get('path'))}")
            else:
                self.data_path(where, entry["path"])

    def data_path(self, key: str, path: str) -> None:
        if Path(path).is_dir():
            return  # a dataset directory, read with datasets.load_dataset
        if Path(path).is_file():
            if not path.endswith(DATA_SUFFIXES):
                self.findings.problem(key, f"data file {path!r}: expected .jsonl, .json or .parquet")
        elif path.startswith(HUB_PREFIX):
            self.findings.note(key, f"{path!r}: a hub dataset (needs the machine online)")
        else:
            hint = f" (a hub dataset is written {HUB_PREFIX}{path})" if HUB_LIKE.fullmatch(path) and not \
                path.endswith(DATA_SUFFIXES) else ""
            self.findings.problem(key, f"data file {path!r} does not exist{hint}")

    def paths(self) -> None:
        tokenizer = _get(self.values, "tokenizer.path")
        if isinstance(tokenizer, str) and not Path(tokenizer).is_dir():
            if tokenizer.startswith(HUB_PREFIX):
                self.findings.note("tokenizer.path", f"{tokenizer!r}: a hub tokenizer (needs the machine online)")
            elif Path(tokenizer).exists():
                self.findings.problem("tokenizer.path", f"{tokenizer!r} is not a directory")
            else:
                hint = f" (a hub tokenizer is written {HUB_PREFIX}{tokenizer})" if HUB_LIKE.fullmatch(tokenizer) else ""
                self.findings.problem("tokenizer.path", f"{tokenizer!r} does not exist{hint}")
        for key in ("model.path", "reference.path"):
            path = _get(self.values, key)
            if not isinstance(path, str):
                continue
            if not Path(path).is_dir():
                self.findings.problem(key, f"{path!r} is not a local directory (chattune loads no models from a hub)")
            elif not (Path(path) / "config.json").is_file():
                self.findings.problem(key, f"{path!r} has no config.json: not a Hugging Face model directory")
        if _get(self.values, "model.path") is None and _get(self.values, "model.config") is None:
            self.findings.problem("model", "neither model.path nor model.config is set")
        if (self.recipe == "dpo" and isinstance(_get(self.values, "reference.path"), str)
                and _get(self.values, "loss.type") in REFERENCE_FREE):
            self.findings.note("reference.path", f"unused: loss.type={_get(self.values, 'loss.type')} needs no reference")

    def numbers(self) -> None:
        for key, least in AT_LEAST.items():
            value = _get(self.values, key)
            if isinstance(value, int) and not isinstance(value, bool) and value < least:
                self.findings.problem(key, f"must be at least {least}, got {value}{HINTS.get(key, '')}")
        self.bound("max_grad_norm", lambda v: v > 0, "must be positive (null: no clipping)")
        self.bound("optimizer.lr", lambda v: v >= 0, "must not be negative")
        if self.recipe == "dpo":
            self.bound("loss.beta", lambda v: v > 0, "must be positive")
            self.bound("loss.label_smoothing", lambda v: 0 <= v < 0.5, "must be in [0, 0.5)")
        max_steps, stop = _number(self.values, "max_steps"), _number(self.values, "stop_after_step")
        if max_steps is not None and stop is not None and stop > max_steps:
            self.findings.problem("stop_after_step", f"{stop} is after max_steps {max_steps}: the run ends first")
        budget, multiple = _number(self.values, "data.max_tokens_per_microbatch"), _number(self.values, "data.pad_to_multiple_of")
        if budget and multiple and multiple > 0 and budget % multiple:
            self.findings.problem("data.max_tokens_per_microbatch", f"{budget} is not a multiple of data.pad_to_multiple_of "
                                                                    f"{multiple}: padding could exceed the budget")
        positions = self.max_positions()
        if budget and positions and budget > positions:
            self.findings.note("data.max_tokens_per_microbatch",
                               f"{budget} is more than model.path's max_position_embeddings {positions}: a document "
                               f"longer than {positions} tokens gets positions the model was not trained on")

    def bound(self, key: str, holds, message: str) -> None:
        value = _number(self.values, key)
        if value is not None and not holds(value):
            self.findings.problem(key, f"{message}, got {value}")

    def max_positions(self) -> int | None:
        """max_position_embeddings of the pretrained model at model.path (a model built from model.config
        has been trained on no position yet)."""
        path = _get(self.values, "model.path")
        if not isinstance(path, str):
            return None
        try:
            value = json.loads((Path(path) / "config.json").read_text()).get("max_position_embeddings")
        except (OSError, ValueError, AttributeError):
            return None  # a missing or unreadable config.json is reported by paths()
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def output_dir(self, cfg: DictConfig, world_size: int | None) -> None:
        """What a launch would do with output_dir, decided as the recipe decides it (`chattune.train.output_dir`):
        writable, not locked by a live run, and the checkpoint it continues fits this config (or an
        earlier run's results would be overwritten without overwrite=true)."""
        if world_size is not None and world_size < 1:
            self.findings.problem("world_size", f"must be at least 1, got {world_size}")
        output_dir = _get(self.values, "output_dir")
        if not isinstance(output_dir, str) or self.findings.problems:
            return  # the decision needs a config without other problems (the fingerprint resolves it whole)
        directory = Path(output_dir)
        existing = next(p for p in (directory, *directory.resolve().parents) if p.exists())
        if not existing.is_dir():
            self.findings.problem("output_dir", f"{existing} is not a directory")
            return
        if not os.access(existing, os.W_OK | os.X_OK):
            self.findings.problem("output_dir", f"cannot write into {existing} (permission denied)")
            return
        resume = _get(self.values, "resume")
        if not directory.is_dir() and not (isinstance(resume, str) and resume != "auto"):
            return  # nothing there to resume, lock or overwrite (and no need to import torch to say so)
        # torch.distributed.checkpoint and the data fingerprints take seconds to import: only where needed.
        from chattune.train.output_dir import OutputDirLock, describe_holder, plan_start
        from chattune.train.resume import ResumeError, run_fingerprint, run_meta

        lock = OutputDirLock(directory)
        if lock.is_held():
            self.findings.problem("output_dir", f"in use by another run: {describe_holder(lock.holder())}")
        try:
            plan = plan_start(cfg, run_meta(world_size, run_fingerprint(cfg)))
        except UserError as error:
            key = "resume" if isinstance(error, ResumeError) else "output_dir"
            self.findings.problem(key, str(error))
            return
        start = plan.start
        if start.resume_from is not None:
            saved = start.checkpoint_meta
            ranks = "" if world_size is not None else f", written by {saved['world_size']} rank(s): launch with " \
                                                        f"--nproc_per_node {saved['world_size']}"
            self.findings.note("resume", f"continues from {start.resume_from} at step {saved['step']}{ranks}")
        for line in start.plan.notes + [f"{h} (the schedule is recomputed for the new horizon)" for h in start.plan.horizon]:
            self.findings.note("resume", line)
        for path in plan.move_aside + plan.copy_aside:
            self.findings.note("output_dir", f"{path} would be set aside as {path.name}.abandoned")


def _dotted_keys(tree: dict, prefix: str = ""):
    """Every key of nested dicts, dotted, sections included."""
    for name, value in tree.items():
        key = _join(prefix, str(name))
        yield key
        if isinstance(value, dict):
            yield from _dotted_keys(value, key)
