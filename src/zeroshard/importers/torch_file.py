"""Read files written by ``torch.save`` (torch >= 1.6, e.g. DeepSpeed's ``*.pt``) without torch.

The format is a zip archive whose records are stored uncompressed under one folder,
``<archive>/``:

* ``data.pkl``: the saved object as a pickle. A tensor is a call
  ``torch._utils._rebuild_tensor_v2(storage, storage_offset, shape, stride, requires_grad,
  hooks[, metadata])`` (``_rebuild_tensor_v3``, with a dtype argument after ``hooks``, for
  float8 and the unsigned dtypes), a parameter ``_rebuild_parameter(tensor, requires_grad,
  hooks)``. Storages are persistent ids ``('storage', storage_type, key, location, numel)``;
* ``data/<key>``: the bytes of storage ``key``, in the byte order of ``byteorder``
  ("little" or "big"; absent in older, little-endian files). ``version`` and the rest are
  not needed.

Safety: a pickle names globals and calls them, so unpickling an arbitrary file runs code the
file chooses. Our unpickler resolves only an explicit allowlist of names, to our own
torch-free rebuild functions and markers and to the caller's data-only stand-in classes, and
refuses every other global by name. Before unpickling, the opcodes are checked against the
set a torch.save pickle uses. Nothing from torch is imported or called.

Tensors come back as :class:`StoredTensor` records: opening a file reads its pickle and the
zip directory, never tensor bytes; those are read with ``os.pread`` when asked for.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import pickletools
import reprlib
import struct
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np


class TorchFileError(ValueError):
    """A torch.save file is missing, damaged, unsafe to unpickle or of an unsupported kind."""


class _Problem(Exception):
    """What is wrong with the file; load_torch_file puts the path in front."""


# Canonical dtype name: (numpy dtype, torch's storage class name; None where torch stores
# the dtype with an untyped storage and _rebuild_tensor_v3).
_DTYPES: dict[str, tuple[np.dtype, str | None]] = {
    "float64": (np.dtype("<f8"), "DoubleStorage"),
    "float32": (np.dtype("<f4"), "FloatStorage"),
    "float16": (np.dtype("<f2"), "HalfStorage"),
    "bfloat16": (np.dtype(ml_dtypes.bfloat16), "BFloat16Storage"),
    "int64": (np.dtype("<i8"), "LongStorage"),
    "int32": (np.dtype("<i4"), "IntStorage"),
    "int16": (np.dtype("<i2"), "ShortStorage"),
    "int8": (np.dtype("i1"), "CharStorage"),
    "uint8": (np.dtype("u1"), "ByteStorage"),
    "bool": (np.dtype("?"), "BoolStorage"),
    "float8_e4m3fn": (np.dtype(ml_dtypes.float8_e4m3fn), None),
    "float8_e5m2": (np.dtype(ml_dtypes.float8_e5m2), None),
    "uint16": (np.dtype("<u2"), None),
    "uint32": (np.dtype("<u4"), None),
    "uint64": (np.dtype("<u8"), None),
}
_LEGACY_MAGIC = (0x1950A86A20F9469CFC6C).to_bytes(10, "little")  # first pickle of pre-1.6 files
_READ_CHUNK = 1 << 30


def _unbuildable(cls: type) -> type:
    """For the records the unpickler makes. ``dataclass(frozen=True, slots=True)`` gives them a
    ``__setstate__`` that sets every field, which a pickle's BUILD opcode would call to rewrite
    a checked record (its path, offset or size): refuse that, and pickle them (to hand them to
    another process) through the constructor instead."""

    def __setstate__(self: Any, state: Any) -> None:
        raise _Problem(f"refused to unpickle data.pkl: it sets the state of a {cls.__name__}")

    def __reduce__(self: Any) -> tuple[type, tuple[Any, ...]]:
        return cls, tuple(getattr(self, field.name) for field in fields(self))

    cls.__setstate__ = __setstate__  # type: ignore[attr-defined]
    cls.__reduce__ = __reduce__  # type: ignore[method-assign,assignment]
    return cls


@_unbuildable
@dataclass(frozen=True, slots=True)
class StorageRecord:
    """One storage's bytes: ``nbytes`` bytes at absolute offset ``data_offset`` of ``path``;
    ``dtype`` is its element type as saved ("uint8" for an untyped storage)."""

    path: Path
    key: str
    data_offset: int
    nbytes: int
    dtype: str


@_unbuildable
@dataclass(frozen=True, slots=True)
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
        """Elements ``[start, end)`` of the flattened tensor as a fresh 1-D array
        (contiguous tensors only)."""
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

    def numpy(self) -> np.ndarray:
        """The whole tensor in its shape, a fresh array the caller owns."""
        if self.is_contiguous():
            return self.read().reshape(self.shape)
        covered = _read(self.storage, self.dtype, self.storage_offset, _span(self.shape, self.stride))
        strides = tuple(step * covered.itemsize for step in self.stride)
        # np.ndarray over the bytes, not as_strided: that cannot handle ml_dtypes' dtypes.
        return np.ndarray(self.shape, covered.dtype, covered.view(np.uint8), 0, strides).copy()


def load_torch_file(path: Path, allowed: Mapping[str, type] | None = None) -> Any:
    """The object a torch.save file holds, with :class:`StoredTensor` leaves (``torch.Size``
    comes back as a tuple, a dtype as its name).

    ``allowed`` maps further globals (``"module.name"``) to data-only stand-in classes: the
    pickle may call one with arguments, create one without ``__init__`` and fill its
    ``__dict__`` (or call the stand-in's own ``__setstate__``). It cannot replace the
    built-in entries. Raises TorchFileError, whose one-line message starts with ``path``.
    """
    path = Path(path)
    globals_ = dict(_GLOBALS)
    for name, cls in (allowed or {}).items():
        if not isinstance(cls, type):
            raise TypeError(f"allowed[{name!r}] must be a class, not {type(cls).__name__}")
        globals_.setdefault(name, _seal(name, cls))
    try:
        with _open_zip(path) as zip_file, open(path, "rb", buffering=0) as file:
            archive = _Archive(path, zip_file, file.fileno())
            order = archive.read("byteorder")
            if order not in (None, b"little"):
                raise _Problem(f"byte order {order!r} is unsupported: only little-endian files are read")
            data = archive.read("data.pkl")
            if data is None:
                raise _Problem(f"record {archive.prefix}data.pkl is missing")
            return _unpickle(data, globals_, archive.storage)
    except _Problem as problem:
        raise TorchFileError(f"{path}: {problem}") from None
    except OSError as err:
        raise TorchFileError(f"{path}: cannot be read: {err.strerror or err}") from None


# ---- the unpickler ---------------------------------------------------------------------


class _SealedGlobal(type):
    """The type of what find_class hands out for a callable global. Calling it calls the
    target (REDUCE) and NEWOBJ gets ``target.__new__(target, *args)``, as with the target
    itself, but a BUILD on the global fails: the targets are shared by every load, and a file
    must not set their attributes (torch's weights-only unpickler refuses that too)."""

    def __call__(cls, *args: Any) -> Any:
        return cls.target(*args)  # type: ignore[attr-defined]

    def __setattr__(cls, name: str, value: Any) -> None:
        raise _Problem(f"refused to unpickle data.pkl: it sets attribute {name!r} of global {cls.__name__!r}")


def _seal(qualname: str, target: Callable[..., Any]) -> type:
    def new(cls: type, *args: Any) -> Any:
        if not isinstance(target, type):
            raise _Problem(f"refused to unpickle data.pkl: NEWOBJ of {qualname!r}, which is not a class")
        return target.__new__(target, *args)

    return _SealedGlobal(qualname, (), {"__slots__": (), "target": staticmethod(target), "__new__": new})


@_unbuildable
@dataclass(frozen=True, slots=True)
class _StorageType:
    """What a storage class global (``torch.FloatStorage``) unpickles to."""

    dtype: str


# The opcodes a torch.save pickle (protocol 2 to 4) uses for data; no buffers, INST/OBJ, EXT.
_OPCODES = frozenset((
    "PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "DUP", "NONE", "NEWTRUE", "NEWFALSE", "BININT",
    "BININT1", "BININT2", "LONG1", "LONG4", "BINFLOAT", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8",
    "SHORT_BINBYTES", "BINBYTES", "BINBYTES8", "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_LIST",
    "APPEND", "APPENDS", "EMPTY_DICT", "SETITEM", "SETITEMS", "EMPTY_SET", "ADDITEMS", "FROZENSET", "GLOBAL",
    "STACK_GLOBAL", "REDUCE", "NEWOBJ", "BUILD", "BINPERSID", "BINGET", "LONG_BINGET", "BINPUT", "LONG_BINPUT",
    "MEMOIZE",
))  # fmt: skip


def _check_opcodes(data: bytes) -> None:
    """Refuse opcodes outside _OPCODES. Also bound memo indices: the C unpickler sizes its
    memo by the largest index, so a tiny pickle could make it allocate gigabytes."""
    try:
        for opcode, arg, _ in pickletools.genops(data):
            if opcode.name not in _OPCODES:
                raise _Problem(f"refused to unpickle data.pkl: opcode {opcode.name} is not allowed")
            if opcode.name in ("BINPUT", "LONG_BINPUT") and arg > len(data):
                raise _Problem(f"corrupt pickle data.pkl: memo index {arg} in a pickle of {len(data)} bytes")
    except ValueError as err:
        raise _Problem(f"corrupt pickle data.pkl: {_one_line(err)}") from None


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, globals_: Mapping[str, Any], storage: Callable[[Any], StorageRecord]) -> None:
        super().__init__(io.BytesIO(data))
        self._globals = globals_
        self._storage = storage

    def find_class(self, module: str, name: str) -> Any:
        qualname = f"{'builtins' if module == '__builtin__' else module}.{name}"
        if qualname not in self._globals:
            raise _Problem(f"refused to unpickle data.pkl: global {qualname!r} is not allowed")
        return self._globals[qualname]

    def persistent_load(self, pid: Any) -> StorageRecord:
        return self._storage(pid)


def _unpickle(data: bytes, globals_: Mapping[str, Any], storage: Callable[[Any], StorageRecord]) -> Any:
    _check_opcodes(data)
    try:
        return _Unpickler(data, globals_, storage).load()
    except _Problem:
        raise
    except Exception as err:  # noqa: BLE001 - whatever a malformed stream makes the unpickler or a stand-in raise
        raise _Problem(f"corrupt pickle data.pkl: {_one_line(err)}") from None


# The rebuild functions take what the file passes, anything: _tensor checks it. Hooks are
# ignored (torch.save writes an empty OrderedDict; a pickle cannot make a callable hook).
def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, hooks, metadata=None):
    dtype = storage.dtype if isinstance(storage, StorageRecord) else None
    return _tensor(storage, dtype, storage_offset, size, stride, requires_grad, metadata)


