"""How a recipe is launched: a Hydra app whose command line chattune checks first, and whose user errors
are printed once.

    @recipe_main(config_name="sft/tiny")
    def main(cfg: DictConfig) -> None: ...

    if __name__ == "__main__":
        main()

On top of `hydra.main`:
- Hydra's flags may come after overrides (`recipes/sft.py max_steps=3 --config-name sft/local_model`): they are
  put first, as Hydra's parser needs them (`hydra_flags_first`);
- a command line Hydra cannot compose (a typo'd key, a value it cannot parse, a config that does not
  exist) is reported as `chattune validate` reports it: every problem at once, an unknown key with the
  nearest valid one, instead of Hydra's first error and its advice to add the key with `+`;
- a relative `--config-path` is resolved from the recipe's own file, as Hydra does (`chattune validate
  --recipe FILE` resolves it the same way);
- `report_errors`: a user error is printed once, without a traceback, on any number of ranks;
- the process ends as soon as the run is done (`exit_process`).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path

import hydra
from hydra._internal.utils import get_args_parser
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from chattune import interrupts, streams
from chattune.config.paths import CONFIG_DIR, resolve_config_path
from chattune.distributed import exit_process, shutdown_distributed
from chattune.errors import report_errors, write_error_file
from chattune.launch.compose import composed, whole_section_key, whole_sections
from chattune.launch.findings import ConfigError
from chattune.launch.recipe_kinds import RECIPE_KIND_ATTRIBUTE, RecipeKind
from chattune.launch.run_rules import output_dir_problem
from chattune.launch.validate import hydra_placement_problems, validate_command

CONFIG_PATH_FLAGS = ("--config-path", "-cp")
_HYDRA_COMMANDS = ("help", "hydra_help", "cfg", "info", "shell_completion", "multirun")  # not a training run


def with_absolute_config_path(argv: list[str], recipe_file: Path) -> list[str]:
    """`argv` with a relative --config-path (-cp) made absolute, resolved as Hydra would for `recipe_file`
    (the decorated recipe: Hydra would otherwise resolve it from this module's directory)."""
    out, argv = [], list(argv)
    while argv:
        word = argv.pop(0)
        flag, equals, value = word.partition("=")
        if flag in CONFIG_PATH_FLAGS and (equals or argv):
            value = value if equals else argv.pop(0)
            out += [flag, str(resolve_config_path(value, recipe_file))]
        else:
            out.append(word)
    return out


def hydra_flags_first(words: list[str]) -> list[str]:
    """A recipe's command-line `words` with Hydra's flags (and their values) before the overrides, each in its own
    order: Hydra's parser takes the overrides as one run of words, so `max_steps=3 --config-name sft/local_model
    data.eval=[]` stopped every rank with its usage message ("unrecognized arguments: data.eval=[]"), where the
    user means the config and the overrides whatever their order. A word that is no flag Hydra knows stays where it
    is, for Hydra to refuse."""
    actions = {option: action for action in get_args_parser()._actions for option in action.option_strings}
    flags: list[str] = []
    overrides: list[str] = []
    words = list(words)
    while words:
        word = words.pop(0)
        if not word.startswith("-"):
            overrides.append(word)
            continue
        flags.append(word)
        action = actions.get(word)  # (a `--flag=value` word, or a word Hydra does not know, takes no other)
        if action is None or not words:
            continue
        if action.nargs is None or (action.nargs == "?" and words[0] in (action.choices or ())):
            flags.append(words.pop(0))
    return [*flags, *overrides]


def with_whole_sections(argv: list[str], default_config: str) -> list[str]:
    """`argv` with each `_target_` section given whole (`model.config={_target_: ..., ...}`) replacing the
    section, as `chattune validate` composes it (`chattune.launch.compose.whole_sections`): `~KEY +KEY=VALUE`
    for Hydra, which would merge it. argv[1:]'s --config-path already absolute."""
    if not any("_target_" in word for word in argv[1:]):
        return argv
    args = get_args_parser().parse_args(argv[1:])  # (with --cfg job too: it shows what would run)
    config_path = Path(args.config_path) if args.config_path else CONFIG_DIR
    config_dir = Path(args.config_dir) if args.config_dir else None
    if not config_path.is_dir() or (config_dir is not None and not config_dir.is_dir()):
        return argv  # check_command_line reports it
    expanded = whole_sections(args.config_name or default_config, args.overrides, config_path, config_dir)
    out = [argv[0]]
    for word in argv[1:]:
        key = whole_section_key(word) if word in args.overrides else None
        if key is not None and f"~{key}" in expanded and f"~{key}" not in args.overrides:
            out += [f"~{key}", f"+{key}={word.split('=', 1)[1]}"]
        else:
            out.append(word)
    return out


def check_command_line(argv: list[str], default_config: str, kind: RecipeKind | None = None) -> None:
    """Raise a ConfigError with every problem `chattune validate` finds when Hydra cannot compose the
    config of this command line (argv[1:], its --config-path already absolute). `kind`: the recipe's."""
    args = get_args_parser().parse_args(argv[1:])
    placement = hydra_placement_problems(args.overrides)
    if placement:
        raise ConfigError(placement)
    if any(getattr(args, name) for name in _HYDRA_COMMANDS):
        return  # Hydra's own commands (--help, --cfg job, ...): Hydra answers them
    config_name = args.config_name or default_config
    if os.environ.get("RANK", "0") == "0":  # the first line of a launch, before the seconds of checks and loading
        print(
            f"chattune: {Path(argv[0]).stem} with {config_name} on {os.environ.get('WORLD_SIZE', '1')} rank(s): "
            "checking the config, then reading the data and loading the model",
            file=sys.stderr,
            flush=True,
        )
    config_path = Path(args.config_path) if args.config_path else CONFIG_DIR
    config_dir = Path(args.config_dir) if args.config_dir else None
    if config_dir is None or config_dir.is_dir():
        cfg = composed(config_name, args.overrides, config_path, config_dir) if config_path.is_dir() else None
        if cfg is not None:
            # Hydra creates output_dir (its run directory) before the recipe runs: say why it cannot, first.
            output_dir = OmegaConf.select(cfg, "output_dir", throw_on_resolution_failure=False)
            problem = output_dir_problem(Path(output_dir)) if isinstance(output_dir, str) else None
            if problem is not None:
                raise ConfigError([f"output_dir: {problem}"])
            return  # the recipe checks the composed config itself (check_config), with every other problem
    findings = validate_command(
        config_name, args.overrides, (config_path, config_dir), int(os.environ.get("WORLD_SIZE", "1")), kind=kind
    )
    if findings.problems:
        raise ConfigError(findings.problems)


def job_config(cfg: DictConfig) -> DictConfig:
    """A multirun (-m) job trains into a directory of its own, output_dir/<job number> (its overrides are in
    its config.yaml): jobs into one output_dir would refuse each other. A single run: `cfg` as it is."""
    hydra_config = HydraConfig.get()
    if hydra_config.mode != RunMode.MULTIRUN:
        return cfg
    cfg.output_dir = str(Path(cfg.output_dir) / str(hydra_config.job.num))
    if os.environ.get("RANK", "0") == "0":
        print(
            f"chattune: multirun job {hydra_config.job.num} ({' '.join(hydra_config.overrides.task)}) -> "
            f"output_dir={cfg.output_dir}",
            file=sys.stderr,
            flush=True,
        )
    return cfg


def recipe_main(
    config_name: str, kind: RecipeKind | None = None
) -> Callable[[Callable[[DictConfig], None]], Callable[[], None]]:
    """Decorate a recipe's `main(cfg)`: the result is called without arguments and reads the command line.
    `kind`: the recipe's kind (`chattune.launch.recipe_kinds`: SFT, DPO, or one `extended` with a schema of
    the recipe's own), which a command line Hydra cannot compose is checked against and `chattune validate
    --recipe FILE` reads (the function's `recipe_kind`); the recipe passes it to `check_config` itself."""

    def decorate(task: Callable[[DictConfig], None]) -> Callable[[], None]:
        recipe_file = Path(inspect.getfile(task)).resolve()

        def run_task(cfg: DictConfig) -> None:
            with report_errors():
                task(job_config(cfg))

        app = hydra.main(config_path=str(CONFIG_DIR), config_name=config_name, version_base=None)(run_task)

        @functools.wraps(task)
        def launch() -> None:
            streams.keep_writing()  # a log reader that dies (`| tee` on Ctrl-C) must not take the run with it
            interrupts.install()  # a signal from here on stops the run after a step, with a checkpoint
            with report_errors():
                sys.argv = [sys.argv[0], *hydra_flags_first(sys.argv[1:])]
                sys.argv = with_absolute_config_path(sys.argv, recipe_file)
                sys.argv = with_whole_sections(sys.argv, config_name)
                check_command_line(sys.argv, config_name, kind)
            try:
                app()
            except interrupts.Preempted as stopped:  # its checkpoint is saved; every rank stopped after the same step
                if os.environ.get("RANK", "0") == "0":
                    print(f"chattune: {stopped}", file=sys.stderr, flush=True)
                write_error_file(str(stopped))  # what torchrun's report of the exit status shows
                shutdown_distributed()
                exit_process(interrupts.exit_code(stopped.code))
            exit_process()  # the run is complete; skip interpreter teardown (see exit_process)

        setattr(launch, RECIPE_KIND_ATTRIBUTE, kind)
        return launch

    return decorate
