"""Expert stacks: what a stacked expert parameter is, where its experts live, and the names
of its experts' tensors in per-expert checkpoints.

An expert stack is a parameter whose dimension 0 enumerates experts (grouped_mm's group
dimension): ``[E_local, ...]`` on a rank, ``[E, ...]`` globally, experts in global id order.
:class:`ExpertStack` says how each expert's slice is oriented and how exports write it; the
layout records one per parameter of an expert group, so the engine, the exports, the
universal format and the importers read the same facts. docs/DESIGN.md, "Expert stacks".

Pure and torch-free, like the rest of the layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Iterable, Sequence

ORIENTATIONS = ("out_in", "in_out", "none")
EXPORTS = ("stacked", "per_expert")


@dataclass(frozen=True)
class ExpertStack:
    """How one expert stack is oriented and exported.

    ``orientation``: each expert's slice is an ``[out, in]`` matrix (``"out_in"``, the
    ``nn.Linear`` and transformers orientation), an ``[in, out]`` one (``"in_out"``), or
    claims none (``"none"``: vectors, or a stack nobody described; never transposed).
    ``export``: exports write one global ``[E, ...]`` tensor under the parameter's own name
    (``"stacked"``) or one tensor per expert (``"per_expert"``). ``parts``: the per-expert
    checkpoint names the stack concatenates along each expert's output dimension, in order
    (transformers' Qwen3-MoE ``gate_up_proj``: ``("gate_proj", "up_proj")``); empty when an
    expert's slice is one tensor.

    Raises:
        ValueError: at construction, for an unknown orientation or export, parts that are
            not distinct plain names, or parts without an orientation.
    """

    orientation: str = "none"
    export: str = "stacked"
    parts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.orientation not in ORIENTATIONS:
            raise ValueError(f"expert stack orientation must be one of {', '.join(ORIENTATIONS)}, got {self.orientation!r}")
        if self.export not in EXPORTS:
            raise ValueError(f"expert stack export must be one of {', '.join(EXPORTS)}, got {self.export!r}")
        if not isinstance(self.parts, tuple) or not all(_plain_name(part) for part in self.parts):
            raise ValueError(f"expert stack parts must be a tuple of plain names (no dots), got {self.parts!r}")
        if len(set(self.parts)) != len(self.parts):
            raise ValueError(f"expert stack parts {list(self.parts)} name a part twice")
        if self.parts and self.orientation == "none":
            raise ValueError("an expert stack with parts must say its orientation (out_in or in_out)")

    @property
    def is_matrix(self) -> bool:
        """Whether each expert's slice is a matrix of known orientation."""
        return self.orientation != "none"

    def to_dict(self) -> dict[str, Any]:
        """The three fields, JSON-ready (``parts`` as a list)."""
        return {"orientation": self.orientation, "export": self.export, "parts": list(self.parts)}

    @classmethod
    def from_dict(cls, data: Any) -> ExpertStack:
        """From :meth:`to_dict` output; ValueError for anything else."""
        if not isinstance(data, dict) or set(data) != {"orientation", "export", "parts"}:
            raise ValueError(f"an expert stack is {{orientation, export, parts}}, got {data!r}")
        parts = data["parts"]
        if not isinstance(parts, list):
            raise ValueError(f"expert stack parts must be a list, got {parts!r}")
        return cls(data["orientation"], data["export"], tuple(parts))


# What a layout without stack descriptions means: MoEGPT's [E, in, out] stacks, exported per
# expert (every checkpoint written before stacks were described).
LEGACY_STACK = ExpertStack("in_out", "per_expert")
# An "expert": True parameter nobody described: exported whole under its own name, never transposed.
UNDECLARED_STACK = ExpertStack("none", "stacked")


def check_expert_map(expert_map: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """A placement of global experts on EP ranks, checked: every EP rank holds the same
    number (>= 1) of experts and every id ``0..E-1`` appears exactly once. Returns it as
    tuples; ValueError saying what is wrong."""
    try:
        placement = tuple(tuple(experts) for experts in expert_map)
    except TypeError:
        raise ValueError("the expert map must be a list of lists of expert ids") from None
    if not placement:
        raise ValueError("the expert map must hold at least one expert-parallel rank")
    local = len(placement[0])
    if local < 1 or any(len(experts) != local for experts in placement):
        raise ValueError("the expert map must give every expert-parallel rank the same number (>= 1) of experts")
    ids = [expert for experts in placement for expert in experts]
    if not all(isinstance(e, int) and not isinstance(e, bool) for e in ids) or sorted(ids) != list(range(len(ids))):
        raise ValueError(f"the expert map must hold each of experts 0..{len(ids) - 1} exactly once, got {[list(e) for e in placement]}")
    return placement


def expert_slots(expert_map: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """``slots[g]``: where global expert ``g`` sits when the EP ranks' experts are laid end to
    end (``ep_rank * E_local + local index``). Sorting rows by slot groups them by EP rank,
    then by local expert, which is the order token dispatch sends them in."""
    placement = check_expert_map(expert_map)
    slots = [0] * sum(len(experts) for experts in placement)
    for ep_rank, experts in enumerate(placement):
        for local, expert in enumerate(experts):
            slots[expert] = ep_rank * len(experts) + local
    return tuple(slots)


@dataclass(frozen=True)
class PerExpertTensor:
    """One tensor of one expert in a per-expert checkpoint: its name, and the rows of the
    expert's ``[out, in]`` matrix (or of its slice, when not a matrix) it holds."""

    name: str
    row_start: int
    row_end: int


def per_expert_tensors(name: str, stack: ExpertStack, expert_id: int, expert_shape: Sequence[int]) -> list[PerExpertTensor]:
    """The tensors that hold expert ``expert_id`` of stack ``name`` in a per-expert
    checkpoint, with ``expert_shape`` one expert's slice as the stack holds it.

    For ``P.L`` (prefix ``P``, leaf ``L``): with parts, ``P.{g}.{part}.weight`` each, an equal
    share of the ``[out, in]`` matrix's rows; else ``P.{g}.L`` when ``L`` is ``weight`` or
    ``bias`` (the stack is the ``L`` of a list of modules ``P``); else ``P.{g}.L.weight`` for
    a matrix, ``P.{g}.L`` for anything else. Rows count in the exported ``[out, in]``
    orientation (an ``in_out`` slice transposed); a slice that is no matrix is one tensor.

    Raises:
        ValueError: the rows do not split evenly into the stack's parts.
    """
    names = per_expert_names(name, stack, expert_id)
    rows = _exported_shape(stack, expert_shape)[0] if expert_shape else 1
    if rows % len(names):
        raise ValueError(f"expert stack {name!r}: {rows} output rows do not split evenly into parts {list(stack.parts)}")
    share = rows // len(names)
    return [PerExpertTensor(tensor, i * share, (i + 1) * share) for i, tensor in enumerate(names)]


def per_expert_names(name: str, stack: ExpertStack, expert_id: int) -> list[str]:
    """The names of :func:`per_expert_tensors` (one per part, in order), which depend on
    neither the expert's shape nor the number of experts."""
    prefix, _, leaf = name.rpartition(".")
    base = f"{prefix}.{expert_id}" if prefix else str(expert_id)
    if stack.parts:
        return [f"{base}.{part}.weight" for part in stack.parts]
    if leaf in ("weight", "bias"):
        return [f"{base}.{leaf}"]
    suffix = ".weight" if stack.is_matrix else ""
    return [f"{base}.{leaf}{suffix}"]


def per_expert_name_clash(stacks: Iterable[tuple[str, ExpertStack, int]], others: Collection[str] = ()) -> str | None:
    """Why a per-expert export of ``stacks`` ((name, description, number of experts) each)
    would write two tensors under one name, or None: two stacks name one per-expert tensor
    (a ``parts`` typo), or one names a tensor of ``others`` (the export's other names). One
    line naming both and the name. A stack is checked in this form whatever its ``export``:
    ``--experts per-expert`` forces it on every stack."""
    others = set(others)
    owner: dict[str, str] = {}
    for name, stack, experts in stacks:
        for expert_id in range(experts):
            for tensor in per_expert_names(name, stack, expert_id):
                if tensor in others:
                    return f"expert stack {name!r} names per-expert tensor {tensor!r}, the name of another tensor of the model"
                first = owner.setdefault(tensor, name)
                if first != name:
                    return f"expert stacks {first!r} and {name!r} both name per-expert tensor {tensor!r}"
    return None


def exported_expert_shape(stack: ExpertStack, expert_shape: Sequence[int]) -> tuple[int, ...]:
    """One expert's shape in a per-expert checkpoint: ``[out, in]`` for a matrix (an
    ``in_out`` slice transposed), the slice's own shape otherwise."""
    return _exported_shape(stack, expert_shape)


def check_stack_shape(name: str, stack: ExpertStack, shape: Sequence[int]) -> None:
    """ValueError naming ``name`` unless ``shape`` (the stack's, experts first) fits ``stack``:
    an oriented stack is a stack of matrices."""
    if not shape:
        raise ValueError(f"expert stack {name!r} has no expert dimension (a 0-d tensor)")
    if stack.is_matrix and len(shape) != 3:
        raise ValueError(
            f"expert stack {name!r} has shape {list(shape)}: orientation {stack.orientation!r} "
            "needs a stack of matrices [experts, rows, columns]"
        )


def _exported_shape(stack: ExpertStack, expert_shape: Sequence[int]) -> tuple[int, ...]:
    shape = tuple(expert_shape)
    return shape[::-1] if stack.orientation == "in_out" else shape


def _plain_name(part: object) -> bool:
    return isinstance(part, str) and bool(part) and "." not in part
