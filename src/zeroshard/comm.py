"""Collectives over a torch.distributed process group, with a byte count per kind.

``Collectives`` is the only place the engine talks to torch.distributed. Without an
initialised process group it acts as a world of one, so the engine also runs in a plain
single process. The byte counts record each call's payload (the reduce-scatter input, the
all-gather output, the all-reduced tensor) so benchmarks can check what a step moves.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# torch 2.13 renamed the tensor collectives; older releases only have the first names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Done:
    """Handle of a collective that completed synchronously (world of one)."""

    def wait(self) -> bool:
        return True


@dataclass
class Collectives:
    """The collectives a ZeRO rank needs, over one process group."""

    group: Any = None
    bytes_moved: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        if self.group is not None and not self.distributed:
            raise ValueError("a process group was given but torch.distributed is not initialised")
        self.rank = dist.get_rank(self.group) if self.distributed else 0
        self.world_size = dist.get_world_size(self.group) if self.distributed else 1

    @property
    def backend(self) -> str:
        return dist.get_backend(self.group) if self.distributed else "local"

    def reduce_scatter_sum(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """output (one partition) <- sum over ranks of this rank's partition of input."""
        self.bytes_moved["reduce_scatter"] += input.numel() * input.element_size()
        if self.world_size == 1:
            output.copy_(input)
            return _Done()
        return _reduce_scatter(output, input, group=self.group, async_op=async_op) or _Done()

    def all_gather_into(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """output <- concatenation of every rank's input (input may be a slice of output)."""
        self.bytes_moved["all_gather"] += output.numel() * output.element_size()
        if self.world_size == 1:
            if input.data_ptr() != output.data_ptr():
                output.copy_(input)
            return _Done()
        return _all_gather(output, input, group=self.group, async_op=async_op) or _Done()

    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self.bytes_moved["all_reduce"] += tensor.numel() * tensor.element_size()
        if self.world_size > 1:
            dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op.upper()), group=self.group)
        return tensor

    def broadcast_(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """``src`` is a rank of this group."""
        self.bytes_moved["broadcast"] += tensor.numel() * tensor.element_size()
        if self.world_size > 1:
            dist.broadcast(tensor, src=self._global_rank(src), group=self.group)
        return tensor

    def all_gather_object(self, value: Any) -> list[Any]:
        if self.world_size == 1:
            return [value]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def _global_rank(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)
