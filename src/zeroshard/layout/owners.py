"""Owner partitions: every matrix of a group whole in one rank's partition.

Optimizers such as Muon update a matrix as a whole (Newton-Schulz orthogonalises it), so a
group they train must not be cut inside a matrix. An *owner* group (``GroupSpec.owner``) is
laid out exactly as an even group at world size 1 (parameters in order, each start aligned),
so its flat offsets and logical offsets are the same at every world size; only where each
rank's partition begins depends on it: ``bounds[r]`` is the flat offset where rank ``r``'s
partition begins (``bounds[0] == 0``, ``bounds[D]`` the end of the buffer), and rank ``r``
holds the flat run ``[bounds[r], bounds[r + 1])``, possibly empty. Every rank's partition
tensor (masters, gradients, optimizer state) has the group's ``partition_numel``: the
longest run, the shorter ones padded at their end, so every format that stores partitions
stores them as before.

A *matrix* is a parameter of a dense owner group, or one expert of a stack in an expert
owner group; a rank boundary falls only between matrices, at a position aligned as
partition starts are (experts whose size is not a multiple of the alignment are kept
together until one ends aligned).

The boundaries balance the Newton-Schulz cost ``max(M, N) * min(M, N) ** 2`` of one
iteration on an ``[M, N]`` matrix (a parameter of more dimensions is taken as ``[M, rest]``,
one of fewer costs nothing) over the ranks, across every owner group of the layout in
order (a rank's load from earlier groups counts: an expert group's shard rank carries the
largest load of the ranks it stands for), and the partition sizes. Two cuts are made:

* cost first (:func:`cost_first_bounds`): each group cut to the smallest largest cost a
  contiguous cut can reach, then among those cuts to the smallest partition. Evening the
  cost at any price in memory wastes much: a group whose large matrices leave its ranks'
  costs uneven makes the next group give its ranks unequal shares to compensate, and every
  rank's partition of that group is then its longest run;
* compact (:func:`compact_bounds`): every rank's cost may rise to the cap
  ``C = max(L, floor(mean * (1 + SLACK)))`` (``L`` the cost-first cut's largest rank
  load, ``mean`` the ranks' mean load); each group in order is cut to the smallest longest
  run within ``C``, then, at that run, to the least largest cost, so that no cost is spent
  that buys no memory and the later groups keep their room.

The layout takes the compact cut where its partitions hold fewer bytes (or as many, at a
lower cost), else the cost-first one (an earlier group's compact cut can crowd a later
group into more padding, or past the cap): its padding is never above the cost-first
cut's, and its cost imbalance at most ``max(cost first, 1 + SLACK)``, so at most
``1 + SLACK`` times the cost-first one. ``SLACK`` (1/40) is half the 5% margin of issue 32's imbalance goal
(1.05), and enough to let an expert group's partitions be even beside a dense group of
uneven cost (Qwen3-30B-A3B shapes at D = 64, benchmarks/muon.py; 1/50 is not).
Contiguous cuts keep every parameter (and every stack) one run of the flat buffer, which
the model's parameter views need. Any cut between matrices is a valid layout
(:func:`bounds_problem`): a layout JSON's recorded bounds are read as recorded, whichever
rule chose them.

Pure exact arithmetic (integers, and ``SLACK`` a Fraction), like the rest of the layout.
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Sequence

from .dtypes import itemsize
from .group import GroupLayout

# How far above the mean a rank's Newton-Schulz cost may rise to even out the partitions'
# sizes, where the cost-first cut stays below it (see the module doc).
SLACK = Fraction(1, 40)

# (units, shard ranks, prefill) -> bounds, or None where there is no such cut
GroupCut = Callable[["MatrixUnits", int, Sequence[int]], "tuple[int, ...] | None"]


def newton_schulz_cost(shape: Sequence[int]) -> int:
    """``max(M, N) * min(M, N) ** 2`` for a matrix ``[M, N]`` (``N`` the product of the
    other dimensions); 0 for fewer than two dimensions."""
    if len(shape) < 2:
        return 0
    rows, cols = shape[0], math.prod(shape[1:])
    return max(rows, cols) * min(rows, cols) ** 2


@dataclass(frozen=True)
class MatrixUnits:
    """The runs of an owner group's flat buffer a rank boundary may not cut: ``ends[i]`` is
    the flat offset just past run ``i`` (its padding included), ``costs[i]`` its
    Newton-Schulz cost. Runs tile the buffer from 0."""

    ends: tuple[int, ...]
    costs: tuple[int, ...]


def matrix_units(group: GroupLayout, alignment: int) -> MatrixUnits:
    """The uncuttable runs of ``group``: each parameter, or each run of experts of a stack
    that ends on a multiple of ``alignment`` elements."""
    ends: list[int] = []
    costs: list[int] = []
    for slot in group.params:
        experts = slot.spec.shape[0] if group.is_expert_group else 1
        if slot.numel == 0:
            ends.append(slot.end + slot.padding)
            costs.append(0)
            continue
        if experts == 1:
            ends.append(slot.end + slot.padding)
            costs.append(newton_schulz_cost(slot.spec.shape[1:] if group.is_expert_group else slot.spec.shape))
            continue
        per_expert = slot.numel // experts
        each = newton_schulz_cost(slot.spec.shape[1:])
        pending = 0
        for expert in range(experts):
            pending += each
            end = slot.offset + (expert + 1) * per_expert
            if expert == experts - 1:
                end += slot.padding
            elif end % alignment:
                continue
            ends.append(end)
            costs.append(pending)
            pending = 0
    return MatrixUnits(tuple(ends), tuple(costs))


def bounds_problem(group: GroupLayout, bounds: object, alignment: int) -> str | None:
    """Why ``bounds`` (as a layout JSON records them) are not a cut of owner group ``group``
    into its ranks' runs between whole matrices, or None: ``world_size + 1`` integers from 0
    to the buffer's end, never decreasing, each where a matrix ends (:func:`matrix_units`).
    Any such cut is a valid layout, whichever balancing chose it."""
    count = group.world_size + 1
    if type(bounds) is not list or len(bounds) != count or any(type(b) is not int for b in bounds):
        return f"its bounds are not a list of {count} integers"
    if bounds[0] != 0 or bounds[-1] != group.numel or any(a > b for a, b in zip(bounds, bounds[1:])):
        return f"its bounds do not rise from 0 to the end of its buffer ({group.numel})"
    ends = set(matrix_units(group, alignment).ends)
    inside = next((b for b in bounds[1:-1] if b and b not in ends), None)
    if inside is not None:
        return f"its bound {inside} falls inside a matrix (or at an unaligned offset)"
    return None


def balanced_bounds(units: MatrixUnits, world_size: int, prefill: Sequence[int]) -> tuple[int, ...]:
    """The flat offsets where each of ``world_size`` ranks' partitions begin (and the end):
    the cut of ``units`` into contiguous runs that gives the smallest largest cost (rank
    ``r`` already carries ``prefill[r]``), then among those the smallest largest run."""
    costs, sizes = _prefix_sums(units)
    cost_limit = _smallest(lambda limit: _cut(costs, sizes, prefill, world_size, limit, sizes[-1]), costs[-1] + max(prefill))
    cost_limit = max(cost_limit, max(prefill))  # up to the largest load already there costs nothing
    size_limit = _smallest(lambda limit: _cut(costs, sizes, prefill, world_size, cost_limit, limit), sizes[-1])
    cuts = _cut(costs, sizes, prefill, world_size, cost_limit, size_limit)
    assert cuts is not None  # feasible by the searches above
    return tuple(sizes[i] for i in cuts)


def compact_bounds(
    units: MatrixUnits, world_size: int, prefill: Sequence[int], cost_cap: int
) -> tuple[int, ...] | None:
    """The cut of ``units`` into ``world_size`` contiguous runs with the smallest largest run
    that keeps every rank's cost (``prefill[r]`` included) within ``cost_cap``, then, at that
    run, the smallest largest cost (no cost is spent that buys no memory); None when no cut
    keeps within ``cost_cap``."""
    costs, sizes = _prefix_sums(units)
    if _cut(costs, sizes, prefill, world_size, cost_cap, sizes[-1]) is None:
        return None
    size_limit = _smallest(lambda limit: _cut(costs, sizes, prefill, world_size, cost_cap, limit), sizes[-1])
    cost_limit = _smallest(lambda limit: _cut(costs, sizes, prefill, world_size, limit, size_limit), cost_cap)
    cuts = _cut(costs, sizes, prefill, world_size, cost_limit, size_limit)
    assert cuts is not None  # feasible by the searches above
    return tuple(sizes[i] for i in cuts)


def _prefix_sums(units: MatrixUnits) -> tuple[list[int], list[int]]:
    """(cost, flat offset) before each unit and at the end: ``_cut``'s arguments."""
    costs = [0]
    for cost in units.costs:
        costs.append(costs[-1] + cost)
    return costs, [0, *units.ends]


