"""The checks a composed config gets from the schema alone (`chattune.config.schema`): its keys (unknown ones
with the nearest valid one, missing ones), their types, choices and bounds, and each `_target_` section against
the callable's signature. The run's own rules (sources, paths, step layout, ...) are `chattune.launch.run_rules`.

Each check adds lines to a `Findings`; nothing stops at the first problem.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
import sys
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig
from omegaconf.errors import InterpolationToMissingValueError, MissingMandatoryValue, OmegaConfBaseException
from transformers import PretrainedConfig

from chattune.config.schema import keys_with, schema_fields, schema_items, section_type, type_options
from chattune.launch.findings import UNSET, Findings, closest, did_you_mean, first_line, get_value, join_key, show

SOURCE_LISTS = ("data.train", "data.eval")  # checked against SourceSpec by the run's rules, not by type


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

TYPE_NAMES = {
    int: "an integer",
    float: "a number",
    bool: "true or false",
    str: "a string",
    dict: "a mapping",
    list: "a list",
}


def base_type(hint: Any) -> type:
    """The plain Python type a value of `hint` has: a schema section is a mapping, list[X] a list."""
    if dataclasses.is_dataclass(hint) or typing.get_origin(hint) is dict:
        return dict
    if typing.get_origin(hint) is list:
        return list
    return object if hint is Any else hint


def _fits(value: Any, expected: type) -> bool:
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, expected)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def number(values: dict, key: str) -> int | float | None:
    """The number at dotted `key` of `values`, or None (absent, null or of another type)."""
    value = get_value(values, key)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


class SchemaChecks:
    """Keys, types, choices and bounds, as the recipe's schema declares them."""

    def __init__(self, values: dict, schema: type, findings: Findings):
        """`schema`: the recipe kind's (`RecipeKind.schema`: a copied recipe's own where it extends one)."""
        self.values, self.findings = values, findings
        self.schema = schema
        self.schema_keys = [key for key, _ in schema_items(self.schema)]

    def keys_and_types(self, values: dict, section: type, key: str, open_section: bool = False) -> None:
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
                self.findings.problem(
                    key, f"null is not allowed; expected {TYPE_NAMES.get(base_type(options[0]), 'a value')}"
                )
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
            self.keys_and_types(value, hint, key, open_section=bool(metadata.get("open_section")))
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
        match = [alias_of] if alias_of else [by_leaf[nearest]] if nearest else []
        if match:
            self.findings.problem(key, f"unknown key; did you mean {match[0]}?")
        elif "." in key and siblings:  # a section of the recipe's own without it (KTO's loss has no type): its keys
            self.findings.problem(
                key,
                f"unknown key: this recipe's {key.rsplit('.', 1)[0]} has no {leaf} "
                f"(its keys: {', '.join(sorted(by_leaf))})",
            )
        else:  # at the top level: a key of that name in a section
            elsewhere = [k for k in self.schema_keys if k.rsplit(".", 1)[-1] == leaf][:1]
            self.findings.problem(key, f"unknown key; did you mean {elsewhere[0]}?" if elsewhere else "unknown key")

    def target(self, values: dict, section: type | None, metadata: dict, key: str) -> None:
        """A section instantiated with `_target_`: its keys against the callable's signature (and, for the
        schema's own target, against the schema's types)."""
        name = values["_target_"]
        if isinstance(name, str) and (missing := missing_attribute(name)) is not None:  # before Hydra logs its error
            self.findings.problem(f"{key}._target_", f"cannot import {name!r}: {missing}")
            return
        try:
            target, parameters = target_parameters(name)
        except Exception as error:  # an import of user code can raise anything
            self.findings.problem(
                f"{key}._target_", f"cannot import {name!r}: {missing_attribute(name) or error_line(error)}"
            )
            return
        is_hf_config = isinstance(target, type) and issubclass(target, PretrainedConfig)
        accepts_any = is_hf_config or any(p.kind is p.VAR_KEYWORD for p in parameters.values())
        accepted = set(parameters) | set(getattr(target, "attribute_map", None) or {})
        recipe_passes = metadata.get("recipe_passes")
        positional, keywords = recipe_passes or (0, ())
        given_by_recipe = {*list(parameters)[:positional], *keywords}
        if recipe_passes and values.get("_partial_") is not True:
            self.findings.problem(
                f"{key}._partial_", "must be true: the recipe calls the result with its own arguments"
            )
        known = schema_fields(section) if section is not None else {}
        same_target = "_target_" in known and section.__dataclass_fields__["_target_"].default == name
        for arg, value in values.items():
            child = f"{key}.{arg}"
            if arg.startswith("_"):  # Hydra's own: _target_, _partial_, _convert_, _recursive_, _args_
                continue
            if arg in known and known[arg][1].get("not_passed"):  # chattune's own key, whatever the target
                self.value(value, *known[arg], child)
            elif arg in given_by_recipe:
                self.findings.problem(child, "passed by the recipe; remove it from the config")
            elif arg not in accepted:
                match = closest(arg, accepted)
                hint = f"; did you mean {key}.{match}?" if match else ""
                if accepts_any:
                    self.findings.note(child, f"not a named parameter of {name} (passed on as an extra keyword){hint}")
                    if match:
                        self.findings.near_misses[child] = f"{key}.{match}"
                else:
                    self.findings.problem(
                        child, f"unknown key{hint}" if hint else f"unknown key: not a parameter of {name}"
                    )
            elif same_target and arg in known:
                self.value(value, *known[arg], child)
        for arg, parameter in list(parameters.items())[positional:]:
            if (
                parameter.default is parameter.empty
                and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
                and arg not in values
                and arg not in keywords
            ):
                self.findings.problem(f"{key}.{arg}", f"required by {name}, not set")

    def choices(self) -> None:
        for key, metadata in keys_with(self.schema, "choices"):
            self.choice(key, get_value(self.values, key), metadata["choices"])

    def choice(self, key: str, value: Any, choices) -> None:
        if isinstance(value, str) and value not in choices:
            self.findings.problem(key, f"{value!r} is not one of {', '.join(choices)}{did_you_mean(value, choices)}")

    def bounds(self) -> None:
        """Each key's `at_least` and `bound` in the schema."""
        for key, metadata in keys_with(self.schema, "at_least"):
            value, least = get_value(self.values, key), metadata["at_least"]
            if isinstance(value, int) and not isinstance(value, bool) and value < least:
                self.findings.problem(key, f"must be at least {least}, got {value}{metadata['hint']}")
        for key, metadata in keys_with(self.schema, "bound"):
            self.bound(key, *metadata["bound"])

    def bound(self, key: str, holds, message: str) -> None:
        value = get_value(self.values, key)
        if isinstance(value, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            pass  # a list of numbers (optimizer.betas)
        elif (value := number(self.values, key)) is None:
            return  # absent, null or of another type (reported by the type checks)
        if not holds(value):
            self.findings.problem(key, f"{message}, got {value}")


_GIVEN = object()  # a parameter's default, read from source: that it has one is all the checks ask


def target_parameters(name: str) -> tuple[Any, Mapping[str, inspect.Parameter]]:
    """(What `_target_` `name` names, or None where it was read from source; its parameters.)

    A function that a lazy package exports (transformers: `transformers.X` from its submodule) is read from its
    submodule's source when that submodule is not imported yet: importing transformers' scheduler module imports
    peft and bitsandbytes, two of the six seconds `chattune validate sft/tiny` took, for a list of parameters.
    Anything else (classes, other modules) is imported."""
    definition = _lazily_exported_function(name)
    if definition is not None:
        return None, _parameters_of(definition)
    target = get_object(name)
    return target, inspect.signature(target).parameters


def _lazily_exported_function(name: str) -> ast.FunctionDef | None:
    package_name, _, attribute = name.rpartition(".")
    package = sys.modules.get(package_name)
    submodule = getattr(package, "_class_to_module", {}).get(attribute) if package is not None else None
    if not isinstance(submodule, str) or f"{package_name}.{submodule}" in sys.modules:
        return None
    spec = importlib.util.find_spec(f"{package_name}.{submodule}")
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    tree = ast.parse(Path(spec.origin).read_text())
    return next((node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == attribute), None)


def _parameters_of(function: ast.FunctionDef) -> Mapping[str, inspect.Parameter]:
    args, P = function.args, inspect.Parameter
    positional = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    parameters = [
        P(
            arg.arg,
            P.POSITIONAL_ONLY if arg in args.posonlyargs else P.POSITIONAL_OR_KEYWORD,
            default=P.empty if default is None else _GIVEN,
        )
        for arg, default in zip(positional, defaults)
    ]
    if args.vararg:
        parameters.append(P(args.vararg.arg, P.VAR_POSITIONAL))
    parameters += [
        P(arg.arg, P.KEYWORD_ONLY, default=P.empty if default is None else _GIVEN)
        for arg, default in zip(args.kwonlyargs, args.kw_defaults)
    ]
    if args.kwarg:
        parameters.append(P(args.kwarg.arg, P.VAR_KEYWORD))
    return inspect.Signature(parameters).parameters


def error_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {first_line(error)}"


def missing_attribute(name: str) -> str | None:
    """For a dotted name whose module imports but holds no such attribute (a misspelled class): which, and the
    module's closest names (`transformers.Qwen35Config`: Qwen3_5Config, ...). None otherwise."""
    import difflib
    import importlib

    module_name, _, attribute = name.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except Exception:  # the module itself does not import: the caller reports that error
        return None
    # Found without importing anything: an attribute already set, or a name transformers' lazy module indexes
    # (hasattr would import its module: for the scheduler, peft and bitsandbytes, seconds that validate avoids).
    if attribute in vars(module) or attribute in getattr(module, "_class_to_module", {}):
        return None
    names = dir(module)  # half a second for transformers: only for a name it does not have
    near = difflib.get_close_matches(attribute, [n for n in names if not n.startswith("_")], n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(f'{module_name}.{n}' for n in near)}?" if near else ""
    return f"{module_name} has no {attribute}{hint}"
