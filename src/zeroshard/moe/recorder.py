"""Watch ``torch._grouped_mm``: record, at each call, the expert weight it was given, and check
it (and, in backward, its gradient) against the rules CUDA's grouped GEMM enforces.

CPU torch checks none of these rules, so a run that would fail (or silently fall back to a
slow loop in transformers) on a GPU passes on a CPU. :func:`grouped_mm_problems` is the
check, read from the tensor the kernel receives (torch's meta registration of
``_grouped_mm``, which mirrors the CUDA checks, spells the stride rule):

* ``data_ptr() % 16 == 0``, and each expert's matrix too (base + g * stride(0));
* of the last two dimensions one has stride 1 and the other, the *leading* stride, is at
  least the size of the unit-stride one and a multiple of 16 bytes (row- or column-major:
  transformers passes ``weight.transpose(-2, -1)`` of an ``[E, out, in]`` stack, whose
  leading stride is ``in``).

The dtype rule (CUDA takes bf16) is reported apart (:attr:`GroupedMMCall.dtype`): fp32 runs
are checked for alignment only. Used by the MoE demos, the tests and benchmarks/gpu_check_moe.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

ALIGNMENT = 16  # bytes: the base pointer and the leading stride


def grouped_mm_problems(tensor: torch.Tensor) -> tuple[str, ...]:
    """Why CUDA's grouped GEMM would refuse ``tensor`` as an operand (empty: it would not),
    from its data_ptr, strides and element size. Checks a 2-D or 3-D tensor; a 3-D one's
    every group (expert) matrix too."""
    problems = []
    item = tensor.element_size()
    if tensor.data_ptr() % ALIGNMENT:
        problems.append(f"data_ptr % 16 = {tensor.data_ptr() % ALIGNMENT}")
    if tensor.dim() not in (2, 3):
        return (*problems, f"{tensor.dim()}-d, not 2-d or 3-d")
    if tensor.dim() == 3 and tensor.shape[0] > 1 and (tensor.stride(0) * item) % ALIGNMENT:
        starts = [(tensor.data_ptr() + g * tensor.stride(0) * item) % ALIGNMENT for g in range(tensor.shape[0])]
        problems.append(f"expert matrices at data_ptr % 16 = {sorted(set(starts))}")
    rows, columns = tensor.shape[-2:]
    row_stride, column_stride = tensor.stride()[-2:]
    if column_stride == 1 and row_stride >= max(1, columns):
        leading, dim = row_stride, tensor.dim() - 2
    elif row_stride == 1 and column_stride >= max(1, rows):
        leading, dim = column_stride, tensor.dim() - 1
    else:
        return (*problems, f"strides {list(tensor.stride())} are neither row- nor column-major for sizes {list(tensor.shape)}")
    if (leading * item) % ALIGNMENT:
        problems.append(f"stride of dimension {dim} is {leading * item} bytes, not a multiple of 16")
    return tuple(problems)


def leading_stride_bytes(tensor: torch.Tensor) -> int:
    """The larger of the last two strides, in bytes: the row stride of a row-major matrix,
    the column stride of a column-major one (the stride the 16-byte rule is about)."""
    return max(tensor.stride()[-2:]) * tensor.element_size() if tensor.dim() >= 2 else tensor.element_size()


@dataclass(frozen=True)
class GroupedMMCall:
    """One ``torch._grouped_mm`` call as it happened: the expert weight it read, checked."""

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
    row_stride_bytes: int  # the leading stride of each expert's matrix (CUDA wants a multiple of 16)
    in_flat_buffer: bool  # the weight is a view of the engine's flat buffer
    problems: tuple[str, ...] = ()  # grouped_mm_problems of the weight as passed
    input_problems: tuple[str, ...] = ()  # and of the tokens (mat_a)

    @property
    def aligned(self) -> bool:
        """The weight meets CUDA's alignment rules (dtype aside)."""
        return not self.problems


@dataclass(frozen=True)
class GradientCheck:
    """The gradient backward computed for the weight of one recorded call."""

    step: int
    index: int  # of the call whose weight it is
    shape: tuple[int, ...]
    problems: tuple[str, ...]


class GroupedMMRecorder:
    """Records every ``torch._grouped_mm`` call while :meth:`watching`, tagged with ``step``,
    and the gradient backward computes for each call's weight (:attr:`gradients`).

    ``experts`` names the stacked expert weights a call may read: name -> (the weight, the
    global ids of its experts, whether it is a view of a flat buffer). A call is matched to
    them by the address of the weight it was given (a transposed view shares it).
    """

    def __init__(self, rank: int, experts: dict[str, tuple[torch.Tensor, tuple[int, ...], bool]]) -> None:
        self.rank = rank
        self.step = 0
        self.calls: dict[int, list[GroupedMMCall]] = {}  # by step
        self.gradients: list[GradientCheck] = []
        self._by_address = {
            weight.data_ptr(): (name, ids, in_buffer) for name, (weight, ids, in_buffer) in experts.items()
        }

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Inside, ``torch._grouped_mm`` records each call under :attr:`step` (and checks its
        weight's gradient in backward); the real function is put back on exit."""
        real = torch._grouped_mm

        def recording(tokens: torch.Tensor, weight: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            call = self._record(tokens, weight)
            if weight.requires_grad and torch.is_grad_enabled():
                # An alias (same storage, strides and address) carries this call's gradient
                # hook; a hook on a leaf parameter itself would outlive the call.
                weight = weight.view_as(weight)
                weight.register_hook(self._gradient_hook(call))
            return real(tokens, weight, *args, **kwargs)

        torch._grouped_mm = recording
        try:
            yield
        finally:
            torch._grouped_mm = real

    def at_step(self, step: int) -> list[GroupedMMCall]:
        """The calls recorded at ``step``, in order (empty if none)."""
        return self.calls.get(step, [])

    def problems(self) -> list[str]:
        """Every rule broken by a recorded weight or its gradient, one line each."""
        lines = [
            f"rank {c.rank} step {c.step} call {c.index} ({c.param or '?'}): {p}"
            for calls in self.calls.values()
            for c in calls
            for p in c.problems
        ]
        lines += [f"rank {self.rank} step {g.step} call {g.index} gradient: {p}" for g in self.gradients for p in g.problems]
        return lines

    def _record(self, tokens: torch.Tensor, weight: torch.Tensor) -> GroupedMMCall:
        name, expert_ids, in_buffer = self._by_address.get(weight.data_ptr(), ("", (), False))
        calls = self.calls.setdefault(self.step, [])
        call = GroupedMMCall(
            rank=self.rank,
            step=self.step,
            index=len(calls),
            param=name,
            shape=tuple(weight.shape),
            dtype=str(weight.dtype).removeprefix("torch."),
            expert_ids=tuple(expert_ids),
            address=weight.data_ptr(),
            weight_mod_16=weight.data_ptr() % ALIGNMENT,
            expert_mod_16=tuple(expert.data_ptr() % ALIGNMENT for expert in weight) if weight.dim() == 3 else (),
            row_stride_bytes=leading_stride_bytes(weight),
            in_flat_buffer=in_buffer,
            problems=grouped_mm_problems(weight),
            input_problems=grouped_mm_problems(tokens),
        )
        calls.append(call)
        return call

    def _gradient_hook(self, call: GroupedMMCall):
        def check(grad: torch.Tensor) -> None:
            self.gradients.append(GradientCheck(call.step, call.index, tuple(grad.shape), grouped_mm_problems(grad)))

        return check
