"""A universal checkpoint as a :class:`ShardSource`: a world of one with parameters back to back.

A universal checkpoint has no ranks and no padding, so it is read as the run of one rank
that would hold its parameters in the compact layout: one layout group per (param group,
dtype), parameters in the manifest's order, the only padding at each group's tail. A
partition range then maps onto the parameters it covers, each read by range. Trained
weights are the fp32 masters cast to the dtype each parameter trained in (the format keeps
no low-precision copy), so ``info.weights_from_masters`` is set: a run may load them in
another dtype.

Expert weights come back as the run held them: each stacked weight is one parameter
``[E, in, out]`` of an expert group at EP = 1 (the contiguous expert map over one rank), whose
ranges are read from the per-expert ``[out, in]`` tensors, transposed back. So the loader
reshards a universal checkpoint to any (W, EP) as it does a native one.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import numpy as np

from ...layout import Layout, build_layout
from ...state import ParamGroupState
from ...io.block_reader import bytes_of
from ...io.observe import observe_bytes
from ...io.dtypes import cast
from ...io.checksum import FileRecord
from ...io.safetensors_io import ReadStats
from ...io.shared_checks import RecordTerms, SharedRecordChecks
from ..reshard import JobReads
from ..formats import SourceFormat
from ..packed import PACKED_POLICY, PackedPartitions, PackedSource
from ..attest.digests import StateDigests
from ..source import SourceInfo, in_place_target
from ..experts import stacked_from_exported
from .format import FORMAT_NAME, UniversalManifest, is_universal_checkpoint
from .read import UniversalCheckpoint, open_universal


class UniversalSource(PackedSource):
    """An opened universal checkpoint, read range by range (the ShardSource protocol)."""

    kind = FORMAT_NAME
    observes_reads = True  # read_into digests what it reads (``observe``): one CRC pass, not two
    reads_in_place = True  # prefetch takes ``into``, and file_offset says where ranges lie

    def __init__(self, checkpoint: str | os.PathLike[str] | UniversalCheckpoint, *, stats: ReadStats | None = None) -> None:
        self.checkpoint = open_universal(checkpoint, stats=stats)
        self.path: Path = self.checkpoint.directory
        manifest = self.checkpoint.manifest
        layout = build_layout(manifest.layout_groups(), 1, PACKED_POLICY)
        self._owner = [manifest.stacked(group.params[0].name).group for group in layout.groups]
        self.info = SourceInfo(
            layout=layout,
            optimizer_class=manifest.optimizer_class,
            param_groups=[
                ParamGroupState(
                    dict(group.hyperparameters),
                    [g for g, owner in enumerate(self._owner) if owner == index],
                    group.optimizer,
                )
                for index, group in enumerate(manifest.param_groups)
            ],
            state_keys=[_state_keys(layout, g, manifest) for g in range(len(layout.groups))],
            model_entries=list(manifest.model_entries.values()),
            aliases=dict(manifest.aliases),
            extra=dict(manifest.extra),
            weights_from_masters=True,
            digests=_digests_by_layout_group(manifest.digests, self._owner),
        )
        self._packed = PackedPartitions(layout, self.path, "a universal checkpoint has no ranks")
        self._expert_cache: dict[tuple[str, str, int], np.ndarray] = {}

    def _read_param(self, name: str, start: int, end: int, *, key: str) -> np.ndarray:
        """Elements [start, end) of a parameter of the layout: a stored one, or a stacked
        expert weight assembled from its experts' tensors."""
        experts = self.checkpoint.manifest.experts.get(name)
        if experts is None:
            return self.checkpoint.read_param(name, key, start, end)
        per_expert = self.checkpoint.manifest.params[experts[0]].numel
        out = np.empty(end - start, dtype=np.float32)
        position = start
        while position < end:
            expert, within = divmod(position, per_expert)
            run = min(per_expert - within, end - position)
            out[position - start : position - start + run] = self._stacked_expert(name, key, expert)[within : within + run]
            position += run
        return out

    def read_into(self, rank: int, group: int, key: str, start: int, out: np.ndarray, observe: Any = None) -> None:
        """:meth:`read` into ``out``. The parameters a range covers lie back to back in the
        shards, in the order a load reads them (``write.output_tensors``), so each run of
        them is read with one read straight into ``out``; a stacked expert weight is
        assembled, then copied; padding is zeros. ``observe`` (a digester, offsets in
        ``out``'s bytes) gets the CRC of every segment of ``out``: of a stored run, those its
        checksum pass computes."""
        if out.dtype != np.float32 or not out.flags.c_contiguous or not out.flags.writeable:
            super().read_into(rank, group, key, start, out)
            if observe is not None:
                observe_bytes(memoryview(np.ascontiguousarray(out).reshape(-1).view(np.uint8)), 0, out.nbytes, observe)
            return
        cursor = start
        for run in self._runs(rank, group, key, start, start + out.size):
            self._fill_zeros(out, cursor - start, run.start - start, observe)
            into = out[run.start - start : run.end - start]
            if run.path is None:
                self._read_param_into(run.name, run.param_start, into, key=key)
                if observe is not None:
                    observe_bytes(bytes_of(out), (run.start - start) * out.itemsize, (run.end - start) * out.itemsize, observe)
            else:
                shifted = observe.after((run.start - start) * out.itemsize) if observe is not None else None
                self.checkpoint.read_range_into(run.path, run.record, run.begin, into, shifted)
            cursor = run.end
        self._fill_zeros(out, cursor - start, out.size, observe)

    @staticmethod
    def _fill_zeros(out: np.ndarray, lo: int, hi: int, observe: Any) -> None:
        """Elements [lo, hi) of ``out`` are padding: zeros, observed as such."""
        if hi <= lo:
            return
        out[lo:hi] = 0
        if observe is not None:
            observe_bytes(bytes_of(out), lo * out.itemsize, hi * out.itemsize, observe)

    def prefetch(self, rank: int, group: int, key: str, start: int, end: int, into: np.ndarray | None = None) -> None:
        """Say that elements [start, end) of the partition of ``key`` in layout group
        ``group`` will be read next (:meth:`read_into`, into ``into`` when given, after those
        announced before): the storage starts reading the runs of stored parameters they
        cover (see :meth:`~zeroshard.checkpoint.native.source.NativeSource.prefetch`). A hint.

        Raises:
            ValueError: no such group, a rank other than 0, or a range outside the partition.
            KeyError: ``key`` is not a state of a parameter the range covers."""
        target = in_place_target(into, np.float32, end - start)
        for run in self._runs(rank, group, key, start, end):
            if run.path is not None:
                where = target[run.start - start : run.end - start] if target is not None else None
                self.checkpoint.announce_range(run.path, run.record, run.begin, run.begin + (run.end - run.start) * 4, where)

    def file_offset(self, rank: int, group: int, key: str, start: int) -> int | None:
        """Where element ``start`` of the partition of ``key`` in layout group ``group`` lies
        in its shard (bytes; None where no shard holds it: padding, an expert weight), as
        :meth:`~zeroshard.checkpoint.native.source.NativeSource.file_offset`. Raises as
        :meth:`prefetch`."""
        partition_numel = self.info.layout.groups[group].partition_numel
        runs = self._runs(rank, group, key, start, min(start + 1, partition_numel))
        return runs[0].begin if runs and runs[0].path is not None and runs[0].start == start else None

    def check_records_with(self, terms: RecordTerms, reads: JobReads) -> None:
        """From now on, a checksum block that this rank reads only part of is checked
        together with the other ranks of a load (:mod:`...io.shared_checks`): this rank reads
        its part (and the block's bytes it owns that no rank needs) and adds their CRCs to
        ``terms``, which the load's agreement combines. ``reads``: what the ranks of the load
        read (the same on every rank). A block between two ranks' ranges (a parameter split
        where the new layout's partitions meet, a buffer beside a master) is then read once
        over the job, not once by each. Expert weights, which every rank holding a part of
        an expert reads whole, keep their edge blocks checked whole."""
        wanted: dict[tuple[str, str], list[tuple[int, int]]] = {}
        experts = self.checkpoint.manifest.experts
        for group in self.info.layout.groups:
            keys = ["fp32", *(self.info.state_keys[group.index] if reads.full else ())]
            for start, end in reads.elements(0, group.index):
                for slot, lo, hi in self._packed.overlaps(0, group.index, start, end):
                    if slot.name not in experts:
                        for key in keys:
                            wanted.setdefault((slot.name, key), []).append((lo - slot.offset, hi - slot.offset))
        self.checkpoint.check_with_others(SharedRecordChecks(terms), wanted, reads.module)

    def _runs(self, rank: int, group: int, key: str, start: int, end: int) -> list[_Run]:
        """The partition's elements [start, end) as runs, in order: each a stretch of stored
        parameters that lie back to back both in the partition and in one shard, or one
        expert weight (no file range)."""
        runs: list[_Run] = []
        for slot, lo, hi in self._packed.overlaps(rank, group, start, end):
            param_start = lo - slot.offset
            if slot.name in self.checkpoint.manifest.experts:
                runs.append(_Run(lo, hi, slot.name, param_start))
                continue
            path, record, begin = self.checkpoint.param_location(slot.name, key, param_start, hi - slot.offset)
            last = runs[-1] if runs else None
            if last is not None and last.path == path and last.end == lo and last.begin + (last.end - last.start) * 4 == begin:
                last.end = hi
            else:
                runs.append(_Run(lo, hi, slot.name, param_start, path, record, begin))
        return runs

    def _stacked_expert(self, name: str, key: str, expert: int) -> np.ndarray:
        """One expert's ``key`` tensor in the stacked orientation [in, out], flat. The last one
        read is kept: a rank's reads of one expert come in a row."""
        cache_key = (name, key, expert)
        if cache_key not in self._expert_cache:
            stored = self.checkpoint.manifest.experts[name][expert]
            shape = self.checkpoint.manifest.params[stored].shape
            self._expert_cache = {cache_key: stacked_from_exported(self.checkpoint.read_param(stored, key), shape)}
        return self._expert_cache[cache_key]

    def scalars(self, group: int) -> dict[str, Any]:
        """The scalars of the param group layout group ``group`` belongs to."""
        self._packed.group(group)
        return self.checkpoint.scalars(self._owner[group])

    def model_tensor(self, name: str) -> np.ndarray:
        """A buffer or frozen parameter as stored; a trained parameter's fp32 master cast to
        the dtype it trained in."""
        manifest = self.checkpoint.manifest
        if name in manifest.experts:
            param = manifest.stacked(name)
            return cast(self._read_param(name, 0, param.numel, key="fp32"), param.dtype).reshape(param.shape)
        param = manifest.params.get(name)
        if param is None:
            return self.checkpoint.model_tensor(name)
        return cast(self.checkpoint.read_param(name, "fp32"), param.dtype).reshape(param.shape)

    def model_configs(self) -> dict[str, str]:
        """The model's config files the checkpoint carries (file name -> JSON text), checked."""
        return self.checkpoint.model_configs()

    def close(self) -> None:
        """Drop the cached expert tensors and close the checkpoint's reader caches."""
        self._expert_cache = {}
        self.checkpoint.close()

    def __enter__(self) -> UniversalSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclasses.dataclass
