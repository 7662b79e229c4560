"""The `chattune` command. Subcommands take the same `--config-name`, `--config-path` and `key=value`
overrides as the recipes.

    chattune inspect [--config-name sft/tiny] [--num-docs 3] [--limit N] [--html FILE] [key=value ...]
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from chattune.inspect_data import DEFAULT_CONFIG_DIR, run_inspect


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="chattune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    inspect = commands.add_parser("inspect", help="show what training will see: counts, lengths, fill, trained tokens")
    inspect.add_argument("--config-name", default="sft/tiny")
    inspect.add_argument("--config-path", type=Path, default=DEFAULT_CONFIG_DIR)
    inspect.add_argument("--num-docs", type=int, default=3, help="documents to show with their trained tokens")
    inspect.add_argument("--limit", type=int, default=None, help="read only the first N training records")
    inspect.add_argument("--html", type=Path, default=None, help="also write the report as an HTML page")
    inspect.add_argument("--color", action=argparse.BooleanOptionalAction, default=None,
                         help="colour trained tokens (default: when writing to a terminal)")
    inspect.add_argument("overrides", nargs="*", help="config overrides, key=value")

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # per-record skip warnings are summed up in the report
    colour = sys.stdout.isatty() if args.color is None else args.color
    print(run_inspect(args.config_name, args.overrides, args.config_path, args.num_docs, args.limit, args.html, colour))
    if args.html:
        print(f"\nwrote {args.html}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
