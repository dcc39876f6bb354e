"""One rank's :class:`ShardedState` for any new layout, from a universal checkpoint or any ShardSource.

The new layout decides everything: world size, policy, bucket size, grouping. For each
fragment of the new rank's partition the same elements are read from the input: from a
universal checkpoint by range reads of the parameter's tensors, from a ShardSource by the
old-rank runs that :func:`plan_reads` computes. A rank whose partition of a group holds no
real element (only padding) gets zero tensors with the group's state names and scalars,
like every other rank. Optimizer hyperparameters and scalars follow the parameters: a new
layout group takes those of the param group its parameters belong to.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any, Mapping

import numpy as np
import torch

from ..layout import Layout
from ..state import ParamGroupState, ShardedState
from .compat import Mismatch, compare_params, compare_shapes
from .dtypes import arrays_to_torch, cast, to_torch, torch_dtype
from .reshard import plan_reads
from .source import ShardSource
from .universal_read import UniversalCheckpoint, open_universal


def load_universal(
    path: str | os.PathLike[str] | UniversalCheckpoint,
    layout: Layout,
    rank: int,
    *,
    load_optimizer_states: bool = True,
    load_module_only: bool = False,
    strict: bool = True,
) -> ShardedState:
    """This rank's state under ``layout`` (the new run's), read from a universal checkpoint.

    The fp32 master partition is read exactly; ``model_state`` is the full module
    state_dict: each trained parameter's fp32 master cast to its dtype in ``layout`` (a run
    may change precision), plus buffers, frozen parameters and tied names. So every rank
    reads all fp32 masters once, and of the optimizer states only its own fragments.

    ``load_optimizer_states=False`` leaves optimizer state empty; ``load_module_only`` also
    drops hyperparameters, the optimizer class and ``extra``. ``strict=False`` loads the
    parameters both sides have with the same shape and warns about the rest.
    """
    ckpt = open_universal(path)
    manifest = ckpt.manifest
    _check_rank(layout, rank)
    saved_shapes = {name: param.shape for name, param in manifest.params.items()}
    loadable = _loadable(_compare_shapes(saved_shapes, layout), layout, strict, str(ckpt.directory))
    full = load_optimizer_states and not load_module_only
    group_of_param = {name: param.group for name, param in manifest.params.items()}
    param_groups, owners = _map_param_groups(layout, group_of_param, [g.hyperparameters for g in manifest.param_groups], loadable)
    fp32, states, scalars = [], [], []
    model_state: dict[str, torch.Tensor] = {}
    for group in layout.groups:
        fragments = _fragments_by_param(layout, rank, group.index, loadable)
        partition = np.zeros(group.partition_numel, dtype=np.float32)
        for slot in group.params:
            if slot.name not in loadable:
                continue
            master = ckpt.read_param(slot.name, "fp32")
            model_state[slot.name] = to_torch(cast(master, group.dtype).reshape(slot.spec.shape))
            for fragment in fragments.get(slot.name, ()):
                end = fragment.param_start + fragment.length
                partition[fragment.partition_start : fragment.partition_start + fragment.length] = master[fragment.param_start : end]
            del master
        fp32.append(to_torch(partition))
        names = _state_names(group.index, [manifest.params[s.name].states for s in group.params if s.name in loadable])
        group_states: dict[str, torch.Tensor] = {}
        for name in names if full else ():
            tensor = np.zeros(group.partition_numel, dtype=np.float32)
            for param_fragments in fragments.values():
                for f in param_fragments:
                    tensor[f.partition_start : f.partition_start + f.length] = ckpt.read_param(
                        f.name, name, f.param_start, f.param_start + f.length
                    )
            group_states[name] = to_torch(tensor)
        states.append(group_states)
        scalars.append(_torch_scalars(ckpt.scalars(owners[group.index])) if full and owners[group.index] is not None else {})
    for name in manifest.model_entries:
        model_state[name] = to_torch(ckpt.model_tensor(name))
    _add_empty_params(model_state, layout, loadable)
    _add_aliases(model_state, manifest.aliases)
    return _state(
        layout, rank, fp32, states, scalars, param_groups, manifest.optimizer_class, model_state, manifest.extra,
        module_only=load_module_only,
    )


def load_from_source(
    source: ShardSource,
    layout: Layout,
    rank: int,
    *,
    load_optimizer_states: bool = True,
    load_module_only: bool = False,
    strict: bool = True,
) -> ShardedState:
    """This rank's state under ``layout``, read range by range from any ShardSource (a
    DeepSpeed checkpoint, a native one). Options as for :func:`load_universal`; here the
    trained parameters' weights in ``model_state`` are the source's own low-precision ones,
    and a parameter's dtype must not change."""
    info = source.info
    _check_rank(layout, rank)
    loadable = _loadable(compare_params(info.layout, layout), layout, strict, str(source.path), dtype_fatal=True)
    full = load_optimizer_states and not load_module_only
    old_owner = {g: index for index, pg in enumerate(info.param_groups) for g in pg.layout_groups}
    group_of_param = {slot.name: old_owner.get(g.index, -1) for g in info.layout.groups for slot in g.params}
    # Scalars are read per old layout group below: the first one a new group draws from
    # belongs to the param group its parameters belong to.
    param_groups, _ = _map_param_groups(layout, group_of_param, [g.hyperparameters for g in info.param_groups], loadable)
    fp32, states, scalars = [], [], []
    for plan in plan_reads(info.layout, layout, rank, loadable):
        numel = layout.groups[plan.group].partition_numel

        def fill(key: str) -> torch.Tensor:
            tensor = np.zeros(numel, dtype=np.float32)
            for copy in plan.copies:
                end = copy.source_start + copy.length
                tensor[copy.dest_start : copy.dest_start + copy.length] = source.read(
                    copy.source_rank, copy.source_group, key, copy.source_start, end
                )
            return to_torch(tensor)

        fp32.append(fill("fp32"))
        names = _state_names(plan.group, [tuple(info.state_keys[g]) for g in plan.source_groups])
        states.append({name: fill(name) for name in names} if full else {})
        group_scalars = source.scalars(plan.source_groups[0]) if full and plan.source_groups else {}
        scalars.append(_torch_scalars(group_scalars))
    model_state = {name: to_torch(source.model_tensor(name)) for name in layout.param_names if name in loadable}
    model_state.update({entry.name: to_torch(source.model_tensor(entry.name)) for entry in info.model_entries})
    _add_empty_params(model_state, layout, loadable)
    _add_aliases(model_state, info.aliases)
    return _state(
        layout, rank, fp32, states, scalars, param_groups, info.optimizer_class, model_state, info.extra,
        module_only=load_module_only,
    )


