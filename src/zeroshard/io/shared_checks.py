"""Checksummed records that the ranks of a load check together, each byte read once over the job.

A record here is a run of bytes with one CRC-32: a zip record of a torch.save file (a
DeepSpeed rank file's partition; its CRC-32 is its only checksum) or a checksum block of
one of our safetensors files. A rank that reads part of a record (its partition cut where
the new layout's ranks begin, a parameter of a universal shard split between two ranks)
would have to read all of it to check it, so the job would read such records up to once per
rank that needs a part. Instead each rank takes the raw CRC of the bytes it reads anyway, as
they arrive, and the load's agreement combines every rank's (:mod:`.digest`: a piece's term
is its raw CRC shifted past the bytes after it, and the XOR of the terms of pieces tiling a
record, finished, is the record's CRC-32).

The bytes of a record that no rank needs (alignment padding, parameters the run does not
load, a neighbouring tensor) are read by one rank each, by a rule each rank applies alone,
knowing only which bytes are needed (the same on every rank) and what it reads itself:

* the gap after a needed run goes to the rank that reads the run's last byte;
* the bytes before the record's first needed byte go to the rank that reads that byte.

Every needed byte is read by exactly one rank of the load, so each gap has one owner and
the pieces tile every record the load touches. A rank that checks a record whole by itself
(a reader that needs all of it, or one outside this scheme) says so, and the others' pieces
of it are not combined. :func:`record_problems` judges the gathered terms: a record whose
pieces do not cover it exactly, or whose CRC-32 differs, is named.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Callable, Iterable

from .digest import finish, piece_term

RecordKey = tuple[str, str]  # (file path, what the record is: "record <name>", "checksum block <i>")
ByteRuns = list[tuple[int, int]]  # sorted, disjoint [begin, end) byte ranges of a record
NeededElements = Callable[[int, int], list[tuple[int, int]]]  # (old rank, old group) -> [start, end) element runs


@dataclass
class RecordTerms:
    """One rank's pieces of checked records (a zip record, a checksum block): per record, the
    XOR of the pieces' terms, the bytes they cover, and the record's size and CRC-32 as the
    file's index says; and the records the rank checked whole by itself (the others' pieces
    of those need no combining). Plain data, so the ranks can exchange it; :meth:`merge`
    combines two ranks'."""

    values: dict[RecordKey, tuple[int, int, int, int]] = field(default_factory=dict)
    whole: set[RecordKey] = field(default_factory=set)

    def add(self, key: RecordKey, size: int, crc: int, begin: int, end: int, raw: int) -> None:
        """Bytes ``[begin, end)`` of the record of ``size`` bytes and CRC-32 ``crc`` had raw
        CRC ``raw`` (:func:`~zeroshard.io.digest.raw_crc`)."""
        xor, covered, _, _ = self.values.get(key, (0, 0, size, crc))
        self.values[key] = (xor ^ piece_term(raw, size - end), covered + end - begin, size, crc)

    def merge(self, other: RecordTerms) -> RecordTerms:
        """Add every record piece of ``other`` into this one (the indexes' sizes and CRCs
        must agree); returns this one."""
        self.whole |= other.whole
        for key, (term, covered, size, crc) in other.values.items():
            mine = self.values.get(key)
            if mine is None:
                self.values[key] = (term, covered, size, crc)
            elif mine[2:] != (size, crc):
                raise ValueError(f"{key[0]}: the ranks read different sizes or CRC-32s for {key[1]}")
            else:
                self.values[key] = (mine[0] ^ term, mine[1] + covered, size, crc)
        return self


def record_problems(every_rank: Iterable[RecordTerms]) -> list[str]:
    """What is wrong with the records the ranks read together: one line per record that no
    rank checked whole and whose pieces do not cover it exactly once, or whose CRC-32 is not
    the one its file's index records."""
    combined = RecordTerms()
    try:
        for terms in every_rank:
            combined.merge(terms)
    except ValueError as err:
        return [str(err)]
    problems = []
    for (path, record), (term, covered, size, crc) in sorted(combined.values.items()):
        if (path, record) in combined.whole:
            continue
        if covered != size:
            problems.append(f"{path}: the ranks read {covered:,} bytes of the {size:,} of {record}")
            continue
        found = finish(term, size)
        if found != crc:
            problems.append(f"{path}: {record} is corrupt: its CRC-32 is {found:08x}, not the recorded {crc:08x}")
    return problems


class SharedRecordChecks:
    """The records one rank of a load checks with the others: where the gaps it must read
    lie (the rule in the module docstring), and the terms of what it read."""

    def __init__(self, terms: RecordTerms) -> None:
        self._runs: dict[RecordKey, tuple[ByteRuns, list[int]]] = {}
        self.terms = terms

    def gaps(self, key: RecordKey, size: int, begin: int, end: int, needed: Callable[[], ByteRuns]) -> ByteRuns:
        """The bytes no rank needs that this rank, reading ``[begin, end)`` of record ``key``
        (``size`` bytes), reads too: the record's head before ``begin`` when ``begin`` is its
        first needed byte, and the gap after ``end`` when ``end`` ends a needed run.
        ``needed()`` gives the bytes of the record that the load needs, the same on every
        rank (asked once per record)."""
        runs, starts = self._runs_of(key, needed)
        found: ByteRuns = []
        if runs and begin == runs[0][0] and begin > 0:
            found.append((0, begin))
        after = bisect.bisect_right(starts, end)  # runs starting after end
        inside = after > 0 and runs[after - 1][0] <= end < runs[after - 1][1]
        if end < size and not inside:
            found.append((end, runs[after][0] if after < len(runs) else size))
        return found

    def _runs_of(self, key: RecordKey, needed: Callable[[], ByteRuns]) -> tuple[ByteRuns, list[int]]:
        found = self._runs.get(key)
        if found is None:
            runs = merged(needed())
            found = self._runs[key] = (runs, [begin for begin, _ in runs])
        return found


def merged(runs: ByteRuns) -> ByteRuns:
    """``runs`` sorted, empty ones dropped, touching or overlapping ones joined."""
    joined: ByteRuns = []
    for begin, end in sorted(run for run in runs if run[1] > run[0]):
        if joined and begin <= joined[-1][1]:
            joined[-1] = (joined[-1][0], max(end, joined[-1][1]))
        else:
            joined.append((begin, end))
    return joined
