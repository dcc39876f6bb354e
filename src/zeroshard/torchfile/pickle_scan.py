"""The opcode allow-list of torch.save pickles, checked in one pass before unpickling.

The C unpickler trusts what a pickle declares: ``LONG_BINPUT`` with index 2**32 - 1 makes it
allocate (and zero) a memo of 64 GiB, ``BINBYTES8`` and ``FRAME`` allocate their declared size
before reading it, and protocol 0/1 or out-of-band opcodes are nothing torch.save writes. So
before unpickling, every opcode is checked against the set a torch.save pickle (protocol 2 to
4) uses, every memo index is bounded by the pickle's size, every counted string, integer or
frame must fit in the bytes that follow, and an integer may not be longer than 1 KiB (its hash,
computed again each time it is a dict key, costs its length; its decimal text, in a JSON
manifest or an error, would be more than Python prints). The scan also says what the opcodes that create
an empty container (one byte for a set of 216) may allocate, for the load's budget, and bounds
what hashing the dict keys and set elements the pickle builds may cost (:func:`_check_hashing`;
:mod:`.pickle_hashing` counts it exactly where the bound is not enough).

:func:`check_opcodes` does that without decoding opcodes one by one in Python (which costs
more than unpickling): one regular expression consumes runs of allowed opcodes whose
arguments are fixed or short, and only the rest (long strings, bytes, big integers, a memo
index past 65535) is looked at here.
"""

from __future__ import annotations

import pickletools
import re
import sys
import threading

from ..io.budget import CONSTANT, FACTOR
from .pickle_hashing import MAX_TUPLE_DEPTH, hash_steps
from .torch_records import FileProblem

# The opcodes a torch.save pickle (protocol 2 to 4) uses for data; no buffers, INST/OBJ, EXT.
ALLOWED_OPCODES = frozenset((
    "PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "DUP", "NONE", "NEWTRUE", "NEWFALSE", "BININT",
    "BININT1", "BININT2", "LONG1", "LONG4", "BINFLOAT", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8",
    "SHORT_BINBYTES", "BINBYTES", "BINBYTES8", "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_LIST",
    "APPEND", "APPENDS", "EMPTY_DICT", "SETITEM", "SETITEMS", "EMPTY_SET", "ADDITEMS", "FROZENSET", "GLOBAL",
    "STACK_GLOBAL", "REDUCE", "NEWOBJ", "BUILD", "BINPERSID", "BINGET", "LONG_BINGET", "BINPUT", "LONG_BINPUT",
    "MEMOIZE",
))  # fmt: skip

