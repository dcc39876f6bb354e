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
zip directory (a file of up to ``WHOLE_FILE_BYTES`` with one read of all of it, a bigger one
structure by structure), and keeps no tensor bytes; those are read with ``os.pread`` when
asked for.

Integrity: every record read is checked against the CRC-32 of the zip directory:
``data.pkl`` and ``byteorder`` when read here, a storage record the first time any of its
bytes are read (:func:`~.torch_records.verify_record`). No size the file declares drives an
allocation beyond the bytes it holds: a storage must fit its record, and a tensor view must
fit its storage and hold no more elements than it (so a stride-0 view of a small storage
cannot expand into gigabytes). What unpickling creates and copies is charged to the file's
:class:`~zeroshard.io.budget.Budget`, which the caller keeps charging for what it
does with the result (the DeepSpeed importer charges every tensor it keeps).
"""

from __future__ import annotations

import enum
import functools
import itertools
import os
import struct
import types
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from ..io.budget import Budget, BudgetExceeded, named, quoted
from ..io.members import open_member
from ..io.read_stats import count_read
from .torch_records import (
    FileProblem,
    StorageRecord,
    StoredTensor,
    TorchFileError,
    crc32,
    one_line,
    refuses_state_of,
)
from .torch_unpickler import ALLOWED_GLOBALS, ITEMSIZES, StorageType, seal, unpickle
from .zip_directory import read_directory

__all__ = ["StorageRecord", "StoredTensor", "TorchFile", "TorchFileError", "load_torch_file", "read_torch_file"]

_new_tuple = tuple.__new__
_LEGACY_MAGIC = (0x1950A86A20F9469CFC6C).to_bytes(10, "little")  # first pickle of pre-1.6 files
WHOLE_FILE_BYTES = 1 << 20  # files up to this size are read with one read, not record by record
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., name length, extra field length
_loads = itertools.count(1)  # numbers the loads of this process (StorageRecord.load)


# The functional form, so that the field types are objects: in a class body this module's
# ``from __future__ import annotations`` makes them strings, which nothing can resolve for the
# generated ``__new__`` (it belongs to no module), and pdoc warns of each.
TorchFile = NamedTuple("TorchFile", [("value", Any), ("pickle", bytes), ("budget", Budget)])
TorchFile.__doc__ = """What :func:`read_torch_file` read: ``value``, the object; ``pickle``, the bytes
of the pickle it was unpickled from (checked: a caller can tell files holding the same pickle
apart); and ``budget``, the file's budget, for the caller to go on charging. (A tuple: one is
made per file.)"""


def load_torch_file(path: Path, allowed: Mapping[str, type] | None = None) -> Any:
    """The object a torch.save file holds, with :class:`StoredTensor` leaves (``torch.Size``
    comes back as a tuple, an ``OrderedDict`` as a
    :class:`~.torch_unpickler.LoadedOrderedDict`, a dtype as its name).

    ``allowed`` maps further globals (``"module.name"``) to data-only stand-in classes: the
    pickle may call one with arguments, create one without ``__init__`` and set its state
    through its ``__setstate__``, which every stand-in must have: one that fills its
    ``__dict__`` within the load's budget (:func:`~.torch_records.fills_state`), its own, or
    one that refuses (:func:`~.torch_records.refuses_state`; a stand-in whose instances are
    shared beyond one load, an Enum's members, must refuse, so that a file cannot change them
    for the whole process). It cannot replace the built-in entries. Raises TorchFileError,
    whose one-line message starts with ``path``, also where the file would cost more than its
    budget (:mod:`zeroshard.io.budget`).
    """
    return read_torch_file(path, allowed).value


def read_torch_file(path: Path, allowed: Mapping[str, type] | None = None) -> TorchFile:
    """:func:`load_torch_file`, with the pickle's bytes and the file's budget."""
    path = path if isinstance(path, Path) else Path(path)  # Path(a Path) parses it again
    stand_ins = tuple((allowed or {}).items())
    for name, cls in stand_ins:
        if not isinstance(cls, type):
            raise TypeError(f"allowed[{name!r}] must be a class, not {type(cls).__name__}")
    globals_ = _globals(stand_ins)
    try:
        fd, size = _open_file(path)
        try:
            archive = _Archive(path, _FileBytes(fd, size, path.name))
            order = archive.read("byteorder")
            if order not in (None, b"little"):
                raise FileProblem(f"byte order {order!r} is unsupported: only little-endian files are read")
            data = archive.read("data.pkl")
            if data is None:
                raise FileProblem(f"record {archive.prefix}data.pkl is missing")
            budget = Budget(path, size)
            value = unpickle(data, globals_, archive.storage, budget)
            return _new_tuple(TorchFile, (value, data, budget))  # TorchFile(...) is a Python call
        finally:
            os.close(fd)
    except FileProblem as problem:
        raise TorchFileError(f"{path}: {problem}") from None
    except BudgetExceeded as err:
        raise TorchFileError(str(err)) from None
    except OSError as err:
        raise TorchFileError(f"{path}: cannot be read: {err.strerror or err}") from None


@functools.lru_cache(maxsize=64)
def _globals(allowed: tuple[tuple[str, type], ...]) -> Mapping[str, Any]:
    """The globals a pickle may name: the built-in ones and the allowed stand-ins, sealed;
    made once per ``allowed`` (a DeepSpeed checkpoint loads thousands of files with one)."""
    globals_ = dict(ALLOWED_GLOBALS)
    for name, cls in allowed:
        if issubclass(cls, enum.Enum) and not refuses_state_of(cls):
            raise TypeError(
                f"allowed[{name!r}] is an Enum, whose members every load shares: decorate it with refuses_state"
            )
        if getattr(cls, "__setstate__", None) is None:
            raise TypeError(
                f"allowed[{name!r}] has no __setstate__, so a pickle's BUILD would fill it uncharged: "
                "decorate it with fills_state (or refuses_state)"
            )
        globals_.setdefault(name, seal(name, cls))
    return types.MappingProxyType(globals_)


# ---- the zip archive -------------------------------------------------------------------


def _open_file(path: Path) -> tuple[int, int]:
    """A read-only descriptor of the regular file ``path``, and the file's size; a FIFO or a
    device is refused, never waited on (:func:`~zeroshard.io.members.open_member`)."""
    try:
        fd = open_member(path, follow_links=True)
    except FileNotFoundError:
        raise FileProblem("file is missing") from None
    except ValueError:  # what it is not: a FIFO, a device, a directory
        raise FileProblem("not a regular file") from None
    return fd, os.fstat(fd).st_size


class _FileBytes:
    """A file's bytes by offset: slices of one read of the whole file when it is small (a
    DeepSpeed rank file at large D is a few KB, and each pread is a system call), else
    ``pread`` calls. ``size`` is what the file held when opened."""

    def __init__(self, fd: int, size: int, name: str = "") -> None:
        self.fd, self.size, self.whole, self.name = fd, size, None, name
        if size <= WHOLE_FILE_BYTES:
            self.whole = _read_whole(fd, self.size)
            self.size = len(self.whole)
            count_read(None, name, self.size, opening=True)

    def read(self, offset: int, size: int) -> bytes:
        """Up to ``size`` bytes from ``offset`` (fewer where the file ends first)."""
        if self.whole is not None:
            return self.whole[offset : offset + size]
        data = os.pread(self.fd, size, offset)
        count_read(None, self.name, len(data), opening=True)
        return data

    def unpack(self, layout: struct.Struct, offset: int) -> tuple[Any, ...]:
        """``layout`` unpacked from ``offset``; struct.error where the file ends first."""
        if self.whole is not None:
            return layout.unpack_from(self.whole, offset)
        return layout.unpack(self.read(offset, layout.size))


def _read_whole(fd: int, size: int) -> bytes:
    parts, done = [], 0
    while done < size:
        part = os.pread(fd, size - done, done)
        if not part:
            break  # shorter than fstat said: what follows checks the bytes there are
        parts.append(part)
        done += len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _directory(path: Path, file: _FileBytes) -> Mapping[str, Any]:
    """The archive's records by name: :class:`~.zip_directory.Entry` for the layout torch.save
    writes, ``zipfile.ZipInfo`` through ``zipfile`` for anything else."""
    found = read_directory(file.read, file.size)
    if found is not None:
        return found
    with _open_zip(path) as zip_file:
        records = zip_file.infolist()
        if len(records) != len(zip_file.NameToInfo):  # torch.load reads the first of two, zipfile the last
            seen: set[str] = set()
            twice = next(info.filename for info in records if info.filename in seen or seen.add(info.filename))
            raise FileProblem(f"the zip archive holds two records named {quoted(twice)}")
        return dict(zip_file.NameToInfo)


def _open_zip(path: Path) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(path)
    except OSError:
        raise
    except Exception as err:  # noqa: BLE001 - zipfile's errors for a damaged directory vary
        with path.open("rb") as file:
            head = file.read(32)
        if _LEGACY_MAGIC in head:
            raise FileProblem(
                "legacy torch.save format (torch < 1.6), which is unsupported: "
                "re-save it with torch.save in a current torch"
            ) from None
        if head.startswith(b"PK"):
            raise FileProblem(f"truncated or corrupt zip archive: {one_line(err)}") from None
        raise FileProblem("empty file" if not head else "not a torch.save file (not a zip archive)") from None


class _Archive:
    """The records of one open torch.save zip, found through its central directory."""

    def __init__(self, path: Path, file: _FileBytes) -> None:
        self.path, self.file = path, file
        self.entries = entries = _directory(path, file)
        pickles = [name for name in entries if name.endswith("/data.pkl") and name.count("/") == 1]
        if len(pickles) != 1:
            raise FileProblem(f"not a torch.save archive: {len(pickles)} <archive>/data.pkl records")
        self.prefix = pickles[0].removesuffix("data.pkl")
        self.storages: dict[str, StorageRecord] = {}
        self.load = next(_loads)

    def info(self, name: str) -> Any:
        """The record ``name`` (a ZipInfo or an Entry), None where there is none."""
        info = self.entries.get(self.prefix + name)
        if info is None:
            return None
        if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 1:
            raise FileProblem(
                f"record {named(info.filename)} is compressed or encrypted; torch.save stores records as they are"
            )
        return info

    def read(self, name: str) -> bytes | None:
        """A small record's bytes (CRC checked), None where there is no such record."""
        info = self.info(name)
        if info is None:
            return None
        data = self.file.read(self._data_offset(info), info.file_size)
        if len(data) != info.file_size:
            raise FileProblem(f"record {named(info.filename)} runs past the end of the file (truncated?)")
        found = crc32(data)
        if found != info.CRC:
            raise FileProblem(
                f"record {named(info.filename)} is corrupt: its CRC-32 is {found:08x}, "
                f"the zip directory says {info.CRC:08x}"
            )
        return data

    def storage(self, pid: Any) -> StorageRecord:
        """The storage a persistent id names; one record object per key."""
        if type(pid) is not tuple or len(pid) != 5:
            raise _unexpected_pid(pid)
        tag, kind, key, _location, numel = pid
        if not (tag == "storage" and isinstance(kind, StorageType) and isinstance(key, str) and type(numel) is int):
            raise _unexpected_pid(pid)
        if numel < 0:
            raise _unexpected_pid(pid)
        nbytes = numel * ITEMSIZES[kind.dtype]
        record = self.storages.get(key)
        if record is None:
            info = self.info(f"data/{key}")
            if info is None:
                raise FileProblem(f"storage record {named(f'{self.prefix}data/{key}')} is missing")
            name, size = info.filename, info.file_size
            if size < nbytes:
                raise FileProblem(
                    f"storage record {named(name)} has {size} bytes, "
                    f"its {numel}-element {kind.dtype} storage needs {nbytes}"
                )
            offset = self._data_offset(info)
            record = StorageRecord(self.path, key, offset, nbytes, kind.dtype, name, size, info.CRC, self.load)
            self.storages[key] = record
        elif record.nbytes != nbytes or record.dtype != kind.dtype:
            raise FileProblem(f"corrupt pickle data.pkl: storage {named(key)} is declared with two types or sizes")
        return record

    def _data_offset(self, info: Any) -> int:
        # The local header repeats the name and has its own extra field (torch pads it to
        # align the data), so the data starts where that header says, not the directory.
        try:
            signature, name_length, extra_length = self.file.unpack(_LOCAL_HEADER, info.header_offset)
        except struct.error:  # the file ends inside the header
            signature = None
        if signature != b"PK\x03\x04":
            raise FileProblem(f"record {named(info.filename)}: bad local zip header")
        start = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
        if start + info.file_size > self.file.size:
            raise FileProblem(f"record {named(info.filename)} runs past the end of the file (truncated?)")
        return start


def _unexpected_pid(pid: Any) -> FileProblem:
    return FileProblem(f"corrupt pickle data.pkl: unexpected persistent id {quoted(pid)}")
