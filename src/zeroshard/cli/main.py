"""Entry point: one subcommand per module, each adding its own arguments.

Only the module of the command being run is imported, so ``inspect``, ``to-universal`` and
``to-fp32`` start without importing torch (about 1.5 s and 200 MB); ``--help`` imports them all.

Exit status: 0 success, 1 ``inspect --verify`` found damage, 2 an error in what was given (a
bad argument, a missing, unreadable or damaged file, a full disk), 3 a bug in zeroshard.
Every error is one line on stderr; ``--debug`` or ``ZEROSHARD_DEBUG=1`` shows the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import NoReturn, Sequence

from .. import __version__
from .errors import describe_error, is_user_error

# command -> the module (in this package) that registers and runs it
COMMANDS = {
    "demo": "demo_cmd",
    "layout": "layout_report",
    "inspect": "inspect_cmd",
    "to-universal": "convert_cmd",
    "to-fp32": "convert_cmd",
}
DEBUG_ENV = "ZEROSHARD_DEBUG"
USER_ERROR, INTERNAL_ERROR, INTERRUPTED = 2, 3, 130  # 128 + SIGINT


class OneLineParser(argparse.ArgumentParser):
    """Usage errors in one line that points at ``--help`` (argparse prints the whole usage)."""

    def error(self, message: str) -> NoReturn:
        """Print ``message`` in one line that points at ``--help`` and exit with status 2.

        Raises:
            SystemExit: always (argparse's exit).
        """
        self.exit(USER_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


VERSION_FLAG = "--version"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with every subcommand, or with just the module of ``command`` if known
    (none for ``--version``, which imports nothing)."""
    parser = OneLineParser(prog="zeroshard", description="ZeRO stage 1/2 training and checkpoint tools")
    parser.add_argument(VERSION_FLAG, action="version", version=f"zeroshard {__version__}")
    _add_debug_flag(parser, argparse.SUPPRESS)
    commands = parser.add_subparsers(dest="command", required=True)
    if command == VERSION_FLAG:
        modules = []
    else:
        modules = [COMMANDS[command]] if command in COMMANDS else list(dict.fromkeys(COMMANDS.values()))
    for name in modules:
        importlib.import_module(f"{__package__}.{name}").register(commands)
    for subparser in commands.choices.values():
        _add_debug_flag(subparser, argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``zeroshard`` on ``argv`` (default: ``sys.argv[1:]``); returns the exit status (see
    the module docstring). Every error the command raises becomes one line on stderr and
    status 2 (bad input) or 3 (a bug), unless ``--debug`` or ZEROSHARD_DEBUG=1 re-raises it.

    Raises:
        SystemExit: from argparse, for a usage error (status 2), ``--help`` or ``--version`` (0).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    _print_any_path()
    args = build_parser(_command_of(argv)).parse_args(argv)
    debug = getattr(args, "debug", False) or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    try:
        return args.run(args) or 0
    except BrokenPipeError:  # stdout closed early (``zeroshard inspect X | head``): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit flush is quiet
        return 0
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"zeroshard {args.command}: interrupted", file=sys.stderr)
        return INTERRUPTED
    except Exception as err:  # noqa: BLE001 - the one place every failure becomes one line
        if debug:
            raise
        if is_user_error(err):
            print(f"zeroshard {args.command}: error: {describe_error(err)}", file=sys.stderr)
            return USER_ERROR
        print(
            f"zeroshard {args.command}: internal error: {type(err).__name__}: {describe_error(err)} "
            f"(a bug; rerun with --debug or {DEBUG_ENV}=1 for the traceback)",
            file=sys.stderr,
        )
        return INTERNAL_ERROR


def _print_any_path() -> None:
    """A path the terminal's encoding cannot show (non-ASCII under ``PYTHONIOENCODING=ascii``
    or a C locale, undecodable bytes in a file name) is printed escaped (``\\xfc``): printing
    it raised UnicodeEncodeError after the work was done, and the command reported failure."""
    for stream in (sys.stdout, sys.stderr):
        if getattr(stream, "errors", None) == "strict" and hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")


def _add_debug_flag(parser: argparse.ArgumentParser, default: object) -> None:
    parser.add_argument(
        "--debug", action="store_true", default=default, help=f"show tracebacks (or set {DEBUG_ENV}=1)"
    )


def _command_of(argv: list[str]) -> str | None:
    """The subcommand named in ``argv`` (the first word that is not an option), or
    ``--version`` when that comes first."""
    for word in argv:
        if word == VERSION_FLAG:
            return VERSION_FLAG
        if not word.startswith("-"):
            return word
    return None


if __name__ == "__main__":
    sys.exit(main())