class _Run:
    """Elements [start, end) of a partition: from ``param_start`` of parameter ``name`` on,
    and, for stored parameters, bytes from ``begin`` of the shard ``path`` (None: an expert
    weight, assembled from its experts' tensors)."""

    start: int
    end: int
    name: str
    param_start: int
    path: Path | None = None
    record: FileRecord | None = None
    begin: int = 0


def _digests_by_layout_group(digests: StateDigests | None, owner: list[int]) -> StateDigests | None:
    """The manifest's digests with scalars per layout group of the source (its param group's)."""
    if digests is None:
        return None
    return StateDigests(digests.params, [digests.scalars[group] for group in owner], digests.model)


def _state_keys(layout: Layout, group: int, manifest: UniversalManifest) -> list[str]:
    """The optimizer states of a layout group: every parameter in it must have the same ones."""
    slots = layout.groups[group].params
    names = manifest.stacked(slots[0].name).states
    for slot in slots[1:]:
        states = manifest.stacked(slot.name).states
        if set(states) != set(names):
            raise ValueError(
                f"parameters {slots[0].name!r} and {slot.name!r} share a param group and dtype but have optimizer "
                f"states {sorted(names)} and {sorted(states)}"
            )
    return list(names)


UNIVERSAL_FORMAT = SourceFormat("universal", is_universal_checkpoint, UniversalSource, "zeroshard universal checkpoint")
