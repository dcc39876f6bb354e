"""Reads that skip the page cache, for big ranges of checkpoint files it does not hold.

A load keeps what it reads, so reading through the page cache pays for memory twice: the
kernel's cache pages and the load's own. Filling cache pages costs kernel time that swings
with the state of free memory (0.13-1.34 s per GiB between rounds of one load on the VM of
benchmarks/README.md, whose balloon takes freed memory back), and no load reads the same
bytes twice. So a big range that is not in the page cache is read with ``O_DIRECT``:
straight into the state where its memory has the file offset's alignment within a page (a
loader allocates each partition so, see :mod:`..checkpoint.loader`; rank files start their
partitions on a page), else into a few reused slots, which the loader copies into the state.

The reads run on a thread of their own (:class:`ReadAhead`), which reads the ranges the
loader announces (``NativeSource.prefetch``, a group's ranges before the group is read) in
their order, a few slots ahead of the loader: the storage keeps reading while the loader
maps the state's new memory, copies and checks what has arrived, and from one range to the
next, so a load takes about its read time, as the kernel's read-ahead into the page cache
gave before. A range the page cache holds (a checkpoint just written, or read
before) is read through it, which is faster than any disk; so are small ranges, files on
file systems without ``O_DIRECT`` (tmpfs) and platforms without it. The price: a load read
past the page cache leaves nothing there, so loading the same checkpoint again reads the
disk again (``ZEROSHARD_DIRECT_READS=0`` turns direct reads off).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import queue
import threading
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from itertools import islice
from pathlib import Path

import numpy as np

from .libc import cached_pages
from .libc import libc as _libc
from .members import open_member

ALIGN = 4096  # file offsets, lengths and addresses of direct reads: a page, a multiple of any disk's sector
SLOT_BYTES = 8 << 20  # one direct read (the disk's request size here is 4 MiB)
SLOTS = 4  # reads in flight or waiting for the loader: 32 MiB a reader
READERS = 2  # threads reading, each with a read in flight: the disk stays busy while one waits for a core
DIRECT_MIN_BYTES = SLOT_BYTES  # smaller ranges go through the page cache: too short for the thread to pay
COLD_FRACTION = 0.5  # a range with less than this much of it in the page cache is read direct

# ZEROSHARD_DIRECT_READS=0 reads everything through the page cache (a machine that loads the
# same checkpoint again and again, and would rather it stayed cached); tests switch it too.
ENABLED = hasattr(os, "O_DIRECT") and os.environ.get("ZEROSHARD_DIRECT_READS", "1") != "0"


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
    reads do. Nothing where the platform has no ``posix_fadvise``, or where the file cannot
    be opened (its read will say why)."""
    if not hasattr(os, "posix_fadvise") or length <= 0:
        return
    try:
        fd = open_member(path)
    except (OSError, ValueError):
        return
    try:
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
    (``cachestat``, or else ``mincore`` of a mapping that touches none of them); 1.0 where
    that cannot be asked."""
    libc = _libc()
    if libc is None or end <= begin:
        return 1.0
    start = begin - begin % mmap.PAGESIZE
    length = end - start
    pages = -(-length // mmap.PAGESIZE)
    cached = cached_pages(fd, start, length)
    if cached is not None:
        return min(cached / pages, 1.0)
    address = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
    if address in (None, ctypes.c_void_p(-1).value):
        return 1.0
    try:
        resident = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.c_void_p(address), length, resident) != 0:
            return 1.0
        return int(np.count_nonzero(np.frombuffer(resident, dtype=np.uint8) & 1)) / pages
    finally:
        libc.munmap(ctypes.c_void_p(address), length)


class SlotRing:
    """The reused, aligned slots direct reads land in; mapped on first use."""

    def __init__(self, slots: int | None = None, slot_bytes: int | None = None) -> None:
        self.slot_bytes = SLOT_BYTES if slot_bytes is None else slot_bytes
        self._count = SLOTS if slots is None else slots
        self._slots: list[mmap.mmap] = []

    def slots(self) -> list[memoryview]:
        """A writable view of each slot (the same memory on every call)."""
        if not self._slots:  # mapped as the reading thread's first reads fill them, not here
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
            self._slots = [mmap.mmap(-1, self.slot_bytes, flags=flags) for _ in range(self._count)]
        return [memoryview(slot) for slot in self._slots]


_Announced = tuple[Path, int, int, int]  # a span and the address of the memory it lands in (0: a slot)


class ReadAhead:
    """Reads announced spans of files past the page cache, in the order announced, on a
    thread of its own, into a ring of slots: at most a ring ahead of the loader taking them.
    A span announced with the memory it goes to (aligned: see :func:`lands_in_place`) is read
    straight into it instead, with no slot and no copy.

    A loader announces the ranges it will read next (:meth:`announce`, before mapping the
    memory they go to) and takes them in the same order (:meth:`take`), so the storage keeps
    reading between one range and the next. Taking anything but the next announced spans
    (a read that changed its mind) drops what was announced and read ahead, and says so
    (None): the caller reads on its own. :meth:`close` stops the thread; so does the
    reader's garbage collection.
    """

    _POLL_SECONDS = 1.0  # how often a waiting side checks whether the other still lives

    def __init__(self, ring: SlotRing | None = None) -> None:
        self._ring = ring or SlotRing()
        self.slot_bytes = self._ring.slot_bytes
        self._lock = threading.Lock()
        self._announced: deque[_Announced] = deque()  # announced, not yet taken
        self._runs: list[_Run] = []  # the running thread's, if any; signalled when this reader is collected
        weakref.finalize(self, _Run.signal_all, self._runs)

    def announce(self, path: Path, spans: Sequence[tuple[int, int]], into: Sequence[memoryview | None] = ()) -> None:
        """Read ``spans`` of ``path`` (each at most a slot, ``begin`` aligned) next, after
        those announced before. ``into``: per span, the writable memory its bytes go to, or
        None (a slot); a span's memory is read into directly where :func:`lands_in_place`."""
        if any(end - begin > self._ring.slot_bytes or begin % ALIGN or end <= begin for begin, end in spans):
            raise ValueError("ReadAhead: a span is empty, longer than a slot or starts unaligned")
        targets = _targets(spans, into)
        with self._lock:
            if not self._runs:
                self._runs.append(_Run(self._ring.slots()))
            for (begin, end), target in zip(spans, targets):
                self._announced.append((path, begin, end, address_of(target)))
                self._runs[0].to_read.put((path, begin, end, target))

    def take(
        self, path: Path, spans: Sequence[tuple[int, int]], into: Sequence[memoryview | None] = ()
    ) -> Iterator[memoryview] | None:
        """The bytes of ``spans`` of ``path``, a view per span as it arrives (shorter only
        where the file ends first; a slot's valid until the next step, or the span's own
        memory where it was read in place), when they are the next announced, with the same
        ``into``; else None: for spans announced later (the reads changed order) once
        everything announced is dropped, for spans never announced with nothing dropped. An
        error of the read is raised in the loop; leaving the loop early drops what is
        announced too."""
        wanted = [(path, begin, end, address_of(target)) for (begin, end), target in zip(spans, _targets(spans, into))]
        with self._lock:
            if not self._runs or list(islice(self._announced, len(wanted))) != wanted:
                if wanted and wanted[0] in self._announced:
                    self._stop()  # read ahead in an order the loader left: of no use now
                return None
            for _ in wanted:
                self._announced.popleft()
            run = self._runs[0]
        return self._deliver(run, wanted)

    def close(self) -> None:
        """Drop what is announced and stop the thread (waiting for its read in flight)."""
        with self._lock:
            self._stop()

    def _deliver(self, run: _Run, wanted: list[_Announced]) -> Iterator[memoryview]:
        complete = False
        try:
            for _, begin, end, _ in wanted:
                item = run.next_arrival()
                if isinstance(item, BaseException):
                    raise item
                view, got, slot = item
                yield view[: min(got, end - begin)]
                if slot is not None:
                    run.free.put(slot)
            complete = True
        finally:
            if not complete:  # drop what this run read ahead, not a later run's
                with self._lock:
                    if self._runs and self._runs[0] is run:
                        self._stop()

    def _stop(self) -> None:
        self._announced.clear()
        while self._runs:
            self._runs.pop().stop()


