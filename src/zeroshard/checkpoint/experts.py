"""Expert stacks in exports: one global stacked tensor under the parameter's own name, or one
tensor per expert named by global id, as each stack's description says
(:class:`~zeroshard.layout.ExpertStack`, recorded in the layout).

* ``"stacked"``: ``model.layers.0.mlp.experts.gate_up_proj`` ``[E, 2I, H]``, the run's
  ``[E / EP, 2I, H]`` with every expert by global id, in its own orientation: what
  ``from_pretrained`` of a transformers v5 model, or a user's own model with ``strict=True``,
  loads.
* ``"per_expert"``: per :func:`~zeroshard.layout.stacks.per_expert_tensors`, each matrix
  ``[out, in]`` (an ``in_out`` slice transposed, an ``out_in`` one not, parts split by rows):
  MoEGPT's ``blocks.0.moe.experts.{g}.w1.weight``, transformers' ``mlp.experts.{g}.gate_proj.weight``.

No exported name or shape depends on E's split over ranks, so exports of one state at any
(W, EP) agree name for name and byte for byte. Torch-free: the universal and fp32 exports use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection

import numpy as np

from ..layout import LEGACY_STACK, Layout, global_shape
from ..layout.coordinates import expert_numel
from ..layout.stacks import ExpertStack, exported_expert_shape, per_expert_name_clash, per_expert_tensors
from .source import ShardSource, read_param, read_whole_param

EXPERT_FORMS = ("stacked", "per_expert")
UNIVERSAL_FORM = "universal"  # legacy stacks per expert (universal version 2), every other stack stacked


@dataclass(frozen=True)
class ExportedParam:
    """One exported tensor of a trained parameter: a dense parameter or a stack whole, or
    (rows of) one expert of a stack."""

    name: str  # the exported name
    shape: tuple[int, ...]  # the exported shape
    param: str  # the layout's parameter it comes from
    expert: int | None = None  # the global expert id, for one expert of a stack
    rows: tuple[int, int] = (0, 0)  # rows [start, end) of the expert's exported matrix it holds
    transpose: bool = False  # the stack holds the expert [in, out]; the export is [out, in]


def exported_params(layout: Layout, experts: str | None = None) -> list[ExportedParam]:
    """The exported tensors of the layout's trained parameters, in layout order.

    ``experts`` forces one form on every stack (``"stacked"`` or ``"per_expert"``); None
    writes each in its own ``export`` form. ValueError naming the parameter for a stack the
    form cannot express (per expert, a legacy stack that is no stack of matrices)."""
    if experts not in (None, UNIVERSAL_FORM, *EXPERT_FORMS):
        raise ValueError(f"expert export form must be one of {', '.join(EXPERT_FORMS)}, got {experts!r}")
    exported: list[ExportedParam] = []
    for group in layout.groups:
        for slot in group.params:
            if not group.is_expert_group:
                exported.append(ExportedParam(slot.name, slot.spec.shape, slot.name))
                continue
            stack = group.stacks[slot.index]
            if _form(stack, experts) == "stacked":
                exported.append(ExportedParam(slot.name, global_shape(group, slot), slot.name))
            else:
                exported += _per_expert(slot.name, stack, global_shape(group, slot), slot.spec.shape)
    return exported


def per_expert_clash(layout: Layout, others: Collection[str]) -> str | None:
    """Why a per-expert export of ``layout``'s stacks would write two tensors under one name
    (:func:`~zeroshard.layout.stacks.per_expert_name_clash`), counting ``others`` (the
    checkpoint's module tensors and tied names) and the layout's parameters; or None."""
    stacks = [
        (slot.name, group.stacks[slot.index], sum(map(len, group.expert_map)))
        for group in layout.groups
        if group.is_expert_group
        for slot in group.params
    ]
    return per_expert_name_clash(stacks, {*others, *layout.param_names}) if stacks else None


def _form(stack: ExpertStack, experts: str | None) -> str:
    if experts == UNIVERSAL_FORM:
        return "per_expert" if stack == LEGACY_STACK else "stacked"
    return experts or stack.export


def _per_expert(name: str, stack: ExpertStack, shape: tuple[int, ...], local: tuple[int, ...]) -> list[ExportedParam]:
    if stack == LEGACY_STACK and len(shape) != 3:
        raise ValueError(
            f"expert weight {name!r} has shape {list(local)}: exports hold one [out, in] "
            "matrix per expert, so stacked expert weights must be [experts, in, out]"
        )
    experts, expert_shape = shape[0], shape[1:]
    out_shape = exported_expert_shape(stack, expert_shape)
    transpose = stack.orientation == "in_out"
    return [
        ExportedParam(tensor.name, _rows_shape(out_shape, tensor.row_start, tensor.row_end), name, g,
                      (tensor.row_start, tensor.row_end), transpose)  # fmt: skip
        for g in range(experts)
        for tensor in per_expert_tensors(name, stack, g, expert_shape)
    ]


def _rows_shape(shape: tuple[int, ...], start: int, end: int) -> tuple[int, ...]:
    return (end - start, *shape[1:]) if shape else shape


def read_exported(
    source: ShardSource, param: ExportedParam, key: str, check: Callable[..., None] | None = None
) -> np.ndarray:
    """The ``key`` tensor ("fp32" or an optimizer state) of ``param`` as fp32, flattened in
    the exported shape: a whole parameter or stack (experts by global id), or an expert's
    slice of a stack (read by global expert id), transposed to [out, in] where the stack
    holds it [in, out], its rows cut to the part. ``check(param, expert, key, values)``, if
    given, sees the values in logical order first, each expert of a stack on its own (a
    :class:`~.attest.read_digests.ReadChecker` digests them there), once per expert."""
    group, slot = source.info.layout.param(param.param)
    if param.expert is None:
        values = read_whole_param(source, param.param, key)
        if check is not None and group.is_expert_group:
            numel = expert_numel(slot)
            for expert in range(values.size // numel if numel else 0):
                check(param.param, expert, key, values[expert * numel : (expert + 1) * numel])
        elif check is not None:
            check(param.param, None, key, values)
        return values
    numel = expert_numel(slot)
    expert = read_param(source, param.param, key, param.expert * numel, (param.expert + 1) * numel)
    if check is not None and param.rows[0] == 0:  # the first part of the expert checks it whole
        check(param.param, param.expert, key, expert)
    expert = expert.reshape(slot.spec.shape[1:])
    if param.transpose:
        expert = expert.T
    start, end = param.rows
    if expert.ndim and (start, end) != (0, expert.shape[0]):
        expert = expert[start:end]
    return np.ascontiguousarray(expert).reshape(-1)


def stacked_from_exported(expert: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """One exported legacy expert tensor (``shape`` [out, in], flat) back in the stack's
    orientation [in, out], flattened: the inverse of :func:`read_exported`'s transpose."""
    d_out, d_in = shape
    return np.ascontiguousarray(expert.reshape(d_out, d_in).T).reshape(-1)
