"""The inputs of :func:`~.layout.build_layout`, checked: every problem a ValueError that names
the parameter or group and what is wrong, before any offset is computed."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Sequence

from .policy import LayoutPolicy
from .specs import DENSE_SHARD_GROUP, GroupSpec, ParamSpec
from .stacks import LEGACY_STACK, ExpertStack, check_expert_map, check_stack_shape, per_expert_name_clash

GroupInput = GroupSpec | Sequence[ParamSpec | tuple[str, Sequence[int], object]]


def checked_groups(groups: Sequence[GroupInput], world_size: int, policy: LayoutPolicy) -> list[GroupSpec]:
    """Each group as a :class:`GroupSpec` with its shard group's size filled in, all checked
    alone and against each other (unique names, per-expert names, shard group sizes).

    Raises:
        ValueError: naming the parameter or group and the problem.
    """
    if not is_int(world_size) or world_size < 1:
        raise ValueError(f"world size must be an integer >= 1, got {world_size!r}")
    checked = [_check_group(index, group, world_size, policy) for index, group in enumerate(groups)]
    _check_unique_names([group.params for group in checked])
    _check_per_expert_names(checked)
    _check_shard_group_sizes(checked)
    return checked


def _check_group(index: int, group: GroupInput, world_size: int, policy: LayoutPolicy) -> GroupSpec:
    shard = group if isinstance(group, GroupSpec) else GroupSpec(())
    params: Iterable[Any] = group.params if isinstance(group, GroupSpec) else group
    specs = [param if isinstance(param, ParamSpec) else ParamSpec.of(*param) for param in params]
    if not specs:
        raise ValueError(f"group {index} has no parameters")
    dtype = specs[0].dtype
    for spec in specs:
        if spec.dtype != dtype:
            raise ValueError(f"parameter {spec.name!r} is {spec.dtype} but group {index} is {dtype}; one dtype per group")
    problem = policy.check_dtype(dtype)
    if problem:
        raise ValueError(f"parameter {specs[0].name!r} (group {index}): {problem}")
    if type(shard.owner) is not bool:
        raise ValueError(f"group {index}: 'owner' must be true or false, got {shard.owner!r}")
    if shard.owner and (policy.kind != "native" or policy.compact):
        raise ValueError(
            f"group {index} is an owner group (whole matrices per rank), which needs the native policy with aligned "
            f"parameters; the policy is {policy.describe()}"
        )
    return dataclasses.replace(_check_shard(index, specs, shard, world_size), owner=shard.owner)


def _check_shard(index: int, specs: list[ParamSpec], shard: GroupSpec, world_size: int) -> GroupSpec:
    """The group with its shard group checked and its world size filled in."""
    name = shard.shard_group
    try:
        expert_map = tuple(tuple(experts) for experts in shard.expert_map)
    except TypeError:
        raise ValueError(f"group {index}: the expert map must be a list of lists of expert ids") from None
    if not isinstance(name, str) or not name:
        raise ValueError(f"group {index}: shard group name must be a non-empty string, got {name!r}")
    parallel = len(expert_map) or 1
    size = shard.world_size if shard.world_size is not None else world_size // parallel
    if not is_int(size) or size < 1 or world_size % size:
        raise ValueError(f"group {index}: shard group {name!r} of {size!r} ranks does not divide the world size {world_size}")
    if name == DENSE_SHARD_GROUP and (size != world_size or expert_map):
        raise ValueError(f"group {index}: shard group {name!r} is all {world_size} ranks, without experts")
    if not expert_map:
        if shard.stacks:
            raise ValueError(f"group {index}: expert stacks are described for a group without experts")
        return GroupSpec(tuple(specs), name, size)
    _check_expert_map(index, specs, expert_map, size, world_size)
    return GroupSpec(tuple(specs), name, size, expert_map, _checked_stacks(index, specs, shard.stacks))


def _checked_stacks(index: int, specs: list[ParamSpec], stacks: Any) -> tuple[ExpertStack, ...]:
    """One ExpertStack per parameter, each checked against its shape; LEGACY_STACK for each
    when none are given (a legacy stack's shape is checked where it matters, at export, as
    before stacks were described)."""
    if not stacks:
        return (LEGACY_STACK,) * len(specs)
    stacks = tuple(stacks)
    if len(stacks) != len(specs) or not all(isinstance(stack, ExpertStack) for stack in stacks):
        raise ValueError(f"group {index}: expert stacks must be one ExpertStack per parameter ({len(specs)})")
    for spec, stack in zip(specs, stacks):
        if stack == LEGACY_STACK:
            continue  # as when none are given
        try:
            check_stack_shape(spec.name, stack, spec.shape)
        except ValueError as err:
            raise ValueError(f"group {index}: {err}") from None
    return stacks


def _check_expert_map(
    index: int, specs: list[ParamSpec], expert_map: tuple[tuple[int, ...], ...], size: int, world_size: int
) -> None:
    try:
        check_expert_map(expert_map)
    except ValueError as err:
        raise ValueError(f"group {index}: {err}") from None
    local = len(expert_map[0])
    if size * len(expert_map) != world_size:
        raise ValueError(
            f"group {index}: {len(expert_map)} expert-parallel ranks x {size} ranks per shard group "
            f"is not the world size {world_size}"
        )
    for spec in specs:
        if not spec.shape or spec.shape[0] != local:
            raise ValueError(
                f"parameter {spec.name!r} (group {index}): expert weights stack {local} local experts "
                f"in their first dimension, got shape {list(spec.shape)}"
            )


def _check_shard_group_sizes(groups: list[GroupSpec]) -> None:
    sizes: dict[str, int] = {}
    for index, group in enumerate(groups):
        size = sizes.setdefault(group.shard_group, group.world_size)
        if size != group.world_size:
            raise ValueError(
                f"group {index}: shard group {group.shard_group!r} has {group.world_size} ranks here "
                f"but {size} in an earlier group"
            )


def is_int(value: object) -> bool:
    """An int that is not a bool (JSON's ``true`` is no count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _check_unique_names(groups: list[tuple[ParamSpec, ...]]) -> None:
    seen: set[str] = set()
    for spec in (spec for group in groups for spec in group):
        if spec.name in seen:
            raise ValueError(f"parameter {spec.name!r} appears more than once")
        seen.add(spec.name)


def _check_per_expert_names(groups: list[GroupSpec]) -> None:
    """Every stack's per-expert tensors have names of their own (exports write them)."""
    experts = [sum(map(len, group.expert_map)) for group in groups]
    stacks = [(spec.name, stack, e) for g, e in zip(groups, experts) for spec, stack in zip(g.params, g.stacks)]
    problem = per_expert_name_clash(stacks, [spec.name for group in groups for spec in group.params])
    if problem:
        raise ValueError(f"{problem}; a per-expert export would write two tensors under it")