def _cut(
    costs: list[int], sizes: list[int], prefill: Sequence[int], world_size: int, cost_limit: int, size_limit: int
) -> list[int] | None:
    """Unit indices where each rank's run begins (and the end), each rank taking as many
    units as fit under both limits; None when they do not all fit. Taking as many as fit
    is optimal for a contiguous cut: what is left is a suffix of what any other cut leaves."""
    count = len(costs) - 1
    cuts, index = [0], 0
    for rank in range(world_size):
        if index < count and prefill[rank] <= cost_limit:
            by_cost = bisect.bisect_right(costs, costs[index] + cost_limit - prefill[rank]) - 1
            by_size = bisect.bisect_right(sizes, sizes[index] + size_limit) - 1
            index = max(index, min(by_cost, by_size))
        cuts.append(index)
    return cuts if index == count else None


def _smallest(feasible, upper: int) -> int:
    """The smallest integer limit in [0, upper] for which ``feasible`` holds (it holds at ``upper``)."""
    low, high = 0, upper
    while low < high:
        middle = (low + high) // 2
        if feasible(middle) is not None:
            high = middle
        else:
            low = middle + 1
    return low


def owner_bounds(
    groups: Sequence[GroupLayout], owners: Sequence[bool], world_size: int, alignments: Sequence[int]
) -> list[tuple[int, ...]]:
    """The bounds of each group of ``groups`` that ``owners`` flags (laid out, its bounds
    not yet set; the others get ``()``), over a layout of ``world_size`` ranks: the compact
    cut under the cost cap where it pads fewer bytes, else the cost-first one (see the
    module doc); ``alignments[g]``: elements a partition start of group ``g`` is aligned to.
    A layout without owner groups costs nothing here: no per-rank list at any world size."""
    if not any(owners):
        return [()] * len(groups)
    owned = _owned_units(groups, owners, alignments)
    cost_first = _cut_in_order(groups, owned, world_size, balanced_bounds)
    assert cost_first is not None  # balanced_bounds always cuts
    loads = cost_first[1]
    cap = max(max(loads), math.floor(Fraction(sum(loads), world_size) * (1 + SLACK)))
    compact = _cut_in_order(groups, owned, world_size, functools.partial(compact_bounds, cost_cap=cap))
    if compact is not None and _footprint(groups, compact) < _footprint(groups, cost_first):
        return compact[0]
    return cost_first[0]