def _check_rank(layout: Layout, rank: int) -> None:
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank {rank} is outside world size {layout.world_size}")


def _compare_shapes(saved: Mapping[str, tuple[int, ...]], layout: Layout) -> Mismatch:
    return compare_shapes(saved, {slot.name: slot.spec.shape for group in layout.groups for slot in group.params})


def _loadable(mismatch: Mismatch, layout: Layout, strict: bool, where: str, dtype_fatal: bool = False) -> set[str]:
    """Names of the run's parameters to read; raises (strict) or warns about differences.

    A run's parameter with no elements that the checkpoint lacks is no difference: there is
    nothing to load (DeepSpeed leaves such parameters out of its buffers). It gets an
    empty weight from :func:`_add_empty_params` and is not read."""
    empty = {slot.name for group in layout.groups for slot in group.params if slot.numel == 0}
    absent_empty = set(mismatch.missing) & empty
    mismatch = dataclasses.replace(mismatch, missing=tuple(n for n in mismatch.missing if n not in absent_empty))
    label = f"{where}: checkpoint does not match the run's parameters"
    if mismatch and (strict or (dtype_fatal and mismatch.retyped)):
        raise ValueError(mismatch.describe(label))
    if mismatch:
        warnings.warn(mismatch.describe(label) + "; loading the rest (strict=False)", stacklevel=3)
    return set(layout.param_names) - mismatch.skipped() - absent_empty


def _torch_scalars(scalars: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Scalars as the engine keeps them: tensors (a plain number becomes a 0-d tensor)."""
    return {name: to_torch(v) if isinstance(v, np.ndarray) else torch.tensor(v) for name, v in scalars.items()}


def _add_empty_params(model_state: dict[str, torch.Tensor], layout: Layout, loadable: set[str]) -> None:
    for group in layout.groups:
        for slot in group.params:
            if slot.numel == 0 and slot.name not in loadable:
                model_state.setdefault(slot.name, torch.empty(slot.spec.shape, dtype=torch_dtype(group.dtype)))


def _fragments_by_param(layout: Layout, rank: int, group: int, loadable: set[str]) -> dict[str, list[Any]]:
    found: dict[str, list[Any]] = {}
    for fragment in layout.groups[group].fragments(rank):
        if fragment.name in loadable:
            found.setdefault(fragment.name, []).append(fragment)
    return found


def _state_names(group: int, per_param: list[tuple[str, ...]]) -> tuple[str, ...]:
    """The optimizer states of a new group: every parameter in it must have the same ones."""
    names = per_param[0] if per_param else ()
    for other in per_param[1:]:
        if set(other) != set(names):
            raise ValueError(
                f"layout group {group} mixes parameters with optimizer states {sorted(names)} and {sorted(other)}"
            )
    return tuple(names)


def _map_param_groups(
    layout: Layout, group_of_param: Mapping[str, int], hyperparameters: list[dict[str, Any]], loadable: set[str]
) -> tuple[list[ParamGroupState], list[int | None]]:
    """The saved param groups that hold the new layout's groups, each listing its new layout
    groups, and the saved param group of each new layout group (None: nothing loaded)."""
    owners: list[int | None] = []
    for group in layout.groups:
        found = {group_of_param[slot.name] for slot in group.params if slot.name in loadable}
        if len(found) > 1 or -1 in found:
            raise ValueError(
                f"layout group {group.index} holds parameters of saved param groups {sorted(found)}; "
                "group the run's parameters as the checkpoint does"
            )
        owners.append(found.pop() if found else None)
    states = [
        ParamGroupState(dict(hyper), [g for g, owner in enumerate(owners) if owner == index])
        for index, hyper in enumerate(hyperparameters)
    ]
    return [state for state in states if state.layout_groups], owners


def _add_aliases(model_state: dict[str, torch.Tensor], aliases: Mapping[str, str]) -> None:
    for alias, target in aliases.items():
        if target in model_state:
            model_state[alias] = model_state[target]


def _state(
    layout: Layout,
    rank: int,
    fp32: list[torch.Tensor],
    states: list[dict[str, torch.Tensor]],
    scalars: list[dict[str, torch.Tensor]],
    param_groups: list[ParamGroupState],
    optimizer_class: str,
    model_state: dict[str, torch.Tensor],
    extra: dict[str, Any],
    *,
    module_only: bool,
) -> ShardedState:
    return ShardedState(
        layout=layout,
        rank=rank,
        fp32_partitions=fp32,
        optimizer_states=states,
        optimizer_scalars=scalars,
        param_groups=[] if module_only else [dataclasses.replace(g, hyperparameters=arrays_to_torch(g.hyperparameters)) for g in param_groups],
        optimizer_class="" if module_only else optimizer_class,
        model_state=model_state,
        extra={} if module_only else arrays_to_torch(dict(extra)),
    )

