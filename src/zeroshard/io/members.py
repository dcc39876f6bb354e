"""Files a checkpoint names: plain names in its own directory, regular files, never links.

A manifest comes from disk and is hostile until checked, so no name it holds may reach a
file outside the checkpoint's directory: :func:`member_path` admits only a plain file name
(no separator, not ``.`` or ``..``, not absolute, no NUL) of a regular file that is not a
symbolic link, wherever it points. Every reader of native and universal checkpoints goes
through it when it opens a checkpoint, and opens the files with :func:`open_member`
(``O_NOFOLLOW``), so a file swapped for a link after the check is refused too.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from .damage import CheckpointDamagedError, MissingFileError

_NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)  # POSIX; elsewhere the lstat check stands alone
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # opening a FIFO must not wait for a writer
_LINK = "{path}: a symbolic link; files of a checkpoint must be regular files in its directory"


def name_problem(name: object) -> str | None:
    """Why ``name`` is not a plain file name, or None when it is one."""
    if not isinstance(name, str) or not name:
        return "not a file name"
    if "\0" in name:
        return "holds a NUL character"
    if name in (".", ".."):
        return "a directory, not a file name"
    if name.startswith(("/", "\\")) or os.path.isabs(name):
        return "an absolute path, not a file name in the checkpoint's directory"
    parts = name.replace("\\", "/").split("/")
    if len(parts) > 1:
        return "a path leaving the checkpoint's directory" if ".." in parts else "a path, not a plain file name"
    return None


def member_path(directory: Path, name: str) -> Path:
    """``directory / name`` once ``name`` is a plain name there of a regular file, not a link.

    Otherwise the checkpoint is not what was saved: MissingFileError when the file is missing,
    CheckpointDamagedError for the rest; one line naming the file.
    """
    problem = name_problem(name)
    if problem is not None:
        raise CheckpointDamagedError(f"{directory}: the manifest names file {name!r}: {problem}; refused")
    path = directory / name
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise MissingFileError(f"{path}: missing; the manifest lists it") from None
    if stat.S_ISLNK(info.st_mode):
        raise CheckpointDamagedError(_LINK.format(path=path))
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointDamagedError(f"{path}: not a regular file")
    return path


def open_member(path: Path, *, follow_links: bool = False, direct: bool = False, read_ahead: bool = True) -> int:
    """A read-only descriptor of the regular file ``path``; ValueError for a symbolic link
    (in the last component, unless ``follow_links``) or anything but a regular file, which is
    never waited on (a FIFO would block an open or a read for ever). ``direct``: its reads
    skip the page cache (``O_DIRECT``; OSError EINVAL where the file system refuses).
    ``read_ahead=False``: its reads bring only their own bytes into the page cache
    (``POSIX_FADV_RANDOM``), for a header or a block read alone beside ranges read direct,
    which the kernel's read-ahead would otherwise read from the disk a second time."""
    flags = os.O_RDONLY | (0 if follow_links else _NO_FOLLOW) | _CLOEXEC | _NONBLOCK
    try:
        fd = os.open(path, flags | (os.O_DIRECT if direct else 0))
    except OSError as err:
        if err.errno == errno.ELOOP and _NO_FOLLOW and not follow_links:
            raise ValueError(_LINK.format(path=path)) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"{path}: not a regular file")
    if not read_ahead and hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # this descriptor's reads only
        except OSError:
            pass  # a hint: a file system that takes none reads the same bytes
    return fd


def read_small_file(path: Path, limit: int, *, follow_links: bool = True) -> bytes:
    """The bytes of the regular file ``path`` (see :func:`open_member`), at most ``limit`` of
    them: ValueError when it holds more (a pointer file or a small JSON, not a stream)."""
    with open(open_member(path, follow_links=follow_links), "rb") as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path}: holds more than {limit} bytes; not the small file expected here")
    return data