def _rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad, hooks, dtype, metadata=None):
    return _tensor(storage, dtype, storage_offset, size, stride, requires_grad, metadata)


def _rebuild_parameter(data: Any, requires_grad: Any, hooks: Any) -> StoredTensor:
    if not isinstance(data, StoredTensor) or type(requires_grad) is not bool:
        raise _Problem("corrupt pickle data.pkl: malformed parameter")
    return replace(data, requires_grad=requires_grad)


def _tensor(
    storage: Any, dtype: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any, metadata: Any
) -> StoredTensor:
    """A StoredTensor from rebuild arguments, once they are checked to describe a view that
    lies inside its storage."""
    shape, steps = _sizes(size), _sizes(stride)
    if (
        not isinstance(storage, StorageRecord)
        or dtype not in _DTYPES
        or shape is None
        or steps is None
        or len(shape) != len(steps)
        or type(storage_offset) is not int
        or storage_offset < 0
        or type(requires_grad) is not bool
    ):
        raise _Problem("corrupt pickle data.pkl: malformed tensor")
    if metadata:  # the conjugate or negative bit: values would need a transformation
        raise _Problem(f"tensor metadata {_one_line(reprlib.repr(metadata))} is unsupported")
    tensor = StoredTensor(storage, dtype, shape, steps, storage_offset, requires_grad)
    if tensor.numel():
        needed = (storage_offset + _span(shape, steps)) * _DTYPES[dtype][0].itemsize
        if needed > storage.nbytes:
            raise _Problem(
                f"a {dtype} tensor of shape {shape}, stride {steps}, offset {storage_offset} "
                f"needs {needed} bytes of storage {storage.key}, which has {storage.nbytes}"
            )
    return tensor


