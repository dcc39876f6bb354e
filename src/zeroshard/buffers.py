"""Flat parameter buffers: one per layout group, the model's parameters bound as views.

Each parameter becomes a zero-copy view of its slot (``param.data = view``), so the module,
autograd and any kernel see the flat buffer's storage. With a native layout every view
starts on the policy's alignment; this is checked on the real data_ptr() at bind time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .layout import GroupLayout, LayoutPolicy, itemsize


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a canonical dtype name (``"bfloat16"`` -> ``torch.bfloat16``).

    Raises:
        AttributeError: torch has no dtype of that name.
    """
    return getattr(torch, name)


@dataclass
class FlatParamBuffer:
    """A group's flat low-precision buffer and the parameters viewing into it."""

    group: GroupLayout
    data: torch.Tensor  # [group.numel], padding zero
    params: list[nn.Parameter]  # in group order

    def bucket_view(self, bucket_index: int) -> torch.Tensor:
        """The bucket's run of the flat buffer (a view), every rank's slice of it included."""
        bucket = self.group.buckets[bucket_index]
        return self.data[bucket.start : bucket.end]

    def rank_slice(self, bucket_index: int, rank: int) -> torch.Tensor:
        """The slice of the bucket that ``rank`` (of the group's shard group) owns (a view;
        in an owner group, of the rank's own length, possibly empty)."""
        begin, end, _ = self.group.bucket_slice(bucket_index, rank)
        return self.data[begin:end]

    def param_view(self, param_index: int) -> torch.Tensor:
        """Parameter ``param_index``'s slot, in the parameter's shape (a view)."""
        slot = self.group.params[param_index]
        return self.data[slot.offset : slot.end].view(slot.spec.shape)


def bind_flat_buffer(
    group: GroupLayout,
    params: list[nn.Parameter],
    device: torch.device,
    policy: LayoutPolicy,
) -> FlatParamBuffer:
    """Allocate the group's buffer, copy each parameter in (cast to the group's dtype) and
    rebind the parameter as a view of its slot. Not collective.

    Raises:
        RuntimeError: a view's data_ptr() is not on the policy's alignment (a bug: the
            buffer's start and the layout's offsets are aligned by construction).
    """
    alignment = _required_alignment(group, policy)
    data = aligned_zeros(group.numel, torch_dtype(group.dtype), device, alignment)
    buffer = FlatParamBuffer(group, data, params)
    for slot, param in zip(group.params, params):
        view = buffer.param_view(slot.index)
        with torch.no_grad():
            view.copy_(param.data)
        if slot.numel and view.data_ptr() % alignment:
            raise RuntimeError(f"parameter {slot.name!r}: view at data_ptr {view.data_ptr():#x} is not {alignment}-byte aligned")
        param.data = view
    return buffer


def aligned_zeros(numel: int, dtype: torch.dtype, device: torch.device, alignment: int) -> torch.Tensor:
    """A zeroed 1-D tensor whose data_ptr() is a multiple of ``alignment`` bytes.

    Allocators align to 64 (CPU) or 256+ (CUDA) bytes; larger alignments need a shifted start.
    """
    element = torch.empty((), dtype=dtype).element_size()
    slack = max(alignment // element - 1, 0)
    raw = torch.zeros(numel + slack, dtype=dtype, device=device)
    shift = (-raw.data_ptr() % alignment) // element
    return raw[shift : shift + numel]


def owns_storage(buffer: FlatParamBuffer, param: torch.Tensor) -> bool:
    """Whether ``param`` lies inside the buffer's storage (for tests and checks)."""
    start = buffer.data.data_ptr()
    end = start + buffer.data.numel() * buffer.data.element_size()
    return start <= param.data_ptr() and param.data_ptr() + param.numel() * param.element_size() <= end


def _required_alignment(group: GroupLayout, policy: LayoutPolicy) -> int:
    if policy.kind == "native" and not policy.compact:
        return policy.alignment_bytes
    if policy.kind == "deepspeed" and policy.parameter_alignment:
        return 16
    return itemsize(group.dtype)
