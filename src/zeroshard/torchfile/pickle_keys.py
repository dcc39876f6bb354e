"""The keys a pickle puts into its dicts and sets, rebuilt from its bytes to learn their hashes.

A dict compares a new key with every stored key of an equal hash. A file can choose the
hashes of ints (an int's is itself modulo 2^61 - 1), floats and tuples (a tuple's mixes its
items' by steps that can be solved for an item), but a key's hash follows from its value,
and the value of an int, float, string, bytes, None, bool or a tuple of them lies in the
pickle's bytes. :func:`stand_in` rebuilds such a key, an equal value of the same hash, so
that :class:`Held` can group each container's keys by their real hashes before the C
unpickler builds the container. What cannot be rebuilt (a call's result, a storage) is
counted as if it collided with every key of its container.
"""

from __future__ import annotations

import pickletools
import struct
from typing import Any

from ..io.hashes import MAX_ALIKE
from .torch_records import FileProblem

UNKNOWN = object()  # what a key whose value the bytes do not give rebuilds to
ITEMS = object()  # the source of a tuple's entry: its item entries follow
_DEEPEST = 64  # tuples nested deeper are not rebuilt (the rebuild recurses in Python)

_CODES = {op.name: op.code.encode("latin-1")[0] for op in pickletools.opcodes}
_CONSTANTS = {_CODES["NONE"]: None, _CODES["NEWTRUE"]: True, _CODES["NEWFALSE"]: False, _CODES["EMPTY_TUPLE"]: ()}
_FIXED_INTS = {_CODES["BININT"]: (4, True), _CODES["BININT1"]: (1, False), _CODES["BININT2"]: (2, False)}
_COUNTED = {  # opcode: (width of its length, what the bytes are)
    _CODES["LONG1"]: (1, "int"),
    _CODES["LONG4"]: (4, "int"),
    _CODES["SHORT_BINUNICODE"]: (1, "str"),
    _CODES["BINUNICODE"]: (4, "str"),
    _CODES["BINUNICODE8"]: (8, "str"),
    _CODES["SHORT_BINBYTES"]: (1, "bytes"),
    _CODES["BINBYTES"]: (4, "bytes"),
    _CODES["BINBYTES8"]: (8, "bytes"),
}
_BINFLOAT = _CODES["BINFLOAT"]
REBUILT = frozenset((*_CONSTANTS, *_FIXED_INTS, *_COUNTED, _BINFLOAT))  # opcodes whose value stand_in reads


def stand_in(entry: tuple[Any, ...], data: bytes, rebuilt: dict[int, Any]) -> Any:
    """The value of the key an entry of the hashing count describes, or UNKNOWN. The entry's
    fourth field says where it lies: the position of the opcode that pushed it, the value in
    a 1-tuple, ITEMS for a tuple (whose item entries follow), or None or UNKNOWN where the
    bytes do not give it. ``rebuilt`` keeps the tuples rebuilt so far by entry (a memoised
    tuple is one object, as in the unpickler), holding each entry so that its id is not reused."""
    source = entry[3]
    if source is None or source is UNKNOWN:
        return UNKNOWN
    if type(source) is int:
        return _scalar(data, source)
    if type(source) is tuple:
        return source[0]
    known = rebuilt.get(id(entry))
    if known is None:
        if entry[1] > _DEEPEST:
            value: Any = UNKNOWN
        else:
            items = [stand_in(item, data, rebuilt) for item in entry[4:]]
            value = UNKNOWN if any(item is UNKNOWN for item in items) else tuple(items)
        known = rebuilt[id(entry)] = (entry, value)
    return known[1]


def _scalar(data: bytes, position: int) -> Any:
    """The value the opcode at ``position`` pushes (one of REBUILT, checked by the scan)."""
    code = data[position]
    if code in _CONSTANTS:
        return _CONSTANTS[code]
    if code in _FIXED_INTS:
        width, signed = _FIXED_INTS[code]
        return int.from_bytes(data[position + 1 : position + 1 + width], "little", signed=signed)
    if code == _BINFLOAT:
        return struct.unpack(">d", data[position + 1 : position + 9])[0]
    width, kind = _COUNTED[code]
    start = position + 1 + width
    value = data[start : start + int.from_bytes(data[position + 1 : start], "little")]
    if kind == "int":
        return int.from_bytes(value, "little", signed=True)
    if kind == "str":
        try:
            return value.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:  # the unpickler refuses it
            return UNKNOWN
    return value


class Held:
    """What a container of the pickle holds that may share hashes: its keys grouped by hash
    (distinct values, MAX_ALIKE at most: more is a file choosing hashes), and how many keys of
    no known value it holds, each of which may share a hash with any other."""

    __slots__ = ("by_hash", "unknown", "known")

    def __init__(self) -> None:
        self.by_hash: dict[int, list[Any]] | None = None  # made for the first key: most calls make no container
        self.unknown = 0
        self.known = 0

    def comparisons(self, key: Any) -> int:
        """How many stored keys putting ``key`` (a stand-in, or UNKNOWN) compares it with,
        at most; the key is then held. FileProblem for one hash too many."""
        if key is UNKNOWN:
            self.unknown += 1
            return self.known + self.unknown - 1
        if self.by_hash is None:
            self.by_hash = {}
        alike = self.by_hash.setdefault(hash(key), [])  # hashes are below 2^61: they hash apart
        compared = len(alike) + self.unknown
        if key not in alike:
            if len(alike) == MAX_ALIKE:
                raise FileProblem(
                    f"refused to unpickle data.pkl: more than {MAX_ALIKE} distinct keys of one hash in a dict or set "
                    "(a file choosing hashes)"
                )
            alike.append(key)
            self.known += 1
        return compared
