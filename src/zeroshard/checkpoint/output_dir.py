"""Conversion outputs appear whole or not at all.

A converter writes into ``OUT.tmp-<id>`` next to ``OUT``, fsyncs, and renames it to ``OUT``
only when everything is written. A failure removes the staging directory, so nothing under
``OUT`` ever looks complete unless it is. A conversion holds ``.OUT.lock`` (next to ``OUT``)
throughout, so a second one into the same ``OUT`` fails at once with a WriterLockedError
naming the first, instead of deleting its staging directory. An existing complete output is replaced only when
asked; a non-empty directory that is not one is never touched.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from .directory import fsync_dir
from .format import OLD_MARKER, TEMP_MARKER
from .writer_lock import WriterLock

_UNIQUE = re.compile(r"[0-9a-f]{12}")


@contextmanager
def staged_output(out_dir: str | os.PathLike[str], *, markers: Sequence[str], overwrite: bool, what: str) -> Iterator[Path]:
    """Yield an empty staging directory; on a normal exit it becomes ``out_dir``.

    ``markers`` are the file names whose presence makes a directory a complete ``what``
    (e.g. "universal checkpoint"). Checked before any work starts and again at the end.
    """
    out_dir = Path(out_dir)
    check_destination(out_dir, markers, overwrite, what)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with output_lock(out_dir, what) as lock:
        if lock.held:
            _remove_stale_staging(out_dir)
        staging = out_dir.with_name(f"{out_dir.name}{TEMP_MARKER}{uuid.uuid4().hex[:12]}")
        staging.mkdir()
        try:
            yield staging
            fsync_dir(staging)
            _publish(staging, out_dir, markers, overwrite, what)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise


def output_lock(out_dir: Path, what: str) -> WriterLock:
    """The writer lock of ``out_dir``: ``.<name>.lock`` next to it, present only while held."""
    return WriterLock(out_dir.with_name(f".{out_dir.name}.lock"), f"writing a {what} to {out_dir}")


def check_destination(out_dir: Path, markers: Sequence[str], overwrite: bool, what: str) -> None:
    """FileExistsError unless ``out_dir`` is absent, empty, or (with ``overwrite``) a complete ``what``."""
    if not out_dir.exists() and not out_dir.is_symlink():
        return
    if not out_dir.is_dir():
        raise FileExistsError(f"{out_dir}: exists and is not a directory")
    if not any(out_dir.iterdir()):
        return
    if _is_complete(out_dir, markers):
        if overwrite:
            return
        raise FileExistsError(f"{out_dir}: already holds a complete {what}; pass --overwrite (overwrite=True) to replace it")
    raise FileExistsError(f"{out_dir}: exists, is not empty and is not a {what}; refusing to write there")


def _is_complete(directory: Path, markers: Sequence[str]) -> bool:
    return any((directory / marker).is_file() for marker in markers)


def _remove_stale_staging(out_dir: Path) -> None:
    """Staging directories of conversions to the same ``out_dir`` that died (call it holding
    the lock: every live conversion to ``out_dir`` holds it)."""
    for marker in (TEMP_MARKER, OLD_MARKER):
        prefix = f"{out_dir.name}{marker}"
        for entry in out_dir.parent.iterdir():
            if entry.name.startswith(prefix) and _UNIQUE.fullmatch(entry.name[len(prefix) :]) and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)


def _publish(staging: Path, out_dir: Path, markers: Sequence[str], overwrite: bool, what: str) -> None:
    check_destination(out_dir, markers, overwrite, what)
    moved_aside = None
    if out_dir.is_dir() and any(out_dir.iterdir()):
        moved_aside = out_dir.with_name(f"{out_dir.name}{OLD_MARKER}{staging.name[-12:]}")
        os.rename(out_dir, moved_aside)
    elif out_dir.is_dir():
        out_dir.rmdir()
    os.rename(staging, out_dir)
    fsync_dir(out_dir.parent)
    if moved_aside is not None:
        shutil.rmtree(moved_aside, ignore_errors=True)
