"""DeepSpeed's Muon (``MuonWithAuxAdam``) in ZeRO-1/2 checkpoints: its groups and its momentum.

DeepSpeed puts each parameter tagged ``use_muon`` (a matrix) in a group whose saved
hyperparameters say ``"use_muon": true``, the rest in groups saying false, where torch's
(or DeepSpeed's) Adam keeps ``exp_avg`` and ``exp_avg_sq`` in the partition's layout. A Muon
group's one state, ``momentum_buffer``, has a layout of its own (DeepSpeed 0.19.8,
``DeepSpeedZeroOptimizer._muon_momentum_buffer``): not the partition's, but the momentum of
every matrix with a piece in the rank's partition, whole, back to back in flat order, with no
alignment or tail padding, in the gradients' dtype. A matrix split across partitions is held
whole by each of its owners.

:func:`muon_groups` says which layout groups are Muon's and checks what the checkpoint says
of them against the layout; :class:`PartitionMomentum` presents a rank's momentum in the
partition's layout (each owner's piece of a split matrix from its own copy, padding as
zeros), so that everything reading a :class:`~zeroshard.checkpoint.source.ShardSource`
(universal conversion, fp32 export, resharded load) reads it as any other state, under its
name ``momentum_buffer``, the name ``torch.optim.Muon`` gives it too.
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any

import numpy as np

from ...io.budget import quoted
from ...io.dtypes import to_float32
from ...layout import GroupLayout, Layout
from ...layout.coordinates import shard_rank
from ...torchfile.torch_file import StoredTensor
from .pickled import DeepSpeedFormatError

MOMENTUM = "momentum_buffer"
USE_MUON = "use_muon"


def muon_groups(
    layout: Layout, param_groups: list[dict[str, Any]], states: list[dict[str, Any]], path: Path
) -> set[int]:
    """The indices of the groups rank 0's file ``path`` says are Muon's (``use_muon`` true),
    after checking that their flags agree with their parameters and states: a Muon group
    holds only matrices, a group saying ``use_muon: false`` holds no ``momentum_buffer``
    (:func:`partition_states` checks each rank's Muon states). A disagreement is a one-line
    DeepSpeedFormatError naming the group and the parameter or state."""
    found = set()
    for group, hyper, group_states in zip(layout.groups, param_groups, states):
        flag = hyper.get(USE_MUON)
        where = f"{path}, group {group.index}"
        if flag is None:
            continue
        if type(flag) is not bool:
            raise DeepSpeedFormatError(f"{where}: use_muon is {flag_text(flag)}, expected true or false")
        if not flag:
            if MOMENTUM in group_states:
                raise DeepSpeedFormatError(f"{where}: use_muon is false, but the group holds Muon's {MOMENTUM!r}")
            continue
        for slot in group.params:
            if len(slot.spec.shape) < 2:
                raise DeepSpeedFormatError(
                    f"{where}: use_muon is true, but parameter {quoted(slot.name)} of shape "
                    f"{quoted(list(slot.spec.shape))} is not a matrix (Muon updates matrices only)"
                )
        found.add(group.index)
    return found


class PartitionMomentum:
    """One rank's Muon momentum (whole matrices back to back) read in the partition's layout:
    the ``read`` / ``numel`` / ``dtype`` / ``is_contiguous`` a source asks of a saved state."""

    def __init__(self, saved: StoredTensor | None, group: GroupLayout, rank: int, where: str) -> None:
        place = shard_rank(group, rank)
        self._saved = saved
        self._numel = group.partition_numel
        self.dtype = saved.dtype if saved is not None else "float32"
        self._fragments = group.fragments(place)
        self._starts = [fragment.partition_start for fragment in self._fragments]
        # Where each fragment's matrix starts in the buffer: the matrices held, whole, in order.
        self._whole_starts = []
        held = 0
        for fragment in self._fragments:
            self._whole_starts.append(held)
            held += group.params[fragment.param_index].spec.numel
        if (saved.numel() if saved is not None else 0) != held:
            found = f"has {saved.numel()} elements" if saved is not None else "is missing"
            raise DeepSpeedFormatError(
                f"{where}: {MOMENTUM!r} {found}, but the {len(self._fragments)} matrices "
                f"with a piece in the partition have {held} (DeepSpeed keeps each whole)"
            )

    def numel(self) -> int:
        """The partition's size: what the momentum reads as, padding included."""
        return self._numel

    def is_contiguous(self) -> bool:
        """False: a read gathers pieces (the caller then reads through :meth:`read`)."""
        return False

    def read(self, start: int, end: int) -> np.ndarray:
        """Elements [start, end) of the partition as fp32; padding reads as zeros."""
        out = np.zeros(end - start, dtype=np.float32)
        first = max(0, bisect.bisect_right(self._starts, start) - 1)
        for index in range(first, len(self._fragments)):
            fragment = self._fragments[index]
            if fragment.partition_start >= end:
                break
            lo = max(start, fragment.partition_start)
            hi = min(end, fragment.partition_start + fragment.length)
            if lo >= hi:
                continue
            assert self._saved is not None  # __init__: no momentum, no fragments
            at = self._whole_starts[index] + fragment.param_start + lo - fragment.partition_start
            out[lo - start : hi - start] = to_float32(self._saved.read(at, at + hi - lo))
        return out


def partition_states(
    layout: Layout, states: list[dict[str, StoredTensor]], param_groups: list[dict[str, Any]], rank: int,
    muon: set[int], path: Path,
) -> list[dict[str, Any]]:
    """Rank ``rank``'s per-group states (from its file ``path``), each Muon group's momentum
    as a :class:`PartitionMomentum`, after checking that the file's ``use_muon`` flags are
    rank 0's. A rank whose partition holds no piece of a Muon group's matrices may hold no
    momentum for it: it reads as zeros."""
    found: list[dict[str, Any]] = []
    for group, group_states, hyper in zip(layout.groups, states, param_groups):
        where = f"{path}, group {group.index}, rank {rank}"
        is_muon = group.index in muon
        if (hyper.get(USE_MUON) is True) != is_muon:
            raise DeepSpeedFormatError(
                f"{where}: use_muon is {flag_text(hyper.get(USE_MUON))}, rank 0's file says {flag_text(is_muon)}"
            )
        if not is_muon:
            found.append(group_states)
            continue
        others = sorted(set(group_states) - {MOMENTUM})
        if others:
            raise DeepSpeedFormatError(
                f"{where}: use_muon is true, but the group holds optimizer state {quoted(others)} besides {MOMENTUM!r}"
            )
        found.append({MOMENTUM: PartitionMomentum(group_states.get(MOMENTUM), group, rank, where)})
    return found


def flag_text(value: Any) -> str:
    """A ``use_muon`` value for a message: true / false as in the config, anything else quoted."""
    return str(value).lower() if type(value) is bool else quoted(value)
