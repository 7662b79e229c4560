"""The `chattune` command.

    chattune ls                                   the recipes and configs that ship, with what each is for
    chattune cp RECIPE|CONFIG DEST [--force]      copy one to edit it (DEST: a file or a directory)
    chattune inspect [CONFIG] [key=value ...]     what training will see: counts, lengths, fill, trained tokens
    chattune validate [CONFIG] [key=value ...]    check a config and its data before launching a run
    chattune prepare [CONFIG] [key=value ...]     tokenize its data once into token caches, before a big job
    chattune plot OUTPUT_DIR [...] [--out FILE]   training curves of one or more runs, overlaid, as a PNG
    chattune chat DIR [--prompts FILE] [...]      talk to an exported model (hf/, adapter/ or a run's output_dir)
    chattune export CHECKPOINT [--to DIR]         a checkpoint's model as the end of its run exports it (hf/, adapter/)
    chattune run [TORCHRUN OPTIONS] RECIPE [...]  torchrun that lets a stopping run finish its save (SIGTERM,
                                                  Ctrl-C) however long it takes, and exits 75 without a traceback
    chattune --version                            the installed version

CONFIG is a config name such as sft/tiny (or --config-name NAME); --config-path DIR takes configs from
your own directory, where they can build on the shipped ones (`defaults: [/sft/tiny, _self_]`). The
key=value overrides are the recipes' own.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from chattune.config.paths import CONFIG_DIR
from chattune.errors import UserError
from chattune.streams import keep_writing

DEFAULT_CONFIG = "sft/tiny"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    keep_writing()  # `chattune run ... | tee log`: a launcher whose reader died must still wait for its workers
    if argv[:1] == ["run"]:  # torchrun's own options and the recipe's overrides, passed on as they are
        return _run(argv[1:])
    parser = build_parser()
    # Overrides may follow options (`inspect sft/tiny --limit 5 key=value`): argparse leaves words after an
    # option unparsed, and they join the config words.
    args, extra = parser.parse_known_args(argv)
    if extra and (not hasattr(args, "words") or any(word.startswith("-") for word in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.words = [*args.words, *extra]
    announce(args)
    try:
        return args.handler(args, parser)
    except UserError as error:  # the user's to fix: one message, no traceback
        print(f"chattune {args.command}: error: {error}", file=sys.stderr)
        return 1


# The first line of a command that takes seconds (imports, the data's first records): said at once, on stderr.
_FIRST_LINES = {
    "validate": "checking {config}: every key, the data's first records, the output directory and its checkpoints",
    "inspect": "reading the data of {config}",
    "prepare": "tokenizing the data of {config} into token caches, where not done before",
}


def announce(args: argparse.Namespace) -> None:
    line = _FIRST_LINES.get(args.command)
    if line is not None:
        words = [word for word in args.words if "=" not in word and not word.startswith("~")]
        config = args.config_name or (words[0] if words else DEFAULT_CONFIG)
        print(f"chattune {args.command}: {line.format(config=config)} ...", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="chattune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    from chattune import __version__

    parser.add_argument("--version", action="version", version=f"chattune {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    ls = commands.add_parser("ls", help="list the shipped recipes and configs")
    ls.set_defaults(handler=_ls)

    cp = commands.add_parser("cp", help="copy a shipped recipe or config to edit it")
    cp.add_argument("name", metavar="RECIPE|CONFIG", help="e.g. sft, dpo, sft/tiny (see chattune ls)")
    # A str, not a Path: Path drops the trailing "/" that marks a directory still to be made.
    cp.add_argument(
        "dest", metavar="DEST", help="a file path, or a directory (existing, or ending in /) to keep the file name"
    )
    cp.add_argument("--force", action="store_true", help="overwrite DEST if it exists")
    cp.set_defaults(handler=_cp)

    inspect = commands.add_parser("inspect", help="show what training will see: counts, lengths, fill, trained tokens")
    _add_config_arguments(inspect)
    inspect.add_argument("--num-docs", type=int, default=3, help="documents to show with their trained tokens")
    inspect.add_argument("--limit", type=int, default=None, help="read only the first N training records")
    inspect.add_argument("--html", type=Path, default=None, help="also write the report as an HTML page")
    inspect.add_argument(
        "--color",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="colour trained tokens (default: when writing to a terminal)",
    )
    inspect.set_defaults(handler=_inspect)

    validate = commands.add_parser("validate", help="check a config and its data before launching a run")
    _add_config_arguments(validate)
    validate.add_argument(
        "--ranks", type=int, default=None, help="plan for this many ranks: checks and the memory estimate's table"
    )
    validate.add_argument(
        "--device-memory",
        default=None,
        metavar="SIZE",
        help="end with the memory estimate's table, planned for a GPU of this size, e.g. 24GiB or 80GB",
    )
    validate.set_defaults(handler=_validate)

    prepare = commands.add_parser("prepare", help="tokenize a config's data once into token caches (data.cache)")
    _add_config_arguments(prepare)
    prepare.set_defaults(handler=_prepare)

    plot = commands.add_parser("plot", help="draw training curves of one or more runs as a PNG")
    plot.add_argument(
        "run_dirs", metavar="OUTPUT_DIR", nargs="+", type=Path, help="run output directories (metrics.jsonl)"
    )
    plot.add_argument(
        "--out",
        type=Path,
        default=None,
        help="PNG to write (default: OUTPUT_DIR/metrics.png for one run, ./metrics.png for several)",
    )
    plot.set_defaults(handler=_plot)

    chat = commands.add_parser("chat", help="talk to an exported model (hf/ or adapter/), or answer a file of prompts")
    from chattune.cli.chat import add_arguments  # (argparse only: the model's imports wait for the command)

    add_arguments(chat)
    chat.set_defaults(handler=_chat)

    export = commands.add_parser(
        "export", help="write a checkpoint's model as the end of its run would (hf/, adapter/), e.g. of a stopped run"
    )
    export.add_argument(
        "checkpoint", metavar="CHECKPOINT", type=Path, help="OUTPUT_DIR/checkpoints/step_N, or OUTPUT_DIR: its newest"
    )
    export.add_argument(
        "--to",
        type=Path,
        default=None,
        help="directory to write hf/ (and adapter/) into (default: OUTPUT_DIR/exports/step_N)",
    )
    export.set_defaults(handler=_export)

    # (listed for --help; `main` hands its arguments to torchrun's parser unread)
    commands.add_parser(
        "run", help="launch a recipe as torchrun does, letting a stopped run finish its save", add_help=False
    )
    return parser


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config-name", default=None, help=f"config to compose (default: {DEFAULT_CONFIG})")
    parser.add_argument(
        "--config-path",
        default=None,
        help="directory of configs, as the recipe's --config-path: absolute, or relative to the recipe's "
        "directory as Hydra resolves it (default: the shipped configs, which stay reachable from yours)",
    )
    parser.add_argument(
        "--config-dir",
        type=Path,
        default=None,
        help="a further directory of configs, searched first (relative to here), as the recipe's --config-dir",
    )
    parser.add_argument(
        "--recipe",
        type=Path,
        default=None,
        help="the recipe file: a relative --config-path is resolved from it, and `validate` checks the keys "
        "its kind declares (a copied recipe's own; default: the shipped recipe)",
    )
    parser.add_argument(
        "words", nargs="*", metavar="[CONFIG] key=value", help="a config name, as --config-name, then config overrides"
    )


def config_location(args: argparse.Namespace, config_name: str) -> tuple[Path, Path | None]:
    """(--config-path resolved as the recipe resolves it, --config-dir)."""
    from chattune.cli.catalog import RECIPES_DIR
    from chattune.config.paths import resolve_config_path

    if args.config_path is None:
        return CONFIG_DIR, args.config_dir
    recipe = args.recipe or RECIPES_DIR / f"{config_name.split('/')[0]}.py"
    return resolve_config_path(args.config_path, recipe.resolve()), args.config_dir


def config_and_overrides(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[str, list[str]]:
    """The config name and overrides: a first word that is no override (no '=', not ~key) names the config."""
    words = list(args.words)
    if words and "=" not in words[0] and not words[0].startswith("~"):
        if args.config_name is not None:
            parser.error(f"config given twice: --config-name {args.config_name} and {words[0]}")
        return words[0], words[1:]
    return args.config_name or DEFAULT_CONFIG, words


def _ls(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from chattune.cli.catalog import listing

    print(listing())
    return 0


def _cp(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from chattune.cli.catalog import copy

    target, notes = copy(args.name, args.dest, args.force)
    print(f"wrote {target}")
    for note in notes:
        print(note)
    return 0


def _inspect(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from chattune.cli.inspect_data import run_inspect  # transformers and the data pipeline: only when needed

    config_name, overrides = config_and_overrides(args, parser)
    logging.basicConfig(level=logging.ERROR)  # per-record skip warnings are summed up in the report
    colour = sys.stdout.isatty() if args.color is None else args.color
    config_path, config_dir = config_location(args, config_name)
    print(run_inspect(config_name, overrides, config_path, args.num_docs, args.limit, args.html, colour, config_dir))
    if args.html:
        print(f"\nwrote {args.html}")
    return 0


def _validate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from chattune.launch.memory_plan import MemoryPlan
    from chattune.launch.recipe_kinds import kind_of_recipe
    from chattune.launch.validate import run_validate

    config_name, overrides = config_and_overrides(args, parser)
    config_path, config_dir = config_location(args, config_name)
    kind = kind_of_recipe(args.recipe) if args.recipe is not None else None  # a copied recipe's own keys
    from chattune.model.cost.memory import parse_size

    try:
        device_memory = parse_size(args.device_memory) if args.device_memory is not None else None
    except ValueError as error:
        parser.error(f"--device-memory: {error}")
    # The memory estimate's table where a plan asks for it (--ranks, --device-memory)
    planned = args.ranks is not None or device_memory is not None
    plan = {"world_size": args.ranks, "memory": MemoryPlan(device_memory)} if planned else {}
    report, ok = run_validate(
        config_name, overrides, config_path, config_dir=config_dir, read_data=True, kind=kind, **plan
    )
    print(report)
    return 0 if ok else 1


def _prepare(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from chattune.cli.prepare import run_prepare

    config_name, overrides = config_and_overrides(args, parser)
    logging.basicConfig(level=logging.WARNING)
    config_path, config_dir = config_location(args, config_name)
    print(run_prepare(config_name, overrides, config_path, config_dir))
    return 0


def _plot(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from chattune.cli.plot import plot_runs

    out = args.out or (args.run_dirs[0] / "metrics.png" if len(args.run_dirs) == 1 else Path("metrics.png"))
    plot_runs(args.run_dirs, out)
    print(f"wrote {out}")
    return 0


def _chat(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from chattune.cli.chat import run_chat

    logging.basicConfig(level=logging.WARNING)
    return run_chat(args)


def _export(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from chattune.cli.export import export_checkpoint
    from chattune.log import setup_logging

    setup_logging(0)
    exported = export_checkpoint(args.checkpoint, args.to)
    for name, path in exported.written.items():
        print(f"chattune export: {name}: {path}", file=sys.stderr)
    print(exported.next_step(), file=sys.stderr)
    return 0


def _run(argv: list[str]) -> int:
    from chattune.cli.run import main as run_main

    try:
        return run_main(argv)
    except UserError as error:
        print(f"chattune run: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