def _sizes(value: Any) -> tuple[int, ...] | None:
    ok = isinstance(value, (tuple, list)) and all(type(item) is int and item >= 0 for item in value)
    return tuple(value) if ok else None


def _span(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Elements from a view's first to its last, inclusive."""
    if math.prod(shape) == 0:
        return 0
    return 1 + sum((size - 1) * step for size, step in zip(shape, stride))


_GLOBALS: dict[str, Any] = {
    **{f"torch.{storage}": _StorageType(name) for name, (_, storage) in _DTYPES.items() if storage},
    "torch.storage.UntypedStorage": _StorageType("uint8"),
    **{f"torch.{name}": name for name in _DTYPES},  # dtypes (_rebuild_tensor_v3's argument)
    **{
        name: _seal(name, target)
        for name, target in {
            "torch._utils._rebuild_tensor_v2": _rebuild_tensor_v2,
            "torch._utils._rebuild_tensor_v3": _rebuild_tensor_v3,
            "torch._utils._rebuild_parameter": _rebuild_parameter,
            "torch.Size": tuple,
            "collections.OrderedDict": OrderedDict,
            "builtins.set": set,
        }.items()
    },
}


# ---- the zip archive -------------------------------------------------------------------


def _open_zip(path: Path) -> zipfile.ZipFile:
    if not path.is_file():
        raise _Problem("file is missing" if not path.exists() else "not a file")
    try:
        return zipfile.ZipFile(path)
    except OSError:
        raise
    except Exception as err:  # noqa: BLE001 - zipfile's errors for a damaged directory vary
        with path.open("rb") as file:
            head = file.read(32)
        if _LEGACY_MAGIC in head:
            raise _Problem(
                "legacy torch.save format (torch < 1.6), which is unsupported: "
                "re-save it with torch.save in a current torch"
            ) from None
        if head.startswith(b"PK"):
            raise _Problem(f"truncated or corrupt zip archive: {_one_line(err)}") from None
        raise _Problem("empty file" if not head else "not a torch.save file (not a zip archive)") from None


class _Archive:
    """The records of one open torch.save zip, found through its central directory."""

    def __init__(self, path: Path, zip_file: zipfile.ZipFile, fd: int) -> None:
        self.path, self.zip_file, self.fd = path, zip_file, fd
        self.file_size = os.fstat(fd).st_size
        pickles = [name for name in zip_file.namelist() if name.endswith("/data.pkl") and name.count("/") == 1]
        if len(pickles) != 1:
            raise _Problem(f"not a torch.save archive: {len(pickles)} <archive>/data.pkl records")
        self.prefix = pickles[0].removesuffix("data.pkl")
        self.storages: dict[str, StorageRecord] = {}

    def info(self, name: str) -> zipfile.ZipInfo | None:
        try:
            info = self.zip_file.getinfo(self.prefix + name)
        except KeyError:
            return None
        if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 1:
            raise _Problem(f"record {info.filename} is compressed or encrypted; torch.save stores records as they are")
        return info

    def read(self, name: str) -> bytes | None:
        """A small record's bytes (CRC checked), None where there is no such record."""
        info = self.info(name)
        if info is None:
            return None
        try:
            return self.zip_file.read(info)
        except (zipfile.BadZipFile, EOFError) as err:
            raise _Problem(f"record {info.filename} is corrupt: {_one_line(err)}") from None

    def storage(self, pid: Any) -> StorageRecord:
        """The storage a persistent id names; one record object per key."""
        if not (
            isinstance(pid, tuple)
            and len(pid) == 5
            and pid[0] == "storage"
            and isinstance(pid[1], _StorageType)
            and isinstance(pid[2], str)
            and type(pid[4]) is int
            and pid[4] >= 0
        ):
            raise _Problem(f"corrupt pickle data.pkl: unexpected persistent id {_one_line(reprlib.repr(pid))}")
        _, kind, key, _location, numel = pid
        nbytes = numel * _DTYPES[kind.dtype][0].itemsize
        record = self.storages.get(key)
        if record is None:
            info = self.info(f"data/{key}")
            if info is None:
                raise _Problem(f"storage record {self.prefix}data/{key} is missing")
            if info.file_size < nbytes:
                raise _Problem(
                    f"storage record {info.filename} has {info.file_size} bytes, "
                    f"its {numel}-element {kind.dtype} storage needs {nbytes}"
                )
            record = StorageRecord(self.path, key, self._data_offset(info), nbytes, kind.dtype)
            self.storages[key] = record
        elif (record.dtype, record.nbytes) != (kind.dtype, nbytes):
            raise _Problem(f"corrupt pickle data.pkl: storage {key} is declared with two types or sizes")
        return record

    def _data_offset(self, info: zipfile.ZipInfo) -> int:
        # The local header repeats the name and has its own extra field (torch pads it to
        # align the data), so the data starts where that header says, not the directory.
        header = os.pread(self.fd, 30, info.header_offset)
        if len(header) < 30 or header[:4] != b"PK\x03\x04":
            raise _Problem(f"record {info.filename}: bad local zip header")
        name_length, extra_length = struct.unpack_from("<HH", header, 26)
        start = info.header_offset + 30 + name_length + extra_length
        if start + info.file_size > self.file_size:
            raise _Problem(f"record {info.filename} runs past the end of the file (truncated?)")
        return start


# ---- reading tensor bytes ----------------------------------------------------------------


def _read(storage: StorageRecord, dtype: str, first: int, count: int) -> np.ndarray:
    """``count`` elements of ``dtype`` from element ``first`` of a storage, via pread."""
    out = np.empty(count, _DTYPES[dtype][0])
    buffer = memoryview(out.view(np.uint8))
    offset = storage.data_offset + first * out.itemsize
    try:
        with open(storage.path, "rb", buffering=0) as file:
            done = 0
            while done < len(buffer):
                got = _pread_into(file.fileno(), buffer[done : done + _READ_CHUNK], offset + done)
                if not got:
                    raise TorchFileError(
                        f"{storage.path}: file ends inside storage record {storage.key} (changed since it was loaded?)"
                    )
                done += got
    except OSError as err:
        raise TorchFileError(f"{storage.path}: cannot be read: {err.strerror or err}") from None
    return out


def _pread_into(fd: int, buffer: memoryview, offset: int) -> int:
    if hasattr(os, "preadv"):
        return os.preadv(fd, [buffer], offset)
    data = os.pread(fd, len(buffer), offset)
    buffer[: len(data)] = data
    return len(data)


def _one_line(value: Any) -> str:
    text = " ".join(str(value).split()) or type(value).__name__
    return text if len(text) <= 200 else text[:197] + "..."
