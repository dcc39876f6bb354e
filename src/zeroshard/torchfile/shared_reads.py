"""Ranges of zip records read for a load whose ranks check the records together.

A range of a stored tensor lands straight in the caller's array and its raw CRC is taken as
it lands; so are the bytes of the record that no rank needs and this rank owns
(:mod:`..io.shared_checks` says which); their terms go to the load's
:class:`~..io.shared_checks.RecordTerms`, combined with every rank's in the load's agreement.
Nothing here checks a record alone.

A big range the page cache lacks is read past it (:mod:`..io.direct_reads`): a zip record
starts anywhere, so the spans read begin at the page before the range. Those inside the
range land straight in the array where it has the file's alignment within a page (a loader
allocates its partitions so); the others, the first and last at least, in the read-ahead's
slots, whose part of the range is copied into the array. A load announces its ranges, with
the arrays they go to, before reading them (:func:`announce`), so the disk reads the next
range while the loader checks this one.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..io.budget import named
from ..io.observe import observe_bytes
from ..io.digest import raw_crc, shift
from ..io.dtypes import itemsize_of
from ..io import direct_reads
from ..io.direct_reads import ALIGN, ReadAhead, destinations, same_memory, worth_reading_direct
from ..io.host_memory import mapping_ahead
from ..io.read_stats import count_read
from ..io.shared_checks import ByteRuns, RecordKey, SharedRecordChecks
from .torch_records import HOT_CHUNK, NONBLOCK, StorageRecord, StoredTensor, TorchFileError, ends_early, pread_full, span_crc

_ALL_ONES = 0xFFFFFFFF  # zlib.crc32 from this start, inverted at the end, is the raw CRC (io.digest)


def read_shared(
    saved: StoredTensor,
    start: int,
    out: np.ndarray,
    together: SharedRecordChecks,
    needed: Callable[[], ByteRuns],
    ahead: ReadAhead | None = None,
    observe: Any = None,
) -> None:
    """Elements ``[start, start + out.size)`` of the contiguous tensor ``saved`` straight
    into ``out`` (a contiguous 1-D array of its dtype), and the gaps of its record this rank
    owns; the raw CRC of each goes to ``together.terms``. ``needed()``: the bytes of the
    record that the load needs (asked once per record). ``ahead``: reads past the page cache
    where the range is big and not cached (announced before, or read now). ``observe`` (a
    digester, offsets in ``out``'s bytes) gets the CRC of every segment of ``out``, from the
    same pass."""
    saved.check_into(start, out)
    storage = saved.storage
    buffer = memoryview(out.view(np.uint8))
    begin = (saved.storage_offset + start) * out.itemsize
    end = begin + len(buffer)
    key = record_key(storage)
    try:
        fd = os.open(storage.path, os.O_RDONLY | NONBLOCK)
        try:
            raw, position = 0, 0  # the raw CRC of no bytes
            for chunk in _arrivals(storage, fd, begin, buffer, ahead):
                if observe is None:
                    raw = raw_crc(chunk, raw)
                else:
                    raw = shift(raw, len(chunk)) ^ observe_bytes(chunk, 0, len(chunk), observe, position)
                position += len(chunk)
            together.terms.add(key, storage.record_size, storage.crc32, begin, end, raw)
            for gap_begin, gap_end in together.gaps(key, storage.record_size, begin, end, needed):
                gap = span_crc(storage, fd, gap_begin, gap_end, _ALL_ONES) ^ _ALL_ONES
                together.terms.add(key, storage.record_size, storage.crc32, gap_begin, gap_end, gap)
        finally:
            os.close(fd)
    except OSError as err:
        raise TorchFileError(f"{storage.path}: cannot be read: {err.strerror or err}") from None


def record_key(storage: StorageRecord) -> RecordKey:
    """How the load's terms name ``storage``'s zip record (:mod:`..io.shared_checks`)."""
    return (str(storage.path), f"record {named(storage.record_name)}")


def announce(saved: StoredTensor, start: int, end: int, ahead: ReadAhead, into: np.ndarray | None = None) -> None:
    """Say that :func:`read_shared` of elements ``[start, end)`` of ``saved`` comes next (into
    ``into`` when given, its ``out``), after those announced before: a big range the page
    cache lacks starts being read past it, straight into ``into`` where aligned as the file.
    A hint: nothing is checked or counted until the read."""
    itemsize = itemsize_of(saved.dtype)
    begin = saved.storage.data_offset + (saved.storage_offset + start) * itemsize
    spans = _direct_spans(begin, begin + (end - start) * itemsize, ahead.slot_bytes)
    if spans is None:
        return
    fd = os.open(saved.storage.path, os.O_RDONLY | NONBLOCK)
    try:
        if worth_reading_direct(fd, spans[0][0], spans[-1][1]):
            ahead.announce(saved.storage.path, spans, destinations(None if into is None else memoryview(into.view(np.uint8)), begin, spans))
    finally:
        os.close(fd)


def _arrivals(storage: StorageRecord, fd: int, begin: int, buffer: memoryview, ahead: ReadAhead | None) -> Iterator[memoryview]:
    """The parts of ``buffer`` (the record's bytes from ``begin``), in order, each once its
    bytes have landed: from slots read past the page cache, or with a pread per chunk; the
    buffer's new pages mapped ahead of them (:func:`~..io.host_memory.mapping_ahead`)."""
    first = storage.data_offset + begin
    spans = _direct_spans(first, first + len(buffer), ahead.slot_bytes) if ahead is not None else None
    arrived = None
    if spans is not None:
        into = destinations(buffer, first, spans)
        arrived = ahead.take(storage.path, spans, into)
        if arrived is None and worth_reading_direct(fd, spans[0][0], spans[-1][1]):
            ahead.close()  # read now: anything announced would be read ahead of it
            ahead.announce(storage.path, spans, into)
            arrived = ahead.take(storage.path, spans, into)
    with mapping_ahead(buffer) as populate_here:
        if arrived is None:
            count_read(None, storage.path.name, len(buffer))
            for done in range(0, len(buffer), HOT_CHUNK):
                chunk = buffer[done : done + HOT_CHUNK]
                populate_here(chunk)
                if pread_full(fd, chunk, first + done) < len(chunk):
                    raise ends_early(storage)
                yield chunk
            return
        for data, (span_begin, span_end) in zip(arrived, spans, strict=True):
            lo, hi = max(span_begin, first), min(span_end, first + len(buffer))
            if len(data) < hi - span_begin:
                raise ends_early(storage)
            count_read(None, storage.path.name, span_end - span_begin)
            target = buffer[lo - first : hi - first]
            if not same_memory(data, target):  # read into a slot, not in place
                populate_here(target)
                target[:] = data[lo - span_begin : hi - span_begin]
            yield target


def _direct_spans(begin: int, end: int, slot_bytes: int) -> list[tuple[int, int]] | None:
    """The slot-sized spans, from the page holding ``begin``, that cover file bytes
    [begin, end): None where the range is too small to read past the page cache."""
    if end - begin < direct_reads.DIRECT_MIN_BYTES:
        return None
    first = begin - begin % ALIGN
    return [(position, min(position + slot_bytes, end)) for position in range(first, end, slot_bytes)]
