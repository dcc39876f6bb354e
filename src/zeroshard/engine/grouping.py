"""From a model and torch-style param groups to layout groups.

A torch param group may mix dtypes; a flat buffer holds one. Each user group therefore
becomes one layout group per dtype, in first-seen order. Frozen parameters stay out; a
parameter shared by two modules (or listed twice) is counted once, under its first name.

A dict group with ``"expert": True`` holds expert parameters (stacked per-rank expert weights,
different on each expert-parallel rank); its layout groups are partitioned over the
expert-data-parallel group instead of all ranks. Two optional keys describe them
(``zeroshard.moe.moe_param_groups`` fills both): ``"expert_map"``, the placement of global
experts on EP ranks (default: contiguous), and ``"expert_stacks"``, parameter name ->
:class:`~zeroshard.layout.ExpertStack` (default: ``UNDECLARED_STACK``). None of the three
keys is passed to the optimizer.

A dict group may name its own torch optimizer class under ``"optimizer"`` (say
``torch.optim.AdamW`` beside a ``torch.optim.Muon`` engine); it is not passed on either.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn

from ..layout import UNDECLARED_STACK, ExpertStack, ParamSpec, check_expert_map

EXPERT_KEYS = ("expert", "expert_map", "expert_stacks")
OPTIMIZER_KEY = "optimizer"  # a group's own torch optimizer class


@dataclass
class UserGroup:
    """A torch-style param group after resolution."""

    options: dict[str, Any]  # everything but "params", the EXPERT_KEYS and OPTIMIZER_KEY
    expert: bool = False
    optimizer_class: type | None = None  # the group's own optimizer class; None: the engine's
    layout_groups: list[int] = field(default_factory=list)
    expert_map: tuple[tuple[int, ...], ...] | None = None  # None: contiguous
    expert_stacks: dict[str, ExpertStack] = field(default_factory=dict)  # by parameter name


@dataclass
class Grouping:
    """Which parameters go to which flat buffer."""

    user_groups: list[UserGroup]
    layout_specs: list[list[ParamSpec]]  # per layout group, in buffer order
    layout_params: list[list[nn.Parameter]]  # the same, as parameters
    layout_user_group: list[int]  # owning user group of each layout group

    def is_expert(self, layout_group: int) -> bool:
        """Whether layout group ``layout_group`` comes from an ``"expert": True`` param group."""
        return self.user_groups[self.layout_user_group[layout_group]].expert

    def user_group_of(self, layout_group: int) -> UserGroup:
        """The (resolved) param group layout group ``layout_group`` comes from."""
        return self.user_groups[self.layout_user_group[layout_group]]

    def optimizer_of(self, layout_group: int, default: type) -> type:
        """The optimizer class that trains layout group ``layout_group`` (its param group's
        own, else ``default``)."""
        return self.user_group_of(layout_group).optimizer_class or default

    def stacks(self, layout_group: int) -> tuple[ExpertStack, ...]:
        """The stack of each parameter of an expert layout group (UNDECLARED_STACK where
        its param group does not describe it)."""
        described = self.user_group_of(layout_group).expert_stacks
        return tuple(described.get(spec.name, UNDECLARED_STACK) for spec in self.layout_specs[layout_group])


def resolve_groups(
    model: nn.Module,
    param_groups: Iterable[Any] | None,
    param_dtype: torch.dtype | None,
) -> Grouping:
    """Split ``model``'s trainable parameters by ``param_groups`` (None: one group of all of
    them) into layout groups, one per param group and dtype (``param_dtype``, if given, for
    every floating-point parameter). Not collective.

    Raises:
        ValueError: naming the param group or parameter: ``param_groups`` is empty, a dict
            has no ``"params"``, a group has no trainable parameter or only ones of earlier
            groups, a parameter is not in the model, not contiguous or not floating-point,
            the parameters are on several devices, or the expert keys are malformed.
    """
    names = _first_names(model)
    groups = _normalise(model, param_groups)
    seen: set[int] = set()
    result = Grouping([], [], [], [])
    for group_index, group in enumerate(groups):
        params = [p for p in group["params"] if p.requires_grad]
        if not params:
            raise ValueError(f"param group {group_index} has no trainable parameters")
        user = _user_group(group_index, group)
        by_dtype: dict[torch.dtype, int] = {}
        for param in params:
            if id(param) in seen:
                continue
            seen.add(id(param))
            if id(param) not in names:
                raise ValueError(f"param group {group_index} holds a parameter that is not in the model")
            _check_param(names[id(param)], param)
            dtype = param_dtype if (param_dtype is not None and param.is_floating_point()) else param.dtype
            if dtype not in by_dtype:
                by_dtype[dtype] = len(result.layout_specs)
                user.layout_groups.append(by_dtype[dtype])
                result.layout_specs.append([])
                result.layout_params.append([])
                result.layout_user_group.append(group_index)
            layout_group = by_dtype[dtype]
            result.layout_specs[layout_group].append(ParamSpec.of(names[id(param)], tuple(param.shape), dtype))
            result.layout_params[layout_group].append(param)
        if not user.layout_groups:
            raise ValueError(f"param group {group_index} has only parameters already in an earlier group")
        _check_described(group_index, user, result)
        result.user_groups.append(user)
    _check_one_device(result.layout_params)
    return result


def _user_group(index: int, group: dict[str, Any]) -> UserGroup:
    """The group's options, its expert flag and, for an expert group, its placement and stacks."""
    expert = group.get("expert", False)
    if not isinstance(expert, bool):
        raise ValueError(f"param group {index}: 'expert' must be True or False, got {expert!r}")
    options = {k: v for k, v in group.items() if k not in ("params", OPTIMIZER_KEY, *EXPERT_KEYS)}
    optimizer_class = group.get(OPTIMIZER_KEY)
    if optimizer_class is not None and not (
        isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)
    ):
        raise ValueError(
            f"param group {index}: {OPTIMIZER_KEY!r} must be a torch.optim.Optimizer class, got {type(optimizer_class).__name__}"
        )
    placement, stacks = group.get("expert_map"), group.get("expert_stacks") or {}
    if not expert and (placement is not None or stacks):
        raise ValueError(f"param group {index}: 'expert_map' and 'expert_stacks' describe expert groups only")
    if placement is not None:
        try:
            placement = check_expert_map(placement)
        except ValueError as err:
            raise ValueError(f"param group {index}: {err}") from None
    if not isinstance(stacks, dict) or not all(isinstance(v, ExpertStack) for v in stacks.values()):
        raise ValueError(f"param group {index}: 'expert_stacks' must map parameter names to ExpertStack")
    return UserGroup(options, expert, optimizer_class, expert_map=placement, expert_stacks=dict(stacks))


