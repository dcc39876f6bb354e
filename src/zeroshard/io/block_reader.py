"""Checked byte ranges of checkpoint files, for readers that walk many small ranges.

Converters read a parameter piece by piece, and consecutive pieces usually share a
checksum block: the one where the previous piece ended. :class:`RangeReader` reads whole
blocks, checks each against the file's :class:`FileRecord`, and keeps the partly used
blocks at the ends of each range in a small cache shared by all files, so a block under two
neighbouring ranges is read and checked once. Interior blocks are used whole and never
cached, so the cache stays a few blocks big whatever the range sizes.

Big ranges (whole tensors of a large model) are memory-mapped instead of read: the checksum
is computed on the file's cached pages and a converter writes them out from there, so the
bytes are copied once (into the output) rather than twice.

A loader, which keeps what it reads, uses :meth:`RangeReader.read_into` instead: the blocks
wholly inside the range land in the caller's array a chunk at a time, and each chunk is
checked there right after it lands, while it is still in the CPU cache. From the page cache
that is one copy (the kernel's, a pread per chunk); a big range the page cache lacks is read
past it, a few chunks ahead on a thread, straight into the caller's array where that has the
file's alignment within a page (announced with it), else into slots it is copied in from
(:mod:`.direct_reads`). So at most one copy and a checksum pass: about the cost of reading
the bytes once. Given an observer (a digester: ``cuts`` and ``segment``, see
:mod:`..checkpoint.attest.digests`), it also hands over the CRC of every segment it checks, cut at the
observer's boundaries too, so a load digests what it read with no pass of its own. In a
load whose ranks check the blocks at their ranges' ends together
(:meth:`RangeReader.check_with_others`), such a block is read only in part
(:mod:`.shared_blocks`).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np

from .checksum import FileRecord
from .damage import CheckpointDamagedError
from . import direct_reads
from .digest import FUSED, combine, crc32
from .direct_reads import ALIGN, ReadAhead, advise, destinations, open_direct, same_memory, worth_reading_direct
from .dtypes import from_bytes
from .host_memory import mapping_ahead
from .observe import PartObserver, observe_bytes
from .members import open_member
from .read_stats import ReadStats, count_read
from .safetensors_io import check_blocks, map_range, pread_into
from .shared_blocks import SharedBlocks
from .shared_checks import ByteRuns, SharedRecordChecks

DEFAULT_CACHE_BYTES = 32 << 20
MAP_BYTES = 8 << 20  # spans at least this big are memory-mapped, not copied in
READ_CHUNK = 1 << 20  # read_into reads whole blocks in preads of about this much, then checks them


class RangeReader:
    """Reads verified byte ranges of any number of files; one cache of edge blocks for all."""

    def __init__(self, stats: ReadStats | None = None, cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.stats = stats
        self._ahead = ReadAhead()
        self._cache: OrderedDict[tuple[str, int], bytes | memoryview] = OrderedDict()
        self._cache_bytes = cache_bytes
        self._cached = 0
        self._shared: SharedBlocks | None = None  # see check_with_others

    def check_with_others(self, together: SharedRecordChecks, needed: Callable[[Path], ByteRuns | None]) -> None:
        """From now on, a block :meth:`read_into` needs only part of is checked together with
        the other ranks of a load (:mod:`.shared_checks`): this reader reads just that part
        (and the bytes of the block it owns that no rank needs) and adds their CRCs to
        ``together.terms``, where the load's agreement combines them. ``needed(path)``: the
        bytes of the file that some rank of the load reads, the same on every rank; None
        for a file whose edge blocks are still read and checked whole (and marked so).
        Blocks :meth:`read` checks are marked checked whole."""
        self._shared = SharedBlocks(together, needed, self.stats)

    def read(self, path: Path, record: FileRecord, begin: int, end: int) -> memoryview:
        """Bytes [begin, end) of ``path``, every block under them checked against ``record``.

        The view is the caller's to keep: of a new buffer; or read-only, of a cached block
        when the range lies within one, or, for a range of at least MAP_BYTES, of a private
        mapping of the file, so that small and big reads cost no copy (the mapping goes when
        the last view of it does)."""
        if not 0 <= begin <= end <= record.size:
            raise ValueError(f"{path}: byte range [{begin}, {end}) is outside its {record.size} bytes")
        blocks = record.blocks_covering(begin, end)
        if not blocks:
            return memoryview(b"")
        first, last = blocks[0], blocks[-1]
        span_start, span_end = record.block_range(first)[0], record.block_range(last)[1]
        key = str(path)
        cached = self._cache.get((key, first)) if first == last else None
        if cached is not None:  # within one block read before: a view of it, no copy
            self._cache.move_to_end((key, first))
            return memoryview(cached)[begin - span_start : end - span_start]
        if span_end - span_start >= MAP_BYTES:
            view = self._map(path, record, first, last, span_start, span_end)
        else:
            view = self._copy(path, record, first, last, span_start, span_end)
        self._mark_whole(path, first)
        self._mark_whole(path, last)
        if begin > span_start or (first == last and end < span_end):
            self._keep(key, first, record, view, span_start)
        if last != first and end < span_end:
            self._keep(key, last, record, view, span_start)
        return view[begin - span_start : end - span_start]

    def read_unchecked(self, path: Path, record: FileRecord, begin: int, end: int) -> memoryview:
        """Bytes [begin, end) of ``path``, read alone and not checked against ``record``: for
        a few bytes that every rank of a load reads (optimizer scalars) while the ranks check
        their block together, and that the caller attests (compares with their saved
        digest). A new buffer, the caller's to keep. ValueError for a range outside the
        file's recorded size; CheckpointDamagedError naming ``path`` if the file ends first."""
        if not 0 <= begin <= end <= record.size:
            raise ValueError(f"{path}: byte range [{begin}, {end}) is outside its {record.size} bytes")
        data = memoryview(np.empty(end - begin, dtype=np.uint8))
        fd = open_member(path, read_ahead=False)
        try:
            pread_into(fd, data, begin, path)
        finally:
            os.close(fd)
        count_read(self.stats, path.name, len(data))
        return data

    def read_into(self, path: Path, record: FileRecord, begin: int, out: memoryview, observe: Any = None) -> None:
        """Fill ``out`` (writable bytes) with bytes [begin, begin + len(out)) of ``path``, every
        block under them checked against ``record`` before this returns.

        Blocks wholly inside the range are read into ``out`` itself and checked there as
        they arrive; then a block the range holds only part of comes from the edge cache, or
        is read whole into a buffer of its own, checked and kept there for the neighbouring
        range, and its part copied (checked with other ranks, just its part is read). On a
        mismatch or a short file, ValueError naming ``path``; ``out`` is then partly written
        and the caller must drop it. ``observe`` (offsets from ``out``'s start) gets the CRC
        of every segment of ``out``."""
        end = begin + len(out)
        if not 0 <= begin <= end <= record.size:
            raise ValueError(f"{path}: byte range [{begin}, {end}) is outside its {record.size} bytes")
        blocks = record.blocks_covering(begin, end)
        if not blocks:
            return
        edges = [index for index in dict.fromkeys((blocks[0], blocks[-1])) if not _inside(record, index, begin, end)]
        first, last = _inner_blocks(record, begin, end)
        if first <= last:
            start = record.block_range(first)[0]
            self._read_checked(path, record, first, last, out[start - begin :], observe, start - begin)
        for index in edges:  # after the interior: the kernel has read them ahead meanwhile (announce)
            self._edge(path, record, index, begin, out, observe)

    def announce(self, path: Path, record: FileRecord, begin: int, end: int, into: memoryview | None = None) -> None:
        """Say that :meth:`read_into` of bytes [begin, end) of ``path`` comes next (into
        ``into`` when given, the writable bytes its ``out`` will be), after those announced
        before. Its blocks are read ahead past the page cache where that is worth it
        (:mod:`.direct_reads`; straight into ``into`` where its alignment allows), else the kernel is asked to start reading them
        into the page cache (``posix_fadvise(WILLNEED)``); so are the blocks at the range's
        ends that it holds only part of, which the read reads on its own, whole or in part,
        after the blocks inside it: asked for now, they are in the page cache by then. A
        hint: nothing is checked or counted before the read."""
        first, last = _inner_blocks(record, begin, end)
        if first <= last:
            span_begin, span_end = record.block_range(first)[0], record.block_range(last)[1]
            if self._worth_direct(path, record, span_begin, span_end):
                spans = self._spans(record, first, last)
                self._ahead.announce(path, spans, destinations(into, begin, spans))
                for lo, hi in ((begin, span_begin), (span_end, end)):
                    if hi > lo:
                        edge_begin, edge_end = record.block_range(record.blocks_covering(lo, hi)[0])
                        advise(path, edge_begin, edge_end - edge_begin)
                return
        advise(path, begin, end - begin)

    def _edge(self, path: Path, record: FileRecord, index: int, begin: int, out: memoryview, observe: Any) -> None:
        """The part of block ``index`` that ``out`` (bytes from ``begin``) holds: read alone
        and checked with the other ranks of the load, or from the whole block (the cache's,
        or read and checked here)."""
        shared = self._shared is not None and (str(path), index) not in self._cache and self._shared.covers(path)
        if not shared:
            self._copy_edge(path, record, index, begin, out, observe)
            return
        self._shared.read_part(path, record, index, begin, out, observe)

    def _mark_whole(self, path: Path, index: int) -> None:
        if self._shared is not None:
            self._shared.mark_whole(path, index)

    def _copy_edge(self, path: Path, record: FileRecord, index: int, begin: int, out: memoryview, observe: Any = None) -> None:
        """Copy the part of block ``index`` that ``out`` (bytes from ``begin``) holds. A block
        read now hands ``observe`` its part's CRCs from the block's check; one from the
        cache (checked by the neighbouring range) has its part CRC'd again."""
        block_start, block_end = record.block_range(index)
        lo, hi = max(begin, block_start), min(begin + len(out), block_end)
        part = None if observe is None else PartObserver(observe, lo - block_start, hi - block_start, block_start - begin)
        block, observed = self._edge_block(path, record, index, part)
        out[lo - begin : hi - begin] = block[lo - block_start : hi - block_start]
        if observe is not None and not observed:
            observe_bytes(out, lo - begin, hi - begin, observe)

    def _read_checked(
        self,
        path: Path,
        record: FileRecord,
        first: int,
        last: int,
        out: memoryview,
        observe: Any = None,
        at: int = 0,
        *,
        alone: bool = False,
    ) -> None:
        """Read blocks first..last into ``out`` (which starts at block ``first``, and at
        ``observe``'s offset ``at``), checking each chunk of them as it lands. ``alone``: the
        blocks are read on their own, so the kernel reads nothing past them into the page
        cache (its read-ahead would read again what the range beside them reads direct)."""
        origin = record.block_range(first)[0]
        fd = open_member(path, read_ahead=not alone)
        try:
            with closing(self._arrivals(path, fd, record, first, last, out)) as arrivals:
                for chunk_first, chunk_last, begin, target in arrivals:
                    if observe is None or not FUSED:
                        check_blocks(path, record, chunk_first, chunk_last, begin, target)
                        if observe is not None:
                            observe_bytes(target, 0, len(target), observe, at + begin - origin)
                    else:
                        _check_observed(path, record, chunk_first, chunk_last, begin, target, observe, at + begin - origin)
                    count_read(self.stats, path.name, len(target))
        finally:
            os.close(fd)

    def _arrivals(
        self, path: Path, fd: int, record: FileRecord, first: int, last: int, out: memoryview
    ) -> Iterator[tuple[int, int, int, memoryview]]:
        """Per chunk of blocks first..last, once its bytes are in ``out``: its first and last
        block, its file offset and its part of ``out``. A big range the page cache lacks is
        read direct, a few chunks ahead on a thread (:mod:`.direct_reads`); the rest with a
        pread per chunk. The new pages of ``out`` are mapped on a thread ahead of the reads
        for a big range (:class:`~.host_memory.MappingAhead`), else each chunk's just before
        it lands."""
        origin = record.block_range(first)[0]
        arrived = self._direct_arrivals(path, fd, record, first, last, out)
        with mapping_ahead(out[: record.block_range(last)[1] - origin]) as populate_here:
            if arrived is None:
                for chunk_first, chunk_last, begin, end in _chunks(record, first, last, READ_CHUNK):
                    target = out[begin - origin : end - origin]
                    populate_here(target)
                    pread_into(fd, target, begin, path)
                    yield chunk_first, chunk_last, begin, target
                return
            chunks = _chunks(record, first, last, self._ahead.slot_bytes)
            # The slots first: the read-ahead learns that the last one is done when asked for more.
            for data, (chunk_first, chunk_last, begin, end) in zip(arrived, chunks, strict=True):
                if len(data) < end - begin:
                    size = os.fstat(fd).st_size
                    raise CheckpointDamagedError(f"{path}: truncated: expected {end} bytes, the file ends at {size}")
                target = out[begin - origin : end - origin]
                if not same_memory(data, target):  # read into a slot, not in place
                    populate_here(target)
                    target[:] = data
                yield chunk_first, chunk_last, begin, target

    def _direct_arrivals(
        self, path: Path, fd: int, record: FileRecord, first: int, last: int, out: memoryview
    ) -> Iterator[memoryview] | None:
        """Where blocks first..last arrive when read past the page cache (into ``out``, which
        starts at block ``first``, where it is aligned as the file, else into slots): read
        ahead already when announced, else read now when worth it; None to read them through
        the page cache."""
        span_begin, span_end = record.block_range(first)[0], record.block_range(last)[1]
        if not self._direct_sized(record, span_begin, span_end):
            return None  # never announced; and no reason to drop what is
        spans = self._spans(record, first, last)
        into = destinations(out, span_begin, spans)
        arrived = self._ahead.take(path, spans, into)
        if arrived is None and self._worth_direct(path, record, span_begin, span_end, fd):
            self._ahead.close()  # read now: anything announced would be read ahead of it
            self._ahead.announce(path, spans, into)
            arrived = self._ahead.take(path, spans, into)
        return arrived

    def _direct_sized(self, record: FileRecord, begin: int, end: int) -> bool:
        """Whether a run of whole blocks [begin, end) has a direct read's shape: its blocks
        start aligned and fit a slot whole, and it is big enough to be worth a thread."""
        block_size = record.block_size
        return block_size % ALIGN == 0 and block_size <= self._ahead.slot_bytes and end - begin >= direct_reads.DIRECT_MIN_BYTES

    def _worth_direct(self, path: Path, record: FileRecord, begin: int, end: int, fd: int | None = None) -> bool:
        """Whether blocks [begin, end) of ``path`` should be read past the page cache: of a
        direct read's shape, mostly not cached, on a file system that allows it."""
        if not self._direct_sized(record, begin, end):
            return False
        own = fd is None
        fd = open_member(path) if own else fd
        try:
            if not worth_reading_direct(fd, begin, end):
                return False
        finally:
            if own:
                os.close(fd)
        direct = open_direct(path)
        if direct is None:
            return False
        os.close(direct)
        return True

    def _spans(self, record: FileRecord, first: int, last: int) -> list[tuple[int, int]]:
        return [(begin, end) for _, _, begin, end in _chunks(record, first, last, self._ahead.slot_bytes)]

    def _edge_block(self, path: Path, record: FileRecord, index: int, observe: Any = None) -> tuple[memoryview, bool]:
        """Block ``index`` of ``path``, checked: from the cache, or read and kept there; and
        whether ``observe`` (offsets in the block) got the CRCs of the read's check, which
        it does where the block is read now and CRCs can be combined."""
        key = (str(path), index)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return memoryview(cached), False
        begin, end = record.block_range(index)
        block = memoryview(np.empty(end - begin, dtype=np.uint8))
        observe = observe if FUSED else None
        self._read_checked(path, record, index, index, block, observe, alone=True)
        self._mark_whole(path, index)
        block = block.toreadonly()
        self._store(key, block)
        return block, observe is not None

    def _copy(self, path: Path, record: FileRecord, first: int, last: int, span_start: int, span_end: int) -> memoryview:
        """Blocks first..last of ``path`` read into a new buffer and checked, the edge
        blocks taken from the cache where they are."""
        # np.empty, not bytearray: no zero-filling of memory the read overwrites anyway.
        view = memoryview(np.empty(span_end - span_start, dtype=np.uint8))
        key = str(path)
        head = self._take(key, first, record, view, span_start)
        tail = last != first and self._take(key, last, record, view, span_start)
        read_first = first + 1 if head else first
        read_last = last - 1 if tail else last
        if read_first <= read_last:
            self._read_blocks(path, record, read_first, read_last, view, span_start)
        return view

    def _read_blocks(
        self, path: Path, record: FileRecord, first: int, last: int, view: memoryview, span_start: int
    ) -> None:
        begin, end = record.block_range(first)[0], record.block_range(last)[1]
        target = view[begin - span_start : end - span_start]
        fd = open_member(path)
        try:
            pread_into(fd, target, begin, path)
        finally:
            os.close(fd)
        count_read(self.stats, path.name, end - begin)
        check_blocks(path, record, first, last, begin, target)

    def _map(self, path: Path, record: FileRecord, first: int, last: int, span_start: int, span_end: int) -> memoryview:
        """Blocks first..last of ``path``, mapped and checked (those in the edge cache were
        checked when they were read)."""
        with open(open_member(path), "rb", buffering=0) as file:
            view = map_range(file.fileno(), span_start, span_end)
            if view is None:
                size = os.fstat(file.fileno()).st_size
                raise CheckpointDamagedError(f"{path}: truncated: expected {span_end} bytes, the file ends at {size}")
        key = str(path)
        for index in range(first, last + 1):
            if (key, index) in self._cache:
                continue
            begin, end = record.block_range(index)
            check_blocks(path, record, index, index, span_start, view[: end - span_start])
            count_read(self.stats, path.name, end - begin)
        return view

    def _take(self, key: str, index: int, record: FileRecord, view: memoryview, span_start: int) -> bool:
        data = self._cache.get((key, index))
        if data is None:
            return False
        self._cache.move_to_end((key, index))
        begin, end = record.block_range(index)
        view[begin - span_start : end - span_start] = data
        return True

    def _keep(self, key: str, index: int, record: FileRecord, view: memoryview, span_start: int) -> None:
        if (key, index) in self._cache:
            return
        begin, end = record.block_range(index)
        self._store((key, index), bytes(view[begin - span_start : end - span_start]))

    def _store(self, key: tuple[str, int], data: bytes | memoryview) -> None:
        self._cache[key] = data
        self._cached += len(data)
        while self._cached > self._cache_bytes and len(self._cache) > 1:
            _, dropped = self._cache.popitem(last=False)
            self._cached -= len(dropped)

    def clear(self) -> None:
        """Drop every cached edge block, and what is announced (the read-ahead thread ends)."""
        self._cache.clear()
        self._cached = 0
        self._ahead.close()


