"""Partitions of a world of one whose parameters lie back to back: how a source without ranks reads.

A universal checkpoint, or a checkpoint read in another model's names, has no partitions of
its own; it presents itself as the run of one rank that would hold its parameters in the
compact layout (each group's parameters back to back, the only padding at its tail). A range
of that partition is then the parameter ranges it covers, each read by the source's own
``read_param(name, start, end)`` (elements of the flattened parameter, as fp32); padding
between them reads as zeros.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from ..layout import GroupLayout, Layout, LayoutPolicy, ParamSlot

# Parameters back to back, each group's tail padded to 16 bytes.
PACKED_POLICY = LayoutPolicy.native(compact=True)

ReadParam = Callable[[str, int, int], np.ndarray]  # (name, start, end) -> elements, fp32
ReadParamInto = Callable[[str, int, np.ndarray], None]  # (name, start, out): elements into out

if TYPE_CHECKING:
    from .source import SourceInfo


class PackedPartitions:
    """Reads of rank 0's partitions of ``layout`` (a world of one) by parameter ranges."""

    def __init__(self, layout: Layout, path: Path, what: str) -> None:
        self.layout = layout
        self.path = path
        self._what = what  # "a universal checkpoint has no ranks": why only rank 0 exists
        self._param_ends = [[slot.end for slot in group.params] for group in layout.groups]

    def read(self, rank: int, group: int, start: int, end: int, read_param: ReadParam) -> np.ndarray:
        """Elements [start, end) of group ``group``'s partition, as fp32."""
        slots = self._slots(rank, group, start, end)
        if slots and slots[0].offset <= start and end <= slots[0].end:  # within one parameter: no copy
            return read_param(slots[0].name, start - slots[0].offset, end - slots[0].offset)
        out = np.empty(end - start, dtype=np.float32)
        self.read_into(rank, group, start, out, functools.partial(_copy_into, read_param))
        return out

    def read_into(self, rank: int, group: int, start: int, out: np.ndarray, read_param_into: ReadParamInto) -> None:
        """:meth:`read` into ``out``: each parameter's range read into its place in ``out``
        (``read_param_into``); padding between them is zeros."""
        end, cursor = start + out.size, start
        for slot, lo, hi in self.overlaps(rank, group, start, end):
            out[cursor - start : lo - start] = 0
            read_param_into(slot.name, lo - slot.offset, out[lo - start : hi - start])
            cursor = hi
        out[cursor - start :] = 0

    def group(self, group: int) -> GroupLayout:
        """Layout group ``group``; ValueError naming the checkpoint when there is no such group."""
        groups = self.layout.groups
        if not 0 <= group < len(groups):
            raise ValueError(f"{self.path}: group {group} does not exist (the checkpoint has {len(groups)})")
        return groups[group]

    def _slots(self, rank: int, group: int, start: int, end: int) -> tuple[ParamSlot, ...]:
        """The parameters from the one that holds (or follows) element ``start`` on."""
        if rank != 0:
            raise ValueError(f"rank {rank} is outside world size 1 ({self._what})")
        layout_group = self.group(group)
        if not 0 <= start <= end <= layout_group.partition_numel:
            numel = layout_group.partition_numel
            raise ValueError(f"range [{start}, {end}) is outside group {group}'s partition of {numel} elements")
        return layout_group.params[bisect.bisect_right(self._param_ends[group], start) :]

    def overlaps(self, rank: int, group: int, start: int, end: int) -> Iterator[tuple[ParamSlot, int, int]]:
        """Each parameter that elements [start, end) reach into, in order, and the part of
        the range it holds, [lo, hi) in the partition's elements."""
        for slot in self._slots(rank, group, start, end):
            if slot.offset >= end:
                return
            lo, hi = max(slot.offset, start), min(slot.end, end)
            if lo < hi:
                yield slot, lo, hi


def _copy_into(read_param: ReadParam, name: str, start: int, out: np.ndarray) -> None:
    out[...] = read_param(name, start, start + out.size)


class PackedSource:
    """The range reads of a source that is a world of one: ``read`` and ``read_into`` of the
    ShardSource protocol, through ``_packed`` (the source's :class:`PackedPartitions`) and its
    ``_read_param(name, start, end, *, key)``."""

    info: SourceInfo
    _packed: PackedPartitions

    @property
    def layout(self) -> Layout:
        """The layout of the world of one the source presents (``info.layout``)."""
        return self.info.layout

    def read(self, rank: int, group: int, key: str, start: int, end: int) -> np.ndarray:
        """Elements [start, end) of layout group ``group``'s only partition of ``key``, as fp32."""
        return self._packed.read(rank, group, start, end, functools.partial(self._read_param, key=key))

    def read_into(self, rank: int, group: int, key: str, start: int, out: np.ndarray) -> None:
        """:meth:`read` into ``out``: each parameter's range lands there, with no buffer between."""
        self._packed.read_into(rank, group, start, out, functools.partial(self._read_param_into, key=key))

    def _read_param(self, name: str, start: int, end: int, *, key: str) -> np.ndarray:
        raise NotImplementedError

    def _read_param_into(self, name: str, start: int, out: np.ndarray, *, key: str) -> None:
        """Elements [start, start + out.size) of parameter ``name``'s ``key`` into ``out``:
        read, then copied (a source that can read into place does so instead)."""
        _copy_into(functools.partial(self._read_param, key=key), name, start, out)
