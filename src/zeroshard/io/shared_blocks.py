"""Checksum blocks that one reader of a load checks together with the other ranks.

:class:`~.block_reader.RangeReader` reads a block that a range holds only part of whole,
to check it. In a load whose ranks check such blocks together (:mod:`.shared_checks`), it
hands the block to :class:`SharedBlocks` instead, which reads just the part (straight into
the caller's array) and the bytes of the block that no rank needs and this rank owns, and
adds their raw CRCs to the load's terms. Blocks a reader still checks whole are marked so,
and the others' parts of them are not combined.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .checksum import FileRecord
from .digest import raw_crc
from .members import open_member
from .observe import observe_bytes
from .read_stats import ReadStats, count_read
from .safetensors_io import pread_into
from .shared_checks import ByteRuns, RecordKey, SharedRecordChecks, merged


class SharedBlocks:
    """The blocks one reader checks with the other ranks of a load. ``needed(path)``: the
    bytes of the file that some rank of the load reads, the same on every rank (asked once
    per file); None for a file whose blocks this reader checks whole."""

    def __init__(self, together: SharedRecordChecks, needed: Callable[[Path], ByteRuns | None], stats: ReadStats | None) -> None:
        self._together = together
        self._needed = needed
        self._stats = stats
        self._runs: dict[str, tuple[ByteRuns, list[int]] | None] = {}

    def covers(self, path: Path) -> bool:
        """Whether the blocks of ``path`` are checked together (its needed bytes are known)."""
        return self._file_runs(path) is not None

    def read_part(self, path: Path, record: FileRecord, index: int, begin: int, out: memoryview, observe: Any = None) -> None:
        """The part of block ``index`` that ``out`` (bytes from ``begin``) holds, read into
        it, and the gaps of the block this rank owns; their raw CRCs go to the load's terms.
        ``observe`` (offsets in ``out``) gets the part's segment CRCs from the same pass."""
        block_start, block_end = record.block_range(index)
        lo, hi = max(begin, block_start), min(begin + len(out), block_end)
        key, size, crc = _key(path, index), block_end - block_start, record.crc32[index]
        fd = open_member(path, read_ahead=False)
        try:
            target = out[lo - begin : hi - begin]
            pread_into(fd, target, lo, path)
            count_read(self._stats, path.name, hi - lo)
            part_crc = raw_crc(target) if observe is None else observe_bytes(target, 0, len(target), observe, lo - begin)
            self._together.terms.add(key, size, crc, lo - block_start, hi - block_start, part_crc)
            needed = lambda: self._block_runs(path, block_start, block_end)  # noqa: E731 - asked once per block
            for gap_begin, gap_end in self._together.gaps(key, size, lo - block_start, hi - block_start, needed):
                gap = memoryview(np.empty(gap_end - gap_begin, dtype=np.uint8))
                pread_into(fd, gap, block_start + gap_begin, path)
                count_read(self._stats, path.name, len(gap))
                self._together.terms.add(key, size, crc, gap_begin, gap_end, raw_crc(gap))
        finally:
            os.close(fd)

    def mark_whole(self, path: Path, index: int) -> None:
        """Block ``index`` of ``path`` was checked whole here: the others' parts of it need no combining."""
        self._together.terms.whole.add(_key(path, index))

    def _file_runs(self, path: Path) -> tuple[ByteRuns, list[int]] | None:
        key = str(path)
        if key not in self._runs:
            runs = self._needed(path)
            runs = None if runs is None else merged(runs)
            self._runs[key] = None if runs is None else (runs, [begin for begin, _ in runs])
        return self._runs[key]

    def _block_runs(self, path: Path, block_start: int, block_end: int) -> ByteRuns:
        """The needed bytes of ``path`` inside [block_start, block_end), from the block's start."""
        runs, starts = self._file_runs(path)
        found = []
        for run_begin, run_end in runs[max(0, bisect.bisect_right(starts, block_start) - 1) :]:
            if run_begin >= block_end:
                break
            if run_end > block_start:
                found.append((max(run_begin, block_start) - block_start, min(run_end, block_end) - block_start))
        return found


def _key(path: Path, index: int) -> RecordKey:
    return (str(path), f"checksum block {index}")
