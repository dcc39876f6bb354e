"""The C library's memory calls (mmap, mincore, munmap, madvise) and Linux's ``cachestat``,
typed, for what Python's mmap module does not offer: asking which pages of a file the page
cache holds, and mapping the pages of a range of memory in one call. None where there is no
C library to load."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import platform

# cachestat(2) (Linux >= 6.5) has the same number on every architecture of the generic table
# and on x86_64; elsewhere it is not asked.
_CACHESTAT = 451 if platform.machine() in ("x86_64", "aarch64", "arm64", "riscv64") else None
_cachestat_missing: list[bool] = []


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The C library with mmap, mincore, munmap and madvise typed, or None."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        library = ctypes.CDLL(name, use_errno=True)
        library.mmap.restype = ctypes.c_void_p
        library.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        library.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        library.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        library.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        library.syscall.restype = ctypes.c_long
    except (OSError, AttributeError):
        return None
    return library


def cached_pages(fd: int, begin: int, length: int) -> int | None:
    """How many pages of bytes [begin, begin + length) of the open file ``fd`` the page cache
    holds (``cachestat``, which maps nothing, so it never waits on the process's memory map
    lock as ``mmap`` and ``mincore`` do while other threads fault pages in); None where the
    kernel has no ``cachestat``."""
    library = libc()
    if library is None or _CACHESTAT is None or _cachestat_missing:
        return None
    span, stat = _CachestatRange(begin, length), _Cachestat()
    if library.syscall(_CACHESTAT, fd, ctypes.byref(span), ctypes.byref(stat), 0) != 0:
        if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):  # an older kernel, or a seccomp filter
            _cachestat_missing.append(True)
        return None
    return stat.nr_cache
