"""One writer at a time: an advisory lock on a checkpoint root or a conversion's output.

A save holds ``<root>/.lock`` from before it cleans up after interrupted saves until its
checkpoint is published; a conversion holds ``.<OUT>.lock`` next to its output directory.
The lock is ``flock`` on that file, so the kernel drops it when its holder dies, however it
dies: a stale lock is reclaimed by the next writer without anyone deleting anything. The
holder writes its pid, host, start time and purpose into the file, so a refused writer can
name it. The file is removed on release; a writer that opened it just before checks, once
it has the lock, that the file it locked is still the one at the path.

While the lock is held no other writer of the same place is alive (all of them take it), so
any staging directory found there belongs to a writer that died.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import stat
import time
from datetime import datetime, timezone
from pathlib import Path

from .safetensors_io import named_os_error

log = logging.getLogger(__name__)

_POLL_SECONDS = 0.05
# flock is not available on every filesystem (Lustre mounted with noflock, some FUSE).
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}


class WriterLockedError(OSError):
    """Another live process holds the lock: it is writing the same checkpoint root or output."""


class WriterLock:
    """An exclusive advisory lock on ``path`` (created if absent), held between
    :meth:`acquire` and :meth:`release`, or for a ``with`` block.

    ``what`` says what the holder is doing ("saving tag 'step100'"); it is recorded for the
    error a refused writer gets. ``wait``: seconds to keep trying before giving up (0: fail at
    once). ``held`` is False after acquiring on a filesystem without ``flock``: a warning is
    logged and the caller proceeds unprotected (it must then not delete others' staging).
    """

    def __init__(self, path: Path, what: str, *, wait: float = 0.0) -> None:
        self.path = Path(path)
        self.what = what
        self.wait = wait
        self.held = False
        self._fd: int | None = None

    def acquire(self) -> WriterLock:
        """Take the lock (trying for up to ``wait`` seconds) and record this holder; returns self.

        Raises:
            WriterLockedError: another live process holds it still after ``wait``; the message
                names that holder.
            OSError: the path is not a regular file (a link, a FIFO), or cannot be opened.
        """
        deadline = time.monotonic() + self.wait
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                if time.monotonic() >= deadline:
                    raise WriterLockedError(self._refusal(holder)) from None
                time.sleep(_POLL_SECONDS)
                continue
            except OSError as err:
                os.close(fd)
                if err.errno not in _UNSUPPORTED:
                    raise
                log.warning("%s: the filesystem does not support flock; writing without a lock", self.path)
                return self
            if _still_at(fd, self.path):
                self._fd, self.held = fd, True
                try:
                    self._record()
                except BaseException:
                    self.release()
                    raise
                return self
            os.close(fd)  # its holder removed it after we opened it; lock the new one

    def _open(self) -> int:
        """The lock file's descriptor: a regular file (created if absent), never a link, and
        never waited on (a FIFO put there is refused, its descriptor closed)."""
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        fd = os.open(self.path, flags, 0o644)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.EINVAL, "not a regular file, so it cannot be a writer lock; remove it", str(self.path))
        return fd

    def release(self) -> None:
        """Remove the lock file and unlock it; nothing if not held."""
        if self._fd is None:
            return
        fd, self._fd, self.held = self._fd, None, False
        try:
            os.unlink(self.path)  # while locked: whoever locks this file next sees it gone and retries
        except FileNotFoundError:
            pass
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __enter__(self) -> WriterLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _record(self) -> None:
        assert self._fd is not None
        since = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        record = {"pid": os.getpid(), "host": socket.gethostname(), "since": since, "what": self.what}
        data = json.dumps(record).encode()
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, data, 0)
        except OSError as err:  # a full disk: the lock file is what was being written
            raise named_os_error(err, self.path) from err

    def _refusal(self, holder: dict | None) -> str:
        if holder is None:
            who = "another process (not recorded yet)"
        else:
            pid, host, since, what = (holder.get(key) for key in ("pid", "host", "since", "what"))
            who = f"pid {pid} on host {host} since {since} ({what})"
        return f"{self.path}: held by {who}; refusing to start {self.what}: one writer at a time"


def _holder(fd: int) -> dict | None:
    """The record of the lock's holder; it writes it right after locking, so an empty
    file is read again a few times before giving up."""
    for _ in range(20):
        try:
            record = json.loads(os.pread(fd, 4096, 0))
        except (OSError, ValueError):
            time.sleep(0.005)
            continue
        return record if isinstance(record, dict) else None
    return None


def _still_at(fd: int, path: Path) -> bool:
    try:
        current = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (opened.st_dev, opened.st_ino) == (current.st_dev, current.st_ino)
