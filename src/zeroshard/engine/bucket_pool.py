"""A bounded pool of flat buffers that stage 2's bucket reductions reuse across backwards.

A bucket's reduction needs a staging buffer (the bucket's gradient), on gloo with a lower
reduce dtype a receive buffer of the same size, and, when the partition already holds a
gradient, an fp32 temporary for the reduced partition. Freeing them after every bucket and
allocating them again in the next backward costs page faults whenever the allocator has
handed the memory back to the system in between (first touch of every page, every step).
The pool keeps them instead, as DeepSpeed keeps its bucket buffer.

It keeps at most ``budget_bytes``, a figure fixed when the engine is built from the layout,
the bucket size and the reduce dtypes (``GradientReducer._pool_budget``); a buffer given
back beyond it is dropped. Every backward asks for the same shapes in the same order, so
from the second backward on the pool neither grows nor, in the usual case, allocates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

PoolKey = tuple[int, torch.dtype]


@dataclass
class BufferPool:
    """Free 1-D buffers by (numel, dtype). The buffers it keeps and those it has lent out
    stay within ``budget_bytes`` together whenever what is lent does: a kept buffer of
    another shape is dropped before a new one is allocated past the budget."""

    device: torch.device
    budget_bytes: int
    _free: dict[PoolKey, list[torch.Tensor]] = field(default_factory=dict)
    _held_bytes: int = 0
    _lent_bytes: int = 0

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised buffer: a kept one of this shape if there is one, else a new one."""
        free = self._free.get((numel, dtype))
        if free:
            buffer = free.pop()
            self._held_bytes -= buffer.nbytes
        else:
            self._drop_until(self.budget_bytes - self._lent_bytes - numel * dtype.itemsize)
            buffer = torch.empty(numel, dtype=dtype, device=self.device)
        self._lent_bytes += buffer.nbytes
        return buffer

    def give(self, buffer: torch.Tensor) -> None:
        """Take back a buffer ``take`` lent; keep it for a later ``take`` if the budget allows."""
        self._lent_bytes -= buffer.nbytes
        if self._lent_bytes + self._held_bytes + buffer.nbytes <= self.budget_bytes:
            self._free.setdefault((buffer.numel(), buffer.dtype), []).append(buffer)
            self._held_bytes += buffer.nbytes

    def held(self) -> list[torch.Tensor]:
        """The buffers kept right now, not lent (for memory accounting)."""
        return [buffer for free in self._free.values() for buffer in free]

    @property
    def held_bytes(self) -> int:
        """Bytes of the buffers kept right now (not those lent out)."""
        return self._held_bytes

    def _drop_until(self, limit: int) -> None:
        """Drop kept buffers (largest first) until at most ``limit`` bytes are kept."""
        while self._held_bytes > max(limit, 0):
            key = max((k for k, free in self._free.items() if free), key=lambda k: k[0] * k[1].itemsize)
            self._held_bytes -= self._free[key].pop().nbytes