_OPCODES = {op.name: op for op in pickletools.opcodes}
_STOP = _OPCODES["STOP"].code.encode("latin-1")[0]
# Opcodes whose argument is a little-endian length of this many bytes, then that many bytes.
_COUNTED = {
    _OPCODES[name].code.encode("latin-1")[0]: width
    for name, width in (
        ("LONG1", 1), ("LONG4", 4), ("SHORT_BINUNICODE", 1), ("BINUNICODE", 4), ("BINUNICODE8", 8),
        ("SHORT_BINBYTES", 1), ("BINBYTES", 4), ("BINBYTES8", 8),
    )
}  # fmt: skip
_LONG_BINPUT = _OPCODES["LONG_BINPUT"].code.encode("latin-1")[0]
_FRAME = _OPCODES["FRAME"].code.encode("latin-1")[0]
_LONG4 = _OPCODES["LONG4"].code.encode("latin-1")[0]
_GLOBAL = _OPCODES["GLOBAL"].code.encode("latin-1")[0]
MAX_INT_BYTES = 1024  # an int of 8,192 bits, 2,467 digits: Python prints up to 4,300
# Opcodes creating a container from nothing (FROZENSET from what the stack holds), and the
# bytes CPython allocates for an empty one.
_CREATING = tuple(
    (_OPCODES[name].code.encode("latin-1"), sys.getsizeof(empty))
    for name, empty in (("EMPTY_DICT", {}), ("EMPTY_LIST", []), ("EMPTY_SET", set()), ("FROZENSET", frozenset((0,))))
)
_MOST_CREATED = max(size for _, size in _CREATING)  # bytes one byte of pickle may create
_FAST_MEMO_LIMIT = 1 << 16  # LONG_BINPUT indices below this pass the fast scan of pickles this big
# Opcodes after which the cheap bound on hashing does not hold (pickle_hashing counts it):
# DUP shares the top, MEMOIZE memoises at an index it does not say, a FRAME may come between
# an object and its put. torch.save (protocol 2) writes none of them.
_UNCOUNTED = ("DUP", "MEMOIZE", "FRAME")
# What may cost more than one step to hash: a tuple, a call's result (torch.Size: a tuple; a
# tensor: its fields), a persistent id's storage, and what a BUILD leaves (BUILD with None
# on a tuple leaves the tuple). A put after a fence memoises what lies below.
_HEAVY = ("TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "REDUCE", "NEWOBJ", "BINPERSID", "BUILD")
_FENCES = ("MARK", "POP", "POP_MARK")
_CALLS_AND_IDS = ("REDUCE", "NEWOBJ", "BINPERSID")
_UNCOUNTED_CODES = frozenset(_OPCODES[name].code.encode("latin-1")[0] for name in _UNCOUNTED)
_BEFORE_A_PUT = frozenset(
    _OPCODES[name].code.encode("latin-1")[0]
    for name in ("PROTO", "BINPUT", "LONG_BINPUT", "BINGET", "LONG_BINGET", *_FENCES)
)
_PUT_CODES = frozenset(_OPCODES[name].code.encode("latin-1")[0] for name in ("BINPUT", "LONG_BINPUT"))


def _code(name: str) -> bytes:
    return re.escape(_OPCODES[name].code.encode("latin-1"))


def _fast_scanner(long_binput: bool) -> re.Pattern[bytes]:
    """A pattern matching the longest run of allowed opcodes that need no arithmetic: fixed
    arguments, GLOBAL's two lines, and counted strings and integers of 1-byte length or
    (BINUNICODE, protocol 2's only string opcode) of a length below 256.

    The branches are tried in order for every opcode, so the commonest come first: opcodes
    with a 1-byte argument (BINPUT, BINGET, BININT1: half of a torch.save pickle), then those
    without one, then BINUNICODE (1.5x faster than the other way round). A put right after an
    opcode that did not make what it memoises (_FENCES, PROTO, a get or a put) stops it: the
    bound on hashing (_check_hashing) does not hold there."""
    by_width: dict[int, list[bytes]] = {}
    fenced = {"PROTO", "BINPUT", "BINGET", "LONG_BINGET", *_FENCES}
    for name in sorted(ALLOWED_OPCODES - {"STOP", "GLOBAL", "LONG_BINPUT", *_UNCOUNTED, *fenced}):
        op = _OPCODES[name]
        if op.code.encode("latin-1")[0] not in _COUNTED:
            by_width.setdefault(op.arg.n if op.arg else 0, []).append(_code(name))
    fixed = {
        width: b"[" + b"".join(codes) + b"]" + (b".{%d}" % width if width else b"") for width, codes in by_width.items()
    }
    no_put = b"(?![" + _code("BINPUT") + _code("LONG_BINPUT") + b"])"
    one_byte = b"[" + _code("BINPUT") + _code("BINGET") + _code("PROTO") + b"]." + no_put
    fences = b"[" + b"".join(map(_code, _FENCES)) + b"]" + no_put
    runs = [fixed.pop(1), one_byte, fixed.pop(0), fences, _code("BINUNICODE") + _lengths_below_256(high_zero_bytes=3)]
    runs += [*fixed.values(), _code("LONG_BINGET") + b"...." + no_put, _code("GLOBAL") + rb"[^\n]*\n[^\n]*\n"]
    if long_binput:  # an index below 2**16, in little-endian order
        runs.append(_code("LONG_BINPUT") + b"..\\x00\\x00" + no_put)
    short = b"[" + _code("SHORT_BINUNICODE") + _code("SHORT_BINBYTES") + _code("LONG1") + b"]"
    runs.append(short + _lengths_below_256(high_zero_bytes=0))
    return re.compile(b"(?:" + b"|".join(runs) + b")*+", re.DOTALL)


def _memo_tokens() -> re.Pattern[bytes]:
    """A pattern matching a run of opcodes, then one that reads the memo or memoises what may
    cost more than a step to hash (or the end of the run). Over a run of opcodes the fast scan
    passed, findall gives per such opcode: a put after MARK, POP, POP_MARK, PROTO, a get or a
    put (what it memoises is not what the opcode before made); the index a put after
    _HEAVY memoises at (1 byte, 4 bytes); the index a get reads (1 byte, 4 bytes)."""
    fence = b"(?:[" + b"".join(map(_code, _FENCES)) + b"]|" + _code("PROTO") + b".)"
    put = b"(?:" + _code("BINPUT") + b".|" + _code("LONG_BINPUT") + b"....)"
    get = b"(?:" + _code("BINGET") + b".|" + _code("LONG_BINGET") + b"....)"
    a_put = b"[" + _code("BINPUT") + _code("LONG_BINPUT") + b"]"
    heavy = b"[" + b"".join(map(_code, _HEAVY)) + b"]"
    by_width: dict[int, list[bytes]] = {}
    special = {"STOP", "GLOBAL", "PROTO", "BINPUT", "LONG_BINPUT", "BINGET", "LONG_BINGET", *_FENCES, *_HEAVY}
    for name in sorted(ALLOWED_OPCODES - special - set(_UNCOUNTED)):
        op = _OPCODES[name]
        if op.code.encode("latin-1")[0] not in _COUNTED:
            by_width.setdefault(op.arg.n if op.arg else 0, []).append(_code(name))
    fixed = [b"[" + b"".join(codes) + b"]" + (b".{%d}" % width if width else b"") for width, codes in by_width.items()]
    short = b"[" + _code("SHORT_BINUNICODE") + _code("SHORT_BINBYTES") + _code("LONG1") + b"]"
    not_a_put = b"(?!" + a_put + b")"
    other = [
        *fixed, put + not_a_put, heavy + not_a_put, fence + not_a_put,
        _code("BINUNICODE") + _lengths_below_256(high_zero_bytes=3), short + _lengths_below_256(high_zero_bytes=0),
        _code("GLOBAL") + rb"[^\n]*\n[^\n]*\n",
    ]  # fmt: skip
    marked = (
        b"((?:" + fence + b"|" + put + b"|" + get + b")(?=" + a_put + b"))"
        + b"|" + heavy + b"(?:" + _code("BINPUT") + b"(.)|" + _code("LONG_BINPUT") + b"(....))"
        + b"|" + _code("BINGET") + b"(.)|" + _code("LONG_BINGET") + b"(....)"
    )
    return re.compile(b"(?:" + b"|".join(other) + b")*+(?:" + marked + b"|\\Z)", re.DOTALL)




def _lengths_below_256(high_zero_bytes: int) -> bytes:
    """A little-endian length n < 256 (its low byte, then zero bytes), then n bytes."""
    zeros = b"\\x00" * high_zero_bytes
    return b"(?:" + b"|".join(re.escape(bytes([n])) + zeros + b".{%d}" % n for n in range(256)) + b")"


_FAST = _fast_scanner(long_binput=False)
_FAST_BIG = _fast_scanner(long_binput=True)
_MEMO_TOKENS = _memo_tokens()
_HEAVY_CLASS = b"[" + b"".join(map(_code, _HEAVY)) + b"]"
_HEAVY_PUTS = re.compile(  # a put's 1-byte or 4-byte index, where the byte before is _HEAVY
    b"%s(?<=%s%s)(.)|%s(?<=%s%s)(....)"
    % (_code("BINPUT"), _HEAVY_CLASS, _code("BINPUT"), _code("LONG_BINPUT"), _HEAVY_CLASS, _code("LONG_BINPUT")),
    re.DOTALL,
)
# A get's index, where an opcode follows it (in names, "weight_", "torch." look like gets).
_OPCODE_CLASS = b"[" + b"".join(map(_code, sorted(ALLOWED_OPCODES))) + b"]"
_SHORT_GETS = re.compile(_code("BINGET") + b"(?=(.)" + _OPCODE_CLASS + b")", re.DOTALL)
_LONG_GETS = re.compile(_code("LONG_BINGET") + b"(?=(....)" + _OPCODE_CLASS + b")", re.DOTALL)


def check_opcodes(data: bytes) -> int:
    """Refuse a pickle with an opcode outside ALLOWED_OPCODES, a memo index beyond its size
    (the C unpickler sizes its memo by the largest index), or an argument running past its end;
    the bytes its container-creating opcodes may allocate (an upper bound: every byte of the
    pickle with such an opcode's value is counted, in arguments too; 0 for a pickle that could
    not create more than the budget's constant).

    The verdict depends on the bytes alone, so the last 256 small pickles that passed are
    remembered by their content: at large D, runs of DeepSpeed rank files hold the same pickle
    (the same keys, shapes and slice mappings), and comparing bytes costs a tenth of a scan."""
    created = _PASSED.get(data)
    if created is not None:
        return created
    segments, uncounted = _scan(data)
    _check_hashing(data, segments, uncounted)
    # A pickle too small to create more than the budget's constant is not counted (a rank
    # file's at large D: a few KB, each a new one); a bigger one is, by its byte values.
    created = 0
    if len(data) * _MOST_CREATED > CONSTANT:
        created = sum(data.count(code) * size for code, size in _CREATING)
    if len(data) <= _PASSED_BYTES:
        with _PASSED_LOCK:
            if len(_PASSED) >= _PASSED_COUNT:
                del _PASSED[next(iter(_PASSED))]  # the oldest
            _PASSED[data] = created
    return created


def _check_hashing(data: bytes, segments: list[tuple[int, int]], uncounted: bool) -> None:
    """FileProblem where hashing what the pickle builds, and comparing keys of equal hashes,
    would take more than FACTOR steps per byte plus CONSTANT, or recurse too deep
    (:func:`~.pickle_hashing.hash_steps` counts it).

    A cheap bound clears most pickles first. A hashed object weighs its bytes at most while no
    get pushes what may weigh more than 1 (the gets of _HEAVY objects: torch.save memoises
    tuples, but gets one again only where the saved object shares it, a ``betas`` tuple in
    every param group of an optimizer), and each such get at most doubles what all the
    objects built so far weigh: hashing takes at most (bytes + 1) * 2^gets steps. A key that
    may collide is compared with at most every other collidable object, of which there are
    no more than the bytes holding an opcode that makes one (_COLLIDING), each comparison
    costing at most the key's weight: (1 + those bytes) times as much in all. (Copies out of
    a list, ``torch.Size(L)`` and ``set(L)``, are checked by the unpickler's wrappers.) A
    tuple is nested at most as deep as the pickle has tuple opcodes."""
    limit = FACTOR * len(data) + CONSTANT
    if not uncounted and _shallow(data):
        collidable = sum(map(data.count, _COLLIDING_CODES))
        bound = limit // ((len(data) + 1) * (1 + collidable))  # 2^gets may be this much
        # By byte values (where more than 2 may pass: names and floats hold bytes that look like
        # gets, a rank file's 5 to 7 where 1 is real); then only those that start an opcode (1 to
        # 3 of a rank file's); then by opcodes.
        counts = (_heavy_gets_starting_opcodes, _heavy_gets)
        puts = _heavy_put_indices(data) if bound else None
        for count in ((_heavy_gets_at_most, *counts) if bound >= 8 else counts) if bound else ():
            gets = count(data, segments, puts)
            if gets is not None and 1 << min(gets, 64) <= bound:
                return
    hash_steps(data, limit)


def _heavy_gets_at_most(data: bytes, segments: list[tuple[int, int]], puts: _Puts) -> int:
    """At least as many as :func:`_heavy_gets`, from byte values alone: every put after a
    _HEAVY opcode and every get is among the bytes that look like one (a put is searched for
    by its code, then the byte before it: a search without a fixed first byte costs 3x)."""
    heavy, heavy_long = puts
    if not heavy and not heavy_long:
        return 0
    gets = sum(map(heavy.__contains__, _SHORT_GETS.findall(data)))
    for index in _LONG_GETS.findall(data):  # rare but in pickles of 256 objects or more
        gets += _is_heavy_long(index, heavy, heavy_long)
    return gets


_Puts = tuple[set[bytes], set[bytes]]


def _heavy_put_indices(data: bytes) -> _Puts:
    """The 1-byte and 4-byte memo indices of every put whose byte before is a _HEAVY opcode,
    by byte values."""
    puts = _HEAVY_PUTS.findall(data)
    short, long = zip(*puts) if puts else ((), ())
    heavy, heavy_long = set(short), set(long)
    heavy.discard(b"")
    heavy_long.discard(b"")
    heavy.update(index[:1] for index in heavy_long if index.endswith(b"\x00\x00\x00"))  # one memo
    return heavy, heavy_long


def _is_heavy_long(index: bytes, heavy: set[bytes], heavy_long: set[bytes]) -> bool:
    return index in heavy_long or (index.endswith(b"\x00\x00\x00") and index[:1] in heavy)


def _heavy_gets_starting_opcodes(data: bytes, segments: list[tuple[int, int]], puts: _Puts) -> int | None:
    """The bytes :func:`_heavy_gets_at_most` counts that start an opcode, found by walking the
    opcodes from the start of the run (a segment) holding one to it; None where the walk does
    not end where its run does (the opcode pass decides)."""
    heavy, heavy_long = puts
    looks = [m.start() for m in _SHORT_GETS.finditer(data) if m.group(1) in heavy]
    looks += [m.start() for m in _LONG_GETS.finditer(data) if _is_heavy_long(m.group(1), heavy, heavy_long)]
    if not looks:
        return 0
    fast = _FAST_BIG if len(data) >= _FAST_MEMO_LIMIT else _FAST
    looks.sort()
    gets, index = 0, 0
    for start, end in segments:
        position = start
        while index < len(looks) and looks[index] < end:
            if looks[index] >= position:
                position = _walk(data, fast, position, looks[index])
                gets += position == looks[index]
            index += 1
        if _walk(data, fast, position, end) != end:
            return None
    return gets


def _walk(data: bytes, fast: re.Pattern[bytes], position: int, target: int) -> int:
    """From the opcode at ``position`` of a scanned pickle, the start of the last opcode at or
    before ``target``: the fast scan's runs, and one by one what it stops at."""
    while True:
        position = fast.match(data, position, target).end()
        if position >= target:
            return position
        if data[position] == _GLOBAL:  # a name's two lines, which the scan has seen end
            after = data.index(b"\n", data.index(b"\n", position + 1) + 1) + 1
        else:
            after = _slow_opcode(data, position)
        if after > target:
            return position
        position = after


def _heavy_gets(data: bytes, segments: list[tuple[int, int]], puts: _Puts) -> int | None:
    """How many gets read a memo index a _HEAVY object was put at; None where a put follows
    something that did not make what it memoises."""
    found = []
    for start, end in segments:
        found += _MEMO_TOKENS.findall(data, start, end)
    if not found:
        return 0
    fenced, short_puts, long_puts, short_gets, long_gets = zip(*found)
    if any(fenced):
        return None
    heavy = set(map(ord, filter(None, short_puts)))
    heavy.update(map(_little_endian, filter(None, long_puts)))
    gets = sum(map(heavy.__contains__, map(ord, filter(None, short_gets))))
    return gets + sum(map(heavy.__contains__, map(_little_endian, filter(None, long_gets))))


def _little_endian(index: bytes) -> int:
    return int.from_bytes(index, "little")


def _shallow(data: bytes) -> bool:
    """Whether the pickle has too few tuple opcodes (counted by byte value) to nest a tuple
    deeper than MAX_TUPLE_DEPTH."""
    return len(data) <= MAX_TUPLE_DEPTH or sum(map(data.count, _TUPLE_CODES)) <= MAX_TUPLE_DEPTH


_TUPLE_CODES = tuple(_OPCODES[name].code.encode("latin-1") for name in ("TUPLE", "TUPLE1", "TUPLE2", "TUPLE3"))
# The opcodes making an object whose hash a file may choose (pickle_hashing's collidable ones).
_COLLIDING = ("BINFLOAT", "LONG1", "LONG4", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "FROZENSET", *_CALLS_AND_IDS)
_COLLIDING_CODES = tuple(_OPCODES[name].code.encode("latin-1") for name in _COLLIDING)
_PASSED: dict[bytes, int] = {}
_PASSED_LOCK = threading.Lock()
# At D = 768 a synthesised checkpoint holds 67 distinct rank-file pickles: 16 entries missed
# most of them (1.045x instructions per open), 256 hold them (0.976x); at most 4 MiB.
_PASSED_COUNT = 256
_PASSED_BYTES = 16 << 10


def _scan(data: bytes) -> tuple[list[tuple[int, int]], bool]:
    """Check every opcode; the runs of opcodes between counted ones too long for the fast scan
    (start, end), and whether an opcode of _UNCOUNTED_CODES was seen."""
    fast = _FAST_BIG if len(data) >= _FAST_MEMO_LIMIT else _FAST
    position, end, start, uncounted = 0, len(data), 0, False
    segments = []
    while True:
        position = fast.match(data, position).end()
        if position >= end:
            raise FileProblem("corrupt pickle data.pkl: it ends without a STOP opcode")
        code = data[position]
        if code == _STOP:
            segments.append((start, position))
            return segments, uncounted
        after = _slow_opcode(data, position)
        if code in _COUNTED:
            segments.append((start, position))
            start = after
        elif code in _UNCOUNTED_CODES or (code in _BEFORE_A_PUT and after < end and data[after] in _PUT_CODES):
            uncounted = True
        position = after


def _slow_opcode(data: bytes, position: int) -> int:
    """Check the opcode at ``position`` that the fast scan stopped at; where the next one starts."""
    code = data[position]
    op = pickletools.code2op.get(chr(code))
    if op is None:
        raise FileProblem(f"corrupt pickle data.pkl: unknown opcode {code:#04x} at byte {position}")
    if op.name not in ALLOWED_OPCODES:
        raise FileProblem(f"refused to unpickle data.pkl: opcode {op.name} is not allowed")
    width = _COUNTED.get(code)
    if width is not None:
        length = _unsigned(data, position + 1, width, op.name)
        after = position + 1 + width + length
        if code == _LONG4 and length > MAX_INT_BYTES:  # hashing one costs its length, each time it is a key
            raise FileProblem(
                f"refused to unpickle data.pkl: an integer of {length:,} bytes at byte {position} "
                f"(at most {MAX_INT_BYTES:,}: torch.save writes none this long)"
            )
    elif code == _LONG_BINPUT:
        index = _unsigned(data, position + 1, 4, op.name)
        if index > len(data):
            raise FileProblem(f"corrupt pickle data.pkl: memo index {index} in a pickle of {len(data)} bytes")
        after = position + 5
    elif code == _FRAME:  # the frame's opcodes follow, and are scanned as any others
        length = _unsigned(data, position + 1, 8, op.name)
        if position + 9 + length > len(data):
            raise FileProblem(
                f"corrupt pickle data.pkl: the FRAME of {length:,} bytes at byte {position} runs past the end"
            )
        after = position + 9
    elif op.arg is None or op.arg.n >= 0:  # DUP, MEMOIZE, a put after a fence, or one cut short
        after = position + 1 + (op.arg.n if op.arg else 0)
    else:  # GLOBAL, which the fast scan takes when it has its two lines
        after = len(data) + 1
    if after > len(data):
        raise FileProblem(f"corrupt pickle data.pkl: the argument of {op.name} at byte {position} runs past the end")
    return after


def _unsigned(data: bytes, start: int, width: int, name: str) -> int:
    if start + width > len(data):
        raise FileProblem(f"corrupt pickle data.pkl: the argument of {name} at byte {start - 1} runs past the end")
    return int.from_bytes(data[start : start + width], "little")
