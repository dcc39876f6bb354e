"""Making hostile torch.save files by hand, and measuring what reading one costs.

A pickle is written opcode by opcode (protocol 2, what torch.save writes), so that a test can
re-use one memoised object as often as it likes: what a hostile file does and no pickler
would. :func:`measured` runs a call under ``tracemalloc`` and reports its peak allocation
and the CPU time its thread spent on it, so a test can assert a bound instead of letting a
bomb allocate gigabytes. CPU time of the calling thread, not wall-clock time: a busy machine
stalls a process without charging it, so the bounds hold beside a CPU hog; and not the
process's, which other threads of a long test session (OpenMP workers spinning after a
torch op) add to.
"""

from __future__ import annotations

import gc
import os
import time
import tracemalloc
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

PROTO = b"\x80\x02"


def archive(path: Path, data: bytes, records: dict[str, bytes] | None = None) -> Path:
    """A torch.save-like zip holding the pickle ``data`` and storage ``records``."""
    with zipfile.ZipFile(path, "w") as zipped:
        zipped.writestr("archive/data.pkl", data)
        zipped.writestr("archive/byteorder", b"little")
        for key, value in (records or {}).items():
            zipped.writestr(f"archive/data/{key}", value)
    return path


def text(value: str) -> bytes:
    """BINUNICODE."""
    encoded = value.encode()
    return b"X" + len(encoded).to_bytes(4, "little") + encoded


def integer(value: int) -> bytes:
    """BININT (a signed 32-bit int)."""
    return b"J" + value.to_bytes(4, "little", signed=True)


def put(index: int) -> bytes:
    return b"r" + index.to_bytes(4, "little")  # LONG_BINPUT


def get(index: int) -> bytes:
    return b"j" + index.to_bytes(4, "little")  # LONG_BINGET


def glob(qualname: str) -> bytes:
    module, _, name = qualname.rpartition(".")
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def distinct_ints(count: int) -> bytes:
    return b"".join(integer(i) for i in range(count))


def memoised_list(index: int, items: bytes) -> bytes:
    """A list of ``items`` stored in memo ``index`` and popped off the stack."""
    return b"](" + items + b"e" + put(index) + b"0"


def memoised_dict(index: int, count: int) -> bytes:
    """A dict of ``count`` string keys (values None) stored in memo ``index``, popped."""
    return b"}(" + b"".join(text(f"k{i}") + b"N" for i in range(count)) + b"u" + put(index) + b"0"


def kept(repeated: bytes, times: int) -> bytes:
    """``repeated`` (which leaves one object on the stack) ``times`` times, into one list."""
    return b"](" + repeated * times + b"e"


def measured(call: Callable[[], Any]) -> tuple[Any, int, float]:
    """(what ``call`` returned or the exception it raised, peak bytes allocated, CPU seconds
    of this thread while it ran, traced)."""
    tracemalloc.start()
    started = time.thread_time()
    try:
        outcome = call()
    except Exception as err:  # noqa: BLE001 - the caller asserts which
        outcome = err
    cpu_seconds = time.thread_time() - started
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return outcome, peak, cpu_seconds


def cpu_seconds(call: Callable[[], Any]) -> float:
    """The CPU seconds this thread spends in ``call`` (untraced; exceptions propagate), with
    the garbage collector paused: a collection would walk the whole test session's heap and
    charge it to the call. Unlike wall-clock time it does not grow when other processes load
    the machine."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        started = time.thread_time()
        call()
        return time.thread_time() - started
    finally:
        if collecting:
            gc.enable()


def edit_torch_file(path: Path, change: Callable[[Any], None]) -> None:
    """Load a file DeepSpeed wrote (its own classes), let ``change`` edit it, save it back:
    torch.save writes an object the edit shares once and refers to it after."""
    import torch

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    raw = torch.load(path, map_location="cpu", weights_only=False)
    change(raw)
    torch.save(raw, path)


# ---- keys of one hash ----------------------------------------------------------------------------
MERSENNE_61 = (1 << 61) - 1  # an int's hash is itself modulo this
_LANE = (11400714785074694791, 14029467366897019727, 2870177450012600261)  # CPython's tuple-hash primes
_MASK = (1 << 64) - 1


def long1(value: int) -> bytes:
    """LONG1 (a signed int of up to 255 bytes)."""
    encoded = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(encoded)]) + encoded


def colliding_ints(count: int) -> list[int]:
    """``count`` distinct ints of one hash: multiples of 2^61 - 1."""
    return [k * MERSENNE_61 for k in range(1, count + 1)]


def colliding_pairs(count: int, target: int = 12345) -> list[tuple[int, int]]:
    """``count`` distinct pairs ``(i, b)`` whose hash is ``target``: CPython mixes a tuple's
    item hashes by invertible steps, so for each small ``i`` the hash ``b`` must have is
    solved for (kept where an int below 2^61 - 1 hashes to it: itself)."""
    prime1, prime2, prime5 = _LANE
    rotate = lambda x, r: ((x << r) | (x >> (64 - r))) & _MASK  # noqa: E731
    mix = lambda acc, lane: (rotate((acc + lane * prime2) & _MASK, 31) * prime1) & _MASK  # noqa: E731
    after_two = rotate(((target - (2 ^ prime5 ^ 3527539)) * pow(prime1, -1, 1 << 64)) & _MASK, 64 - 31)
    pairs, first = [], 0
    while len(pairs) < count:
        second = ((after_two - mix(prime5, first)) * pow(prime2, -1, 1 << 64)) & _MASK
        if second < MERSENNE_61 - 1:
            pairs.append((first, second))
        first += 1
    return pairs
