"""Observers of CRC segments: how a reader hands the CRCs its checks compute to a digester.

An *observer* (a digester: :class:`~..checkpoint.attest.digests.PartitionDigester`) says
where a stream of bytes must be cut (``cuts``) and takes the CRC of each segment
(``segment``). :func:`observe_bytes` CRCs a view cut where an observer asks;
:class:`PartObserver` narrows an observer of a range to the part of a block the range holds,
so that the block's own check hands the part its CRCs.
"""

from __future__ import annotations

from typing import Any

from .digest import crc32, shift, zeros_crc


def observe_bytes(view: memoryview, lo: int, hi: int, observe: Any, at: int = 0) -> int:
    """Hand ``observe`` the CRC of each segment of ``view[lo:hi]`` (its offsets: ``at`` + the
    offset in ``view``), cut where it asks. Returns the raw CRC of ``view[lo:hi]``
    (:func:`.digest.raw_crc`), from the segments' CRCs."""
    position, raw = lo, 0
    for cut in [*observe.cuts(lo + at, hi + at), hi + at]:
        stop = min(cut - at, hi)
        if stop > position:
            crc = crc32(view[position:stop])
            observe.segment(position + at, stop - position, crc)
            raw = shift(raw, stop - position) ^ crc ^ zeros_crc(stop - position)
            position = stop
    return raw


class PartObserver:
    """An observer of a whole block that passes on to ``observe`` only the segments of its
    part [lo, hi) (block offsets), at offset + ``shift`` in ``observe``'s coordinates: the
    block's check is cut at the part's ends and wherever ``observe`` asks within it."""

    def __init__(self, observe: Any, lo: int, hi: int, shift: int) -> None:
        self._observe, self._lo, self._hi, self._shift = observe, lo, hi, shift

    def cuts(self, begin: int, end: int) -> list[int]:
        """The part's ends, and ``observe``'s cuts within the part, inside (begin, end)."""
        ends = [bound for bound in (self._lo, self._hi) if begin < bound < end]
        lo, hi = max(begin, self._lo), min(end, self._hi)
        inner = [cut - self._shift for cut in self._observe.cuts(lo + self._shift, hi + self._shift)] if lo < hi else []
        return sorted({*ends, *inner})

    def segment(self, offset: int, length: int, crc: int) -> None:
        """A segment's CRC, passed on where it lies within the part (dropped elsewhere)."""
        if self._lo <= offset and offset + length <= self._hi:
            self._observe.segment(offset + self._shift, length, crc)
