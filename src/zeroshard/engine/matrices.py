"""Whole matrices for optimizers that update them whole (Muon).

A torch optimizer such as ``torch.optim.Muon`` needs each weight as a 2-D tensor. The engine
lays out the groups such an optimizer trains as owner groups (``zeroshard.layout.owners``):
every matrix (a parameter, or one expert of a stack) lies whole in one rank's partition. On
that rank the optimizer gets, for each matrix it owns, an ``nn.Parameter`` that is a 2-D view
of the fp32 master partition, and at each step a 2-D view of the gradient partition as its
``grad``: the same optimizer class runs unchanged, each matrix is updated exactly once per
step across the job, and the masters stay one flat partition per group, as every other
part of the engine and the checkpoint formats hold them.

Optimizer state: the optimizer creates its state per matrix (Muon's ``momentum_buffer``);
after each step :class:`MatrixStates` copies each matrix-shaped state tensor into one flat
partition-shaped tensor per group and state name (once: afterwards the optimizer's entry
is a view of it), so a checkpoint reads the group's state as it reads an elementwise
optimizer's, without a copy per save. A rank that owns no matrix of a group has no state
the optimizer made: after the first step the ranks tell each other which states each group
has (:meth:`MatrixStates.described`, one all-gather), and such a rank holds zeros, so every
rank's share has the same states.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..layout import GroupLayout
from ..layout.specs import ParamSpec

WHOLE_MATRICES_ATTRIBUTE = "zeroshard_whole_matrices"


def needs_whole_matrices(optimizer_class: Any) -> bool:
    """Whether ``optimizer_class`` updates each weight as a whole matrix: ``torch.optim.Muon``
    and its subclasses, or a class that sets ``zeroshard_whole_matrices = True``."""
    muon = getattr(torch.optim, "Muon", None)
    if isinstance(optimizer_class, type) and muon is not None and issubclass(optimizer_class, muon):
        return True
    return getattr(optimizer_class, WHOLE_MATRICES_ATTRIBUTE, False) is True


def matrix_problem(spec: ParamSpec, expert: bool) -> str | None:
    """Why parameter ``spec`` cannot be trained as whole matrices, or None: a dense parameter
    must be a matrix, an expert stack a stack of matrices ``[E, M, N]``."""
    dims = len(spec.shape) - (1 if expert else 0)
    if dims == 2:
        return None
    what = f"an expert stack of shape {list(spec.shape)}" if expert else f"shape {list(spec.shape)}"
    hint = "" if expert or len(spec.shape) < 3 else " and is not a declared expert stack"
    return f"parameter {spec.name!r} has {what}{hint}: the optimizer updates 2-D matrices"


@dataclass
class MatrixView:
    """One matrix a rank owns: its 2-D view of the master partition, given to the optimizer."""

    param: nn.Parameter  # a view of the master partition, [M, N]
    partition_start: int
    shape: tuple[int, int]

    @property
    def numel(self) -> int:
        """The matrix's elements."""
        return self.shape[0] * self.shape[1]

    def of(self, partition: torch.Tensor) -> torch.Tensor:
        """The same matrix in another partition-shaped tensor (a gradient, a state): a view."""
        return partition[self.partition_start : self.partition_start + self.numel].view(self.shape)


def matrix_views(master: nn.Parameter, group: GroupLayout, rank: int) -> list[MatrixView]:
    """The matrices of ``group`` that ``rank`` (of its shard group) owns, in partition order,
    as views of ``master`` (the rank's fp32 partition of the group)."""
    views = []
    for fragment in group.fragments(rank):
        spec = group.params[fragment.param_index].spec
        shape = spec.shape[1:] if group.is_expert_group else spec.shape
        numel = shape[0] * shape[1]
        for first in range(0, fragment.length, numel):
            start = fragment.partition_start + first
            param = nn.Parameter(master.data[start : start + numel].view(shape))
            views.append(MatrixView(param, start, (shape[0], shape[1])))
    return views


