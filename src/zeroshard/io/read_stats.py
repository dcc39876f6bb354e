"""What a load reads: bytes per file on this rank, and, after a collective load, per rank.

Bytes are of two kinds: a file's tensors (with the checksum blocks around the ranges read),
and what opening a file costs besides them (a safetensors header, a torch.save file's
directory and pickle, a small file read whole to parse it): ``opening`` counts those apart,
so that what a load reads of the state it needs (``data``) can be compared with that state.

A reader given a :class:`ReadStats` counts into it what it reads (:func:`count_read`). A
load counts everything its readers read, whatever the format, by making its stats the
thread's meter for the duration (:meth:`ReadStats.counting`): every read goes through
:func:`count_read`, which adds to the reader's own stats and to the meter (once where they
are the same). A collective load then fills :attr:`ReadStats.ranks` with what every rank
read, from the load's own agreement (no collective of its own).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field

_meter: contextvars.ContextVar[ReadStats | None] = contextvars.ContextVar("zeroshard_read_meter", default=None)


@dataclass
class ReadStats:
    """Bytes read from each checkpoint file (header, data and checksum-block overhead) by
    this rank; ``ranks``: what each rank of a collective load read (empty before one)."""

    bytes_by_file: dict[str, int] = field(default_factory=dict)
    opening: int = 0  # of the total: headers, directories, pickles (what opening the files cost)
    ranks: tuple[int, ...] = ()  # total by rank, this one's included: set by a collective load
    ranks_opening: tuple[int, ...] = ()  # opening by rank, likewise

    def add(self, file_name: str, count: int, *, opening: bool = False) -> None:
        """Count ``count`` more bytes read from ``file_name`` (``opening``: to open it, not
        of its tensors)."""
        self.bytes_by_file[file_name] = self.bytes_by_file.get(file_name, 0) + count
        if opening:
            self.opening += count

    @property
    def total(self) -> int:
        """Bytes this rank read, from all files together."""
        return sum(self.bytes_by_file.values())

    @property
    def data(self) -> int:
        """Bytes this rank read of the files' tensors (the total less opening them)."""
        return self.total - self.opening

    @property
    def job_total(self) -> int:
        """Bytes every rank of the last collective load read together (this rank's alone
        before one)."""
        return sum(self.ranks) if self.ranks else self.total

    @property
    def job_data(self) -> int:
        """Of :attr:`job_total`, the bytes of the files' tensors."""
        return self.job_total - (sum(self.ranks_opening) if self.ranks else self.opening)

    def gathered(self, totals: list[tuple[int, int]]) -> None:
        """Record what every rank of a collective load read: ``(total, opening)`` by rank."""
        self.ranks = tuple(total for total, _ in totals)
        self.ranks_opening = tuple(opening for _, opening in totals)

    @contextlib.contextmanager
    def counting(self) -> Iterator[ReadStats]:
        """Within the block, every checkpoint read of this thread counts here too, whoever
        reads it (a source opened without stats, DeepSpeed's torch.save files)."""
        token = _meter.set(self)
        try:
            yield self
        finally:
            _meter.reset(token)


def count_read(stats: ReadStats | None, file_name: str, count: int, *, opening: bool = False) -> None:
    """``count`` bytes read from ``file_name``: into ``stats`` if given, and into the thread's
    meter (:meth:`ReadStats.counting`) if one is set and it is not ``stats``."""
    if stats is not None:
        stats.add(file_name, count, opening=opening)
    meter = _meter.get()
    if meter is not None and meter is not stats:
        meter.add(file_name, count, opening=opening)
