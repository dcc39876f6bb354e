"""What hashing a pickle's dict keys and set elements costs, counted before unpickling.

The C unpickler hashes every dict key (SETITEM, SETITEMS, into a dict or an OrderedDict) and
set element (ADDITEMS, FROZENSET), and a tuple's hash is not cached: hashing one hashes its
items, tuples again. A tuple of memoised tuples, each holding the one before twice, takes
2^depth steps to hash (26 links of 11 bytes: seconds; each link doubles it), and a tuple
nested 150,000 deep overflows the C stack. Nothing of this can be charged while the C
unpickler runs, so :func:`hash_steps` counts it first, on the opcodes alone: the *weight*
of each object on the stack and in the memo (a tuple's: 1 plus its items'; a call's result:
its arguments', as ``torch.Size(t)`` copies ``t``; anything else: 1) and the weight of every
key and element hashed. :mod:`.pickle_scan` runs it only where a cheap bound cannot clear the
pickle (most torch.save pickles memoise no tuple that they get again).

Python code hashing what a pickle built (``set(...)``) is charged by :func:`hash_weight`.
"""

from __future__ import annotations

import pickletools
from typing import Any

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
_PUSH_ONE = {  # a new object, weight 1, no argument or one that is skipped
    _CODES[name]
    for name in (
        "NONE", "NEWTRUE", "NEWFALSE", "BININT", "BININT1", "BININT2", "BINFLOAT", "EMPTY_TUPLE",
        "EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8",
        "SHORT_BINBYTES", "BINBYTES", "BINBYTES8", "LONG1", "LONG4",
    )
}  # fmt: skip
_TUPLE_SIZES = {_CODES["TUPLE1"]: 1, _CODES["TUPLE2"]: 2, _CODES["TUPLE3"]: 3}
_GETS = {_CODES["BINGET"]: 1, _CODES["LONG_BINGET"]: 4}
_PUTS = {_CODES["BINPUT"]: 1, _CODES["LONG_BINPUT"]: 4}
_CALLS = {_CODES["REDUCE"], _CODES["NEWOBJ"]}
_GLOBAL, _STOP, _MARK = _CODES["GLOBAL"], _CODES["STOP"], _CODES["MARK"]


class _Underflow(Exception):
    """The stack ends where the pickle pops: the C unpickler stops there too."""


def hash_steps(data: bytes, limit: int) -> int:
    """The steps hashing the keys and elements of the (scanned) pickle ``data`` takes, each
    object's weight (of at most ``limit + 1``: the count stops there) once per time it is
    hashed; FileProblem past ``limit`` or for a tuple nested deeper than MAX_TUPLE_DEPTH.
    A pickle the C unpickler would refuse part way is counted up to there."""
    total = 0
    try:
        for weight, _ in _hashed(data, limit + 1):
            total += weight
            if total > limit:
                raise FileProblem(
                    f"refused to unpickle data.pkl: hashing its dict keys and set elements takes more than "
                    f"{limit:,} steps for a pickle of {len(data):,} bytes (tuples shared through the memo)"
                )
    except _Underflow:
        pass
    return total


def _hashed(data: bytes, cap: int) -> Any:
    """(weight, depth) of each object the pickle's opcodes hash, in order; a stack entry is
    such a pair, weights capped at ``cap``."""
    one = (1, 0)
    stack: list[tuple[int, int]] = []
    marks: list[list[tuple[int, int]]] = []
    memo: dict[int, tuple[int, int]] = {}

    def pop_mark() -> list[tuple[int, int]]:
        nonlocal stack
        if not marks:
            raise _Underflow
        items, stack = stack, marks.pop()
        return items

    def pop() -> tuple[int, int]:
        if not stack:
            raise _Underflow
        return stack.pop()

    position, end = 0, len(data)
    while position < end:
        code = data[position]
        position += 1
        if code in _PUSH_ONE:
            stack.append(one)
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
            if not stack:
                raise _Underflow
            memo[int.from_bytes(data[position : position + width], "little")] = stack[-1]
            position += width
        elif code in _TUPLE_SIZES:
            count = _TUPLE_SIZES[code]
            if len(stack) < count:
                raise _Underflow
            items = stack[-count:]
            del stack[-count:]
            stack.append(_tuple(items, cap))
        elif code == _MARK:
            marks.append(stack)
            stack = []
        elif code == _CODES["TUPLE"]:
            items = pop_mark()  # before stack.append is looked up: it rebinds stack
            stack.append(_tuple(items, cap))
        elif code == _CODES["SETITEM"]:
            pop()
            yield pop()
        elif code == _CODES["SETITEMS"]:
            yield from pop_mark()[::2]
        elif code == _CODES["ADDITEMS"]:
            yield from pop_mark()
        elif code == _CODES["FROZENSET"]:
            yield from pop_mark()
            stack.append(one)
        elif code in _CALLS:  # torch.Size(t) copies t; any other result costs no more to hash
            arguments = pop()
            pop()
            stack.append(arguments)
        elif code == _CODES["BINPERSID"]:
            stack.append(pop())
        elif code in (_CODES["APPEND"], _CODES["BUILD"], _CODES["POP"]):
            if code == _CODES["POP"] and not stack:
                pop_mark()
            else:
                pop()
        elif code in (_CODES["APPENDS"], _CODES["POP_MARK"]):
            pop_mark()
        elif code == _CODES["DUP"]:
            if not stack:
                raise _Underflow
            stack.append(stack[-1])
        elif code == _CODES["MEMOIZE"]:
            if not stack:
                raise _Underflow
            memo[len(memo)] = stack[-1]
        elif code == _GLOBAL:
            position = data.index(b"\n", data.index(b"\n", position) + 1) + 1
            stack.append(one)
        elif code == _CODES["STACK_GLOBAL"]:
            pop()
            pop()
            stack.append(one)
        elif code == _STOP:
            return
        else:  # PROTO, FRAME: no object
            position += _WIDTHS.get(code, 0)


def _tuple(items: list[tuple[int, int]], cap: int) -> tuple[int, int]:
    """The (weight, depth) of a tuple of ``items``; FileProblem past MAX_TUPLE_DEPTH (whether
    it is hashed by the unpickler or not: what reads the object may hash it)."""
    if not items:
        return (1, 1)
    weights, depths = zip(*items)
    depth = 1 + max(depths)
    if depth > MAX_TUPLE_DEPTH:
        raise FileProblem(f"refused to unpickle data.pkl: a tuple nested more than {MAX_TUPLE_DEPTH:,} deep")
    return (min(1 + sum(weights), cap), depth)


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
    where one holds a tuple (other values cost a step each, charged with their copy)."""
    if any(type(value) is tuple for value in values):
        charge_load(hash_weight(values), "hashing {:,} items into {}", len(values), what)
