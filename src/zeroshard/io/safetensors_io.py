"""Write safetensors files in one streaming pass, and read verified byte ranges back.

The writer produces standard safetensors (any safetensors reader opens the files) while
hashing the bytes as they go out, so a save reads nothing back and copies no tensor. The
reader reads only the checksum blocks under the requested byte ranges with ``os.pread``,
checks each block against the manifest, and counts the bytes it read.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from ..layout.specs import shape_problem, tensor_name_problem
from . import jsonvalue
from .checksum import BlockHasher, FileRecord, block_crc
from .damage import CheckpointDamagedError
from .digest import FUSED, combine, crc32
from .dtypes import as_array, dtype_info, dtype_of, dtype_of_code
from .members import open_member
from .read_stats import ReadStats, count_read

_MAX_HEADER_BYTES = 100 << 20  # the limit safetensors itself enforces
_WRITE_CHUNK = 1 << 20  # hashed and written while still in the CPU cache
_WRITEBACK_CHUNK = 64 << 20  # start writing this much to disk while the rest is produced
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: fault a mapping's pages in with the mmap call

if sys.byteorder != "little":  # safetensors is little-endian and tensors are written raw
    raise ImportError("zeroshard checkpoints need a little-endian machine")

Tensor = Any  # a numpy array or a torch tensor (torch is not imported here)
Observer = Callable[[int, memoryview], None]
"""Called as ``observe(offset, chunk)`` with consecutive chunks of a tensor's bytes as they are
written (``offset``: of the chunk in the tensor), while they are in the CPU cache. An observer
that also has ``cuts(begin, end)`` (the offsets in ``(begin, end)`` where it needs a segment to
end) and ``segment(offset, length, crc)`` is instead given the CRC-32 of each segment, computed
once for it and the block checksums (where zlib-ng can combine CRCs)."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: dtype code, shape and absolute byte range."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class PlannedTensor:
    """A tensor a :class:`SafetensorsWriter` will write: its key, dtype name and shape."""

    key: str
    dtype: str  # "float32", "bfloat16", ... (dtypes.dtype_info names)
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        """Refuse, before anything is written, a tensor no safetensors reader would open."""
        problem = None
        if self.key == "__metadata__":
            problem = "the name safetensors keeps for the file's metadata"
        elif any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in self.shape):
            problem = f"shape {list(self.shape)} has a dimension that is not a non-negative integer"
        else:
            problem = tensor_name_problem(self.key) or shape_problem(self.shape, dtype_info(self.dtype).itemsize)
        if problem:
            raise ValueError(f"tensor {self.key!r}: {problem}; refusing to write it")

    @property
    def numel(self) -> int:
        """Number of elements: the product of the shape (1 for a scalar)."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of its data in the file."""
        return self.numel * dtype_info(self.dtype).itemsize


