"""Reads that skip the page cache, for big ranges of checkpoint files it does not hold.

A load keeps what it reads, so reading through the page cache pays for memory twice: the
kernel's cache pages and the load's own. Filling cache pages costs kernel time that swings
with the state of free memory (0.13-1.34 s per GiB between rounds of one load on the VM of
benchmarks/README.md, whose balloon takes freed memory back), and no load reads the same
bytes twice. So a big range that is not in the page cache is read with ``O_DIRECT``: the
disk writes into a few reused slots, and the loader copies each slot into the state.

The reads run on a thread of their own (:class:`ReadAhead`), a few slots ahead of the
loader, so the storage keeps reading while the loader maps the state's new memory, copies
and checks what has arrived: the load then takes about the read's time, as the disk's
read-ahead gave before. A range the page cache holds (a checkpoint just written, or read
before) is read through it, which is faster than any disk; so are small ranges, files on
file systems without ``O_DIRECT`` (tmpfs) and platforms without it.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import queue
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from .libc import libc as _libc
from .members import open_member

ALIGN = 4096  # file offsets, lengths and addresses of direct reads: a page, a multiple of any disk's sector
SLOT_BYTES = 8 << 20  # one direct read (the disk's request size here is 4 MiB)
SLOTS = 4  # reads in flight or waiting for the loader: 32 MiB a reader
DIRECT_MIN_BYTES = SLOT_BYTES  # smaller ranges go through the page cache: too short for the thread to pay
COLD_FRACTION = 0.5  # a range with less than this much of it in the page cache is read direct

ENABLED = hasattr(os, "O_DIRECT")  # tests switch it off to compare the two paths


def open_direct(path: Path) -> int | None:
    """A descriptor of ``path`` that reads past the page cache, or None where the platform
    or the file system has none (the caller reads through the page cache)."""
    if not ENABLED:
        return None
    try:
        return open_member(path, direct=True)
    except OSError as err:
        if err.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return None
        raise


def advise(path: Path, begin: int, length: int) -> None:
    """Ask the kernel to start reading bytes [begin, begin + length) of the regular file
    ``path`` into the page cache (``posix_fadvise(WILLNEED)``); a hint, returning before the
    reads do. Nothing for a range the loader will read direct (the read-ahead thread does
    it, and cached pages would only cost), where the platform has no ``posix_fadvise``, or
    where the file cannot be opened (its read will say why)."""
    if not hasattr(os, "posix_fadvise") or length <= 0:
        return
    try:
        fd = open_member(path)
    except (OSError, ValueError):
        return
    try:
        if worth_reading_direct(fd, begin - begin % ALIGN, begin + length):
            return
        os.posix_fadvise(fd, begin, length, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass  # a file system without read-ahead: the reads go on without the hint
    finally:
        os.close(fd)


def worth_reading_direct(fd: int, begin: int, end: int) -> bool:
    """Whether bytes [begin, end) of the open file ``fd`` should be read direct: aligned,
    big enough, and mostly not in the page cache."""
    return (
        ENABLED
        and begin % ALIGN == 0
        and end - begin >= DIRECT_MIN_BYTES
        and cached_fraction(fd, begin, end) < COLD_FRACTION
    )


def cached_fraction(fd: int, begin: int, end: int) -> float:
    """The fraction of the pages of bytes [begin, end) of ``fd`` that the page cache holds
    (``mincore`` of a mapping that touches none of them); 1.0 where that cannot be asked."""
    libc = _libc()
    if libc is None or end <= begin:
        return 1.0
    start = begin - begin % mmap.PAGESIZE
    length = end - start
    address = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
    if address in (None, ctypes.c_void_p(-1).value):
        return 1.0
    try:
        pages = -(-length // mmap.PAGESIZE)
        resident = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.c_void_p(address), length, resident) != 0:
            return 1.0
        return sum(flag & 1 for flag in bytes(resident)) / pages
    finally:
        libc.munmap(ctypes.c_void_p(address), length)


class SlotRing:
    """The reused, aligned slots direct reads land in; mapped on first use."""

    def __init__(self, slots: int | None = None, slot_bytes: int | None = None) -> None:
        self.slot_bytes = SLOT_BYTES if slot_bytes is None else slot_bytes
        self._count = SLOTS if slots is None else slots
        self._slots: list[mmap.mmap] = []

    def slots(self) -> list[memoryview]:
        if not self._slots:
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
            self._slots = [mmap.mmap(-1, self.slot_bytes, flags=flags) for _ in range(self._count)]
        return [memoryview(slot) for slot in self._slots]


class ReadAhead:
    """Reads ``spans`` (file offsets ``(begin, end)``, each at most a slot, ``begin``
    aligned) of the direct descriptor ``fd`` on a thread, into the ring's slots, in order.

    Iterating yields ``(begin, data)`` per span as it arrives: ``data`` is the slot's view,
    shorter than the span only where the file ends first, and valid until the next step.
    Leaving the ``with`` block (done, or on an error) stops the thread and waits for it; an
    error of the thread's read is raised in the loop.
    """

    _POLL_SECONDS = 1.0  # how often a waiting loader checks that the thread still lives

    def __init__(self, fd: int, spans: Sequence[tuple[int, int]], ring: SlotRing) -> None:
        if any(end - begin > ring.slot_bytes or begin % ALIGN for begin, end in spans):
            raise ValueError("ReadAhead: a span is longer than a slot or starts unaligned")
        self._fd = fd
        self._spans = list(spans)
        self._slots = ring.slots()
        self._stop = threading.Event()
        self._free: queue.Queue[int | None] = queue.Queue()
        self._arrived: queue.Queue[tuple[int, int, int] | BaseException] = queue.Queue()
        self._thread = threading.Thread(target=self._read_all, name="zeroshard-read-ahead", daemon=True)

    def __enter__(self) -> Iterator[tuple[int, memoryview]]:
        for index in range(len(self._slots)):
            self._free.put(index)
        self._thread.start()
        return self._arrivals()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._free.put(None)
        self._thread.join()

    def _read_all(self) -> None:
        try:
            for begin, end in self._spans:
                index = self._free.get()
                if index is None or self._stop.is_set():
                    return
                slot = self._slots[index]
                length = min(len(slot), -(-(end - begin) // ALIGN) * ALIGN)
                self._arrived.put((index, begin, _read_until_end(self._fd, slot[:length], begin)))
        except BaseException as err:  # handed to the loader, which raises it
            self._arrived.put(err)

    def _arrivals(self) -> Iterator[tuple[int, memoryview]]:
        for begin, end in self._spans:
            item = self._next()
            if isinstance(item, BaseException):
                raise item
            index, _, got = item
            yield begin, self._slots[index][: min(got, end - begin)]
            self._free.put(index)

    def _next(self) -> tuple[int, int, int] | BaseException:
        while True:
            try:
                return self._arrived.get(timeout=self._POLL_SECONDS)
            except queue.Empty:
                if not self._thread.is_alive() and self._arrived.empty():
                    return RuntimeError("the read-ahead thread ended before its reads")


def _read_until_end(fd: int, view: memoryview, offset: int) -> int:
    """Read into ``view`` from ``offset`` until it is full or the file ends; the bytes read."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            break
        done += got
    return done
