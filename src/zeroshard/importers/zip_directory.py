"""The central directory of a torch.save zip archive, read with two preads.

``zipfile.ZipFile`` builds a full ``ZipInfo`` per record in Python, which costs more than
the rest of opening a small DeepSpeed rank file. :func:`read_directory` parses the layout
torch.save writes (no archive comment, no data before the archive, a zip64 end record or
not, every size in the 32-bit fields) into :class:`Entry` records with the attributes of
``ZipInfo`` that the reader uses. Anything else gives None, and the caller falls back to
``zipfile``, which also words the errors for damaged archives.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

_END = struct.Struct("<4s4H2IH")  # end of central directory record
_ZIP64_LOCATOR = struct.Struct("<4sIQI")
_ZIP64_END = struct.Struct("<4sQ2H2I4Q")
_HEADER = struct.Struct("<4s6H3I5HII")  # central directory file header
_MAX_32 = 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class Entry:
    """One record, named as in ``zipfile.ZipInfo``."""

    filename: str
    header_offset: int
    file_size: int
    compress_size: int
    compress_type: int
    flag_bits: int
    CRC: int  # noqa: N815 - ZipInfo's name


def read_directory(fd: int) -> dict[str, Entry] | None:
    """Records by name, or None where the archive is not laid out as torch.save writes it."""
    size = os.fstat(fd).st_size
    if size < _END.size:
        return None
    end_at = size - _END.size
    signature, disk, directory_disk, disk_count, count, directory_size, directory_at, comment = _END.unpack(
        os.pread(fd, _END.size, end_at)
    )
    if signature != b"PK\x05\x06" or disk or directory_disk or comment or disk_count != count:
        return None
    record_at = end_at
    if end_at >= _ZIP64_LOCATOR.size + _ZIP64_END.size:
        zip64 = _zip64_end(fd, end_at)
        if zip64 is False:
            return None
        if zip64 is not None:
            count, directory_size, directory_at, record_at = zip64
    if directory_at + directory_size != record_at:  # data before the archive, or a damaged record
        return None
    return _entries(os.pread(fd, directory_size, directory_at), count, directory_at)


def _zip64_end(fd: int, end_at: int) -> tuple[int, int, int, int] | None | bool:
    """(records, directory size, directory offset, record offset) from the zip64 end record;
    None where there is none, False where it is not as torch writes it."""
    locator_at = end_at - _ZIP64_LOCATOR.size
    signature, disk, record_at, disks = _ZIP64_LOCATOR.unpack(os.pread(fd, _ZIP64_LOCATOR.size, locator_at))
    if signature != b"PK\x06\x07":
        return None
    if disk or disks != 1 or record_at + _ZIP64_END.size != locator_at:
        return False
    fields = _ZIP64_END.unpack(os.pread(fd, _ZIP64_END.size, record_at))
    signature, _, _, _, disk, directory_disk, disk_count, count, directory_size, directory_at = fields
    if signature != b"PK\x06\x06" or disk or directory_disk or disk_count != count:
        return False
    return count, directory_size, directory_at, record_at


def _entries(data: bytes, count: int, directory_at: int) -> dict[str, Entry] | None:
    entries: dict[str, Entry] = {}
    position = 0
    for _ in range(count):
        if position + _HEADER.size > len(data):
            return None
        fields = _HEADER.unpack_from(data, position)
        signature, _, _, flags, method, _, _, crc, compressed, file_size = fields[:10]
        name_length, extra_length, comment_length = fields[10:13]
        header_offset = fields[-1]
        if signature != b"PK\x01\x02" or _MAX_32 in (compressed, file_size, header_offset):
            return None  # zip64 sizes: leave them to zipfile
        if header_offset >= directory_at:
            return None
        start = position + _HEADER.size
        raw_name = data[start : start + name_length]
        if len(raw_name) != name_length or not raw_name.isascii() or b"\x00" in raw_name:
            return None
        name = raw_name.decode("ascii")
        entries[name] = Entry(name, header_offset, file_size, compressed, method, flags, crc)
        position = start + name_length + extra_length + comment_length
    return entries if position == len(data) else None
