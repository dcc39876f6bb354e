"""What a torch.save file's pickle describes, without torch: storages and tensor views of them.

:class:`StoredTensor` is a tensor not yet read: a view (shape, stride, offset) of a
:class:`StorageRecord`, a run of bytes in the file. Its bytes are read with ``os.pread`` when
asked for, into a fresh numpy array (``ml_dtypes`` for bfloat16 and float8). The first read
of a record checks the zip CRC-32 of the whole record (:func:`verify_record`).

The markers a pickle's objects carry are here too: :func:`refuses_state` and
:func:`fills_state` decide what a BUILD opcode may do to an object, and :func:`charge_load`
charges the budget of the load running on this thread (the unpickler's callbacks have no
other way to reach it).
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from ..io.budget import DICT_ITEM_BYTES, named
from ..io.dtypes import dtype_info
from ..io.read_stats import count_read
from ..io.safetensors_io import map_range

try:
    from zlib_ng.zlib_ng import crc32
except ImportError:  # a platform without zlib-ng wheels: the same CRC, slower
    from zlib import crc32


class TorchFileError(ValueError):
    """A torch.save file is missing, damaged, unsafe to unpickle or of an unsupported kind."""


class FileProblem(Exception):
    """What is wrong with the file; load_torch_file puts the path in front."""


# torch's storage class of each dtype; None where torch saves the dtype with an untyped
# storage and _rebuild_tensor_v3. Element types come from zeroshard.io.dtypes.
STORAGE_CLASSES: dict[str, str | None] = {
    "float64": "DoubleStorage",
    "float32": "FloatStorage",
    "float16": "HalfStorage",
    "bfloat16": "BFloat16Storage",
    "int64": "LongStorage",
    "int32": "IntStorage",
    "int16": "ShortStorage",
    "int8": "CharStorage",
    "uint8": "ByteStorage",
    "bool": "BoolStorage",
    "float8_e4m3fn": None,
    "float8_e5m2": None,
    "uint16": None,
    "uint32": None,
    "uint64": None,
}
_READ_CHUNK = 1 << 30
HOT_CHUNK = 1 << 20  # read and checked while still in the CPU's cache
MAP_BYTES = 8 << 20  # reads at least this big are memory-mapped, not copied in
NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # a file replaced by a FIFO since it was opened is not waited on


def refuses_state(cls: type) -> type:
    """Make a pickle's BUILD opcode on an instance of ``cls`` an error. For classes whose
    instances outlive a load: an enum's members are shared by the whole process, so a file
    must not set their attributes."""

    def __setstate__(self: Any, state: Any) -> None:
        raise FileProblem(f"refused to unpickle data.pkl: it sets the state of a {cls.__name__}")

    __setstate__.refuses_state = True  # type: ignore[attr-defined]
    cls.__setstate__ = __setstate__  # type: ignore[attr-defined]
    return cls


def refuses_state_of(cls: type) -> bool:
    """Whether :func:`refuses_state` decorated ``cls``."""
    return getattr(getattr(cls, "__setstate__", None), "refuses_state", False)


def fills_state(cls: type) -> type:
    """Let a pickle's BUILD opcode fill the ``__dict__`` of an instance of ``cls`` from a dict,
    charged to the load's budget: without a ``__setstate__``, BUILD copies the state in C, and
    one memoised state given to many objects copies it again each time. (A state of a few
    entries costs less than the opcodes giving it, and is not charged.)"""

    def __setstate__(self: Any, state: Any) -> None:
        if type(state) is not dict:
            raise FileProblem(f"corrupt pickle data.pkl: the state of a {cls.__name__} is not a dict")
        if len(state) > _SMALL_STATE:
            charge_load(len(state) * DICT_ITEM_BYTES, "setting {:,} attributes of a {}", len(state), cls.__name__)
            check_attribute_names(state, cls.__name__)
        self.__dict__.update(state)

    cls.__setstate__ = __setstate__  # type: ignore[attr-defined]
    return cls


_SMALL_STATE = 4


def check_attribute_names(state: dict[Any, Any], what: str) -> None:
    """Refuse a BUILD state whose keys are not all strings: they are attribute names, and
    keys a file chose the hashes of would be compared with each other again in every object
    a memoised state fills."""
    if not all(type(name) is str for name in state):
        raise FileProblem(f"corrupt pickle data.pkl: the state of a {what} names an attribute by a non-string")
LOADING = threading.local()  # .budget: the Budget of the load this thread runs (set by the unpickler)


def charge_load(nbytes: int, what: str, *details: Any) -> None:
    """Charge the budget of the load running on this thread (nothing outside a load)."""
    budget = getattr(LOADING, "budget", None)
    if budget is not None:
        budget.charge(nbytes, what, *details)


def unbuildable(cls: type) -> type:
    """For the records the unpickler makes. ``dataclass(slots=True)`` gives them a
    ``__setstate__`` that sets every field, which a pickle's BUILD opcode would call to rewrite
    a checked record (its path, offset or size): refuse that, and pickle them (to hand them to
    another process) through the constructor instead.

    The records are read-only by convention, not ``frozen``: a frozen dataclass sets each field
    through ``object.__setattr__``, 5x the cost of building a plain one, and a DeepSpeed
    checkpoint at D=4096 makes 65,000 of them."""

    def __reduce__(self: Any) -> tuple[type, tuple[Any, ...]]:
        return cls, tuple(getattr(self, field.name) for field in fields(self))

    refuses_state(cls)
    cls.__reduce__ = __reduce__  # type: ignore[method-assign,assignment]
    return cls


@unbuildable
@dataclass(slots=True, unsafe_hash=True)
class StorageRecord:
    """One storage's bytes: ``nbytes`` bytes at absolute offset ``data_offset`` of ``path``;
    ``dtype`` is its element type as saved ("uint8" for an untyped storage). The zip record
    ``record_name`` holding them is ``record_size`` bytes (at least ``nbytes``) with CRC-32
    ``crc32``. ``load`` tells apart the loads of one process: a record's CRC is checked once
    per load (and again if the file is replaced or modified)."""

    path: Path
    key: str
    data_offset: int
    nbytes: int
    dtype: str
    record_name: str
    record_size: int
    crc32: int
    load: int = 0


@unbuildable
@dataclass(slots=True, unsafe_hash=True)
class StoredTensor:
    """A tensor of a torch.save file, not yet read: a view (shape, stride, offset in
    elements) of a storage that other tensors of the file may share."""

    storage: StorageRecord
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    requires_grad: bool = False

    @property
    def path(self) -> Path:
        """The torch.save file holding the storage."""
        return self.storage.path

    @property
    def data_offset(self) -> int:
        """Absolute file offset of the storage's first byte (not of this view's)."""
        return self.storage.data_offset

    @property
    def nbytes(self) -> int:
        """Size of the storage in bytes."""
        return self.storage.nbytes

    def numel(self) -> int:
        """Number of elements of the view: the product of its shape."""
        return math.prod(self.shape)

    def is_contiguous(self) -> bool:
        """Row-major without gaps, as torch decides it (strides of size-1 dims do not count)."""
        if self.numel() == 0:
            return True
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def read(self, start: int = 0, end: int | None = None) -> np.ndarray:
        """Elements ``[start, end)`` of the flattened tensor as a 1-D array the caller owns
        (contiguous tensors only): a new one, or for MAP_BYTES or more a read-only view of a
        private mapping of the file (no copy; unmapped when the last view goes)."""
        numel = self.numel()
        end = numel if end is None else end
        if not self.is_contiguous():
            raise ValueError(
                f"{self.path}: read() needs a contiguous tensor, not shape {self.shape} "
                f"with stride {self.stride}; use numpy()"
            )
        if not 0 <= start <= end <= numel:
            raise IndexError(f"elements [{start}, {end}) are outside a tensor of {numel} elements")
        return _read(self.storage, self.dtype, self.storage_offset + start, end - start)

    def read_into(self, start: int, out: np.ndarray) -> None:
        """Elements ``[start, start + out.size)`` of the flattened tensor (contiguous tensors
        only) read straight into ``out``, a contiguous 1-D array of the tensor's dtype; the
        record's CRC-32 is checked as for :meth:`read`, on ``out`` itself when it holds the
        whole record. (:mod:`.shared_reads` reads a range whose record the ranks of a load
        check together.)"""
        self.check_into(start, out)
        _read_into(self.storage, (self.storage_offset + start) * out.itemsize, out)

    def check_into(self, start: int, out: np.ndarray) -> None:
        """Refuse ``out`` for elements ``[start, start + out.size)`` unless the tensor is
        contiguous, ``out`` a contiguous 1-D array of its dtype, and the range inside it."""
        if not self.is_contiguous() or out.dtype != dtype_info(self.dtype).numpy or not out.flags.c_contiguous:
            raise ValueError(f"{self.path}: read_into() needs a contiguous tensor and an array of its dtype")
        if not 0 <= start <= start + out.size <= self.numel():
            raise IndexError(f"elements [{start}, {start + out.size}) are outside a tensor of {self.numel()} elements")

    def record(self) -> np.ndarray:
        """The whole zip record holding the storage, read once into a new byte array and
        checked against its CRC-32 as it arrives: for a reader that wants several ranges of
        it, which checking range by range would read twice (the check reads all of it)."""
        out = np.empty(self.storage.record_size, dtype=np.uint8)
        _read_into(self.storage, 0, out)
        return out

    def peek(self, start: int, end: int) -> np.ndarray:
        """Elements ``[start, end)`` of the flattened tensor (contiguous tensors only) as they
        are on disk, without checking the record's CRC-32, which would read all of it: for a
        check of a few elements that reads them again with :meth:`read` before it trusts a
        difference."""
        if not self.is_contiguous() or not 0 <= start <= end <= self.numel():
            raise ValueError(f"{self.path}: peek() needs a contiguous tensor and a range inside it")
        numpy_dtype = dtype_info(self.dtype).numpy
        begin = self.storage.data_offset + (self.storage_offset + start) * numpy_dtype.itemsize
        try:
            fd = os.open(self.storage.path, os.O_RDONLY | NONBLOCK)
            try:
                return np.array(_read_range(self.storage, fd, numpy_dtype, begin, end - start))
            finally:
                os.close(fd)
        except OSError as err:
            raise TorchFileError(f"{self.storage.path}: cannot be read: {err.strerror or err}") from None

    def numpy(self) -> np.ndarray:
        """The whole tensor in its shape, an array the caller owns (as :meth:`read`)."""
        if self.is_contiguous():
            return self.read().reshape(self.shape)
        covered = _read(self.storage, self.dtype, self.storage_offset, span(self.shape, self.stride))
        strides = tuple(step * covered.itemsize for step in self.stride)
        # np.ndarray over the bytes, not as_strided: that cannot handle ml_dtypes' dtypes.
        return np.ndarray(self.shape, covered.dtype, covered.view(np.uint8), 0, strides).copy()


def span(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Elements from a view's first to its last, inclusive."""
    last = 0
    for size, step in zip(shape, stride):  # a loop, not sum() of a generator: this runs per tensor per file
        if not size:
            return 0
        last += (size - 1) * step
    return last + 1


