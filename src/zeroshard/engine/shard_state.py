"""ZeroOptimizer.state_dict() / load_state_dict(): one rank's shard in torch's form.

The dict is the wrapped optimizer's own state_dict (``"state"``, ``"param_groups"``) plus
a ``"zero"`` entry with what torch's form lacks: the fp32 master partitions, the step
count, the loss scaler, and what identifies the shard (layout digest, world size, rank,
optimizer class). A shard only fits the same rank of an identically laid-out engine;
everything else is refused, pointing to ``zeroshard.checkpoint``, which reshards.
"""

from __future__ import annotations

from typing import Any

import torch

from .parts import EngineParts
from .state_io import optimizer_class_name

ZERO_KEY = "zero"


def shard_state_dict(engine: EngineParts) -> dict[str, Any]:
    """This rank's shard; the tensors are the live ones, as in torch's state_dict."""
    state_dict = engine.optimizer.state_dict()
    state_dict[ZERO_KEY] = {
        "layout_sha256": engine.layout_digest,
        "world_size": engine.world_size,
        "rank": engine.rank,
        "optimizer_class": optimizer_class_name(engine.optimizer),
        "fp32_partitions": [master.detach() for master in engine.masters],
        "global_steps": engine.global_steps,
        "loss_scaler": engine.scaler.state_dict(),
    }
    return state_dict


def shard_mismatch(engine: EngineParts, state_dict: Any) -> str | None:
    """Why ``state_dict`` cannot be loaded into this rank of ``engine``, or None. Never raises."""
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get(ZERO_KEY), dict):
        return "not a ZeroOptimizer state_dict (it has no 'zero' entry)"
    zero = state_dict[ZERO_KEY]
    if zero.get("world_size") != engine.world_size or zero.get("layout_sha256") != engine.layout_digest:
        return (
            f"the shard is of another layout or world size (saved at world size {zero.get('world_size')!r}, "
            f"this engine has {engine.world_size})"
        )
    if zero.get("rank") != engine.rank:
        return f"the shard is rank {zero.get('rank')!r}'s, this is rank {engine.rank}"
    expected = optimizer_class_name(engine.optimizer)
    if zero.get("optimizer_class") != expected:
        return f"the shard's optimizer is {zero.get('optimizer_class')!r}, this engine uses {expected}"
    return _partitions_mismatch(engine, zero) or _torch_part_mismatch(engine, state_dict)


def load_shard(engine: EngineParts, state_dict: dict[str, Any]) -> None:
    """Load a shard ``shard_mismatch`` accepted; the caller re-gathers the parameters."""
    zero = state_dict[ZERO_KEY]
    engine.optimizer.load_state_dict({key: value for key, value in state_dict.items() if key != ZERO_KEY})
    with torch.no_grad():
        for master, values in zip(engine.masters, zero["fp32_partitions"]):
            master.copy_(values)
    engine.global_steps = int(zero["global_steps"])
    engine.scaler.load_state_dict(zero["loss_scaler"])


def _partitions_mismatch(engine: EngineParts, zero: dict[str, Any]) -> str | None:
    partitions = zero.get("fp32_partitions")
    if not isinstance(partitions, (list, tuple)) or len(partitions) != len(engine.masters):
        return f"'fp32_partitions' must be a list of {len(engine.masters)} tensors"
    for index, (values, master) in enumerate(zip(partitions, engine.masters)):
        if not torch.is_tensor(values) or values.shape != master.shape:
            shape = tuple(values.shape) if torch.is_tensor(values) else type(values).__name__
            return f"fp32 partition {index} is {shape}, expected shape {tuple(master.shape)}"
    if not isinstance(zero.get("global_steps"), int) or not isinstance(zero.get("loss_scaler"), dict):
        return "'global_steps' must be an int and 'loss_scaler' a dict"
    unknown = set(zero["loss_scaler"]) - set(engine.scaler.state_dict())
    if unknown:
        return f"'loss_scaler' has unknown fields {sorted(unknown)}"
    return None


def _torch_part_mismatch(engine: EngineParts, state_dict: dict[str, Any]) -> str | None:
    groups, state = state_dict.get("param_groups"), state_dict.get("state")
    well_formed = isinstance(groups, list) and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
    if not well_formed:
        return "'param_groups' must be a list of dicts with 'params' lists"
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in engine.param_groups]:
        return f"it has {len(groups)} param groups of other sizes than the engine's {len(engine.param_groups)}"
    ordered = [param for group in engine.param_groups for param in group["params"]]
    if not isinstance(state, dict):
        return "'state' must be a dict"
    for index, entry in state.items():
        if not isinstance(index, int) or not 0 <= index < len(ordered) or not isinstance(entry, dict):
            return f"'state' entry {index!r} is not a partition of this engine"
        for key, value in entry.items():
            if torch.is_tensor(value) and value.dim() > 0 and value.shape != ordered[index].shape:
                expected = tuple(ordered[index].shape)
                return f"optimizer state {key!r} of partition {index} has shape {tuple(value.shape)}, expected {expected}"
    return None
