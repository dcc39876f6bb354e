"""One group's flat buffer: where each parameter sits and which rank owns which elements.

Coordinates used throughout:

* flat offset: position in the group's flat buffer (all buckets, all padding);
* partition offset: position in one rank's partition of the group, which is the
  concatenation of that rank's slice of every bucket (bucket 0 first);
* logical offset: position with the world-size-dependent tail paddings removed. It does not
  depend on the world size, so state laid out in logical order reshards by range reads.

Everything here is integer arithmetic on frozen values. Per-rank queries cost
O(log P + answer size), so listing one rank's fragments at world size 4096 never walks all
parameters or all ranks.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

from .specs import DENSE_SHARD_GROUP, ParamSpec
from .stacks import ExpertStack


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter sits in its group's flat buffer."""

    spec: ParamSpec
    index: int  # position in the group
    bucket: int
    offset: int  # flat offset of element 0
    padding: int  # padding elements right after the parameter
    logical_offset: int

    @property
    def name(self) -> str:
        """The parameter's name."""
        return self.spec.name

    @property
    def numel(self) -> int:
        """The parameter's elements (no padding)."""
        return self.spec.numel

    @property
    def end(self) -> int:
        """Flat offset just past the parameter's last element (its padding follows)."""
        return self.offset + self.spec.numel


@dataclass(frozen=True)
class Bucket:
    """A run of parameters partitioned across all ranks on its own."""

    index: int
    first_param: int  # index of its first parameter in the group
    num_params: int
    start: int  # flat offset
    content_numel: int  # parameters and the padding between them
    tail_padding: int  # makes the bucket divide into world_size equal partitions
    partition_numel: int  # elements of this bucket on each rank
    partition_start: int  # where this bucket's slice begins in every rank's partition
    logical_start: int

    @property
    def numel(self) -> int:
        """Elements of the bucket, tail padding included."""
        return self.content_numel + self.tail_padding

    @property
    def end(self) -> int:
        """Flat offset just past the bucket."""
        return self.start + self.numel

    def rank_range(self, rank: int) -> tuple[int, int]:
        """Flat [start, end) of this bucket's slice owned by ``rank``."""
        begin = self.start + rank * self.partition_numel
        return begin, begin + self.partition_numel


@dataclass(frozen=True)
class Fragment:
    """A run of one parameter's elements inside one rank's partition."""

    param_index: int
    name: str
    param_start: int  # first element inside the (flattened) parameter
    partition_start: int  # where it lies in the rank's partition
    length: int


@dataclass(frozen=True)
class Piece:
    """A run of a parameter's elements and the rank that owns it."""

    rank: int
    partition_start: int
    param_start: int
    length: int


@dataclass(frozen=True)
class LogicalRange:
    """A run of a rank's partition that maps to the world-size-free logical buffer."""

    partition_start: int
    logical_start: int
    length: int


@dataclass(frozen=True)
class LogicalPiece:
    """A run of the logical buffer and the rank and partition offset that hold it."""

    rank: int
    partition_start: int
    logical_start: int
    length: int