# ---- reading tensor bytes ----------------------------------------------------------------


def _read(storage: StorageRecord, dtype: str, first: int, count: int) -> np.ndarray:
    """``count`` elements of ``dtype`` from element ``first`` of a storage: mapped when big,
    the record's CRC checked first (once per load); a small record read whole, with its
    check, in one pread, unless the range is a small part of it (a layout of many tiny
    parameters would read the record again for each); any other range read with pread, the
    record checked in the same pass (:func:`_read_into`), so its bytes are read once."""
    numpy_dtype = dtype_info(dtype).numpy
    begin = first * numpy_dtype.itemsize
    end = begin + count * numpy_dtype.itemsize
    whole_read = storage.record_size <= min(_SMALL_RECORD_BYTES, _WHOLE_READS * (end - begin) + _WHOLE_BYTES)
    if end - begin < MAP_BYTES and not whole_read:
        out = np.empty(count, numpy_dtype)
        _read_into(storage, begin, out)
        return out
    try:
        fd = os.open(storage.path, os.O_RDONLY | NONBLOCK)
        try:
            if end - begin < MAP_BYTES:
                whole = _checked_record(storage, fd)
                return np.frombuffer(memoryview(whole)[begin:end], numpy_dtype).copy()
            verify_record(storage, fd)
            return _read_range(storage, fd, numpy_dtype, storage.data_offset + begin, count)
        finally:
            os.close(fd)
    except OSError as err:
        raise TorchFileError(f"{storage.path}: cannot be read: {err.strerror or err}") from None


