"""GradientMemoryProbe: the peak gradient memory of an engine, observed from outside.

For tests and benchmarks. It counts the reducer's ``held_tensors()`` plus every buffer
handed to a reduce-scatter that is still alive (in flight, or an output not yet folded in)
and the temporaries its handle holds (a widening reduce-scatter's receive buffer), each
storage once, sampled after every reduce-scatter call and after every parameter's gradient
hook. It wraps the engine's Collectives instance and reads no private state, so it also
catches buffers the engine's own accounting would miss.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from .optimizer import ZeroOptimizer


class GradientMemoryProbe:
    """The peak bytes of gradient memory ``engine`` holds, in :attr:`peak_bytes` (see the
    module docstring). Build it after the engine, over the same ``model``; it wraps the
    engine's reduce-scatters and adds a gradient hook to every parameter. Not collective."""

    def __init__(self, engine: ZeroOptimizer, model: nn.Module) -> None:
        self.engine = engine
        self.peak_bytes = 0
        self._collective_buffers: list[weakref.ref] = []
        for method in ("reduce_scatter_sum", "reduce_scatter_widened"):
            setattr(engine.comm, method, self._sampling(getattr(engine.comm, method)))
        for param in model.parameters():  # registered after the engine's hooks, so runs after them
            param.register_post_accumulate_grad_hook(lambda _: self.sample())

    def _sampling(self, reduce_scatter):
        def reduce_scatter_and_sample(output, input, async_op=False, **options):
            handle = reduce_scatter(output, input, async_op=async_op, **options)
            # With the handle's own temporaries (a widening reduction's receive buffer).
            buffers = [output, input, *getattr(handle, "buffers", ())]
            self._collective_buffers += [weakref.ref(tensor) for tensor in buffers]
            self.sample()
            return handle

        return reduce_scatter_and_sample

    def sample(self) -> None:
        """Count the gradient memory held right now (each storage once) into the peak."""
        alive = [ref() for ref in self._collective_buffers]
        self._collective_buffers = [ref for ref, tensor in zip(self._collective_buffers, alive) if tensor is not None]
        tensors = list(self.engine.reducer.held_tensors()) + [t for t in alive if t is not None]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        self.peak_bytes = max(self.peak_bytes, sum(storages.values()))
