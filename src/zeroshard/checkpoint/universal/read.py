"""Read a universal checkpoint: range reads of any tensor, checked block by block.

Opening checks the manifest (format, version, consistency) and every shard's presence and
size; a shard's safetensors header is checked against the manifest the first time it is
read; every checksum block a read touches is verified.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ...layout import Layout, LayoutPolicy, build_layout
from ...io.block_reader import RangeReader, array_view, bytes_of
from ...io.shared_checks import SharedRecordChecks
from ...io.checksum import FileRecord
from ...io.damage import CheckpointDamagedError
from ..directory import check_files_present
from ...io.dtypes import dtype_info, itemsize_of
from ...io.safetensors_io import ReadStats, TensorEntry, check_entries, read_header
from ..model_config import STORED_NAMES, read_config
from .format import UniversalManifest, model_key, param_key, read_universal_manifest, shard_version_problem


class UniversalCheckpoint:
    """An opened universal checkpoint. Cheap to open; reads only what is asked for."""

    def __init__(self, directory: Path, manifest: UniversalManifest, *, stats: ReadStats | None = None) -> None:
        self.directory = directory
        self.manifest = manifest
        self._stats = stats
        self._reader = RangeReader(stats)
        self._headers: dict[str, dict[str, TensorEntry]] = {}
        self._specs = manifest.tensor_specs()
        self._shared = False  # see check_with_others

    def read_param(self, name: str, key: str = "fp32", start: int = 0, end: int | None = None) -> np.ndarray:
        """Elements [start, end) of parameter ``name``'s ``key`` ("fp32" or an optimizer
        state), flattened in the parameter's own shape, as an fp32 array the caller may keep
        (possibly read-only: a view of a mapping of the shard or of a cached block, see
        :mod:`.block_reader`)."""
        stored, end = self._param_range(name, key, start, end)
        return self._read(stored, start * 4, end * 4, "float32")

    def param_location(self, name: str, key: str, start: int, end: int) -> tuple[Path, FileRecord, int]:
        """Where elements [start, end) of parameter ``name``'s ``key`` lie: the shard, its
        record, and the byte offset of element ``start`` in it (checked as :meth:`read_param`
        checks), for :meth:`read_range_into` and :meth:`announce_range`."""
        stored, _ = self._param_range(name, key, start, end)
        path, record, begin = self._located(stored)
        return path, record, begin + start * 4

    def read_range_into(self, path: Path, record: FileRecord, begin: int, out: np.ndarray, observe: Any = None) -> None:
        """Bytes from ``begin`` of the shard ``path`` (``record`` its record) into ``out`` (a
        contiguous, writable array), checked, with no buffer between: a big range the page
        cache lacks is read past it (:mod:`...io.direct_reads`). ``observe`` (offsets in
        ``out``'s bytes) gets the CRC of every segment as its block is checked
        (:meth:`.RangeReader.read_into`)."""
        self._reader.read_into(path, record, begin, bytes_of(out), observe)

    def announce_range(self, path: Path, record: FileRecord, begin: int, end: int, into: np.ndarray | None = None) -> None:
        """Say that :meth:`read_range_into` of bytes [begin, end) of ``path`` comes next (into
        ``into`` when given), after those announced before: the storage starts reading them
        (:meth:`.RangeReader.announce`, straight into ``into`` where it is aligned as the
        file). A hint: nothing is checked or counted until the read."""
        self._reader.announce(path, record, begin, end, None if into is None else bytes_of(into))

    def check_with_others(
        self, together: SharedRecordChecks, wanted: dict[tuple[str, str], list[tuple[int, int]]], module: Sequence[str]
    ) -> None:
        """Check the blocks that :meth:`read_range_into` and :meth:`model_tensor` read only
        part of together with the other ranks of a load (:meth:`.RangeReader.check_with_others`).
        ``wanted``: per (parameter, key), the element runs some rank of the load reads;
        ``module``: the module tensors the load reads, each by one rank (the same on every
        rank). A shard's needed bytes are worked out when it is first read from."""
        by_shard: dict[str, list[tuple[str, str, list[tuple[int, int]]]]] = {}
        for (name, key), runs in wanted.items():
            by_shard.setdefault(self.manifest.weight_map[param_key(name, key)], []).append((name, key, runs))
        stored = {model_key(self.manifest.aliases.get(name, name)) for name in module}
        for key in sorted(stored):
            by_shard.setdefault(self.manifest.weight_map[key], []).append((key, "", []))

        def needed(path: Path) -> list[tuple[int, int]] | None:
            if path.name not in by_shard:
                return None
            found = []
            for name, key, runs in by_shard[path.name]:
                if not key:  # a module tensor: all of it
                    entry = self._header(path.name)[name]
                    found.append((entry.begin, entry.end))
                for start, end in runs:
                    begin = self.param_location(name, key, start, end)[2]
                    found.append((begin, begin + (end - start) * 4))
            return found

        self._shared = True
        self._reader.check_with_others(together, needed)

    def _param_range(self, name: str, key: str, start: int, end: int | None) -> tuple[str, int]:
        """The stored tensor of parameter ``name``'s ``key``, and the range's end (None: the
        parameter's), once the range is within it."""
        param = self.manifest.params.get(name)
        if param is None:
            raise KeyError(f"{self.directory}: no trained parameter {name!r}")
        if key != "fp32" and key not in param.states:
            raise KeyError(f"{self.directory}: parameter {name!r} has no state {key!r} (it has {list(param.states)})")
        end = param.numel if end is None else end
        if not 0 <= start <= end <= param.numel:
            raise ValueError(f"range [{start}, {end}) is outside parameter {name!r}'s {param.numel} elements")
        return param_key(name, key), end

    def model_tensor(self, name: str) -> np.ndarray:
        """A buffer or frozen parameter in its own dtype and shape (aliases followed)."""
        stored = self.manifest.aliases.get(name, name)
        entry = self.manifest.model_entries.get(stored)
        if entry is None:
            raise KeyError(f"{self.directory}: no buffer or frozen parameter {name!r}")
        dtype, shape = self._specs[model_key(stored)]
        size = itemsize_of(dtype) * math.prod(shape)
        if self._shared:  # one rank of a load reads it: its edge blocks in parts, checked with the others
            out = np.empty(math.prod(shape), dtype=dtype_info(dtype).numpy)
            path, record, begin = self._located(model_key(stored))
            self._reader.read_into(path, record, begin, bytes_of(out))
            return out.reshape(shape)
        return self._read(model_key(stored), 0, size, dtype).reshape(shape)

    def scalars(self, group: int) -> dict[str, Any]:
        """Non-partitioned optimizer state of param group ``group`` (``step``): numpy arrays
        (new ones, the caller's to keep) or plain values, as the run saved them."""
        return {
            name: value.copy() if isinstance(value, np.ndarray) else value
            for name, value in self.manifest.param_groups[group].scalars.items()
        }

    def model_configs(self) -> dict[str, str]:
        """The model's config files it carries, checked: file name to write them under
        (``config.json``, ...) -> JSON text. Empty for a checkpoint without them."""
        configs = sorted(self.manifest.configs.items())
        return {STORED_NAMES[name]: read_config(self.directory, name, record) for name, record in configs}

    def build_layout(self, world_size: int, policy: LayoutPolicy | None = None, *, ep_size: int = 1) -> Layout:
        """The layout a run of these parameters would have at ``world_size`` under ``policy``
        (expert weights stacked, over ``ep_size`` expert-parallel ranks)."""
        return build_layout(self.manifest.layout_groups(ep_size), world_size, policy)

    def close(self) -> None:
        """Drop the cached edge blocks and shard headers (no file is held open between reads)."""
        self._reader.clear()
        self._headers.clear()

    def __enter__(self) -> UniversalCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read(self, key: str, begin: int, end: int, dtype: str) -> np.ndarray:
        """Bytes [begin, end) of tensor ``key``'s data as a 1-D ``dtype`` array the caller owns."""
        path, record, data_begin = self._located(key)
        return array_view(self._reader.read(path, record, data_begin + begin, data_begin + end), dtype)

    def _located(self, key: str) -> tuple[Path, FileRecord, int]:
        """The shard holding tensor ``key``, its record, and where the tensor's data begins."""
        shard = self.manifest.weight_map[key]
        return self.directory / shard, self.manifest.shards[shard], self._header(shard)[key].begin

    def _header(self, shard: str) -> dict[str, TensorEntry]:
        header = self._headers.get(shard)
        if header is None:
            path = self.directory / shard
            metadata: dict[str, Any] = {}
            header = read_header(path, self.manifest.shards[shard].size, self._stats, metadata)
            problem = shard_version_problem(path, metadata, self.manifest)
            if problem:
                raise CheckpointDamagedError(problem)
            expected = {
                key: spec
                for key, spec in self._specs.items()
                if self.manifest.weight_map[key] == shard
            }
            check_entries(path, header, expected)
            unexpected = sorted(set(header) - set(expected))
            if unexpected:
                raise ValueError(f"{path}: corrupted or not the manifest's shard: unexpected tensors {unexpected[:3]}")
            self._headers[shard] = header
        return header


def open_universal(path: str | os.PathLike[str] | UniversalCheckpoint, *, stats: ReadStats | None = None) -> UniversalCheckpoint:
    """Open the universal checkpoint in directory ``path``: manifest checked, every shard
    present with its recorded size. FileNotFoundError or ValueError in one line otherwise."""
    if isinstance(path, UniversalCheckpoint):
        return path
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: no such directory")
    manifest = read_universal_manifest(directory)
    check_files_present(directory, {**manifest.shards, **manifest.configs})
    return UniversalCheckpoint(directory, manifest, stats=stats)
