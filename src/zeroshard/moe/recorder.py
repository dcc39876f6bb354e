"""Watch ``torch._grouped_mm``: record, at each call, the stacked expert weight it was given.

The alignment CUDA's grouped GEMM needs is the alignment of the operands it receives, so it
is read at the call: the weight's ``data_ptr()``, each expert matrix's, the row stride, and
whether the weight lies in a flat buffer (the caller says which weights do; a call is matched
to them by address). Used by the MoE demo; a test or a user can wrap any forward the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GroupedMMCall:
    """One ``torch._grouped_mm`` call as it happened: the stacked expert weight it read."""

    rank: int
    step: int
    index: int  # the call's place in the step's forward
    param: str  # the expert parameter whose storage it read; "" if none of them
    shape: tuple[int, ...]
    dtype: str
    expert_ids: tuple[int, ...]  # global ids of the stacked experts, in order
    address: int  # data_ptr() of the stacked weight
    weight_mod_16: int  # data_ptr() % 16 of the stacked weight
    expert_mod_16: tuple[int, ...]  # data_ptr() % 16 of each expert's matrix
    row_stride_bytes: int  # of each expert's matrix (CUDA wants a multiple of 16)
    in_flat_buffer: bool  # the weight is a view of the engine's flat buffer

    @property
    def aligned(self) -> bool:
        return self.weight_mod_16 == 0 and not any(self.expert_mod_16) and self.row_stride_bytes % 16 == 0


class GroupedMMRecorder:
    """Records every ``torch._grouped_mm`` call while :meth:`watching`, tagged with ``step``.

    ``experts`` names the stacked expert weights a call may read: name -> (the weight, the
    global ids of its experts, whether it is a view of a flat buffer).
    """

    def __init__(self, rank: int, experts: dict[str, tuple[torch.Tensor, tuple[int, ...], bool]]) -> None:
        self.rank = rank
        self.step = 0
        self.calls: dict[int, list[GroupedMMCall]] = {}  # by step
        self._by_address = {
            weight.data_ptr(): (name, ids, in_buffer) for name, (weight, ids, in_buffer) in experts.items()
        }

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        real = torch._grouped_mm

        def recording(tokens: torch.Tensor, weight: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            self._record(weight)
            return real(tokens, weight, *args, **kwargs)

        torch._grouped_mm = recording
        try:
            yield
        finally:
            torch._grouped_mm = real

    def at_step(self, step: int) -> list[GroupedMMCall]:
        return self.calls.get(step, [])

    def _record(self, weight: torch.Tensor) -> None:
        name, expert_ids, in_buffer = self._by_address.get(weight.data_ptr(), ("", (), False))
        calls = self.calls.setdefault(self.step, [])
        calls.append(
            GroupedMMCall(
                rank=self.rank,
                step=self.step,
                index=len(calls),
                param=name,
                shape=tuple(weight.shape),
                dtype=str(weight.dtype).removeprefix("torch."),
                expert_ids=tuple(expert_ids),
                address=weight.data_ptr(),
                weight_mod_16=weight.data_ptr() % 16,
                expert_mod_16=tuple(expert.data_ptr() % 16 for expert in weight),
                row_stride_bytes=weight.stride(1) * weight.element_size(),
                in_flat_buffer=in_buffer,
            )
        )