def _check_observed(
    path: Path, record: FileRecord, first: int, last: int, run_start: int, data: memoryview, observe: Any, at: int
) -> None:
    """check_blocks, with each block cut where ``observe`` asks: one CRC per segment, joined
    for the block's check and handed to ``observe`` (offsets from ``at``)."""
    for index in range(first, last + 1):
        begin, end = (offset - run_start for offset in record.block_range(index))
        block_crc = None
        position = begin
        for cut in [*observe.cuts(begin + at, end + at), end + at]:
            stop = cut - at
            crc = crc32(data[position:stop])
            block_crc = crc if block_crc is None else combine(block_crc, crc, stop - position)
            observe.segment(position + at, stop - position, crc)
            position = stop
        if (block_crc if block_crc is not None else crc32(b"")) != record.crc32[index]:
            start = begin + run_start
            raise CheckpointDamagedError(
                f"{path}: checksum mismatch in block {index} (bytes {start}-{end + run_start}): the file is corrupted"
            )


def _chunks(record: FileRecord, first: int, last: int, chunk_bytes: int) -> list[tuple[int, int, int, int]]:
    """Blocks first..last in runs of about ``chunk_bytes`` (at least a block): each run's
    first and last block and its file offsets."""
    per_chunk = max(1, chunk_bytes // record.block_size)
    runs = []
    for chunk_first in range(first, last + 1, per_chunk):
        chunk_last = min(chunk_first + per_chunk - 1, last)
        runs.append((chunk_first, chunk_last, record.block_range(chunk_first)[0], record.block_range(chunk_last)[1]))
    return runs


def _inner_blocks(record: FileRecord, begin: int, end: int) -> tuple[int, int]:
    """The first and last of the blocks wholly inside bytes [begin, end) (first > last: none)."""
    blocks = record.blocks_covering(begin, end)
    if not blocks:
        return 0, -1
    first, last = blocks[0], blocks[-1]
    if not _inside(record, first, begin, end):
        first += 1
    if first <= last and not _inside(record, last, begin, end):
        last -= 1
    return first, last


def _inside(record: FileRecord, index: int, begin: int, end: int) -> bool:
    block_start, block_end = record.block_range(index)
    return begin <= block_start and block_end <= end


def bytes_of(array: np.ndarray) -> memoryview:
    """The writable bytes of a contiguous array (of any dtype, bfloat16 included), for
    :meth:`RangeReader.read_into`."""
    return memoryview(array.reshape(-1).view(np.uint8))


def array_view(data: memoryview, dtype: str) -> np.ndarray:
    """A 1-D array of dtype ``dtype`` over ``data`` (shared when aligned for it, else a copy)."""
    array = from_bytes(data, dtype)
    return array if array.flags.aligned else array.copy()