@dataclass(frozen=True)
class GroupLayout:
    """The flat buffer of one group of same-dtype parameters, partitioned over one process group.

    ``world_size`` is the size of the process group named ``shard_group``: all ranks for a
    dense group, the W / EP ranks holding the same experts for an expert group. Per-rank
    queries take the rank within that process group. An expert group lays out the local
    experts of one expert-parallel rank; ``expert_map[e]`` names the global expert ids that
    expert-parallel rank ``e`` holds, in the order of the stacked weights' first dimension,
    and ``stacks[i]`` describes parameter ``i``'s stack (orientation, export form).
    """

    index: int
    dtype: str
    world_size: int
    params: tuple[ParamSlot, ...]
    buckets: tuple[Bucket, ...]
    shard_group: str = DENSE_SHARD_GROUP
    expert_map: tuple[tuple[int, ...], ...] = ()
    stacks: tuple[ExpertStack, ...] = ()

    @property
    def numel(self) -> int:
        """Elements of the flat buffer, padding included."""
        return self.buckets[-1].end if self.buckets else 0

    @property
    def partition_numel(self) -> int:
        """Elements of each rank's partition (the same on every rank)."""
        return sum(bucket.partition_numel for bucket in self.buckets)

    @property
    def logical_numel(self) -> int:
        """Elements of the world-size-free logical buffer (no tail padding)."""
        return sum(bucket.content_numel for bucket in self.buckets)

    @property
    def param_numel(self) -> int:
        """Elements of the parameters alone (no padding)."""
        return sum(slot.numel for slot in self.params)

    @property
    def is_expert_group(self) -> bool:
        """Whether the group holds stacked expert weights (it has an expert map)."""
        return bool(self.expert_map)

    @property
    def inter_param_padding(self) -> int:
        """Padding elements after parameters (alignment), independent of the world size."""
        return self.logical_numel - self.param_numel

    @property
    def tail_padding(self) -> int:
        """Padding elements at the buckets' tails, which depend on the world size."""
        return self.numel - self.logical_numel

    # ---- per rank -------------------------------------------------------------------

    def partition_ranges(self, rank: int) -> tuple[tuple[int, int], ...]:
        """Flat [start, end) of each bucket slice that makes up ``rank``'s partition.

        Raises:
            ValueError: ``rank`` is outside the group's world size (as every per-rank query).
        """
        self._check_rank(rank)
        return tuple(bucket.rank_range(rank) for bucket in self.buckets)

    def fragments(self, rank: int) -> tuple[Fragment, ...]:
        """The parameter runs in ``rank``'s partition, in partition order."""
        self._check_rank(rank)
        found: list[Fragment] = []
        for bucket in self.buckets:
            begin, end = bucket.rank_range(rank)
            for slot in self._slots_overlapping(bucket, begin, end):
                first, last = max(slot.offset, begin), min(slot.end, end)
                found.append(
                    Fragment(
                        param_index=slot.index,
                        name=slot.name,
                        param_start=first - slot.offset,
                        partition_start=bucket.partition_start + first - begin,
                        length=last - first,
                    )
                )
        return tuple(found)

    def padding_ranges(self, rank: int) -> tuple[tuple[int, int], ...]:
        """[start, end) runs of ``rank``'s partition that hold padding, not parameters."""
        gaps: list[tuple[int, int]] = []
        cursor = 0
        for fragment in self.fragments(rank):
            if fragment.partition_start > cursor:
                gaps.append((cursor, fragment.partition_start))
            cursor = fragment.partition_start + fragment.length
        if cursor < self.partition_numel:
            gaps.append((cursor, self.partition_numel))
        return tuple(gaps)

    def logical_ranges(self, rank: int) -> tuple[LogicalRange, ...]:
        """Runs of ``rank``'s partition that lie in the logical buffer (tail padding left out)."""
        self._check_rank(rank)
        ranges: list[LogicalRange] = []
        for bucket in self.buckets:
            begin, end = bucket.rank_range(rank)
            content_end = bucket.start + bucket.content_numel
            if begin < content_end:
                ranges.append(
                    LogicalRange(
                        partition_start=bucket.partition_start,
                        logical_start=bucket.logical_start + begin - bucket.start,
                        length=min(end, content_end) - begin,
                    )
                )
        return tuple(ranges)

    def padding_per_rank(self) -> tuple[int, ...]:
        """Padding elements in each rank's partition, O(world_size x buckets x log P)."""
        return tuple(self.partition_numel - self._real_numel_of_rank(rank) for rank in range(self.world_size))

    def padded_rank_counts(self) -> tuple[int, int]:
        """(ranks whose partition holds padding, ranks whose partition is all padding), as
        :meth:`padding_per_rank` would count them, in O(buckets x parameters): no loop over
        the ranks, so any world size answers at once."""
        touched: list[tuple[int, int]] = []  # inclusive rank intervals
        whole: list[tuple[int, int]] | None = None
        for bucket in self.buckets:
            size = bucket.partition_numel
            if size == 0:
                continue
            gaps = _gaps(bucket, self.params[bucket.first_param : bucket.first_param + bucket.num_params])
            touched += [(begin // size, (end - 1) // size) for begin, end in gaps]
            inside = _merged([(-(-begin // size), end // size - 1) for begin, end in gaps])
            whole = inside if whole is None else _intersection(whole, inside)
        only = 0 if whole is None or self.partition_numel == 0 else sum(hi - lo + 1 for lo, hi in whole)
        return sum(hi - lo + 1 for lo, hi in _merged(touched)), only

    # ---- per parameter ----------------------------------------------------------------

    def pieces(self, param_index: int) -> tuple[Piece, ...]:
        """The runs, rank by rank, that reassemble parameter ``param_index``."""
        slot = self.params[param_index]
        bucket = self.buckets[slot.bucket]
        found: list[Piece] = []
        position = slot.offset
        while position < slot.end:
            rank, within = divmod(position - bucket.start, bucket.partition_numel)
            length = min(bucket.partition_numel - within, slot.end - position)
            found.append(Piece(rank, bucket.partition_start + within, position - slot.offset, length))
            position += length
        return tuple(found)

    def locate_logical(self, logical_start: int, length: int) -> tuple[LogicalPiece, ...]:
        """The runs, rank by rank, that hold logical elements [logical_start, +length).

        Raises:
            ValueError: the range is not inside the group's logical elements.
        """
        if logical_start < 0 or length < 0 or logical_start + length > self.logical_numel:
            raise ValueError(
                f"logical range [{logical_start}, {logical_start + length}) is outside "
                f"group {self.index}'s {self.logical_numel} logical elements"
            )
        found: list[LogicalPiece] = []
        position, end = logical_start, logical_start + length
        while position < end:
            # The last bucket starting at or before `position`: never an empty one, since an
            # empty bucket shares its logical start with the bucket after it.
            bucket = self.buckets[bisect.bisect_right(self._bucket_logical_starts, position) - 1]
            rank, within = divmod(position - bucket.logical_start, bucket.partition_numel)
            run = min(bucket.partition_numel - within, end - position, bucket.logical_start + bucket.content_numel - position)
            found.append(LogicalPiece(rank, bucket.partition_start + within, position, run))
            position += run
        return tuple(found)

    # ---- helpers ----------------------------------------------------------------------

    @functools.cached_property
    def _bucket_logical_starts(self) -> list[int]:
        return [bucket.logical_start for bucket in self.buckets]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")

    @functools.cached_property
    def _param_ends(self) -> list[int]:
        return [slot.end for slot in self.params]

    @functools.cached_property
    def _real_before(self) -> list[int]:
        """_real_before[i]: parameter elements in params[:i]."""
        totals = [0]
        for slot in self.params:
            totals.append(totals[-1] + slot.numel)
        return totals

    def _slots_overlapping(self, bucket: Bucket, begin: int, end: int):
        stop = bucket.first_param + bucket.num_params
        index = bisect.bisect_right(self._param_ends, begin, bucket.first_param, stop)
        while index < stop and self.params[index].offset < end:
            slot = self.params[index]
            if slot.numel:
                yield slot
            index += 1

    def _real_at(self, flat_offset: int) -> int:
        """Parameter elements in the flat buffer before ``flat_offset``."""
        index = bisect.bisect_right(self._param_ends, flat_offset)
        real = self._real_before[index]
        if index < len(self.params):
            real += max(0, flat_offset - self.params[index].offset)
        return real

    def _real_numel_of_rank(self, rank: int) -> int:
        return sum(self._real_at(end) - self._real_at(begin) for begin, end in self.partition_ranges(rank))


def _gaps(bucket: Bucket, slots: tuple[ParamSlot, ...]) -> list[tuple[int, int]]:
    """The padding of ``bucket`` as [begin, end) runs relative to its start."""
    gaps, cursor = [], 0
    for slot in slots:
        if not slot.numel:
            continue
        if slot.offset - bucket.start > cursor:
            gaps.append((cursor, slot.offset - bucket.start))
        cursor = max(cursor, slot.end - bucket.start)
    if cursor < bucket.numel:
        gaps.append((cursor, bucket.numel))
    return gaps


def _merged(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Inclusive integer intervals merged into disjoint, sorted ones (empty ones dropped)."""
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(i for i in intervals if i[0] <= i[1]):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _intersection(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The intersection of two sorted disjoint interval lists."""
    found, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo <= hi:
            found.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return found
