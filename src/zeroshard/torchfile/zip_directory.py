"""The central directory of a torch.save zip archive, parsed from the archive's bytes.

``zipfile.ZipFile`` builds a full ``ZipInfo`` per record in Python, which costs more than
the rest of opening a small DeepSpeed rank file. :func:`read_directory` parses the layout
torch.save writes (no archive comment, no data before the archive, a zip64 end record or
not, every size in the 32-bit fields, no name twice) into :class:`Entry` records with the
attributes of ``ZipInfo`` that the reader uses. Anything else gives None, and the caller falls
back to ``zipfile``, which also words the errors for damaged archives.

The bytes come from ``read(offset, size)``: slices of the whole file when the caller read
it at once (small files), or ``pread`` calls (the end records, then the directory).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import NamedTuple

_END = struct.Struct("<4s4H2IH")  # end of central directory record
_ZIP64_LOCATOR = struct.Struct("<4sIQI")
_ZIP64_END = struct.Struct("<4sQ2H2I4Q")
# A central directory file header: signature, flags, method, CRC-32, sizes, name, extra and
# comment lengths, local header offset (versions, times, disk and attributes skipped).
_HEADER = struct.Struct("<4s4x2H4x3I3H8xI")
_MAX_32 = 0xFFFFFFFF

Read = Callable[[int, int], bytes]  # (offset, size) -> up to size bytes


class Entry(NamedTuple):
    """One record, named as in ``zipfile.ZipInfo`` (a tuple: thousands are made per conversion)."""

    filename: str
    header_offset: int
    file_size: int
    compress_size: int
    compress_type: int
    flag_bits: int
    CRC: int


def read_directory(read: Read, size: int) -> dict[str, Entry] | None:
    """Records by name, or None where the archive of ``size`` bytes is not laid out as
    torch.save writes it."""
    if size < _END.size:
        return None
    end_at = size - _END.size
    signature, disk, directory_disk, disk_count, count, directory_size, directory_at, comment = _END.unpack(
        read(end_at, _END.size)
    )
    if signature != b"PK\x05\x06" or disk or directory_disk or comment or disk_count != count:
        return None
    record_at = end_at
    if end_at >= _ZIP64_LOCATOR.size + _ZIP64_END.size:
        zip64 = _zip64_end(read, end_at)
        if zip64 is False:
            return None
        if zip64 is not None:
            count, directory_size, directory_at, record_at = zip64
    if directory_at + directory_size != record_at:  # data before the archive, or a damaged record
        return None
    return _entries(read(directory_at, directory_size), count, directory_at)


def _zip64_end(read: Read, end_at: int) -> tuple[int, int, int, int] | None | bool:
    """(records, directory size, directory offset, record offset) from the zip64 end record;
    None where there is none, False where it is not as torch writes it."""
    locator_at = end_at - _ZIP64_LOCATOR.size
    signature, disk, record_at, disks = _ZIP64_LOCATOR.unpack(read(locator_at, _ZIP64_LOCATOR.size))
    if signature != b"PK\x06\x07":
        return None
    if disk or disks != 1 or record_at + _ZIP64_END.size != locator_at:
        return False
    fields = _ZIP64_END.unpack(read(record_at, _ZIP64_END.size))
    signature, _, _, _, disk, directory_disk, disk_count, count, directory_size, directory_at = fields
    if signature != b"PK\x06\x06" or disk or directory_disk or disk_count != count:
        return False
    return count, directory_size, directory_at, record_at


def _entries(data: bytes, count: int, directory_at: int) -> dict[str, Entry] | None:
    entries: dict[str, Entry] = {}
    position = 0
    unpack, new_entry = _HEADER.unpack_from, tuple.__new__  # Entry(...) is a Python call
    try:
        for _ in range(count):
            (signature, flags, method, crc, compressed, file_size, name_length, extra_length, comment_length,
             header_offset) = unpack(data, position)  # fmt: skip
            if signature != b"PK\x01\x02" or _MAX_32 in (compressed, file_size, header_offset):
                return None  # zip64 sizes: leave them to zipfile
            if header_offset >= directory_at:
                return None
            start = position + _HEADER.size
            position = start + name_length  # a name cut short by the end: position ends past it
            name = data[start:position].decode("ascii")
            if name in entries:
                return None  # two records of one name: zipfile's reading words the refusal
            entries[name] = new_entry(Entry, (name, header_offset, file_size, compressed, method, flags, crc))
            position += extra_length + comment_length
    except (struct.error, UnicodeDecodeError):  # the directory ends early, or a name is not ASCII
        return None
    if position != len(data) or "\x00" in "".join(entries):
        return None
    return entries
