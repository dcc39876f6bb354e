"""What hashing a pickle's dict keys and set elements costs, counted before unpickling.

The C unpickler hashes every dict key (SETITEM, SETITEMS, into a dict or an OrderedDict) and
set element (ADDITEMS, FROZENSET), and a tuple's hash is not cached: hashing one hashes its
items, tuples again. A tuple of memoised tuples, each holding the one before twice, takes
2^depth steps to hash (26 links of 11 bytes: seconds; each link doubles it), and a tuple
nested 150,000 deep overflows the C stack. Nothing of this can be charged while the C
unpickler runs, so :func:`hash_steps` counts it first, on the opcodes alone: the *weight*
of each object on the stack and in the memo (a tuple's: 1 plus its items'; a call's result:
its arguments', as ``torch.Size(t)`` copies ``t``; anything else: 1) and the weight of every
key and element hashed.

A dict also compares a new key with every stored key of an equal hash, and a file can choose
hashes: an int's is itself modulo 2^61 - 1, a float's follows from its value, and a tuple's
mixes its items' by steps that can be solved for an item (20,000 int keys that are multiples
of 2^61 - 1, 259 KB, took seconds to unpickle: quadratic in the keys). A string's hash is
keyed by the process's random seed, and distinct small ints hash apart, so only keys that are
*collidable* (a big int, a float, a tuple, a frozenset, anything a call or a persistent id
made) can collide. The count charges each such key, as if every one collided, a comparison
with every collidable key its container already holds (each costs at most the new key's
weight: a comparison stops at the first item that differs, and an item compared with
itself costs one step). A file of keys torch.save writes (strings, small ints) costs what
it costs to hash.

:mod:`.pickle_scan` runs the count only where a cheap bound cannot clear the pickle.
Python code hashing what a pickle built (``set(...)``) is charged by :func:`charge_hashing`.
"""

from __future__ import annotations

import operator
import pickletools
from typing import Any

from ..io.hashes import MAX_ALIKE, crowded
from .pickle_keys import ITEMS, REBUILT, UNKNOWN, Held, stand_in
from .torch_records import FileProblem, charge_load

MAX_TUPLE_DEPTH = 10_000  # tuples nested deeper are refused: hashing one recurses in C

_CODES = {op.name: op.code.encode("latin-1")[0] for op in pickletools.opcodes}
_WIDTHS = {  # opcodes with a fixed-width argument this simulation does not need
    _CODES[op.name]: op.arg.n for op in pickletools.opcodes if op.arg is not None and op.arg.n > 0
}
_LENGTH_WIDTHS = {  # counted opcodes: the width of their length, then that many bytes
    _CODES[name]: width
    for name, width in (
        ("LONG1", 1), ("LONG4", 4), ("SHORT_BINUNICODE", 1), ("BINUNICODE", 4), ("BINUNICODE8", 8),
        ("SHORT_BINBYTES", 1), ("BINBYTES", 4), ("BINBYTES8", 8),
    )
}  # fmt: skip
_PUSHED = {  # a new object of weight 1 whose value lies in its bytes; no argument or one skipped
    _CODES[name]
    for name in (
        "NONE", "NEWTRUE", "NEWFALSE", "BININT", "BININT1", "BININT2", "BINFLOAT", "EMPTY_TUPLE",
        "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "SHORT_BINBYTES", "BINBYTES", "BINBYTES8", "LONG1", "LONG4",
    )
}  # fmt: skip
# Of those, what a file may choose the hash of (BININT's 32 bits hash to themselves: distinct
# ones hash apart, but for -1 and -2; a string's hash is keyed by the process's seed).
_CHOSEN_HASHES = {_CODES[name] for name in ("BINFLOAT", "LONG1", "LONG4")}
_CONTAINERS = {_CODES[name] for name in ("EMPTY_DICT", "EMPTY_SET")}
# The entries of pushes whose value needs no position, shared (a constant; by the byte after
# the opcode: a BININT1, an empty string, bytes or LONG1): the opcodes allocating an entry
# are then 3 bytes at least, at most 40 bytes a byte of pickle.
_SHARED = {
    _CODES[name]: (1, 0, None, (value,))
    for name, value in (("NONE", None), ("NEWTRUE", True), ("NEWFALSE", False), ("EMPTY_TUPLE", ()))
}
_SHARED_BY_BYTE = {
    _CODES["BININT1"]: {value: (1, 0, None, (value,)) for value in range(256)},
    **{_CODES[name]: {0: (1, 0, None, (empty,))} for name, empty in (("SHORT_BINUNICODE", ""), ("SHORT_BINBYTES", b""), ("LONG1", 0))},
}
_TUPLE_SIZES = {_CODES["TUPLE1"]: 1, _CODES["TUPLE2"]: 2, _CODES["TUPLE3"]: 3}
_GETS = {_CODES["BINGET"]: 1, _CODES["LONG_BINGET"]: 4}
_PUTS = {_CODES["BINPUT"]: 1, _CODES["LONG_BINPUT"]: 4}
_CALLS = {_CODES["REDUCE"], _CODES["NEWOBJ"]}
_GLOBAL, _STOP, _MARK = _CODES["GLOBAL"], _CODES["STOP"], _CODES["MARK"]
assert _PUSHED <= REBUILT

