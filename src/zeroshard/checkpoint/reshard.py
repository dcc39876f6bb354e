"""Which ranges of which old rank files fill one new rank's partitions.

Pure layout math. A parameter's elements sit at the same logical offsets at every world
size, so a new fragment (param, param_start, length) is old logical range
``old_slot.logical_offset + param_start`` of the same length, which the old group's
``locate_logical`` splits into (old rank, old partition offset) runs. Parameters are matched
by name, so the old and new layouts may differ in world size, policy, bucket size and even
grouping. Padding in the new partition is never a destination: it stays zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection

from ..layout import Layout


@dataclass(frozen=True)
class Copy:
    """Copy ``length`` elements from an old rank's partition of an old group into the new partition."""

    source_rank: int
    source_group: int
    source_start: int  # element offset in the old rank's partition of ``source_group``
    dest_start: int  # element offset in the new rank's partition
    length: int


@dataclass(frozen=True)
class GroupPlan:
    """Everything that fills one new group's partition on one rank, coalesced and sorted by source."""

    group: int
    source_groups: tuple[int, ...]  # old groups holding this group's parameters, first parameter's first
    copies: tuple[Copy, ...]

    @property
    def source_ranks(self) -> tuple[int, ...]:
        return tuple(sorted({copy.source_rank for copy in self.copies}))

    @property
    def numel(self) -> int:
        return sum(copy.length for copy in self.copies)


def plan_reads(old: Layout, new: Layout, rank: int, params: Collection[str] | None = None) -> tuple[GroupPlan, ...]:
    """One GroupPlan per new group for ``rank``; ``params`` limits it to those names (None: all).

    When the layouts are equal the plan copies each old partition of ``rank`` whole.
    """
    if old == new and (params is None or set(params) >= set(new.param_names)):
        return tuple(
            GroupPlan(g.index, (g.index,), (Copy(rank, g.index, 0, 0, g.partition_numel),) if g.partition_numel else ())
            for g in new.groups
        )
    wanted = None if params is None else set(params)
    return tuple(_plan_group(old, new, group_index, rank, wanted) for group_index in range(len(new.groups)))


def _plan_group(old: Layout, new: Layout, group_index: int, rank: int, wanted: set[str] | None) -> GroupPlan:
    group = new.groups[group_index]
    copies: list[Copy] = []
    for fragment in group.fragments(rank):
        if wanted is not None and fragment.name not in wanted:
            continue
        old_group, old_slot = old.param(fragment.name)
        logical_start = old_slot.logical_offset + fragment.param_start
        for piece in old_group.locate_logical(logical_start, fragment.length):
            dest = fragment.partition_start + piece.logical_start - logical_start
            copies.append(Copy(piece.rank, old_group.index, piece.partition_start, dest, piece.length))
    return GroupPlan(group_index, _source_groups(old, new, group_index, wanted), coalesce(copies))


def _source_groups(old: Layout, new: Layout, group_index: int, wanted: set[str] | None) -> tuple[int, ...]:
    found: list[int] = []
    old_names = set(old.param_names)
    for slot in new.groups[group_index].params:
        if (wanted is None or slot.name in wanted) and slot.name in old_names:
            source = old.param(slot.name)[0].index
            if source not in found:
                found.append(source)
    return tuple(found)


def coalesce(copies: list[Copy]) -> tuple[Copy, ...]:
    """Sort by source and merge copies contiguous in both the source and the destination."""
    merged: list[Copy] = []
    for copy in sorted(copies, key=lambda c: (c.source_rank, c.source_group, c.source_start)):
        last = merged[-1] if merged else None
        if (
            last is not None
            and (last.source_rank, last.source_group) == (copy.source_rank, copy.source_group)
            and last.source_start + last.length == copy.source_start
            and last.dest_start + last.length == copy.dest_start
        ):
            merged[-1] = Copy(
                last.source_rank, last.source_group, last.source_start, last.dest_start, last.length + copy.length
            )
        else:
            merged.append(copy)
    return tuple(merged)
