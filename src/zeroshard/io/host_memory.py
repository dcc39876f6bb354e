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
"""

from __future__ import annotations

import mmap

import numpy as np

SMALL = 1 << 20  # bytes; below this, numpy's allocator (a mapping per array would waste pages)
_POSIX = hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS")
_FLAGS = (mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)) if _POSIX else 0


def new_zeros(numel: int, dtype: np.dtype) -> np.ndarray:
    """A zero-filled 1-D array of ``numel`` elements of ``dtype``, its memory mapped already."""
    dtype = np.dtype(dtype)
    nbytes = numel * dtype.itemsize
    if nbytes < SMALL or not _POSIX:
        return np.zeros(numel, dtype=dtype)
    return np.frombuffer(mmap.mmap(-1, nbytes, flags=_FLAGS), dtype=dtype)
