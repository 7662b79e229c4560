"""The checks of a composed config against the schema (`chattune.config.schema`): keys, types, choices,
bounds, data sources, paths and, for `chattune validate`, what a launch would do with output_dir.

Each check adds lines to a `Findings`; nothing stops at the first problem.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import os
import types
import typing
from dataclasses import fields
from functools import lru_cache
from pathlib import Path
from typing import Any

from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig
from omegaconf.errors import InterpolationToMissingValueError, MissingMandatoryValue, OmegaConfBaseException
from transformers import PretrainedConfig

from chattune.config.findings import UNSET, Findings, closest, did_you_mean, first_line, get_value, join_key, show
from chattune.config.schema import QUANTIZE_BASE, REFERENCE_FREE, schema_for
from chattune.data.formats import DEFAULT_COLUMNS, PREFERENCE_FORMATS, DataError, SourceSpec
from chattune.errors import UserError
from chattune.hub import HUB_LIKE, HUB_PREFIX, hub_hint, hub_id

HUB_NOTE = "downloaded once per node into the Hugging Face cache, or read from it offline"

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")  # the files data.records.RecordSource reads itself
SOURCE_KEYS = tuple(f.name for f in fields(SourceSpec))
SOURCE_LISTS = ("data.train", "data.eval")  # checked against SourceSpec, not by type


def plain_values(node: Any, key: str, findings: Findings) -> Any:
    """`node` as plain Python values, each interpolation resolved; a value that cannot be resolved is
    reported and becomes UNSET."""
    if isinstance(node, DictConfig):
        items = [(name, join_key(key, str(name))) for name in node.keys()]
    elif isinstance(node, ListConfig):
        items = [(index, f"{key}[{index}]") for index in range(len(node))]
    else:
        return node
    plain = {}
    for name, child_key in items:
        try:
            plain[name] = plain_values(node[name], child_key, findings)
        except InterpolationToMissingValueError:
            findings.problem(child_key, f"{node._get_node(name)._value()} refers to a value that is not set")
            plain[name] = UNSET
        except MissingMandatoryValue:
            findings.problem(child_key, "required value (???) is not set")
            plain[name] = UNSET
        except OmegaConfBaseException as error:
            findings.problem(child_key, f"cannot resolve {node._get_node(name)._value()}: {first_line(error)}")
            plain[name] = UNSET
    return plain if isinstance(node, DictConfig) else list(plain.values())


# --- the schema's types ---

TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "a mapping",
              list: "a list"}


@lru_cache(maxsize=None)
def schema_fields(section: type) -> dict[str, tuple[Any, dict]]:
    """A schema section's keys: name -> (type hint, metadata)."""
    hints = typing.get_type_hints(section)
    return {f.name: (hints[f.name], f.metadata) for f in dataclasses.fields(section)}


