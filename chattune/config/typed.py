"""The config a run reads: the schema's dataclasses (`chattune.config.schema`), built from the composed Hydra
config once it has been checked.

Hydra composes a `DictConfig` (YAML files and overrides) and the launch checks all of it against the schema
(`chattune.launch.validate.check_config`); from then on a recipe and the library read typed values (an
`SFTConfig`, a `DPOConfig`, or the subclass a copied recipe declares with keys of its own), with every
interpolation resolved, so a value cannot change between two reads and a key the schema does not know cannot
be read at all.

Two kinds of section stay mappings, as the schema says of them: a section with a `_target_` (the optimizer,
the scheduler, `model.config`) holds the keyword arguments of the callable it names, whatever they are, and
stays a resolved `DictConfig` for `hydra.utils.instantiate`; an open section (`wandb`, passed to `wandb.init`
as it is) is a plain dict. Lists and mappings of values (data sources) are plain lists and dicts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf

from chattune.config.schema import schema_fields, section_type

Config = TypeVar("Config")


def typed_config(cfg: DictConfig, schema: type[Config]) -> Config:
    """`cfg` (composed and checked against `schema`) as an instance of `schema`, interpolations resolved."""
    values = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(values, dict)  # a config's top level is a mapping
    return _build(schema, values, "")


def _build(section: type, values: dict[Any, Any], prefix: str) -> Any:
    fields = schema_fields(section)
    unknown = sorted(set(values) - set(fields))
    if unknown:  # the checks report unknown keys before this: reaching it is a bug, not a user error
        raise ValueError(f"keys {[prefix + name for name in unknown]} are not in {section.__name__}")
    arguments = {}
    for name, value in values.items():
        hint, metadata = fields[name]
        nested = section_type(hint)
        if nested is None or value is None:
            arguments[name] = value
        elif "_target_" in schema_fields(nested):
            arguments[name] = OmegaConf.create(value)
        elif metadata["open_section"]:
            arguments[name] = dict(value)
        else:
            arguments[name] = _build(nested, value, f"{prefix}{name}.")
    return section(**arguments)


def config_dict(cfg: Any) -> Any:
    """A config, a section of one or a value of one as plain, resolved Python (dicts, lists, scalars), whether
    it is typed (the schema's dataclasses) or a `DictConfig`: what a fingerprint, a cache key or a file stores."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {field.name: config_dict(getattr(cfg, field.name)) for field in dataclasses.fields(cfg)}
    if OmegaConf.is_config(cfg):
        return OmegaConf.to_container(cfg, resolve=True)
    if isinstance(cfg, dict):
        return {name: config_dict(value) for name, value in cfg.items()}
    if isinstance(cfg, (list, tuple)):
        return [config_dict(value) for value in cfg]
    return cfg
