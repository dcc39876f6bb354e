"""Entry point: one subcommand per module, each adding its own arguments.

Only the module of the command being run is imported, so ``to-universal`` and ``to-fp32``
start without importing torch (about 1.5 s and 200 MB); ``--help`` imports them all.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

# command -> the module (in this package) that registers and runs it
COMMANDS = {
    "demo": "demo_cmd",
    "layout": "layout_report",
    "inspect": "inspect_cmd",
    "to-universal": "convert_cmd",
    "to-fp32": "convert_cmd",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with every subcommand, or with just the module of ``command`` if known."""
    parser = argparse.ArgumentParser(prog="zeroshard", description="ZeRO stage 1/2 training and checkpoint tools")
    commands = parser.add_subparsers(dest="command", required=True)
    modules = [COMMANDS[command]] if command in COMMANDS else list(dict.fromkeys(COMMANDS.values()))
    for name in modules:
        importlib.import_module(f"{__package__}.{name}").register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    try:
        return args.run(args) or 0
    except (ValueError, FileNotFoundError) as err:
        print(f"zeroshard {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
