"""Ranges of stored tensors served from their whole zip records, each record read once.

A record's CRC-32 is its only checksum and covers all of it, so a reader that checks a range
which is not the whole record reads the whole record for the check; a load that wants
several ranges of one record (a resharded load, or one whose layout cuts a partition at
other places) would read it again for each range. :class:`RecordCache` reads such a record
once, checked as it arrives (:meth:`~.torch_records.StoredTensor.record`), and keeps it
while its owner reads other ranges of it, up to a byte limit. Nothing is dropped: a record
that does not fit beside those kept is left to the straight read, so no access pattern makes
the cache read a record twice (dropping the least recently used would, for a reader that
alternates between records bigger together than the limit). Each record kept is at most its
own file's size.
"""

from __future__ import annotations

import numpy as np

from ..io.dtypes import from_bytes, itemsize_of
from .torch_records import StoredTensor

RECORD_CACHE_BYTES = 256 << 20  # of records a load reads several ranges of, kept while it does


class RecordCache:
    """Whole records of stored tensors, read once and kept (at most ``limit`` bytes of them)."""

    def __init__(self, limit: int = RECORD_CACHE_BYTES) -> None:
        self.limit = limit
        self._records: dict[tuple[str, str], np.ndarray] = {}
        self._bytes = 0

    def elements(self, saved: StoredTensor, start: int, stop: int) -> np.ndarray | None:
        """Elements [start, stop) of ``saved`` from its whole record, read and checked once
        however many ranges of it are asked for. None where the range is better read straight
        where it goes: the whole record, a record that does not fit beside those kept, a
        tensor that is not contiguous, an empty range or one past the tensor's end (the
        straight read says what is wrong)."""
        record_size = saved.storage.record_size
        whole = start == 0 and stop == saved.numel() and saved.numel() * itemsize_of(saved.dtype) == record_size
        if whole or not saved.is_contiguous() or not 0 <= start < stop <= saved.numel():
            return None
        record = self._record(saved)
        if record is None:
            return None
        return record_elements(record, saved, start, stop)

    def _record(self, saved: StoredTensor) -> np.ndarray | None:
        key = (str(saved.storage.path), saved.storage.record_name)
        record = self._records.get(key)
        if record is None and self._bytes + saved.storage.record_size <= self.limit:
            record = self._records[key] = saved.record()
            self._bytes += record.size
        return record

    def clear(self) -> None:
        """Drop every record kept."""
        self._records.clear()
        self._bytes = 0


def record_elements(record: np.ndarray, saved: StoredTensor, start: int, stop: int) -> np.ndarray:
    """Elements [start, stop) of the contiguous tensor ``saved`` out of ``record``, the bytes
    of its whole zip record (:meth:`~.torch_records.StoredTensor.record`): a view, no copy."""
    itemsize = itemsize_of(saved.dtype)
    begin = (saved.storage_offset + start) * itemsize
    return from_bytes(record[begin : begin + (stop - start) * itemsize], saved.dtype)