# A stack entry is (weight, depth, held, source): ``held`` the Held of a container (a dict,
# a set, what a call made: an OrderedDict), else None; ``source`` what stand_in rebuilds the
# value from (the position of the opcode that pushed it, the value in a 1-tuple, or ITEMS:
# a tuple's, whose item entries follow in the entry), None
# for what no file chooses the hash of (a global, a list), UNKNOWN for what a call or a
# persistent id made (its hash unknown here).
_Entry = tuple[Any, ...]  # (int, int, Held | None, Any, *items)


class _Underflow(Exception):
    """The stack ends where the pickle pops: the C unpickler stops there too."""


def hash_steps(data: bytes, limit: int) -> int:
    """The steps hashing the keys and elements of the (scanned) pickle ``data`` takes (each
    object's weight, of at most ``limit + 1``: the count stops there, once per time it is
    hashed), and comparing each one whose hash the file may choose with the stored keys of
    its hash (rebuilt from the bytes) or of any hash (where the bytes do not give its value);
    FileProblem past ``limit``, for more than MAX_ALIKE distinct keys of one hash in a
    container, or for a tuple nested deeper than MAX_TUPLE_DEPTH. A pickle the C unpickler
    would refuse part way is counted up to there."""
    total = 0
    try:
        for steps in _hashed(data, limit + 1):
            total += steps
            if total > limit:
                raise FileProblem(
                    f"refused to unpickle data.pkl: hashing its dict keys and set elements (and comparing those "
                    f"that may hash alike) takes more than {limit:,} steps for a pickle of {len(data):,} bytes"
                )
    except _Underflow:
        pass
    return total