def type_options(hint: Any) -> tuple[list[Any], bool]:
    """The types a hint allows, and whether it allows null (`X | None`)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        return [a for a in args if a is not type(None)], type(None) in args
    return [hint], False


def base_type(hint: Any) -> type:
    """The plain Python type a value of `hint` has: a schema section is a mapping, list[X] a list."""
    if dataclasses.is_dataclass(hint) or typing.get_origin(hint) is dict:
        return dict
    if typing.get_origin(hint) is list:
        return list
    return object if hint is Any else hint


def section_type(hint: Any) -> type | None:
    """The schema section a hint holds (`Section` or `Section | None`), None for a plain value."""
    return next((o for o in type_options(hint)[0] if dataclasses.is_dataclass(o)), None)


def schema_items(section: type, prefix: str = ""):
    """(dotted key, metadata) of every key of a schema in schema order, sections included (a section
    that may be null, by its own type)."""
    for name, (hint, metadata) in schema_fields(section).items():
        key = join_key(prefix, name)
        yield key, metadata
        nested = section_type(hint)
        if nested is not None:
            yield from schema_items(nested, key)


def keys_with(section: type, metadata_key: str):
    """(dotted key, metadata) of every key whose metadata sets `metadata_key`, in schema order."""
    return [(key, metadata) for key, metadata in schema_items(section) if metadata.get(metadata_key) is not None]


def _fits(value: Any, expected: type) -> bool:
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, expected)


def _number(values: dict, key: str) -> int | float | None:
    value = get_value(values, key)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _cuda_available() -> bool:
    import torch  # only for a config that asks for a 4-bit base

    return torch.cuda.is_available()


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def output_dir_problem(directory: Path) -> str | None:
    """Why a run could not create or write `directory` (its nearest existing ancestor decides), or None."""
    existing = next(p for p in (directory, *directory.resolve().parents) if p.exists())
    if not existing.is_dir():
        return f"{existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"cannot write into {existing} (permission denied, or a read-only file system)"
    return None


# --- the checks ---


class Checker:
    def __init__(self, values: dict, recipe: str, findings: Findings, cfg: DictConfig | None = None):
        """`cfg`: the composed config, to check output_dir and the resume as a launch would (None: not checked)."""
        self.values, self.recipe, self.findings, self.cfg = values, recipe, findings, cfg
        self.schema = schema_for(recipe)
        self.schema_keys = [key for key, _ in schema_items(self.schema)]

    def run(self, world_size: int | None) -> None:
        self.structure(self.values, self.schema, "")
        self.enums()
        self.sources("data.train", required=True)
        self.sources("data.eval", required=False)
        self.paths()
        self.numbers()
        self.quantized_base()
        self.device()
        self.step_layout(world_size)
        if self.cfg is not None:
            self.output_dir(self.cfg, world_size)

    # keys and types

    def structure(self, values: dict, section: type, key: str, open_section: bool = False) -> None:
        """A section's keys: each known one checked against its type, unknown and missing ones reported
        (an open section, passed on as it is, takes any key and needs none)."""
        known = schema_fields(section)
        aliases = {alias: join_key(key, name) for name, (_, metadata) in known.items() for alias in metadata["aliases"]}
        for name, value in values.items():
            child = join_key(key, str(name))
            if name in known:
                self.value(value, *known[name], child)
            elif not open_section:
                self.unknown(child, [join_key(key, n) for n in known], aliases.get(str(name)))
        if not open_section:
            for name in known:
                if name not in values:
                    self.findings.problem(join_key(key, name), "missing: the recipe reads it (removed with ~?)")

    def value(self, value: Any, hint: Any, metadata: dict, key: str) -> None:
        if value is UNSET or key in SOURCE_LISTS:  # sources are checked on their own
            return
        options, nullable = type_options(hint)
        if value is None:
            if not nullable:
                self.findings.problem(key, f"null is not allowed; expected {TYPE_NAMES.get(base_type(options[0]), 'a value')}")
            return
        if isinstance(value, dict) and "_target_" in value:
            self.target(value, section_type(hint), metadata, key)
            return
        for option in options:
            if _fits(value, base_type(option)):
                self.contents(value, option, metadata, key)
                return
        self.wrong_type(key, value, base_type(options[0]))

    def contents(self, value: Any, hint: Any, metadata: dict, key: str) -> None:
        """What is inside a value of the right type: a section's keys, a typed list's items."""
        if dataclasses.is_dataclass(hint):
            self.structure(value, hint, key, open_section=bool(metadata.get("open_section")))
        elif typing.get_origin(hint) is list:
            (item_type,) = typing.get_args(hint) or (Any,)
            expected = base_type(item_type)
            if expected in (object, dict, list):
                return
            for index, item in enumerate(value):
                if not _fits(item, expected):
                    self.wrong_type(f"{key}[{index}]", item, expected)

    def wrong_type(self, key: str, value: Any, expected: type) -> None:
        quoted_number = expected in (int, float) and isinstance(value, str) and _is_number(value)
        hint = " (a quoted number: write it without quotes)" if quoted_number else ""
        self.findings.problem(key, f"expected {TYPE_NAMES[expected]}, got {show(value)}{hint}")

    def unknown(self, key: str, siblings: list[str], alias_of: str | None = None) -> None:
        """An unknown key, with the key it is another name for (peft's `r` for `rank`), the closest sibling or,
        failing those, a key of that name in another section."""
        leaf = key.rsplit(".", 1)[-1]
        by_leaf = {k.rsplit(".", 1)[-1]: k for k in siblings}
        nearest = closest(leaf, by_leaf)
        match = [alias_of] if alias_of else [by_leaf[nearest]] if nearest else \
            [k for k in self.schema_keys if k.rsplit(".", 1)[-1] == leaf][:1]
        self.findings.problem(key, f"unknown key; did you mean {match[0]}?" if match else "unknown key")

    def target(self, values: dict, section: type | None, metadata: dict, key: str) -> None:
        """A section instantiated with `_target_`: its keys against the callable's signature (and, for the
        schema's own target, against the schema's types)."""
        name = values["_target_"]
        try:
            target = get_object(name)
            parameters = inspect.signature(target).parameters
        except Exception as error:  # an import of user code can raise anything
            self.findings.problem(f"{key}._target_", f"cannot import {name!r}: {type(error).__name__}: {first_line(error)}")
            return
        is_hf_config = isinstance(target, type) and issubclass(target, PretrainedConfig)
        accepts_any = is_hf_config or any(p.kind is p.VAR_KEYWORD for p in parameters.values())
        accepted = set(parameters) | set(getattr(target, "attribute_map", None) or {})
        recipe_passes = metadata.get("recipe_passes")
        positional, keywords = recipe_passes or (0, ())
        given_by_recipe = {*list(parameters)[:positional], *keywords}
        if recipe_passes and values.get("_partial_") is not True:
            self.findings.problem(f"{key}._partial_", "must be true: the recipe calls the result with its own arguments")
        known = schema_fields(section) if section is not None else {}
        same_target = "_target_" in known and section.__dataclass_fields__["_target_"].default == name
        for arg, value in values.items():
            child = f"{key}.{arg}"
            if arg.startswith("_"):  # Hydra's own: _target_, _partial_, _convert_, _recursive_, _args_
                continue
            if arg in given_by_recipe:
                self.findings.problem(child, "passed by the recipe; remove it from the config")
            elif arg not in accepted:
                match = closest(arg, accepted)
                hint = f"; did you mean {key}.{match}?" if match else ""
                if accepts_any:
                    self.findings.note(child, f"not a named parameter of {name} (passed on as an extra keyword){hint}")
                else:
                    self.findings.problem(child, f"unknown key{hint}" if hint else f"unknown key: not a parameter of {name}")
            elif same_target and arg in known:
                self.value(value, *known[arg], child)
        for arg, parameter in list(parameters.items())[positional:]:
            if (parameter.default is parameter.empty and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
                    and arg not in values and arg not in keywords):
                self.findings.problem(f"{key}.{arg}", f"required by {name}, not set")

    # values

    def enums(self) -> None:
        for key, metadata in keys_with(self.schema, "choices"):
            self.choice(key, get_value(self.values, key), metadata["choices"])

    def choice(self, key: str, value: Any, choices) -> None:
        if isinstance(value, str) and value not in choices:
            self.findings.problem(key, f"{value!r} is not one of {', '.join(choices)}{did_you_mean(value, choices)}")

    def sources(self, key: str, required: bool) -> None:
        sources = get_value(self.values, key)
        if sources is UNSET or (sources is None and not required):
            return
        if not isinstance(sources, list):
            self.findings.problem(key, f"expected a list of data sources, got {show(sources)}")
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
                if entry is not UNSET:
                    self.findings.problem(where, "a data source is a path or a mapping {path, format, columns, roles, split}")
                continue
            if UNSET in entry.values():
                continue
            unknown = [name for name in entry if name not in SOURCE_KEYS]
            for name in unknown:
                self.unknown(f"{where}.{name}", [f"{where}.{k}" for k in SOURCE_KEYS])
            fmt = entry.get("format", SourceSpec.format)
            if fmt not in formats:
                recipe_note = " (DPO reads preference pairs)" if self.recipe == "dpo" else ""
                self.findings.problem(f"{where}.format", f"{fmt!r} is not one of {', '.join(formats)}{recipe_note}"
                                                         f"{did_you_mean(str(fmt), formats)}")
            elif not unknown:
                try:
                    SourceSpec.from_config(entry)
                except DataError as error:
                    self.findings.problem(where, str(error))
            if not isinstance(entry.get("path"), str):
                self.findings.problem(f"{where}.path", f"a source needs a path, got {show(entry.get('path'))}")
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

    def numbers(self) -> None:
        for key, metadata in keys_with(self.schema, "at_least"):
            value, least = get_value(self.values, key), metadata["at_least"]
            if isinstance(value, int) and not isinstance(value, bool) and value < least:
                self.findings.problem(key, f"must be at least {least}, got {value}{metadata['hint']}")
        for key, metadata in keys_with(self.schema, "bound"):
            self.bound(key, *metadata["bound"])
        max_steps, stop = _number(self.values, "max_steps"), _number(self.values, "stop_after_step")
        if max_steps is not None and stop is not None and stop > max_steps:
            self.findings.problem("stop_after_step", f"{stop} is after max_steps {max_steps}: the run ends first")
        warmup, save_every = _number(self.values, "scheduler.num_warmup_steps"), _number(self.values, "save_every")
        if max_steps is not None and warmup is not None and warmup > max_steps:
            self.findings.note("scheduler.num_warmup_steps", f"{warmup} is more than max_steps {max_steps}: the learning "
                                                             "rate never reaches optimizer.lr")
        if max_steps is not None and save_every is not None and save_every > max_steps:
            self.findings.note("save_every", f"{save_every} is more than max_steps {max_steps}: no checkpoint is written, so "
                                             "the run can be neither resumed nor extended (its export is still written)")
        budget, multiple = _number(self.values, "data.max_tokens_per_microbatch"), _number(self.values, "data.pad_to_multiple_of")
        if budget and multiple and multiple > 0 and budget % multiple:
            self.findings.problem("data.max_tokens_per_microbatch", f"{budget} is not a multiple of data.pad_to_multiple_of "
                                                                    f"{multiple}: padding could exceed the budget")
        positions = self.max_positions()
        if budget and positions and budget > positions:
            self.findings.note("data.max_tokens_per_microbatch",
                               f"{budget} is more than model.path's max_position_embeddings {positions}: a document "
                               f"longer than {positions} tokens gets positions the model was not trained on")

    def paths(self) -> None:
        tokenizer = get_value(self.values, "tokenizer.path")
        if isinstance(tokenizer, str) and not Path(tokenizer).is_dir():
            if hub_id(tokenizer) is not None:
                self.findings.note("tokenizer.path", f"{tokenizer!r}: a hub tokenizer ({HUB_NOTE})")
            elif Path(tokenizer).exists():
                self.findings.problem("tokenizer.path", f"{tokenizer!r} is not a directory")
            else:
                self.findings.problem("tokenizer.path", f"{tokenizer!r} does not exist{hub_hint(tokenizer, 'tokenizer')}")
        for key in ("model.path", "reference.path"):
            path = get_value(self.values, key)
            if not isinstance(path, str):
                continue
            if hub_id(path) is not None:
                self.findings.note(key, f"{path!r}: a hub model ({HUB_NOTE})")
            elif not Path(path).is_dir():
                self.findings.problem(key, f"{path!r} is not a local directory{hub_hint(path, 'model')}")
            elif not (Path(path) / "config.json").is_file():
                self.findings.problem(key, f"{path!r} has no config.json: not a Hugging Face model directory")
        if get_value(self.values, "model.path") is None and get_value(self.values, "model.config") is None:
            self.findings.problem("model", "neither model.path nor model.config is set")
        if (self.recipe == "dpo" and isinstance(get_value(self.values, "reference.path"), str)
                and get_value(self.values, "loss.type") in REFERENCE_FREE):
            self.findings.note("reference.path", f"unused: loss.type={get_value(self.values, 'loss.type')} needs no reference")

    def step_layout(self, world_size: int | None) -> None:
        """World-size-invariant steps (data.microbatches_per_step) are dealt to the ranks, which must divide
        them; the microbatches per rank follow from them, so grad_accum_steps stays at 1."""
        total = _number(self.values, "data.microbatches_per_step")
        if not isinstance(total, int) or total < 1:
            return
        accum = _number(self.values, "grad_accum_steps")
        if accum not in (None, 1):
            self.findings.problem("grad_accum_steps", f"{accum} with data.microbatches_per_step={total}: the microbatches "
                                                      "per rank follow from it (data.microbatches_per_step / ranks); "
                                                      "leave grad_accum_steps at 1")
        if world_size is not None and world_size >= 1 and total % world_size:
            self.findings.problem("data.microbatches_per_step", f"{total} cannot be dealt to {world_size} ranks: the "
                                                                "number of ranks must divide it")

    def device(self) -> None:
        if get_value(self.values, "device") == "cuda" and not _cuda_available():
            self.findings.problem("device", "cuda, but torch finds no CUDA device on this machine (torch.cuda.is_available() "
                                            "is False): use device=auto (CUDA where there is one) or device=cpu")

    def quantized_base(self) -> None:
        """QLoRA (peft.quantize_base) needs CUDA and bitsandbytes (an optional install)."""
        if get_value(self.values, "peft.quantize_base") not in QUANTIZE_BASE:
            return  # null (full precision), or not a format (reported by enums)
        device = get_value(self.values, "device")
        if device == "cpu" or (device == "auto" and not _cuda_available()):
            self.findings.problem("peft.quantize_base", "a 4-bit base (QLoRA) trains on CUDA only: it saves GPU memory "
                                                        "with bitsandbytes' GPU kernels. On the CPU, set "
                                                        "peft.quantize_base=null (LoRA on the full-precision base)")
        elif importlib.util.find_spec("bitsandbytes") is None:
            self.findings.problem("peft.quantize_base", 'needs bitsandbytes: pip install "chattune[qlora]"')

    def bound(self, key: str, holds, message: str) -> None:
        value = get_value(self.values, key)
        if isinstance(value, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            pass  # a list of numbers (optimizer.betas)
        elif (value := _number(self.values, key)) is None:
            return  # absent, null or of another type (reported by the type checks)
        if not holds(value):
            self.findings.problem(key, f"{message}, got {value}")

    def max_positions(self) -> int | None:
        """max_position_embeddings of the pretrained model at model.path (a model built from model.config
        has been trained on no position yet)."""
        path = get_value(self.values, "model.path")
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
        output_dir = get_value(self.values, "output_dir")
        if not isinstance(output_dir, str) or self.findings.problems:
            return  # the decision needs a config without other problems (the fingerprint resolves it whole)
        directory = Path(output_dir)
        problem = output_dir_problem(directory)
        if problem is not None:
            self.findings.problem("output_dir", problem)
            return
        resume = get_value(self.values, "resume")
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
            invariant = get_value(self.values, "data.microbatches_per_step")
            if world_size is not None:
                ranks = ""
            elif isinstance(invariant, int):  # world-size-invariant steps: any divisor of M resumes it
                divisors = ", ".join(str(n) for n in range(1, invariant + 1) if invariant % n == 0)
                ranks = (f", written by {saved['world_size']} rank(s): launch with any --nproc_per_node that divides "
                         f"data.microbatches_per_step={invariant} ({divisors})")
            else:
                ranks = f", written by {saved['world_size']} rank(s): launch with --nproc_per_node {saved['world_size']}"
            self.findings.note("resume", f"continues from {start.resume_from} at step {saved['step']}{ranks}")
        for line in start.plan.notes + [f"{h} (the schedule is recomputed for the new horizon)" for h in start.plan.horizon]:
            self.findings.note("resume", line)
        for path in plan.move_aside + plan.copy_aside:
            self.findings.note("output_dir", f"{path} would be set aside as {path.name}.abandoned")