class _Run:
    """The reading threads and the queues they share with the loader; they end with :meth:`stop`.

    Each thread claims a free slot and the next span together, so spans get slots in their
    order and the span the loader waits for never waits for a slot; READERS threads keep as
    many reads in flight, so the disk is not idle while a thread waits to be scheduled."""

    def __init__(self, slots: list[memoryview], readers: int = 0) -> None:
        self.slots = slots
        self.to_read: queue.Queue[tuple[Path, int, int, memoryview | None] | None] = queue.Queue()
        self.free: queue.Queue[int | None] = queue.Queue()
        self.arrived: queue.Queue[tuple[int, _Arrival | BaseException]] = queue.Queue()
        self.stopping = threading.Event()
        self._claim = threading.Lock()
        self._claimed = 0  # spans handed to threads so far (under _claim): the next one's number
        self._delivered = 0  # spans handed to the loader so far
        self._early: dict[int, _Arrival | BaseException] = {}  # arrived before their turn
        for index in range(len(slots)):
            self.free.put(index)
        count = max(1, min(readers or READERS, len(slots)))
        self.threads = [threading.Thread(target=self._read_all, name="zeroshard-read-ahead", daemon=True) for _ in range(count)]
        for thread in self.threads:
            thread.start()

    def signal(self) -> None:
        """Tell the threads to end (each after its read in flight, if any)."""
        self.stopping.set()
        for _ in self.threads:
            self.to_read.put(None)
            self.free.put(None)

    def stop(self) -> None:
        """End the threads and wait for them."""
        self.signal()
        for thread in self.threads:
            thread.join()

    @staticmethod
    def signal_all(runs: list[_Run]) -> None:
        for run in runs:
            run.signal()

    def next_arrival(self) -> _Arrival | BaseException:
        """The memory, byte count and slot (None: read in place) of the next span in announced
        order, or its read's error."""
        while self._delivered not in self._early:
            try:
                number, item = self.arrived.get(timeout=ReadAhead._POLL_SECONDS)
            except queue.Empty:
                if not any(thread.is_alive() for thread in self.threads) and self.arrived.empty():
                    return RuntimeError("the read-ahead threads ended before their reads")
                continue
            self._early[number] = item
        self._delivered += 1
        return self._early.pop(self._delivered - 1)

    def _read_all(self) -> None:
        descriptors: dict[Path, int] = {}
        try:
            while True:
                with self._claim:
                    index = self.free.get()
                    span = None if index is None or self.stopping.is_set() else self.to_read.get()
                    number = self._claimed
                    self._claimed += 1
                if span is None or self.stopping.is_set():
                    return
                try:
                    path, begin, end, target = span
                    if target is not None:  # read in place: the slot is the next span's
                        self.free.put(index)
                        slot, view = None, target
                    else:
                        slot, view = index, self.slots[index][: -(-(end - begin) // ALIGN) * ALIGN]
                    if path not in descriptors:
                        descriptors[path] = _must_open_direct(path)
                    try:
                        got = _read_until_end(descriptors[path], view, begin)
                    except OSError as err:
                        if err.errno != errno.EINVAL:
                            raise
                        # A file system asking another alignment: this file through the page cache.
                        os.close(descriptors.pop(path))
                        descriptors[path] = open_member(path)
                        got = _read_until_end(descriptors[path], view, begin)
                    self.arrived.put((number, (view, got, slot)))
                except BaseException as err:  # handed to the loader, which raises it in its turn
                    self.arrived.put((number, err))
                    return
        finally:
            for fd in descriptors.values():
                os.close(fd)


_Arrival = tuple[memoryview, int, "int | None"]  # where a span landed, its bytes read, its slot (None: in place)


def lands_in_place(view: memoryview, begin: int, end: int) -> bool:
    """Whether bytes [begin, end) of a file, read past the page cache, can land straight in
    ``view``: writable and contiguous, exactly as long, its address and length multiples of
    ALIGN (a direct read's, as the file offset ``begin`` is)."""
    return (
        not view.readonly
        and view.c_contiguous
        and view.nbytes == end - begin
        and (end - begin) % ALIGN == 0
        and address_of(view) % ALIGN == 0
    )


def _targets(spans: Sequence[tuple[int, int]], into: Sequence[memoryview | None]) -> list[memoryview | None]:
    """Per span, the memory it is read into in place, or None (a slot)."""
    if not into:
        return [None] * len(spans)
    if len(into) != len(spans):
        raise ValueError(f"ReadAhead: {len(into)} destinations for {len(spans)} spans")
    return [view if view is not None and lands_in_place(view, *span) else None for view, span in zip(into, spans)]


def destinations(into: memoryview | None, origin: int, spans: Sequence[tuple[int, int]]) -> list[memoryview | None]:
    """Per span (file offsets), its part of ``into`` (the bytes from file offset ``origin``),
    or None where it reaches outside them; none at all without ``into`` (the read-ahead then
    reads every span into a slot)."""
    if into is None:
        return []
    return [into[begin - origin : end - origin] if origin <= begin and end - origin <= len(into) else None for begin, end in spans]


def same_memory(a: memoryview, b: memoryview) -> bool:
    """Whether two byte views are the same bytes (a span that was read in place)."""
    return len(a) == len(b) and address_of(a) == address_of(b)


def address_of(view: memoryview | None) -> int:
    """Where ``view``'s bytes start (0 for None)."""
    if view is None:
        return 0
    return np.frombuffer(view, dtype=np.uint8).ctypes.data if view.nbytes else 0


def _must_open_direct(path: Path) -> int:
    fd = open_direct(path)
    if fd is None:
        raise OSError(errno.EINVAL, f"{path}: cannot be read past the page cache (O_DIRECT)")
    return fd


def _read_until_end(fd: int, view: memoryview, offset: int) -> int:
    """Read into ``view`` from ``offset`` until it is full or the file ends; the bytes read."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            break
        done += got
    return done
