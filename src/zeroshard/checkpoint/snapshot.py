"""HostSnapshot: one rank's state copied into reusable host buffers while training waits.

An asynchronous save must not read tensors the next step will change, so it first copies
them: the fp32 master partitions, the optimizer state, and on rank 0 the module's state
(the flat parameter buffers and the other entries; rank 0 alone writes model.safetensors).
The buffers are allocated at the first save and reused while each tensor keeps its shape
and dtype (optimizer state appears after the first step: only its buffers are added).
They are pinned when the state lives on a GPU, so the device-to-host copies run at full
speed and asynchronously, with one synchronisation at the end.
"""

from __future__ import annotations

import copy
from typing import Hashable

import torch

from ..state import ShardedState

Key = tuple[Hashable, ...]


class HostSnapshot:
    """Reusable host buffers for copies of a :class:`ShardedState` (one save at a time)."""

    def __init__(self, pin_memory: bool = False) -> None:
        self.pin_memory = pin_memory
        self._buffers: dict[Key, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the buffers hold."""
        return sum(t.numel() * t.element_size() for t in self._buffers.values())

    def release(self) -> None:
        """Let go of the host buffers (the next ``take`` allocates again)."""
        self._buffers = {}

    def take(self, views: ShardedState, with_model: bool) -> ShardedState:
        """A copy of ``views`` in the host buffers (valid until the next ``take``); its
        model state is empty unless ``with_model``. Returns once the copy is complete."""
        sources, model_keys = _tensors_of(views, with_model)
        self._allocate({key: (tuple(t.shape), t.dtype) for key, t in sources.items()})
        for key, tensor in sources.items():
            self._buffers[key].copy_(tensor, non_blocking=True)
        if any(t.is_cuda for t in sources.values()):
            torch.cuda.synchronize()
        return self._state_like(views, model_keys)

    def _allocate(self, wanted: dict[Key, tuple[tuple[int, ...], torch.dtype]]) -> None:
        """Keep the buffers that fit; free the others before allocating what is missing."""
        self._buffers = {
            key: buffer
            for key, buffer in self._buffers.items()
            if wanted.get(key) == (tuple(buffer.shape), buffer.dtype)
        }
        for key, (shape, dtype) in wanted.items():
            if key not in self._buffers:
                self._buffers[key] = torch.empty(shape, dtype=dtype, pin_memory=self.pin_memory)

    def _state_like(self, views: ShardedState, model_keys: dict[str, Key]) -> ShardedState:
        groups = range(len(views.fp32_partitions))
        buffers = self._buffers
        return ShardedState(
            layout=views.layout,
            rank=views.rank,
            fp32_partitions=[buffers[("fp32", g)] for g in groups],
            optimizer_states=[{n: buffers[("state", g, n)] for n in views.optimizer_states[g]} for g in groups],
            optimizer_scalars=[{n: buffers[("scalar", g, n)] for n in views.optimizer_scalars[g]} for g in groups],
            param_groups=copy.deepcopy(views.param_groups),  # schedulers change them in place
            optimizer_class=views.optimizer_class,
            model_state={name: buffers[key] for name, key in model_keys.items()},
            extra=copy.deepcopy(views.extra),
            model_configs=dict(views.model_configs),
        )


def _tensors_of(views: ShardedState, with_model: bool) -> tuple[dict[Key, torch.Tensor], dict[str, Key]]:
    """Every tensor to copy by key, and each model state name's key: names that share a
    tensor (tied weights) share one key, so the copy keeps them tied."""
    sources: dict[Key, torch.Tensor] = {}
    for g, partition in enumerate(views.fp32_partitions):
        sources[("fp32", g)] = partition
        sources.update({("state", g, n): t for n, t in views.optimizer_states[g].items()})
        sources.update({("scalar", g, n): t for n, t in views.optimizer_scalars[g].items()})
    model_keys: dict[str, Key] = {}
    first_of: dict[tuple, Key] = {}
    for name, tensor in (views.model_state if with_model else {}).items():
        storage = tensor.untyped_storage().data_ptr()
        identity = (tensor.device, storage, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
        key = first_of.setdefault(identity, ("model", name))
        if key == ("model", name):
            sources[key] = tensor
        model_keys[name] = key
    return sources, model_keys
