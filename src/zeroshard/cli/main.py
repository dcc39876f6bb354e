"""Entry point: one subcommand per module, each adding its own arguments."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from . import convert_cmd, demo_cmd, inspect_cmd, layout_report

SUBCOMMANDS = [demo_cmd, layout_report, inspect_cmd, convert_cmd]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zeroshard", description="ZeRO stage 1/2 training and checkpoint tools")
    commands = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS:
        module.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args) or 0
    except (ValueError, FileNotFoundError) as err:
        print(f"zeroshard {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
