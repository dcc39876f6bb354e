"""MemoryReport: the bytes of training state one rank of a ZeroOptimizer holds.

Its one job is the report behind ``ZeroOptimizer.memory_report()``: the flat parameter
buffers, fp32 masters, optimizer state and gradients this rank holds, stage 2's bucket pool
apart, and what plain (unsharded) data parallelism would hold for the same model.
"""

from __future__ import annotations

from dataclasses import dataclass

from .parts import EngineParts
from .state_io import partition_state


@dataclass(frozen=True)
class MemoryReport:
    """Bytes of training state on one rank; ``unsharded_bytes`` is plain data parallelism's.
    ``total_bytes`` also counts stage 2's bucket pool, reusable scratch that is no state."""

    param_buffer_bytes: int
    master_bytes: int
    optimizer_state_bytes: int
    gradient_bytes: int
    unsharded_bytes: int
    bucket_pool_bytes: int = 0  # stage 2's reusable bucket buffers (scratch, not state)

    @property
    def total_bytes(self) -> int:
        """Every byte the report counts: the training state and stage 2's bucket pool."""
        state = self.param_buffer_bytes + self.master_bytes + self.optimizer_state_bytes + self.gradient_bytes
        return state + self.bucket_pool_bytes


def rank_memory(engine: EngineParts) -> MemoryReport:
    """Not collective. Bytes this rank of ``engine`` holds for training state, and what
    unsharded training would hold."""
    master = sum(m.numel() * m.element_size() for m in engine.masters)
    state = sum(
        t.numel() * t.element_size()
        for index in range(len(engine.masters))
        for t in partition_state(engine, index)[0].values()
    )
    pool = engine.reducer.pool_bytes
    grads = sum(t.numel() * t.element_size() for t in engine.reducer.held_tensors()) - pool
    params = sum(b.data.numel() * b.data.element_size() for b in engine.buffers)
    real = sum(group.param_numel for group in engine.layout.groups)
    partition = sum(group.partition_numel for group in engine.layout.groups)
    state_per_element = state / partition if partition else 0.0
    unsharded = (
        sum(group.param_numel * b.data.element_size() for group, b in zip(engine.layout.groups, engine.buffers))
        + real * (4 + 4)  # fp32 master and fp32 gradient
        + int(real * state_per_element)
    )
    return MemoryReport(params, master, state, grads, unsharded, pool)
