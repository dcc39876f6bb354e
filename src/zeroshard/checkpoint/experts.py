"""Expert weights in exports: one tensor per expert and weight, named by global expert id, in
``nn.Linear`` orientation, as Hugging Face MoE checkpoints store them (Mixtral:
``block_sparse_moe.experts.{i}.w1.weight``).

A run holds an expert weight stacked, ``{prefix}.w1`` of shape ``[E / EP, in, out]``; its
export is ``{prefix}.{g}.w1.weight`` of shape ``[out, in]`` for every global expert ``g``. No
exported name or shape depends on E's split over ranks, so exports of one state at any
(W, EP) agree name for name and byte for byte. Torch-free: the universal and fp32 exports
use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..layout import Layout, global_shape
from .source import ShardSource, read_param, read_whole_param


@dataclass(frozen=True)
class ExportedParam:
    """One exported tensor of a trained parameter: a dense parameter whole, or one expert."""

    name: str  # the exported name
    shape: tuple[int, ...]  # the exported shape
    param: str  # the layout's parameter it comes from
    expert: int | None = None  # the global expert id, for one expert of a stacked weight


def per_expert_name(stacked_name: str, expert_id: int) -> str:
    """``blocks.0.moe.experts.7.w1.weight`` for expert 7 of ``blocks.0.moe.experts.w1``."""
    prefix, _, weight = stacked_name.rpartition(".")
    return f"{prefix}.{expert_id}.{weight}.weight" if prefix else f"{expert_id}.{weight}.weight"


def exported_params(layout: Layout) -> list[ExportedParam]:
    """The exported tensors of the layout's trained parameters, in layout order; a stacked
    expert weight gives one per global expert, in expert order. ValueError naming the
    parameter for an expert weight that is not a stack of matrices."""
    exported: list[ExportedParam] = []
    for group in layout.groups:
        for slot in group.params:
            if not group.is_expert_group:
                exported.append(ExportedParam(slot.name, slot.spec.shape, slot.name))
                continue
            shape = global_shape(group, slot)
            if len(shape) != 3:
                raise ValueError(
                    f"expert weight {slot.name!r} has shape {list(slot.spec.shape)}: exports hold one [out, in] "
                    "matrix per expert, so stacked expert weights must be [experts, in, out]"
                )
            experts, d_in, d_out = shape
            exported += [
                ExportedParam(per_expert_name(slot.name, g), (d_out, d_in), slot.name, g) for g in range(experts)
            ]
    return exported


def read_exported(
    source: ShardSource, param: ExportedParam, key: str, check: Callable[..., None] | None = None
) -> np.ndarray:
    """The ``key`` tensor ("fp32" or an optimizer state) of ``param`` as fp32, flattened in
    the exported shape: an expert's slice of the stacked weight (read by global expert id),
    transposed to [out, in]. ``check(param, expert, key, values)``, if given, sees the values
    in logical order first (a :class:`~.read_digests.ReadChecker` digests them there)."""
    if param.expert is None:
        values = read_whole_param(source, param.param, key)
        if check is not None:
            check(param.param, None, key, values)
        return values
    d_out, d_in = param.shape
    numel = d_out * d_in
    stacked = read_param(source, param.param, key, param.expert * numel, (param.expert + 1) * numel)
    if check is not None:
        check(param.param, param.expert, key, stacked)
    return np.ascontiguousarray(stacked.reshape(d_in, d_out).T).reshape(-1)


def stacked_from_exported(expert: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """One exported expert tensor (``shape`` [out, in], flat) back in the stacked weight's
    orientation [in, out], flattened: the inverse of :func:`read_exported`'s transpose."""
    d_out, d_in = shape
    return np.ascontiguousarray(expert.reshape(d_out, d_in).T).reshape(-1)