class SafetensorsWriter:
    """Writes one safetensors file tensor by tensor, in the planned order.

    The header is computed from the plan and written first, so tensors can be produced,
    written and dropped one at a time. Every byte is hashed into block CRCs as it goes out;
    :meth:`close` checks that every planned tensor came, fsyncs and returns the record.
    Leaving a ``with`` block by an exception closes the file unfinished (the caller removes it).
    """

    def __init__(
        self,
        path: Path,
        plan: Sequence[PlannedTensor],
        block_size: int,
        metadata: dict[str, str] | None = None,
        page_aligned: str | None = None,
    ) -> None:
        self.path = path
        self._plan = list(plan)
        self._next = 0
        self._flushed = 0  # bytes handed to _start_writeback
        self._hasher = BlockHasher(block_size)
        header = _plan_header(self._plan, metadata, page_aligned, block_size)
        self._file = open(path, "wb", buffering=0)
        try:
            for piece in (struct.pack("<Q", len(header)), header):
                _write_all(self._file, memoryview(piece), self._hasher)
        except BaseException as err:
            self._file.close()
            raise named_os_error(err, path) if isinstance(err, OSError) else err

    def write(self, key: str, tensor: Tensor, observe: Observer | None = None) -> None:
        """Write the next planned tensor (a numpy array or a CPU torch tensor): ``key`` and
        dtype as planned, the planned number of elements (any shape: the header holds the
        planned one). ``observe``, if given, sees each chunk as it goes out (digests)."""
        if self._next >= len(self._plan):
            raise ValueError(f"{self.path}: {key!r} was not planned; all {len(self._plan)} tensors are written")
        planned = self._plan[self._next]
        array = as_array(tensor)
        dtype = dtype_of(array).name
        if key != planned.key or dtype != planned.dtype or array.size != planned.numel:
            raise ValueError(
                f"{self.path}: expected {planned.key!r} ({planned.dtype}, {planned.numel} elements), "
                f"got {key!r} ({dtype}, {array.size} elements)"
            )
        raw = _as_bytes(array)
        fused = FUSED and observe is not None and hasattr(observe, "segment")
        try:
            for start in range(0, len(raw), _WRITE_CHUNK):
                chunk = raw[start : start + _WRITE_CHUNK]
                if fused:
                    _write_all(self._file, chunk, None)
                    self._hash_segments(chunk, start, observe)
                else:
                    _write_all(self._file, chunk, self._hasher)
                    if observe is not None:
                        observe(start, chunk)
                self._start_writeback()
        except OSError as err:
            raise named_os_error(err, self.path) from err
        self._next += 1

    def _hash_segments(self, chunk: memoryview, offset: int, observe: Any) -> None:
        """CRC ``chunk`` (bytes from ``offset`` of the tensor) once, cut where a checksum block
        ends or ``observe`` wants a cut; each segment's CRC goes to both."""
        end = offset + len(chunk)
        cuts = iter(observe.cuts(offset, end))
        cut = next(cuts, end)
        position = offset
        while position < end:
            while cut <= position:
                cut = next(cuts, end)
            stop = min(cut, end, position + self._hasher.room)
            crc = crc32(chunk[position - offset : stop - offset])
            self._hasher.update_known(stop - position, crc, combine)
            observe.segment(position, stop - position, crc)
            position = stop

    def _start_writeback(self) -> None:
        """Have the kernel start writing what is written so far, without waiting, so that
        the fsync in :meth:`close` finds little left to do: on Linux, POSIX_FADV_DONTNEED
        starts writeback of a range's dirty pages (and drops its clean ones from the page
        cache, which the converters never read back)."""
        written = self._hasher.size
        if written - self._flushed < _WRITEBACK_CHUNK or not hasattr(os, "posix_fadvise"):
            return
        os.posix_fadvise(self._file.fileno(), self._flushed, written - self._flushed, os.POSIX_FADV_DONTNEED)
        self._flushed = written

    def close(self) -> FileRecord:
        """Finish the file: every planned tensor must have been written. Fsyncs it."""
        if self._file.closed:
            return self._hasher.record()
        if self._next != len(self._plan):
            self._file.close()
            raise ValueError(f"{self.path}: {len(self._plan) - self._next} planned tensors were never written")
        try:
            os.fsync(self._file.fileno())
        except OSError as err:
            raise named_os_error(err, self.path) from err
        finally:
            self._file.close()
        return self._hasher.record()

    def abort(self) -> None:
        """Close the file unfinished (the caller removes it)."""
        self._file.close()

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, kind: object, error: object, trace: object) -> None:
        if error is not None:
            self.abort()
        else:
            self.close()


def write_safetensors(
    path: Path,
    tensors: Sequence[tuple[str, Tensor]],
    block_size: int,
    metadata: dict[str, str] | None = None,
    observers: Mapping[str, Observer] | None = None,
    page_aligned: str | None = None,
) -> FileRecord:
    """Write ``tensors`` in the given order to ``path``, fsync it, return its block checksums.
    ``observers[key]`` sees tensor ``key``'s bytes as they are written. ``page_aligned``: a
    tensor whose bytes start on a page boundary of the file (the header is padded for it),
    so a reader past the page cache can read them straight into page-aligned memory."""
    plan = [PlannedTensor(name, dtype_of(tensor).name, tuple(tensor.shape)) for name, tensor in tensors]
    observers = observers or {}
    with SafetensorsWriter(path, plan, block_size, metadata, page_aligned) as writer:
        for name, tensor in tensors:
            writer.write(name, tensor, observers.get(name))
        return writer.close()


def named_os_error(err: OSError, path: Path) -> OSError:
    """``err`` naming ``path`` if it names no file (``write`` and ``fsync`` know only a file
    descriptor, so a full disk (ENOSPC) would otherwise not say where) or two (a rename's
    source and target: ``path`` is the one being written)."""
    if not err.errno or (err.filename is not None and err.filename2 is None):
        return err
    return OSError(err.errno, err.strerror or os.strerror(err.errno), str(path))


def describe_os_error(err: OSError) -> str:
    """``err`` as one line, "PATH: reason" (a rename's "SOURCE -> TARGET: reason")."""
    if not err.strerror:
        return str(err)
    paths = [str(p) for p in (err.filename, err.filename2) if p is not None]
    return f"{' -> '.join(paths)}: {err.strerror}" if paths else err.strerror


_HEADER_SIZE_BYTES = 8  # the little-endian u64 before the header
_PAGE = 4096  # a page, and a multiple of any disk's sector: direct reads' alignment


