"""Argument types that refuse impossible values when the command line is parsed."""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    """An integer of at least 1 (argparse.ArgumentTypeError otherwise)."""
    return _at_least(text, 1)


def at_least(minimum: int):
    """An argument type: an integer of at least ``minimum`` (argparse.ArgumentTypeError otherwise)."""

    def parse(text: str) -> int:
        return _at_least(text, minimum)

    parse.__name__ = f"integer >= {minimum}"  # argparse names the type in "invalid ... value"
    return parse


def positive_float(text: str) -> float:
    """A finite number above 0 (argparse.ArgumentTypeError otherwise)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def _at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
    return value
