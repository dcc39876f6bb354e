"""A parameter's global elements, and where they live among all W ranks.

A dense parameter's global elements are its own. An expert group lays out the stacked weights
``[E / EP, ...]`` of one expert-parallel rank; the *global* tensor of such a weight stacks all
E experts by global expert id, ``[E, ...]``, so element ``k`` of expert ``g`` is global element
``g * n + k`` (``n`` elements per expert) whatever the EP. Checkpoints name elements this way,
which makes them independent of (W, EP).

Ranks follow :class:`~.experts.ExpertMesh`: global rank ``r`` holds the experts of EP rank
``r % EP`` and is rank ``r // EP`` of its expert-data-parallel group (the rank the group's
per-rank queries take). For a dense group EP is 1 and both are ``r`` itself.

Pure integer arithmetic, like the rest of the layout.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

from .group import Fragment, GroupLayout, ParamSlot


@dataclass(frozen=True)
class GlobalRun:
    """A run of one parameter's global elements and where it sits in one rank's partition."""

    rank: int  # global rank (of all W)
    name: str
    partition_start: int
    global_start: int
    length: int


def ep_size(group: GroupLayout) -> int:
    """Expert-parallel ranks of the group (1 for a dense group)."""
    return len(group.expert_map) or 1


def shard_rank(group: GroupLayout, rank: int) -> int:
    """Global rank ``rank``'s place in the group's shard group (ValueError outside the world)."""
    _check_rank(group, rank)
    return rank // ep_size(group)


def ep_rank(group: GroupLayout, rank: int) -> int:
    """The expert-parallel rank whose experts global rank ``rank`` holds (0 when dense;
    ValueError outside the world)."""
    _check_rank(group, rank)
    return rank % ep_size(group)


def global_rank(group: GroupLayout, shard: int, ep: int) -> int:
    """The global rank that is rank ``shard`` of the shard group of EP rank ``ep``."""
    return shard * ep_size(group) + ep


def global_shape(group: GroupLayout, slot: ParamSlot) -> tuple[int, ...]:
    """The parameter's shape with every expert stacked (its own shape when dense)."""
    shape = slot.spec.shape
    return (shape[0] * ep_size(group), *shape[1:]) if group.is_expert_group else shape


def expert_numel(slot: ParamSlot) -> int:
    """Elements of one expert in a stacked weight."""
    return slot.numel // slot.spec.shape[0] if slot.spec.shape and slot.spec.shape[0] else 0


def expert_location(group: GroupLayout, expert_id: int) -> tuple[int, int]:
    """(EP rank, local index) of global expert ``expert_id`` in an expert group (ValueError
    for an id the group does not have)."""
    try:
        return _locations(group.expert_map)[expert_id]
    except KeyError:
        raise ValueError(f"group {group.index} has no expert {expert_id!r}") from None


def rank_runs(group: GroupLayout, rank: int) -> tuple[GlobalRun, ...]:
    """Global rank ``rank``'s partition of ``group`` as runs of global elements, in partition
    order (padding left out); a fragment of a stacked weight is split where experts change.
    ValueError for a rank outside the world."""
    shard, ep = shard_rank(group, rank), ep_rank(group, rank)
    runs: list[GlobalRun] = []
    for fragment in group.fragments(shard):
        slot = group.params[fragment.param_index]
        if not group.is_expert_group:
            runs.append(GlobalRun(rank, slot.name, fragment.partition_start, fragment.param_start, fragment.length))
            continue
        per_expert = expert_numel(slot)
        for piece in expert_pieces(fragment, per_expert):
            first = group.expert_map[ep][piece.local_expert] * per_expert + piece.within_expert
            runs.append(GlobalRun(rank, slot.name, piece.partition_start, first, piece.length))
    return tuple(runs)


@dataclass(frozen=True)
class ExpertPiece:
    """The part of a fragment of a stacked expert weight that lies in one local expert."""

    local_expert: int  # index in the rank's stack
    within_expert: int  # first element, counted from the start of that expert
    length: int
    partition_start: int  # where it lies in the rank's partition


def expert_pieces(fragment: Fragment, per_expert: int) -> Iterator[ExpertPiece]:
    """``fragment`` (of a stacked weight whose experts hold ``per_expert`` elements each) cut
    where one local expert ends and the next begins, in partition order."""
    position, end = fragment.param_start, fragment.param_start + fragment.length
    while position < end:
        local, within = divmod(position, per_expert)
        length = min(per_expert - within, end - position)
        yield ExpertPiece(local, within, length, fragment.partition_start + position - fragment.param_start)
        position += length


def locate_global(group: GroupLayout, slot: ParamSlot, global_start: int, length: int) -> tuple[GlobalRun, ...]:
    """The runs, rank by rank (global ranks), that hold global elements [global_start, +length)
    of parameter ``slot`` of ``group``.

    Raises:
        ValueError: the range is not inside the parameter's global elements.
    """
    total = slot.numel * ep_size(group)
    if global_start < 0 or length < 0 or global_start + length > total:
        raise ValueError(f"range [{global_start}, {global_start + length}) is outside {slot.name!r}'s {total} elements")
    if not group.is_expert_group:
        return _locate_local(group, slot, 0, global_start, global_start, length)
    per_expert = expert_numel(slot)
    found: list[GlobalRun] = []
    position, end = global_start, global_start + length
    while position < end:
        expert, within = divmod(position, per_expert)
        run = min(per_expert - within, end - position)
        ep, local = expert_location(group, expert)
        found += _locate_local(group, slot, ep, local * per_expert + within, position, run)
        position += run
    return tuple(found)


def _locate_local(
    group: GroupLayout, slot: ParamSlot, ep: int, param_start: int, global_start: int, length: int
) -> list[GlobalRun]:
    logical = slot.logical_offset + param_start
    return [
        GlobalRun(
            global_rank(group, piece.rank, ep),
            slot.name,
            piece.partition_start,
            global_start + piece.logical_start - logical,
            piece.length,
        )
        for piece in group.locate_logical(logical, length)
    ]


@functools.lru_cache(maxsize=64)
def _locations(expert_map: tuple[tuple[int, ...], ...]) -> dict[int, tuple[int, int]]:
    return {expert: (ep, local) for ep, experts in enumerate(expert_map) for local, expert in enumerate(experts)}


def _check_rank(group: GroupLayout, rank: int) -> None:
    ranks = group.world_size * ep_size(group)
    if not 0 <= rank < ranks:
        raise ValueError(f"rank {rank} is outside world size {ranks}")
