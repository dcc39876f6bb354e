"""How the command line tells a user's error from a bug, and words either in one line."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from ..io.safetensors_io import describe_os_error, named_os_error

_TRACEBACK = "Traceback (most recent call last):"
# Errors about the output's disk, not about the input: worth naming the output directory.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})


def is_user_error(err: BaseException) -> bool:
    """Bad input or a bad environment (ValueError, OSError), as opposed to a bug in zeroshard.

    The library raises ValueError (DeepSpeedFormatError included) for a bad argument or a
    damaged, inconsistent or unsupported file, and OSError (FileNotFoundError,
    PermissionError, ENOSPC, ...) when the file system says no.
    """
    return isinstance(err, (ValueError, OSError))


def describe_error(err: BaseException) -> str:
    """``err`` in one line: an OSError as "PATH: reason", anything else as its message."""
    if isinstance(err, OSError) and err.strerror:
        text = describe_os_error(err)
    elif isinstance(err, KeyError) and err.args:
        text = str(err.args[0])
    else:
        text = str(err) or type(err).__name__
    if _TRACEBACK in text:  # a spawned rank's error carries its traceback: keep its last line
        head, _, trace = text.partition(_TRACEBACK)
        text = f"{head} {trace.strip().splitlines()[-1] if trace.strip() else ''}"
    return " ".join(text.split())


def name_output(err: OSError, out: str | os.PathLike[str]) -> OSError:
    """``err`` naming the output directory ``out`` when it is about the output's disk (a full
    disk, a quota, a read-only file system) and names no file itself."""
    return named_os_error(err, Path(out)) if err.errno in DISK_ERRNOS else err
