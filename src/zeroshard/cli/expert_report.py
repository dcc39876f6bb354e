"""Report lines for layouts with expert groups: shard groups, expert parallelism, expert map.

Shared by ``zeroshard inspect`` and ``zeroshard layout``. Pure: a :class:`Layout` in, lines out
(no torch). A dense layout has no such lines, so dense reports are unchanged.

Which ranks hold an EP rank's experts follows :class:`~zeroshard.layout.ExpertMesh`, the
arrangement the engine builds its process groups from: EP rank ``e`` is every rank
``e, e + EP, ...`` (its expert-data-parallel group).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from ..layout import LEGACY_STACK, ExpertStack, GroupLayout, Layout

LISTED_EP_RANKS = 8  # expert-map lines shown per group before "... N more"
_LISTED_IDS = 6  # ids shown of a list that is not a run or a stride


def expert_parallel_size(layout: Layout) -> int | None:
    """EP: how many expert-parallel ranks share the experts (None for a dense layout)."""
    sizes = {len(group.expert_map) for group in layout.groups if group.is_expert_group}
    return sizes.pop() if len(sizes) == 1 else None


def shard_group_lines(layout: Layout, *, indent: str = "", listed: int | None = LISTED_EP_RANKS) -> list[str]:
    """The shard groups (name, ranks), EP and, per expert group, the expert map; ``[]`` for
    a dense layout. ``listed`` caps the EP ranks shown per expert map (None: all)."""
    if layout.is_dense:
        return []
    groups = ", ".join(f"{name} ({size} rank{'s' if size != 1 else ''})" for name, size in layout.shard_groups.items())
    ep = expert_parallel_size(layout)
    lines = [f"{indent}shard groups: {groups}" + (f"; expert parallelism EP={ep}" if ep else "")]
    for group in layout.groups:
        if group.is_expert_group:
            lines += _expert_map_lines(layout.world_size, group, indent, listed)
            lines += stack_lines({slot.name: group.stacks[slot.index] for slot in group.params}, f"{indent}  ")
    return lines


def stack_lines(stacks: Mapping[str, ExpertStack], indent: str = "") -> list[str]:
    """One line per distinct stack description (orientation, export form, parts), with how
    many stacks have it and the first one's name; ``[]`` when every stack is MoEGPT's
    ``LEGACY_STACK`` (reports of such layouts are unchanged)."""
    if all(stack == LEGACY_STACK for stack in stacks.values()):
        return []
    alike: dict[ExpertStack, list[str]] = {}
    for name, stack in stacks.items():
        alike.setdefault(stack, []).append(name)
    lines = []
    for stack, names in alike.items():
        parts = f" (per expert: {', '.join(stack.parts)})" if stack.parts else ""
        more = f", ... ({len(names)} in all)" if len(names) > 1 else ""
        lines.append(f"{indent}stacks {stack.orientation}, exported {stack.export}{parts}: {names[0]}{more}")
    return lines


def every_expert_numel(layout: Layout) -> int:
    """Elements of the whole model: the dense groups, and each expert group times EP (a
    layout group holds one EP rank's experts)."""
    return sum(group.param_numel * max(len(group.expert_map), 1) for group in layout.groups)


def universal_expert_lines(
    experts: Mapping[str, Sequence[str]], stacks: Mapping[str, ExpertStack] | None = None
) -> list[str]:
    """The expert weights of a universal checkpoint (its manifest's ``experts``: legacy stack
    -> its experts' tensor names by global id; ``expert_stacks``: stacks stored whole);
    ``[]`` without experts."""
    lines = []
    if stacks:
        lines.append(
            f"experts: {len(stacks)} expert stacks stored whole, [E, ...] by global id under their own names; "
            "any expert parallelism that divides the experts loads them"
        )
        lines += stack_lines(stacks, "  ")
    if not experts:
        return lines
    counts = sorted({len(names) for names in experts.values()})
    first_stack, first_names = next(iter(experts.items()))
    return lines + [
        f"experts: {len(experts)} stacked expert weights of {'/'.join(map(str, counts))} experts each, stored as one "
        f"[out, in] tensor per expert by global id ({first_stack} -> {first_names[0]}, ...); "
        "any expert parallelism that divides the experts loads them"
    ]


def group_partitioning(layout: Layout, group: GroupLayout) -> str:
    """How one group is partitioned, for a layout with shard groups (``""`` for a dense one)."""
    if layout.is_dense:
        return ""
    what = "experts" if group.is_expert_group else "dense"
    return f"{what}, over {group.shard_group} ({group.world_size} ranks)"


def _expert_map_lines(world_size: int, group: GroupLayout, indent: str, listed: int | None) -> list[str]:
    ep = len(group.expert_map)
    experts = sum(len(ids) for ids in group.expert_map)
    lines = [
        f"{indent}expert map of group {group.index}: {experts} experts, {experts // ep} per EP rank; "
        f"{group.param_numel:,} elements per EP rank, {group.param_numel * ep:,} in all"
    ]
    shown = group.expert_map if listed is None else group.expert_map[:listed]
    for ep_rank, ids in enumerate(shown):
        ranks = range(ep_rank, world_size, ep)  # its expert-DP group (ExpertMesh), never listed whole
        plural = "s" if len(ranks) > 1 else ""
        lines.append(f"{indent}  EP rank {ep_rank}: experts {format_ids(ids)} on rank{plural} {format_ids(ranks)}")
    if len(shown) < ep:
        lines.append(f"{indent}  ... {ep - len(shown)} more EP ranks")
    return lines


def format_ids(ids: Sequence[int]) -> str:
    """``0-3`` for a run, ``1, 3, ..., 9`` for a longer stride, else a list (long ones cut)."""
    if isinstance(ids, range) and len(ids) > _LISTED_IDS:  # any length, without listing it
        return f"{ids[0]}-{ids[-1]}" if ids.step == 1 else f"{ids[0]}, {ids[1]}, ..., {ids[-1]}"
    ids = list(ids)
    if len(ids) <= 2:
        return ", ".join(map(str, ids))
    steps = {b - a for a, b in zip(ids, ids[1:])}
    if steps == {1}:
        return f"{ids[0]}-{ids[-1]}"
    if len(steps) == 1 and len(ids) > 4:
        return f"{ids[0]}, {ids[1]}, ..., {ids[-1]}"
    if len(ids) > _LISTED_IDS:
        return ", ".join(map(str, ids[:_LISTED_IDS])) + f", ... ({len(ids)} in all)"
    return ", ".join(map(str, ids))