def _read_into(storage: StorageRecord, begin: int, out: np.ndarray) -> None:
    """The bytes of ``out`` from byte ``begin`` of a storage, read straight into it. Unless
    its record was checked already in this load, the record's CRC-32 is taken in the same
    pass: over the record's bytes before the range, the range on ``out`` as it arrives, and
    the bytes after it, so the range is read once (not once to check the record and again
    for ``out``). On a mismatch ``out`` is partly written and the caller must drop it."""
    buffer = memoryview(out.view(np.uint8))
    try:
        fd = os.open(storage.path, os.O_RDONLY | NONBLOCK)
        try:
            checked = not _was_verified(storage, fd)
            value = span_crc(storage, fd, 0, begin) if checked else 0
            count_read(None, storage.path.name, len(buffer))
            for done in range(0, len(buffer), HOT_CHUNK):
                chunk = buffer[done : done + HOT_CHUNK]
                if pread_full(fd, chunk, storage.data_offset + begin + done) < len(chunk):
                    raise ends_early(storage)
                if checked:
                    value = crc32(chunk, value)
            if checked:
                value = span_crc(storage, fd, begin + len(buffer), storage.record_size, value)
                _check_crc(storage, value)
                _mark_verified(storage, fd)
        finally:
            os.close(fd)
    except OSError as err:
        raise TorchFileError(f"{storage.path}: cannot be read: {err.strerror or err}") from None


def pread_full(fd: int, buffer: memoryview, offset: int) -> int:
    """Bytes read into ``buffer`` from ``offset``: all of it unless the file ends first."""
    done = 0
    while done < len(buffer):
        got = _pread_into(fd, buffer[done:], offset + done)
        if not got:
            break
        done += got
    return done


