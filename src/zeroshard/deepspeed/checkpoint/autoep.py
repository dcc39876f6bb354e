"""A DeepSpeed AutoEP checkpoint in the transformers model's names and layout (a ShardSource).

:class:`~.source.DeepSpeedSource` reads the ZeRO files as DeepSpeed laid them out: the
router under AutoEP's name and the experts as ``w1``/``w2``/``w3`` stacks of each EP rank.
:class:`AutoEPSource` presents the same state as the model the run started from holds it
(:mod:`.autoep_names`): ``mlp.gate.weight`` and the stacks ``mlp.experts.gate_up_proj
[E, 2I, H]`` (``cat(w1, w3)``) and ``mlp.experts.down_proj [E, H, I]`` (``w2``), every expert
under its global id. Like a universal checkpoint it is a world of one whose parameters lie back
to back (:mod:`...checkpoint.packed`): the dense group, and an expert group at EP = 1 holding all
E experts in id order. A range of it is read from the ranges of DeepSpeed's tensors it maps to,
each from the rank files holding them, so the loader reshards it to any (W, EP), and the
converters export it under the model's own names.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from ...checkpoint.packed import PACKED_POLICY, PackedPartitions, PackedSource
from ...checkpoint.source import read_param
from ...layout import EXPERT_SHARD_GROUP, GroupSpec, ParamSpec, build_layout
from .autoep_names import ModelStack, TransformersNames, transformers_names
from .source import DeepSpeedSource
from .paths import MODEL_STATES_FILE


class AutoEPSource(PackedSource):
    """An AutoEP checkpoint read in the transformers model's names (the ShardSource protocol).
    ``raw`` is the checkpoint in DeepSpeed's own names and layout."""

    kind = "DeepSpeedAutoEPSource"

    def __init__(self, raw: DeepSpeedSource) -> None:
        self.raw = raw
        self.path: Path = raw.path
        self.world_size = raw.layout.world_size  # of the run that saved it
        self.names = _names(raw)
        self._stacks = {stack.name: stack for stack in self.names.stacks}
        self._weights = raw.autoep.expert_params()  # AutoEP weight name -> (its layer, w1/w2/w3)
        layout = build_layout([self._group(group) for group in raw.layout.groups], 1, PACKED_POLICY)
        self._autoep_name = {model_name: name for name, model_name in self.names.renamed.items()}
        self._packed = PackedPartitions(layout, self.path, "an AutoEP checkpoint is read as a world of one")
        info = raw.info
        self.info = dataclasses.replace(
            info,
            layout=layout,
            model_entries=[
                dataclasses.replace(entry, name=self.names.name(entry.name))
                for entry in info.model_entries
                if entry.name not in self.names.router_aliases
            ],
            aliases={self.names.name(alias): self.names.name(target) for alias, target in info.aliases.items()},
            extra={**info.extra, "autoep": _summary(raw)},
        )

    def scalars(self, group: int) -> dict[str, Any]:
        """Non-partitioned optimizer state of layout group ``group`` (``step``), as DeepSpeed's
        rank 0 saved it; ValueError when there is no such group."""
        self._packed.group(group)
        return self.raw.scalars(group)

    def model_tensor(self, name: str) -> np.ndarray:
        """A module tensor under the model's name; an expert stack from the per-expert files."""
        stack = self._stacks.get(name)
        if stack is None:
            return self.raw.model_tensor(self._autoep_name.get(name, name))
        experts = []
        for expert in range(stack.num_experts):
            matrices = [self._expert_matrix(part.source, expert) for part in stack.parts]
            experts.append(np.concatenate(matrices, axis=0))
        return np.stack(experts)

    def close(self) -> None:
        """Close ``raw``, the checkpoint in DeepSpeed's own names."""
        self.raw.close()

    def __enter__(self) -> AutoEPSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read_param(self, name: str, start: int, end: int, *, key: str) -> np.ndarray:
        stack = self._stacks.get(name)
        if stack is None:
            return read_param(self.raw, self._autoep_name.get(name, name), key, start, end)
        pieces = [
            read_param(self.raw, source, key, first, stop) for source, first, stop in stack.source_ranges(start, end)
        ]
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def _expert_matrix(self, source: str, expert: int) -> np.ndarray:
        layer, weight = self._weights[source]
        return self.raw.experts.read(layer, weight, expert)

    def _group(self, group) -> GroupSpec | list[ParamSpec]:
        """The group of the view that holds the raw layout group ``group``'s parameters."""
        if not group.is_expert_group:
            return [ParamSpec(self.names.name(slot.name), slot.spec.shape, group.dtype) for slot in group.params]
        stacks = [stack for stack in self.names.stacks if stack.parts[0].source in {slot.name for slot in group.params}]
        experts = stacks[0].num_experts
        specs = tuple(ParamSpec(stack.name, stack.shape(), group.dtype) for stack in stacks)
        contracts = tuple(stack.contract for stack in stacks)
        return GroupSpec(specs, EXPERT_SHARD_GROUP, 1, (tuple(range(experts)),), contracts)


def _names(raw: DeepSpeedSource) -> TransformersNames:
    expert_group = next(group for group in raw.layout.groups if group.is_expert_group)
    local_shapes = {slot.name: slot.spec.shape for slot in expert_group.params}
    others = [name for name in raw.layout.param_names if name not in local_shapes]
    others += [entry.name for entry in raw.info.model_entries]
    return transformers_names(raw.autoep, local_shapes, others, raw.path / MODEL_STATES_FILE)


def _summary(raw: DeepSpeedSource) -> dict[str, Any]:
    """What ``extra`` records of the AutoEP run (plain values: it goes into manifests)."""
    autoep = raw.autoep
    return {
        "preset_model": autoep.preset,
        "autoep_size": autoep.ep_size,
        "world_size": raw.layout.world_size,
        "expert_placement": [list(ids) for ids in autoep.layers[0].placement],
        "moe_layers": [layer.module_path for layer in autoep.layers],
    }


__all__ = ["AutoEPSource", "ModelStack"]