def cost_first_bounds(
    groups: Sequence[GroupLayout], owners: Sequence[bool], world_size: int, alignments: Sequence[int]
) -> list[tuple[int, ...]]:
    """As :func:`owner_bounds`, but every owner group cut by :func:`balanced_bounds`: the
    smallest largest Newton-Schulz cost first, whatever the partitions' sizes (the cut
    zeroshard made before the cost cap, which the cap is measured from)."""
    if not any(owners):
        return [()] * len(groups)
    found = _cut_in_order(groups, _owned_units(groups, owners, alignments), world_size, balanced_bounds)
    assert found is not None
    return found[0]


def _owned_units(
    groups: Sequence[GroupLayout], owners: Sequence[bool], alignments: Sequence[int]
) -> dict[int, MatrixUnits]:
    """The matrix units of each owner group, by its index."""
    return {index: matrix_units(group, alignments[index]) for index, group in enumerate(groups) if owners[index]}


def _cut_in_order(
    groups: Sequence[GroupLayout], owned: dict[int, MatrixUnits], world_size: int, cut: GroupCut
) -> tuple[list[tuple[int, ...]], list[int]] | None:
    """(bounds of every group, load of every global rank) when each owner group in order is
    cut by ``cut(units, shard ranks, prefill)``, its ranks carrying the loads of the groups
    before it; None when ``cut`` finds no cut for one of them."""
    load = [0] * world_size  # per global rank: an owner group's bounds are a list over the ranks anyway
    found: list[tuple[int, ...]] = []
    for index, group in enumerate(groups):
        units = owned.get(index)
        if units is None:
            found.append(())
            continue
        ep = world_size // group.world_size
        prefill = [max(load[shard * ep : (shard + 1) * ep]) for shard in range(group.world_size)]
        bounds = cut(units, group.world_size, prefill)
        if bounds is None:
            return None
        for shard, cost in enumerate(rank_costs(units, bounds)):
            for column in range(ep):
                load[shard * ep + column] += cost
        found.append(bounds)
    return found, load