class MatrixStates:
    """The flat, partition-shaped optimizer state of each owner group (see the module doc)."""

    def __init__(self, views: list[list[MatrixView] | None], partition_numels: list[int]) -> None:
        self.views = views  # per layout group: its matrices, or None for an elementwise group
        self.partition_numels = partition_numels
        self.flat: list[dict[str, torch.Tensor]] = [{} for _ in views]  # per layout group: name -> partition
        self.scalars: list[dict[str, torch.Tensor]] = [{} for _ in views]
        self.agreed = False  # whether every rank holds every state of every group (see complete)

    @classmethod
    def of(cls, masters: list[nn.Parameter], groups: Sequence[GroupLayout], rank_in: Callable[[GroupLayout], int]) -> MatrixStates:
        """The matrices of every owner group among ``groups`` that this rank owns (``rank_in``:
        its rank in a group's shard group), as views of its ``masters``; no state yet."""
        views = [matrix_views(master, group, rank_in(group)) if group.owner else None for master, group in zip(masters, groups)]
        return cls(views, [group.partition_numel for group in groups])

    def adopt(self, state: Any) -> None:
        """Make each matrix's state tensors views of the flat ones (copying what the
        optimizer made itself); a state entry that is no matrix is a group scalar (the same
        for every matrix, as ``step`` would be)."""
        for group_index, views in enumerate(self.views):
            for view in views or ():
                entry = state.get(view.param)
                if not entry:
                    continue
                for name, value in entry.items():
                    if torch.is_tensor(value) and tuple(value.shape) == view.shape:
                        entry[name] = self._adopted(group_index, view, name, value)
                    else:
                        self.scalars[group_index][name] = value if torch.is_tensor(value) else torch.tensor(value)

    def _adopted(self, group_index: int, view: MatrixView, name: str, value: torch.Tensor) -> torch.Tensor:
        flat = self.flat[group_index].get(name)
        if flat is None or flat.dtype != value.dtype or flat.device != value.device:
            flat = torch.zeros(self.partition_numels[group_index], dtype=value.dtype, device=value.device)
            self.flat[group_index][name] = flat
        target = view.of(flat)
        if target.data_ptr() != value.data_ptr():
            target.copy_(value)
        return target

    def described(self) -> list[tuple[dict[str, tuple[str, str]], dict[str, torch.Tensor]]]:
        """Per layout group: each partition state's (dtype, device type) and the scalars, for
        :meth:`complete` on every rank (sent by all-gather: no tensor of any size)."""
        return [
            ({name: (str(t.dtype), t.device.type) for name, t in flat.items()}, {k: v.cpu() for k, v in scalars.items()})
            for flat, scalars in zip(self.flat, self.scalars)
        ]

    def complete(self, reports: list[list[tuple[dict[str, tuple[str, str]], dict[str, torch.Tensor]]]], device: torch.device) -> None:
        """Every rank's :meth:`described`: hold zeros for the states other ranks have and
        this rank lacks (it owns no matrix of the group), and their scalars."""
        for group_index, views in enumerate(self.views):
            if views is None:
                continue
            for states, scalars in (report[group_index] for report in reports):
                for name, (dtype, _) in states.items():
                    if name not in self.flat[group_index]:
                        dtype_of = getattr(torch, dtype.removeprefix("torch."))
                        self.flat[group_index][name] = torch.zeros(self.partition_numels[group_index], dtype=dtype_of, device=device)
                for name, value in scalars.items():
                    self.scalars[group_index].setdefault(name, value.to(device))
        self.agreed = any(states or scalars for report in reports for states, scalars in report)

    def agree(self, comm: Any, device: torch.device) -> None:
        """Collective over ``comm`` (all ranks) unless already agreed or no group is an owner
        group: every rank holds every state of every owner group (see :meth:`complete`).
        Every rank calls it at the same point (after a step, after a load)."""
        if not self.agreed and any(views is not None for views in self.views):
            self.complete(comm.all_gather_object(self.described()), device)

    def partition_state(self, group_index: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(partition-shaped states, scalars) of an owner group."""
        return self.flat[group_index], self.scalars[group_index]

    def torch_entries(self, group_index: int, states: dict[str, torch.Tensor], scalars: dict[str, Any]) -> list[dict[str, Any]]:
        """Per matrix of the group, in order, its state entry in torch's form: views of
        ``states`` (partition-shaped tensors, which become the group's flat state) and the
        scalars."""
        self.flat[group_index] = dict(states)
        self.scalars[group_index] = dict(scalars)
        return [{**scalars, **{name: view.of(flat) for name, flat in states.items()}} for view in self.views[group_index] or ()]

    def clear(self) -> None:
        """Forget every group's state (the optimizer's is cleared with it)."""
        self.flat = [{} for _ in self.views]
        self.scalars = [{} for _ in self.views]
        self.agreed = False
