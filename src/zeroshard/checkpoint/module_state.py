"""The module state_dict a rank's load returns beside its partitions.

The trained parameters' weights come from their fp32 masters where the checkpoint keeps no
low-precision copy (universal, or expert weights: each expert read by global id and cast
as the engine makes its parameters), else as stored, like the buffers and frozen
parameters; a master read whole for its weight also fills the rank's fragments of it in the
fp32 partition, so it is read once. Tied names come back as the same tensor.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch

from ..io.dtypes import cast, dtype_info, to_torch
from ..layout import Fragment, GroupLayout, Layout, ParamSlot
from ..layout.coordinates import ep_rank, expert_numel, shard_rank
from .attest.attestation import Evidence
from .source import ShardSource, read_model_tensors, read_param, read_whole_param


def module_weights(
    source: ShardSource,
    layout: Layout,
    rank: int,
    loadable: set[str],
    keep_only: Mapping[str, Any] | None,
    fp32: Mapping[int, np.ndarray],
    evidence: Evidence,
) -> dict[str, np.ndarray]:
    """The module state_dict entries to load, tied names left out: the trained parameters'
    weights in the run's dtype (of expert weights, the experts ``rank`` holds), buffers and
    frozen parameters as stored (only those ``keep_only`` names, when given). A weight cast
    from its fp32 master also copies the master's fragments of ``rank`` into the partition
    of its group in ``fp32``, if there."""
    info = source.info
    planned: dict[str, np.ndarray | tuple[int, ...]] = {}  # an array, or the shape of one read as stored
    for group in layout.groups:
        partition = fp32.get(group.index)
        fragments = _fragments_by_param(group.fragments(shard_rank(group, rank))) if partition is not None else {}
        for slot in group.params:
            if slot.name not in loadable:
                if slot.numel == 0:
                    planned[slot.name] = np.empty(slot.spec.shape, dtype=dtype_info(group.dtype).numpy)
            elif group.is_expert_group:
                planned[slot.name] = _local_experts(source, group, slot, rank, evidence)
            elif info.weights_from_masters:
                weight = _master_weight(source, slot, group.dtype, fragments.get(slot.name, ()), partition, evidence)
                planned[slot.name] = weight.reshape(slot.spec.shape)
            else:
                planned[slot.name] = slot.spec.shape  # its dtype is the run's: a change is refused before
    for entry in info.model_entries:
        if entry.name not in planned and (keep_only is None or entry.name in keep_only):
            planned[entry.name] = entry.shape
    # All at once: the native source reads neighbouring tensors in one read.
    digests: dict[str, tuple] | None = {} if evidence.enabled else None  # name -> (address, nbytes, digest) read
    found = read_model_tensors(source, [name for name, value in planned.items() if isinstance(value, tuple)], digests)
    for name, values in found.items():
        evidence.model_tensor(name, values, digests.get(name) if digests else None)
    return {name: found[name].reshape(value) if isinstance(value, tuple) else value for name, value in planned.items()}


def _master_weight(
    source: ShardSource,
    slot: ParamSlot,
    dtype: str,
    fragments: Sequence[Fragment],
    partition: np.ndarray | None,
    evidence: Evidence,
) -> np.ndarray:
    """Parameter ``slot``'s fp32 master cast to ``dtype``; its ``fragments`` copied into ``partition``."""
    master = read_whole_param(source, slot.name, "fp32")
    evidence.master(slot.name, None, master)
    for fragment in fragments:
        read = master[fragment.param_start : fragment.param_start + fragment.length]
        partition[fragment.partition_start : fragment.partition_start + fragment.length] = read
        evidence.read_range(slot.name, None, "fp32", fragment.param_start, read, slot.numel)
    return cast(master, dtype)


def _fragments_by_param(fragments: Sequence[Fragment]) -> dict[str, list[Fragment]]:
    found: dict[str, list[Fragment]] = {}
    for fragment in fragments:
        found.setdefault(fragment.name, []).append(fragment)
    return found


def _local_experts(
    source: ShardSource, group: GroupLayout, slot: ParamSlot, rank: int, evidence: Evidence
) -> np.ndarray:
    """The stacked weight of the experts ``rank`` holds: their fp32 masters (read by global
    expert id) cast to the run's dtype, as the engine makes its parameters from its masters.
    No checkpoint stores expert weights in low precision (a native one keeps one module
    file, written by rank 0, which holds only its own experts)."""
    per_expert = expert_numel(slot)
    experts = group.expert_map[ep_rank(group, rank)]
    masters = [read_param(source, slot.name, "fp32", g * per_expert, (g + 1) * per_expert) for g in experts]
    stacked = np.concatenate(masters) if masters else np.empty(0, dtype=np.float32)
    for local, expert in enumerate(experts):  # as placed: the cast keeps each element where it is
        evidence.master(slot.name, expert, stacked[local * per_expert : (local + 1) * per_expert])
    return cast(stacked, group.dtype).reshape(slot.spec.shape)


def to_torch_keeping_ties(weights: Mapping[str, np.ndarray], aliases: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """``weights`` as torch tensors (sharing their memory), each alias the same tensor as the
    name it ties to, as the module holds them."""
    state = {name: to_torch(array) for name, array in weights.items()}
    for alias, target in aliases.items():
        if target in state:
            state[alias] = state[target]
    return state