def _footprint(groups: Sequence[GroupLayout], cut: tuple[list[tuple[int, ...]], list[int]]) -> tuple[int, int]:
    """(bytes of the owner groups' partitions on each rank, the largest rank's load) of a
    cut, to compare two cuts by: every rank holds one partition of each group (an expert
    group's too, whatever its shard group), each its group's longest run."""
    all_bounds, load = cut
    partitions = sum(
        max(b - a for a, b in zip(bounds, bounds[1:])) * itemsize(group.dtype)
        for group, bounds in zip(groups, all_bounds)
        if bounds
    )
    return partitions, max(load)


def rank_costs(units: MatrixUnits, bounds: Sequence[int]) -> list[int]:
    """The Newton-Schulz cost of each rank's partition under ``bounds`` (unit ends)."""
    costs, sizes = _prefix_sums(units)

    def before(offset: int) -> int:
        return costs[bisect.bisect_right(sizes, offset) - 1]

    return [before(bounds[r + 1]) - before(bounds[r]) for r in range(len(bounds) - 1)]


@dataclass(frozen=True)
class OwnerBalance:
    """How evenly a layout spreads the Newton-Schulz work of its owner groups: the cost of
    one iteration over every matrix each global rank owns."""

    costs: tuple[int, ...]  # per global rank

    @property
    def imbalance(self) -> float:
        """The largest rank's cost over the mean (1.0: perfectly even; 1.0 without owner groups)."""
        total = sum(self.costs)
        return max(self.costs) * len(self.costs) / total if total else 1.0


def owner_balance(groups: Sequence[GroupLayout], world_size: int, alignments: Sequence[int]) -> OwnerBalance:
    """Each global rank's Newton-Schulz cost over the owner groups of a layout."""
    load = [0] * world_size
    for group, alignment in zip(groups, alignments):
        if not group.owner:
            continue
        ep = world_size // group.world_size
        for shard, cost in enumerate(rank_costs(matrix_units(group, alignment), group.bounds)):
            for column in range(ep):
                load[shard * ep + column] += cost
    return OwnerBalance(tuple(load))
