"""ShardedState: what one rank hands to the checkpoint layer, and gets back from it.

The engine exports its state as this plain value and imports it back; the checkpoint layer
never reaches into the engine. Tensors are on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .layout import Layout

if TYPE_CHECKING:
    import torch


@dataclass
class ParamGroupState:
    """One optimizer param group: its hyperparameters and the layout groups it owns."""

    hyperparameters: dict[str, Any]  # lr, betas, weight_decay, ... (JSON-able)
    layout_groups: list[int]  # indices into Layout.groups (one per dtype in the group)


@dataclass
class ResumeState:
    """What one rank needs, besides its shard, to resume exactly (format version 3): its
    random state (copies, as :func:`zeroshard.checkpoint.rng.capture_rng` takes it) and the
    training script's own states (a data loader's position, ...), already encoded as JSON-able
    values (:func:`zeroshard.checkpoint.io.jsonvalue.encode`: a copy taken at the save)."""

    rng: dict[str, Any] | None  # the rank's random state; None: not saved (rng=False)
    states: dict[str, Any] = field(default_factory=dict)  # per rank: name -> its state_dict
    global_states: dict[str, Any] = field(default_factory=dict)  # the same on every rank: name -> state_dict

    def scopes(self) -> dict[str, str]:
        """Every state's name and scope: "rank" or "global"."""
        return {**{name: "rank" for name in self.states}, **{name: "global" for name in self.global_states}}


@dataclass
class ShardedState:
    """One rank's share of a ZeRO run, in layout terms.

    ``fp32_partitions[g]`` and every tensor in ``optimizer_states[g]`` have shape
    ``[layout.groups[g].partition_numel]`` (this rank's partition, padding included, zeros
    in the padding); for an expert group, the partition of the rank's place in its
    expert-data-parallel group of the experts of its EP rank (``zeroshard.layout.coordinates``),
    so every rank's share is its own. ``optimizer_scalars[g]`` holds state that is not partition-shaped
    (such as ``step``), the same on every rank, carried as is when resharding.
    """

    layout: Layout
    rank: int
    fp32_partitions: list[torch.Tensor]
    optimizer_states: list[dict[str, torch.Tensor]]
    optimizer_scalars: list[dict[str, torch.Tensor]]
    param_groups: list[ParamGroupState]
    optimizer_class: str  # e.g. "torch.optim.adamw.AdamW"
    model_state: dict[str, torch.Tensor]  # the module's full state_dict (frozen params, buffers)
    extra: dict[str, Any] = field(default_factory=dict)  # step counters, loss scaler, lr scheduler
    resume: ResumeState | None = None  # random state and user states (a Checkpointer's saves)
