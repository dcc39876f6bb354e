"""The C library's memory calls (mmap, mincore, munmap, madvise), typed, for what Python's
mmap module does not offer: asking which pages of a file the page cache holds, and mapping
the pages of a range of memory in one call. None where there is no C library to load."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


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
    except (OSError, AttributeError):
        return None
    return library