def _check_described(index: int, user: UserGroup, result: Grouping) -> None:
    members = {spec.name for g in user.layout_groups for spec in result.layout_specs[g]}
    strangers = sorted(set(user.expert_stacks) - members)
    if strangers:
        raise ValueError(f"param group {index}: 'expert_stacks' names parameters not in the group: {strangers[:3]}")


def _first_names(model: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
    return names


def _normalise(model: nn.Module, param_groups: Iterable[Any] | None) -> list[dict[str, Any]]:
    if param_groups is None:
        return [{"params": list(model.parameters())}]
    groups = list(param_groups)
    if not groups:
        raise ValueError("param_groups is empty")
    if not isinstance(groups[0], dict):
        return [{"params": groups}]
    normalised = []
    for index, group in enumerate(groups):
        if "params" not in group:
            raise ValueError(f"param group {index} has no 'params' entry")
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        normalised.append({**group, "params": params})
    return normalised


def _check_param(name: str, param: nn.Parameter) -> None:
    if not param.is_contiguous():
        raise ValueError(f"parameter {name!r} is not contiguous (strides {param.stride()}); call .contiguous() first")
    if not param.is_floating_point():
        raise ValueError(f"parameter {name!r} has dtype {param.dtype}; only floating-point parameters can be trained")


def _check_one_device(layout_params: list[list[nn.Parameter]]) -> None:
    devices = {param.device for group in layout_params for param in group}
    if len(devices) > 1:
        raise ValueError(f"parameters are on several devices ({', '.join(sorted(map(str, devices)))}); move the model to one")
