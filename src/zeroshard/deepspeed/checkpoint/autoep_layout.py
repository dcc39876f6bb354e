"""The expert group of an AutoEP run's ZeRO files, as a layout group.

AutoEP puts every layer's stacked expert weights (``{prefix}.w1``, ``w2``, ``w3``, each
``[E / EP, ...]``) into one optimizer group of their own, partitioned over the
expert-data-parallel group: the W / EP ranks that hold the same experts. DeepSpeed builds
those groups as zeroshard's :class:`~zeroshard.layout.ExpertMesh` does (ds_to_universal reads
EP rank ``e``'s fragments from ranks ``e, e + EP, ...``; ``use_data_before_expert_parallelism``,
which orders them otherwise, is refused), so rank file ``r`` holds partition ``r // EP`` of EP
rank ``r % EP``'s experts, and the group is a zeroshard expert group with the placement as its
expert map.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...io.budget import Budget, BudgetExceeded, quoted
from ...layout import EXPERT_SHARD_GROUP, GroupSpec, ParamSpec
from .autoep_files import AutoEP, check_affine_maps
from .pickled import DeepSpeedFormatError


def group_kind(autoep: AutoEP | None, names: list[str], hyperparameters: dict[str, Any], where: str) -> bool:
    """Whether a ZeRO group of ``names`` is AutoEP's expert group (all its parameters are
    stacked expert weights, and the optimizer group says ``moe``), or a dense one."""
    experts = autoep.expert_params() if autoep is not None else {}
    found = [name in experts for name in names]
    is_expert = bool(found) and all(found)
    if any(found) and not is_expert:
        raise DeepSpeedFormatError(f"{where}: mixes AutoEP expert weights and dense parameters in one group")
    if bool(hyperparameters.get("moe", False)) != is_expert:
        what = "holds expert weights" if is_expert else "holds no expert weights"
        raise DeepSpeedFormatError(
            f"{where}: {what}, but its optimizer group says moe={quoted(hyperparameters.get('moe'))}"
        )
    return is_expert


def expert_group_spec(
    autoep: AutoEP,
    shapes: dict[str, tuple[int, ...]],
    dtype: str,
    world_size: int,
    path: Path,
    budget: Budget | None = None,
) -> GroupSpec:
    """The layout group of the expert weights ``shapes`` (name -> stacked shape, in flat
    order) of ``path``'s ``param_shapes``; every layer's shapes, placement and affine maps
    checked against each other, what the affine maps' check copies charged to ``budget`` (the
    model-states file's)."""
    params = autoep.expert_params()
    layers = {params[name][0].moe_layer_id: params[name][0] for name in shapes}
    if len(layers) != len(autoep.layers) or len(shapes) != len(params):
        missing = sorted(set(params) - set(shapes))
        raise DeepSpeedFormatError(f"{path}: param_shapes has no expert weight {quoted(missing[0])}")
    placement = autoep.layers[0].placement
    if any(layer.placement != placement for layer in autoep.layers):  # not a set: no hashing of the file's ids
        raise DeepSpeedFormatError(
            f"{path}: AutoEP layers place their experts differently; one placement per group is read"
        )
    ep = autoep.ep_size
    if world_size % ep:
        raise DeepSpeedFormatError(f"{path}: expert parallelism {ep} does not divide the {world_size} rank files")
    for layer in autoep.layers:
        _check_shapes(layer.param_name, layer.num_experts // ep, shapes, path)
        if layer.data_parallel_size != world_size // ep:
            raise DeepSpeedFormatError(
                f"{path}: ds_autoep_layers says {quoted(layer.data_parallel_size)} expert-data-parallel ranks for "
                f"{layer.module_path}, {world_size} rank files / EP {ep} gives {world_size // ep}"
            )
        try:
            check_affine_maps(layer, shapes, path, budget)
        except BudgetExceeded as err:
            raise DeepSpeedFormatError(str(err)) from None
    specs = tuple(ParamSpec.of(name, shape, dtype) for name, shape in shapes.items())
    return GroupSpec(specs, EXPERT_SHARD_GROUP, world_size // ep, placement)


def _check_shapes(name_of: Any, local_experts: int, shapes: dict[str, tuple[int, ...]], path: Path) -> None:
    """w1 and w3 ``[E / EP, I, H]``, w2 ``[E / EP, H, I]``."""
    w1, w2, w3 = (shapes[name_of(weight)] for weight in ("w1", "w2", "w3"))
    ok = len(w1) == 3 and w1[0] == local_experts and w3 == w1 and w2 == (w1[0], w1[2], w1[1])
    if not ok:
        raise DeepSpeedFormatError(
            f"{path}: param_shapes gives {name_of('w1')} {quoted(list(w1))}, w2 {quoted(list(w2))}, "
            f"w3 {quoted(list(w3))}; expected "
            f"[{local_experts}, I, H], [{local_experts}, H, I], [{local_experts}, I, H]"
        )