def _plan_header(plan: Sequence[PlannedTensor], metadata: dict[str, str] | None, page_aligned: str | None, block_size: int) -> bytes:
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    aligned_at = None  # the page_aligned tensor's offset in the data
    for entry in plan:
        if entry.key == page_aligned:
            aligned_at = offset
        if entry.key in header:
            raise ValueError(f"tensor key {entry.key!r} appears twice")
        header[entry.key] = {
            "dtype": dtype_info(entry.dtype).code,
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    padding = -len(encoded) % 8  # data starts 8-byte aligned, as safetensors writes it
    # Never on a checksum block's boundary (so not at all where blocks divide a page): the
    # blocks before it would hold the header and scalars only, which no load reads whole,
    # so no load would check them.
    if aligned_at is not None and aligned_at % 8 == 0 and _PAGE % block_size:
        start = _HEADER_SIZE_BYTES + len(encoded) + padding + aligned_at
        page = start + -start % _PAGE
        if page % block_size == 0:
            page += _PAGE  # two pages in a row are boundaries only where blocks divide a page
        padding += page - start
    return encoded + b" " * padding


def _as_bytes(array: np.ndarray) -> memoryview:
    flat = np.ascontiguousarray(array).reshape(-1)
    if flat.size == 0:
        return memoryview(b"")
    return memoryview(flat.view(np.uint8))


def _write_all(out, data: memoryview, hasher: BlockHasher | None) -> None:
    if hasher is not None:
        hasher.update(data)
    written = 0
    while written < len(data):
        written += out.write(data[written:])


def read_header(
    path: Path, file_size: int, stats: ReadStats | None = None, metadata: dict[str, Any] | None = None
) -> dict[str, TensorEntry]:
    """Parse and check a safetensors header; offsets become absolute and must fit the file.
    ``metadata``, if given, receives the header's ``__metadata__`` entries. A header that is
    cut short or does not parse into entries that fit is damage: CheckpointDamagedError, one
    line naming the file."""
    header, length = _header_object(path, file_size, stats)
    data_start = 8 + length
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            if metadata is not None and isinstance(info, dict):
                metadata.update(info)
            continue
        try:
            begin, end = (data_start + offset for offset in jsonvalue.read_shape(info["data_offsets"], "data_offsets"))
            entries[name] = TensorEntry(str(info["dtype"]), jsonvalue.read_shape(info["shape"], "shape"), begin, end)
        except (KeyError, TypeError, ValueError):  # JSON integers only: not true, 1.0 or "1"
            raise CheckpointDamagedError(f"{path}: corrupted: bad header entry for {name!r}") from None
        if not data_start <= begin <= end <= file_size:
            raise CheckpointDamagedError(f"{path}: corrupted: tensor {name!r} lies outside the file")
    return entries


def read_metadata(path: Path) -> dict[str, Any]:
    """The ``__metadata__`` of the safetensors file ``path`` (a regular file, not a link);
    empty when it has none. ValueError when it is no safetensors file."""
    header, _ = _header_object(path, os.lstat(path).st_size, None)
    metadata = header.get("__metadata__", {})
    return metadata if isinstance(metadata, dict) else {}


def _header_object(path: Path, file_size: int, stats: ReadStats | None) -> tuple[dict[str, Any], int]:
    """A safetensors file's header as a JSON object, and its length in bytes."""
    # No read-ahead: the tensors after the header are read by ranges, many of them direct.
    with open(open_member(path, read_ahead=False), "rb", buffering=0) as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise CheckpointDamagedError(f"{path}: truncated: no safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(_MAX_HEADER_BYTES, file_size - 8):
            raise CheckpointDamagedError(
                f"{path}: corrupted: header length {length} does not fit a {file_size}-byte file"
            )
        raw = handle.read(length)
    count_read(stats, path.name, 8 + len(raw), opening=True)
    try:
        header = jsonvalue.loads(raw, path)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointDamagedError(f"{path}: corrupted: the safetensors header is not valid JSON") from None
    except ValueError as err:  # jsonvalue's own line: nested too deeply, an integer too long
        raise CheckpointDamagedError(str(err)) from None
    if not isinstance(header, dict):
        raise CheckpointDamagedError(f"{path}: corrupted: the safetensors header is not a JSON object")
    return header, length


def check_entries(path: Path, entries: Mapping, expected: Mapping[str, tuple[str, tuple[int, ...]]]) -> None:
    """The file's header must hold the tensors ``expected`` describes: name -> (dtype name, shape).
    Otherwise the file and the manifest that lists it disagree: CheckpointDamagedError."""
    missing = sorted(set(expected) - set(entries))
    if missing:
        raise CheckpointDamagedError(f"{path}: corrupted or not the manifest's file: tensors {missing} are missing")
    for name, (dtype, shape) in expected.items():
        entry = entries[name]
        try:
            found = dtype_of_code(entry.dtype)
        except ValueError:
            problem = f"tensor {name!r} has unknown dtype {entry.dtype!r}"
            raise CheckpointDamagedError(f"{path}: corrupted: {problem}") from None
        found_dtype = found.name
        if found_dtype != dtype or tuple(entry.shape) != tuple(shape):
            raise CheckpointDamagedError(
                f"{path}: tensor {name!r} is {found_dtype} {list(entry.shape)}, the manifest says {dtype} {list(shape)}"
            )
        if entry.end - entry.begin != found.itemsize * math.prod(shape):
            raise CheckpointDamagedError(f"{path}: corrupted: tensor {name!r} spans {entry.end - entry.begin} bytes")


class VerifiedRanges:
    """Byte ranges of one file, read whole-block and checked against the manifest."""

    def __init__(
        self, path: Path, record: FileRecord, ranges: Iterable[tuple[int, int]], stats: ReadStats | None
    ) -> None:
        self.path = path
        self._runs: list[tuple[int, memoryview]] = []
        blocks = sorted({index for begin, end in ranges for index in record.blocks_covering(begin, end)})
        with open(open_member(path), "rb", buffering=0) as handle:
            for first, last in _consecutive_runs(blocks):
                begin, end = record.block_range(first)[0], record.block_range(last)[1]
                data = pread_exact(handle.fileno(), begin, end - begin, path)
                count_read(stats, path.name, len(data))
                check_blocks(path, record, first, last, begin, data)
                self._runs.append((begin, data))

    def view(self, begin: int, end: int) -> memoryview:
        """Bytes [begin, end) of the file, from the verified runs read at construction (no copy).

        Raises:
            AssertionError: the range was not among those read (a bug of the caller).
        """
        for run_start, data in self._runs:
            if run_start <= begin and end <= run_start + len(data):
                return memoryview(data)[begin - run_start : end - run_start]
        raise AssertionError(f"bytes [{begin}, {end}) of {self.path} were not read")


def verify_file(path: Path, record: FileRecord) -> list[str]:
    """Problems found re-reading all of ``path`` against ``record`` (empty when it is intact)."""
    with open(open_member(path), "rb", buffering=0) as handle:
        size = os.fstat(handle.fileno()).st_size
        if size != record.size:
            return [f"{path}: size {size} bytes, the manifest says {record.size}"]
        problems = []
        for index in range(len(record.crc32)):
            begin, end = record.block_range(index)
            data = pread_exact(handle.fileno(), begin, end - begin, path)
            if block_crc(data) != record.crc32[index]:
                problems.append(
                    f"{path}: checksum mismatch in block {index} (bytes {begin}-{end}): the file is corrupted"
                )
    return problems


def _consecutive_runs(indices: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for index in indices:
        if runs and runs[-1][1] == index - 1:
            runs[-1] = (runs[-1][0], index)
        else:
            runs.append((index, index))
    return runs


def pread_exact(fd: int, offset: int, count: int, path: Path) -> memoryview:
    """``count`` bytes of the open file ``fd`` from ``offset``, in a new buffer.

    Raises:
        CheckpointDamagedError: the file (``path``, for the message) ends first.
    """
    data = memoryview(np.empty(count, dtype=np.uint8))  # not a bytearray: no zero-filling first
    pread_into(fd, data, offset, path)
    return data


def map_range(fd: int, begin: int, end: int) -> memoryview | None:
    """A read-only view of bytes [begin, end) of the open file ``fd`` through a private
    mapping (pages faulted in up front where the OS can), or None if the file ends before
    ``end``: reading a mapping past the end of a file faults (SIGBUS) instead of raising.
    The mapping lives as long as any view of it."""
    if os.fstat(fd).st_size < end:
        return None
    start = begin - begin % mmap.ALLOCATIONGRANULARITY
    mapped = mmap.mmap(fd, end - start, flags=mmap.MAP_PRIVATE | _POPULATE, prot=mmap.PROT_READ, offset=start)
    return memoryview(mapped)[begin - start :]


def pread_into(fd: int, view: memoryview, offset: int, path: Path) -> None:
    """Fill ``view`` with the file's bytes from ``offset``; CheckpointDamagedError (a ValueError)
    naming ``path`` if the file ends first."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:  # the file ends before offset + done (a read that starts past the end gets 0 too)
            raise CheckpointDamagedError(
                f"{path}: truncated: expected {offset + len(view)} bytes, the file ends at {os.fstat(fd).st_size}"
            )
        done += got


def check_blocks(
    path: Path, record: FileRecord, first: int, last: int, run_start: int, data: memoryview
) -> None:
    """CRC-check blocks ``first``..``last`` held in ``data``, which starts at file offset ``run_start``."""
    view = memoryview(data)
    for index in range(first, last + 1):
        begin, end = record.block_range(index)
        if block_crc(view[begin - run_start : end - run_start]) != record.crc32[index]:
            raise CheckpointDamagedError(f"{path}: checksum mismatch in block {index} (bytes {begin}-{end}): the file is corrupted")