def _read_range(storage: StorageRecord, fd: int, numpy_dtype: np.dtype, begin: int, count: int) -> np.ndarray:
    """``count`` elements from absolute offset ``begin``: mapped when MAP_BYTES or more."""
    end = begin + count * numpy_dtype.itemsize
    count_read(None, storage.path.name, end - begin)
    if end - begin >= MAP_BYTES:
        view = map_range(fd, begin, end)
        if view is None:
            raise ends_early(storage)
        return np.frombuffer(view, numpy_dtype)
    out = np.empty(count, numpy_dtype)
    buffer = memoryview(out.view(np.uint8))
    done = 0
    while done < len(buffer):
        got = _pread_into(fd, buffer[done : done + _READ_CHUNK], begin + done)
        if not got:
            raise ends_early(storage)
        done += got
    return out


# ---- CRC-32 of storage records -----------------------------------------------------------


_CRC_WINDOW = 16 << 20
_SMALL_RECORD_BYTES = 256 << 10  # read whole with one pread (mapping one costs more than copying it)
_WHOLE_READS, _WHOLE_BYTES = 16, 16 << 10  # ... when at most 16 times the range plus 16 KiB
_VERIFIED_LIMIT = 1 << 14
_verified: dict[tuple[Any, ...], None] = {}  # records checked: by load, record and file identity
_verified_lock = threading.Lock()


def verify_record(storage: StorageRecord, fd: int) -> None:
    """Check the zip CRC-32 of ``storage``'s whole record, unless it was checked already in
    the same load, in the same file (same inode, size and mtime). Reads the record window by
    window, so memory stays flat; raises TorchFileError naming the file and the record on a mismatch."""
    if _was_verified(storage, fd):
        return
    _check_crc(storage, _record_crc(storage, fd))
    _mark_verified(storage, fd)


def _verified_key(storage: StorageRecord, fd: int) -> tuple[Any, ...]:
    stat = os.fstat(fd)
    return (storage.load, storage.record_name, stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)


def _was_verified(storage: StorageRecord, fd: int) -> bool:
    return _verified_key(storage, fd) in _verified


def _mark_verified(storage: StorageRecord, fd: int) -> None:
    key = _verified_key(storage, fd)
    with _verified_lock:
        if len(_verified) >= _VERIFIED_LIMIT:
            _verified.clear()
        _verified[key] = None


def _checked_record(storage: StorageRecord, fd: int) -> bytes:
    """A small record's bytes, read with one pread and checked against its CRC-32 (checking
    costs less than remembering that it was checked)."""
    data = os.pread(fd, storage.record_size, storage.data_offset)
    count_read(None, storage.path.name, len(data))
    if len(data) != storage.record_size:
        raise ends_early(storage)
    _check_crc(storage, crc32(data))
    return data


def _check_crc(storage: StorageRecord, found: int) -> None:
    if found != storage.crc32:
        raise TorchFileError(
            f"{storage.path}: record {named(storage.record_name)} is corrupt: its CRC-32 is {found:08x}, "
            f"the zip directory says {storage.crc32:08x}"
        )


def _record_crc(storage: StorageRecord, fd: int) -> int:
    return span_crc(storage, fd, 0, storage.record_size)


def span_crc(storage: StorageRecord, fd: int, begin: int, end: int, value: int = 0) -> int:
    """The CRC-32 ``value`` carried on over bytes [begin, end) of the record. Through
    mappings of a window at a time: 4x faster than copying the bytes in with pread, and each
    window is unmapped before the next, so resident memory stays flat."""
    done = begin
    while done < end:
        window_end = min(done + _CRC_WINDOW, end)
        window = map_range(fd, storage.data_offset + done, storage.data_offset + window_end)
        if window is None:
            raise ends_early(storage)
        value = crc32(window, value)
        count_read(None, storage.path.name, len(window))
        window.release()
        done = window_end
    return value


def ends_early(storage: StorageRecord) -> TorchFileError:
    """The error for a file that ends inside ``storage``'s bytes."""
    return TorchFileError(
        f"{storage.path}: file ends inside storage record {named(storage.key)} (changed since it was loaded?)"
    )


def _pread_into(fd: int, buffer: memoryview, offset: int) -> int:
    if hasattr(os, "preadv"):
        return os.preadv(fd, [buffer], offset)
    data = os.pread(fd, len(buffer), offset)
    buffer[: len(data)] = data
    return len(data)


def one_line(value: Any) -> str:
    """``str(value)`` on one line (whitespace runs made one space), cut to 200 characters; the
    type's name when it is empty. For error messages quoting a file's values or errors."""
    text = " ".join(str(value).split()) or type(value).__name__
    return text if len(text) <= 200 else text[:197] + "..."
