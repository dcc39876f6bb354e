"""From a model and torch-style param groups to layout groups.

A torch param group may mix dtypes; a flat buffer holds one. Each user group therefore
becomes one layout group per dtype, in first-seen order. Frozen parameters stay out; a
parameter shared by two modules (or listed twice) is counted once, under its first name.

A dict group with ``"expert": True`` holds expert parameters (stacked per-rank expert weights,
different on each expert-parallel rank); its layout groups are partitioned over the
expert-data-parallel group instead of all ranks. The flag is not passed to the optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn

from ..layout import ParamSpec


@dataclass
class UserGroup:
    """A torch-style param group after resolution."""

    options: dict[str, Any]  # everything but "params" and "expert"
    expert: bool = False
    layout_groups: list[int] = field(default_factory=list)


@dataclass
class Grouping:
    """Which parameters go to which flat buffer."""

    user_groups: list[UserGroup]
    layout_specs: list[list[ParamSpec]]  # per layout group, in buffer order
    layout_params: list[list[nn.Parameter]]  # the same, as parameters
    layout_user_group: list[int]  # owning user group of each layout group

    def is_expert(self, layout_group: int) -> bool:
        return self.user_groups[self.layout_user_group[layout_group]].expert


def resolve_groups(
    model: nn.Module,
    param_groups: Iterable[Any] | None,
    param_dtype: torch.dtype | None,
) -> Grouping:
    names = _first_names(model)
    groups = _normalise(model, param_groups)
    seen: set[int] = set()
    result = Grouping([], [], [], [])
    for group_index, group in enumerate(groups):
        params = [p for p in group["params"] if p.requires_grad]
        if not params:
            raise ValueError(f"param group {group_index} has no trainable parameters")
        expert = group.get("expert", False)
        if not isinstance(expert, bool):
            raise ValueError(f"param group {group_index}: 'expert' must be True or False, got {expert!r}")
        user = UserGroup({k: v for k, v in group.items() if k not in ("params", "expert")}, expert)
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
        result.user_groups.append(user)
    _check_one_device(result.layout_params)
    return result


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
