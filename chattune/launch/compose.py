"""Composing a config as a recipe composes it, for `chattune validate`, `chattune inspect` and a recipe's
launch (`chattune.launch.app`): the same search path (--config-path, --config-dir, the shipped
configs), and each override that Hydra refuses reported on its own line rather than stopping at the first.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hydra import compose
from hydra._internal.hydra import Hydra  # Hydra's own set-up, so --config-dir is searched as a recipe searches it
from hydra._internal.utils import create_config_search_path
from hydra.core.config_search_path import SearchPathQuery
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from chattune.config.paths import CONFIG_DIR  # importing chattune.config.paths also registers ${demo_asset:...}
from chattune.launch.findings import Findings, closest, did_you_mean, dotted_keys, first_line, get_value


@contextmanager
def hydra_search_path(config_path: Path, config_dir: Path | None = None) -> Iterator[None]:
    """Hydra initialised as a recipe initialises it: configs from `config_path` (its --config-path, or
    the shipped configs), with `config_dir` (--config-dir) searched before it and the shipped configs
    after it (the search-path plugin)."""
    search_path = create_config_search_path(str(Path(config_path).resolve()))
    if config_dir is not None:
        search_path.prepend(
            provider="command-line",
            path=f"file://{Path(config_dir).resolve()}",
            anchor=SearchPathQuery(provider="schema"),
        )
    Hydra.create_main_hydra2(task_name="chattune", config_search_path=search_path)
    try:
        yield
    finally:
        GlobalHydra.instance().clear()


def composed(
    config_name: str, overrides: list[str], config_path: Path, config_dir: Path | None = None
) -> DictConfig | None:
    """The config as Hydra composes it from this command line (a recipe's launch does exactly this first), or
    None where Hydra cannot."""
    overrides = whole_sections(config_name, overrides, config_path, config_dir)
    with hydra_search_path(config_path, config_dir):
        return _try_compose(config_name, overrides)[0]


def whole_sections(
    config_name: str, overrides: list[str], config_path: Path, config_dir: Path | None = None
) -> list[str]:
    """`overrides` with each `_target_` section given whole (`model.config={_target_: transformers.Qwen3MoeConfig,
    hidden_size: 64, ...}`, with or without `+`) made to replace the section it names, as the user means it:
    Hydra merges a dict into a section, so the old class's other arguments stayed (a Llama config's
    `num_experts_per_tok` under a Qwen3-MoE class) and a key the old section lacked was refused. Such an
    override becomes `~KEY +KEY=VALUE`; every other override stays as it is. The recipe's launch and
    `chattune validate` both compose through this, so they agree."""
    given = {i: key for i, override in enumerate(overrides) if (key := whole_section_key(override)) is not None}
    if not given:
        return list(overrides)
    with hydra_search_path(config_path, config_dir):
        base, _ = _try_compose(config_name, [o for i, o in enumerate(overrides) if i not in given])
    if base is None:  # the other overrides fail: they are reported as they are
        return list(overrides)
    out: list[str] = []
    for i, override in enumerate(overrides):
        key = given.get(i)
        if key is not None and isinstance(OmegaConf.select(base, key, throw_on_missing=False), DictConfig):
            out += [f"~{key}", f"+{key}={override.split('=', 1)[1]}"]
        else:
            out.append(override)
    return out


def whole_section_key(override: str) -> str | None:
    """The key of `KEY={_target_: ..., ...}` or `+KEY={...}` (an object given whole), else None."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType

    if "=" not in override or "_target_" not in override:
        return None
    try:
        parsed = OverridesParser.create().parse_override(override)
    except HydraException:  # reported where it is composed
        return None
    if parsed.type not in (OverrideType.CHANGE, OverrideType.ADD) or parsed.is_sweep_override():
        return None
    value = parsed.value()
    return parsed.key_or_group if isinstance(value, dict) and "_target_" in value else None


