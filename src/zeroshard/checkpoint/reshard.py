"""Which ranges of which old rank files fill one new rank's partitions.

Pure layout math. Both layouts name a parameter's elements by global element
(:mod:`zeroshard.layout.coordinates`): a dense parameter's own, an expert weight's with every
expert stacked by global expert id, so the same element has the same global index at any
(W, EP). A new rank's partition is a list of global runs (``rank_runs``: fragments, split
where experts change); each is found in the old layout by ``locate_global``: expert by expert
(global expert ``g`` is local index ``l`` on old EP rank ``j`` with ``expert_map[j][l] == g``,
a contiguous range of the stacked weight), then by logical offset over the old shard group's
ranks (global rank ``shard_rank * EP + j``). Parameters are matched by name, so the layouts
may differ in world size, EP, policy, bucket size and even grouping. Padding in the new
partition is never a destination: it stays zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection

from ..layout import Layout, locate_global, rank_runs
from ..layout.coordinates import shard_rank


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
        """The old ranks whose files the copies read, sorted."""
        return tuple(sorted({copy.source_rank for copy in self.copies}))

    @property
    def numel(self) -> int:
        """Elements the copies fill (the partition's padding aside)."""
        return sum(copy.length for copy in self.copies)


def plan_reads(old: Layout, new: Layout, rank: int, params: Collection[str] | None = None) -> tuple[GroupPlan, ...]:
    """One GroupPlan per new group for global rank ``rank``; ``params`` limits it to those
    names (None: all). Copies name old global ranks (the rank files).

    When the layouts are equal the plan copies each old partition of ``rank`` whole.
    """
    if old == new and (params is None or set(params) >= set(new.param_names)):
        return tuple(
            GroupPlan(g.index, (g.index,), (Copy(rank, g.index, 0, 0, g.partition_numel),) if g.partition_numel else ())
            for g in new.groups
        )
    wanted = None if params is None else set(params)
    return tuple(_plan_group(old, new, group_index, rank, wanted) for group_index in range(len(new.groups)))


@dataclass(frozen=True)
class JobReads:
    """What the ranks of a load read together, worked out alike on every rank (no
    collective): of ``old``'s partitions, the elements some rank's plan into ``new`` copies
    (:meth:`elements`), of ``params``; the optimizer states too when ``full``; and the
    module tensors ``module`` (stored names; each read by one rank)."""

    old: Layout
    new: Layout
    params: frozenset[str]
    full: bool
    module: tuple[str, ...] = ()

    def elements(self, rank: int, group: int) -> list[tuple[int, int]]:
        """:func:`source_runs` of old rank ``rank``'s partition of old group ``group``."""
        return source_runs(self.old, self.new, self.params, rank, group)

    @property
    def own_partitions(self) -> bool:
        """Whether each rank reads exactly its own old partitions, whole (equal layouts,
        every parameter loaded): then no two ranks read from one old rank's partitions."""
        return copies_whole_partitions(self.old, self.new, self.params)


def copies_whole_partitions(old: Layout, new: Layout, params: Collection[str]) -> bool:
    """Whether :func:`plan_reads` of ``params`` copies each old partition whole into the same
    rank's new one: the layouts are equal and every parameter is loaded."""
    return old == new and set(params) >= set(new.param_names)


def source_runs(old: Layout, new: Layout, params: Collection[str], rank: int, group: int) -> list[tuple[int, int]]:
    """The elements of old rank ``rank``'s partition of old group ``group`` that some new
    rank's :func:`plan_reads` (of ``params``) copies, as ``(start, end)`` runs in partition
    order: the same on every rank, so the ranks of a load can tell which bytes of a file no
    rank reads (:mod:`zeroshard.io.shared_checks`) without a collective."""
    old_group = old.groups[group]
    if copies_whole_partitions(old, new, params):
        return [(0, old_group.partition_numel)] if old_group.partition_numel else []
    wanted = set(params)
    new_names = set(new.param_names)
    return [
        (fragment.partition_start, fragment.partition_start + fragment.length)
        for fragment in old_group.fragments(shard_rank(old_group, rank))
        if fragment.name in wanted and fragment.name in new_names
    ]


def _plan_group(old: Layout, new: Layout, group_index: int, rank: int, wanted: set[str] | None) -> GroupPlan:
    copies: list[Copy] = []
    for run in rank_runs(new.groups[group_index], rank):
        if wanted is not None and run.name not in wanted:
            continue
        old_group, old_slot = old.param(run.name)
        if old_group.is_expert_group != new.groups[group_index].is_expert_group:
            raise ValueError(f"parameter {run.name!r} is an expert weight in one layout and dense in the other")
        for piece in locate_global(old_group, old_slot, run.global_start, run.length):
            dest = run.partition_start + piece.global_start - run.global_start
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