def _hashed(data: bytes, cap: int) -> Any:
    """The steps of each put of a key or element into a container, in the order of the
    pickle's opcodes (hashing it, then comparing it); weights capped at ``cap``."""
    one: _Entry = (1, 0, None, None)
    stack: list[_Entry] = []
    marks: list[list[_Entry]] = []
    memo: dict[int, _Entry] = {}
    rebuilt: dict[int, Any] = {}

    def into(container: _Entry, keys: list[_Entry]) -> Any:
        held = container[2]
        for key in keys:
            weight, source = key[0], key[3]
            yield weight  # hashed first: the rebuilt key is hashed only once that is affordable
            if held is None:
                continue  # no container: the unpickler fails
            if source is None or (type(source) is int and data[source] not in _CHOSEN_HASHES):
                yield weight * held.unknown  # a hash no file chooses, but a key of no known value may have it
            else:
                yield weight * held.comparisons(stand_in(key, data, rebuilt))

    def pop_mark() -> list[_Entry]:
        nonlocal stack
        if not marks:
            raise _Underflow
        items, stack = stack, marks.pop()
        return items

    def pop() -> _Entry:
        if not stack:
            raise _Underflow
        return stack.pop()

    def top() -> _Entry:
        if not stack:
            raise _Underflow
        return stack[-1]

    position, end = 0, len(data)
    while position < end:
        code = data[position]
        position += 1
        if code in _PUSHED:
            by_byte = _SHARED_BY_BYTE.get(code)  # most pushes of a torch.save pickle: none allocates an entry
            shared = by_byte.get(data[position]) if by_byte else _SHARED.get(code)
            stack.append(shared or (1, 0, None, position - 1))
            if code in _LENGTH_WIDTHS:
                width = _LENGTH_WIDTHS[code]
                position += width + int.from_bytes(data[position : position + width], "little")
            else:
                position += _WIDTHS.get(code, 0)
        elif code in _GETS:
            width = _GETS[code]
            stack.append(memo.get(int.from_bytes(data[position : position + width], "little"), one))
            position += width
        elif code in _PUTS:
            width = _PUTS[code]
            memo[int.from_bytes(data[position : position + width], "little")] = top()
            position += width
        elif code in _TUPLE_SIZES:
            count = _TUPLE_SIZES[code]
            if len(stack) < count:
                raise _Underflow
            items = stack[-count:]
            del stack[-count:]
            stack.append(_tuple(items, cap))
        elif code in _CONTAINERS:
            stack.append((1, 0, Held(), None))
        elif code == _MARK:
            marks.append(stack)
            stack = []
        elif code == _CODES["TUPLE"]:
            items = pop_mark()  # before stack.append is looked up: it rebinds stack
            stack.append(_tuple(items, cap))
        elif code == _CODES["SETITEM"]:
            pop()
            key = pop()
            yield from into(top(), [key])
        elif code == _CODES["SETITEMS"]:
            items = pop_mark()
            yield from into(top(), items[::2])
        elif code == _CODES["ADDITEMS"]:
            items = pop_mark()
            yield from into(top(), items)
        elif code == _CODES["FROZENSET"]:
            yield from into((1, 0, Held(), None), pop_mark())
            stack.append((1, 0, None, UNKNOWN))
        elif code in _CALLS:  # torch.Size(t) copies t; what a call makes may be a container
            arguments = pop()
            pop()
            stack.append((arguments[0], arguments[1], Held(), UNKNOWN))
        elif code == _CODES["BINPERSID"]:
            made = pop()
            stack.append((made[0], made[1], None, UNKNOWN))
        elif code in (_CODES["APPEND"], _CODES["BUILD"], _CODES["POP"]):
            if code == _CODES["POP"] and not stack:
                pop_mark()
            else:
                pop()
        elif code in (_CODES["APPENDS"], _CODES["POP_MARK"]):
            pop_mark()
        elif code == _CODES["DUP"]:
            stack.append(top())
        elif code == _CODES["MEMOIZE"]:
            memo[len(memo)] = top()
        elif code == _GLOBAL:
            position = data.index(b"\n", data.index(b"\n", position) + 1) + 1
            stack.append(one)
        elif code == _CODES["STACK_GLOBAL"]:
            pop()
            pop()
            stack.append(one)
        elif code == _STOP:
            return
        elif code == _CODES["EMPTY_LIST"]:
            stack.append(one)
        else:  # PROTO, FRAME: no object
            position += _WIDTHS.get(code, 0)


def _tuple(items: list[_Entry], cap: int) -> _Entry:
    """The entry of a tuple of ``items``; FileProblem past MAX_TUPLE_DEPTH (whether it is
    hashed by the unpickler or not: what reads the object may hash it)."""
    if not items:
        return (1, 1, None, ITEMS)
    depth = 1 + max(map(_DEPTH, items))
    if depth > MAX_TUPLE_DEPTH:
        raise FileProblem(f"refused to unpickle data.pkl: a tuple nested more than {MAX_TUPLE_DEPTH:,} deep")
    return (min(1 + sum(map(_WEIGHT, items)), cap), depth, None, ITEMS, *items)  # one object: 40 bytes a tuple opcode


_WEIGHT, _DEPTH = operator.itemgetter(0), operator.itemgetter(1)


def hash_weight(values: Any) -> int:
    """The steps hashing each of ``values`` takes (a tuple: 1 plus its items', a shared one
    counted each time it is held, but weighed once: the count is linear in the distinct
    tuples); RecursionError for a tuple nested deeper than Python recurses."""
    weights: dict[int, int] = {}

    def weigh(value: Any) -> int:
        if type(value) is not tuple:
            return 1
        known = weights.get(id(value))
        if known is None:
            known = weights[id(value)] = 1 + sum(map(weigh, value))
        return known

    return sum(map(weigh, values))


def charge_hashing(values: Any, what: str) -> None:
    """Charge the load's budget (one byte per step) for hashing ``values`` into ``what``,
    where one holds a tuple (other values cost a step each, charged with their copy); then
    refuse more than MAX_ALIKE distinct values of one hash among them (FileProblem), which
    the set would compare with each other: quadratic in the values."""
    if any(type(value) is tuple for value in values):
        charge_load(hash_weight(values), "hashing {:,} items into {}", len(values), what)
    if not all(type(value) is str for value in values) and crowded(values):
        raise FileProblem(
            f"refused to unpickle data.pkl: {what} of {len(values):,} items holds more than {MAX_ALIKE} "
            "distinct ones of one hash (a file choosing hashes)"
        )