def compose_reporting(
    config_name: str, overrides: list[str], config_path: Path, findings: Findings, config_dir: Path | None = None
) -> tuple[DictConfig | None, dict[str, str]]:
    """The composed config (None if even the bare config fails) and the keys that were only added by
    retrying an override as `+key=value` (key -> override). Failing overrides are reported and left out."""
    added: dict[str, str] = {}
    for flag, directory in (("--config-path", config_path), ("--config-dir", config_dir)):
        if directory is not None and not Path(directory).is_dir():
            hint = (
                " (a relative --config-path is resolved from the recipe's directory, as Hydra does: give an "
                "absolute path, or --config-dir DIR for a directory relative to where you are)"
                if flag == "--config-path"
                else ""
            )
            findings.problem(flag, f"{directory} is not a directory{hint}")
            return None, added
    overrides = whole_sections(config_name, overrides, config_path, config_dir)
    with hydra_search_path(config_path, config_dir):
        cfg, _ = _try_compose(config_name, overrides)
        if cfg is not None:
            return cfg, added
        cfg, error = _try_compose(config_name, [])
        if cfg is None:
            searched = [d for d in (config_dir, config_path, CONFIG_DIR) if d is not None]
            names = set().union(*map(_config_names, searched)) - {config_name}
            findings.problem(
                "config",
                f"{config_name} from {' or '.join(map(str, dict.fromkeys(searched)))}: "
                f"{first_line(error)}{did_you_mean(config_name, names)}",
            )
            return None, added
        accepted: list[str] = []  # one override at a time, to find those at fault
        searched = [d for d in (config_dir, config_path, CONFIG_DIR) if d is not None]
        for override in overrides:
            cfg, error = _try_compose(config_name, [*accepted, override])
            if cfg is not None:
                accepted.append(override)
            elif (unselected := _unselected_group(config_name, accepted, override, searched)) is not None:
                findings.problem(override.lstrip("+~").split("=", 1)[0], unselected)
            elif (unknown := _unknown_group_choice(override, searched)) is not None:
                findings.problem(override.lstrip("+~").split("=", 1)[0], unknown)
            elif override[:1] not in "+~" and _try_compose(config_name, [*accepted, "+" + override])[0] is not None:
                accepted.append("+" + override)
                added[override.split("=", 1)[0]] = override
            else:
                findings.problem(f"override {override!r}", first_line(error))
        return compose(config_name, overrides=accepted), added


def required_keys(config_name: str, config_dirs: list[Path]) -> list[str]:
    """The keys the config file itself marks ??? (required). Merging keeps a value from the configs it
    builds on over a ???, so the composed config does not show them missing: a recipe would silently run
    with the parent's value (e.g. sft/tiny's model)."""
    for directory in (*config_dirs, CONFIG_DIR):  # the search path's order
        path = directory / f"{config_name}.yaml"
        if path.is_file():
            if "/" in config_name and "@package _global_" not in path.read_text():
                return []  # its keys live under its group's package, where a ??? shows as missing anyway
            raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
            return [key for key in dotted_keys(raw) if get_value(raw, key) == "???"]
    return []


def _unselected_group(config_name: str, accepted: list[str], override: str, searched: list[Path]) -> str | None:
    """The advice for a key set inside a config group that is null here (`peft.rank=8` without `peft=lora`):
    choose one of the group's configs first. (Hydra would advise `+peft.rank=8`, which makes a section of
    that one key.) None when the override is not of that kind."""
    key = override.lstrip("+~").split("=", 1)[0]
    group = key.split(".", 1)[0]
    options = _group_configs(group, searched)
    if "." not in key or not options:
        return None
    cfg, _ = _try_compose(config_name, accepted)
    if cfg is None or group not in cfg or cfg[group] is not None:
        return None
    return (
        f"{group} is null in this config: choose one first, {' or '.join(f'{group}={o}' for o in options)} "
        f"(e.g. {group}={options[0]} {override})"
    )


def _group_configs(group: str, searched: list[Path]) -> list[str]:
    """The names of the configs of group `group` (configs/peft/*.yaml: lora, qlora) on the search path."""
    return sorted({p.stem for d in searched if (d / group).is_dir() for p in (d / group).glob("*.yaml")})


def _unknown_group_choice(override: str, searched: list[Path]) -> str | None:
    """The problem of `GROUP=NAME` naming a config its group does not have (`peft=lorra`): the nearest of its
    configs, and all of them. (Hydra says only "Could not find 'peft/lorra'".) None for any other override."""
    group, equals, name = override.lstrip("+~").partition("=")
    options = _group_configs(group, searched) if equals and "." not in group else []
    if not options or name in options:
        return None
    if name == "null":  # (Hydra raises a ValueError for it)
        return (
            f"a config group is left out with ~{group}, not {group}=null (the configs of {group}: {', '.join(options)})"
        )
    nearest = closest(name, options)
    hint = f"; did you mean {group}={nearest}?" if nearest else ""
    return f"no config {group}/{name}{hint} (the configs of {group}: {', '.join(options)})"


def _try_compose(config_name: str, overrides: list[str]) -> tuple[DictConfig | None, Exception | None]:
    try:
        return compose(config_name, overrides=overrides), None
    except (HydraException, OmegaConfBaseException, ValueError) as error:  # ValueError: Hydra's, for `peft=null`
        return None, error


def _config_names(directory: Path) -> set[str]:
    return {str(p.relative_to(directory).with_suffix("")) for p in directory.rglob("*.yaml")}
