"""What reading one file may cost: a byte budget proportional to the file's size.

Every object a reader takes from a file is bounded by the reader's checks, but shared
references (a pickle's memo) let a small file hand out one object many times. So each file a
load, conversion or inspection reads gets one :class:`Budget` of ``FACTOR`` bytes per byte of
the file plus ``CONSTANT``, and the readers charge it for what the file makes them allocate,
copy, repeat or print: container copies, containers a pickle creates, the bytes of every
tensor view they keep, values and names they copy into an output. Going over is a one-line
:class:`BudgetExceeded` naming the file. (A JSON manifest shares nothing, so it costs a small
multiple of its bytes to parse; a count it declares, a world size, is compared with what it
lists before a reader acts on it.)

:func:`quoted` words a value read from a file for an error message by its type and length
when it is not short, so that a message never calls the ``repr()`` of a file-built object
(a doubling chain of objects takes exponential time to print) and stays one short line.
"""

from __future__ import annotations

import os
from typing import Any

FACTOR = 16  # bytes a reader may spend per byte of the file
CONSTANT = 1 << 20  # and this much for any file, however small
# A hot path (once per file, thousands of files) may leave out a charge of at most this
# much, a few times per file: the constant covers it, and the call costs more than the bytes.
UNCHARGED_BYTES = 64 << 10

# What charges count, in bytes (CPython 3.11 on 64-bit, measured): a reference in a list or
# tuple, an entry of a set and of a dict (an instance __dict__ too).
REFERENCE_BYTES = 8
SET_ITEM_BYTES = 48
DICT_ITEM_BYTES = 56


class BudgetExceeded(ValueError):
    """A file would make a reader spend more than its budget."""


class Budget:
    """What the reader of one file of ``file_bytes`` bytes (``path``) may still spend.

    Not locked: threads charging one budget at once may lose a charge, never add one."""

    __slots__ = ("file_bytes", "limit", "path", "spent")

    def __init__(self, path: str | os.PathLike[str], file_bytes: int) -> None:
        if file_bytes < 0:
            raise ValueError(f"{path}: a file of {file_bytes} bytes")
        self.path = path
        self.file_bytes = file_bytes
        self.limit = FACTOR * file_bytes + CONSTANT
        self.spent = 0

    def charge(self, nbytes: int, what: str, *details: Any) -> None:
        """Spend ``nbytes`` on ``what`` (a few words, "copying {:,} items into a set", formatted
        with ``details`` only when it is said: charges are many); BudgetExceeded when that
        goes over the limit (what was spent stays spent)."""
        self.spent += nbytes
        if self.spent > self.limit:
            raise BudgetExceeded(
                f"{self.path}: {what.format(*details)} exceeds the budget of {self.limit:,} bytes "
                f"for a file of {self.file_bytes:,} bytes ({FACTOR} per byte, plus {CONSTANT:,})"
            )

    def __repr__(self) -> str:
        return f"Budget({str(self.path)!r}, {self.file_bytes}, spent {self.spent} of {self.limit})"


_SHORT_TEXT = 80  # characters of a string quoted as it is
_SHORT_INT_BITS = 64
_SCALARS = (type(None), bool, float)
_SHOWN = (*_SCALARS, int, str)  # what a short list or tuple may hold to be shown item by item
_SHOWN_ITEMS = 8


def _shown_items(value: list[Any] | tuple[Any, ...], room: int, depth: int = 0) -> int:
    """What is left of ``room`` once ``value``'s items are shown one by one (nested lists and
    tuples too, two deep), or -1 where they do not fit or are not all short scalars."""
    room -= len(value)
    if room < 0 or depth > 1:
        return -1
    for item in value:
        kind = type(item)
        if kind in (list, tuple):
            room = _shown_items(item, room, depth + 1)
            if room < 0:
                return -1
        elif kind not in _SHOWN:
            return -1
    return room


def named(text: Any) -> str:
    """A name read from a file, for an error message: as it is when it is a short printable
    string, else :func:`quoted` (a repr escapes what would break the line)."""
    if type(text) is str and len(text) <= _SHORT_TEXT and text.isprintable():
        return text
    return quoted(text)


def quoted(value: Any) -> str:
    """``value`` (read from a file) for an error message: short strings, ints of up to 64
    bits, floats, bools and None as their repr, and lists and tuples of up to 8 of those item
    by item; anything else by its type and length ("a str of 4,194,304 characters", "a list
    of 300 items", "a FragmentAddress"). Never calls the repr() of a container or of an
    object the file built."""
    kind = type(value)
    if kind in (list, tuple) and _shown_items(value, _SHOWN_ITEMS) >= 0:
        inner = ", ".join(map(quoted, value))
        return f"[{inner}]" if kind is list else f"({inner}{',' if len(value) == 1 else ''})"
    if kind in _SCALARS:
        return repr(value)
    if kind is int:
        return repr(value) if value.bit_length() <= _SHORT_INT_BITS else f"an int of {value.bit_length():,} bits"
    if kind is str:
        return repr(value) if len(value) <= _SHORT_TEXT else f"a str of {len(value):,} characters"
    name = kind.__name__
    article = "an" if name[:1].lower() in "aeiou" else "a"
    if kind in (bytes, bytearray):
        return f"{article} {name} object of {len(value):,} bytes"
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        return f"{article} {name} of {len(value):,} item{'' if len(value) == 1 else 's'}"
    return f"{article} {name}"
