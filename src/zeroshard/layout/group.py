"""One group's flat buffer: where each parameter sits and which rank owns which elements.

Coordinates used throughout:

* flat offset: position in the group's flat buffer (all buckets, all padding);
* partition offset: position in one rank's partition of the group, which is the
  concatenation of that rank's slice of every bucket (bucket 0 first);
* logical offset: position with the world-size-dependent tail paddings removed. It does not
  depend on the world size, so state laid out in logical order reshards by range reads.

An *even* group (the default) cuts every bucket into ``world_size`` equal slices, its tail
padded to make them so. An *owner* group (:mod:`.owners`) has no tail padding: its flat
buffer is its logical buffer, and ``bounds[r]`` is where rank ``r``'s partition begins, so a
rank's partition is one run of the flat buffer, possibly empty, padded at its end to the
group's ``partition_numel`` (the longest); its buckets' slices differ in size from rank to
rank (:meth:`GroupLayout.bucket_slice`).

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
    partition_numel: int  # elements of this bucket on each rank (0 in an owner group: see bucket_slice)
    partition_start: int  # where this bucket's slice begins in every rank's partition (even groups)
    logical_start: int
    uneven: bool = False  # an owner group's: its slices differ from rank to rank

    @property
    def numel(self) -> int:
        """Elements of the bucket, tail padding included."""
        return self.content_numel + self.tail_padding

    @property
    def end(self) -> int:
        """Flat offset just past the bucket."""
        return self.start + self.numel

    def rank_range(self, rank: int) -> tuple[int, int]:
        """Flat [start, end) of this bucket's slice owned by ``rank`` (even groups).

        Raises:
            ValueError: the bucket is an owner group's, whose slices only the group knows
                (:meth:`GroupLayout.bucket_slice`).
        """
        if self.uneven:
            raise ValueError("an owner group's bucket slices differ by rank: use GroupLayout.bucket_slice")
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
    ``bounds``: an owner group's partition starts (``world_size + 1`` flat offsets, see the
    module doc); empty for an even group.
    """

    index: int
    dtype: str
    world_size: int
    params: tuple[ParamSlot, ...]
    buckets: tuple[Bucket, ...]
    shard_group: str = DENSE_SHARD_GROUP
    expert_map: tuple[tuple[int, ...], ...] = ()
    stacks: tuple[ExpertStack, ...] = ()
    bounds: tuple[int, ...] = ()

    @property
    def owner(self) -> bool:
        """Whether every matrix lies whole in one rank's partition (:mod:`.owners`)."""
        return bool(self.bounds)

    @property
    def numel(self) -> int:
        """Elements of the flat buffer, padding included."""
        return self.buckets[-1].end if self.buckets else 0

    @functools.cached_property
    def partition_numel(self) -> int:
        """Elements of each rank's partition (the same on every rank; an owner group's
        shorter runs are padded at their end to its longest)."""
        if self.owner:
            return max(self.bounds[r + 1] - self.bounds[r] for r in range(self.world_size))
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
        """Padding elements at the buckets' tails (an owner group: at its partitions'
        tails), summed over the ranks; they depend on the world size."""
        return self.world_size * self.partition_numel - self.logical_numel

    # ---- per rank -------------------------------------------------------------------

    def partition_ranges(self, rank: int) -> tuple[tuple[int, int], ...]:
        """Flat [start, end) runs that, concatenated, make up ``rank``'s partition: each
        bucket's slice (an owner group: one run, none when empty); what they leave of
        ``partition_numel`` is padding at the end.

        Raises:
            ValueError: ``rank`` is outside the group's world size (as every per-rank query).
        """
        self._check_rank(rank)
        if self.owner:
            begin, end = self.bounds[rank], self.bounds[rank + 1]
            return ((begin, end),) if end > begin else ()
        return tuple(bucket.rank_range(rank) for bucket in self.buckets)

    def bucket_slice(self, bucket_index: int, rank: int) -> tuple[int, int, int]:
        """(flat start, flat end, partition offset) of ``rank``'s slice of a bucket: the
        bucket's equal slice in an even group, its overlap with the rank's run in an owner
        group (possibly empty)."""
        self._check_rank(rank)
        bucket = self.buckets[bucket_index]
        if not self.owner:
            begin, end = bucket.rank_range(rank)
            return begin, end, bucket.partition_start
        run_start = self.bounds[rank]
        begin = min(max(run_start, bucket.start), bucket.end)
        end = max(min(self.bounds[rank + 1], bucket.end), begin)
        return begin, end, begin - run_start

    def _bucket_indices(self, rank: int) -> range:
        """The buckets holding elements of ``rank``'s partition (all of them in an even group)."""
        if not self.owner:
            return range(len(self.buckets))
        begin, end = self.bounds[rank], self.bounds[rank + 1]
        if end == begin:
            return range(0)
        first = bisect.bisect_right(self._bucket_starts, begin) - 1
        return range(first, bisect.bisect_left(self._bucket_starts, end))

    def fragments(self, rank: int) -> tuple[Fragment, ...]:
        """The parameter runs in ``rank``'s partition, in partition order."""
        self._check_rank(rank)
        found: list[Fragment] = []
        for bucket_index in self._bucket_indices(rank):
            bucket = self.buckets[bucket_index]
            begin, end, partition_start = self.bucket_slice(bucket_index, rank)
            for slot in self._slots_overlapping(bucket, begin, end):
                first, last = max(slot.offset, begin), min(slot.end, end)
                found.append(
                    Fragment(
                        param_index=slot.index,
                        name=slot.name,
                        param_start=first - slot.offset,
                        partition_start=partition_start + first - begin,
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
        for bucket_index in self._bucket_indices(rank):
            bucket = self.buckets[bucket_index]
            begin, end, partition_start = self.bucket_slice(bucket_index, rank)
            content_end = bucket.start + bucket.content_numel
            if begin < min(end, content_end):
                ranges.append(
                    LogicalRange(
                        partition_start=partition_start,
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
        if self.owner:
            return self._owner_padded_rank_counts()
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

    def _owner_padded_rank_counts(self) -> tuple[int, int]:
        """:meth:`padded_rank_counts` of an owner group, O(world_size x log P): its bounds
        are a list over the ranks already."""
        real = [self._real_at(self.bounds[rank + 1]) - self._real_at(self.bounds[rank]) for rank in range(self.world_size)]
        return sum(1 for n in real if n < self.partition_numel), sum(1 for n in real if self.partition_numel and n == 0)

    # ---- per parameter ----------------------------------------------------------------

    def pieces(self, param_index: int) -> tuple[Piece, ...]:
        """The runs, rank by rank, that reassemble parameter ``param_index``."""
        slot = self.params[param_index]
        if self.owner:
            return tuple(
                Piece(rank, partition_start, position - slot.offset, length)
                for rank, partition_start, position, length in self._owner_runs(slot.offset, slot.numel)
            )
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
        if self.owner:  # its logical buffer is its flat buffer
            return tuple(LogicalPiece(*run) for run in self._owner_runs(logical_start, length))
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

    def _owner_runs(self, flat_start: int, length: int) -> list[tuple[int, int, int, int]]:
        """(rank, partition offset, flat offset, length) of the runs of an owner group's
        flat elements [flat_start, +length), rank by rank: O(log D + answer)."""
        found = []
        position, end = flat_start, flat_start + length
        while position < end:
            # The last rank starting at or before `position`: never an empty one, since an
            # empty rank shares its start with the rank after it.
            rank = bisect.bisect_right(self.bounds, position) - 1
            run = min(self.bounds[rank + 1], end) - position
            found.append((rank, position - self.bounds[rank], position, run))
            position += run
        return found

    # ---- helpers ----------------------------------------------------------------------

    @functools.cached_property
    def _bucket_starts(self) -> list[int]:
        return [bucket.start for bucket in self.buckets]

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
