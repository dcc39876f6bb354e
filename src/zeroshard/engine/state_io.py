"""Export an engine rank's state as a ShardedState, and load one back.

Loading keeps the engine's invariant: afterwards the flat buffers, the model's parameters
(views of them) and the fp32 master partitions agree, whatever kind of load it was, so
the first step after a load starts from the loaded values. Everything is validated before
anything changes.
"""

from __future__ import annotations

from typing import Any, Collection, Iterable

import torch

from ..io.host_memory import release_later
from ..state import ParamGroupState, ShardedState, model_config_files
from .multi import MultiOptimizer, class_name
from .parts import EngineParts
from .setup import gather_partition


def optimizer_class_name(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer's class as ``module.QualName``, as shards and checkpoints record it; for
    a ``MultiOptimizer`` its classes in the order the param groups first name them, joined
    by ``+`` (``torch.optim._muon.Muon+torch.optim.adamw.AdamW``)."""
    if isinstance(optimizer, MultiOptimizer):
        return "+".join(dict.fromkeys(optimizer.classes))
    return class_name(type(optimizer))


def group_classes(optimizer: torch.optim.Optimizer) -> list[str]:
    """The optimizer class of each param group, in order."""
    if isinstance(optimizer, MultiOptimizer):
        return optimizer.classes
    return [class_name(type(optimizer))] * len(optimizer.param_groups)


def partition_state(engine: EngineParts, group_index: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(partition-shaped optimizer states, the other states) of layout group
    ``group_index`` on this rank, live tensors: the wrapped optimizer's over the group's
    master partition, or an owner group's flat states (``matrices.MatrixStates``)."""
    if engine.matrices.views[group_index] is not None:
        return engine.matrices.partition_state(group_index)
    master = engine.masters[group_index]
    partitioned, scalar = {}, {}
    for key, value in engine.optimizer.state.get(master, {}).items():
        tensor = value.detach() if torch.is_tensor(value) else torch.tensor(value)
        is_partition = tensor.dim() == 1 and tensor.numel() == master.numel()
        (partitioned if is_partition else scalar)[key] = tensor
    return partitioned, scalar


def state_views(engine: EngineParts) -> ShardedState:
    """Not collective. This rank's share as views of the live tensors (on the engine's
    devices), no copies.

    Valid until the engine changes its state (the next step or load): copy it before that,
    as :func:`export_state` and the Checkpointer's host snapshot do.
    """
    states, scalars = [], []
    for group_index in range(len(engine.masters)):
        partitioned, scalar = partition_state(engine, group_index)
        states.append(dict(partitioned))
        scalars.append(dict(scalar))
    groups = [
        ParamGroupState(
            hyperparameters={k: v for k, v in group.items() if k != "params"},
            layout_groups=list(user.layout_groups),
            optimizer=cls,
        )
        for group, user, cls in zip(
            engine.optimizer.param_groups, engine.grouping.user_groups, group_classes(engine.optimizer)
        )
    ]
    return ShardedState(
        layout=engine.layout,
        rank=engine.rank,
        fp32_partitions=[m.detach() for m in engine.masters],
        optimizer_states=states,
        optimizer_scalars=scalars,
        param_groups=groups,
        optimizer_class=optimizer_class_name(engine.optimizer),
        model_state=engine.model.state_dict(),
        extra={"global_steps": engine.global_steps, "loss_scaler": engine.scaler.state_dict()},
        model_configs=model_config_files(engine.model),
    )


def export_state(engine: EngineParts) -> ShardedState:
    """Not collective. A CPU copy of this rank's share: masters, optimizer state, model, counters."""
    views = state_views(engine)
    views.fp32_partitions = [t.cpu().clone() for t in views.fp32_partitions]
    views.optimizer_states = [{k: t.cpu().clone() for k, t in d.items()} for d in views.optimizer_states]
    views.optimizer_scalars = [{k: t.cpu().clone() for k, t in d.items()} for d in views.optimizer_scalars]
    views.model_state = _cpu_copy_keeping_ties(views.model_state)
    return views


def _cpu_copy_keeping_ties(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU copies of a state_dict in which names that shared a tensor (tied weights) still do."""
    copies: dict[tuple, torch.Tensor] = {}
    result = {}
    for name, tensor in state.items():
        identity = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
        if identity not in copies:
            copies[identity] = tensor.detach().cpu().clone()
        result[name] = copies[identity]
    return result


def import_state(
    engine: EngineParts,
    state: ShardedState,
    *,
    load_optimizer_states: bool = True,
    load_module_only: bool = False,
    strict: bool = True,
    take: bool = False,
    weights_from_masters: bool = False,
    params_gathered: bool = False,
    checked: bool = False,
) -> None:
    """Collective: every rank of the engine's process group calls it with its own state.
    Load ``state`` (already laid out for this engine) into the engine.

    ``take=True`` hands ``state`` over: the optimizer keeps its state tensors, and the
    masters their fp32 partitions, as they are instead of copies (the caller must not use
    them afterwards; a checkpoint load that built the state for this call does so).

    Every rank validates its state first and the ranks agree on the outcome: either every
    rank loads, or every rank raises the same error and nothing changes.

    * full: model weights, masters, optimizer state, hyperparameters, counters;
    * ``load_optimizer_states=False``: model weights; masters rebuilt from them; fresh
      optimizer state;
    * ``load_module_only=True``: model weights only (masters rebuilt from them).

    ``weights_from_masters=True``: ``state.model_state`` holds no trained parameter (nor a
    name tied to one); the parameters are ``state.fp32_partitions`` cast and all-gathered,
    for every kind of load (a checkpoint load that read no weight does so).
    ``params_gathered=True`` (with it): the parameters already are those partitions cast and
    gathered (``start_params_gather`` while the load read), so none is gathered again.
    ``checked=True``: every rank ran :func:`check_import` on its state (or on what it becomes:
    the same names and shapes) with these options, and the ranks agreed that none raised (a
    checkpoint load, whose agreement carries it), so this agrees on nothing again.

    Raises:
        ValueError: on every rank alike, naming the failing rank, when any rank's state has
            another layout, rank, optimizer class, param group count or partition shapes, or
            a model state that does not match the model (``strict``: names too); nothing
            changes then.
        CollectiveCallError: the other ranks did not call it.
    """
    full = load_optimizer_states and not load_module_only
    if not checked:  # every rank loads, or none
        options = f"load_optimizer_states={load_optimizer_states}, load_module_only={load_module_only}, strict={strict}"
        call = f"import_state({options}, weights_from_masters={weights_from_masters}, params_gathered={params_gathered})"
        kind = dict(load_optimizer_states=load_optimizer_states, load_module_only=load_module_only, strict=strict)
        engine.comm.checked(call, lambda: check_import(engine, state, **kind, weights_from_masters=weights_from_masters))
    with torch.no_grad():
        engine.model.load_state_dict(_cast_like(engine.model.state_dict(), state.model_state), strict=strict and not weights_from_masters)
    engine.reducer.zero_grad()
    # What the load replaces is freed on a thread: the caller need not wait for the unmapping.
    replaced = _host_tensors(master.data for master in engine.masters) if take else []
    if not load_module_only:
        replaced += _host_tensors(t for per_param in engine.optimizer.state.values() for t in per_param.values())
    try:
        if not full:
            if weights_from_masters:
                _set_masters(engine, state, take)
                if not params_gathered:
                    engine.sync_params_from_masters()
            else:
                _rebuild_masters_from_params(engine)
            if not load_module_only:
                engine.optimizer.state.clear()
                engine.matrices.clear()
            return
        _set_masters(engine, state, take)
        engine.optimizer.load_state_dict(_torch_optimizer_state(engine, state, take))
        engine.matrices.adopt(engine.optimizer.state)
        engine.matrices.agreed = False
        engine.matrices.agree(engine.comm, engine.masters[0].device if engine.masters else engine.device)
        engine.global_steps = int(state.extra.get("global_steps", 0))
        engine.scaler.load_state_dict(state.extra.get("loss_scaler", engine.scaler.state_dict()))
        if not (weights_from_masters and params_gathered):
            engine.sync_params_from_masters()
    finally:
        release_later(replaced)


def check_import(
    engine: EngineParts,
    state: ShardedState,
    *,
    load_optimizer_states: bool = True,
    load_module_only: bool = False,
    strict: bool = True,
    weights_from_masters: bool = False,
) -> None:
    """Not collective: raise the ValueError :func:`import_state` would refuse this rank's
    ``state`` with (another layout, rank or optimizer, partitions or a model state of other
    shapes, with ``strict`` other names); its model state is read for names and shapes only."""
    full = load_optimizer_states and not load_module_only
    rebuilt = _rebuilt_names(engine) if weights_from_masters else set()
    _validate(engine, state, full, strict, rebuilt)


def _host_tensors(tensors: Iterable[Any]) -> list[torch.Tensor]:
    """The CPU tensors among ``tensors``. Device memory is not held back: its allocator
    frees it at once, and the next step may need it."""
    return [t for t in tensors if isinstance(t, torch.Tensor) and t.device.type == "cpu"]


def _set_masters(engine: EngineParts, state: ShardedState, take: bool) -> None:
    """The state's fp32 partitions into the masters: copied, or, when ``take`` and a
    partition is already what the master holds (dtype, device, contiguous), the master takes
    its memory (no copy of the masters on a load). An owner group's masters are always
    copied: its matrices' parameters are views of them."""
    for master, values, views in zip(engine.masters, state.fp32_partitions, engine.matrices.views):
        fits = values.dtype == master.dtype and values.device == master.device and values.is_contiguous()
        if take and fits and views is None and values.shape == master.shape:
            master.data = values.detach()
        else:
            master.data.copy_(values)


def _rebuilt_names(engine: EngineParts) -> set[str]:
    """The module's state_dict names whose tensors lie in the flat buffers: the trained
    parameters and every name tied to one."""
    storages = {buffer.data.untyped_storage().data_ptr() for buffer in engine.buffers}
    return {name for name, t in engine.model.state_dict().items() if t.untyped_storage().data_ptr() in storages}


def _validate(engine: EngineParts, state: ShardedState, full: bool, strict: bool, rebuilt: Collection[str] = ()) -> None:
    """``rebuilt``: names the model state does not hold (the weights rebuilt from the state's
    fp32 partitions, which must then fit whatever the load)."""
    if state.layout != engine.layout:
        raise ValueError("the state's layout differs from the engine's; load it through zeroshard.checkpoint to reshard")
    if state.rank != engine.rank:
        raise ValueError(f"the state is rank {state.rank}'s, this is rank {engine.rank}")
    held = sorted(set(state.model_state) & set(rebuilt))
    if held:
        raise ValueError(f"the model state holds {held[:5]}, which are rebuilt from the fp32 partitions")
    current = {name: t for name, t in engine.model.state_dict().items() if name not in rebuilt}
    _validate_model_state(current, state.model_state, strict)
    if full or rebuilt:  # the masters are loaded
        _validate_partitions(engine, state)
    if not full:
        return
    live_classes = group_classes(engine.optimizer)
    saved_classes = [saved.optimizer or state.optimizer_class for saved in state.param_groups]
    if set(saved_classes or [state.optimizer_class]) != set(live_classes):
        expected = optimizer_class_name(engine.optimizer)
        raise ValueError(f"the checkpoint's optimizer is {state.optimizer_class}, this run uses {expected}")
    if len(state.param_groups) != len(engine.optimizer.param_groups):
        raise ValueError(
            f"the checkpoint has {len(state.param_groups)} param groups, this run has {len(engine.optimizer.param_groups)}"
        )
    # Per group, each saved group beside the run's group holding its parameters: the run-level
    # name joins the classes in group order, which says nothing of which group ran which.
    saved_classes = [saved.optimizer or state.optimizer_class for saved in saved_in_run_order(engine, state)]
    for index, (saved, live) in enumerate(zip(saved_classes, live_classes)):
        if saved != live:
            raise ValueError(f"param group {index}: the checkpoint's optimizer is {saved}, this run's is {live}")


def _validate_partitions(engine: EngineParts, state: ShardedState) -> None:
    for group_index, (values, master) in enumerate(zip(state.fp32_partitions, engine.masters)):
        if values.shape != master.shape:
            raise ValueError(f"group {group_index}: fp32 partition has shape {tuple(values.shape)}, expected {tuple(master.shape)}")
        for key, tensor in state.optimizer_states[group_index].items():
            if tensor.shape != master.shape:
                raise ValueError(f"group {group_index}: optimizer state {key!r} has shape {tuple(tensor.shape)}")


def saved_in_run_order(engine: EngineParts, state: ShardedState) -> list[ParamGroupState]:
    """The state's param groups in the order of the run's: each beside the run's group that
    holds its layout groups (a run may list its groups in another order than the checkpoint's).

    Raises:
        ValueError: a run's group holds the layout groups of none, or of several, saved groups.
    """
    run_group_of = {g: index for index, user in enumerate(engine.grouping.user_groups) for g in user.layout_groups}
    ordered: list[list[ParamGroupState]] = [[] for _ in engine.grouping.user_groups]
    for saved in state.param_groups:
        holders = {run_group_of.get(g) for g in saved.layout_groups}
        if len(holders) == 1 and None not in holders:
            ordered[holders.pop()].append(saved)
    for index, found in enumerate(ordered):
        if len(found) != 1:
            raise ValueError(
                f"param group {index} holds the parameters of {len(found)} of the checkpoint's param groups, not one; "
                "group the run's parameters as the checkpoint does"
            )
    return [found[0] for found in ordered]


def _validate_model_state(current: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor], strict: bool) -> None:
    """What ``load_state_dict`` would refuse, found before anything is loaded."""
    if strict:
        missing, unexpected = sorted(current.keys() - loaded.keys()), sorted(loaded.keys() - current.keys())
        if missing or unexpected:
            mismatch = f"missing {missing[:5]}, unexpected {unexpected[:5]}"
            raise ValueError(f"the model state does not match the model: {mismatch}")
    for name, tensor in loaded.items():
        if name in current and tuple(tensor.shape) != tuple(current[name].shape):
            shapes = f"has shape {tuple(tensor.shape)}, the model's is {tuple(current[name].shape)}"
            raise ValueError(f"model state {name!r} {shapes}")


def _cast_like(current: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Loaded tensors in the dtypes the live module uses (a run may change param_dtype)."""
    return {k: v.to(current[k].dtype) if k in current and v.is_floating_point() else v for k, v in loaded.items()}


def _rebuild_masters_from_params(engine: EngineParts) -> None:
    for master, buffer in zip(engine.masters, engine.buffers):
        master.data.copy_(gather_partition(buffer.data, buffer.group, engine.rank_in(buffer.group)))


def _torch_optimizer_state(engine: EngineParts, state: ShardedState, take: bool) -> dict[str, Any]:
    """The state in torch.optim's own state_dict form, so the optimizer casts it its way: per
    master partition, or per matrix of an owner group (views of the group's states)."""
    ordered = [param for group in engine.optimizer.param_groups for param in group["params"]]
    index_of = {id(param): i for i, param in enumerate(ordered)}
    per_param = {}
    for group_index, master in enumerate(engine.masters):
        # Unless taken, clones: torch keeps tensors it needs no cast for, and would update
        # the caller's in place.
        states = {key: value if take else value.clone() for key, value in state.optimizer_states[group_index].items()}
        scalars = {key: value if take else value.clone() for key, value in state.optimizer_scalars[group_index].items()}
        views = engine.matrices.views[group_index]
        if views is None:
            if states or scalars:
                per_param[index_of[id(master)]] = {**scalars, **states}
            continue
        if states or scalars:
            for view, entry in zip(views, engine.matrices.torch_entries(group_index, states, scalars)):
                per_param[index_of[id(view.param)]] = entry
    groups = []
    for live, saved in zip(engine.optimizer.param_groups, saved_in_run_order(engine, state)):
        params = [index_of[id(p)] for p in live["params"]]
        groups.append({**live, **saved.hyperparameters, "params": params})
    return {"state": per_param, "param_groups": groups}
