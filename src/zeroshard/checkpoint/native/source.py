"""A native zeroshard checkpoint as a :class:`ShardSource`.

Reads are range reads of the rank files, every checksum block under them verified (see
:mod:`.block_reader`); each file's safetensors header is checked against the manifest the
first time the file is read, and so is a rank file's binding (:mod:`.binding`: the layout,
rank, shard groups and experts it was written for). In a load with other ranks, a block that
several of them read parts of is checked by them together (:meth:`NativeSource.check_records_with`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..format import LATEST_FILE, MANIFEST_FILE, MODEL_FILE, fp32_key, rank_file_name, scalar_key, state_key
from ..formats import SourceFormat
from ..attest.digests import Terms, finished, tensors_digester
from ...io.block_reader import RangeReader, array_view, bytes_of
from ...io.observe import observe_bytes
from ...io.checksum import FileRecord
from ...io.dtypes import dtype_info, itemsize_of, to_float32
from ...io.safetensors_io import ReadStats, TensorEntry, check_entries, read_header
from ...io.shared_checks import ByteRuns, RecordTerms, SharedRecordChecks
from ..reshard import JobReads
from ..model_config import STORED_NAMES, read_config
from ..source import ModelEntry, SourceInfo, in_place_target
from .binding import check_binding
from .handle import Checkpoint, open_checkpoint
from .manifest import ModelTensorRecord

NATIVE_KIND = "zeroshard.checkpoint"


class NativeSource:
    """An opened native checkpoint, read range by range (the ShardSource protocol)."""

    kind = NATIVE_KIND
    observes_reads = True  # read_into digests what it reads (``observe``)
    digests_model_tensors = True  # and model_tensors (``digests``)
    reads_in_place = True  # prefetch takes ``into``, and file_offset says where ranges lie

    def __init__(self, checkpoint: str | os.PathLike[str] | Checkpoint, *, stats: ReadStats | None = None) -> None:
        self.checkpoint = open_checkpoint(checkpoint)
        self.path = self.checkpoint.directory
        manifest = self.checkpoint.manifest
        self._reader = RangeReader(stats)
        self._stats = stats
        self._headers: dict[str, dict[str, TensorEntry]] = {}
        self._rank_tensors = manifest.rank_file_tensors()
        self._binding_digest = manifest.binding_digest
        self._scalars_attested = False  # see scalars
        self.info = SourceInfo(
            layout=manifest.layout,
            optimizer_class=manifest.optimizer_class,
            param_groups=list(manifest.param_groups),
            state_keys=[list(record.states) for record in manifest.groups],
            model_entries=[
                ModelEntry(name, record.shape, record.dtype, record.kind)
                for name, record in manifest.model_tensors.items()
                if record.kind != "trainable"
            ],
            aliases=dict(manifest.aliases),
            extra=dict(manifest.extra),
            stored_dtypes=[
                {key: dtype for key, dtype in {"fp32": record.fp32_dtype, **record.states}.items() if dtype != "float32"}
                for record in manifest.groups
            ],
            digests=manifest.digests,
        )

    def read(self, rank: int, group: int, key: str, start: int, end: int) -> np.ndarray:
        """Elements [start, end) of ``rank``'s partition of ``key`` in ``group``, as fp32."""
        file_name, entry, dtype = self._locate(rank, group, key, start, end)
        itemsize = itemsize_of(dtype)
        data = self._read(file_name, entry.begin + start * itemsize, entry.begin + end * itemsize)
        return to_float32(array_view(data, dtype))

    def read_into(self, rank: int, group: int, key: str, start: int, out: np.ndarray, observe: Any = None) -> None:
        """Elements [start, start + out.size) of ``rank``'s partition of ``key`` in ``group``
        into ``out``, a 1-D array. In the stored dtype and contiguous, the bytes are read
        straight into it (no copy); otherwise read as fp32 and cast. ``observe`` (a digester,
        offsets in ``out``'s bytes) gets the CRC of every segment of ``out`` as it is checked."""
        end = start + out.size
        file_name, entry, dtype = self._locate(rank, group, key, start, end)
        if out.dtype != dtype_info(dtype).numpy or not out.flags.c_contiguous or not out.flags.writeable:
            out[...] = self.read(rank, group, key, start, end)
            if observe is not None:
                observe_bytes(memoryview(np.ascontiguousarray(out).reshape(-1).view(np.uint8)), 0, out.nbytes, observe)
            return
        begin = entry.begin + start * itemsize_of(dtype)
        path, record = self.checkpoint.path(file_name), self._record(file_name)
        self._reader.read_into(path, record, begin, bytes_of(out), observe)

    def prefetch(self, rank: int, group: int, key: str, start: int, end: int, into: np.ndarray | None = None) -> None:
        """Say that elements [start, end) of ``rank``'s partition of ``key`` in ``group``
        will be read next (with :meth:`read_into`, into ``into`` when given, after those
        announced before): a thread starts reading them past the page cache where they are
        big and not cached (straight into ``into`` where it has the file's alignment, see
        :meth:`file_offset`), or the kernel into it (:meth:`.RangeReader.announce`), so the
        disk keeps reading while the loader checks what it has and maps new memory. A hint:
        nothing is checked or counted until the bytes are read.

        Raises:
            KeyError: ``key`` is not a state of the group (as the read would).
            ValueError: no such group or rank, or a range outside the partition; a rank
                file whose header or binding does not match the manifest."""
        file_name, entry, dtype = self._locate(rank, group, key, start, end)
        itemsize = itemsize_of(dtype)
        begin = entry.begin + start * itemsize
        target = in_place_target(into, dtype_info(dtype).numpy, end - start)
        destination = bytes_of(target) if target is not None else None
        path, record = self.checkpoint.path(file_name), self._record(file_name)
        self._reader.announce(path, record, begin, begin + (end - start) * itemsize, destination)

    def file_offset(self, rank: int, group: int, key: str, start: int) -> int:
        """Where element ``start`` of ``rank``'s partition of ``key`` in ``group`` lies in its
        rank file (bytes): memory with this offset's alignment within a page has the bytes
        read past the page cache land in it with no copy. Raises as :meth:`prefetch`."""
        file_name, entry, dtype = self._locate(rank, group, key, start, start)
        return entry.begin + start * itemsize_of(dtype)

    def scalars(self, group: int) -> dict[str, np.ndarray]:
        """The group's non-partitioned optimizer state: the same in every rank file, so
        read from one already opened (they sit in its first block, next to the header).
        In a load whose ranks check blocks together, every rank reads just their bytes (a
        whole first block each would be read again by the ranks reading parts of it); the
        load attests them against their saved digests, and whoever reads that block's
        other bytes checks its CRC with the others."""
        manifest = self.checkpoint.manifest
        file_name = next((name for name in self._headers if name != MODEL_FILE), None) or self._rank_file(0)
        header = self._header(file_name)
        found = {}
        for name, (dtype, shape) in manifest.groups[group].scalars.items():
            entry = header[scalar_key(group, name)]
            if self._scalars_attested:
                path, record = self.checkpoint.path(file_name), self._record(file_name)
                data = self._reader.read_unchecked(path, record, entry.begin, entry.end)  # attested by the load
            else:
                data = self._read(file_name, entry.begin, entry.end)
            found[name] = array_view(data, dtype).reshape(shape)
        return found

    def check_records_with(self, terms: RecordTerms, reads: JobReads) -> None:
        """From now on, a checksum block that this rank reads only part of is checked
        together with the other ranks of a load (:mod:`...io.shared_checks`): this rank reads
        its part (and the block's bytes it owns that no rank needs) and adds their CRCs to
        ``terms``, which the load's agreement combines. ``reads``: what the ranks of the load
        read (the same on every rank). A block where two ranks' ranges meet in a rank file
        (a resharded load) or in the model file is then read once over the job, not once by
        each. Where each rank reads only its own old rank file (equal layouts), the rank
        files' blocks stay checked by their one reader as it reads them: a damaged one
        fails that rank's read at once, naming it."""
        manifest = self.checkpoint.manifest
        module = {self._model_record(name)[0] for name in reads.module}
        rank_files = {} if reads.own_partitions else {name: rank for rank, name in enumerate(manifest.rank_files())}

        def needed(path: Path) -> ByteRuns | None:
            if path.name == MODEL_FILE:
                header = self._header(MODEL_FILE)
                return [(header[name].begin, header[name].end) for name in module]
            rank = rank_files.get(path.name)
            return None if rank is None else self._needed_of_rank_file(rank, reads)

        self._reader.check_with_others(SharedRecordChecks(terms), needed)
        self._scalars_attested = self.info.digests is not None

    def _needed_of_rank_file(self, rank: int, reads: JobReads) -> ByteRuns:
        """The bytes of old rank ``rank``'s file that some rank of the load reads (its
        partitions' runs that ``reads`` copies), from its start."""
        manifest = self.checkpoint.manifest
        header = self._header(self._rank_file(rank))
        found = []
        for group, record in enumerate(manifest.groups):
            keys = {fp32_key(group): record.fp32_dtype}
            if reads.full:
                keys.update({state_key(group, name): dtype for name, dtype in record.states.items()})
            runs = reads.elements(rank, group)
            for key, dtype in keys.items():
                begin, itemsize = header[key].begin, itemsize_of(dtype)
                found += [(begin + start * itemsize, begin + end * itemsize) for start, end in runs]
        return found

    def model_tensor(self, name: str) -> np.ndarray:
        """A module state_dict entry from model.safetensors, aliases followed (an array of its own)."""
        return self.model_tensors([name])[name]

    def model_tensors(self, names: list[str], digests: dict[str, tuple] | None = None) -> dict[str, np.ndarray]:
        """:meth:`model_tensor` of each name. Tensors that lie next to each other in the
        file are read with one read into one buffer and come back as views of it: one
        buffer per run instead of one per tensor (each its own allocation, page by page).
        ``digests``, if given, receives for each name ``(address, nbytes, digest)``: the digest,
        from the CRCs the read computes, of the bytes at that address (see :mod:`..attest.attestation`)."""
        header = self._header(MODEL_FILE)
        records = {name: self._model_record(name) for name in names}

        def entry_of(name: str) -> TensorEntry:
            return header[records[name][0]]

        found = {}
        for run in _adjacent_runs(sorted(records, key=lambda name: entry_of(name).begin), entry_of):
            begin, end = entry_of(run[0]).begin, entry_of(run[-1]).end
            data = memoryview(np.empty(end - begin, dtype=np.uint8))
            terms = Terms()
            spans = {name: (entry_of(name).begin - begin, entry_of(name).end - begin) for name in run}
            observe = tensors_digester(spans, terms) if digests is not None else None
            self._reader.read_into(self.checkpoint.path(MODEL_FILE), self._record(MODEL_FILE), begin, data, observe)
            if digests is not None:
                address = np.frombuffer(data, dtype=np.uint8).ctypes.data
                for name, (lo, hi) in spans.items():
                    digests[name] = (address + lo, hi - lo, finished(terms, (name, None, "module"), hi - lo))
            for name in run:
                entry, record = entry_of(name), records[name][1]
                piece = array_view(data[entry.begin - begin : entry.end - begin], record.dtype)  # copied if misaligned
                found[name] = piece.reshape(record.shape)
        return found

    def _model_record(self, name: str) -> tuple[str, ModelTensorRecord]:
        """The stored name (aliases followed) and manifest record of a module tensor."""
        stored = self.info.aliases.get(name, name)
        record = self.checkpoint.manifest.model_tensors.get(stored)
        if record is None:
            raise KeyError(f"{self.path / MODEL_FILE}: no module tensor {name!r}")
        return stored, record

    def model_configs(self) -> dict[str, str]:
        """The model's config files the checkpoint stores, checked: file name to write them
        under (``config.json``, ...) -> JSON text. Empty for a checkpoint without them."""
        configs = self.checkpoint.manifest.config_files
        return {STORED_NAMES[name]: read_config(self.path, name, record) for name, record in sorted(configs.items())}

    def close(self) -> None:
        """Drop the cached edge blocks and file headers (no file is held open between reads)."""
        self._reader.clear()
        self._headers.clear()

    def __enter__(self) -> NativeSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _rank_file(self, rank: int) -> str:
        world_size = self.checkpoint.manifest.world_size
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        return rank_file_name(rank, world_size)

    def _locate(self, rank: int, group: int, key: str, start: int, end: int) -> tuple[str, TensorEntry, str]:
        """The rank file, tensor entry and stored dtype of a partition range, checked."""
        manifest = self.checkpoint.manifest
        if not 0 <= group < len(manifest.groups):
            raise ValueError(f"{self.path}: group {group} does not exist (the checkpoint has {len(manifest.groups)})")
        record = manifest.groups[group]
        if key == "fp32":
            tensor_key, dtype = fp32_key(group), record.fp32_dtype
        elif key in record.states:
            tensor_key, dtype = state_key(group, key), record.states[key]
        else:
            raise KeyError(f"{self.path}: group {group} has no optimizer state {key!r} (it has {sorted(record.states)})")
        partition_numel = manifest.layout.groups[group].partition_numel
        if not 0 <= start <= end <= partition_numel:
            raise ValueError(f"range [{start}, {end}) is outside group {group}'s partition of {partition_numel} elements")
        file_name = self._rank_file(rank)
        return file_name, self._header(file_name)[tensor_key], dtype

    def _header(self, file_name: str) -> dict[str, TensorEntry]:
        header = self._headers.get(file_name)
        if header is None:
            manifest = self.checkpoint.manifest
            path = self.checkpoint.path(file_name)
            metadata: dict = {}
            header = read_header(path, manifest.files[file_name].size, self._stats, metadata)
            expected = manifest.model_file_tensors() if file_name == MODEL_FILE else self._rank_tensors
            check_entries(path, header, expected)
            if file_name != MODEL_FILE:
                check_binding(path, metadata, manifest.layout, self._binding_digest, _rank_of(file_name))
            self._headers[file_name] = header
        return header

    def _read(self, file_name: str, begin: int, end: int) -> memoryview:
        return self._reader.read(self.checkpoint.path(file_name), self._record(file_name), begin, end)

    def _record(self, file_name: str) -> FileRecord:
        return self.checkpoint.manifest.files[file_name]


def _rank_of(file_name: str) -> int:
    """The rank of ``rank-RRRRR-of-DDDDD.safetensors`` (a name the manifest's file list holds)."""
    return int(file_name.split("-")[1])


def _adjacent_runs(names: list[str], entry_of: Callable[[str], TensorEntry]) -> list[list[str]]:
    """``names`` (sorted by offset) cut where a tensor does not start where the previous one ends."""
    runs: list[list[str]] = []
    for name in names:
        if runs and entry_of(runs[-1][-1]).end == entry_of(name).begin:
            runs[-1].append(name)
        else:
            runs.append([name])
    return runs


def is_native_checkpoint(path: Path) -> bool:
    """A tag directory (it has a manifest) or a root whose ``latest`` names one."""
    return (path / MANIFEST_FILE).is_file() or (path / LATEST_FILE).is_file()


NATIVE_FORMAT = SourceFormat("native", is_native_checkpoint, NativeSource, "zeroshard checkpoint")
