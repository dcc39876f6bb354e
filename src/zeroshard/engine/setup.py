"""How a ZeroOptimizer is set up: its shard groups' collectives, its layout, its reduction
dtypes and the initial values of its flat buffers and fp32 masters.

Plain functions over what the constructor has (the grouping of the model's parameters and
the process groups), so the optimizer module holds the training step and torch's surface."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn

from ..buffers import torch_dtype
from ..comm import Collectives
from ..layout import (
    DENSE_SHARD_GROUP,
    EXPERT_SHARD_GROUP,
    ExpertMesh,
    GroupLayout,
    GroupSpec,
    Layout,
    LayoutPolicy,
    build_layout,
)
from ..layout.coordinates import shard_rank
from .grouping import Grouping
from .matrices import matrix_problem, needs_whole_matrices
from .multi import class_name

DEFAULT_STAGE2_BUCKET_NUMEL = 1 << 25  # 128 MiB of fp32 gradient per bucket in flight
REDUCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def shard_group_collectives(comm: Collectives, grouping: Grouping, expert_process_group: Any) -> dict[str, Collectives]:
    """One Collectives per shard group: ``"dp"`` (all ranks) and, with experts, ``"expert_dp"``
    (in a world of one, without an expert process group, the dense one: EP = 1). Not collective.

    Raises:
        ValueError: a param group is flagged expert but no ``expert_process_group`` is given
            (at world size > 1).
    """
    comms = {DENSE_SHARD_GROUP: comm}
    has_experts = any(user.expert for user in grouping.user_groups)
    if has_experts and expert_process_group is None:
        if comm.world_size != 1:
            raise ValueError("a param group is flagged 'expert' but no expert_process_group was given")
        comms[EXPERT_SHARD_GROUP] = comm  # a world of one holds every expert (EP = 1)
    elif has_experts:
        comms[EXPERT_SHARD_GROUP] = Collectives(expert_process_group)
    return comms


def resolve_layout(
    grouping: Grouping,
    comms: dict[str, Collectives],
    stage: int,
    layout: Layout | None,
    policy: LayoutPolicy | None,
    owners: list[bool] | None = None,
) -> Layout:
    """The given layout, checked against the parameters and shard groups, or a new one.
    ``owners[g]``: layout group ``g`` is an owner group (its optimizer updates whole
    matrices; default none). Not collective.

    Raises:
        ValueError: ``layout`` is for another world size, parameters or shard groups; the
            expert process group's size does not divide the world size; expert parameters
            stack different numbers of local experts; or the layout cannot be built.
    """
    world_size = comms[DENSE_SHARD_GROUP].world_size
    inputs = _layout_inputs(grouping, comms, world_size, owners or [False] * len(grouping.layout_specs))
    if layout is not None:
        if layout.world_size != world_size:
            raise ValueError(
                f"the layout is for world size {layout.world_size} but the process group has {world_size} ranks"
            )
        if layout.specs() != grouping.layout_specs:
            raise ValueError("the layout's parameters differ from the model's (names, shapes, dtypes or grouping)")
        if layout.group_specs() != build_layout(inputs, world_size, layout.policy).group_specs():
            raise ValueError(
                "the layout's shard groups differ from the param groups' (expert flags, expert parallelism, or owner "
                "groups for an optimizer of whole matrices)"
            )
        return layout
    if policy is None:
        policy = LayoutPolicy.native(bucket_numel=DEFAULT_STAGE2_BUCKET_NUMEL if stage == 2 else None)
    return build_layout(inputs, world_size, policy)


def _layout_inputs(
    grouping: Grouping, comms: dict[str, Collectives], world_size: int, owners: list[bool]
) -> list[list | GroupSpec]:
    """The layout's input: dense groups as plain lists (owner groups as GroupSpecs), expert
    groups as GroupSpecs over the expert-DP group, with their param group's placement
    (default contiguous) and stacks."""
    dense = [GroupSpec(tuple(specs), owner=True) if owner else specs for specs, owner in zip(grouping.layout_specs, owners)]
    if EXPERT_SHARD_GROUP not in comms:
        return dense
    expert_dp_size = comms[EXPERT_SHARD_GROUP].world_size
    if world_size % expert_dp_size:
        raise ValueError(
            f"the expert process group has {expert_dp_size} ranks, which does not divide the world size {world_size}"
        )
    mesh = ExpertMesh(world_size, world_size // expert_dp_size)
    inputs: list[list | GroupSpec] = []
    for index, specs in enumerate(grouping.layout_specs):
        if not grouping.is_expert(index):
            inputs.append(dense[index])
            continue
        local = {spec.shape[0] if spec.shape else 0 for spec in specs}
        if len(local) != 1 or 0 in local:
            raise ValueError(
                f"expert parameters {[spec.name for spec in specs]} must stack the same number "
                f"(>= 1) of local experts in their first dimension, got shapes {[list(s.shape) for s in specs]}"
            )
        user = grouping.user_group_of(index)
        try:
            group = mesh.expert_group(
                specs,
                local.pop() * mesh.ep_size,
                expert_map=user.expert_map,
                stacks=grouping.stacks(index),
                owner=owners[index],
            )
        except ValueError as err:
            raise ValueError(f"param group {grouping.layout_user_group[index]}: {err}") from None
        inputs.append(group)
    return inputs


def resolve_reduce_dtypes(layout: Layout, reduce_dtype: torch.dtype | None) -> list[torch.dtype]:
    """Each layout group's reduction dtype; float32 means today's fp32 reduction.

    Raises:
        ValueError: ``reduce_dtype`` is not None, float32, bfloat16 or float16.
    """
    if reduce_dtype not in (None, *REDUCE_DTYPES):
        allowed = ", ".join(map(str, REDUCE_DTYPES))
        raise ValueError(f"reduce_dtype must be None or one of {allowed}, got {reduce_dtype!r}")
    if layout.world_size == 1:
        return [torch.float32] * len(layout.groups)
    return [reduce_dtype or torch_dtype(group.dtype) for group in layout.groups]


def check_same_layout_on_every_rank(layout: Layout, comms: dict[str, Collectives]) -> str:
    """Collective over the dense group (all W ranks; one all-gather): every rank has rank 0's
    layout, and sits in its expert-DP group where the layout's expert mesh puts it
    (checkpoints name a rank's experts by that mesh). Returns the layout's digest.

    Raises:
        ValueError: on every rank, when some rank's layout differs from rank 0's or a rank
            is misplaced in its expert-DP group.
    """
    digest = hashlib.sha256(layout.to_json().encode()).hexdigest()
    reports = comms[DENSE_SHARD_GROUP].all_gather_object((digest, _expert_mesh_problem(layout, comms)))
    differing = [rank for rank, (other, _) in enumerate(reports) if other != reports[0][0]]
    if differing:
        raise ValueError(f"ranks {differing} have other parameters or param groups than rank 0 (their layouts differ)")
    misplaced = [f"rank {rank}: {problem}" for rank, (_, problem) in enumerate(reports) if problem]
    if misplaced:
        raise ValueError(
            f"the expert process group is not the expert mesh's column ({misplaced[0]}); "
            "create it with zeroshard.moe.new_expert_groups"
        )
    return digest


def _expert_mesh_problem(layout: Layout, comms: dict[str, Collectives]) -> str | None:
    rank = comms[DENSE_SHARD_GROUP].rank
    for group in layout.groups:
        rank_in_group = comms[group.shard_group].rank
        if group.is_expert_group and rank_in_group != shard_rank(group, rank):
            return f"it is rank {rank_in_group} of its expert-DP group, the mesh's rank {shard_rank(group, rank)}"
    return None


def initial_values(
    layout: Layout, grouping: Grouping, comms: dict[str, Collectives], device: torch.device, sync: bool
) -> list[torch.Tensor]:
    """Each group's parameters in fp32 at their flat offsets; with ``sync``, rank 0's values
    (expert groups: those of the first rank holding the same experts). Collective if
    ``sync``: a broadcast per group over its shard group."""
    values = []
    for group, params in zip(layout.groups, grouping.layout_params):
        flat = torch.zeros(group.numel, dtype=torch.float32, device=device)
        for slot, param in zip(group.params, params):
            flat[slot.offset : slot.end].copy_(param.detach().reshape(-1))
        if sync:
            comms[group.shard_group].broadcast_(flat, src=0)
        values.append(flat)
    return values


def master_partition(
    values: torch.Tensor, group: GroupLayout, rank_in_group: int, device: torch.device
) -> nn.Parameter:
    """This rank's fp32 master partition of ``group``, copied out of its flat ``values``."""
    return nn.Parameter(gather_partition(values, group, rank_in_group).float().to(device, copy=True))


def gather_partition(flat: torch.Tensor, group: GroupLayout, rank_in_group: int) -> torch.Tensor:
    """A new tensor of ``partition_numel`` elements: this rank's runs of the flat buffer
    ``flat`` one after the other, zeros after them (an owner group's shorter runs)."""
    partition = flat.new_zeros(group.partition_numel)
    position = 0
    for begin, end in group.partition_ranges(rank_in_group):
        partition[position : position + end - begin] = flat[begin:end]
        position += end - begin
    return partition


def owner_groups(grouping: Grouping, optimizer_class: type, defaults: dict[str, Any]) -> list[bool]:
    """Whether each layout group is an owner group (its optimizer updates whole matrices,
    ``matrices.needs_whole_matrices``), after checking that its parameters are matrices and
    that every optimizer class takes its options. Not collective.

    Raises:
        ValueError: as :func:`check_matrices` and :func:`check_optimizer_options`.
    """
    owners = [
        needs_whole_matrices(grouping.optimizer_of(index, optimizer_class)) for index in range(len(grouping.layout_specs))
    ]
    check_matrices(grouping, owners)
    if any(owners) or len(set(optimizer_classes(grouping, optimizer_class))) > 1:
        check_optimizer_options(grouping, optimizer_class, defaults)
    return owners


def check_matrices(grouping: Grouping, owners: list[bool]) -> None:
    """Every parameter of an owner group is a matrix (or a stack of them). Not collective.

    Raises:
        ValueError: naming the param group and the parameter.
    """
    for index, specs in enumerate(grouping.layout_specs):
        if not owners[index]:
            continue
        for spec in specs:
            problem = matrix_problem(spec, grouping.is_expert(index))
            if problem:
                raise ValueError(
                    f"param group {grouping.layout_user_group[index]}: {problem}; give such parameters a param group "
                    "with an elementwise optimizer (\"optimizer\": torch.optim.AdamW)"
                )


def optimizer_classes(grouping: Grouping, optimizer_class: type) -> list[type]:
    """The optimizer class of each param group, in order (its own, else ``optimizer_class``)."""
    return [user.optimizer_class or optimizer_class for user in grouping.user_groups]


def check_optimizer_options(grouping: Grouping, optimizer_class: type, defaults: dict[str, Any]) -> None:
    """Build each optimizer class over stand-in matrices with its param groups' options and
    step it once on zero gradients, so options it refuses, when built or only when it steps
    (``torch.optim.Muon``'s ``ns_steps`` and ``ns_coefficients``), are found on every rank
    before anything changes, not at a step on the ranks that own a matrix. Not collective.

    Raises:
        ValueError: naming the class and what it refused; or ``defaults`` are given for
            ``optimizer_class`` while every param group names another class.
    """
    by_class: dict[type, list[dict[str, Any]]] = {}
    for user, cls in zip(grouping.user_groups, optimizer_classes(grouping, optimizer_class)):
        stand_in = torch.zeros(2, 2, requires_grad=True)
        stand_in.grad = torch.zeros_like(stand_in)
        by_class.setdefault(cls, []).append({**user.options, "params": [stand_in]})
    if defaults and optimizer_class not in by_class:
        raise ValueError(
            f"options {sorted(defaults)} are for {class_name(optimizer_class)}, but every param group names its own optimizer"
        )
    for cls, groups in by_class.items():
        try:
            cls(groups, **(defaults if cls is optimizer_class else {})).step()
        except (ValueError, TypeError) as err:
            raise ValueError(f"{class_name(cls)} refuses its options: {err}") from None
