"""New host arrays for what a load reads: zero-filled, their pages mapped when allocated.

A load builds the state it returns in new memory (a load that fails changes nothing), and
the page faults of that memory cost more than reading it from the page cache: a fault per
4 KiB page, each a trap into the kernel. Mapping the pages in the allocating call
(``MAP_POPULATE``) does the same work in one system call, about half the time of faulting
them in one by one (0.16 s against 0.29 s for 512 MiB on the 2-core VM of
benchmarks/README.md, "Loads that read each byte once").

Not numpy's allocator: above 4 MiB numpy asks for transparent huge pages
(``MADV_HUGEPAGE``), whose cost swings with the state of free memory: little when free
2 MiB blocks are at hand and warm, much when the kernel must compact memory to find them
(``defrag=madvise``, a common default) or, in a VM with free page reporting, when the host
has taken those blocks back (the same 512 MiB: 0.02 s or 1.4 s here). A load should take
the same time every time.

The state a load replaces is freed on a thread (:func:`release_later`): unmapping a GiB of
touched pages takes about 0.1 s of kernel time here, which the load need not wait for, and
CPython releases the GIL while it unmaps. The next load waits for it first
(:func:`wait_released`), so two loads never hold three states. One thread does it for the
whole process, started when a load begins, so a load's end only queues its old state.

A load that reads into the array as it goes asks for it unpopulated and has its pages
mapped as the reads go (:func:`populate`, ``MADV_POPULATE_WRITE``): the same kernel work,
done while the disk reads ahead (:mod:`.direct_reads`) instead of before the first read; for
a big range on a thread of its own (:class:`MappingAhead`), a few chunks ahead of the
loader, which then only copies and checks.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import mmap
import os
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from .libc import libc

SMALL = 1 << 20  # bytes; below this, numpy's allocator (a mapping per array would waste pages)
MAP_AHEAD_BYTES = 8 << 20  # mapping_ahead maps the pages of a range this big on a thread ahead of its reads
MAP_AHEAD_PIECE = 4 << 20  # that thread's call (it stops between two when the read ends early)
_POSIX = hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS")
_FLAGS = (mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) if _POSIX else 0
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
MADV_POPULATE_WRITE = 23  # Linux >= 5.14; older kernels refuse it (EINVAL) and the writes fault the pages in
_populate_refused: list[bool] = []


def new_zeros(numel: int, dtype: np.dtype, *, populated: bool = True, phase: int = 0) -> np.ndarray:
    """A zero-filled 1-D array of ``numel`` elements of ``dtype``: its memory mapped already,
    or, with ``populated=False``, mapped as the caller populates or writes it.

    ``phase`` (bytes, a multiple of the itemsize below the page size): where in its first page
    a big array starts, so that a file's bytes read past the page cache can land in it
    directly where their file offset has that phase (:mod:`.direct_reads`); small arrays
    ignore it."""
    dtype = np.dtype(dtype)
    nbytes = numel * dtype.itemsize
    if nbytes < SMALL or not _POSIX:
        return np.zeros(numel, dtype=dtype)
    if not 0 <= phase < mmap.PAGESIZE or phase % dtype.itemsize:
        raise ValueError(f"phase {phase} is not a multiple of {dtype.itemsize} below the page size")
    memory = mmap.mmap(-1, nbytes + phase, flags=_FLAGS | (_POPULATE if populated else 0))
    return np.frombuffer(memory, dtype=dtype, count=numel, offset=phase)


def populate(view: memoryview) -> None:
    """Map the pages under the writable bytes ``view`` in one call, ahead of writing them
    (a hint: nothing where the kernel or platform cannot)."""
    library = libc()
    if library is None or _populate_refused or len(view) == 0 or view.readonly or not view.c_contiguous:
        return
    address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    start = address - address % mmap.PAGESIZE
    if library.madvise(ctypes.c_void_p(start), address + len(view) - start, MADV_POPULATE_WRITE) != 0:
        if ctypes.get_errno() == errno.EINVAL:  # a kernel without it: do not ask again
            _populate_refused.append(True)


class MappingAhead:
    """Maps the pages under ``views`` (writable bytes, in the order they will be written) on a
    thread of its own, so the kernel's work of mapping new memory runs on another core while
    the caller fills the views. A hint, as :func:`populate`: a view written before its turn
    has its pages mapped by the writes. :meth:`close` (or leaving the ``with`` block) stops
    the thread after the view it is mapping."""

    def __init__(self, views: Sequence[memoryview]) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._map, args=(list(views),), name="zeroshard-map-ahead", daemon=True)
        self._thread.start()

    def _map(self, views: list[memoryview]) -> None:
        for view in views:
            if self._stop.is_set():
                return
            populate(view)

    def close(self) -> None:
        """Stop mapping once the view being mapped is done, and wait for that."""
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> MappingAhead:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


@contextmanager
def mapping_ahead(out: memoryview) -> Iterator[Callable[[memoryview], None]]:
    """While reading into ``out`` (new memory, in order): its pages mapped on a thread ahead
    of the reads when it is big (the caller maps nothing itself), else each chunk's by the
    caller just before it lands (the populate this yields)."""
    if len(out) < MAP_AHEAD_BYTES:
        yield populate
        return
    pieces = [out[start : start + MAP_AHEAD_PIECE] for start in range(0, len(out), MAP_AHEAD_PIECE)]
    with MappingAhead(pieces):
        yield lambda _: None


class _Releaser:
    """One thread, for the life of the process, that drops what it is handed: a load's end
    hands over the state it replaced with a queue's put, not a thread's start (which waits
    for the new thread to run, behind every other busy core: 5-17 ms at the end of a load of
    four ranks on two cores)."""

    def __init__(self) -> None:
        self._queue: queue.Queue[list] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the thread unless it runs."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._drop_all, name="zeroshard-release", daemon=True)
                self._thread.start()

    def put(self, objects: list) -> None:
        self.start()
        self._queue.put(objects)

    def join(self) -> None:
        self._queue.join()

    def _drop_all(self) -> None:
        while True:
            objects = self._queue.get()
            objects.clear()
            del objects
            self._queue.task_done()


_releaser = _Releaser()


def _new_releaser_in_child() -> None:
    # A forked child has no thread of its parent's, and the queue's lock may be held by one.
    global _releaser
    _releaser = _Releaser()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_releaser_in_child)


def release_later(objects: list) -> None:
    """Drop ``objects`` (a list holding the last references to host memory the caller is
    done with) on the release thread; the caller keeps no other reference to them. Their
    memory is back once :func:`wait_released` returns (the interpreter waits for it at exit
    too)."""
    if objects:
        _releaser.put(objects)


def wait_released() -> None:
    """Wait until what :func:`release_later` was given so far is dropped. Starts the release
    thread if it does not run yet: a load calls this first, so its end hands its old state
    to a running thread."""
    _releaser.start()
    _releaser.join()


@atexit.register
def _wait_at_exit() -> None:
    _releaser.join()  # no thread started now: the interpreter is going
