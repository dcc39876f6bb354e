"""The parts of a ZeroOptimizer its helper modules work on, as a protocol.

``fragments`` (the per-parameter accessors ZeroOptimizer mixes in), ``torch_api`` (torch's
optimizer surface, mixed in too), ``state_io`` (a ShardedState out and back in),
``shard_state`` (torch's state_dict form) and ``memory`` (the memory report) each take the
engine and read or set these parts. They name :class:`EngineParts`, not ZeroOptimizer, so the
engine imports them and none of them imports the engine.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from ..buffers import FlatParamBuffer
from ..comm import Collectives
from ..layout import GroupLayout, Layout
from .gradients import GradientReducer
from .grouping import Grouping
from .matrices import MatrixStates
from .scaler import LossScaler


class EngineParts(Protocol):
    """What the engine's helpers use of a ZeroOptimizer: the model, its layout (and digest),
    the flat buffers, the fp32 master partitions and the wrapped optimizer over them, the
    gradient reducer, the loss scaler, the collectives (all W ranks, and each group's shard
    group) and the step count."""

    model: nn.Module
    layout: Layout
    layout_digest: str
    grouping: Grouping
    device: torch.device
    master_device: torch.device  # where the fp32 masters and optimizer state live (host with offload)
    buffers: list[FlatParamBuffer]
    masters: list[nn.Parameter]
    matrices: MatrixStates  # an owner group's matrices and their flat optimizer state
    optimizer: torch.optim.Optimizer
    reducer: GradientReducer
    scaler: LossScaler
    comm: Collectives
    group_comms: list[Collectives]
    global_steps: int

    @property
    def rank(self) -> int:
        """This rank in the engine's process group (of all W ranks)."""
        ...

    @property
    def world_size(self) -> int:
        """W: the ranks of the engine's process group."""
        ...

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's param groups."""
        ...

    def rank_in(self, group: GroupLayout) -> int:
        """This rank's place in the process group ``group`` is partitioned over."""
        ...

    def sync_params_from_masters(self) -> None:
        """Collective: every rank calls it. Make the model's parameters the fp32 masters cast
        to their dtype."""
        ...
